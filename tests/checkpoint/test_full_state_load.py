"""torch's full state-dict loaders on a sharded model (issue 10, last part).

``set_model_state_dict`` / ``set_optimizer_state_dict`` with ``StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True)`` (and ``cpu_offload=True``) load owned parameters on every rank: the
parameters equal the full dict bitwise and training continues exactly as before a save/load
round trip (torch AdamW and ``matrixfsdp.optim.Muon(model)``). Without ``broadcast_from_rank0``
torch's loader needs a process group on each one-rank owner mesh, which matrixfsdp does not
create: every rank raises the same ValueError (before the fix: an error on owners only, a copy
error on non-owners with the owner hanging in the next broadcast). W=2 and W=3.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _models import TinyConfig, TinyDecoder, make_batch, make_plan
from fully_shard.test_parity import shard_model

import matrixfsdp

TIMEOUT = 90  # a hang (the pre-fix behaviour) fails the test instead of blocking it
NO_BCAST_MSG = "would distribute a tensor of shape"


def _sharded(W: int, seed: int = 0, scalar: bool = True):
    model = TinyDecoder(TinyConfig(scalar_param=scalar), seed=seed)
    mesh = init_device_mesh("cpu", (W,))
    shard_model(model, mesh, make_plan(model, W))
    return model


def _rank0_copy(sd: dict, bcast: bool) -> dict:
    # torch consumes rank 0's dict with broadcast_from_rank0 (values replaced); others may pass {}
    return copy.deepcopy(sd) if (dist.get_rank() == 0 or not bcast) else {}


def _train(model, opt, steps: range, W: int) -> list[float]:
    losses = []
    for step in steps:
        x, y = make_batch(TinyConfig(), step, 2 * W)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def model_load_check(variant: dict) -> dict:
    W = dist.get_world_size()
    bcast = variant.get("broadcast_from_rank0", False)
    model = _sharded(W, seed=0)
    src = TinyDecoder(TinyConfig(), seed=7)  # the plain reference, other values than the model's
    full = src.state_dict()
    try:
        set_model_state_dict(model, _rank0_copy(full, bcast),
                             options=StateDictOptions(full_state_dict=True, **variant))
    except ValueError as e:
        return {"error": str(e)}
    out: dict = {"error": None}
    out["bitwise"] = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), full[n])]
    out["n_owned"] = sum(matrixfsdp.owned_of(p) is not None for p in model.parameters())
    # training continues as the plain reference's (same batches, averaged gradients)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(src.parameters(), lr=1e-2)
    losses = _train(model, opt, range(3), W)
    rlosses = _train(src, ropt, range(3), W)
    out["loss_diff"] = max(abs(a - b) for a, b in zip(losses, rlosses))
    out["param_diff"] = max((p.full_tensor() - q).abs().max().item()
                            for p, q in zip(model.parameters(), src.parameters()))
    return out


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("variant", [dict(broadcast_from_rank0=True),
                                     dict(broadcast_from_rank0=True, cpu_offload=True)],
                         ids=["bcast", "bcast-offload"])
def test_set_model_state_dict_full_broadcast(W, variant):
    for r in get_pool(W).run(model_load_check, variant, timeout=TIMEOUT):
        assert r["error"] is None, r
        assert r["n_owned"] > 0 and r["bitwise"] == [], r
        assert r["loss_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("variant", [dict(), dict(cpu_offload=True)], ids=["full", "full-offload"])
def test_set_model_state_dict_full_without_broadcast_raises_on_every_rank(W, variant):
    res = get_pool(W).run(model_load_check, variant, timeout=TIMEOUT)
    for r in res:
        assert r["error"] is not None and NO_BCAST_MSG in r["error"], r
        assert "broadcast_from_rank0=True" in r["error"] and "owned_by_rank" in r["error"], r
    assert len({r["error"] for r in res}) == 1  # the same error (same key) on every rank


def _make_opt(name: str, model):
    if name == "Muon":
        return matrixfsdp.optim.Muon(model, lr=0.01, ns_dtype=torch.float32)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def optim_load_check(name: str, bcast: bool, scalar: bool = True) -> dict:
    """Train 2 steps, save full model+optimizer dicts, load them into a fresh sharded model and
    optimizer, train 2 more steps on both: the restored run must equal the original bitwise.
    ``scalar``: the model has 0-dim (owned) parameters."""
    W = dist.get_world_size()
    model = _sharded(W, seed=0, scalar=scalar)
    opt = _make_opt(name, model)
    _train(model, opt, range(2), W)
    opts = StateDictOptions(full_state_dict=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, opt, options=opts)

    model2 = _sharded(W, seed=3, scalar=scalar)
    opt2 = _make_opt(name, model2)
    # strict=False: the gated block's unused projection has no state (torch refuses that with
    # strict=True, sharded or not)
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=bcast, strict=False)
    try:
        # the model loads with broadcast either way: the optimizer's own path is under test
        set_model_state_dict(model2, _rank0_copy(msd, True),
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        set_optimizer_state_dict(model2, opt2, _rank0_copy(osd, bcast), options=load)
    except ValueError as e:
        return {"error": str(e)}
    out: dict = {"error": None}
    osd2 = get_optimizer_state_dict(model2, opt2, options=opts)
    # (strict=False keeps the initialised state of parameters absent from the dict: compare
    # the dict's entries)
    out["state_equal"] = set(osd["state"]) <= set(osd2["state"]) and all(
        (torch.equal(v, osd2["state"][f][k]) if torch.is_tensor(v) else v == osd2["state"][f][k])
        for f, st in osd["state"].items() for k, v in st.items())
    a = _train(model, opt, range(2, 4), W)
    try:
        b = _train(model2, opt2, range(2, 4), W)
    except ValueError as e:
        return {"error": None, "step_error": str(e)}
    out["losses_equal"] = a == b
    out["params_bitwise"] = [n for (n, p), q in zip(model.named_parameters(), model2.parameters())
                             if not torch.equal(p.full_tensor(), q.full_tensor())]
    return out


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("name,scalar", [("AdamW", False), ("Muon", True)])
def test_set_optimizer_state_dict_full_broadcast(W, name, scalar):
    for r in get_pool(W).run(optim_load_check, name, True, scalar, timeout=TIMEOUT):
        assert r["error"] is None and "step_error" not in r, r
        assert r["state_equal"] and r["losses_equal"] and r["params_bitwise"] == [], r


def test_torch_optimizer_state_of_0dim_owned_param_refuses_to_step_after_full_load():
    # torch's loader hands 0-dim state (AdamW's exp_avg of a 0-dim parameter) over as plain
    # tensors; the next step would update the owner's copy only: refused, on every rank alike
    res = get_pool(2).run(optim_load_check, "AdamW", True, True, timeout=TIMEOUT)
    for r in res:
        assert "aten::lerp_" in r["step_error"] and "would write a plain tensor of shape ()" in r["step_error"], r
        assert "matrixfsdp.optim" in r["step_error"], r


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_set_optimizer_state_dict_full_without_broadcast_raises_on_every_rank(name):
    res = get_pool(3).run(optim_load_check, name, False, timeout=TIMEOUT)
    for r in res:
        assert r["error"] is not None and NO_BCAST_MSG in r["error"], r


# ------------------------------------------------------------------ an unverified torch release
UNVERIFIED = "2.99.0+unverified"


def on_unverified_torch(fn, *args) -> dict:
    """``fn(*args)`` while torch claims a release matrixfsdp has not verified its loaders on."""
    real = torch.__version__
    torch.__version__ = UNVERIFIED
    try:
        return fn(*args)
    except ValueError as e:
        return {"error": str(e)}
    finally:
        torch.__version__ = real


def expert_load_check() -> dict:
    from checkpoint.test_experts import build

    model, _, _ = build("flat", dist.get_world_size())
    plain, _, _ = build("flat")
    set_model_state_dict(model, plain.state_dict() if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return {"error": None}


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("what", ["model-bcast", "model", "optimizer-bcast", "experts-bcast"])
def test_unverified_torch_raises_the_same_error_on_every_rank(W, what):
    """On a torch release outside ``_compat.SUPPORTED_TORCH`` the loaders raise one ValueError
    naming the release and loads that work, on every rank at the same key; before, the
    broadcast path hung (the owner went on to the next broadcast while the others raised)."""
    if what == "experts-bcast":
        args = (expert_load_check,)
    elif what.startswith("model"):
        args = (model_load_check, dict(broadcast_from_rank0=True) if what == "model-bcast" else {})
    else:
        args = (optim_load_check, "Muon", True)
    res = get_pool(W).run(on_unverified_torch, *args, timeout=TIMEOUT)
    errors = {r["error"] for r in res}
    assert len(errors) == 1, errors
    (msg,) = errors
    assert msg is not None and f"torch {UNVERIFIED}'s full-state-dict loader" in msg, msg
    assert "is not verified with matrixfsdp's owned tensors (verified on torch 2.11, 2.13, 2.14, 2.15)" in msg, msg
    assert "matrixfsdp.checkpoint.load" in msg and "matrixfsdp.set_full_(param, tensor)" in msg, msg
