"""Review of ``fully_shard`` over tensor-parallel models (torch's FSDP2 + TP pattern) as an outside
user at (dp=2, tp=2), against one process on the same global batch (each dp rank its slice).

The first tests are the failures found (each failed before its fix, see the commit log of branch
``review-tp``); ``test_outsider_tour`` runs what worked, so it stays working: gradient accumulation
without sync, post-accumulate-grad hooks, an exception in backward, ``reshard_after_forward=False``,
mixed precision against a flat ``fully_shard`` bf16 run, SequenceParallel norms and Colwise biases
(Replicate and 1-D Shard(0) TP parameters), TP parameters at the root with tied embeddings, and
the refusals of a plan without the 2-D mesh and of mismatched meshes.
"""

from __future__ import annotations

import copy
import math
import os

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
from tp.test_host_matrices import MLPBlock, _opt
from fully_shard.test_tp import VOCAB, FwdNet, _diff, _expect, _global_batch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

D = 48


# ============================================================================ helpers
def _build(dp, tp, *, meta=False, h=80, **fs_kw):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    ref = FwdNet(h)
    if meta:
        with torch.device("meta"):
            model = FwdNet(h)
    else:
        model = copy.deepcopy(ref)
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(MLPBlock,))
    for b in model.blocks:
        matrixfsdp.fully_shard(b, mesh=mesh["dp_shard"], plan=plan, **fs_kw)
    matrixfsdp.fully_shard(model, mesh=mesh["dp_shard"], plan=plan, **fs_kw)
    return mesh, model, ref


def _raise_in_backward(model, d):
    """One forward whose backward raises (a hook on block 1's output); whether it raised."""
    def boom(m, i, o):
        o.register_hook(lambda g: (_ for _ in ()).throw(KeyError("boom")))

    h = model.blocks[1].register_forward_hook(boom)
    x, y = _global_batch(0, 2)
    try:
        model(x[2 * d:2 * d + 2], y[2 * d:2 * d + 2]).backward()
    except KeyError:
        return True
    finally:
        h.remove()
    return False


def _fulls(model):
    return {f: matrixfsdp.full_tensor(p).detach().clone() for f, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def _step(model, opt, mesh, k, ref=None, ref_opt=None):
    dp = mesh["dp_shard"].size()
    d = mesh["dp_shard"].get_local_rank()
    x, y = _global_batch(k, dp)
    n = x.shape[0] // dp
    model(x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]).backward()
    if ref is not None:
        ref.loss(x, y).backward()
    opt.step()
    opt.zero_grad()
    if ref_opt is not None:
        ref_opt.step()
        ref_opt.zero_grad()


# ============================================================================ findings
def meta_init_set_full():
    """Meta-device init, to_empty, set_full_ from the reference's state dict: set_full_ copied the
    whole tensor into an owned TP parameter's local tensor, which is its TP shard."""
    mesh, model, ref = _build(2, 2, meta=True)
    model.to_empty(device="cpu")
    sd = ref.state_dict()
    for f, p in model.named_parameters():
        matrixfsdp.set_full_(p, sd[f])
    full = _fulls(model)
    out = {"full": max(_rel(full[k], sd[k]) for k in sd)}
    d = mesh["dp_shard"].get_local_rank()
    x, y = _global_batch(0, 2)
    model(x[2 * d:2 * d + 2], y[2 * d:2 * d + 2]).backward()
    ref.loss(x, y).backward()
    out["grad"] = _diff(model, ref, "grad")
    return out


def test_set_full_on_tp_owned_params_after_meta_init():
    # before: RuntimeError "The size of tensor a (40) must match the size of tensor b (80)" on
    # the owners' TP rows (blocks.*.up.weight / down.weight)
    for r in get_pool(4).run(meta_init_set_full, timeout=60):
        assert r["full"] == 0.0 and r["grad"] < 1e-6, r


def adamw_group_tp():
    """A matrixfsdp optimizer whose TP matrices are in an ``algorithm="adamw"`` group."""
    mesh, model, ref = _build(2, 2)
    mk = lambda m: matrixfsdp.optim.Muon([dict(params=list(m.parameters()), algorithm="adamw")],  # noqa: E731
                                         lr=0.02, adamw_lr=1e-2, weight_decay=0.1)
    opt, ref_opt = mk(model), mk(ref)
    _step(model, opt, mesh, 0, ref, ref_opt)
    refp = dict(ref.named_parameters())
    return {f: _rel(matrixfsdp.full_tensor(p), refp[f].detach()) for f, p in model.named_parameters()}


def test_adamw_group_steps_every_tp_shard():
    # before: only the TP host's shard moved (up.weight 6.6e-2, down.weight 8.3e-2 off the
    # reference after one step); AdamW's first step is sign-like, so a few elements whose
    # gradient is ~eps differ by ~1e-5 in any layout (flat fully_shard too)
    for r in get_pool(4).run(adamw_group_tp, timeout=60):
        assert max(r.values()) < 1e-3, r


