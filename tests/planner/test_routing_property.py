"""The routing invariant over generated models (issue 39; see [Note: routing invariant] in
planner/rules.py): every parameter gets the same kind on the plain model (``Muon(model)``), under
a whole-model plan (balanced and replicate's bucket policy, flat and HSDP, W 1..6) and under
drop-in calls (each call classifies its own parameters on its own module, as ``plan_call`` does;
a disagreement the drop-in root must refuse is computed by the same function it uses), and no
matrix-kind parameter is placed where no matrix step takes it (evenly sharded with no host).

Planning only (pure Python over shapes, meta tensors where it matters): the default profile runs
in well under 60 s. ``HYPOTHESIS_PROFILE=routing-long`` runs 20x the examples. Real gloo parity
runs of sampled models (W=2 and 3): tests/optim/test_routing_invariant.py.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from matrixfsdp import MatrixRule, plan_owners

settings.register_profile("routing-default", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("routing-long", max_examples=1200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "routing-default")
if not PROFILE.startswith("routing-"):
    PROFILE = "routing-default"

NAMES = ["gate", "up", "down", "head", "output", "experts", "router", "proj", "w"]
ODD = st.sampled_from([3, 5, 7, 9, 11, 13])


class Gen(nn.Module):
    pass


@st.composite
def models(draw):
    """A root with optional embedding and (tied or untied) head, 1-3 blocks of 1-4 matrices with
    odd widths, norms and biases, and optionally an MoE part (3-D stacks with or without a router,
    under varied names), a convolution, frozen and shared parameters."""
    D = draw(ODD)
    V = draw(st.sampled_from([0, 5, 17]))  # 0: no embedding
    root = Gen()
    if V:
        root.embed = nn.Embedding(V, D)
    blocks = nn.ModuleList()
    for _ in range(draw(st.integers(1, 3))):
        b = Gen()
        b.norm = nn.LayerNorm(D)
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
        for n in names:
            out = draw(ODD)
            setattr(b, n, nn.Linear(D, out, bias=draw(st.booleans())))
        if draw(st.booleans()):  # an MoE part
            E, F = draw(st.sampled_from([2, 3, 4])), draw(ODD)
            holder_name = draw(st.sampled_from(["moe", "experts", "output", "head", "mlp"]))
            holder = Gen()
            on_child = draw(st.booleans())  # stacks on a child (torchtitan/HF) or the MoE module itself
            target = Gen() if on_child else holder
            for sname in draw(st.lists(st.sampled_from(["w1", "w2", "experts", "gate", "bank"]), min_size=1,
                                       max_size=3, unique=True)):
                shape = (E, F, D) if sname != "w2" else (E, D, F)
                target.register_parameter(sname, nn.Parameter(torch.randn(shape)))
            if on_child:
                holder.add_module(draw(st.sampled_from(["experts", "bank", "ffn"])), target)
            router = draw(st.sampled_from([None, "router", "gate", "head", "output", "score"]))
            if router is not None and not hasattr(holder, router):
                holder.add_module(router, nn.Linear(D, E, bias=False))
            if draw(st.booleans()):  # shared experts: a dense MLP
                holder.shared = nn.Sequential(nn.Linear(D, draw(ODD), bias=False))
            if hasattr(b, holder_name):
                holder_name += "_moe"
            b.add_module(holder_name, holder)
        if draw(st.booleans()):
            b.conv = nn.Conv1d(D, D, 3)
        if draw(st.booleans()) and len(names) >= 1:  # a shared (tied) module inside the block
            b.again = getattr(b, names[0])
        blocks.append(b)
    root.blocks = blocks
    head = draw(st.sampled_from([None, "head", "output", "lm_head", "proj"]))
    if head is not None:
        root.add_module(head, nn.Linear(D, V or draw(ODD), bias=False))
        if V and draw(st.booleans()):
            getattr(root, head).weight = root.embed.weight  # tied
    params = list(root.parameters())
    for i in draw(st.sets(st.integers(0, len(params) - 1), max_size=3)):
        params[i].requires_grad_(False)  # frozen
    return root


def plain_kinds(model, rule):
    """What ``Muon(model)`` routes a plain model by: its param groups."""
    from matrixfsdp.optim import Muon

    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for g in Muon(model, matrix_rule=rule).param_groups:
        kind = "elementwise" if g["algorithm"] == "adamw" else ("experts" if g.get("experts") else "matrix")
        out.update({names[id(p)]: kind for p in g["params"]})
    return out


OF = {"matrix": "matrix", "hosted": "matrix", "experts": "experts", "tail": "elementwise", "even": "elementwise"}


def check_plan(plan, kinds, what):
    for pp in plan.params:
        assert OF[pp.placement] == kinds[pp.fqn], (what, pp.fqn, pp.placement, kinds[pp.fqn])
        if kinds[pp.fqn] == "matrix":  # a matrix step takes it: owned, or hosted with a host group
            assert pp.owner is not None or (pp.placement == "hosted" and any(
                pp.fqn in {f for f, _ in g.members} for g in plan.host_groups)), (what, pp)


def dropin_kinds(model, rule, world):
    """Each drop-in call (every block, then the root) classifies its own parameters on its own
    module and plans them with ``plan_dropin``, as ``_fully_shard.init.plan_call`` does; returns
    the kinds and the plans' placements, by the model's fqns."""
    from matrixfsdp._fully_shard.init import plan_dropin
    from matrixfsdp.planner.rules import DecidedRule

    kinds, placements = {}, {}
    names = {id(p): n for n, p in model.named_parameters()}
    for call in [*model.blocks, model]:
        decided = {f: k for f, k in rule.kinds(call).items() if names[id(call.get_parameter(f))] not in kinds}
        if not decided:
            continue
        holder = Gen()  # the call's own parameters on meta, by their names in the call's module
        for f in decided:
            *path, attr = f.split(".")
            m = holder
            for part in path:
                if not hasattr(m, part):
                    m.add_module(part, Gen())
                m = getattr(m, part)
            p = call.get_parameter(f)
            m.register_parameter(attr, nn.Parameter(torch.empty(p.shape, device="meta"), requires_grad=p.requires_grad))
        plan = plan_dropin(holder, DecidedRule(decided=decided), world)
        for pp in plan.params:
            name = names[id(call.get_parameter(pp.fqn))]
            kinds[name], placements[name] = decided[pp.fqn].kind, pp.placement
            assert pp.placement != "hosted", ("drop-in hosts nothing: no host is attached", name)
            if decided[pp.fqn].kind == "matrix":
                assert pp.owner is not None, ("drop-in matrix without an owner", name, pp)
    return kinds, placements


@settings(settings.get_profile(PROFILE))
@given(models(), st.integers(1, 6), st.integers(1, 3), st.booleans(), st.booleans())
def test_routing_invariant_over_generated_models(model, W, R, routers, experts):
    from matrixfsdp._fully_shard.init import dropin_mismatches

    rule = MatrixRule(routers=routers, experts=experts)
    whole = {f: k.kind for f, k in rule.kinds(model).items()}
    assert plain_kinds(model, rule) == whole
    blocks = list(model.blocks)
    for mesh in (W, (R, W)):
        check_plan(plan_owners(model, mesh, blocks=blocks, matrix_rule=rule), whole, ("planned", mesh))
    check_plan(plan_owners(model, W, blocks=blocks, matrix_rule=rule, policy="alpha_balanced"), whole,
               ("replicate", W))
    # drop-in: a call's kinds equal the whole model's, or the drop-in root refuses that parameter
    calls, placements = dropin_kinds(model, rule, (R, W) if R > 1 else W)
    refused = {f for f, _, _ in dropin_mismatches(rule.kinds(model), placements)}
    assert {f for f in whole if calls[f] != whole[f]} == refused
