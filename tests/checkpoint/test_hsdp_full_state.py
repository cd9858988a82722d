"""DCP's full optimizer state dicts on an HSDP (2, 2) mesh under ``split``.

``get_optimizer_state_dict(full_state_dict=True)`` gathers key by key, so every rank must present
the same keys for every parameter. Under ``split`` an owner outside a matrix's step replica gets
no ``.grad`` for it, so before the fix its optimizer never learned that the step replica keeps
state, presented no keys while every other rank did, and DCP's gather hung (a timeout here).

Checked with ``fully_shard`` and ``replicate``, after steps that used the gated block's optional
projection and after steps that did not: no hang, the same keys on every rank, an unused
parameter keyless on every rank alike (``fully_shard``; ``replicate`` presents every trainable
parameter's keys by design), and a round trip through
``set_optimizer_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` that restores the
state bitwise and continues exactly like the uninterrupted run. The step receipts that fix it
(see [Note: step receipts] in ``placement/owner.py``) follow the step replica's gradients across
``zero_grad`` and a fresh optimizer, and ``set_find_unused_parameters(False)``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp
from _harness import get_pool
from _models import Block, TinyConfig, TinyDecoder, make_batch
from matrixfsdp.placement.owner import owner_of

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

R, S = 2, 2
BATCH = 12
TIMEOUT = 150  # a hang (the pre-fix behaviour) fails the test instead of blocking it
EXTRA = "blocks.1.extra.weight"  # the gated block's optional projection
FULL = StateDictOptions(full_state_dict=True)


def _build(front: str, seed: int):
    model = TinyDecoder(TinyConfig(), seed=seed)
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("dp_replicate", "dp_shard"))
    if front == "fully_shard":
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,), replica_step="split")
        for b in model.blocks:
            matrixfsdp.fully_shard(b, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    else:
        plan = matrixfsdp.plan_owners(model, mesh, policy="alpha_balanced", elementwise="owned",
                                      bucket_numel=40_000, replica_step="split")
        model = matrixfsdp.replicate(model, mesh=mesh, plan=plan)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    return model, opt


def _train(model, opt, steps, use_extra: bool) -> list[float]:
    per, r = BATCH // (R * S), dist.get_rank()
    losses = []
    for step in steps:
        x, y = make_batch(model.cfg, step, BATCH)
        loss = model.loss(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per], use_extra=use_extra)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _keys(osd: dict) -> dict[str, list[str]]:
    return {f: sorted(st) for f, st in sorted(osd["state"].items())}


def _full(model) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(model, options=FULL)
    return {k: v.detach().clone() for k, v in sd.items()}


def full_optim_round_trip(front: str, use_extra: bool) -> dict:
    model, opt = _build(front, seed=0)
    _train(model, opt, range(2), use_extra)
    msd = get_model_state_dict(model, options=FULL)
    osd = get_optimizer_state_dict(model, opt, options=FULL)  # hung on the owner outside the step replica
    out: dict = {"keys": _keys(osd)}
    # parameters this rank holds whole but another replica steps: the case under test
    out["held_not_stepped"] = sum(1 for p in model.parameters()
                                  if (o := owner_of(p)) is not None and o.holds and not o.is_local)

    model2, opt2 = _build(front, seed=3)
    bcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    # torch consumes rank 0's dict; the others pass nothing
    set_model_state_dict(model2, copy.deepcopy(msd) if dist.get_rank() == 0 else {}, options=bcast)
    # strict=False: an unused parameter has no state in the dict, while the fresh optimizer
    # initialises every parameter's (torch refuses that with strict=True, sharded or not)
    set_optimizer_state_dict(model2, opt2, copy.deepcopy(osd) if dist.get_rank() == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))
    osd2 = get_optimizer_state_dict(model2, opt2, options=FULL)
    out["state_bitwise"] = [f"{f}.{k}" for f, st in osd["state"].items() for k, v in st.items()
                            if not (torch.equal(v, osd2["state"][f][k]) if torch.is_tensor(v)
                                    else v == osd2["state"][f][k])]
    a = _train(model, opt, range(2, 4), use_extra)
    b = _train(model2, opt2, range(2, 4), use_extra)
    out["losses_equal"] = a == b
    p1, p2 = _full(model), _full(model2)
    out["params_differ"] = [k for k in p1 if not torch.equal(p1[k], p2[k])]
    return out


@pytest.mark.parametrize("front", ["fully_shard", "replicate"])
@pytest.mark.parametrize("use_extra", [True, False], ids=["all_used", "one_unused"])
def test_hsdp_split_full_optimizer_state_dict_round_trip(front, use_extra):
    res = get_pool(R * S).run(full_optim_round_trip, front, use_extra, timeout=TIMEOUT)
    keys = res[0]["keys"]
    for r in res:
        assert r["keys"] == keys, "ranks present different state keys"
        assert r["state_bitwise"] == [] and r["losses_equal"] and r["params_differ"] == [], r
    trainable = {f for f, st in keys.items() if st}
    assert len(trainable) > 10, keys  # the matrices' and the element-wise tensors' state
    if front == "fully_shard":
        # an unused parameter has no state anywhere: keyless on every rank alike
        assert bool(keys.get(EXTRA)) == use_extra, keys.get(EXTRA)
    assert sum(r["held_not_stepped"] for r in res) > 0, res


def receipts_follow_gradients(find_unused: bool) -> dict:
    """The step receipt mirrors the step replica's ``.grad``: a parameter used under one optimizer,
    then unused after ``zero_grad`` under a fresh one, has no state under the fresh one anywhere
    (a receipt kept from the first would make its outside owner alone present keys: a hang).
    With ``set_find_unused_parameters(False)`` the step replica takes the unread (zero) sum, so
    every rank presents its keys."""
    model, first = _build("fully_shard", seed=0)
    if not find_unused:
        model.set_find_unused_parameters(False)
    _train(model, first, range(1), use_extra=True)
    fresh = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    _train(model, fresh, range(1, 3), use_extra=False)
    osd = get_optimizer_state_dict(model, fresh, options=FULL)
    return {"keys": _keys(osd)}


@pytest.mark.parametrize("find_unused", [True, False])
def test_hsdp_split_step_receipts_follow_the_step_replicas_gradients(find_unused):
    res = get_pool(R * S).run(receipts_follow_gradients, find_unused, timeout=TIMEOUT)
    keys = res[0]["keys"]
    for r in res:
        assert r["keys"] == keys, "ranks present different state keys"
    assert bool(keys.get(EXTRA)) == (not find_unused), keys.get(EXTRA)
