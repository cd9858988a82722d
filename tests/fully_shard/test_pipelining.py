"""fully_shard under torch's pipelining schedules: PP=2 x DP=2 on 4 gloo processes.

Each pipeline stage is a model part (a deep copy of the whole model with the other stages' layers
deleted, as torchtitan splits models, so its parameter names are the whole model's). Owners are
planned per stage over that stage's data-parallel mesh (``mesh["dp"]`` of a ``("pp", "dp")``
mesh): the digest exchange and every collective of ``fully_shard``'s initialization run in that
group only, so the two stages, whose plans differ, never meet. The schedules drive each microbatch
through a plain ``torch.autograd.backward`` (our modules are not torch ``FSDPModule``s, so
``stage.py`` calls none of FSDP2's controls on them): every microbatch's backward reduces its
gradients to their owners, which accumulate them, and ``scale_grads`` divides the owned gradients
by the microbatch count. The reference is the whole model, unsharded, in one process, on the
whole global batch. The optimizer step makes no collective.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp
from _harness import get_pool
from fully_shard.test_features import collective_spy

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

H = 16
N_LAYERS = 4
GLOBAL_BATCH = 8
MAX_NORM = 0.5  # below the gradients' norm: clipping is active
MICROBATCHES = 4  # per data-parallel rank: microbatches of GLOBAL_BATCH / DP / MICROBATCHES rows


class MLPBlock(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.up = nn.Linear(h, 2 * h)
        self.down = nn.Linear(2 * h, h)
        self.norm = nn.LayerNorm(h)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    """``layers`` (a ModuleDict, as torchtitan's decoders) then ``head`` (a Linear, or with
    ``tail="norm"`` a LayerNorm); a stage keeps some layers and, on the last stage, the head."""

    def __init__(self, h: int = H, n_layers: int = N_LAYERS, seed: int = 0, tail: str = "linear"):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleDict({str(i): MLPBlock(h) for i in range(n_layers)})
        self.head = nn.Linear(h, h) if tail == "linear" else nn.LayerNorm(h)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


def split(model: Net, stage: int, n_stages: int, layout: str = "even") -> Net:
    """Stage ``stage`` of ``n_stages``: ``N_LAYERS / n_stages`` consecutive layers each, or with
    ``layout="no_matrix"`` every layer on the first stages and the last one the head alone."""
    part = copy.deepcopy(model)
    n = len(model.layers)
    if layout == "no_matrix":
        per = n // (n_stages - 1)
        keep = set() if stage == n_stages - 1 else {str(i) for i in range(stage * per, (stage + 1) * per)}
    else:
        per = n // n_stages
        keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != n_stages - 1:
        part.head = None
    return part


def _mse(out, tgt):
    return nn.functional.mse_loss(out, tgt)


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, H, generator=g), torch.randn(GLOBAL_BATCH, H, generator=g)


def _opt(model):
    return matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-2)


def _stage_indices(schedule: str, pp_rank: int, pp: int) -> list[int]:
    if schedule == "interleaved":  # torch's loop style: rank r holds stages r, r + pp
        return [pp_rank, pp_rank + pp]
    return [pp_rank]


def _schedule(name: str, stages: list, n_mb: int, scale_grads: bool = True):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_microbatches=n_mb, loss_fn=_mse, scale_grads=scale_grads)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return cls(stages[0], n_microbatches=n_mb, loss_fn=_mse, scale_grads=scale_grads)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    v = (a.float() - b.float()).abs().max().item() / max(b.abs().max().item(), 1e-12)
    return math.inf if math.isnan(v) else v


def pp_parity(schedule: str, steps: int = 3, pp: int = 2, layout: str = "even", deferred: bool = False) -> dict:
    """Pool worker (W = pp * dp ranks): the pipelined, owner-sharded run against the whole model.
    ``layout="no_matrix"``: the last stage holds a LayerNorm alone (no matrix, no layer).
    ``deferred``: the microbatches accumulate unreduced (``set_requires_gradient_sync(False)``)
    and ``reduce_accumulated_grads()`` reduces once per step; the schedule does not scale
    (``scale_grads=False``), the divide factor takes the microbatch count instead."""
    from torch.distributed.pipelining import PipelineStage

    from matrixfsdp._fully_shard import comm_counter

    W = dist.get_world_size()
    dp = W // pp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    whole = Net(tail="norm" if layout == "no_matrix" else "linear")
    ref = copy.deepcopy(whole)
    idx = _stage_indices(schedule, pp_rank, pp)
    n_stages = pp * len(idx)
    parts, stages, plans = [], [], []
    for s in idx:
        part = split(whole, s, n_stages, layout)
        # block_types None for a stage without layers: planned (and sharded) as its root alone
        plan = matrixfsdp.plan_owners(part, mesh["dp"], block_types=(MLPBlock,) if len(part.layers) else None)
        for layer in part.layers.values():
            matrixfsdp.fully_shard(layer, mesh=mesh["dp"], plan=plan)
        matrixfsdp.fully_shard(part, mesh=mesh["dp"], plan=plan)
        parts.append(part)
        plans.append(plan.digest)
        stages.append(PipelineStage(part, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group()))
    sched = _schedule(schedule, stages, MICROBATCHES, scale_grads=not deferred)
    if deferred:
        for part in parts:
            part.set_gradient_divide_factor(float(dp * MICROBATCHES))
    opts, ref_opt = [_opt(p) for p in parts], _opt(ref)
    has_first, has_last = 0 in idx, n_stages - 1 in idx
    out = {"pp": pp_rank, "dp": d, "digests": plans, "losses": [], "ref_losses": [], "grad": [],
           "norm": [], "step_python": [], "step_dispatcher": [], "reduce_calls": [], "owned": 0}
    counter = comm_counter(parts[0])  # one per data-parallel group: every part of this rank counts on it
    assert all(comm_counter(p) is counter for p in parts)
    n = GLOBAL_BATCH // dp
    for step in range(steps):
        x, y = _batch(step)
        xl, yl = x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]
        counter.reset()
        losses: list = []
        kw = {"target": yl, "losses": losses} if has_last else {}
        for part in parts:
            part.set_requires_gradient_sync(not deferred)
        if has_first:
            sched.step(xl, **kw)
        else:
            sched.step(**kw)
        if deferred:
            for part in parts:
                part.set_requires_gradient_sync(True)
            if step == 0:
                with pytest.raises(ValueError, match=r"reduce_accumulated_grads: call it on the root"):
                    next(iter(parts[0].layers.values())).reduce_accumulated_grads()
            out.setdefault("flushed", []).append([part.reduce_accumulated_grads() for part in parts])
        out["reduce_calls"].append(counter.calls.get("reduce_scatter", 0))
        if has_last:
            out["losses"].append(torch.stack(losses).mean().item())
        ref_loss = _mse(ref(x), y)
        ref_loss.backward()
        out["ref_losses"].append(ref_loss.item())
        # clipping spans the stages: one more all-reduce over the pipeline mesh
        norm = matrixfsdp.clip_grad_norm_([p for part in parts for p in part.parameters()], MAX_NORM,
                                          pp_mesh=mesh["pp"])
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        out["norm"].append(_rel(norm, ref_norm))
        refp = dict(ref.named_parameters())
        worst = 0.0
        for part in parts:
            for f, p in part.named_parameters():
                g = matrixfsdp.full_tensor(p.grad) if p.grad is not None else None
                if g is None:
                    worst = math.inf
                    continue
                worst = max(worst, _rel(g, refp[f].grad))
        out["grad"].append(worst)
        with collective_spy() as spy:
            for o in opts:
                o.step()
        out["step_python"].append(spy["python"])
        out["step_dispatcher"].append(spy["dispatcher"])
        ref_opt.step()
        for o in opts:
            o.zero_grad()
        ref_opt.zero_grad()
    refp = dict(ref.named_parameters())
    out["param"] = max(_rel(matrixfsdp.full_tensor(p), refp[f].detach())
                       for part in parts for f, p in part.named_parameters())
    # one reduction per block with parameters per microbatch (each microbatch's backward reduces),
    # or per step when deferred
    per = 1 if deferred else MICROBATCHES
    out["blocks"] = [len(part.layers) + (part.head is not None) for part in parts]
    out["expected_reduces"] = sum(per * b for b in out["blocks"])
    out["owned"] = sum(1 for part in parts for p in part.parameters()
                       if (o := matrixfsdp.owned_of(p)) is not None and o.kind == "matrix")
    # the head is an output head (AdamW) by the default rule
    out["matrices"] = sum(1 for part in parts for f, p in part.named_parameters() if p.ndim == 2 and "head" not in f)
    return out


@pytest.mark.parametrize("schedule, layout, deferred", [
    ("gpipe", "even", False), ("1f1b", "even", False), ("interleaved", "even", False), ("1f1b", "no_matrix", False),
    ("1f1b", "even", True), ("interleaved", "even", True)])
def test_pipelining_parity_and_step_collectives(schedule, layout, deferred):
    res = get_pool(4).run(pp_parity, schedule, layout=layout, deferred=deferred, timeout=180)
    for r in res:
        assert max(r["grad"]) < 1e-5, (r["pp"], r["dp"], r["grad"])
        assert r["param"] < 1e-5, (r["pp"], r["dp"], r["param"])
        # a stage without a matrix is handled: evenly sharded, stepped element-wise
        assert r["owned"] == r["matrices"] and (r["owned"] > 0) == (layout == "even" or r["pp"] == 0), r
        assert max(r["norm"]) < 1e-5, r["norm"]
        assert all(c == r["expected_reduces"] for c in r["reduce_calls"]), (r["reduce_calls"], r["expected_reduces"])
        if deferred:
            assert all(f == r["blocks"] for f in r["flushed"]), (r["flushed"], r["blocks"])
        assert all(not s for s in r["step_python"]), r["step_python"]
        assert all(not s for s in r["step_dispatcher"]), r["step_dispatcher"]
    # each stage checked its own plan in its own group: the digests agree within a stage
    by_stage = {}
    for r in res:
        by_stage.setdefault(r["pp"], set()).add(tuple(r["digests"]))
    assert all(len(v) == 1 for v in by_stage.values()), by_stage
    assert len({d for v in by_stage.values() for d in v}) == len(by_stage), by_stage  # the stages' plans differ
    last = [r for r in res if r["losses"]]
    assert len(last) == 2
    for step in range(len(last[0]["losses"])):
        got = sum(r["losses"][step] for r in last) / len(last)  # mean over the dp ranks
        ref = last[0]["ref_losses"][step]
        assert abs(got - ref) <= 1e-5 * abs(ref), (step, got, ref)


def shared_across_stages() -> list[str]:
    """Pool worker (W=2, one data-parallel group): two stages of one rank sharing a parameter."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    whole = Net()
    parts = [split(whole, s, 2) for s in range(2)]
    parts[1].layers["2"].up.weight = parts[0].layers["0"].up.weight  # tied across the stages
    errors = []
    for part in parts:
        plan = matrixfsdp.plan_owners(part, mesh, block_types=(MLPBlock,))
        try:
            for layer in part.layers.values():
                matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
            matrixfsdp.fully_shard(part, mesh=mesh, plan=plan)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_parameter_shared_across_stages_is_refused():
    """A parameter of two stages held by one rank (interleaved schedules) is refused by the second
    stage's ``fully_shard`` on every rank of its data-parallel group alike. Across ranks a tie cannot
    exist (each rank builds its own stages), so a tied model must be untied before the split
    (torchtitan refuses tied embeddings with PP)."""
    res = get_pool(2).run(shared_across_stages, timeout=60)
    assert res[0] == res[1] and len(res[0]) == 1, res
    assert "'up.weight' of MLPBlock is already managed by the fully_shard call on MLPBlock" in res[0][0], res
    assert "two pipeline stages of one rank" in res[0][0], res


