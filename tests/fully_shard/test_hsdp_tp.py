"""HSDP x TP (issue 27): ``fully_shard`` on a 3-D ``("dp_replicate", "dp_shard", "tp")`` mesh.

torch's FSDP2 HSDP + TP pattern with owners: ``parallelize_module(block, mesh["tp"], ...)``,
``plan_owners(model, mesh)`` (the whole 3-D mesh), ``fully_shard(block, mesh=mesh["dp_replicate",
"dp_shard"], plan=plan)``. Each data-parallel rank ``(r, s)`` trains on its slice of the batch (the
TP ranks of a row share it); the reference is the plain model in one process over the whole batch.
Gradients are compared directly on every rank that holds a reduced sum (each rank's local tensor
against the matching part of the reference gradient; under ``split`` only the step replica holds
one), then parameters and losses after a few steps, in both ``replica_step`` modes. The step makes
only the TP hosts' all-to-alls, inside the stepping owners' TP rows: nothing across data
parallelism.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import matrixfsdp
from _harness import get_pool
from fully_shard.test_features import collective_spy
from fully_shard.test_tp import FwdNet, _expect, _global_batch, _merged, check_load, err, train_save_or_load
from matrixfsdp.placement.owner import owner_of
from tp.test_host_matrices import MLPBlock, _opt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NAMES = ("dp_replicate", "dp_shard", "tp")
H = 80


def _parallelize(model, tp_mesh):
    for b in model.blocks:
        parallelize_module(b, tp_mesh, {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})


def _build(R, S, T, mode, h=H):
    """(R, S, T) with R, T >= 1: HSDP x TP; T == 0: HSDP (R, S) without TP; S == 0: one process."""
    model = FwdNet(h)
    ref = copy.deepcopy(model)
    if S == 0:
        return None, model, ref, None
    if T == 0:
        mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=NAMES[:2])
        dp = mesh
    else:
        mesh = init_device_mesh("cpu", (R, S, T), mesh_dim_names=NAMES)
        _parallelize(model, mesh["tp"])
        dp = mesh["dp_replicate", "dp_shard"]
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(MLPBlock,), optimizer="muon", replica_step=mode)
    for b in model.blocks:
        matrixfsdp.fully_shard(b, mesh=dp, plan=plan)
    matrixfsdp.fully_shard(model, mesh=dp, plan=plan)
    return dp, model, ref, plan


def _dp_index(dp):
    """This rank's data-parallel index ``r * S + s`` (its slice of the batch) and the DP size."""
    if dp is None:
        return 0, 1
    c = dp.get_coordinate()
    return c[0] * dp.size(1) + c[1], dp.size()


def _grad_diff(model, ref):
    """Worst relative difference of this rank's local gradients against the reference; a rank that
    should hold a reduced sum and holds none (or a non-step replica that holds one) fails."""
    refp = dict(ref.named_parameters())
    worst = 0.0
    for f, p in model.named_parameters():
        b = refp[f].grad
        info = owner_of(p)
        exp = _expect(b, p)
        if exp is None or exp.numel() == 0:
            continue
        if info is not None and info.step_replica is not None and not info.is_local:
            assert p.grad is None, f"{f}: a non-step replica holds a gradient"
            continue
        if p.grad is None:
            return math.inf
        mine = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        assert mine.shape == exp.shape, (f, mine.shape, exp.shape)
        v = (mine.float() - exp).abs().max().item() / max(b.abs().max().item(), 1e-12)
        worst = max(worst, math.inf if math.isnan(v) else v)
    return worst


def _param_diff(model, ref):
    refp = dict(ref.named_parameters())
    worst = 0.0
    for f, p in model.named_parameters():
        exp = _expect(refp[f].detach(), p)
        if exp is None or exp.numel() == 0:
            continue
        mine = p._local_tensor if isinstance(p, DTensor) else p.detach()
        v = (mine - exp).abs().max().item() / max(refp[f].abs().max().item(), 1e-12)
        worst = max(worst, math.inf if math.isnan(v) else v)
    return worst


