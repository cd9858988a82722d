"""The prepared GPU check (``benchmarks/gpu/check.py``, issue 19) runs its CPU-runnable parts in
CI: without CUDA it says so, runs the fully_shard parity under the stream-delay patch (no streams
on the CPU) and the smoke of every API that touches collectives under gloo at W=1, reports the
GPU-only parts as skipped and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA this is the full GPU check: run it directly")
def test_gpu_check_runs_cpu_parts_and_skips_the_rest(tmp_path):
    env = dict(os.environ, MATRIXFSDP_CHECK_STEPS="3",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "check.py"), "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cuda"] is False
    parts = summary["parts"]
    assert parts["race"] == "passed" and parts["smoke"] == "passed", parts
    for p in ("sync_debug", "kernels", "memory", "compile"):
        assert parts[p] == "skipped: needs a CUDA GPU", parts
    smoke = json.loads((tmp_path / "smoke.json").read_text())
    assert smoke["backend"] == "gloo"
    names = " ".join(smoke["checks"])
    for api in ("fully_shard[all_to_all]", "fully_shard[p2p]", "fully_shard[two_phase]",
                "replicate[stage=1]", "replicate[stage=2]", "hf save_pretrained"):
        assert api in names, smoke["checks"]
    assert all(v == "ok" or v.startswith("skipped") for v in smoke["checks"].values()), smoke["checks"]
    race = json.loads((tmp_path / "race.json").read_text())
    assert race["delayed_equals_plain_bitwise"] and race["worst_rel_err_vs_unsharded"] < 1e-5, race


def test_gpu_check_rejects_unknown_parts(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / "check.py"), "--out", str(tmp_path),
                           "--parts", "race,bogus"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode == 2 and "unknown part" in proc.stderr, proc.stderr
