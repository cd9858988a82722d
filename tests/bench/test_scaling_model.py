"""benchmarks/scaling_model.py's HSDP rows (issue 17) on one Qwen3 preset: structural invariants of
the model (no result numbers pinned), and the CLI's outputs, so the script cannot rot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
    # per rank, split sends T - c_k + (R-1) c_k for its replica's share c_k of T (whole matrices,
    # uneven across replicas): the replica stepping the most sends at least the all-reduce's
    assert sp.xbytes_rank_max >= rep.xbytes_rank_max * (1 - 1e-12)
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


# ---------------------------------------------------------------- TP rows (issue 18)


def _tp_rows(dp, optimizer="muon", **kw):
    rows = sm.simulate_tp(PRESET, dp, optimizer, **kw)
    by = {r.impl: r for r in rows}
    assert set(by) == set(sm.TP_IMPLS)
    return by


@pytest.mark.parametrize("optimizer", ["muon", "soap"])
@pytest.mark.parametrize("dp", [1, 4])
def test_tp_invariants(dp, optimizer):
    by = _tp_rows(dp, optimizer)
    tp = sm.HW.node
    mg, seq, unf = by["mf_tp_microgroups"], by["mf_tp_fused_seq"], by["mf_tp_unfused"]
    red, red_f, dm, dm_mean = by["tp_redundant"], by["tp_redundant_fsdp"], by["tp_distmuon"], by["tp_distmuon_mean"]
    tol = 1 + 1e-12
    assert all(r.dp == dp and r.tp == tp and r.world == dp * tp for r in by.values())
    # issue 18's structure: one host per matrix beats stepping it everywhere; fused <= unfused;
    # pipelined <= sequential
    assert mg.step_ms <= red.step_ms * tol and mg.step_ms <= red_f.step_ms * tol
    assert mg.step_ms <= seq.step_ms * tol <= unf.step_ms * tol * tol
    assert unf.collectives >= seq.collectives == mg.collectives == 2 * mg.groups
    # FSDP on the DP side only adds a gather; the mean-bytes DistMuon reading is its lower bound
    assert red_f.step_ms >= red.step_ms and dm_mean.step_ms <= dm.step_ms * tol
    # the redundant rows step every matrix on every rank; the hosted step is at least the bound
    assert red.compute_ms == pytest.approx(red_f.compute_ms)
    assert mg.compute_ms * dp * tp >= red.compute_ms * (1 - 1e-9)
    assert red.compute_ms <= red.step_ms * tol
    for r in (mg, seq, unf):
        assert r.step_ms >= r.compute_ms * (1 - 1e-12)
        assert r.flops_max_avg >= 1 - 1e-12 and r.flops_max_avg_naive >= 1 - 1e-12
        assert r.host_makespan_bound >= 1 - 1e-12 and r.tp_flops_max_avg >= 1 - 1e-12
    if dp == 1:  # one owner group: no DP imbalance, the mesh ratio is the TP ratio
        assert mg.dp_max_mean == 1.0 and mg.flops_max_avg == pytest.approx(mg.tp_flops_max_avg)
        assert red_f.step_ms == pytest.approx(red.step_ms)


def test_tp_pipelining_with_several_micro_groups():
    by = _tp_rows(1, "muon", c_max=2 * 2**20)  # a small capacity: many micro-groups
    mg, seq = by["mf_tp_microgroups"], by["mf_tp_fused_seq"]
    assert mg.groups > 1
    assert mg.step_ms < seq.step_ms  # later groups' gathers hide under earlier groups' compute


def test_tp_micro_groups_and_lpt():
    items = [(f"m{i}", float((i * 37) % 11 + 1), float((i * 13) % 7 + 1)) for i in range(40)]
    tp, c_max = 4, 6.0
    groups = sm.tp_micro_groups(items, tp, c_max)
    flat = [it for g in groups for it, _ in g]
    assert sorted(flat) == sorted(items)  # every item once
    assert flat == sorted(items, key=lambda it: (-it[1], it[0]))  # in LPT order
    for g in groups:
        held = [0.0] * tp
        for (_, _, nb), h in g:
            assert 0 <= h < tp
            held[h] += nb
        assert max(held) <= max(c_max, g[0][0][2])
    assert sm.tp_micro_groups(items, tp, c_max) == groups  # deterministic
    costs = [it[1] for it in items]
    host, loads = sm.lpt_hosts(costs, tp)
    assert sum(loads) == pytest.approx(sum(costs))
    assert max(loads) <= sum(costs) / tp + max(costs)  # Graham's list-scheduling bound


def test_tp_cli_outputs(tmp_path):
    out = tmp_path / "tp"
    rc = sm.main(["--tp", "--models", PRESET, "--dps", "1", "2", "--optimizers", "muon", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in open(f"{out}.jsonl")]
    assert {r["impl"] for r in rows} == set(sm.TP_IMPLS) and {r["dp"] for r in rows} == {1, 2}
    md = open(f"{out}.md").read()
    assert md.startswith("<!-- produced by: python benchmarks/scaling_model.py --tp")
    assert "check mf_tp_microgroups <= tp_redundant" in md
    assert Path(f"{out}.png").stat().st_size > 0
    res, _ = sm.check_tp([sm.TRow(**r) for r in rows])
    passed, points, fails = res["muon"]["structural"]
    assert points == 2 and passed == 2 and not fails
    with pytest.raises(SystemExit):
        sm.main(["--tp", "--hsdp"])
