"""Adaptive placement (``plan_owners(..., placement="auto")``, planner/hosting.py): hypothesis
properties of hosted plans, the budget's contract and its errors, and the Qwen3 presets at scale."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from matrixfsdp import OwnerPlan, plan_owners
from matrixfsdp.models import PRESETS, Decoder, DecoderLayer
from matrixfsdp.planner.hosting import DEFAULT_MEMORY_BUDGET
from matrixfsdp.planner.owner_plan import even_rows, rank_held_bytes
from planner.test_owners import Block, _net, blocks_st


def _mats(plan: OwnerPlan) -> list:
    return [p for p in plan.params if len(p.shape) == 2 and p.placement in ("matrix", "hosted")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=blocks_st, W=st.integers(1, 12), budget=st.one_of(st.none(), st.floats(0.3, 4.0)),
       optimizer=st.sampled_from(["muon", "shampoo"]))
def test_every_matrix_is_owned_or_evenly_sharded_with_a_host(spec, W, budget, optimizer):
    model = _net(spec)
    owned = plan_owners(model, W, block_types=Block, placement="owned", optimizer=optimizer)
    try:
        plan = plan_owners(model, W, block_types=Block, memory_budget=budget, optimizer=optimizer)
    except ValueError as e:  # an explicit budget below what hosting reaches: the message names it
        assert budget is not None and "cannot be met" in str(e)
        floor = float(str(e).split("pass memory_budget >= ")[1].split(",")[0])
        assert floor > budget
        plan = plan_owners(model, W, block_types=Block, memory_budget=floor + 1e-3, optimizer=optimizer)
        budget = floor + 1e-3
    cap = DEFAULT_MEMORY_BUDGET if budget is None else budget
    # the same matrices, each owned whole or hosted: stored in torch.chunk rows, one host shard rank
    assert [p.fqn for p in _mats(plan)] == [p.fqn for p in _mats(owned)]
    for p in plan.params:
        if p.placement == "hosted":
            assert p.owner is None and 0 <= p.host < W and len(p.shape) == 2
            # Muon's momentum stays on the rows; Shampoo's factors whole on the host
            assert p.state_on_shards == (optimizer == "muon")
            assert [p.local_rows(r, W) for r in range(W)] == [even_rows(p.shape[0], W, r) for r in range(W)]
        else:
            assert p.host is None
    # nothing hosted where owning fits: the owned plan, digest included
    if owned.memory_vs_fsdp2 <= cap:
        assert plan.num_hosted == 0 and plan.digest == owned.digest
    # the bound holds when the budget was explicit (strict), and hosting never makes the peak worse
    if budget is not None:
        assert plan.memory_vs_fsdp2 <= cap * (1 + 1e-9)
    assert max(rank_held_bytes(plan.params, W)) <= max(rank_held_bytes(owned.params, W)) * (1 + 1e-9)
    # host groups hold each hosted matrix once with its host; JSON round trip; digest covers hosts
    members = sorted((f, h) for g in plan.host_groups for f, h in g.members)
    assert members == sorted((p.fqn, p.host) for p in plan.params if p.placement == "hosted")
    assert OwnerPlan.from_json(plan.to_json()) == plan
    if plan.num_hosted and W > 1:
        d = json.loads(plan.to_json())
        i = next(i for i, p in enumerate(d["params"]) if p["placement"] == "hosted")
        d["params"][i]["host"] = (d["params"][i]["host"] + 1) % W
        for g in d["host_groups"]:
            g["members"] = [[f, d["params"][i]["host"] if f == d["params"][i]["fqn"] else h] for f, h in g["members"]]
        with pytest.raises(ValueError, match="digest mismatch"):
            OwnerPlan.from_json(json.dumps(d))
        d = json.loads(plan.to_json())  # where the state lives is in the digest too
        p = d["params"][i]
        p["state_on_shards"] = not p.get("state_on_shards", False)
        with pytest.raises(ValueError, match="digest mismatch"):
            OwnerPlan.from_json(json.dumps(d))


def test_bad_budgets_raise_naming_the_constraint():
    model = _net([([(8, 8), (8, 8)], 0)])
    with pytest.raises(ValueError, match=r"memory_budget must be a finite number > 0 .* got memory_budget=0.0"):
        plan_owners(model, 4, block_types=Block, memory_budget=0.0)
    with pytest.raises(ValueError, match=r"placement must be one of \('auto', 'owned'\), got placement='even'"):
        plan_owners(model, 4, block_types=Block, placement="even")
    with pytest.raises(ValueError, match="memory_budget applies to placement='auto'.*placement='owned'"):
        plan_owners(model, 4, block_types=Block, placement="owned", memory_budget=2.0)
    with pytest.raises(ValueError, match="memory_budget applies to placement='auto'.*policy='alpha_balanced'"):
        plan_owners(model, 4, block_types=Block, policy="alpha_balanced", memory_budget=2.0)
    # two 8x8 matrices on 4 ranks: a Shampoo host keeps a whole matrix's state, so 1.0 cannot be met
    with pytest.raises(ValueError, match=r"memory_budget=1.0 cannot be met: .*whole state.* pass memory_budget >= "
                                         r"(\d+\.\d+)") as e:
        plan_owners(model, 4, block_types=Block, memory_budget=1.0, optimizer="shampoo")
    floor = float(str(e.value).split("pass memory_budget >= ")[1].split(",")[0])
    assert plan_owners(model, 4, block_types=Block, memory_budget=floor + 1e-3,
                       optimizer="shampoo").memory_vs_fsdp2 <= floor + 1e-3
    # Muon's momentum stays on the rows: both matrices hosted are FSDP2's even sharding (8 rows
    # on 4 ranks), and only the owned norm (a tail) stands above it
    muon = plan_owners(model, 4, block_types=Block, memory_budget=1.1)
    assert muon.num_hosted == 2 and muon.memory_vs_fsdp2 <= 1.1


@pytest.fixture(scope="module")
def qwen3_8b():
    with torch.device("meta"):
        return Decoder(PRESETS["qwen3-8b"]).to(torch.bfloat16)


@pytest.mark.parametrize("W, owned_x, auto_x, hosted", [(64, 1.066, 1.066, 0), (256, 1.690, 1.090, 180),
                                                       (1024, 6.183, 1.002, 252), (4096, 24.154, 1.115, 252)])
def test_qwen3_8b_memory_owned_vs_auto(qwen3_8b, W, owned_x, auto_x, hosted):
    """Parameter + gradient + state bytes of the most loaded rank over an even share (FSDP2: 1.0),
    Muon state: the default hosts matrices once owning passes the budget, their momentum on the
    row shards, so the budget holds at every W."""
    owned = plan_owners(qwen3_8b, W, block_types=DecoderLayer, placement="owned")
    auto = plan_owners(qwen3_8b, W, block_types=DecoderLayer)
    assert owned.memory_imbalance == pytest.approx(owned_x, abs=1e-3)
    assert auto.memory_imbalance == pytest.approx(auto_x, abs=1e-3) and auto.memory_vs_fsdp2 <= DEFAULT_MEMORY_BUDGET
    assert auto.num_hosted == hosted
    assert all(p.state_on_shards for p in auto.params if p.placement == "hosted")


def test_whole_matrix_state_stays_on_the_host(qwen3_8b):
    """Shampoo's factors are whole-matrix state: a host keeps them, so hosting cannot reach the
    budget at W=1024 (the report and the default say so; HSDP is the remedy)."""
    auto = plan_owners(qwen3_8b, 1024, block_types=DecoderLayer, optimizer="shampoo")
    hosted = [p for p in auto.params if p.placement == "hosted"]
    assert hosted and not any(p.state_on_shards for p in hosted)
    assert auto.memory_imbalance == pytest.approx(6.789, abs=1e-3)
    assert "state is kept whole on the hosts" in auto.report()
    muon = plan_owners(qwen3_8b, 1024, block_types=DecoderLayer)
    assert "the hosts keep none" in muon.report()
