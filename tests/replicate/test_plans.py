"""Issue 20 item 1: every planner policy gives ``replicate`` a plan it runs, or a refusal whose hint
is a fix that works (applied here), never the option the caller already used. W=2, 3, 4 with
processes; W=8 at plan level (``replicate``'s plan check and bucket layout, no process group)."""

from __future__ import annotations

import ast
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _models import Block, TinyConfig, TinyDecoder, make_batch

import matrixfsdp
from matrixfsdp.planner.owners import POLICIES
from matrixfsdp._replicate.api import _check_whole
from matrixfsdp._replicate.bucket_layout import build_layout

KW = dict(lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3)
HINT = re.compile(r"rebuild it with plan_owners\(\.\.\., (.*)\)$")
DEFAULTS = {"policy": "balanced", "elementwise": "auto"}
# vocab 512: embedding + head are 32% of the bytes, so "auto" owned the root tail at W=2 and
# sharded it (every norm included) at W=4, as the issue saw
CFG = TinyConfig(vocab=512)


def _f(fqn: str, p: torch.Tensor) -> bool:  # the issue's filter: 2D weights but embedding and head
    return p.ndim == 2 and not fqn.startswith(("tok_emb", "head"))


# the issue's call (no blocks: one root scope), a blocked one, and an explicit "even" request
SETUPS = {
    "issue": dict(matrix_filter=_f),
    "blocks": dict(block_types=Block),
    "even": dict(block_types=Block, elementwise="even"),
}


def _hint_kwargs(msg: str) -> dict:
    m = HINT.search(msg)
    assert m, msg
    call = ast.parse(f"f({m.group(1)})", mode="eval").body
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def _accepts(plan, model) -> None:
    """What replicate checks before any collective: whole owners, then a bucket layout that holds
    every trainable parameter exactly once."""
    named = dict(model.named_parameters())
    _check_whole(plan, named)
    trainable = [f for f, p in named.items() if p.requires_grad]
    layouts = build_layout(plan, trainable, bucket_numel=40_000)
    assert sorted(s.fqn for lay in layouts for s in lay.slots) == sorted(trainable)


def _plan_or_hint(model, world, policy, setup) -> tuple[object, dict | None, str | None]:
    """(accepted plan, hint applied or None, refusal message or None)."""
    kw = dict(SETUPS[setup], policy=policy)
    plan = matrixfsdp.plan_owners(model, world, **kw)
    try:
        _accepts(plan, model)
        return plan, None, None
    except ValueError as e:
        msg = str(e)
    assert msg.startswith("matrixfsdp.replicate: every parameter must be owned whole by one rank, but the plan "
                          f"(policy={policy!r}, W={plan.world_size}) shards "), msg
    hint = _hint_kwargs(msg)
    # the hint differs from what the caller did
    assert any(kw.get(k, DEFAULTS.get(k)) != v for k, v in hint.items()), (msg, kw)
    fixed = matrixfsdp.plan_owners(model, world, **{**kw, **hint})
    _accepts(fixed, model)
    return fixed, hint, msg


@pytest.mark.parametrize("W", [2, 3, 4, 8])
def test_every_policy_accepted_or_hint_works_plan_level(W):
    model = TinyDecoder(CFG, seed=0)
    refused = []
    for setup in SETUPS:
        for policy in POLICIES:
            _plan, hint, msg = _plan_or_hint(model, W, policy, setup)
            if policy in ("alpha_balanced", "naive_static") and setup != "even":
                assert hint is None, (setup, policy, msg)  # Canzona's rule: bucket plans keep tensors whole
            if setup == "even":
                assert hint == {"policy": policy, "elementwise": "owned", "placement": "owned"}, msg
            if hint is not None:
                refused.append((setup, policy))
    # the refusal path ran for the owner policies' "auto" too (so the hint check is not vacuous)
    assert ("even", "alpha_balanced") in refused
    assert ("blocks", "balanced") in refused, refused


def test_issue_call_is_atomic_at_w4():
    # plan_owners(model, 4, policy="alpha_balanced", matrix_filter=f): at W=2 auto already owned
    # every norm; at W=4 it used to shard them all (one root scope), which replicate refused
    model = TinyDecoder(CFG, seed=0)
    for W in (2, 3, 4, 8):
        for policy in ("alpha_balanced", "naive_static"):
            plan = matrixfsdp.plan_owners(model, W, policy=policy, matrix_filter=_f)
            assert all(p.owner is not None for p in plan.params), (W, policy)
        assert plan["blocks.0.attn_norm.weight"].placement == "tail"
    even = matrixfsdp.plan_owners(model, 4, policy="alpha_balanced", matrix_filter=_f, elementwise="even")
    assert even["blocks.0.attn_norm.weight"].placement == "even"


def replicate_each_policy() -> list[tuple[str, str, str | None, float]]:
    W, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (W,))
    cfg = CFG
    out = []
    for setup in SETUPS:
        for policy in POLICIES:
            model = TinyDecoder(cfg, seed=0)
            kw = dict(SETUPS[setup], policy=policy)
            plan = matrixfsdp.plan_owners(model, mesh, **kw)
            msg = None
            try:
                model = matrixfsdp.replicate(model, mesh=mesh, plan=plan, stage=1)
            except ValueError as e:  # apply the hint, as a user would
                msg = str(e)
                plan = matrixfsdp.plan_owners(model, mesh, **{**kw, **_hint_kwargs(msg)})
                model = matrixfsdp.replicate(model, mesh=mesh, plan=plan, stage=1)
            opt = matrixfsdp.optim.Muon(model, **KW)
            x, y = make_batch(cfg, 0, 4 * W)
            sl = slice(rank * 4, (rank + 1) * 4)
            model.loss(x[sl], y[sl]).backward()
            opt.step()
            model.sync_params()
            # every rank holds the same stepped parameters
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            ref = flat.clone()
            dist.broadcast(ref, 0)
            out.append((setup, policy, msg, float((flat - ref).abs().max())))
    return out


@pytest.mark.parametrize("W", [2, 3, 4])
def test_every_policy_runs_under_replicate(W):
    res = get_pool(W).run(replicate_each_policy, timeout=600)
    assert all(r == res[0] for r in res)  # every rank took the same path, with the same message
    for setup, policy, msg, diff in res[0]:
        assert diff == 0.0, (setup, policy)
        if policy in ("alpha_balanced", "naive_static") and setup != "even":
            assert msg is None, (setup, policy, msg)
        if setup == "even":
            assert msg is not None and "elementwise='owned'" in msg
