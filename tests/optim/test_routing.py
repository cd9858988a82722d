"""One routing rule for sharded and plain models (issue 10): ``Optimizer(model)`` gives every
parameter the planner's rule (block and root matrices: the matrix rule; embeddings, output heads,
non-2D tensors: AdamW) whether the model is sharded or not; state dicts record each parameter's
rule and loading under other rules raises."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _models import Block, TinyConfig, TinyDecoder, make_batch

import matrixfsdp
import matrixfsdp.checkpoint as mckpt

BATCH = 8
KW = dict(lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3)


def _shard(model, W):
    mesh = init_device_mesh("cpu", (W,))
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,))
    for b in model.blocks:
        matrixfsdp.fully_shard(b, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    return model


def _rules(opt, model):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: opt._route(g, p) for g in opt.param_groups for p in g["params"]}


def parity_check(root: str) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = TinyConfig()
    model = TinyDecoder(cfg, seed=0)
    ref = copy.deepcopy(model)
    _shard(model, W)
    opt, ref_opt = matrixfsdp.optim.Muon(model, **KW), matrixfsdp.optim.Muon(ref, **KW)
    out = {"rules_equal": _rules(opt, model) == _rules(ref_opt, ref), "rules": _rules(ref_opt, ref),
           "loss_diff": 0.0}
    per = BATCH // W
    for step in range(2):
        x, y = make_batch(cfg, step, BATCH)
        loss = model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        ref_loss = sum(ref.loss(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]) for r in range(W)) / W
        ref_loss.backward()
        g = loss.detach().clone()
        dist.all_reduce(g)
        out["loss_diff"] = max(out["loss_diff"], abs(g.item() / W - ref_loss.item()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    out["param_diff"] = max((p.full_tensor() - q).abs().max().item()
                            for p, q in zip(model.parameters(), ref.parameters()))
    # checkpoints: one saved with Optimizer(model), one with the parameter-list "auto" routing
    mckpt.save(os.path.join(root, "module"), model, opt)
    auto = matrixfsdp.optim.Muon(model.parameters(), **KW)
    mckpt.save(os.path.join(root, "auto"), model, auto)
    return out


def test_one_routing_rule_sharded_and_plain(tmp_path):
    root = str(tmp_path)
    for r in get_pool(2).run(parity_check, root):
        assert r["rules_equal"], r["rules"]
        assert r["rules"]["tok_emb.weight"] == "adamw" and r["rules"]["head.weight"] == "adamw"
        assert r["rules"]["blocks.0.up.weight"] == "muon"
        assert r["loss_diff"] <= 1e-6 and r["param_diff"] <= 1e-6, r
    # resume into a plain model in this process: same rule -> loads; another rule -> clear error
    plain = TinyDecoder(TinyConfig(), seed=3)
    mckpt.load(os.path.join(root, "module"), plain, matrixfsdp.optim.Muon(plain, **KW))
    plain = TinyDecoder(TinyConfig(), seed=3)
    with pytest.raises(ValueError, match=r"Muon.load_state_dict: param group 0 was saved with other update "
                                         r"rules than this optimizer applies .* Optimizer\(model\)"):
        mckpt.load(os.path.join(root, "auto"), plain, matrixfsdp.optim.Muon(plain.parameters(), **KW))