def hsdp_tp_parity(R, S, T, mode, steps=3):
    dp, model, ref, plan = _build(R, S, T, mode)
    d, W = _dp_index(dp)
    opt, ref_opt = _opt("muon", model), _opt("muon", ref)
    hosted = [p for p in model.parameters() if matrixfsdp.tp.tp_host_of(p) is not None]
    executors = {id(e): e for p in hosted if (e := matrixfsdp.tp.tp_host_of(p).executor) is not None}
    counters = [model.comm_counter(), model.comm_counter("replicate")]
    out = {"grad": 0.0, "loss": 0.0, "steps": [], "plan": (plan.replicas, plan.world_size, plan.tp),
           "replica_step": plan.replica_step, "hosted": len(hosted)}
    for step in range(steps):
        x, y = _global_batch(step, W)
        n = x.shape[0] // W
        loss = model(x[d * n:(d + 1) * n], y[d * n:(d + 1) * n])
        loss.backward()
        ref_loss = ref.loss(x, y)
        ref_loss.backward()
        g = loss.detach().clone()
        dist.all_reduce(g)  # every TP rank of a row has its row's loss: the mean over the world
        out["loss"] = max(out["loss"], abs(g.item() / dist.get_world_size() - ref_loss.item()) / ref_loss.item())
        out["grad"] = max(out["grad"], _grad_diff(model, ref))
        # the global norm across replicas, shards and TP (no clipping at this max_norm)
        norm = matrixfsdp.clip_grad_norm_(model.parameters(), 1e9).item()
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
        out["norm"] = max(out.get("norm", 0.0), abs(norm - ref_norm) / ref_norm)
        for c in counters:
            c.reset()
        c0 = {k: (e.calls["all_to_all"], e.host_steps) for k, e in executors.items()}
        with collective_spy() as spy:
            opt.step()
        out["steps"].append({
            "python": spy["python"],
            "dispatcher": spy["dispatcher"],
            "dp_calls": sum(c.total_calls for c in counters),
            "a2a": sum(e.calls["all_to_all"] - c0[k][0] for k, e in executors.items()),
            "host_steps": sum(e.host_steps - c0[k][1] for k, e in executors.items()),
        })
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    model.sync_params()  # split: the step replicas' last values reach the other replicas
    out["param"] = _param_diff(model, ref)
    refp = dict(ref.named_parameters())
    out["full"] = max(((matrixfsdp.full_tensor(p) - refp[f].detach()).abs().max()
                       / refp[f].detach().abs().max()).item() for f, p in model.named_parameters())
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # DCP's full state dict
    out["full_sd"] = (sorted(sd) == sorted(refp), max(((sd[f] - refp[f].detach()).abs().max()
                                                       / refp[f].detach().abs().max()).item() for f in refp))
    return out


@pytest.mark.parametrize("mode", ["repeat", "split"])
def test_hsdp_tp_parity_and_step_collectives(mode):
    """(2, 2, 2): gradients within 1e-6 of the reference's largest entry on every rank that holds
    a sum, losses, parameters, full tensors and DCP's full state dict after 3 Muon steps within
    1e-5, ``clip_grad_norm_``'s global norm within 1e-5 of torch's; the step makes nothing but the
    hosts' all-to-alls (in the stepping rows only)."""
    res = get_pool(8).run(hsdp_tp_parity, 2, 2, 2, mode)
    for r in res:
        print(mode, {k: r[k] for k in ("grad", "loss", "param", "full", "norm", "full_sd", "hosted")})
        assert r["plan"] == (2, 2, 2) and r["replica_step"] == mode, r
        assert r["grad"] < 1e-6 and r["loss"] < 1e-6 and r["param"] < 1e-5 and r["full"] < 1e-5, r
        assert r["norm"] < 1e-5 and r["full_sd"][0] and r["full_sd"][1] < 1e-5, r
        for s in r["steps"]:
            assert s["dp_calls"] == 0, s  # nothing over dp_shard or dp_replicate
            assert all(c.endswith("all_to_all_single") for c in s["python"]), s["python"]
            assert len(s["python"]) == s["a2a"], s
            assert all("alltoall" in e.lower().replace("_", "") or "record_param_comms" in e
                       for e in s["dispatcher"]), s["dispatcher"]
    assert res[0]["hosted"] == 4
    # every TP matrix is stepped by one host per stepping replica: R of them under repeat, one under split
    per_step = 4 * (2 if mode == "repeat" else 1)
    for k in range(3):
        assert sum(r["steps"][k]["host_steps"] for r in res) == per_step


# ------------------------------------------------------------------------------------ checkpoints
def hsdp_tp_checkpoint(root, R, S, T, mode, save):
    """Train 2 steps and save (``save``), or load; then one more step. Full parameters after the
    save/load and after the extra step, and the whole optimizer state this rank holds."""
    dp, model, _, _ = _build(R, S, T, mode)
    d, W = _dp_index(dp)
    return train_save_or_load(root, model, _opt("muon", model), d, W, 4, save)


@pytest.mark.parametrize("mode", ["repeat", "split"])
def test_hsdp_tp_checkpoints_reshard(tmp_path, mode):
    """Saved at (2, 2, 2), loaded at (1, 2, 2) and at HSDP (2, 2) without TP; a (2, 2) checkpoint
    without TP loaded at (2, 2, 2): parameters and every whole optimizer state bitwise, one more
    step within 1e-6 of the saving layout's."""
    path = str(tmp_path / "a")
    saved = get_pool(8).run(hsdp_tp_checkpoint, path, 2, 2, 2, mode, True)
    full, state, after = saved[0][0], _merged(saved, 1), saved[0][2]
    assert {k for k in state if k.endswith("momentum_buffer")} == {
        f"blocks.{i}.{n}.weight.momentum_buffer" for i in range(2) for n in ("up", "down")}
    check_load("(1,2,2)", get_pool(4).run(hsdp_tp_checkpoint, path, 1, 2, 2, mode, False), full, state, after)
    check_load("(2,2) no TP", get_pool(4).run(hsdp_tp_checkpoint, path, 2, 2, 0, mode, False), full, state, after)
    path = str(tmp_path / "b")
    saved = get_pool(4).run(hsdp_tp_checkpoint, path, 2, 2, 0, mode, True)
    check_load("no TP -> (2,2,2)", get_pool(8).run(hsdp_tp_checkpoint, path, 2, 2, 2, mode, False),
                saved[0][0], _merged(saved, 1), saved[0][2])


