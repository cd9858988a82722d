"""The prepared GPU check (``benchmarks/gpu/check.py``, issues 19, 29 and 40) and the NCCL sweep
(``benchmarks/gpu/nccl_sweep.py``) in CI, without a GPU: the check's dry run of its CUDA path on
the CPU (the driver and one worker process, every part, gloo, tiny sizes) inside its limits, with
the figures each part must produce and the results folder the GPU machine can return (at most 8
files, safe names); a part past its limit killed and the rest run; the sweep's gloo smoke at W=2
(flat, HSDP and TP meshes against the unsharded reference)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
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
race_mod = pytest.importorskip("check_parts.race")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("OUT", None)
    env.pop("MATRIXFSDP_CHECK_STEPS", None)
    return env


def test_part_limits_fit_one_cold_device_command():
    """Each mode's part limits plus the start-ups they pay fit its budget, and the budgets leave the
    device's 10-minute command a margin (issue 40: one command on a cold machine)."""
    for limits, budget in ((check.LIMITS, check.BUDGET_S), (check.QUICK_LIMITS, check.QUICK_BUDGET_S)):
        assert check.DRIVER_START_S + check.STARTUP_S + sum(limits.values()) <= budget <= check.DEVICE_COMMAND_S - 60
        assert set(limits) == set(check.PARTS)
    assert check.DRY_BUDGET_S >= check.DRIVER_START_S + check.DRY_STARTUP_S + sum(check.DRY_LIMITS.values())
    assert check.PARTS[0] == "preflight" and check.PARTS[-1] == "race_sanitizer"  # first; the sanitizer cannot be undone
    assert all(check.SAFE_NAME.match(n) for n in check.RESULT_FILES) and len(check.RESULT_FILES) + 1 <= 8


def _results(out: Path, tmp: Path) -> dict:
    """The folder's files (at most 8, safe names: what the GPU machine returns), unpacked archive."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files), files
    assert sorted(p.name for p in files) == sorted(check.RESULT_FILES), files
    with tarfile.open(out / check.ARCHIVE) as tar:
        tar.extractall(tmp, filter="data")
    parts = tmp / "gpu-check" / "parts"
    return {p.stem: json.loads(p.read_text()) for p in parts.glob("*.json")}


def test_dry_run_of_the_cuda_path_on_the_cpu(tmp_path):
    """``--device cpu``: the driver and one worker process, as on the GPU; every part runs its CUDA
    path on the CPU, passes what the CPU can check, within its own limit and the dry budget; the
    results folder holds 4 files with safe names, the archive everything."""
    out = tmp_path / "out"
    # the README's form: from the repository root with a relative PYTHONPATH=src
    proc = subprocess.run([sys.executable, "benchmarks/gpu/check.py", "--device", "cpu", "--out", str(out)],
                          env=dict(_env(), PYTHONPATH="src"), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"results in {out}" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cuda"] is False and summary["mode"] == "dry" and summary["within_budget"], summary
    assert set(summary["parts"]) == set(check.PARTS), summary["parts"]
    assert summary["parts"].pop("race_sanitizer") == "skipped: needs CUDA"
    assert all(v == "dry-run passed" for v in summary["parts"].values()), summary["parts"]
    for row in summary["table"]:
        assert row["wall_s"] is None or row["wall_s"] <= row["limit_s"], row
    res = _results(out, tmp_path)
    # rows were appended as produced, and a result row per part
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert {r["part"] for r in rows if r.get("kind") == "result"} == set(check.PARTS)
    assert "| part | status | key figure |" in (out / "summary.md").read_text()

    pre = res["preflight"]
    assert pre["from_tree"] and pre["versions"]["torch"] and pre["event_wait_probe"]["status"].startswith("skipped")
    assert {"process_start_s", "torch_import_s", "import_matrixfsdp_s", "gloo_w1_init_first_collective_s"} <= set(
        pre["startup"]), pre["startup"]
    race = res["race"]
    # the hook made the W=1 group call its backend; without it nothing reached it; same bits;
    # the hand-written bf16 mirror is the same arithmetic: bitwise on the CPU
    assert race["pg_calls"]["plain"] > 0 and race["pg_calls"]["no hook"] == 0, race["pg_calls"]
    assert race["hook_equals_no_hook_bitwise"] and race["vs_unsharded"]["bf16"]["bitwise"], race
    assert race["tolerance"] == race_mod.race_tolerance(race["steps"]) > race["update_rel_err_vs_unsharded"], race
    smoke = res["smoke"]
    assert all(v == "ok" or v.startswith("skipped") for v in smoke["checks"].values()), smoke["checks"]
    # what one device cannot show, measured: the (1,1) meshes run without the replica phase / TP host step
    assert smoke["shown_on_one_device"] == {"hsdp_replica_phase": False, "tp_host_step": False}, smoke
    sync = res["sync_debug"]["results"]
    assert sync["Muon unused find_unused=True"]["flag_reads"] == 3, sync
    assert sync["Muon find_unused=False"]["flag_reads"] == 0, sync
    assert sync["Shampoo find_unused=False"]["eigh_calls"] > 0, sync
    assert res["memory"]["models_freed"] == {"fsdp2": True, "matrixfsdp": True, "matrixfsdp+hook": True}
    kern = [r for r in rows if r["part"] == "kernels" and r.get("how", "").startswith("batched compiled")]
    assert kern and all(r["compiled"] and r["frames_compiled"] == 1 for r in kern), kern
    comp = res["compile"]["results"]["compiled"]
    assert 1 <= comp["frames"] <= 2 and comp["max_rel_diff_vs_eager"] <= 1e-6 and comp["lr_device"] == "cpu", comp


def test_a_part_past_its_limit_is_killed_and_the_rest_runs_in_a_new_worker(tmp_path):
    """The driver's clock: ``memory`` given 0.01 s is killed with its worker (TIMEOUT), ``kernels``
    then runs in a fresh worker; the folder still holds only the check's files."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(CHECK), "--device", "cpu", "--out", str(out), "--parts",
                           "memory,kernels", "--limit", "memory=0.01"],
                          env={k: v for k, v in _env().items() if k != "PYTHONPATH"}, capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)  # no PYTHONPATH, elsewhere: check.py finds its src itself
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parts"] == {"preflight": "dry-run passed", "memory": "TIMEOUT (rows kept)",
                                "kernels": "dry-run passed"}, summary["parts"]
    assert "not passed: ['memory']" in proc.stdout
    res = _results(out, tmp_path)
    assert res["memory"]["status"] == "TIMEOUT (rows kept)" and res["kernels"]["ok"], res


