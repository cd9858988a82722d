"""Meta-device initialization: build on ``meta``, plan, ``fully_shard``, ``to_empty``, initialize.

The sharded model must end up exactly where an eagerly built and then sharded one is (values,
layout, owner metadata), train identically, and refuse to run while still on meta.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from _harness import get_pool
from _models import TinyConfig, TinyDecoder, local_of, make_batch, make_plan
from fully_shard.test_parity import compare_to_ref, shard_model

import matrixfsdp
from matrixfsdp import Decoder, DecoderLayer, PRESETS
from matrixfsdp.placement.owned_tensor import owned_of, set_full_
from matrixfsdp._fully_shard import get_state


def _shard_decoder(model, mesh, plan):
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    return model


def _train(model, steps, W, rank, vocab):
    opt = matrixfsdp.optim.Muon(model.parameters(), lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, vocab, (2 * W, 9), generator=g)[2 * rank:2 * rank + 2]
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def check_decoder_meta_init() -> dict:
    """Qwen3-style Decoder, real planner: meta init + to_empty + reset_parameters(seed) equals
    eager init + fully_shard bitwise, before and after 3 Muon steps."""
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = PRESETS["tiny"]
    mesh = init_device_mesh("cpu", (W,))
    eager = Decoder(cfg)
    eager.reset_parameters(seed=3)
    ref = copy.deepcopy(eager)
    plan = matrixfsdp.plan_owners(eager, mesh, block_types=(DecoderLayer,))
    _shard_decoder(eager, mesh, plan)

    with torch.device("meta"):
        model = Decoder(cfg)
    mplan = matrixfsdp.plan_owners(model, mesh, block_types=(DecoderLayer,))
    assert mplan.digest == plan.digest  # the planner reads shapes only
    _shard_decoder(model, mesh, mplan)
    p0 = dict(model.named_parameters())
    assert all(local_of(p).is_meta for p in p0.values())
    with pytest.raises(RuntimeError, match=r"still on the meta device .*call model\.to_empty\(device=\.\.\.\)"):
        model(torch.zeros(1, 4, dtype=torch.long))
    model.to_empty(device="cpu")
    model.reset_parameters(seed=3)

    checked = 0
    for (fqn, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert isinstance(p, DTensor) and p.placements == q.placements and p.device_mesh == q.device_mesh, fqn
        assert local_of(p).device.type == "cpu" and local_of(p).shape == local_of(q).shape, fqn
        assert plan[fqn].local_shape(rank, W) == tuple(local_of(p).shape), fqn
        assert owned_of(p) == owned_of(q), fqn
        assert torch.equal(local_of(p), local_of(q)), fqn
        checked += 1
    assert compare_to_ref_decoder(model, ref, plan, rank, W) == 0.0
    l_meta = _train(model, 3, W, rank, cfg.vocab_size)
    l_eager = _train(eager, 3, W, rank, cfg.vocab_size)
    same = all(torch.equal(local_of(p), local_of(q))
               for p, q in zip(model.parameters(), eager.parameters()))
    # a checkpoint loads into a fresh meta-initialized model (the usual resume path)
    path = [tempfile.mkdtemp(prefix="mfsdp-meta-") if rank == 0 else None]
    dist.broadcast_object_list(path)
    ckpt = os.path.join(path[0], "ckpt")
    matrixfsdp.checkpoint.save(ckpt, eager)
    with torch.device("meta"):
        resumed = Decoder(cfg)
    _shard_decoder(resumed, mesh, matrixfsdp.plan_owners(resumed, mesh, block_types=(DecoderLayer,)))
    resumed.to_empty(device="cpu")
    matrixfsdp.checkpoint.load(ckpt, resumed)
    loaded = all(torch.equal(local_of(p), local_of(q))
                 for p, q in zip(resumed.parameters(), eager.parameters()))
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # loaded parameters count as written
        warnings.simplefilter("always")
        resumed(torch.zeros(1, 4, dtype=torch.long))
    loaded = loaded and not any("never written" in str(w.message) for w in caught)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path[0], ignore_errors=True)
    return {"checked": checked, "losses_equal": l_meta == l_eager, "params_equal": same,
            "checkpoint_loaded": loaded}


def compare_to_ref_decoder(model, ref, plan, rank, W) -> float:
    refp = dict(ref.named_parameters())
    md = 0.0
    for fqn, p in model.named_parameters():
        s, e = plan[fqn].local_rows(rank, W)
        mine = local_of(p)
        if mine.numel():
            full = refp[fqn].detach()
            md = max(md, (mine - (full if full.ndim == 0 else full[s:e])).abs().max().item())
    return md


def check_tiny_meta_set_full() -> dict:
    """Hand-built plan with 0-dim, frozen, evenly sharded and owned tensors: meta init, to_empty,
    set_full_ from an eager model's tensors -> same grads as the eagerly sharded model."""
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = TinyConfig()
    eager = TinyDecoder(cfg, seed=0)
    full = {k: v.detach().clone() for k, v in eager.named_parameters()}
    plan = make_plan(eager, W, root_matrices="matrix", even=["head.weight"])
    mesh = init_device_mesh("cpu", (W,))
    shard_model(eager, mesh, plan)
    with torch.device("meta"):
        model = TinyDecoder(cfg, seed=0)
    shard_model(model, mesh, plan)
    model.to_empty(device="cpu")
    for fqn, p in model.named_parameters():
        set_full_(p, full[fqn])
    scalar_non_owner = [fqn for fqn, p in model.named_parameters()
                        if p.ndim == 0 and plan[fqn].owner != rank]
    for fqn in scalar_non_owner:  # 0-dim owned elsewhere: an empty [0] segment, not a scalar
        assert tuple(local_of(dict(model.named_parameters())[fqn]).shape) == (0,), fqn
    x, y = make_batch(cfg, 1, 4 * W)
    x, y = x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]
    for m in (model, eager):
        m.loss(x, y, use_extra=True).backward()
    grads_equal = all(
        (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(local_of(p.grad), local_of(q.grad)))
        for p, q in zip(model.parameters(), eager.parameters())
    )
    frozen_ok = all(not p.requires_grad and p.grad is None
                    for fqn, p in model.named_parameters() if "frozen" in fqn)
    return {"grads_equal": grads_equal, "frozen_ok": frozen_ok, "n_scalar_non_owner": len(scalar_non_owner)}


