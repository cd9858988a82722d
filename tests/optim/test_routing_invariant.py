"""Issue 39: every matrix gets its matrix rule, or a clear error (see [Note: routing invariant] in
planner/rules.py). Real gloo runs at W=2 and W=3; the wide planning-only property test is
tests/planner/test_routing_property.py.

* finding 1: drop-in ``fully_shard`` (per block + root, no plan) on MLP blocks with odd widths
  made ``down.weight`` an evenly sharded DTensor with no host (the drop-in plan hosted it, and
  nothing attached the host), so ``Muon(model)`` stepped it with AdamW; caused by 5e016cd
  (``placement="auto"`` became the planner's default, the drop-in path never attached hosts);
* finding 2: 3-D stacks held directly on a ``MoE`` module beside a router ``Linear(D, E)`` were
  planned element-wise;
* explicit requests: a group asking for the matrix rule (by name, or ``"auto"`` with an explicit
  list) for a parameter the plan made element-wise is refused on every rank alike.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool


class MLPBlock(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.gate = nn.Linear(d, f, bias=False)
        self.up = nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class MLPNet(nn.Module):
    def __init__(self, d: int = 31, f: int = 63, n: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(MLPBlock(d, f) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class MoE(nn.Module):
    """gpt-oss / reference-implementation layout: stacks held directly on the MoE module."""

    def __init__(self, d: int = 12, f: int = 10, e: int = 4, k: int = 2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, f, d) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(e, d, f) / f ** 0.5)
        self.w3 = nn.Parameter(torch.randn(e, f, d) / d ** 0.5)

    def forward(self, x):
        scores = self.router(x).softmax(-1)
        top, idx = scores.topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.w1.shape[0]):
            w = (top * (idx == e)).sum(-1, keepdim=True)
            h = F.silu(x @ self.w1[e].T) * (x @ self.w3[e].T)
            out = out + w * (h @ self.w2[e].T)
        return out


class MoEBlock(nn.Module):
    def __init__(self, d: int = 12):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.moe = MoE(d)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class MoENet(nn.Module):
    def __init__(self, n: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _full(p):
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def _wrap(model, plan_mode: str, mesh):
    from matrixfsdp import fully_shard, plan_owners

    plan = plan_owners(model, mesh, blocks=list(model.blocks)) if plan_mode == "planned" else None
    for b in model.blocks:
        fully_shard(b, mesh=mesh, plan=plan)
    fully_shard(model, mesh=mesh, plan=plan)


def parity_check(kind: str, plan_mode: str, steps: int = 2) -> dict:
    """``Muon(model)`` sharded vs ``Muon(model)`` plain, same batch on every rank."""
    from matrixfsdp.optim import Muon
    from matrixfsdp.placement.stepping import planned_kind

    W = dist.get_world_size()
    ref = MLPNet() if kind == "mlp" else MoENet()
    model = copy.deepcopy(ref)
    _wrap(model, plan_mode, init_device_mesh("cpu", (W,)))
    kinds = {n: planned_kind(p) for n, p in model.named_parameters()}
    opts = [Muon(m, lr=0.02, ns_dtype=torch.float32) for m in (ref, model)]
    d = ref.blocks[0].norm.normalized_shape[0]
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        for m, o in zip((ref, model), opts):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    diffs = {n: (_full(b) - a.detach()).abs().max().item()
             for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters())}
    moved = max((_full(b) - a.detach()).abs().max().item()
                for a, b in zip(MLPNet().parameters() if kind == "mlp" else MoENet().parameters(),
                                model.parameters()))
    return {"kinds": kinds, "diff": max(diffs.values()), "worst": max(diffs, key=diffs.get), "moved": moved}


@pytest.mark.parametrize("W", [2, 3])
def test_dropin_mlp_blocks_route_every_matrix_to_muon(W):
    """Finding 1 (failed before the fix at W=2: down.weight 'elementwise', 4e-2 off the plain run)."""
    res = get_pool(W).run(parity_check, "mlp", "dropin")
    for r in res:
        wrong = {n: k for n, k in r["kinds"].items() if "norm" not in n and k != "matrix"}
        assert not wrong, wrong
        assert r["moved"] > 1e-2  # the step did move them
        assert r["diff"] < 1e-5, (r["worst"], r["diff"])


@pytest.mark.parametrize("plan_mode", ["planned", "dropin"])
def test_moe_stacks_on_module_are_expert_stacks(plan_mode):
    """Finding 2 (failed before: the stacks were 'elementwise' and stepped with AdamW)."""
    res = get_pool(2).run(parity_check, "moe", plan_mode)
    for r in res:
        stacks = {n: k for n, k in r["kinds"].items() if n.rpartition(".")[2] in ("w1", "w2", "w3")}
        assert set(stacks.values()) == {"experts"}, stacks
        assert r["kinds"]["blocks.0.moe.router.weight"] == "matrix"
        assert r["diff"] < 1e-5, (r["worst"], r["diff"])


def refusal_check(how: str) -> str:
    """A group asking for the matrix rule for a parameter the plan made element-wise."""
    from matrixfsdp import MatrixRule, plan_owners
    from matrixfsdp.optim import Muon

    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,))
    if how == "matrix_by_name":  # a 2-D matrix a plan's matrix_filter made element-wise, evenly sharded
        # (an owned tail's owner holds it whole: asked by name, it gets the matrix rule there)
        model = MLPNet(d=9, f=11, n=1)
        plan = plan_owners(model, mesh, blocks=list(model.blocks),
                           matrix_filter=lambda n, p: p.ndim == 2 and "down" not in n, elementwise="even")
        _apply(model, mesh, plan)
        groups = [dict(params=[model.blocks[0].down.weight], algorithm="muon")]
    else:  # stacks a plan made element-wise (MatrixRule(experts=False))
        model = MoENet()
        _apply(model, mesh, plan_owners(model, mesh, blocks=list(model.blocks),
                                        matrix_rule=MatrixRule(experts=False)))
        moe = model.blocks[0].moe
        groups = ([dict(params=[moe.w1], algorithm="muon", experts=1)] if how == "stack_by_name"
                  else [dict(params=[moe.w1, moe.w2], experts=1)])
    try:
        Muon(groups, lr=0.02)
    except ValueError as e:
        return str(e)
    return "no error"


def _apply(model, mesh, plan):
    from matrixfsdp import fully_shard

    for b in model.blocks:
        fully_shard(b, mesh=mesh, plan=plan)
    fully_shard(model, mesh=mesh, plan=plan)


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("how", ["stack_by_name", "stack_auto", "matrix_by_name"])
def test_explicit_matrix_request_on_elementwise_param_is_refused(W, how):
    msgs = get_pool(W).run(refusal_check, how)
    assert len(set(msgs)) == 1, msgs  # the same error on every rank
    msg = msgs[0]
    assert msg.startswith("Muon: param group 0 asks for the 'muon' rule for "), msg
    name = "blocks.0.down.weight" if how == "matrix_by_name" else "blocks.0.moe.w1"
    assert repr(name) in msg and "element-wise" in msg and "algorithm='adamw'" in msg, msg
    if how != "matrix_by_name":
        assert "MatrixRule(expert_stacks=" in msg or "experts=False" in msg, msg


def unhosted_check() -> str:
    """A whole-model plan that hosts a matrix, with the host attachment knocked out: the
    resolution's invariant check must name the parameter, on every rank alike."""
    from unittest import mock

    from matrixfsdp import fully_shard, plan_owners

    W = dist.get_world_size()
    model = MLPNet(n=1)  # at W=2 the plan hosts down.weight (checked below)
    mesh = init_device_mesh("cpu", (W,))
    plan = plan_owners(model, mesh, blocks=list(model.blocks))
    hosted = sorted(p.fqn for p in plan.params if p.placement == "hosted")
    if not hosted:
        return "nothing hosted"
    with mock.patch("matrixfsdp._fully_shard.init.attach_dp_hosts", lambda *a, **k: None):
        for b in model.blocks:
            fully_shard(b, mesh=mesh, plan=plan)
        try:
            fully_shard(model, mesh=mesh, plan=plan)
        except RuntimeError as e:
            return f"{hosted[0]} | {e}"
    return "no error"


