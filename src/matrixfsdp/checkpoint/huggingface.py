"""Hugging Face ``transformers`` models under matrixfsdp: writing a ``save_pretrained`` folder.

``PreTrainedModel.save_pretrained`` on a sharded model reads ``model.state_dict()``: owned
parameters there are DTensors whose local tensor is empty on every rank but the owner, so
transformers sees many empty tensors at the same address and refuses with a misleading "shared
tensors" error (and even where it did not, it would write empty shards). :func:`save_pretrained`
gathers each full tensor first (one broadcast per tensor, from its owner, in ``state_dict`` order
on every rank), keeps it only on rank 0, and lets rank 0 run transformers' own
``save_pretrained(state_dict=...)``: config, generation config, safetensors, tied weights written
once (aliased keys map to one gathered tensor, which transformers de-duplicates as for an
unsharded model).

:func:`enable_save_pretrained` gives the same collective form to ``model.save_pretrained`` itself
on every ``fully_shard``-ed Hugging Face model, through a class adapter of the engine's class swap
(the runtime knows nothing of transformers). It is a call, not an import side effect: importing
matrixfsdp changes no class.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.agree import agree, encode_error
from ..engine.swap import register_class_adapter

__all__ = ["save_pretrained", "gather_full_state_dict", "enable_save_pretrained"]


def gather_full_state_dict(model: nn.Module, *, rank0_only: bool = True, api: str = "matrixfsdp.checkpoint") -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded tensor replaced by its full value, on CPU.

    A collective: call on every rank. With ``rank0_only`` the other ranks get ``{}`` and hold at
    most one full tensor at a time. Keys that alias one parameter (tied weights) map to one
    tensor object, as in an unsharded model's state dict.
    """
    from .dcp import _check_sharded, drop_stale_state
    from ..placement.owned_tensor import full_tensor

    drop_stale_state(model)
    _check_sharded(model, api)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    keep = rank == 0 or not rank0_only
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            if keep:
                out[key] = seen[id(t)]
            continue
        full = full_tensor(t).detach()
        if keep:
            full = full.cpu()
            seen[id(t)] = full
            out[key] = full
        else:
            seen[id(t)] = None  # type: ignore[assignment]
    return out


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> str:
    """Write a Hugging Face ``save_pretrained`` folder from a (sharded) ``transformers`` model.

    Call on every rank (a collective): full tensors are gathered from their owners, rank 0 calls
    ``model.save_pretrained(save_directory, state_dict=full, **kwargs)`` (config, generation
    config, safetensors; tied weights written once, as transformers does), and every rank
    returns after the write, or raises the same error. Works unchanged on an unsharded model.
    ``from_pretrained(save_directory)`` then loads it anywhere. Returns ``save_directory``.

    Example::

        matrixfsdp.checkpoint.save_pretrained(model, "out/qwen3-finetuned")   # every rank
        model = Qwen3ForCausalLM.from_pretrained("out/qwen3-finetuned")        # one process
    """
    api = "matrixfsdp.checkpoint.save_pretrained"
    if not callable(getattr(model, "save_pretrained", None)) or not hasattr(model, "config"):
        raise TypeError(f"{api}: model must be a transformers PreTrainedModel (with save_pretrained "
                        f"and config), got {type(model).__name__}")
    for bad in ("state_dict", "is_main_process"):
        if bad in kwargs:
            raise ValueError(f"{api}: {bad}= is chosen by {api} itself, got {bad}= in kwargs")
    error = None
    full: dict[str, torch.Tensor] = {}
    try:
        full = gather_full_state_dict(model, api=api)
    except (ValueError, RuntimeError) as e:
        error = encode_error(e)
    agree(error)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank == 0:
        try:
            # transformers records type(model).__name__ in "architectures": the swapped class keeps
            # the user's name (see engine/swap.py)
            model.save_pretrained(save_directory, state_dict=full, is_main_process=True, **kwargs)
        except Exception as e:  # every rank must learn it
            error = encode_error(RuntimeError(f"{api}: writing {os.fspath(save_directory)!r} failed: "
                                      f"{type(e).__name__}: {e}"))
    del full
    agree(error)
    return os.fspath(save_directory)


def _collective_save_pretrained(self: nn.Module, save_directory: Any, **kwargs: Any) -> Any:
    """Hugging Face's ``save_pretrained`` on a ``fully_shard``-ed model: call it on every rank (a
    collective, as with FSDP2); see :func:`save_pretrained`."""
    if "state_dict" in kwargs:  # full tensors given (rank 0 inside save_pretrained above)
        return super(type(self), self).save_pretrained(save_directory, **kwargs)  # type: ignore[misc]
    return save_pretrained(self, save_directory, **kwargs)


def _save_pretrained_adapter(user_cls: type, mixin: type) -> dict[str, Any]:
    from .._fully_shard import MatrixFSDPModule

    if mixin is MatrixFSDPModule and callable(getattr(user_cls, "save_pretrained", None)):
        return {"save_pretrained": _collective_save_pretrained}
    return {}


def enable_save_pretrained() -> None:
    """Make ``model.save_pretrained(path)`` of every ``fully_shard``-ed ``transformers`` model
    (sharded before or after this call) collective, as :func:`save_pretrained`: call it on every
    rank, full tensors are gathered and rank 0 writes the folder. Idempotent; without it, use
    :func:`save_pretrained` (transformers' own would see the empty shards of non-owners).

    Example::

        matrixfsdp.checkpoint.enable_save_pretrained()
        model.save_pretrained("out/hf")        # every rank, e.g. from code that only knows transformers
    """
    register_class_adapter(_save_pretrained_adapter)
