"""The prepared GPU check (``benchmarks/gpu/check.py``, issues 19 and 29) and the NCCL sweep
(``benchmarks/gpu/nccl_sweep.py``) in CI, without a GPU: the check's dry run of its CUDA path on
the CPU (every part, gloo, tiny sizes) inside its time budget, with the figures each part must
produce; the sweep's gloo smoke at W=2 (flat, HSDP and TP meshes against the unsharded reference)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu" / "check.py"
SWEEP = ROOT / "benchmarks" / "gpu" / "nccl_sweep.py"
sys.path.insert(0, str(CHECK.parent))
check = pytest.importorskip("check")
sweep = pytest.importorskip("nccl_sweep")
# the parts' helpers, from the package beside check.py (importing check put its folder on sys.path)
kernels = pytest.importorskip("check_parts.kernels")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("OUT", None)
    env.pop("MATRIXFSDP_CHECK_STEPS", None)
    return env


def test_part_limits_fit_the_budgets():
    assert sum(check.LIMITS.values()) <= check.BUDGET_S == 360
    assert sum(check.QUICK_LIMITS.values()) <= check.QUICK_BUDGET_S == 180
    assert set(check.LIMITS) == set(check.QUICK_LIMITS) == set(check.PARTS) | {"race_sanitizer"}


def test_dry_run_of_the_cuda_path_on_the_cpu(tmp_path):
    """``--device cpu --quick --inline``: every part runs its CUDA path on the CPU, passes what the
    CPU can check, and the whole run stays inside the quick budget (3 minutes)."""
    proc = subprocess.run([sys.executable, str(CHECK), "--device", "cpu", "--quick", "--inline", "--out", str(tmp_path)],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cuda"] is False and summary["within_budget"], summary
    assert summary["wall_s"] <= check.QUICK_BUDGET_S
    assert set(summary["parts"]) == set(check.PARTS), summary["parts"]
    assert all(v.startswith("dry-run passed") for v in summary["parts"].values()), summary["parts"]
    # rows were appended as produced, each part's and a result row per part
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert {r["part"] for r in rows if r.get("kind") == "result"} == set(check.PARTS)
    assert "| part | status | key figure | what it shows | what it cannot show |" in (tmp_path / "summary.md").read_text()

    race = json.loads((tmp_path / "race.json").read_text())
    # the hook made the W=1 group call its backend; without it nothing reached it; same bits
    assert race["pg_calls"]["plain"] > 0 and race["pg_calls"]["no hook"] == 0, race["pg_calls"]
    assert race["hook_equals_no_hook_bitwise"] and race["update_rel_err_vs_unsharded"] < race["tolerance"], race
    smoke = json.loads((tmp_path / "smoke.json").read_text())
    assert all(v == "ok" or v.startswith("skipped") for v in smoke["checks"].values()), smoke["checks"]
    # what one device cannot show, measured: the (1,1) meshes run without the replica phase / TP host step
    assert smoke["shown_on_one_device"] == {"hsdp_replica_phase": False, "tp_host_step": False}, smoke
    sync = json.loads((tmp_path / "sync_debug.json").read_text())["results"]
    assert sync["Muon unused find_unused=True"]["flag_reads"] == 3, sync
    assert sync["Muon find_unused=False"]["flag_reads"] == 0, sync
    assert sync["Shampoo find_unused=False"]["eigh_calls"] > 0, sync
    kernels = [r for r in rows if r["part"] == "kernels" and r.get("how", "").startswith("batched compiled")]
    assert kernels and all(r["compiled"] and r["frames_compiled"] == 1 for r in kernels), kernels
    comp = json.loads((tmp_path / "compile.json").read_text())["results"]["compiled"]
    assert comp["frames"] <= 2 and comp["max_rel_diff_vs_eager"] <= 1e-6 and comp["lr_device"] == "cpu", comp


def test_rows_are_written_when_produced_and_a_timeout_keeps_them(tmp_path):
    import torch

    ctx = check.Ctx(torch.device("cpu"), "gloo", True, tmp_path, "race")
    ctx.row(run="a", x=1)
    assert json.loads((tmp_path / "rows.jsonl").read_text())["run"] == "a"  # on disk before the part ends
    ctx.row(run="b")
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 2
    assert check._status({"ok": False}, 124, False) == "TIMEOUT (rows kept)"
    assert check._status({"ok": True}, 0, True) == "dry-run passed"
    assert kernels.bf16_peak("NVIDIA H100 80GB HBM3") == 989.0 and kernels.bf16_peak("NVIDIA H200") == 989.0
    assert kernels.bf16_peak("NVIDIA A10G") is None
    assert kernels.ns_flops(1, 2, 3) == 5 * (4 * 2 * 2 * 3 + 2 * 8)


def test_gpu_check_rejects_unknown_parts(tmp_path):
    proc = subprocess.run([sys.executable, str(CHECK), "--out", str(tmp_path), "--parts", "race,bogus"],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2 and "unknown part" in proc.stderr, proc.stderr


def test_nccl_sweep_requires_the_flight_recorder_dump(monkeypatch, capsys):
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    with pytest.raises(SystemExit) as e:
        sweep.main(["--backend", "nccl"])
    assert e.value.code == 2 and "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in capsys.readouterr().err


def test_nccl_sweep_gloo_smoke_at_w2(tmp_path):
    """The sweep's CPU form: flat, HSDP (2,1) both step modes and TP (1,2) against the reference."""
    proc = subprocess.run([sys.executable, str(SWEEP), "--backend", "gloo", "--spawn", "2", "--steps", "2",
                           "--out", str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["mesh"] for r in rows] == ["flat", "hsdp-repeat", "hsdp-split", "tp"]
    for r in rows:
        assert r["ok"] and r["world"] == 2 and r["grad0"] <= sweep.GRAD_TOL and r["param"] <= sweep.PARAM_TOL, r
