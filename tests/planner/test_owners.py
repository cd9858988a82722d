"""Planner tests: exact hand-checked plans, hypothesis invariants, bad input, preset quality."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import matrixfsdp
from matrixfsdp import OwnerPlan, plan_owners
from matrixfsdp.models.decoder import PRESETS, Decoder, DecoderLayer
from matrixfsdp.planner.owner_plan import _tight_lower_bound, even_rows


class Block(nn.Module):
    def __init__(self, shapes: list[tuple[int, int]], norm: int = 0, order: list[int] | None = None) -> None:
        super().__init__()
        # ``order`` permutes the registration order while keeping names (w{i} has shapes[i])
        for i in order if order is not None else range(len(shapes)):
            self.register_parameter(f"w{i}", nn.Parameter(torch.empty(*shapes[i], device="meta")))
        if norm:
            self.norm = nn.Parameter(torch.empty(norm, device="meta"))


class Net(nn.Module):
    def __init__(self, blocks: list[Block], emb: tuple[int, int] | None = None) -> None:
        super().__init__()
        if emb:
            self.emb = nn.Embedding(*emb, device="meta")
        self.blocks = nn.ModuleList(blocks)


# ------------------------------------------------------------------------------------ exact plans
def test_hand_checked_balanced_plan():
    # One block, four matrices with NS cost in ratio: 8x8 -> 5*(4*512+2*512)=15360, 4x8 -> 3840,
    # 4x4 -> 1920, 2x2 -> 240; W=2. LPT: A(8x8)->r0, then B,C,D to r1 (r1 never catches r0).
    # The block cap is max(largest=256 B, total/W) so A may not share r0 with more than... A is
    # 256 B of 416 B: r0 holds A (256 B, cap 256) and everything else goes to r1 (160 B).
    model = Net([Block([(8, 8), (4, 8), (4, 4), (2, 2)], norm=2)])
    plan = plan_owners(model, 2, block_types=Block)
    owners = {p.fqn: p.owner for p in plan.params}
    assert owners == {
        "blocks.0.w0": 0,
        "blocks.0.w1": 1,
        "blocks.0.w2": 1,
        "blocks.0.w3": 1,
        "blocks.0.norm": 1,
    }
    assert [p.placement for p in plan.params] == ["tail", "matrix", "matrix", "matrix", "matrix"]
    # gamma_B = 256 / (424 / 2) with bound W*largest/bytes = 2*256/424
    (b,) = plan.block_stats
    assert b.nbytes == 4 * (64 + 32 + 16 + 4 + 2)
    assert b.gamma == pytest.approx(256 * 2 / b.nbytes)
    assert b.gamma_lower_bound == pytest.approx(2 * 256 / b.nbytes)


def test_hand_checked_scope_and_role_greedy():
    model = Net([Block([(4, 4), (2, 4)]), Block([(4, 4), (2, 4)]), Block([(2, 2)])])
    scope = plan_owners(model, 2, block_types=Block, policy="scope_greedy")
    # scopes by bytes: blocks.0 (96 B) -> r0, blocks.1 (96 B) -> r1, blocks.2 (16 B) -> r0
    assert {p.fqn: p.owner for p in scope.params} == {
        "blocks.0.w0": 0, "blocks.0.w1": 0, "blocks.1.w0": 1, "blocks.1.w1": 1, "blocks.2.w0": 0,
    }
    role = plan_owners(model, 2, block_types=Block, policy="role_greedy")
    # per block: biggest role to the rank with least bytes in this block (ties: least overall)
    assert {p.fqn: p.owner for p in role.params} == {
        "blocks.0.w0": 0, "blocks.0.w1": 1, "blocks.1.w0": 1, "blocks.1.w1": 0, "blocks.2.w0": 0,
    }


def test_even_rows_match_torch_chunk():
    for n in range(0, 20):
        for W in range(1, 7):
            chunks = torch.arange(n).chunk(W) if n else ()
            expect = [(int(c[0]), int(c[-1]) + 1) for c in chunks if c.numel()]
            got = [even_rows(n, W, r) for r in range(W)]
            assert [g for g in got if g[1] > g[0]] == expect
            assert sum(b - a for a, b in got) == n


def test_elementwise_auto_shards_embedding_evenly_and_owns_norms():
    with torch.device("meta"):
        model = Decoder(PRESETS["qwen3-0.6b"])
    plan = plan_owners(model, 64, block_types=DecoderLayer)
    assert plan.owner_of("model.embed_tokens.weight") is None
    assert plan["model.embed_tokens.weight"].placement == "even"
    assert plan["model.layers.0.input_layernorm.weight"].placement == "tail"
    assert plan["model.layers.0.self_attn.q_proj.weight"].placement == "matrix"
    owned = plan_owners(model, 64, block_types=DecoderLayer, elementwise="owned")
    # owning the 151936 x 1024 embedding wrecks byte balance: measured, not assumed
    assert owned.bytes_imbalance > 10 * plan.bytes_imbalance


def test_tied_embedding_planned_once():
    with torch.device("meta"):
        model = Decoder(PRESETS["qwen3-0.6b"])
    plan = plan_owners(model, 8, block_types=DecoderLayer)
    assert "lm_head.weight" not in plan and "model.embed_tokens.weight" in plan


def test_meta_and_real_models_plan_identically():
    cfg = PRESETS["tiny"]
    torch.manual_seed(0)
    real = Decoder(cfg)
    with torch.device("meta"):
        meta = Decoder(cfg)
    assert plan_owners(real, 3, block_types=DecoderLayer).digest == plan_owners(meta, 3, block_types=DecoderLayer).digest


def test_mesh_argument_needs_1d_or_named_2d():
    from torch.distributed.device_mesh import DeviceMesh

    class FakeMesh(DeviceMesh):
        def __init__(self, ndim, size):  # no process group needed for the check
            self._nd, self._sz = ndim, size
            self._mesh_dim_names = None

        @property
        def ndim(self):
            return self._nd

        def size(self, dim=None):
            return self._sz

    model = Net([Block([(4, 4)])])
    assert plan_owners(model, FakeMesh(1, 3), block_types=Block).world_size == 3
    with pytest.raises(ValueError, match=r"plan_owners: mesh must be a 1-D mesh .* a 2-D HSDP mesh "
                                         r"\(dp_replicate, dp_shard\), .* got a 4-D mesh"):
        plan_owners(model, FakeMesh(4, 4), block_types=Block)
    with pytest.raises(ValueError, match=r"plan_owners: a 3-D mesh must be HSDP x TP with its dimensions named "
                                         r"\('dp_replicate', 'dp_shard', 'tp'\) in this order .* has dimension names none"):
        plan_owners(model, FakeMesh(3, 4), block_types=Block)
    with pytest.raises(ValueError, match=r"plan_owners: a 2-D \(HSDP\) mesh needs dimension names"):
        plan_owners(model, FakeMesh(2, 4), block_types=Block)


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(world_size_or_mesh=0), ValueError, r"plan_owners: world size must be >= 1, got world_size=0"),
        (dict(world_size_or_mesh=2.0), TypeError, r"must be an int, an \(replicas, shard\) pair, or a 1-D, 2-D \(dp_replicate, dp_shard\) or \(dp_shard, tp\), or 3-D \(dp_replicate, dp_shard, tp\) DeviceMesh, got float"),
        (dict(policy="lpt"), ValueError, r"plan_owners: policy must be one of .* got policy='lpt'"),
        (dict(cost="time"), ValueError, r"plan_owners: cost must be one of .* got cost='time'"),
        (dict(optimizer="sgd"), ValueError, r"plan_owners: optimizer must be one of .* got optimizer='sgd'"),
        (dict(elementwise="x"), ValueError, r"elementwise must be one of .* got elementwise='x'"),
        (dict(blocks=["nope"]), ValueError, r"plan_owners: block 'nope' is not a submodule of the model"),
        (dict(blocks=[nn.Linear(2, 2)]), ValueError, r"plan_owners: block Linear .* is not a submodule"),
        (dict(block_types=(nn.Conv2d,)), ValueError,
         r"^plan_owners: block_types must match at least one submodule of the model \(the repeated blocks to "
         r"wrap with fully_shard\), got block_types=\('Conv2d',\), which matches no module of Net$"),
        (dict(blocks=[], block_types=None), ValueError,
         r"^plan_owners: blocks must name at least one submodule \(the repeated blocks to wrap with "
         r"fully_shard\), got blocks=\[\] \(pass blocks=None to plan the root scope only\)$"),
        (dict(matrix_filter=lambda fqn, p: True), ValueError,
         r"matrix_filter selected 'blocks.0.norm', which is not 2D: got shape=\(4,\)"),
        (dict(cost=lambda info: -1.0), ValueError, r"must return a finite number >= 0, got -1.0"),
        (dict(policy="alpha_balanced", alpha=1.5), ValueError, r"alpha must be a number in \[0, 1\], got alpha=1.5"),
    ],
)
def test_bad_input_errors(kwargs, exc, match):
    model = Net([Block([(4, 4)], norm=4)])
    kw = dict(world_size_or_mesh=2, block_types=Block)
    kw.update(kwargs)
    W = kw.pop("world_size_or_mesh")
    with pytest.raises(exc, match=match):
        plan_owners(model, W, **kw)


def test_from_json_rejects_tampering():
    plan = plan_owners(Net([Block([(4, 4), (4, 2)])]), 2, block_types=Block, placement="owned")
    d = json.loads(plan.to_json())
    d["params"][0]["owner"] = 1 - d["params"][0]["owner"]
    with pytest.raises(ValueError, match="OwnerPlan.from_json: digest mismatch"):
        OwnerPlan.from_json(json.dumps(d))
    with pytest.raises(ValueError, match="expected plan format 1, got format=None"):
        OwnerPlan.from_json("{}")
    with pytest.raises(ValueError, match="OwnerPlan.from_json: malformed plan: KeyError"):
        OwnerPlan.from_json('{"format": 1}')


# ------------------------------------------------------------------------------------ properties
shape = st.tuples(st.integers(1, 48), st.integers(1, 48))
blocks_st = st.lists(
    st.tuples(st.lists(shape, min_size=0, max_size=5), st.integers(0, 16)), min_size=1, max_size=5
)


def _net(spec, perm_seed=None):
    import random

    rng = random.Random(perm_seed)
    blocks = []
    for shapes, norm in spec:
        order = list(range(len(shapes)))
        if perm_seed is not None:
            rng.shuffle(order)
        blocks.append(Block(list(shapes), norm, order))
    if perm_seed is not None:  # block registration order permuted too (names kept)
        idx = list(range(len(blocks)))
        rng.shuffle(idx)
        net = Net([], emb=(37, 8))
        for i in idx:
            net.blocks.add_module(str(i), blocks[i])
        return net
    return Net(blocks, emb=(37, 8))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=blocks_st, W=st.integers(1, 9), policy=st.sampled_from(["balanced", "role_greedy", "scope_greedy"]),
       elementwise=st.sampled_from(["auto", "owned", "even"]))
def test_every_param_planned_once_owners_in_range(spec, W, policy, elementwise):
    model = _net(spec)
    plan = plan_owners(model, W, block_types=Block, policy=policy, elementwise=elementwise)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(p.fqn for p in plan.params) == sorted(names)
    for p in plan.params:
        assert p.owner is None or 0 <= p.owner < W
        # the row segments of all ranks tile the parameter exactly once
        rows = [p.local_rows(r, W) for r in range(W)]
        n = p.shape[0] if p.shape else 1
        covered = sorted((a, b) for a, b in rows if b > a)
        assert sum(b - a for a, b in covered) == n
        assert all(covered[i][1] == covered[i + 1][0] for i in range(len(covered) - 1))
    # imbalances never beat their lower bounds (the bounds are valid)
    assert plan.cost_imbalance >= plan.cost_imbalance_bound - 1e-9
    assert plan.bytes_imbalance >= plan.bytes_imbalance_bound - 1e-9
    for b in plan.block_stats:
        assert b.gamma >= b.gamma_lower_bound - 1e-9
    assert OwnerPlan.from_json(plan.to_json()) == plan


@settings(max_examples=40, deadline=None)
@given(spec=blocks_st, W=st.integers(1, 9), seed=st.integers(0, 1000),
       policy=st.sampled_from(["balanced", "role_greedy", "scope_greedy"]))
def test_plan_invariant_under_parameter_order(spec, W, seed, policy):
    a = plan_owners(_net(spec), W, block_types=Block, policy=policy)
    b = plan_owners(_net(spec, perm_seed=seed), W, block_types=Block, policy=policy)
    assert a == b and a.digest == b.digest


@settings(max_examples=40, deadline=None)
@given(spec=blocks_st, W=st.integers(1, 9), alpha=st.floats(0, 1), bucket=st.integers(1, 3000),
       policy=st.sampled_from(["alpha_balanced", "naive_static"]))
def test_bucket_cuts_monotone_on_param_boundaries(spec, W, alpha, bucket, policy):
    model = _net(spec)
    plan = plan_owners(model, W, block_types=Block, policy=policy, alpha=alpha, bucket_numel=bucket)
    meta = dict(plan.meta)
    order = [n for n, _ in model.named_parameters() if plan[n].owner is not None]
    flat = [f for fqns, _ in meta["buckets"] for f in fqns]
    assert flat == order  # buckets are consecutive runs of the registration order
    for fqns, cuts in meta["buckets"]:
        assert len(cuts) == W + 1 and cuts[0] == 0 and cuts[-1] == len(fqns)
        assert all(cuts[i] <= cuts[i + 1] for i in range(W))
        for r in range(W):
            for f in fqns[cuts[r]:cuts[r + 1]]:  # cut points are indices: whole parameters
                assert plan.owner_of(f) == r


@settings(max_examples=40, deadline=None)
@given(spec=blocks_st, W1=st.integers(1, 6), W2=st.integers(1, 6))
def test_digest_equal_iff_plans_equal(spec, W1, W2):
    model = _net(spec)
    a = plan_owners(model, W1, block_types=Block)
    b = plan_owners(model, W2, block_types=Block)
    assert (a == b) == (a.digest == b.digest)
    c = plan_owners(model, W1, block_types=Block, cost="bytes")
    assert (a == c) == (a.digest == c.digest)


@settings(max_examples=200, deadline=None)
@given(loads=st.lists(st.integers(1, 50), min_size=1, max_size=9), W=st.integers(1, 4))
def test_lower_bound_is_valid_against_brute_force(loads, W):
    assert _tight_lower_bound([float(x) for x in loads], 0.0, W) <= _optimal_makespan(loads, W) + 1e-9


def _optimal_makespan(loads: list[int], W: int) -> int:
    """The least max rank load over every assignment of ``loads`` to ``W`` ranks, by exhaustive
    search: ranks holding equal loads are interchangeable, so one of them is tried, and a branch
    stops once its max reaches the best found (all W**n assignments took up to 25 s a run)."""
    best = sum(loads)  # all on one rank: an assignment, so the optimum is at most this

    def go(i: int, ranks: list[int]) -> None:
        nonlocal best
        if max(ranks) >= best:
            return
        if i == len(loads):
            best = max(ranks)
            return
        tried = set()
        for k in range(W):
            if ranks[k] not in tried:
                tried.add(ranks[k])
                ranks[k] += loads[i]
                go(i + 1, ranks)
                ranks[k] -= loads[i]

    go(0, [0] * W)
    return best


def test_optimal_makespan_is_the_brute_force_one():
    """The search above against every assignment, on cases small enough to enumerate."""
    import itertools

    rng = random.Random(0)
    for _ in range(30):
        loads, W = [rng.randint(1, 50) for _ in range(rng.randint(1, 7))], rng.randint(1, 4)
        brute = min(max(sum(l for l, r in zip(loads, a) if r == k) for k in range(W))
                    for a in itertools.product(range(W), repeat=len(loads)))
        assert _optimal_makespan(loads, W) == brute, (loads, W)


# ------------------------------------------------------------------------------------ presets
@pytest.fixture(scope="module")
def meta_models():
    with torch.device("meta"):
        return {k: Decoder(v) for k, v in PRESETS.items() if k != "tiny"}


def test_qwen3_32b_at_256_ranks_plans_under_50ms(meta_models):
    """17 ms on the development box (AMD EPYC, 2 cores). CI machines differ in speed and load, so the
    bound is relative: planning must take under 1.2x a fixed pure-Python reference workload
    (0.4x on the development box, where the reference takes 42 ms), each the best of interleaved
    runs so both see the same load."""
    model = meta_models["qwen3-32b"]
    plan_owners(model, 256, block_types=DecoderLayer)  # warm-up
    plan_s = ref_s = float("inf")
    for _ in range(10):
        plan_s = min(plan_s, _timed(lambda: plan_owners(model, 256, block_types=DecoderLayer)))
        ref_s = min(ref_s, _timed(_reference_workload))
    assert plan_s < 1.2 * ref_s, (
        f"planning took {plan_s * 1e3:.1f} ms, {plan_s / ref_s:.2f}x the reference workload "
        f"({ref_s * 1e3:.1f} ms)")


def _reference_workload() -> float:
    rng = random.Random(0)
    xs = [rng.random() for _ in range(200_000)]
    xs.sort()
    return sum(x * x for x in xs)


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@pytest.mark.parametrize("W", [8, 64, 256])
def test_balanced_quality_on_qwen3_32b(meta_models, W):
    plan = plan_owners(meta_models["qwen3-32b"], W, block_types=DecoderLayer)
    assert plan.cost_imbalance <= 1.05 * plan.cost_imbalance_bound
    assert plan.max_gamma_ratio <= 1.05


def test_alpha_balanced_beats_canzona_published_figures(meta_models):
    # Canzona Fig. 3c (Qwen3-32B, DP=32): FLOPs 1.43x, memory 1.11x after alpha-balancing.
    # Embedding/head evenly sharded, as measured before bucket policies' "auto" went atomic (issue 20).
    plan = plan_owners(meta_models["qwen3-32b"], 32, block_types=DecoderLayer, policy="alpha_balanced",
                       bucket_numel=40_000_000, elementwise="even")
    assert plan.cost_imbalance < 1.43
    assert plan.state_imbalance < 1.11
    naive = plan_owners(meta_models["qwen3-32b"], 32, block_types=DecoderLayer, policy="naive_static",
                        bucket_numel=40_000_000, elementwise="even")
    assert naive.cost_imbalance > plan.cost_imbalance


def test_public_api_surface():
    assert set(matrixfsdp.__all__) >= {"plan_owners", "OwnerPlan"}
    # what a user calls (issue 16): the demo decoder and torch's MixedPrecisionPolicy left the
    # surface and stay reachable as aliases
    # left the surface and stay reachable as aliases; MatrixRule is the one routing rule (issue 26)
    assert len(matrixfsdp.__all__) <= 15
    assert not {"Decoder", "DecoderConfig", "DecoderLayer", "PRESETS", "MixedPrecisionPolicy"} & set(matrixfsdp.__all__)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from matrixfsdp.models import Decoder

    assert matrixfsdp.Decoder is Decoder and matrixfsdp.MixedPrecisionPolicy is MixedPrecisionPolicy


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts"])
def test_config_from_hf_refuses_moe(tmp_path, key):
    from matrixfsdp.models.decoder import config_from_hf

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, key: 8,
                                "model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match=(
            rf"^config_from_hf: only dense decoders are supported \(the planner's built-in Decoder has no "
            rf"mixture-of-experts layers\), got {key}=8 in '.*config.json'; plan the transformers model itself "
            r"with plan_owners\(model, W, block_types=\(DecoderLayer,\)\)$")):
        config_from_hf(path)
    path.write_text(json.dumps({"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, key: 0}))
    assert config_from_hf(path).num_hidden_layers == 2  # 0 experts: dense


def test_full_tensor_is_exported():
    import matrixfsdp
    from matrixfsdp.placement.owned_tensor import full_tensor

    assert matrixfsdp.full_tensor is full_tensor and "full_tensor" in matrixfsdp.__all__


# ------------------------------------------------------------------------------------ HSDP replicas
def test_flat_plan_digests_unchanged_by_replicas():
    """``OwnerPlan.digest`` is a public contract: flat plans hash as before replicas existed
    (digests computed at bac28fb, before the HSDP fields)."""
    with torch.device("meta"):
        m = Decoder(PRESETS["qwen3-0.6b"])
    assert plan_owners(m, 8, block_types=DecoderLayer).digest == \
        "e00a5067888e80df447b216e9afbc0d0350f19c088492bddc4348e9f9b33f38a"
    assert plan_owners(m, 4, block_types=DecoderLayer, policy="alpha_balanced").digest == \
        "46709ccb94a6e16b946f971222ce8ef60c0543b23d2860f7236f375d112f0192"
    assert plan_owners(m, (1, 8), block_types=DecoderLayer).digest == plan_owners(m, 8, block_types=DecoderLayer).digest


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=blocks_st, R=st.integers(2, 4), S=st.integers(1, 5), mode=st.sampled_from(["auto", "repeat", "split"]))
def test_step_replicas_invariants(spec, R, S, mode):
    """Owners are planned as on a flat S-rank mesh; split parameters get a step replica in range,
    each (block, owner)'s split parameters in plan order take replicas in non-decreasing order
    (one whole-tensor interval per replica), auto splits exactly the matrices, the plan
    round-trips through JSON and its digest covers the replica assignment."""
    model = _net(spec)
    flat = plan_owners(model, S, block_types=Block)
    plan = plan_owners(model, (R, S), block_types=Block, replica_step=mode)
    assert plan.replicas == R and plan.world_size == S
    assert [(p.fqn, p.owner, p.placement) for p in plan.params] == [(p.fqn, p.owner, p.placement) for p in flat.params]
    for p in plan.params:
        split = p.step_replica is not None
        want = p.owner is not None and (mode == "split" or (mode == "auto" and p.placement == "matrix"))
        assert split == want, p
        assert not split or 0 <= p.step_replica < R
    for b in (*plan.blocks, ""):
        for s in range(S):
            seq = [p.step_replica for p in plan.params_of_block(b) if p.owner == s and p.step_replica is not None]
            assert seq == sorted(seq), (b, s, seq)
    assert OwnerPlan.from_json(plan.to_json()) == plan
    assert plan.digest != flat.digest
    if any(p.step_replica is not None for p in plan.params):
        import dataclasses

        moved = next(p for p in plan.params if p.step_replica is not None)
        other = dataclasses.replace(moved, step_replica=(moved.step_replica + 1) % R)
        tampered = dataclasses.replace(plan, params=tuple(other if p is moved else p for p in plan.params))
        assert tampered.digest != plan.digest


def test_split_balances_step_cost_across_replicas():
    """On Qwen3-0.6B at 4 x 8, each owner's matrix work splits evenly across its replicas: the
    busiest replica's step cost is within 10% of the owner's total / R, and split's per-replica
    state is about 1/R of repeat's."""
    with torch.device("meta"):
        m = Decoder(PRESETS["qwen3-0.6b"])
    R, S = 4, 8
    split = plan_owners(m, (R, S), block_types=DecoderLayer, replica_step="split")
    repeat = plan_owners(m, (R, S), block_types=DecoderLayer, replica_step="repeat")
    cost, state = split.replica_stats
    rcost, rstate = repeat.replica_stats
    assert max(cost) <= 1.10 * sum(cost) / R
    assert max(state) <= max(rstate) / R + max(p.state_nbytes for p in split.params)
    assert split.replica_step == "split" and repeat.replica_step == "repeat"
    assert plan_owners(m, (R, S), block_types=DecoderLayer).replica_step == "mixed"  # auto: tails repeat