def check_meta_errors() -> dict:
    W = dist.get_world_size()
    cfg = TinyConfig()
    with torch.device("meta"):
        model = TinyDecoder(cfg, seed=0)
    plan = make_plan(TinyDecoder(cfg, seed=0), W)
    mesh = init_device_mesh("cpu", (W,))
    matrixfsdp.fully_shard(model.blocks[0], mesh=mesh, plan=plan)
    try:
        model.blocks[0].to_empty(device="cpu")
    except RuntimeError as e:
        msg = str(e)
    else:
        msg = ""
    return {"msg": msg, "registered": get_state(model.blocks[0]) is not None}


@pytest.mark.parametrize("W", [2, 3])
def test_decoder_meta_init_matches_eager(W):
    for r in get_pool(W).run(check_decoder_meta_init):
        assert r["checked"] > 0
        assert r["losses_equal"] and r["params_equal"] and r["checkpoint_loaded"], r


@pytest.mark.parametrize("W", [2, 3])
def test_tiny_meta_init_with_set_full(W):
    res = get_pool(W).run(check_tiny_meta_set_full)
    for r in res:
        assert r["grads_equal"] and r["frozen_ok"], r
    assert sum(r["n_scalar_non_owner"] for r in res) > 0  # the 0-dim case was exercised


def test_meta_init_errors():
    for r in get_pool(2).run(check_meta_errors):
        assert "to_empty on Block before its blocks were resolved" in r["msg"], r


def test_set_full_plain_tensor_and_shape_error():
    p = torch.nn.Parameter(torch.zeros(3, 2))
    set_full_(p, torch.ones(3, 2))
    assert torch.equal(p.detach(), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"matrixfsdp.set_full_: shape mismatch, param \(3, 2\) vs full \(2, 3\)"):
        set_full_(p, torch.ones(2, 3))


