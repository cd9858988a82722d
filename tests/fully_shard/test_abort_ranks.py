"""An aborted backward that left TP gradients on some ranks only (issue 29, item 1a).

``fully_shard`` + TP at (dp=1, tp=2) with SequenceParallel norms: a replicated norm weight's
gradient is ``Partial`` over TP until it is reduced. Both ranks abort the same backward, at
different points (an exception is rank-local: a NaN check, an OOM): rank 0 before anything
(a hook on the logits), rank 1 after the root's final norm has accumulated its ``Partial``
gradient (a hook on that norm's input). Before, ``begin_iteration`` *took* the partial gradients
it then dropped, which reduces a ``Partial`` one over TP: rank 1 issued a TP all-reduce that
rank 0 never did (a hang on NCCL; on gloo the next collectives mismatch). Now it drops them
untaken: no collective on any rank, and training goes on as the single-process reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

import matrixfsdp
from _harness import get_pool
from fully_shard.test_features import collective_spy
from fully_shard.test_tp import VOCAB, _diff
from fully_shard.test_tp_clients import BBlock
from tp.test_host_matrices import _opt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

D = 48


class Boom(RuntimeError):
    pass


def _boom(_grad):
    raise Boom("injected fault")


class SPNet(nn.Module):
    """Sequence-parallel residual stream, a final SequenceParallel norm at the root."""

    tp = None

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(BBlock(D, 80) for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx, tgt, fault=None):
        x = self.emb(idx)
        if self.tp is not None:
            x = DTensor.from_local(x, self.tp, [Replicate()], run_check=False).redistribute(self.tp, [Shard(1)])
        for b in self.blocks:
            x = b(x)
        if fault == "after_norm":  # fires once the norm's backward has run (its weight's grad is in)
            x.register_hook(_boom)
        x = self.norm(x)
        if self.tp is not None:
            x = x.full_tensor()  # backward: a local slice, no TP collective after the norm
        logits = self.head(x)
        if fault == "first":
            logits.register_hook(_boom)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1))

    loss = forward


def _batch(k):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g)


def abort_on_different_ranks() -> dict:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "tp"))
    tp = mesh["tp"]
    model = SPNet()
    ref = copy.deepcopy(model)
    model.tp = tp
    for b in model.blocks:
        parallelize_module(b, tp, {"norm": SequenceParallel(),
                                   "up": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
                                   "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    parallelize_module(model, tp, {"norm": SequenceParallel()})
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(BBlock,))
    for b in model.blocks:
        matrixfsdp.fully_shard(b, mesh=mesh["dp_shard"], plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh["dp_shard"], plan=plan)
    opt, ref_opt = _opt("muon", model), _opt("muon", ref)
    rank = tp.get_local_rank()
    out: dict = {}

    x, y = _batch(0)
    try:
        model(x, y, fault="first" if rank == 0 else "after_norm").backward()
    except Boom:
        out["raised"] = True
    ctx = matrixfsdp._fully_shard.get_state(model).root_ctx
    held = [(mp.fqn, type(g.placements[0]).__name__) for s in ctx.states for mp in s.group.params
            if mp.unsharded is not None and isinstance(g := mp.unsharded.grad, DTensor)]
    out["partial_held"] = sorted(f for f, pl in held if pl == "Partial")
    with collective_spy() as spy:
        ctx.begin_iteration()  # what the next forward's root pre-forward does first
    out["begin_iteration"] = list(spy["python"])
    out["left"] = [mp.fqn for s in ctx.states for mp in s.group.params
                   if mp.unsharded is not None and mp.unsharded.grad is not None]

    # the batch again, then one more: every rank issues the same collectives, as the reference
    out["steps"], worst = [], 0.0
    for k in range(2):
        x, y = _batch(k)
        opt.zero_grad()
        with collective_spy() as spy:
            model(x, y).backward()
            opt.step()
        out["steps"].append(list(spy["python"]))
        ref.loss(x, y).backward()
        worst = max(worst, _diff(model, ref, "grad"))
        ref_opt.step()
        ref_opt.zero_grad()
    out["diff"] = max(worst, _diff(model, ref, "param"))
    return out


def test_an_abort_with_partial_tp_grads_on_one_rank_issues_the_same_collectives_everywhere():
    r0, r1 = get_pool(2).run(abort_on_different_ranks, timeout=60)
    assert r0["raised"] and r1["raised"]
    # the fault left a Partial TP gradient on rank 1 alone: what made the old decision diverge
    assert r0["partial_held"] == [] and r1["partial_held"] == ["norm.bias", "norm.weight"], (r0, r1)
    # dropped untaken: no collective on either rank, nothing left behind
    assert r0["begin_iteration"] == r1["begin_iteration"] == [], (r0["begin_iteration"], r1["begin_iteration"])
    assert r0["left"] == r1["left"] == []
    assert r0["steps"] == r1["steps"] and all(r0["steps"])
    assert r0["diff"] < 1e-5 and r1["diff"] < 1e-5, (r0["diff"], r1["diff"])
