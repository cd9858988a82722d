"""``python -m matrixfsdp.train`` (the main job) at smoke size: outputs, bitwise resume, bad input.

Each command starts its own processes, so the tests share one uninterrupted reference run (module
fixture, the command run for real) and resume from copies of its folder. The other commands run
the command's ``main`` in this process, their ranks forked from the test harness's forkserver
(tests/_train_cli.py): the same rank code without a torch + matrixfsdp import per command.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _train_cli import train_in_process

from matrixfsdp.train import main

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ["--model", "nano", "--steps", "6", "--ckpt-every", "3", "--eval-every", "3", "--sample-bytes", "8",
         "--max-corpus-bytes", "200000", "--threads", "1"]
RUNS = ("matrixfsdp-muon", "fsdp2-adamw")


def train(*args: str, check: bool = True, real: bool = False) -> subprocess.CompletedProcess:
    """``python -m matrixfsdp.train *args``: run as typed (``real``), else in this process
    (``train_in_process``, see the module docstring)."""
    if real:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        res = subprocess.run([sys.executable, "-m", "matrixfsdp.train", *args], capture_output=True, text=True,
                             timeout=300, env=env, cwd=ROOT)
    else:
        res = train_in_process(*args)
    if check:
        assert res.returncode == 0, res.stdout + res.stderr
    return res


def records(out: Path, run: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"{run}.jsonl").read_text().splitlines()]


def comparable(recs: list[dict]) -> list[dict]:
    """Everything but timings and the header: what a resumed run must reproduce bit for bit."""
    drop = {"tokens_per_s", "step_s", "wall_s_this_process", "resumed_from"}
    return [{k: v for k, v in r.items() if k not in drop} for r in recs if not r.get("header")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train") / "ref"
    res = train(*SMOKE, "--out", str(out), real=True)
    (out / "stdout.txt").write_text(res.stdout)
    return out


def test_outputs(reference):
    out = reference
    for run in RUNS:
        recs = records(out, run)
        assert recs[0]["header"] and recs[0]["world_size"] == 2 and recs[0]["corpus"]["files"] >= 10
        steps = [r for r in recs if "loss" in r]
        assert [r["step"] for r in steps] == list(range(1, 7))
        assert {"loss", "lr", "grad_norm", "tokens_per_s"} <= set(steps[0])
        assert steps[-1]["loss"] < steps[0]["loss"]
        assert [r["step"] for r in recs if "heldout_loss" in r and not r.get("final")] == [3, 6]
        final = recs[-1]
        assert final["final"] and final["heldout_loss"] > 0 and final["sample"].startswith("def ")
        assert sorted(p.name for p in (out / "ckpt" / run).iterdir()) == [
            "step-000003", "step-000003.json", "step-000006", "step-000006.json"]
    bytes_ = [r["comm_bytes"] for r in records(out, "matrixfsdp-muon") if "comm_bytes" in r]
    assert all(b["forward"] > 0 and b["backward"] > 0 and b["optimizer_step"] == 0 for b in bytes_)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    stdout = (out / "stdout.txt").read_text()
    assert "matrixfsdp-muon: 6 steps at W=2" in stdout and "held-out loss" in stdout


def interrupted_copy(reference: Path, dst: Path, *, compare_started: bool) -> Path:
    """``reference`` as a run interrupted after step 3..5 would have left it: the step-6
    checkpoint never written, the log running past step 3 (and, unless ``compare_started``,
    no trace of the compare run)."""
    shutil.copytree(reference, dst)
    for run in RUNS:
        kept = [line for line in (dst / f"{run}.jsonl").read_text().splitlines()
                if json.loads(line).get("step", 0) <= 5 and not json.loads(line).get("final")]
        (dst / f"{run}.jsonl").write_text("".join(line + "\n" for line in kept))
        (dst / "ckpt" / run / "step-000006.json").unlink()
        shutil.rmtree(dst / "ckpt" / run / "step-000006")
    (dst / "loss.png").unlink()
    if not compare_started:
        (dst / "fsdp2-adamw.jsonl").unlink()
        shutil.rmtree(dst / "ckpt" / "fsdp2-adamw")
    return dst


def test_resume_is_bitwise_at_the_same_world_size(reference, tmp_path):
    out = interrupted_copy(reference, tmp_path / "resumed", compare_started=False)
    res = train(*SMOKE, "--out", str(out), "--resume")
    for run in RUNS:
        assert comparable(records(out, run)) == comparable(records(reference, run)), run
    assert records(out, RUNS[0])[-1]["resumed_from"] == 3 and records(out, RUNS[1])[-1]["resumed_from"] == 0
    assert (out / "loss.png").exists() and "matrixfsdp-muon: 6 steps at W=2" in res.stdout


def test_resume_with_more_steps_trains_on(reference, tmp_path):
    """``--resume --steps 8`` after a finished 6-step run trains steps 7 and 8 (it used to exit 0
    with the 6-step summary); the first 6 steps stay bitwise, the schedule keeps the first run's
    end (the extra steps run at its floor, 0.1x), and a changed setting is still refused."""
    out = tmp_path / "more"
    shutil.copytree(reference, out)
    res = train(*[a if a != "6" else "8" for a in SMOKE], "--out", str(out), "--resume", "--no-compare")
    assert "resuming from step 6 to step 8" in res.stdout and "matrixfsdp-muon: 8 steps at W=2" in res.stdout
    got, ref = records(out, RUNS[0]), records(reference, RUNS[0])
    steps = [r for r in got if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert comparable([r for r in got if r.get("step", 0) <= 6 and not r.get("final")]) == \
        comparable([r for r in ref if not r.get("final")])
    assert [r["lr"] for r in steps[6:]] == pytest.approx([0.1 * 0.02] * 2)
    assert got[-1]["final"] and got[-1]["step"] == 8 and got[-1]["lr_schedule_steps"] == 6
    assert sorted(p.name for p in (out / "ckpt" / RUNS[0]).iterdir())[-1] == "step-000008.json"


@pytest.mark.parametrize("argv, msg", [
    (["--lr", "0.05"], "was written by another configuration; --lr was None, now 0.05"),
    (["--steps", "4"], "is at step 6, past --steps 4; pass --steps 6 or more"),
])
def test_resume_of_a_finished_run_still_checks_the_configuration(reference, tmp_path, argv, msg):
    out = tmp_path / "finished"
    shutil.copytree(reference, out)
    before = (out / f"{RUNS[0]}.jsonl").read_bytes()
    res = train(*SMOKE, "--out", str(out), "--resume", *argv, check=False)
    assert res.returncode == 2 and msg in res.stderr, res.stdout + res.stderr
    assert (out / f"{RUNS[0]}.jsonl").read_bytes() == before


def test_resume_at_another_world_size(reference, tmp_path):
    out = interrupted_copy(reference, tmp_path / "w1", compare_started=True)
    train(*SMOKE, "--out", str(out), "--resume", "--world", "1", "--sample-bytes", "0")
    got, ref = records(out, RUNS[0]), records(reference, RUNS[0])
    assert got[-1]["world_size"] == 1 and got[-1]["resumed_from"] == 3
    ref_losses = [r["loss"] for r in ref if "loss" in r]
    losses = [r["loss"] for r in got if "loss" in r]
    assert losses[:3] == ref_losses[:3]  # the W=2 steps, kept
    assert losses[3:] == pytest.approx(ref_losses[3:], rel=1e-5)  # summed in another order
    assert got[-1]["heldout_loss"] == pytest.approx(ref[-1]["heldout_loss"], rel=1e-5)


@pytest.mark.parametrize("argv, msg", [
    (["--world", "3"], "error: --world 3 must divide --batch 16"),
    (["--world", "0"], "--world must be >= 1, got 0"),
    (["--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
    (["--steps", "ten"], "--steps must be an integer, got 'ten'"),
    (["--world", "4", "--replicas", "3"], "error: --replicas 3 must divide --world 4"),
    (["--replicas", "0"], "--replicas must be >= 1, got 0"),
    (["--replica-step", "half"], "argument --replica-step: invalid choice: 'half'"),
    (["--resume"], "error: --resume: no checkpoint of run 'matrixfsdp-muon'"),
    (["--resume", "--overwrite"], "error: --resume and --overwrite exclude each other"),
    (["--stop-after", "9", "--steps", "5"], "error: --stop-after 9 must be below --steps 5"),
    (["--qk-clip", "0"], "error: --qk-clip must be a positive number, got 0.0"),
    (["--per-head", "--optimizer", "shampoo"],
     "error: --per-head is per-head Muon: it needs --optimizer muon, got --optimizer shampoo"),
])
def test_bad_arguments(argv, msg, tmp_path, capsys):
    try:
        status = main(["--out", str(tmp_path / "o"), *argv])
    except SystemExit as e:  # argparse
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_existing_run_is_not_overwritten(reference, tmp_path, capsys):
    before = (reference / "matrixfsdp-muon.jsonl").read_bytes()
    assert main([*SMOKE, "--out", str(reference)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (reference / "matrixfsdp-muon.jsonl").read_bytes() == before


def test_damaged_checkpoint_is_a_clear_error_and_loses_nothing(reference, tmp_path):
    out = tmp_path / "damaged"
    shutil.copytree(reference, out)
    shard = out / "ckpt" / "matrixfsdp-muon" / "step-000006" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    (out / "matrixfsdp-muon.jsonl").write_text((out / "matrixfsdp-muon.jsonl").read_text()
                                               .replace('"final": true', '"final_": true'))
    log = (out / "matrixfsdp-muon.jsonl").read_bytes()
    res = train(*SMOKE, "--out", str(out), "--resume", check=False)
    assert res.returncode == 2, res.stderr
    assert "error: --resume: cannot load" in res.stderr and "step-000006" in res.stderr
    assert "Traceback" not in res.stderr
    assert (out / "matrixfsdp-muon.jsonl").read_bytes() == log  # untouched

    (out / "ckpt" / "matrixfsdp-muon" / "step-000006.json").write_text("{not json")
    assert main([*SMOKE, "--out", str(out), "--resume"]) == 2


HSDP = ["--model", "nano", "--steps", "4", "--ckpt-every", "2", "--eval-every", "4", "--sample-bytes", "0",
        "--max-corpus-bytes", "200000", "--threads", "1", "--world", "4", "--no-compare"]
# The flat and the HSDP runs compute the same global-batch gradient; only the order of the float32
# sums differs (4 ranks in one reduce-scatter vs. pairs within a shard group, then across the 2
# replicas): a few ulp (~1e-7 relative) per step, which 4 Muon steps carry to about 1e-7 in the
# losses (measured 1.0e-7). 1e-5 is the tolerance the W=2 -> 1 resume above uses, 100x that.
HSDP_RTOL = 1e-5


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in records(out, RUNS[0]) if "loss" in r]


def test_replicas_hsdp_matches_flat_and_resumes_across_meshes(tmp_path):
    """``--world 4 --replicas 2``: a (2, 2) HSDP mesh, logged in the header, the checkpoint state
    and on stdout; the losses are the flat ``--world 4`` run's. A flat checkpoint resumes on the
    HSDP mesh (``--replica-step repeat``; DCP reshards 1x4 -> 2x2) and continues as the flat run."""
    flat, hsdp = tmp_path / "flat", tmp_path / "hsdp"
    train(*HSDP, "--out", str(flat))
    res = train(*HSDP, "--out", str(hsdp), "--replicas", "2", "--replica-step", "split")
    head = records(hsdp, RUNS[0])[0]
    assert head["mesh"] == {"dim_names": ["dp_replicate", "dp_shard"], "shape": [2, 2], "replica_step": "split"}
    assert head["config"]["replicas"] == 2 and records(flat, RUNS[0])[0]["mesh"]["shape"] == [4]
    assert "matrixfsdp-muon: W=4 on mesh (dp_replicate=2, dp_shard=2), replica_step split" in res.stdout
    assert "4 steps at W=4 on mesh (dp_replicate=2, dp_shard=2)" in res.stdout
    state = json.loads((hsdp / "ckpt" / RUNS[0] / "step-000004.json").read_text())
    assert state["mesh"]["shape"] == [2, 2]
    assert all(b["optimizer_step"] == 0 for b in (r["comm_bytes"] for r in records(hsdp, RUNS[0]) if "comm_bytes" in r))
    ref = _losses(flat)
    assert len(ref) == 4 and ref[-1] < ref[0]
    assert _losses(hsdp) == pytest.approx(ref, rel=HSDP_RTOL)
    assert records(hsdp, RUNS[0])[-1]["heldout_loss"] == pytest.approx(records(flat, RUNS[0])[-1]["heldout_loss"],
                                                                     rel=HSDP_RTOL)

    # The flat run as if interrupted after step 2..3, resumed on the (2, 2) mesh.
    resumed = tmp_path / "resumed"
    shutil.copytree(flat, resumed)
    log = resumed / f"{RUNS[0]}.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()
                           if json.loads(line).get("step", 0) <= 3 and not json.loads(line).get("final")))
    (resumed / "ckpt" / RUNS[0] / "step-000004.json").unlink()
    shutil.rmtree(resumed / "ckpt" / RUNS[0] / "step-000004")
    (resumed / "loss.png").unlink()
    res = train(*HSDP, "--out", str(resumed), "--resume", "--replicas", "2", "--replica-step", "repeat")
    assert "resuming from step 2" in res.stdout
    got = records(resumed, RUNS[0])
    assert got[-1]["resumed_from"] == 2 and got[-1]["mesh"]["shape"] == [2, 2]
    assert _losses(resumed)[:2] == ref[:2]  # the flat steps, kept
    assert _losses(resumed)[2:] == pytest.approx(ref[2:], rel=HSDP_RTOL)


def test_tiny_moe_trains_and_resumes(tmp_path):
    """``--model tiny-moe``: a Qwen3-MoE-style decoder (8 experts, fused gate_up) trained by
    matrixfsdp + Muon (expert stacks owned whole per rank, stepped per expert) next to FSDP2 +
    AdamW: losses fall, the step communicates nothing, and a resume from the step-3 checkpoint
    (per-expert optimizer state included) reproduces the run bitwise."""
    # 4 x 32 bytes a step (the default 16 x 128 cost ~4 s CPU more per command for nothing pinned here)
    argv = ["--model", "tiny-moe", "--steps", "6", "--ckpt-every", "3", "--eval-every", "6", "--sample-bytes", "0",
            "--max-corpus-bytes", "200000", "--threads", "1", "--batch", "4", "--seq-len", "32"]
    ref = tmp_path / "ref"
    train(*argv, "--out", str(ref))
    recs = records(ref, "matrixfsdp-muon")
    steps = [r for r in recs if "loss" in r]
    assert recs[0]["model_params"] == 1447296 and steps[-1]["loss"] < steps[0]["loss"]
    assert all(r["comm_bytes"]["optimizer_step"] == 0 for r in recs if "comm_bytes" in r)
    out = tmp_path / "resumed"
    shutil.copytree(ref, out)
    for run in RUNS:
        kept = [line for line in (out / f"{run}.jsonl").read_text().splitlines()
                if json.loads(line).get("step", 0) <= 3 and not json.loads(line).get("final")]
        (out / f"{run}.jsonl").write_text("".join(line + "\n" for line in kept))
        (out / "ckpt" / run / "step-000006.json").unlink()
        shutil.rmtree(out / "ckpt" / run / "step-000006")
    train(*argv, "--out", str(out), "--resume")
    for run in RUNS:
        assert comparable(records(out, run)) == comparable(records(ref, run)), run


def test_qk_clip_and_per_head_muon(tmp_path):
    """``--qk-clip TAU``: QK-clip after every step of the matrixfsdp run (its one MAX all-reduce is
    the step's only collective, counted with the model's), each step's max logit in the log;
    ``--per-head`` (one run with both: each costs a training run) plans and steps the q/k/v
    projections per head, recorded in the config and the checkpoint's optimizer state."""
    out = tmp_path / "qk"
    train("--model", "nano", "--steps", "3", "--eval-every", "3", "--ckpt-every", "3", "--sample-bytes", "0",
          "--max-corpus-bytes", "200000", "--threads", "1", "--no-compare", "--qk-clip", "1.0", "--per-head",
          "--out", str(out))
    recs = records(out, "matrixfsdp-muon")
    assert recs[0]["config"]["qk_clip"] == 1.0 and recs[0]["config"]["per_head"] is True
    saved = [f for f in (out / "ckpt" / "matrixfsdp-muon").rglob("*") if f.is_file()]
    assert any(b"muon:heads/4" in f.read_bytes() for f in saved)  # the param groups' routes
    steps = [r for r in recs if "loss" in r]
    assert len(steps) == 3 and all(0 < r["max_logit"] < 1e3 for r in steps), steps
    assert all(r["comm_calls"]["optimizer_step"] == 1 for r in steps), [r["comm_calls"] for r in steps]


def test_help_says_each_default_once():
    """``--help`` printed "(default: per --optimizer, above) (default: None)" and the like."""
    import re

    from matrixfsdp.train.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    for opt in re.findall(r"\s(--[a-z-]+) [A-Z_]+ ", text):  # options taking a value
        entry = text.split(f" {opt} ", 2)[-1].split(" --", 1)[0]
        assert entry.count("default") <= 1, (opt, entry)
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: 200)" in text  # --steps
