"""HSDP checkpoints through DCP: between (R, S) meshes, flat meshes and one process, between
``repeat`` and ``split``, and to and from stock FSDP2 HSDP checkpoints.

A (2, 2) ``split`` run saves after 3 steps (both paths: the helpers and the standard
``get_state_dict`` + ``dcp.save``). The reference is the same checkpoint read into a plain model
in one process. Every target layout must then hold exactly its part of the reference, bitwise:
parameters on every rank (after the next forward's exchange), optimizer state on the ranks that
keep it (the step replica under ``split``, every owner under ``repeat``). At the same layout the
resumed run continues bitwise like the uninterrupted one.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import matrixfsdp
import matrixfsdp.checkpoint as mckpt
from _harness import get_pool
from _models import Block, TinyConfig, TinyDecoder
from matrixfsdp._fully_shard import fully_shard
from matrixfsdp.placement.owner import keeps_state, owner_of
from checkpoint.test_dcp import full_params, local, make_opt, rows, std_load, std_save, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SAVE_AT, MORE = 3, 2


def build(R, S, mode, name="muon"):
    """TinyDecoder + optimizer on an (R, S) HSDP mesh (R=0: a flat S-rank mesh; None: plain)."""
    model = TinyDecoder(TinyConfig(), seed=0)
    if S is not None:
        mesh = (init_device_mesh("cpu", (S,)) if R == 0 else
                init_device_mesh("cpu", (R, S), mesh_dim_names=("dp_replicate", "dp_shard")))
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,), replica_step=mode)
        for b in model.blocks:
            fully_shard(b, mesh=mesh, plan=plan)
        fully_shard(model, mesh=mesh, plan=plan)
    return model, make_opt(model, name)


def _mine(p, full):
    """This rank's part of ``full`` for parameter ``p`` (or its same-shaped state)."""
    info = owner_of(p)
    if not isinstance(p, DTensor) or full.ndim == 0 or full.shape != p.shape:
        return full
    if info is not None:
        return full if info.holds else None
    mesh = p.device_mesh
    return rows(full, mesh.get_coordinate()[-1], mesh.size(mesh.ndim - 1), True)


def check_layout(model, opt, ref_params, ref_state):
    """Parameters and optimizer state hold exactly this rank's part of the reference, bitwise."""
    model.sync_params()
    bad = []
    for f, p in model.named_parameters():
        exp = _mine(p, ref_params[f])
        if exp is not None and local(p).numel() and not torch.equal(local(p), exp):
            bad.append(f"param {f}")
    fqn_of = {id(p): f for f, p in model.named_parameters()}
    checked = 0
    for g in opt.param_groups:
        for p in g["params"]:
            f = fqn_of[id(p)]
            st, ref = opt.state.get(p, {}), ref_state.get(f)
            if ref is None or not keeps_state(p) or local(p).numel() == 0:
                if st and any(isinstance(v, torch.Tensor) and v.numel() > 1 for v in st.values()):
                    bad.append(f"state {f} kept on a rank that does not step it")
                continue
            for k, v in st.items():
                exp = _mine(p, ref[k])
                if isinstance(v, torch.Tensor) and exp is not None and not torch.equal(local(v).reshape(exp.shape), exp):
                    bad.append(f"state {f}.{k}")
                checked += 1
    return bad, checked


def w_save(root, R, S, mode):
    d = os.path.join(root, f"{R}x{S}-{mode}")
    model, opt = build(R, S, mode)
    train(model, opt, range(SAVE_AT))
    mckpt.save(os.path.join(d, "helper"), model, opt)
    std_save(model, opt, os.path.join(d, "std"))
    train(model, opt, range(SAVE_AT, SAVE_AT + MORE))
    final = full_params(model)
    again, opt2 = build(R, S, mode)
    mckpt.load(os.path.join(d, "helper"), again, opt2)
    train(again, opt2, range(SAVE_AT, SAVE_AT + MORE))
    resumed = full_params(again)
    return {"resume_bitwise": all(torch.equal(final[k], resumed[k]) for k in final)}