def test_replica_step_bad_input():
    model = Net([Block([(4, 4)])])
    with pytest.raises(ValueError, match=r"plan_owners: replica_step must be one of \('auto', 'repeat', 'split'\), got replica_step='halve'"):
        plan_owners(model, (2, 2), block_types=Block, replica_step="halve")
    with pytest.raises(ValueError, match=r"plan_owners: an \(replicas, shard\) pair needs two ints >= 1, got \(0, 2\)"):
        plan_owners(model, (0, 2), block_types=Block)


# ------------------------------------------------------------------------------------ TP micro-groups
from matrixfsdp.planner.micro_groups import (  # noqa: E402
    BALANCE_SLACK,
    DEFAULT_C_MAX_FLOOR,
    MicroGroup,
    default_c_max,
    plan_micro_groups,
)


def _lpt(costs: list[float], tp: int) -> list[float]:
    """Host loads of min-heap LPT over ``costs`` in the given order (ties to the lowest rank)."""
    loads = [0.0] * tp
    for c in costs:
        r = min(range(tp), key=lambda k: (loads[k], k))
        loads[r] += c
    return loads


def test_micro_groups_hand_checked():
    # tp=2, c_max=100. Order a(10), b(6), c(5), d(4), e(4, after d by fqn), f(1).
    # g0: a->r0, b->r1, c->r1 (least loaded: 6 < 10): loads 10/11, makespan 11 <= 1.05 * 10.5
    #     (bound = max(21/2, 10)); d would make the buffer 110 > 100: rolled back to g1.
    # g1: d->r0, e->r1 (70 B); f (200 B) would overflow: rolled back; g2: f alone, oversized.
    mats = [("f", (10, 10), 1.0, 200), ("e", (5, 5), 4.0, 50), ("d", (4, 5), 4.0, 20),
            ("c", (4, 4), 5.0, 20), ("b", (5, 6), 6.0, 30), ("a", (4, 10), 10.0, 40)]
    assert plan_micro_groups(mats, 2, c_max=100) == (
        MicroGroup(index=0, members=(("a", 0), ("b", 1), ("c", 1)), makespan=11.0, bound=10.5, buffer_bytes=90),
        MicroGroup(index=1, members=(("d", 0), ("e", 1)), makespan=4.0, bound=4.0, buffer_bytes=70),
        MicroGroup(index=2, members=(("f", 0),), makespan=1.0, bound=1.0, buffer_bytes=200),
    )
    # balance rollback: d would go to r0 (10 + 4 = 14 > 1.05 * max(25/2, 10) = 13.125)
    mats = [("a", (4, 4), 10.0, 1), ("b", (4, 4), 6.0, 1), ("c", (4, 4), 5.0, 1), ("d", (4, 4), 4.0, 1)]
    g = plan_micro_groups(mats, 2)
    assert [x.members for x in g] == [(("a", 0), ("b", 1), ("c", 1)), (("d", 0),)]
    assert [x.ratio for x in g] == [pytest.approx(11 / 10.5), 1.0]
    # tp equal matrices fill a group exactly; the tp+1-th would double its makespan
    g = plan_micro_groups([(f"m{i}", (2, 2), 3.0, 16) for i in range(7)], 3)
    assert [len(x.members) for x in g] == [3, 3, 1]
    assert [h for x in g for _, h in x.members] == [0, 1, 2, 0, 1, 2, 0]
    assert plan_micro_groups([], 4) == ()
    assert default_c_max(8, 1) == DEFAULT_C_MAX_FLOOR and default_c_max(8, 2**30) == 8 * 2**30


