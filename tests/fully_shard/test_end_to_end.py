"""End to end with the real planner and optimizer: ``matrixfsdp.plan_owners`` ->
``fully_shard`` per block and on the model -> ``matrixfsdp.optim.Muon`` (fp32 Newton-Schulz),
against the same optimizer in one process on the whole batch.

(``fully_shard`` is imported from ``matrixfsdp._fully_shard`` until the package exports it.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _models import Block, TinyConfig, TinyDecoder, make_batch
from fully_shard.test_parity import compare_to_ref

import matrixfsdp
from matrixfsdp.placement.owned_tensor import owned_of
from matrixfsdp._fully_shard import comm_counter, fully_shard
from matrixfsdp.optim import Muon


def muon_groups(named, is_matrix):
    """Whole matrices get Muon; everything else (even-sharded embedding/head, tails) AdamW."""
    matrix, rest = [], []
    for fqn, p in named:
        if p.requires_grad:
            (matrix if is_matrix(fqn, p) else rest).append(p)
    return [dict(params=matrix, algorithm="muon"), dict(params=rest, algorithm="adamw")]


def train_e2e(steps: int) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = TinyConfig()
    model = TinyDecoder(cfg, seed=0)
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("dp_shard",))
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, plan=plan)
    fully_shard(model, mesh=mesh, plan=plan)
    kw = dict(lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3, adamw_eps=1e-6)

    def owned_matrix(fqn, p):
        info = owned_of(p)
        return info is not None and info.kind == "matrix" and p.ndim == 2

    opt = Muon(muon_groups(model.named_parameters(), owned_matrix), **kw)
    ref_opt = Muon(muon_groups(ref.named_parameters(), lambda f, p: plan[f].placement == "matrix"
                               and p.ndim == 2), **kw)
    per = 12 // W
    counter = comm_counter(model)
    out = {"loss_diff": 0.0, "step_calls": 0}
    for step in range(steps):
        x, y = make_batch(cfg, step, 12)
        loss = model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per],
                          use_extra=step % 2 == 1)
        loss.backward()
        ref_loss = sum(ref.loss(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per],
                                use_extra=step % 2 == 1) for r in range(W)) / W
        ref_loss.backward()
        if step == 0:
            out["grad_diff"] = compare_to_ref(model, ref, plan, rank, W, "grad")
        before = counter.total_calls
        opt.step()
        out["step_calls"] += counter.total_calls - before
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        out["loss_diff"] = max(out["loss_diff"], abs(g.item() / W - ref_loss.item()))
    out["param_diff"] = compare_to_ref(model, ref, plan, rank, W, "param")
    return out


@pytest.mark.parametrize("W", [2, 4])
def test_e2e_planner_muon(W):
    res = get_pool(W).run(train_e2e, 10)
    worst = {k: max(r[k] for r in res) for k in res[0]}
    print(f"\n[e2e W={W} plan_owners + matrixfsdp.optim.Muon, 10 steps] {worst}")
    assert worst["step_calls"] == 0
    assert worst["grad_diff"] <= 1e-6 and worst["loss_diff"] <= 1e-6
    assert worst["param_diff"] <= 1e-6
