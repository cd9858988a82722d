"""Owned parameters are DTensors to every consumer (issue 10, model side): ``full_tensor()``,
``redistribute`` and DCP's full state dicts give the whole tensor on every rank, never the empty
local tensor a non-owner holds. W=2 and W=3 against the unsharded model."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from _harness import get_pool
from _models import TinyConfig, TinyDecoder, make_batch, make_plan
from fully_shard.test_parity import shard_model

import matrixfsdp


def _setup(W):
    model = TinyDecoder(TinyConfig(), seed=0)
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (W,))
    plan = make_plan(model, W)
    shard_model(model, mesh, plan)
    return model, ref, mesh, plan


def consumers_check(tmp: str) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    model, ref, mesh, plan = _setup(W)
    rsd = ref.state_dict()
    owned = [n for n, p in model.named_parameters() if matrixfsdp.owned_of(p) is not None and p.ndim == 2]
    out = {"n_owned": len(owned)}
    out["full_tensor"] = all(torch.equal(p.full_tensor(), rsd[n]) for n, p in model.named_parameters())
    out["grad_full_tensor"] = None
    x, y = make_batch(TinyConfig(), 0, 2 * W)
    model.loss(x, y).backward()
    ref.loss(x, y).backward()
    out["grad_full_tensor"] = max((p.grad.full_tensor() - q.grad).abs().max().item()
                                  for p, q in zip(model.parameters(), ref.parameters()) if p.grad is not None)
    w = model.get_submodule(owned[0].rpartition(".")[0]).get_parameter(owned[0].rpartition(".")[2])
    out["redistribute_replicate"] = torch.equal(w.redistribute(mesh, [Replicate()]).to_local(), rsd[owned[0]])
    out["redistribute_shard"] = torch.equal(w.redistribute(mesh, [Shard(0)]).full_tensor(), rsd[owned[0]])
    try:
        w.redistribute(mesh, [Replicate(), Replicate()])  # two placements on a 1-D mesh
        out["bad_redistribute"] = None
    except ValueError as e:
        out["bad_redistribute"] = str(e)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["full_sd"] = sorted(full) == sorted(rsd) and all(torch.equal(full[k], rsd[k]) for k in rsd)
    off = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # rank 0 writes the usual torch.save checkpoint; a plain model loads it
        torch.save(off, os.path.join(tmp, "full.pt"))
        plain = TinyDecoder(TinyConfig(), seed=1)
        plain.load_state_dict(torch.load(os.path.join(tmp, "full.pt")))
        out["torch_save_roundtrip"] = all(torch.equal(a, rsd[k]) for k, a in plain.state_dict().items())
    else:
        out["torch_save_roundtrip"] = off == {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out["adamw_state_full"] = all(v.shape == rsd[k].shape for k, st in osd["state"].items()
                                  for s, v in st.items() if s != "step")
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_full_tensors_and_full_state_dicts_on_every_rank(W, tmp_path):
    tmp = str(tmp_path)
    for r in get_pool(W).run(consumers_check, tmp):
        assert r["n_owned"] > 0
        assert r["full_tensor"] and r["grad_full_tensor"] <= 1e-6, r
        assert r["redistribute_replicate"] and r["redistribute_shard"], r
        assert "can be redistributed to [Replicate()] or" in r["bad_redistribute"], r
        assert r["full_sd"] and r["torch_save_roundtrip"] and r["adamw_state_full"], r


def optim_full_state_check(name: str) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    model, ref, mesh, plan = _setup(W)
    kw = {"ns_dtype": torch.float32} if name == "Muon" else {"precondition_frequency": 1} if name == "SOAP" else {}
    opt = getattr(matrixfsdp.optim, name)(model, lr=0.01, **kw)
    for step in range(2):
        x, y = make_batch(TinyConfig(), step, 2 * W)
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    keys = {fqn: sorted(st) for fqn, st in osd["state"].items()}
    every = [None] * W
    dist.all_gather_object(every, keys)
    out = {"same_keys": all(k == keys for k in every), "n_params": len(keys), "mismatch": [],
           "key_diff": [(f, every[0].get(f), every[1].get(f)) for f in set(every[0]) | set(every[1])
                        if every[0].get(f) != every[1].get(f)][:4]}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():  # this rank's own state == the full dict's entries
        for k, v in st.items():
            full = osd["state"][names[id(p)]][k]
            if matrixfsdp.owned_of(p) is not None and not torch.equal(full, v):
                out["mismatch"].append((names[id(p)], k))
    out["empty"] = [(f, k) for f, st in osd["state"].items() for k, v in st.items()
                    if torch.is_tensor(v) and v.ndim and 0 in v.shape]
    return out


@pytest.mark.parametrize("name", ["Muon", "Shampoo", "SOAP"])
def test_full_optimizer_state_dict_of_matrix_optimizers(name):
    for r in get_pool(2).run(optim_full_state_check, name):
        assert r["same_keys"] and r["n_params"] > 0 and not r["mismatch"] and not r["empty"], r


def cross_owner_check() -> dict:
    W = dist.get_world_size()
    model, ref, mesh, plan = _setup(W)
    x, y = make_batch(TinyConfig(), 0, 2 * W)
    model.loss(x, y).backward()
    out = {}
    for what, fn in [("clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),
                     ("l2", lambda: sum(p.pow(2).sum() for p in model.parameters()).full_tensor())]:
        try:
            fn()
            out[what] = None
        except ValueError as e:
            out[what] = str(e)
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_cross_owner_arithmetic_raises_a_clear_error_on_every_rank(W):
    # stock FSDP2 computes both; owned tensors of different owners share no mesh (docs/fully_shard.md)
    res = get_pool(W).run(cross_owner_check, timeout=90)
    for r in res:
        assert "aten::stack combines DTensors on different meshes" in r["clip"], r
        assert "aten::add combines DTensors on different meshes" in r["l2"], r
        for msg in r.values():
            assert "owned_by_rank" in msg and "matrixfsdp.clip_grad_norm_" in msg, r