@pytest.mark.parametrize("args, kwargs, match", [
    (([], 0), {}, r"plan_micro_groups: tp must be an int >= 1, got tp=0"),
    (([], True), {}, r"plan_micro_groups: tp must be an int >= 1, got tp=True"),
    (([], 2), {"c_max": 0}, r"plan_micro_groups: c_max must be an int >= 1, got c_max=0"),
    (([("a", (2, 2), 1.0, 8), ("a", (2, 2), 2.0, 8)], 2), {}, r"plan_micro_groups: fqns must be unique, got 'a' twice"),
    (([("a", (2, 2), -1.0, 8)], 2), {}, r"plan_micro_groups: cost must be a finite number >= 0, got 'a' cost=-1.0"),
    (([("a", (2, 2), float("nan"), 8)], 2), {}, r"plan_micro_groups: cost must be a finite number >= 0, got 'a' cost=nan"),
    (([("a", (2, 2), 1.0, -8)], 2), {}, r"plan_micro_groups: nbytes must be an int >= 0, got 'a' nbytes=-8"),
    (([("a", 1.0, 8)], 2), {}, r"plan_micro_groups: each matrix must be \(fqn, shape, cost, nbytes\)"),
])
def test_micro_groups_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_micro_groups(*args, **kwargs)


mats_st = st.lists(st.tuples(st.one_of(st.integers(0, 60).map(float), st.floats(0, 1e6)), st.integers(0, 400)),
                   min_size=0, max_size=40)


