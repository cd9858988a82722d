"""Planner tests for expert stacks: hypothesis properties on random MoE-like models (every expert
placed once, contiguous rows, digests, JSON, balance against the bound), the two baselines of
[Note: expert baselines], digests pinned across the planner's speed-ups, and planning (its time
measured, not bounded) and quality on the real MoE presets."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from matrixfsdp import MatrixRule, OwnerPlan, plan_owners
from matrixfsdp.models.decoder import PRESETS, Decoder, DecoderLayer
from matrixfsdp.models.moe import MOE_PRESETS, MoEDecoder, MoEDecoderLayer
from matrixfsdp.planner.expert_baselines import (BASELINES, chunked_counts, expert_baseline, expert_matrices_per_rank,
                                        round_robin_counts)


# ------------------------------------------------------------------------------------ models
class FusedExperts(nn.Module):
    """Hugging Face's layout: ``gate_up_proj [E, 2F, D]`` (``splits`` matrices per expert by the
    rule's ``fused``), ``down_proj [E, D, F]``."""

    def __init__(self, E: int, D: int, F: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F, D, device="meta"))
        self.down_proj = nn.Parameter(torch.empty(E, D, F, device="meta"))


class GroupedExperts(nn.Module):
    """torchtitan's layout, registered in ``order`` (names kept)."""

    def __init__(self, E: int, D: int, F: int, order: list[str]) -> None:
        super().__init__()
        shapes = {"w1": (E, F, D), "w2": (E, D, F), "w3": (E, F, D)}
        for name in order:
            self.register_parameter(name, nn.Parameter(torch.empty(*shapes[name], device="meta")))


class Router(nn.Module):
    def __init__(self, E: int, D: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, D, device="meta"))


class Layer(nn.Module):
    """A norm, two attention-like matrices and ``len(moes)`` MoE modules (router + experts)."""

    def __init__(self, D: int, A: int, moes: list[tuple[int, int, bool]], order: list[str]) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.empty(D, device="meta"))
        self.q = nn.Parameter(torch.empty(A, D, device="meta"))
        self.o = nn.Parameter(torch.empty(D, A, device="meta"))
        self.moes = nn.ModuleList()
        for E, F, fused in moes:
            moe = nn.Module()
            moe.router = Router(E, D)
            moe.experts = FusedExperts(E, D, F) if fused else GroupedExperts(E, D, F, order)
            self.moes.append(moe)


class Net(nn.Module):
    def __init__(self, spec: dict, perm_seed: int | None = None) -> None:
        super().__init__()
        rng = random.Random(perm_seed)
        order = ["w1", "w2", "w3"]
        idx = list(range(spec["L"]))
        if perm_seed is not None:  # registration order permuted, names kept
            rng.shuffle(order)
            rng.shuffle(idx)
        self.emb = nn.Embedding(spec["vocab"], spec["D"], device="meta")
        self.layers = nn.ModuleList()
        for i in idx:
            self.layers.add_module(str(i), Layer(spec["D"], spec["A"], spec["moes"], order))


@st.composite
def moe_specs(draw, experts_at_least_ranks: bool = False):
    """A random MoE-like model and world size: 1-4 layers, 1-2 MoE modules per layer of E experts
    (fused or not), attention-like matrices, an evenly sharded embedding (vocab above every row
    count, so no matrix is taken for an output head)."""
    W = draw(st.integers(1, 12))
    lo = W if experts_at_least_ranks else 1
    D = draw(st.sampled_from([8, 16, 32, 48]))
    moes = draw(st.lists(st.tuples(st.integers(lo, max(lo, 40)), st.sampled_from([4, 8, 16, 24]), st.booleans()),
                         min_size=1, max_size=2))
    return dict(W=W, D=D, A=D * draw(st.sampled_from([1, 2])), L=draw(st.integers(1, 4)), moes=moes,
                vocab=draw(st.integers(200, 300)))


def _rule(splits: int) -> MatrixRule:
    return MatrixRule(fused=(("gate_up_proj", splits),))


def _plan(spec: dict, splits: int = 2, perm_seed: int | None = None, **kw) -> OwnerPlan:
    return plan_owners(Net(spec, perm_seed), kw.pop("world", spec["W"]), block_types=Layer,
                       matrix_rule=_rule(splits), **kw)


