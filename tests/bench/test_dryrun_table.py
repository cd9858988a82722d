"""benchmarks/dryrun_table.py and scaling_model.rank_bytes against the real code (issue 28): on
the tiny preset, the bytes the scaling model prices for the sampled rank are exactly what its dry
run sends, per phase, on a flat mesh with hosted matrices, on an HSDP mesh with split steps and on
a (dp, tp) mesh with TP host steps.

The table's cells (a ``python -m matrixfsdp.dryrun`` command each) run in this process, their
ranks forked from the harness's forkserver (``_dryrun_cli.py``); the command itself is tested as
run in tests/dryrun/test_dryrun.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _dryrun_cli import in_process_subprocess

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
dt = pytest.importorskip("dryrun_table")


def test_the_scaling_model_prices_exactly_what_the_dry_run_sends(tmp_path, monkeypatch):
    monkeypatch.setattr(dt, "subprocess", in_process_subprocess(monkeypatch))
    out = tmp_path / "table"
    assert dt.main(["--models", "tiny", "--worlds", "64", "--roles", "most_loaded", "rank0",
                    "--out", str(out), "--timeout", "600"]) == 0
    lines = out.with_suffix(".jsonl").read_text().splitlines()
    rows = [dt.with_model(json.loads(x)) for x in lines[1:]]
    assert {(r["world"], r["replicas"], r["tp"]) for r in rows} == {(64, 1, 1), (64, 8, 1), (64, 1, 8)}
    for r in rows:
        for ph in dt.PHASES:
            # exact but for the all-reduce's whole-byte count per call (one per block)
            assert abs(r["measured"][ph] - r["model_bytes"][ph]) <= 5, (r["replicas"], ph, r["measured"], r["model_bytes"])
    flat = [r for r in rows if r["replicas"] == r["tp"] == 1]
    hsdp = [r for r in rows if r["replicas"] == 8]
    tp = [r for r in rows if r["tp"] == 8]
    # the cells exercise what the model prices: hosted steps (flat), traffic across replicas (HSDP),
    # the TP host step of the owners' tensor-parallel matrices (TP)
    assert any(r["measured"]["step"] > 0 for r in flat)
    assert all(r["measured"]["across"] > 0 and r["measured"]["step"] == 0 for r in hsdp)
    assert all(r["measured"]["step"] > 0 and set(r["comm"]["step"]) == {"all_to_all_single"} for r in tp)
    md = out.with_suffix(".md").read_text()
    assert "| tiny | 8 x 8 | most_loaded |" in md and "1.000" in md
    # a second call resumes: nothing is run again
    assert dt.main(["--models", "tiny", "--worlds", "64", "--out", str(out)]) == 0
    assert out.with_suffix(".jsonl").read_text().splitlines() == lines