@settings(max_examples=200, deadline=None)
@given(spec=mats_st, tp=st.integers(1, 9), c_max=st.one_of(st.none(), st.integers(1, 2000)), seed=st.integers(0, 10**6))
def test_micro_groups_invariants(spec, tp, c_max, seed):
    import random

    mats = [(f"w{i}", (i + 1, 2), c, n) for i, (c, n) in enumerate(spec)]
    groups = plan_micro_groups(mats, tp, c_max=c_max)
    cost = {f: c for f, _, c, _ in mats}
    nbytes = {f: n for f, _, _, n in mats}
    cap = c_max if c_max is not None else default_c_max(tp, max(nbytes.values(), default=0))
    order = [f for g in groups for f, _ in g.members]
    # every matrix exactly once, in consecutive runs of the global (cost desc, fqn) order
    assert order == [f for f, *_ in sorted(mats, key=lambda m: (-m[2], m[0]))]
    for k, g in enumerate(groups):
        assert g.index == k and g.members
        assert all(0 <= h < tp for _, h in g.members)
        costs = [cost[f] for f, _ in g.members]
        loads = _lpt(costs, tp)
        assert sorted(loads) == pytest.approx(sorted(
            sum(cost[f] for f, x in g.members if x == h) for h in range(tp)))  # LPT's loads (ties may permute hosts)
        assert g.makespan == pytest.approx(max(loads))
        assert g.bound == pytest.approx(max(sum(costs) / tp, max(costs)))
        assert g.buffer_bytes == sum(nbytes[f] for f, _ in g.members)
        assert g.buffer_bytes <= cap or len(g.members) == 1  # only an oversized matrix exceeds c_max
        assert g.makespan >= g.bound * (1 - 1e-9)
        assert g.makespan <= (1 + BALANCE_SLACK) * g.bound * (1 + 1e-9)
        if k + 1 < len(groups):  # greedy rollback: the next group's seed did not fit this group
            nxt, _ = groups[k + 1].members[0]
            test = costs + [cost[nxt]]
            fits = g.buffer_bytes + nbytes[nxt] <= cap
            balanced = max(_lpt(test, tp)) <= (1 + BALANCE_SLACK) * max(sum(test) / tp, max(test)) * (1 + 1e-12)
            assert not (fits and balanced)
    # deterministic under input permutation
    shuffled = list(mats)
    random.Random(seed).shuffle(shuffled)
    assert plan_micro_groups(shuffled, tp, c_max=c_max) == groups


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=blocks_st, W=st.integers(1, 4), tp=st.integers(2, 5), c_max=st.one_of(st.none(), st.integers(1, 20000)))
def test_plan_micro_groups_in_owner_plan(spec, W, tp, c_max):
    """plan_owners(tp=T): owners as at tp=1, one micro-group sequence per owner over exactly its
    matrices, JSON round-trip, and the digest covers the groups."""
    import dataclasses

    model = _net(spec)
    flat = plan_owners(model, W, block_types=Block, placement="owned")  # tp > 1 plans host nothing
    plan = plan_owners(model, W, block_types=Block, tp=tp, tp_c_max=c_max)
    assert plan.params == flat.params and plan.tp == tp and len(plan.micro_groups) == W
    for s, groups in enumerate(plan.micro_groups):
        mats = [(p.fqn, p.shape, p.cost, p.nbytes) for p in plan.params if p.placement == "matrix" and p.owner == s]
        assert groups == plan_micro_groups(mats, tp, c_max=c_max)
    back = OwnerPlan.from_json(plan.to_json())
    assert back == plan and back.digest == plan.digest
    assert plan.digest != flat.digest
    if plan.summary()["tp_groups"]:
        s = next(s for s, gs in enumerate(plan.micro_groups) if gs)
        g = plan.micro_groups[s][0]
        (f, h), *rest = g.members
        moved = dataclasses.replace(g, members=((f, (h + 1) % tp), *rest))
        groups = tuple((moved, *gs[1:]) if i == s else gs for i, gs in enumerate(plan.micro_groups))
        assert dataclasses.replace(plan, micro_groups=groups).digest != plan.digest