SLOW = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------ properties
@settings(max_examples=40, **SLOW)
@given(spec=moe_specs(), splits=st.sampled_from([1, 2, 4]))
def test_every_expert_placed_once_in_contiguous_rows(spec, splits):
    W = spec["W"]
    model = Net(spec)
    plan = plan_owners(model, W, block_types=Layer, matrix_rule=_rule(splits))
    assert sorted(p.fqn for p in plan.params) == sorted(n for n, _ in model.named_parameters())
    stacks = [p for p in plan.params if p.placement == "experts"]
    assert len(stacks) == spec["L"] * sum(2 if fused else 3 for _, _, fused in spec["moes"])
    for p in stacks:
        E = p.shape[0]
        assert p.owner is None and len(p.experts) == W and sum(p.experts) == E and min(p.experts) >= 0
        assert p.splits == (splits if p.fqn.endswith("gate_up_proj") else 1)
        rows = [p.local_rows(r, W) for r in range(W)]
        assert rows[0][0] == 0 and rows[-1][1] == E  # the ranks' ranges tile [0, E) in rank order
        assert all(rows[r][1] == rows[r + 1][0] for r in range(W - 1))
        assert all(b - a == n for (a, b), n in zip(rows, p.experts))
        assert [p.local_shape(r, W) for r in range(W)] == [(n, *p.shape[1:]) for n in p.experts]
        assert sum(p.share(r, W) for r in range(W)) == pytest.approx(1.0)
    assert sum(plan.expert_matrices) == sum(p.shape[0] * p.splits for p in stacks)
    assert plan.cost_imbalance >= plan.cost_imbalance_bound - 1e-9  # the bound stays a bound
    assert plan.bytes_imbalance >= plan.bytes_imbalance_bound - 1e-9


@settings(max_examples=25, **SLOW)
@given(spec=moe_specs(), seed=st.integers(0, 1000))
def test_digest_stable_and_invariant_under_registration_order(spec, seed):
    a, again = _plan(spec), _plan(spec)
    permuted = _plan(spec, perm_seed=seed)
    assert a == again == permuted and a.digest == again.digest == permuted.digest


@settings(max_examples=25, **SLOW)
@given(spec=moe_specs(), splits=st.sampled_from([1, 2, 4]))
def test_json_round_trip_and_digest_covers_expert_counts(spec, splits):
    plan = _plan(spec, splits)
    back = OwnerPlan.from_json(plan.to_json())
    assert back == plan and back.digest == plan.digest
    assert [(p.experts, p.splits) for p in back.params] == [(p.experts, p.splits) for p in plan.params]
    if spec["W"] < 2:
        return
    # one expert moved to another rank: another plan, another digest, and a file saying otherwise is refused
    stack = next(p for p in plan.params if p.placement == "experts")
    src = next(r for r, n in enumerate(stack.experts) if n)
    counts = list(stack.experts)
    counts[src] -= 1
    counts[(src + 1) % spec["W"]] += 1
    moved = dataclasses.replace(stack, experts=tuple(counts))
    other = dataclasses.replace(plan, params=tuple(moved if p is stack else p for p in plan.params))
    assert other.digest != plan.digest
    forged = other.to_json().replace(other.digest, plan.digest)
    with pytest.raises(ValueError, match="OwnerPlan.from_json: digest mismatch"):
        OwnerPlan.from_json(forged)


# Measured before stating it, on 4,000 random models of moe_specs(experts_at_least_ranks=True)
# (2,000 with 1-4 layers, 2,000 with 2-4; W up to 12): cost_imbalance / cost_imbalance_bound was
# at most 1.52 (median 1.01, 90th percentile 1.14, 99th 1.33), so the stated ratio is 1.75, not
# the 1.10 hoped for. The bound looks at cost alone; the plan also keeps every block's byte share
# per rank under its cap (gamma_B at its lower bound) and balances bytes. On small random blocks a
# dense matrix nearly fills a rank's share of its block, so the experts that rank cannot take
# pile up elsewhere and the cost spreads unevenly: a worst case (W=7, one layer, q and o [48, 48]
# (3.3 MFLOP each, a third of a rank's byte share), 54 expert matrices [16, 48]) is within a few
# percent of the best plan under those caps. On the real presets (W = 8 to 1024) the ratio is at
# most 1.03 (test_real_presets_near_their_bounds).
RANDOM_COST_RATIO = 1.75