def dcp_full_optim_roundtrip(opt_name):
    """torch DCP's full state dicts, gathered and loaded with broadcast_from_rank0 into a fresh
    model and optimizer; one more step on each agrees."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    mk = (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)) if opt_name == "adamw" else (lambda m: _opt(opt_name, m))
    mesh, model, _ = _build(2, 2)
    opt = mk(model)
    for k in range(2):
        _step(model, opt, mesh, k)
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    # (rank 0's full dict aliases the state the owners keep; a copy keeps the two runs apart)
    msd, osd = copy.deepcopy(msd), copy.deepcopy(osd)
    _, model2, _ = _build(2, 2)
    opt2 = mk(model2)
    rank0 = dist.get_rank() == 0
    # (two calls: torch's combined set_state_dict skips the model on ranks passing {}, and rank 0
    # then waits in its broadcast alone, with stock FSDP2 too)
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model2, msd if rank0 else {}, options=load)
    set_optimizer_state_dict(model2, opt2, osd if rank0 else {}, options=load)
    a, b = _fulls(model), _fulls(model2)
    out = {"params_equal": all(torch.equal(a[k], b[k]) for k in a),
           "osd_keys": {k: sorted(v) for k, v in osd["state"].items()} if rank0 else None}
    _step(model, opt, mesh, 2)
    _step(model2, opt2, mesh, 2)
    a, b = _fulls(model), _fulls(model2)
    out["after_step"] = max(_rel(b[k], a[k]) for k in a)
    return out


@pytest.mark.parametrize("opt_name", ["muon", "soap", "adamw"])
def test_dcp_full_state_dict_broadcast_roundtrip(opt_name):
    # before (muon): get_optimizer_state_dict(full_state_dict=True) hung in OwnedDTensor.full_tensor:
    # a TP matrix's state was on its host's mesh on the host, absent on the rest of the host's TP
    # row and on the other row's owner mesh, so the ranks broadcast over different groups; and a
    # fresh Muon's state-initialization step made the host's state TP-shard shaped
    # before (soap): after the load one more step was 2.6e-2 off: the owners' eigenbases QL/QR
    # (eigh's column-major output) were broadcast by gloo as raw storage, so every other rank got
    # them scrambled (flat fully_shard too)
    res = get_pool(4).run(dcp_full_optim_roundtrip, opt_name, timeout=60)
    for r in res:
        assert r["params_equal"] and r["after_step"] == 0.0, r
    if opt_name == "muon":
        keys = res[0]["osd_keys"]
        assert all(keys[f"blocks.{i}.{n}.weight"] == ["momentum_buffer"] for i in range(2) for n in ("up", "down")), keys


def checkpoint_stock_adamw(root):
    """matrixfsdp.checkpoint save/load with torch.optim.AdamW on the sharded TP model."""
    import matrixfsdp.checkpoint as mckpt

    mesh, model, ref = _build(2, 2)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for k in range(2):
        _step(model, opt, mesh, k, ref, ref_opt)
    out = {"param": _diff(model, ref, "param")}
    path = os.path.join(root, "ckpt")
    mckpt.save(path, model, opt)
    _, model2, _ = _build(2, 2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    mckpt.load(path, model2, opt2)
    _step(model, opt, mesh, 2)
    _step(model2, opt2, mesh, 2)
    a, b = _fulls(model), _fulls(model2)
    out["after_step"] = max(_rel(b[k], a[k]) for k in a)
    return out


def test_checkpoint_round_trip_with_stock_adamw(tmp_path):
    # before: the step after load raised "aten::lerp_ combines DTensors on different meshes
    # ['tp_host0@...', 'tp_owned_by_rank0@...']": the loader placed a stock optimizer's state of
    # TP matrices whole on the TP host (matrixfsdp.optim's layout), not like the parameter on the
    # owner's TP row (and gave the row's other ranks none)
    for r in get_pool(4).run(checkpoint_stock_adamw, str(tmp_path), timeout=60):
        assert r["param"] < 1e-4 and r["after_step"] == 0.0, r


def after_1d_tp_mesh():
    """A 1-D "tp" mesh over the same ranks created earlier in the process (host_matrices, another
    model, a previous test): torch hands the parallelized parameters that cached, equal mesh,
    whose root is itself, not the ("dp_shard", "tp") mesh."""
    from tp.test_host_matrices import _tp_model

    _tp_model(80, 2)
    mesh, model, ref = _build(1, 2)
    opt, ref_opt = _opt("muon", model), _opt("muon", ref)
    _step(model, opt, mesh, 0, ref, ref_opt)
    return _diff(model, ref, "param")


def test_fsdp_tp_after_an_earlier_1d_tp_mesh():
    # before: ValueError "the data-parallel mesh DeviceMesh((dp_shard=1) ...) and the parameters'
    # TP mesh DeviceMesh((tp=2) ...) must be two named dimensions of one mesh" (also
    # tests/fully_shard/test_tp.py[muon-1-2-80] after tests/tp/test_host_matrices.py in one session)
    for r in get_pool(2).run(after_1d_tp_mesh, timeout=60):
        assert r < 1e-5, r


# ============================================================================ what works
class BBlock(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h, bias=True)
        self.down = nn.Linear(h, d, bias=True)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class BNet(nn.Module):
    """Biased blocks; ``tp`` set: the residual stream is sequence-sharded between the blocks."""

    tp = None

    def __init__(self, h=80, tied=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(BBlock(D, h) for _ in range(2))
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx, tgt):
        x = self.emb(idx)
        if self.tp is not None:
            x = DTensor.from_local(x, self.tp, [Replicate()], run_check=False).redistribute(self.tp, [Shard(1)])
        for b in self.blocks:
            x = b(x)
        if self.tp is not None:
            x = x.full_tensor()
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), tgt.reshape(-1))

    loss = forward


def _parity(mesh, model, ref, steps=2, opt=None):
    opt, ref_opt = opt or _opt("muon", model), _opt("muon", ref)
    d = mesh["dp_shard"].get_local_rank()
    grad = None
    for k in range(steps):
        x, y = _global_batch(k, 2)
        model(x[2 * d:2 * d + 2], y[2 * d:2 * d + 2]).backward()
        ref.loss(x, y).backward()
        grad = _diff(model, ref, "grad") if grad is None else grad
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    return max(grad, _diff(model, ref, "param"))


def _wrap(model, mesh):
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(BBlock,))
    for b in model.blocks:
        matrixfsdp.fully_shard(b, mesh=mesh["dp_shard"], plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh["dp_shard"], plan=plan)


def outsider_tour():
    out = {}
    d = None

    # gradient accumulation: a no-sync micro-batch, then a synced one
    mesh, model, ref = _build(2, 2)
    d = mesh["dp_shard"].get_local_rank()
    seen = []
    for f, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda t, f=f: seen.append(f))
    model.set_requires_gradient_sync(False)
    for k in range(2):
        x, y = _global_batch(10 + k, 2)
        if k == 1:
            model.set_requires_gradient_sync(True)
        model(x[2 * d:2 * d + 2], y[2 * d:2 * d + 2]).backward()
        ref.loss(x, y).backward()
    out["accum_grad"] = _diff(model, ref, "grad")
    out["hooks"] = sorted(seen) == sorted(f for f, _ in model.named_parameters())

    # torch.autograd.grad of an activation: the reference's, and no .grad written anywhere
    mesh, model, ref = _build(2, 2)
    cap, rcap = {}, {}
    model.emb.register_forward_hook(lambda m, i, o: cap.__setitem__("e", o))
    ref.emb.register_forward_hook(lambda m, i, o: rcap.__setitem__("e", o))
    x, y = _global_batch(0, 2)
    (g,) = torch.autograd.grad(model(x[2 * d:2 * d + 2], y[2 * d:2 * d + 2]), cap["e"])
    (rg,) = torch.autograd.grad(ref.loss(x, y), rcap["e"])
    out["autograd_grad"] = _rel(g, 2 * rg[2 * d:2 * d + 2])  # (the reference's mean is over 2x the rows)
    out["autograd_grad_no_dot_grad"] = all(p.grad is None for p in model.parameters())

    # model.state_dict(): the reference's keys, full values equal
    sd, rsd = model.state_dict(), ref.state_dict()
    out["state_dict_keys"] = sorted(sd) == sorted(rsd)
    out["state_dict_values"] = max(_rel(matrixfsdp.full_tensor(v), rsd[k]) for k, v in sd.items())

    # an exception in backward, then training goes on like the reference
    mesh, model, ref = _build(2, 2)
    opt = _opt("muon", model)

    out["raised"] = _raise_in_backward(model, d)
    opt.zero_grad()
    out["after_exception"] = _parity(mesh, model, ref, opt=opt)

    # reshard_after_forward=False
    out["no_reshard"] = _parity(*_build(2, 2, reshard_after_forward=False))

    # SequenceParallel norms (Replicate TP params, Partial gradients), Colwise bias (Shard(0) 1-D)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = BNet()
    ref = copy.deepcopy(model)
    model.tp = mesh["tp"]
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
            "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    _wrap(model, mesh)
    out["seqpar"] = _parity(mesh, model, ref)

    # TP parameters at the root (vocab-parallel embedding, column-parallel head); tied embeddings
    for tied in (False, True):
        model = BNet(tied=tied)
        ref = copy.deepcopy(model)
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
        if not tied:
            parallelize_module(model, mesh["tp"], {"emb": RowwiseParallel(input_layouts=Replicate()),
                                                   "head": ColwiseParallel(output_layouts=Replicate())})
        _wrap(model, mesh)
        out["tied" if tied else "root_tp"] = _parity(mesh, model, ref)

    # mixed precision: close to a flat fully_shard bf16 run on the same global batch
    mp = matrixfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh, model, ref = _build(2, 2, mp_policy=mp)
    fmesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    flat = copy.deepcopy(ref)
    fplan = matrixfsdp.plan_owners(flat, fmesh, block_types=(MLPBlock,))
    for b in flat.blocks:
        matrixfsdp.fully_shard(b, mesh=fmesh, plan=fplan, mp_policy=mp)
    matrixfsdp.fully_shard(flat, mesh=fmesh, plan=fplan, mp_policy=mp)
    x, y = _global_batch(0, 2)
    r = dist.get_rank()
    model(x[2 * d:2 * d + 2], y[2 * d:2 * d + 2]).backward()
    flat(x[r:r + 1], y[r:r + 1]).backward()
    ref.loss(x, y).backward()
    tg = {f: matrixfsdp.full_tensor(p.grad) for f, p in model.named_parameters()}
    fg = {f: matrixfsdp.full_tensor(p.grad) for f, p in flat.named_parameters()}
    rg = {f: p.grad for f, p in ref.named_parameters()}
    out["bf16_dtypes"] = {str(p.dtype) for p in model.parameters()} | {str(p.grad.dtype) for p in model.parameters()}
    out["bf16_tp_vs_flat"] = max(_rel(tg[k], fg[k]) for k in tg)
    out["bf16_flat_vs_fp32"] = max(_rel(fg[k], rg[k]) for k in tg)
    out["bf16_tp_vs_fp32"] = max(_rel(tg[k], rg[k]) for k in tg)

    # a plan without the 2-D mesh, and a TP mesh that is not the dp mesh's sibling: clear errors
    for name, plan_mesh, tp_mesh in (
        ("flat_plan", 2, mesh["tp"]),
        ("transposed", mesh, init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp_shard"))["tp"]),
    ):
        m = FwdNet(80)
        for b in m.blocks:
            parallelize_module(b, tp_mesh, {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
        try:
            plan = matrixfsdp.plan_owners(m, plan_mesh, block_types=(MLPBlock,))
            for b in m.blocks:
                matrixfsdp.fully_shard(b, mesh=mesh["dp_shard"], plan=plan)
            matrixfsdp.fully_shard(m, mesh=mesh["dp_shard"], plan=plan)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_outsider_tour():
    for r in get_pool(4).run(outsider_tour, timeout=90):
        print({k: v for k, v in r.items() if not isinstance(v, str)})
        assert r["accum_grad"] < 1e-6 and r["hooks"], r
        assert r["autograd_grad"] < 1e-5 and r["autograd_grad_no_dot_grad"], r
        assert r["state_dict_keys"] and r["state_dict_values"] == 0.0, r
        assert r["raised"] and r["after_exception"] < 1e-5, r
        assert max(r["no_reshard"], r["seqpar"], r["root_tp"], r["tied"]) < 1e-5, r
        assert r["bf16_dtypes"] == {"torch.float32"}, r
        # bf16 rounding: the TP run is as far from the flat bf16 run as that is from fp32
        assert r["bf16_tp_vs_flat"] < 3e-2 and r["bf16_tp_vs_fp32"] < 3e-2, r
        assert "tp=1" in r["flat_plan"], r
        assert "must be two named dimensions of one mesh" in r["transposed"], r


# ============================================================================ not fixed
def optimizer_after_backward_exception():
    """An exception escapes backward; the optimizer is built afterwards (before the next forward)."""
    mesh, model, ref = _build(2, 2)
    d = mesh["dp_shard"].get_local_rank()

    _raise_in_backward(model, d)
    opt = _opt("muon", model)
    plain = sum(not isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
    opt.zero_grad()
    return plain, _parity(mesh, model, ref, opt=opt)


@pytest.mark.xfail(strict=True, reason="the root's unsharded leaves stay in its slots after an "
                   "exception in backward (the final callback never ran, and drop_stale_state "
                   "does not reshard while awaiting_backward): Muon(model) then holds emb/head's "
                   "unsharded leaves, steps them, and the next unshard overwrites the update "
                   "(params 2.8e-2 off the reference after 2 steps); not TP-specific")
def test_optimizer_built_after_a_backward_exception():
    for plain, worst in get_pool(4).run(optimizer_after_backward_exception, timeout=60):
        assert plain == 0 and worst < 1e-5, (plain, worst)
