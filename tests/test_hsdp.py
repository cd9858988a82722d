"""HSDP: ``fully_shard`` on a 2-D (dp_replicate, dp_shard) mesh, ``repeat`` and ``split``.

Every rank trains on its slice of the batch (by global rank) and, in the same process, a
single-process reference on the whole batch. After a backward the reduced gradients are compared
directly on every rank that holds a full sum (the step replica under ``split``; every owner under
``repeat``; every replica's rows of evenly sharded tensors), relative to the reference's size.
Then both take steps with the same optimizer and the parameters are compared after the next
forward has exchanged the step replicas' values.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp
from _harness import get_pool
from _models import Block, TinyConfig, TinyDecoder, make_batch
from matrixfsdp._fully_shard import comm_counter, fully_shard
from matrixfsdp.placement.owner import owner_of

BATCH = 12  # divisible by 4 and 6


def _mesh(R, S):
    if R == 1:  # the flat baseline
        return init_device_mesh("cpu", (S,), mesh_dim_names=("dp_shard",))
    return init_device_mesh("cpu", (R, S), mesh_dim_names=("dp_replicate", "dp_shard"))


def _shard(model, mesh, plan):
    for b in model.blocks:
        fully_shard(b, mesh=mesh, plan=plan)
    fully_shard(model, mesh=mesh, plan=plan)
    return model


def _opt(name, model, form="module"):
    params = model if form == "module" else model.parameters()
    if name == "muon":
        return matrixfsdp.optim.Muon(params, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    if name == "shampoo":
        return matrixfsdp.optim.Shampoo(params, lr=1e-3, precondition_frequency=2)
    return matrixfsdp.optim.SOAP(params, lr=1e-3, precondition_frequency=2)


def _rows(p, full, S):
    """The part of ``full`` this rank holds for ``p`` (its shard coordinate's rows), or None."""
    info = owner_of(p)
    mesh = p.device_mesh
    if info is not None:
        return full if info.holds else None
    c = -(-full.shape[0] // S)
    s = mesh.get_coordinate()[-1]
    return full[s * c:(s + 1) * c]


def _diff(model, ref, S, what):
    """Max relative diff of this rank's local grads/params vs the reference's rows; checks that
    exactly the ranks that should hold a gradient hold one."""
    refp = dict(ref.named_parameters())
    worst = 0.0
    for fqn, p in model.named_parameters():
        rp = refp[fqn]
        info = owner_of(p)
        if what == "grad":
            if rp.grad is None:
                assert p.grad is None, fqn
                continue
            expect_grad = info is None or info.is_local or (info.step_replica is None and info.holds) or not info.holds
            if info is not None and info.step_replica is not None and info.holds and not info.is_local:
                expect_grad = False
            if not expect_grad:
                assert p.grad is None, f"{fqn}: a non-step replica holds a gradient"
                continue
            assert p.grad is not None, f"{fqn}: no gradient on a rank that should hold the sum"
            mine, full = p.grad._local_tensor, rp.grad
        else:
            mine, full = p._local_tensor, rp.detach()
        exp = _rows(p, full, S)
        if exp is None or mine.numel() == 0:
            continue
        assert mine.shape == exp.shape, (fqn, mine.shape, exp.shape)
        scale = max(full.abs().max().item(), 1e-12)
        worst = max(worst, (mine - exp).abs().max().item() / scale)
    return worst


def hsdp_parity(R, S, mode, opt_name, steps=5, form="module"):
    rank = dist.get_rank()
    W = R * S
    cfg = TinyConfig()
    model = TinyDecoder(cfg, seed=0)
    ref = copy.deepcopy(model)
    mesh = _mesh(R, S)
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,), optimizer=opt_name, replica_step=mode)
    _shard(model, mesh, plan)
    opt, ref_opt = _opt(opt_name, model, form), _opt(opt_name, ref, form)
    per = BATCH // W
    out = {"grad": 0.0, "param": 0.0, "loss": 0.0, "step_calls": 0}
    counters = [comm_counter(model)] + ([comm_counter(model, "replicate")] if R > 1 else [])
    for step in range(steps):
        x, y = make_batch(cfg, step, BATCH)
        sl = slice(rank * per, (rank + 1) * per)
        loss = model.loss(x[sl], y[sl])
        loss.backward()
        ref_loss = sum(ref.loss(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]) for r in range(W)) / W
        ref_loss.backward()
        g = loss.detach().clone()
        dist.all_reduce(g)
        out["loss"] = max(out["loss"], abs(g.item() / W - ref_loss.item()))
        d = _diff(model, ref, S, "grad")
        if step == 0:  # the same parameters: the reduction alone
            out["grad0"] = d
        out["grad"] = max(out["grad"], d)
        for c in counters:
            c.reset()
        opt.step()
        out["step_calls"] += sum(c.total_calls for c in counters)
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    model.sync_params()
    out["param"] = _diff(model, ref, S, "param")
    out["replica_step"] = plan.replica_step
    return out


def _worst(res):
    return {k: max(r[k] for r in res) for k in ("grad0", "grad", "param", "loss", "step_calls")}


@pytest.mark.parametrize("mode", ["repeat", "split"])
def test_hsdp_parity_muon_2x2(mode):
    res = get_pool(4).run(hsdp_parity, 2, 2, mode, "muon")
    worst = _worst(res)
    flat = _worst(get_pool(4).run(hsdp_parity, 1, 4, "repeat", "muon"))
    print(mode, worst, "flat W=4:", flat)
    assert res[0]["replica_step"] == mode
    assert worst["grad0"] < 1e-6, worst
    assert worst["param"] < 1e-5, worst
    assert worst["loss"] < 1e-5, worst
    assert worst["step_calls"] == 0, worst