@settings(max_examples=40, **SLOW)
@given(spec=moe_specs(experts_at_least_ranks=True))
def test_cost_imbalance_within_stated_ratio_of_its_bound(spec):
    plan = _plan(spec)
    assert plan.cost_imbalance <= RANDOM_COST_RATIO * plan.cost_imbalance_bound + 1e-9


@settings(max_examples=40, **SLOW)
@given(E=st.integers(1, 60), W=st.integers(1, 16), F=st.sampled_from([4, 6, 8]))
def test_a_lone_stack_spreads_its_experts_within_one(E, W, F):
    """A block holding one stack only: whole experts, so ``E mod W`` ranks hold one more (and with
    E < W, W - E ranks hold none); never more than one apart."""

    class Only(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = GroupedExperts(E, 8, F, ["w1"])

    model = nn.Sequential(Only())
    plan = plan_owners(model, W, block_types=Only)
    (p,) = plan.params
    assert max(p.experts) - min(p.experts) <= 1
    assert sum(n == 0 for n in p.experts) == max(0, W - E)


def test_fewer_experts_than_ranks_leaves_ranks_to_dense_matrices():
    """E = 3 on W = 8: at most three ranks hold experts of a stack; the dense matrices go to the
    others, and every rank carries load."""
    spec = dict(W=8, D=32, A=64, L=2, moes=[(3, 16, False)], vocab=250)
    plan = _plan(spec)
    for p in plan.params:
        if p.placement == "experts":
            assert sum(n > 0 for n in p.experts) <= 3 and sum(p.experts) == 3
    free = [r for r, n in enumerate(plan.expert_matrices) if n == 0]
    assert free, plan.expert_matrices
    assert all(plan.owned_by(r) for r in free)  # ranks without experts own dense matrices
    assert min(s.cost for s in plan.rank_stats) > 0


# ------------------------------------------------------------------------------------ baselines
def test_baseline_counts_hand_checked():
    assert round_robin_counts(10, 4) == (3, 3, 2, 2)
    assert chunked_counts(10, 4) == (3, 3, 3, 1)  # torch.chunk: ceil(10/4) = 3 per rank while they last
    assert chunked_counts(5, 4) == (2, 2, 1, 0)
    assert round_robin_counts(3, 8) == chunked_counts(3, 8) == (1, 1, 1, 0, 0, 0, 0, 0)
    assert round_robin_counts(128, 8) == chunked_counts(128, 8) == (16,) * 8
    assert set(BASELINES) == {"round_robin", "chunked"}


@settings(max_examples=100, deadline=None)
@given(E=st.integers(1, 300), W=st.integers(1, 64))
def test_baseline_counts_are_torch_chunk_and_modulo(E, W):
    chunks = [len(c) for c in torch.arange(E).chunk(W)]
    assert chunked_counts(E, W) == tuple(chunks + [0] * (W - len(chunks)))
    assert round_robin_counts(E, W) == tuple(torch.bincount(torch.arange(E) % W, minlength=W).tolist())


@pytest.mark.parametrize("fn", [round_robin_counts, chunked_counts])
@pytest.mark.parametrize("args, what", [((0, 4), "num_experts=0"), ((4, 0), "world_size=0"),
                                        ((True, 4), "num_experts=True"), ((4, 2.0), "world_size=2.0")])
def test_baseline_counts_bad_input(fn, args, what):
    name = what.split("=")[0]
    with pytest.raises(ValueError, match=rf"^{fn.__name__}: {name} must be an int >= 1, got {what}$"):
        fn(*args)


def test_expert_baseline_hand_checked():
    """One block with a stack of E=5 experts [2, 2] (fp32: 16 B and Newton-Schulz
    5 * (4*4*2 + 2*8) = 240 FLOPs each), one block with a dense [8, 8] matrix (256 B,
    5 * (4*64*8 + 2*512) = 15360 FLOPs), W = 4. The dense matrix goes to the least loaded rank
    around the baseline's experts."""

    class A(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = GroupedExperts(5, 2, 2, ["w1"])

    class B(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(8, 8, device="meta"))

    plan = plan_owners(nn.Sequential(A(), B()), 4, block_types=(A, B))
    rr = expert_baseline(plan.params, 4, "round_robin")  # experts (2, 1, 1, 1): the matrix to rank 1
    assert rr.expert_matrices == (2, 1, 1, 1)
    assert rr.nbytes == (32, 16 + 256, 16, 16) and rr.cost == (480, 240 + 15360, 240, 240)
    ch = expert_baseline(plan.params, 4, "chunked")  # experts (2, 2, 1, 0): the matrix to rank 3
    assert ch.expert_matrices == (2, 2, 1, 0)
    assert ch.nbytes == (32, 32, 16, 256) and ch.cost == (480, 480, 240, 15360)
    assert rr.expert_imbalance == ch.expert_imbalance == pytest.approx(2 / (5 / 4))
    assert rr.cost_imbalance == pytest.approx(15600 / (16560 / 4))
    assert ch.bytes_imbalance == pytest.approx(256 / (336 / 4))
    s = plan.summary()
    assert s["cost_imbalance_round_robin"] == rr.cost_imbalance and s["bytes_imbalance_chunked"] == ch.bytes_imbalance
    # the plan itself keeps block A's byte share per rank under its cap max(16 B, 80 B / 4): one
    # expert per rank, the dense matrix's rank included, and the fifth where the cap breaks least
    assert sorted(plan.expert_matrices) == [1, 1, 1, 2] and s["expert_imbalance"] == pytest.approx(1.6)
    # five whole experts on four ranks: some rank holds 2 x 16 B of block A's 80 B, gamma 1.6, for all three
    assert s["max_gamma_ratio"] == s["max_gamma_ratio_chunked"] == s["max_gamma_ratio_round_robin"] == pytest.approx(1.6)
    with pytest.raises(ValueError, match=r"^expert_baseline: name must be one of \('round_robin', 'chunked'\), "
                                         r"got name='ep'$"):
        expert_baseline(plan.params, 4, "ep")


EXPERT_KEYS = {"expert_stacks", "expert_matrices", "expert_matrices_min", "expert_matrices_max", "expert_imbalance",
               *(f"{m}_{b}" for m in ("expert_imbalance", "cost_imbalance", "bytes_imbalance", "max_gamma_ratio")
                 for b in BASELINES)}


def test_summary_and_report_show_experts_only_for_moe_plans():
    with torch.device("meta"):
        dense = plan_owners(Decoder(PRESETS["tiny"]), 3, block_types=DecoderLayer)
        moe = plan_owners(MoEDecoder(MOE_PRESETS["tiny-moe"]), 3, block_types=MoEDecoderLayer)
    assert not EXPERT_KEYS & set(dense.summary()) and dense.expert_baselines == {}
    assert not dense.has_experts and dense.expert_imbalance == 1.0
    assert "experts" not in dense.report()
    assert "\n  rank  owned   param bytes   +state bytes        cost  owns\n" in dense.report()
    s = moe.summary()
    assert EXPERT_KEYS <= set(s)
    # tiny-moe: 4 layers x (gate_up: 2 matrices, down: 1) x 8 experts
    assert s["expert_stacks"] == 8 and s["expert_matrices"] == 4 * 3 * 8
    assert s["expert_matrices_min"] == min(moe.expert_matrices) and s["expert_matrices_max"] == max(moe.expert_matrices)
    assert moe.expert_matrices == expert_matrices_per_rank(moe.params, 3)
    report = moe.report()
    assert "experts: 8 stacks, 96 expert matrices" in report
    assert "round-robin (expert e on rank e mod W)" in report and "chunked (torch.chunk homes, as EP)" in report
    assert "\n  rank  owned  experts   param bytes   +state bytes        cost  owns\n" in report
    lines = report.splitlines()
    head = lines.index("  rank  owned  experts   param bytes   +state bytes        cost  owns")
    assert [int(line.split()[2]) for line in lines[head + 1:head + 4]] == list(moe.expert_matrices)


# ------------------------------------------------------------------------------------ pinned digests
def test_dense_and_moe_digests_pinned():
    """``OwnerPlan.digest`` is a public contract. Computed at 53945ec, before the planner's expert
    speed-ups (planner/balance.py): dense plans, and MoE plans too, are the same plans. The bf16
    plans were re-pinned when Muon/AdamW state started to be sized in the parameter's dtype (as
    the optimizers keep it; it was float32): every owner the same, only ``state_nbytes`` halved."""
    with torch.device("meta"):
        tiny = Decoder(PRESETS["tiny"])
        big = Decoder(PRESETS["qwen3-32b"]).to(torch.bfloat16)
        tiny_moe = MoEDecoder(MOE_PRESETS["tiny-moe"])
        qwen3_moe = MoEDecoder(MOE_PRESETS["qwen3-30b-a3b"]).to(torch.bfloat16)
    assert plan_owners(tiny, 3, block_types=DecoderLayer).digest == \
        "5aa485b5e56a0d01c62ad8b9da2315e3dcaf28553a03ba9d796257684df9ca0f"
    assert plan_owners(tiny, 5, block_types=DecoderLayer, cost="bytes", optimizer="shampoo").digest == \
        "514807f9402fc5b9949f286c6e03785845ca385267556facc2a7bf9f52dec384"
    # W=1024: owning every matrix puts 4.1x an even share on one rank, so the default plan hosts
    # matrices (placement="auto", planner/hosting.py); the owned plan keeps its digest
    assert plan_owners(big, 1024, block_types=DecoderLayer, placement="owned").digest == \
        "6c846156c9140d6e0dedc8d64bb801cb76413dd162942590e6311037b0507973"
    auto = plan_owners(big, 1024, block_types=DecoderLayer)
    assert auto.num_hosted > 0 and auto.digest != "6c846156c9140d6e0dedc8d64bb801cb76413dd162942590e6311037b0507973"
    assert plan_owners(tiny_moe, 3, block_types=MoEDecoderLayer).digest == \
        "dbde6476b666eb932d62710ab9c72bd1e073d25df6af3fcaa33f113219d10b68"
    assert plan_owners(qwen3_moe, 64, block_types=MoEDecoderLayer).digest == \
        "1ae00771fe901e0f0a2e056737805aa5f5b9559d36e44edf46fe370ad757c663"


# ------------------------------------------------------------------------------------ real presets
@pytest.fixture(scope="module")
def moe_presets():
    with torch.device("meta"):
        return {k: MoEDecoder(MOE_PRESETS[k]).to(torch.bfloat16) for k in ("qwen3-30b-a3b", "deepseek-v3")}


@pytest.mark.parametrize("W", [8, 1024])
def test_qwen3_30b_a3b_plans(moe_presets, W):
    """12,288 expert roles (48 layers x 2 stacks x 128 experts) next to 240 dense matrices.
    Measured on this 2-core machine: about 0.5 s at W=8 and 1 s at W=1024 (39 s at W=1024 before
    MULTIFIT's first fit resumed each role signature's scan). No bound on the time (issue 42: no
    wall-clock assertion in the suite): a regression shows in the suite's time."""
    plan = plan_owners(moe_presets["qwen3-30b-a3b"], W, block_types=MoEDecoderLayer)
    assert sum(plan.expert_matrices) == 48 * 128 * 3


@pytest.mark.parametrize("name, W, experts_rr", [("qwen3-30b-a3b", 1024, 8.0), ("deepseek-v3", 1024, 4.0),
                                                 ("qwen3-30b-a3b", 64, 1.0), ("deepseek-v3", 8, 1.0)])
def test_real_presets_near_their_bounds(moe_presets, name, W, experts_rr):
    """The plan's cost is within 5% of its bound (measured: at most 1.029), and at W > E it spreads
    the experts where both baselines leave W - E ranks without any (expert imbalance W / E)."""
    plan = plan_owners(moe_presets[name], W, block_types=MoEDecoderLayer)
    s = plan.summary()
    assert s["cost_imbalance"] <= 1.05 * s["cost_imbalance_bound"]
    assert s["expert_imbalance_round_robin"] == s["expert_imbalance_chunked"] == pytest.approx(experts_rr)
    assert s["expert_imbalance"] <= 1.2
    if experts_rr > 1:
        assert s["cost_imbalance"] < s["cost_imbalance_round_robin"] / 3
