"""Iterations that never finish a backward must not corrupt later ones ([Note: stale state]).

Each scenario trains the sharded model and a single-process reference on the same data, with the
disturbance applied to the sharded model only, and checks gradients/parameters afterwards:

* an exception escapes backward (a user hook aborts it), the batch is skipped;
* a no-grad forward of one block between backward and step (its prefetch of the next block is
  never consumed);
* a grad-mode forward whose output is discarded between backward and step (a "metric" forward);
* checkpoint helpers after such leftovers, and with a trailing slash in the path.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _models import LocalMatrixOpt, TinyConfig, TinyDecoder, local_of, make_batch, make_plan, opt_groups
from fully_shard.test_parity import compare_to_ref, shard_model

import matrixfsdp.checkpoint as mckpt

BATCH = 12


def _setup(W):
    cfg = TinyConfig()
    model = TinyDecoder(cfg, seed=0)
    ref = copy.deepcopy(model)
    plan = make_plan(model, W)
    shard_model(model, init_device_mesh("cpu", (W,)), plan)
    return cfg, model, ref, plan


def _ref_loss(ref, x, y, W):
    per = BATCH // W
    return sum(ref.loss(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]) for r in range(W)) / W


def exception_in_backward() -> float:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    per = BATCH // W
    x, y = make_batch(cfg, 0, BATCH)
    mine = slice(rank * per, (rank + 1) * per)

    def abort(module, grad_in, grad_out):
        raise RuntimeError("abort this batch")

    h = model.blocks[1].register_full_backward_hook(abort)
    with pytest.raises(RuntimeError, match="abort this batch"):
        model.loss(x[mine], y[mine]).backward()
    h.remove()
    model.zero_grad(set_to_none=True)
    model.loss(x[mine], y[mine]).backward()  # the batch again, normally
    _ref_loss(ref, x, y, W).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None
               and n != "blocks.1.extra.weight"]  # the gated projection is unused at step 0
    assert not missing, missing
    return compare_to_ref(model, ref, plan, rank, W, "grad")


def disturbed_training(kind: str) -> float:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    opt = LocalMatrixOpt(opt_groups(model, plan), elementwise="sgd")
    ref_opt = LocalMatrixOpt(opt_groups(ref, plan), elementwise="sgd")
    per = BATCH // W
    mine = slice(rank * per, (rank + 1) * per)
    for step in range(3):
        x, y = make_batch(cfg, step, BATCH)
        model.loss(x[mine], y[mine]).backward()
        _ref_loss(ref, x, y, W).backward()
        if kind == "no_grad_block":
            with torch.no_grad():  # e.g. an early-exit probe: prefetches blocks[1], which does not run
                model.blocks[0](torch.randn(per, cfg.seq, cfg.dim))
        elif kind == "discarded_output":
            model.loss(x[mine], y[mine])  # grad mode, no backward
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    x, y = make_batch(cfg, 10, BATCH)
    model.loss(x[mine], y[mine]).backward()
    _ref_loss(ref, x, y, W).backward()
    return max(compare_to_ref(model, ref, plan, rank, W, "grad"),
               compare_to_ref(model, ref, plan, rank, W, "param"))


def checkpoint_after_leftovers() -> str:
    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    per = BATCH // W
    mine = slice(rank * per, (rank + 1) * per)
    x, y = make_batch(cfg, 0, BATCH)
    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    path = os.path.join(root[0], "ck") + "/"  # trailing slash: committed as "ck", no hang
    with torch.no_grad():
        model.blocks[0](torch.randn(per, cfg.seq, cfg.dim))  # leaves a dangling prefetch
    mckpt.save(path, model)
    assert sorted(os.listdir(root[0])) == ["ck"]
    pending = model.loss(x[mine], y[mine])  # a forward awaiting its backward
    with pytest.raises(RuntimeError, match=r"matrixfsdp.checkpoint.load: module '<root>' holds materialized .* "
                                           r"a forward is still awaiting its backward"):
        mckpt.load(path, model)
    pending.backward()
    mckpt.load(path, model)  # fine once the backward ran
    return "ok"


@pytest.mark.parametrize("W", [2, 3])
def test_exception_in_backward_then_normal_step(W):
    diffs = get_pool(W).run(exception_in_backward)
    assert max(diffs) <= 1e-6, diffs


@pytest.mark.parametrize("kind", ["no_grad_block", "discarded_output"])
def test_leftover_forwards_do_not_leave_stale_weights(kind):
    diffs = get_pool(2).run(disturbed_training, kind)
    assert max(diffs) == 0.0, diffs  # W=2: bitwise, as without the disturbance


def hf_losses_after_move(move: str | None) -> list[float]:
    """A Hugging Face Qwen3 under fully_shard, moved with ``model.to(move)`` after sharding."""
    import matrixfsdp
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from integrations.test_huggingface import build, tokens

    model, _ = build("qwen3", False)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(Qwen3DecoderLayer,))
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    if move is not None:
        model.to(move)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32)
    r, W = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(3):
        ids = tokens(step)[r::W]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("move", ["cpu:0", torch.float32])
def test_a_conversion_that_changes_nothing_keeps_training_exact(move):
    """model.to("cpu:0") after fully_shard (transformers' Trainer moves the model to args.device,
    "cpu:0" on a CPU box): torch copies every parameter even so, which left the owners computing on
    the old storage (losses drifted from step 2); now bitwise as without the move."""
    pool = get_pool(2)
    assert pool.run(hf_losses_after_move, move) == pool.run(hf_losses_after_move, None)


def test_checkpoint_helpers_after_leftovers_and_trailing_slash():
    assert get_pool(2).run(checkpoint_after_leftovers) == ["ok", "ok"]


def clip_matches_torch(norm_type: float) -> tuple[float, float]:
    import matrixfsdp

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    per = BATCH // W
    mine = slice(rank * per, (rank + 1) * per)
    x, y = make_batch(cfg, 0, BATCH)
    model.loss(x[mine], y[mine]).backward()
    _ref_loss(ref, x, y, W).backward()
    total = matrixfsdp.clip_grad_norm_(model.parameters(), 0.05, norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
    return abs(total.item() - ref_total.item()) / ref_total.item(), compare_to_ref(model, ref, plan, rank, W, "grad")


@pytest.mark.parametrize("W,norm_type", [(2, 2.0), (3, 2.0), (3, float("inf"))])
def test_clip_grad_norm_matches_torch_on_the_unsharded_model(W, norm_type):
    res = get_pool(W).run(clip_matches_torch, norm_type)
    assert max(r[0] for r in res) < 1e-6 and max(r[1] for r in res) < 1e-7, res


def clip_edge_cases() -> dict:
    """A plain (replicated) gradient counts once in the global norm; error_if_nonfinite raises
    before any gradient is scaled."""
    import matrixfsdp

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg, model, ref, plan = _setup(W)
    per = BATCH // W
    x, y = make_batch(cfg, 0, BATCH)
    model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
    params = list(model.parameters())
    base = matrixfsdp.clip_grad_norm_(params, float("inf"))  # max_norm=inf: the norm, no scaling
    extra = torch.nn.Parameter(torch.zeros(3))
    extra.grad = torch.tensor([3.0, 4.0, 0.0])  # the same on every rank, as after DDP
    with_plain = matrixfsdp.clip_grad_norm_(params + [extra], float("inf"))
    expected = (base.item() ** 2 + 25.0) ** 0.5
    before = [local_of(p.grad).clone() for p in params if p.grad is not None]
    extra.grad = torch.tensor([float("nan"), 0.0, 0.0])
    try:
        matrixfsdp.clip_grad_norm_(params + [extra], 1e-3, error_if_nonfinite=True)
        msg = ""
    except RuntimeError as e:
        msg = str(e)
    after = [local_of(p.grad) for p in params if p.grad is not None]
    return {"rel": abs(with_plain.item() - expected) / expected, "msg": msg,
            "untouched": all(torch.equal(a, b) for a, b in zip(before, after))}


def test_clip_grad_norm_plain_grads_and_nonfinite():
    for r in get_pool(2).run(clip_edge_cases):
        assert r["rel"] < 1e-6, r
        assert "non-finite, so it cannot be clipped (error_if_nonfinite=True); gradients are unchanged" in r["msg"], r
        assert r["untouched"], r
