"""A program may exit right after matrixfsdp's last collective (a caught checkpoint error, a
finished save): gloo must hold no Python tensor by then (see [Note: collectives right before exit]
in ``matrixfsdp/_checkpoint.py``; before the fix ~1 in 6 such runs died with SIGABRT at exit)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from _harness import get_pool

ROOT = Path(__file__).resolve().parents[2]


def _gather(rank_msgs):
    import torch.distributed as dist

    from matrixfsdp.comm.agree import all_gather_strings

    return all_gather_strings(rank_msgs[dist.get_rank()])


def test_all_gather_strings():
    msgs = [None, "ValueError|a longer message, non-ascii: é", "RuntimeError|x"]
    assert get_pool(3).run(_gather, msgs) == [msgs] * 3


# The ranks exit as torch.multiprocessing's spawned ranks do (multiprocessing's spawn: the
# interpreter finalizes after the function returns); the parent starts them with the standard
# library alone, so it pays no torch import (~2 s CPU a run): only the ranks' exits are under test.
SCRIPT = textwrap.dedent('''
    import multiprocessing as mp, os, sys, tempfile

    def worker(rank, W, store, missing):
        import torch, torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store, W), rank=rank, world_size=W)
        import matrixfsdp
        from torch.distributed.device_mesh import init_device_mesh
        model = matrixfsdp.Decoder(matrixfsdp.PRESETS["tiny"])
        mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("dp_shard",))
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(matrixfsdp.DecoderLayer,))
        for layer in model.model.layers:
            matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
        opt = matrixfsdp.optim.Muon(model.parameters(), lr=0.02, ns_dtype=torch.float32)
        model(torch.randint(0, 512, (2, 16))).sum().backward()
        opt.step()
        try:
            matrixfsdp.checkpoint.load(missing, model, opt)
        except FileNotFoundError:
            pass  # and exit at once, without destroy_process_group

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        with tempfile.TemporaryDirectory() as tmp:
            ranks = [ctx.Process(target=worker, args=(r, 2, os.path.join(tmp, "s"), os.path.join(tmp, "missing")))
                     for r in range(2)]
            for p in ranks:
                p.start()
            for p in ranks:
                p.join()
        sys.exit(f"rank exit codes {[p.exitcode for p in ranks]}" if any(p.exitcode for p in ranks) else 0)
''')


def test_exit_right_after_a_caught_load_error(tmp_path):
    (tmp_path / "repro.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    for _ in range(3):
        res = subprocess.run([sys.executable, str(tmp_path / "repro.py")], capture_output=True, text=True,
                             timeout=120, env=env)
        assert res.returncode == 0 and "terminate called" not in res.stderr, res.stderr[-2000:]