def w_load(root, src, R, S, mode, ref_params, ref_state):
    out = {}
    for how in ("helper", "std"):
        model, opt = build(R, S, mode)
        path = os.path.join(root, src, how)
        if how == "helper":
            mckpt.load(path, model, opt)
        else:
            std_load(model, opt, path)
        out[how] = check_layout(model, opt, ref_params, ref_state)
    return out


def _reference(path):
    model, opt = build(None, None, None)
    mckpt.load(path, model, opt)
    params = {f: p.detach().clone() for f, p in model.named_parameters()}
    fqn_of = {id(p): f for f, p in model.named_parameters()}
    state = {fqn_of[id(p)]: {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
             for p, st in opt.state.items()}
    return params, state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hsdp_ckpt"))
    res = get_pool(4).run(w_save, root, 2, 2, "split")
    assert all(r["resume_bitwise"] for r in res), res
    res = get_pool(4).run(w_save, root, 0, 4, "auto")  # a flat 4-rank checkpoint
    assert all(r["resume_bitwise"] for r in res), res
    return root


@pytest.mark.parametrize("src", ["2x2-split", "0x4-auto"])
@pytest.mark.parametrize("R, S, mode", [(2, 2, "split"), (2, 2, "repeat"), (0, 4, "auto"), (4, 1, "split"), (0, 1, "auto")])
def test_hsdp_checkpoints_reshard(saved, src, R, S, mode):
    ref_params, ref_state = _reference(os.path.join(saved, src, "helper"))
    W = S * max(R, 1)
    res = get_pool(W).run(w_load, saved, src, R, S, mode, ref_params, ref_state)
    for r in res:
        for how, (bad, checked) in r.items():
            assert not bad, (how, bad[:5])
    assert sum(c for r in res for _, c in r.values()) > 0


def test_hsdp_checkpoint_single_process(saved):
    """The (2, 2) split checkpoint read into a plain model in one process equals the flat one's
    reading of itself at the same step (both trained the same math)."""
    a, _ = _reference(os.path.join(saved, "2x2-split", "helper"))
    b, _ = _reference(os.path.join(saved, "0x4-auto", "helper"))
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def _stock_hsdp(model, mesh):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for b in model.blocks:  # FSDP2 rejects 0-dim parameters: leave res_scale replicated
        b.res_scale.requires_grad_(False)
        torch_fully_shard(b, mesh=mesh, ignored_params={b.res_scale})
    torch_fully_shard(model, mesh=mesh)
    return model


def w_stock(root):
    """Stock torch HSDP (fully_shard on the 2-D mesh) checkpoint -> matrixfsdp split, and a
    matrixfsdp split checkpoint -> stock HSDP: the model weights, bitwise."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    stock = _stock_hsdp(TinyDecoder(TinyConfig(), seed=0), mesh)
    opt = torch.optim.AdamW([p for p in stock.parameters() if p.requires_grad], lr=1e-3, foreach=False)
    train(stock, opt, range(2))
    stock_full = {f: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
                  for f, p in stock.named_parameters()}
    dst = os.path.join(root, "stock")
    std_save(stock, opt, dst)
    out = {}
    for how in ("helper", "std"):
        m2, _ = build(2, 2, "split")
        if how == "helper":
            mckpt.load(dst, m2)
        else:
            msd = get_model_state_dict(m2)
            dcp.load({"model": msd}, checkpoint_id=dst)
            set_model_state_dict(m2, msd)
        full = full_params(m2)
        out[f"from_stock_{how}"] = all(torch.equal(full[f], stock_full[f]) for f in stock_full)
    ours = os.path.join(root, "2x2-split", "std")
    back = _stock_hsdp(TinyDecoder(TinyConfig(), seed=1), mesh)
    msd = get_model_state_dict(back)
    dcp.load({"model": msd}, checkpoint_id=ours)
    set_model_state_dict(back, msd)
    m3, o3 = build(2, 2, "split")
    mckpt.load(os.path.join(root, "2x2-split", "helper"), m3, o3)
    ours_full = full_params(m3)
    out["to_stock"] = all(torch.equal((p.full_tensor() if isinstance(p, DTensor) else p.detach()), ours_full[f])
                          for f, p in back.named_parameters())
    return out


def test_hsdp_stock_fsdp2_interop(saved):
    for r in get_pool(4).run(w_stock, saved):
        assert all(r.values()), r