def check_identity_repair_and_refusals() -> dict:
    """An optimizer built before to_empty keeps working (same parameter objects, as FSDP2);
    torch's own to_empty on an outer wrapper is repaired at the next checkpoint load / forward;
    to_empty drops unreduced accumulated gradients; a meta model refuses checkpoint load."""
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = PRESETS["tiny"]
    mesh = init_device_mesh("cpu", (W,))
    out = {}

    def meta_model():
        with torch.device("meta"):
            m = Decoder(cfg)
        return _shard_decoder(m, mesh, matrixfsdp.plan_owners(m, mesh, block_types=(DecoderLayer,)))

    eager = Decoder(cfg)
    eager.reset_parameters(seed=5)
    _shard_decoder(eager, mesh, matrixfsdp.plan_owners(eager, mesh, block_types=(DecoderLayer,)))
    l_eager = _train(eager, 2, W, rank, cfg.vocab_size)

    # optimizer first, then to_empty + init (the objects it holds must be the live parameters)
    model = meta_model()
    before = list(model.parameters())
    opt = matrixfsdp.optim.Muon(model.parameters(), lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3)
    model.to_empty(device="cpu")
    model.reset_parameters(seed=5)
    out["identity"] = all(p is q for p, q in zip(before, model.parameters()))
    losses = []
    for step in range(2):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, cfg.vocab_size, (2 * W, 9), generator=g)[2 * rank:2 * rank + 2]
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out["opt_before_to_empty_trains_identically"] = losses == l_eager and all(
        torch.equal(local_of(p), local_of(q)) for p, q in zip(model.parameters(), eager.parameters()))

    # a checkpoint load into a model still on meta is refused on every rank
    path = [tempfile.mkdtemp(prefix="mfsdp-meta-") if rank == 0 else None]
    dist.broadcast_object_list(path)
    ckpt = os.path.join(path[0], "ckpt")
    matrixfsdp.checkpoint.save(ckpt, eager)
    fresh = meta_model()
    try:
        matrixfsdp.checkpoint.load(ckpt, fresh)
        out["meta_load_error"] = ""
    except RuntimeError as e:
        out["meta_load_error"] = str(e)

    # torch's to_empty on a wrapper swaps our DTensors (Owned metadata lost, non-owners get 1-D
    # tensor([])); the checkpoint helpers repair the layout before loading
    torch.nn.ModuleDict({"m": fresh}).to_empty(device="cpu")
    out["broken_before_repair"] = any(owned_of(p) is None and matrixfsdp.owned_of(q) is not None
                                      for p, q in zip(fresh.parameters(), eager.parameters()))
    matrixfsdp.checkpoint.load(ckpt, fresh)
    out["repaired"] = all(
        owned_of(p) == owned_of(q) and torch.equal(local_of(p), local_of(q))
        for p, q in zip(fresh.parameters(), eager.parameters()))

    # to_empty drops gradients accumulated without sync
    fresh.set_requires_gradient_sync(False)
    fresh(torch.zeros(2, 4, dtype=torch.long)).sum().backward()
    fresh.set_requires_gradient_sync(True)
    fresh.to_empty(device="cpu")
    out["accum_dropped"] = all(get_state(m).group.accum is None for m in fresh.modules() if get_state(m) is not None)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path[0], ignore_errors=True)
    return out


def test_identity_repair_and_refusals():
    for r in get_pool(2).run(check_identity_repair_and_refusals):
        assert r["identity"] and r["opt_before_to_empty_trains_identically"], r
        assert "parameters are still on the meta device" in r["meta_load_error"], r
        assert r["broken_before_repair"] and r["repaired"], r
        assert r["accum_dropped"], r


def check_unwritten_parameters_warn() -> dict:
    """Meta init, to_empty, every parameter initialized but one: the first forward warns naming
    it on the rank(s) holding it; writes through ``.data`` and through set_full_ count as
    written; the second forward is silent; a fully initialized model never warns."""
    import warnings

    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,))
    cfg = PRESETS["tiny"]
    out = {}
    for skip in ("model.layers.1.mlp.down_proj.weight", None):
        with torch.device("meta"):
            model = Decoder(cfg)
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(DecoderLayer,))
        _shard_decoder(model, mesh, plan)
        model.to_empty(device="cpu")
        g = torch.Generator().manual_seed(0)
        for i, (name, p) in enumerate(model.named_parameters()):
            full = torch.randn(p.shape, generator=g) * 0.02
            if name == skip:
                continue
            if i % 2:  # through .data (the segment): the version counter does not move
                local_of(p).data.copy_(torch.full_like(local_of(p), 0.01))
            else:
                set_full_(p, full)
        tokens = torch.zeros(2, 5, dtype=torch.long)
        with warnings.catch_warnings(record=True) as first:
            warnings.simplefilter("always")
            loss = model(tokens).float().sum()
        with warnings.catch_warnings(record=True) as second:
            warnings.simplefilter("always")
            model(tokens)
        msgs = [str(w.message) for w in first if "never written since to_empty" in str(w.message)]
        owner = plan[skip].owner if skip else None
        out[str(skip)] = {"msgs": msgs, "second": [str(w.message) for w in second], "owner": owner,
                          "finite": bool(torch.isfinite(loss))}
    return out


def test_unwritten_parameter_warns_at_the_first_forward():
    res = get_pool(2).run(check_unwritten_parameters_warn)
    name = "model.layers.1.mlp.down_proj.weight"
    for rank, r in enumerate(res):
        skipped, full = r[name], r["None"]
        holds = skipped["owner"] in (rank, None)
        assert len(skipped["msgs"]) == int(holds), skipped
        if holds:
            assert f"1 parameters never written since to_empty (still NaN): {name}; initialize them with " \
                   "matrixfsdp.set_full_" in skipped["msgs"][0]
        assert not any("never written" in m for m in skipped["second"])
        assert full["msgs"] == [] and full["finite"], full