def hsdp_tp_full_state_roundtrip(mode):
    """torch DCP's full state dicts (model and optimizer) gathered at (2, 2, 2) and loaded with
    broadcast_from_rank0 into a fresh model and optimizer; one more step on each agrees."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_optimizer_state_dict

    dp, model, _, _ = _build(2, 2, 2, mode)
    opt = _opt("muon", model)
    d, W = _dp_index(dp)

    def step(m, o, k):
        x, y = _global_batch(k, W)
        n = x.shape[0] // W
        m(x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]).backward()
        o.step()
        o.zero_grad()

    for k in range(2):
        step(model, opt, k)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    msd, osd = copy.deepcopy(msd), copy.deepcopy(osd)  # rank 0's dict aliases the owners' state
    _, model2, _, _ = _build(2, 2, 2, mode)
    opt2 = _opt("muon", model2)
    rank0 = dist.get_rank() == 0
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model2, msd if rank0 else {}, options=load)
    set_optimizer_state_dict(model2, opt2, osd if rank0 else {}, options=load)
    step(model, opt, 2)
    step(model2, opt2, 2)
    a = {f: matrixfsdp.full_tensor(p) for f, p in model.named_parameters()}
    b = {f: matrixfsdp.full_tensor(p) for f, p in model2.named_parameters()}
    keys = {k: sorted(v) for k, v in osd["state"].items()} if rank0 else None
    return max(((a[f] - b[f]).abs().max() / a[f].abs().max()).item() for f in a), keys


@pytest.mark.parametrize("mode", ["repeat", "split"])
def test_hsdp_tp_full_state_dict_roundtrip(mode):
    """At (2, 2, 2) DCP's full optimizer state dict gathers the hosted matrices' momentum whole:
    under ``repeat`` every replica's TP hosts present their state within their replica; under
    ``split`` the step replica's host presents it and the owner row of the other replica, which
    got no gradient, presents the same keys empty (its step receipt; before, it presented none
    and DCP's per-key gather hung). Loaded back, one more step agrees bitwise."""
    res = get_pool(8).run(hsdp_tp_full_state_roundtrip, mode, timeout=180)
    assert all(r[0] == 0.0 for r in res), [r[0] for r in res]
    keys = res[0][1]
    assert sum(v == ["momentum_buffer"] for v in keys.values()) == 4, keys


# ------------------------------------------------------------------------------------ refusals
def hsdp_tp_refusals():
    """A 3-D mesh with wrong names or order, to plan_owners and fully_shard; the whole 3-D mesh to
    fully_shard. Raised on every rank alike (no rank hangs)."""
    out = {}

    model = FwdNet(H)
    for key, names in (("order", ("dp_shard", "dp_replicate", "tp")), ("tp_first", ("tp", "dp_replicate", "dp_shard")),
                       ("names", ("rep", "shard", "tp"))):
        bad = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
        out[f"plan_{key}"] = err(lambda: matrixfsdp.plan_owners(model, bad, block_types=(MLPBlock,)))
        out[f"shard_{key}"] = err(lambda: matrixfsdp.fully_shard(FwdNet(H).blocks[0], mesh=bad))
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=NAMES)
    out["whole_mesh"] = err(lambda: matrixfsdp.fully_shard(FwdNet(H).blocks[0], mesh=mesh))
    return out


def test_hsdp_tp_refusals():
    res = get_pool(8).run(hsdp_tp_refusals)
    assert all(r == res[0] for r in res), res  # the same error on every rank
    r = res[0]
    print(r)
    for key, names in (("order", "('dp_shard', 'dp_replicate', 'tp')"), ("tp_first", "('tp', 'dp_replicate', 'dp_shard')"),
                       ("names", "('rep', 'shard', 'tp')")):
        for api in ("plan_owners", "matrixfsdp.fully_shard"):
            msg = r[f"{'plan' if api == 'plan_owners' else 'shard'}_{key}"]
            assert msg.startswith(
                f"ValueError: {api}: a 3-D mesh must be HSDP x TP with its dimensions named "
                "('dp_replicate', 'dp_shard', 'tp') in this order (dimension 0 replicates, 1 shards, 2 is "
                "tensor-parallel; dimension 1 may be named otherwise, e.g. torchtitan's 'fsdp'), but this "
                f"mesh of shape (2, 2, 2) has dimension names {names}"), msg
    assert ("got the ('dp_replicate', 'dp_shard', 'tp') mesh of shape (2, 2, 2); pass its data-parallel "
            "dimensions, mesh['dp_replicate', 'dp_shard']") in r["whole_mesh"], r["whole_mesh"]