def test_matrix_placed_evenly_without_host_is_an_internal_error():
    msgs = get_pool(2).run(unhosted_check)
    assert len(set(msgs)) == 1, msgs
    first, _, msg = msgs[0].partition(" | ")
    assert "matrixfsdp internal error (fully_shard(plan=<plan " in msg, msgs[0]
    assert f"parameter {first!r}" in msg and "placement 'hosted'" in msg, msgs[0]


class SampledBlock(nn.Module):
    def __init__(self, up: str, down: str):
        super().__init__()
        self.up_name, self.down_name = up, down

    def forward(self, h):
        n = self.norm(h)
        out = h + getattr(self, self.down_name)(F.silu(getattr(self, self.up_name)(n)))
        return out if self.moe is None else out + self.moe(n)


class SampledNet(nn.Module):
    """A sampled model for the parity runs (the property test's ingredients, with a forward): an
    embedding, blocks of a norm and an up/down pair with odd widths under names drawn from roles
    they do not play (gate, head, output, router, experts), a gpt-oss-style MoE part, a head (tied
    or not), a frozen parameter."""

    def __init__(self, seed: int):
        super().__init__()
        import random

        rnd = random.Random(seed)
        torch.manual_seed(seed)
        D, F, V = rnd.choice([7, 9, 11]), rnd.choice([13, 15, 17]), 19
        self.up_name, self.down_name = rnd.sample(["gate", "head", "output", "router", "experts", "up"], 2)
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList()
        for _ in range(2):
            b = SampledBlock(self.up_name, self.down_name)
            b.norm = nn.LayerNorm(D)
            b.add_module(self.up_name, nn.Linear(D, F, bias=rnd.random() < 0.5))
            b.add_module(self.down_name, nn.Linear(F, D, bias=False))
            b.moe = MoE(D, F, e=3) if rnd.random() < 0.7 else None
            self.blocks.append(b)
        self.head = nn.Linear(D, V, bias=False)
        if rnd.random() < 0.5:
            self.head.weight = self.embed.weight
        self.blocks[0].norm.bias.requires_grad_(False)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def sampled_parity(seed: int, how: str, steps: int = 2) -> dict:
    from matrixfsdp import fully_shard, plan_owners, replicate
    from matrixfsdp.optim import Muon
    from matrixfsdp.placement.stepping import planned_kind

    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,))
    ref = SampledNet(seed)
    model = copy.deepcopy(ref)
    if how == "replicate":
        replicate(model, mesh=mesh)
    else:
        plan = plan_owners(model, mesh, blocks=list(model.blocks)) if how == "planned" else None
        for b in model.blocks:
            fully_shard(b, mesh=mesh, plan=plan)
        fully_shard(model, mesh=mesh, plan=plan)
    opts = [Muon(m, lr=0.02, ns_dtype=torch.float32, adamw_lr=0.01) for m in (ref, model)]
    x = torch.randint(0, 19, (2, 6), generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        for m, o in zip((ref, model), opts):
            o.zero_grad()
            m(x).float().logsumexp(-1).mean().backward()
            o.step()
    if how == "replicate":
        model.sync_params()  # non-owners receive the owners' updates at the next forward otherwise
    names = {id(p): n for n, p in ref.named_parameters()}
    routes = [{names[id(p)]: o._route(g, p) for g in o.param_groups for p in g["params"]} for o in opts[:1]]
    got = {n: opts[1]._route(g, p) for g in opts[1].param_groups for p in g["params"]
           for n in [dict((id(q), k) for k, q in model.named_parameters())[id(p)]]}
    diffs = {n: (_full(b) - a.detach()).abs().max().item()
             for (n, a), b in zip(ref.named_parameters(), model.parameters())}
    return {"same_routes": routes[0] == got, "routes": got, "diff": max(diffs.values()),
            "worst": max(diffs, key=diffs.get),
            "kinds": {n: planned_kind(p) for n, p in model.named_parameters()}}


@pytest.mark.parametrize("W,seed,how", [(2, 1, "dropin"), (2, 2, "planned"), (3, 3, "dropin"), (3, 4, "replicate")])
def test_sampled_models_match_the_plain_run(W, seed, how):
    """Two Muon(model) steps sharded equal the plain run within float rounding, with the same rule
    for every parameter (the sampled half of the property; the wide half plans only)."""
    for r in get_pool(W).run(sampled_parity, seed, how, timeout=300):
        assert r["same_routes"], r["routes"]
        assert r["diff"] < 2e-5, (r["worst"], r["diff"])


class VocabRows(nn.Module):
    """A block matrix with as many rows as the embedding's vocabulary: an output head by the
    rule on the whole model, which the block's own drop-in call cannot see (found while building
    the property test)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(5, 7)
        self.blocks = nn.ModuleList([MLPBlock(7, 5)])  # gate/up: [5, 7], 5 rows = the vocabulary


def vocab_rows_check(explicit: bool) -> str:
    from matrixfsdp import MatrixRule, fully_shard

    W = dist.get_world_size()
    model, mesh = VocabRows(), init_device_mesh("cpu", (W,))
    kw = dict(matrix_rule=MatrixRule(vocab_sizes=(5,))) if explicit else {}
    fully_shard(model.blocks[0], mesh=mesh, **kw)
    try:
        fully_shard(model, mesh=mesh, **kw)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("W", [2, 3])
def test_dropin_root_refuses_kinds_its_blocks_could_not_see(W):
    msgs = get_pool(W).run(vocab_rows_check, False)
    assert len(set(msgs)) == 1, msgs
    assert msgs[0].startswith("matrixfsdp.fully_shard: drop-in calls planned 'blocks.0.gate.weight' as 'matrix', "
                              "but the routing rule on the whole VocabRows makes it 'elementwise'"), msgs[0]
    assert "MatrixRule(vocab_sizes=" in msgs[0] and "plan_owners(model, mesh" in msgs[0]
    assert get_pool(W).run(vocab_rows_check, True) == ["no error"] * W  # the fix it names