def test_plan_micro_groups_validation():
    model = Net([Block([(4, 4), (2, 4)])])
    flat = plan_owners(model, 1, block_types=Block)
    assert plan_owners(model, 1, block_types=Block, tp=1).digest == flat.digest
    assert "micro_groups" not in flat.to_json() and '"tp"' not in flat.to_json()
    with pytest.raises(ValueError, match=r"plan_owners: tp must be an int >= 1, got tp=0"):
        plan_owners(model, 1, block_types=Block, tp=0)
    with pytest.raises(ValueError, match=r"plan_owners: tp_c_max needs tp > 1, got tp_c_max=64 with tp=1"):
        plan_owners(model, 1, block_types=Block, tp_c_max=64)
    plan = plan_owners(model, 1, block_types=Block, tp=2)
    import dataclasses

    g = plan.micro_groups[0][0]
    with pytest.raises(ValueError, match=r"OwnerPlan: owner 0's micro-groups must hold each of its 2 matrices once"):
        dataclasses.replace(plan, micro_groups=((dataclasses.replace(g, members=g.members[:1]),),))
    with pytest.raises(ValueError, match=r"host must be in \[0, 2\)"):
        dataclasses.replace(plan, micro_groups=((dataclasses.replace(g, members=((g.members[0][0], 2), *g.members[1:])),),))
    with pytest.raises(ValueError, match=r"OwnerPlan: micro_groups need tp > 1"):
        dataclasses.replace(plan, tp=1)
    with pytest.raises(ValueError, match=r"OwnerPlan.from_json: malformed plan"):
        OwnerPlan.from_json(plan.to_json().replace('"buffer_bytes"', '"buffer"'))


