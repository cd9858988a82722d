"""One rank's sharding work does not grow with the world size (issue 44), counted, not timed.

Before, ``fully_shard`` built one piece, one receive-buffer view and one copy pair per (evenly
sharded parameter, rank), and the plan's row ranges W at a time: sharding one rank of the tiny
preset made 19,811 tensor ops at W=1024 against 7,460 at W=64 (541,541 Python calls against
135,672); sharding Qwen3-8B took 3x longer at W=4096 than at W=1024. Now a block is cut into spans
of alike ranks ([Note: spans] in ``engine/layout.py``): the counts at W=1024 are those at W=64,
up to a per-model term (the plan-digest agreement decodes one entry per rank once).

Runs rank 0 through the dry run (``run_rank``: the real planner, ``fully_shard`` and
``to_empty`` on torch's fake process group), in a process of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = r"""
import json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import matrixfsdp._fully_shard as FS
from matrixfsdp._fully_shard.api import MatrixFSDPModule
from matrixfsdp.dryrun import preset_builder
from matrixfsdp.dryrun.rank import run_rank

class Ops(TorchDispatchMode):
    n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Ops.n += 1
        return func(*args, **(kwargs or {}))

calls = [0]
def profile(frame, event, arg):
    if event == "call":
        calls[0] += 1

def counted(fn):
    def run(*a, **k):
        sys.setprofile(profile)
        try:
            with Ops():
                return fn(*a, **k)
        finally:
            sys.setprofile(None)
    return run

FS.fully_shard = counted(FS.fully_shard)  # run_rank calls it through the package
MatrixFSDPModule.to_empty = counted(MatrixFSDPModule.to_empty)
out = {}
for W in (64, 1024):
    Ops.n, calls[0] = 0, 0
    run_rank(preset_builder("tiny", torch.float32), name="tiny", world_size=W, rank=0, role="rank0", steps=0)
    out[W] = {"ops": Ops.n, "calls": calls[0]}
print(json.dumps(out))
"""


def test_sharding_one_rank_does_not_grow_with_the_world_size():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    got = {int(w): v for w, v in json.loads(res.stdout.splitlines()[-1]).items()}
    small, large = got[64], got[1024]
    assert small["ops"] > 100 and small["calls"] > 1000, got  # the counters saw the sharding
    # 16x the ranks: tensor ops (views, slices, copies, allocations) and Python calls stay within
    # a quarter of W=64's (measured: 1,701 vs 2,142 ops, 57,433 vs 55,344 calls; 2.7x and 4.0x before)
    assert large["ops"] <= 1.25 * small["ops"], got
    assert large["calls"] <= 1.25 * small["calls"], got
