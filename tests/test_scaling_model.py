"""benchmarks/scaling_model.py's HSDP rows (issue 17) on one Qwen3 preset: structural invariants of
the model (no result numbers pinned), and the CLI's outputs, so the script cannot rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sm = pytest.importorskip("scaling_model")

PRESET = "qwen3-0.6b"


def _rows(W, optimizer="muon", regime="weak"):
    rows = sm.simulate_hsdp(PRESET, W, optimizer, regime, flat=False)
    by = {r.impl: r for r in rows}
    assert set(by) == set(sm.HSDP_IMPLS)
    return by


@pytest.mark.parametrize("optimizer", ["muon", "soap"])
@pytest.mark.parametrize("W", [8, 64])
def test_split_invariants(W, optimizer):
    by = _rows(W, optimizer)
    sp, rep, ad, dm = by["mf_split"], by["mf_repeat"], by["hsdp_adamw"], by["hsdp_distmuon"]
    R = W // 8
    assert sp.replicas == R and sp.shard == 8
    # the split step runs each matrix once across the replicas: never slower than repeating it
    assert sp.step_ms <= rep.step_ms * (1 + 1e-12)
    # bytes across replicas: split's RS + AG (and HSDP's all-reduce of the element-wise rest)
    # equal the all-reduce of what each rank holds, i.e. repeat's, and over the group HSDP's
    assert sp.xbytes_rank == pytest.approx(ad.xbytes_rank, rel=1e-12)
    assert sp.xbytes_rank == pytest.approx(rep.xbytes_rank, rel=1e-12)
    assert sp.xbytes_rank_max == pytest.approx(rep.xbytes_rank_max, rel=1e-12)
    assert dm.xbytes_rank == ad.xbytes_rank
    # optimizer state: split keeps each matrix's state on one replica only
    assert sp.state_bytes_rank <= rep.state_bytes_rank
    # forward/backward is what the rows share: same compute, so a row's total is at least it
    for r in by.values():
        assert r.total_ms == pytest.approx(r.fwd_bwd_ms + r.step_ms)
        assert 0 < r.step_share < 1
    if R == 1:  # one replica: split is repeat, nothing crosses replicas
        assert (sp.step_ms, sp.total_ms, sp.xbytes_rank) == (rep.step_ms, rep.total_ms, 0.0)
    else:
        assert sp.step_ms < rep.step_ms and sp.state_bytes_rank < rep.state_bytes_rank


def test_strong_scaling_share_grows_with_W():
    worlds = (16, 64, 256)
    rows = {W: _rows(W, "muon", "strong") for W in worlds}
    for W in worlds:
        assert rows[W]["mf_split"].tokens_per_rank == sm.STRONG_GLOBAL_TOKENS // W
    # the repeated steps (total/S) stay put while fwd/bwd shrinks with the per-rank batch
    for impl in ("hsdp_distmuon", "mf_repeat"):
        shares = [rows[W][impl].step_share for W in worlds]
        assert shares == sorted(shares) and shares[0] < shares[-1], (impl, shares)
    weak = _rows(64, "muon", "weak")["mf_split"]
    assert weak.tokens_per_rank == sm.HW.tokens_per_rank


def test_cli_outputs_and_check(tmp_path):
    out = tmp_path / "hsdp"
    rc = sm.main(["--hsdp", "--models", PRESET, "--worlds", "8", "16", "--optimizers", "muon",
                  "--regime", "strong", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in open(f"{out}.jsonl")]
    impls = {(r["mesh"], r["impl"]) for r in rows}
    assert {("hsdp", i) for i in sm.HSDP_IMPLS} | {("flat", i) for i in sm.FLAT_IMPLS} == impls
    md = open(f"{out}.md").read()
    assert md.startswith("<!-- produced by: python benchmarks/scaling_model.py --hsdp")
    assert "check mf_split <= hsdp_distmuon (total and step), muon strong:" in md
    assert Path(f"{out}.png").stat().st_size > 0
    res, lines = sm.check_split([sm.HRow(**r) for r in rows])
    (passed, points, fails), = res.values()
    assert points == 2 and passed + len(fails) == points


def test_flat_mode_rejects_sweeps():
    with pytest.raises(SystemExit):
        sm.main(["--optimizers", "muon", "soap"])