def test_stage_rule_counts_the_whole_models_vocabulary():
    """A stage without the embedding classifies a weight with the vocabulary's row count as the
    unsplit model does (an output head: element-wise) once the rule is told the vocabulary
    (``MatrixRule(vocab_sizes=)``); without it that weight becomes a matrix."""

    class Whole(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 8)
            self.proj = nn.Linear(8, 32)  # 32 rows: the vocabulary size
            self.mlp = nn.Linear(8, 8)

    whole = Whole()
    stage = copy.deepcopy(whole)
    stage.emb = None
    assert matrixfsdp.MatrixRule().kinds(whole)["proj.weight"].kind == "elementwise"
    assert matrixfsdp.MatrixRule().kinds(stage)["proj.weight"].kind == "matrix"
    rule = matrixfsdp.MatrixRule(vocab_sizes=(32,))
    assert {f: k.kind for f, k in rule.kinds(stage).items()} == {
        f: k.kind for f, k in matrixfsdp.MatrixRule().kinds(whole).items() if not f.startswith("emb")}
    plan = matrixfsdp.plan_owners(stage, 2, matrix_rule=rule)
    assert plan["proj.weight"].placement != "matrix" and plan["mlp.weight"].placement == "matrix"
    with pytest.raises(ValueError, match=r"MatrixRule: vocab_sizes must hold positive ints, got vocab_sizes=\(0,\)"):
        matrixfsdp.MatrixRule(vocab_sizes=(0,))