def test_qwen3_32b_micro_groups_at_tp8(meta_models):
    """docs/planner.md's TP figures: Qwen3-32B, Muon FLOPs, tp=8. One owner (dp=1): 40 groups,
    every group at its bound, the sum of makespans equal to the 448 matrices' cost / 8. At dp=32
    the busiest owner's single group is at its bound, 1.058x its matrices' cost / 8."""
    model = meta_models["qwen3-32b"]
    plan = plan_owners(model, 1, block_types=DecoderLayer, tp=8)
    (groups,) = plan.micro_groups
    total = sum(p.cost for p in plan.params if p.placement == "matrix")
    assert len(groups) == 40 and sum(len(g.members) for g in groups) == 448
    assert max(g.ratio for g in groups) == pytest.approx(1.0)
    assert sum(g.makespan for g in groups) == pytest.approx(total / 8)
    assert max(g.buffer_bytes for g in groups) <= default_c_max(8, max(p.nbytes for p in plan.params if p.placement == "matrix"))
    numel = plan_owners(model, 1, block_types=DecoderLayer, cost="numel", tp=8)
    assert len(numel.micro_groups[0]) == 56 and max(g.ratio for g in numel.micro_groups[0]) == pytest.approx(1.0)
    s = plan_owners(model, 32, block_types=DecoderLayer, tp=8).summary()
    assert s["tp_makespan"] == pytest.approx(s["tp_bound"])


def test_micro_groups_of_one_matrix_rotate_hosts():
    """Under a small c_max every matrix is a group of its own; LPT's ties go to the host least
    loaded over the earlier groups, so the hosts rotate instead of all being rank 0."""
    mats = [(f"w{i}", (8, 8), 1.0, 256) for i in range(6)]
    groups = plan_micro_groups(mats, 3, c_max=1)
    assert [g.members for g in groups] == [((f"w{i}", i % 3),) for i in range(6)]