def test_results_default_to_a_git_ignored_folder(monkeypatch):
    """Without ``$OUT`` (and ``--out``) results land under ``runs/``, which git ignores (issue 43)."""
    monkeypatch.delenv("OUT", raising=False)
    out = check.default_out()
    assert out.relative_to(ROOT).parts[:2] == ("runs", "gpu-check"), out
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    probe = subprocess.run(["git", "check-ignore", "-q", str(out / "summary.json")], cwd=ROOT)
    assert probe.returncode == 0, f"{out} is not ignored by git"
    monkeypatch.setenv("OUT", "/x/y")
    assert check.default_out() == Path("/x/y")


def test_rows_are_written_when_produced(tmp_path):
    import torch

    ctx = check.Ctx(torch.device("cpu"), "gloo", True, tmp_path, "race")
    ctx.row(run="a", x=1)
    assert json.loads((tmp_path / "rows.jsonl").read_text())["run"] == "a"  # on disk before the part ends
    ctx.row(run="b")
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 2
    assert kernels.bf16_peak("NVIDIA H100 80GB HBM3") == 989.0 and kernels.bf16_peak("NVIDIA H200") == 989.0
    assert kernels.bf16_peak("NVIDIA A10G") is None
    assert kernels.ns_flops(1, 2, 3) == 5 * (4 * 2 * 2 * 3 + 2 * 8)
    # the race tolerance grows with the steps and stays below 1 (a garbage run's error)
    assert race_mod.race_tolerance(3) == pytest.approx(0.2) and race_mod.race_tolerance(20) == pytest.approx(0.625)
    with pytest.raises(ValueError, match="race_tolerance: steps must be 1..34"):
        race_mod.race_tolerance(40)


def test_gpu_check_rejects_unknown_parts(tmp_path):
    proc = subprocess.run([sys.executable, str(CHECK), "--out", str(tmp_path), "--parts", "race,bogus"],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2 and "unknown part" in proc.stderr, proc.stderr


def test_nccl_sweep_requires_the_flight_recorder_dump(monkeypatch, capsys):
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    with pytest.raises(SystemExit) as e:
        sweep.main(["--backend", "nccl"])
    assert e.value.code == 2 and "TORCH_NCCL_DUMP_ON_TIMEOUT=1" in capsys.readouterr().err


def test_nccl_sweep_gloo_smoke_at_w2(tmp_path, monkeypatch):
    """The sweep's CPU form: flat, HSDP (2,1) both step modes and TP (1,2) against the reference.
    Its ``main`` runs in this process (its two ranks are spawned, as from the command line); what
    it sets process-wide (the ranks' PYTHONPATH, this tree's src on sys.path) is put back after."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    assert sweep.main(["--backend", "gloo", "--spawn", "2", "--steps", "2", "--out", str(tmp_path)]) == 0
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["mesh"] for r in rows] == ["flat", "hsdp-repeat", "hsdp-split", "tp"]
    for r in rows:
        assert r["ok"] and r["world"] == 2 and r["grad0"] <= sweep.GRAD_TOL and r["param"] <= sweep.PARAM_TOL, r
