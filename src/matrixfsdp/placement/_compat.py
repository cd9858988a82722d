"""Version-gated workarounds for torch internals: the only place matrixfsdp inspects a caller.

[Note: torch's full state-dict loaders and owned tensors]
``set_model_state_dict`` / ``set_optimizer_state_dict`` with ``full_state_dict=True`` distribute
each incoming full tensor onto the local DTensor's mesh; torch 2.13 assumes every rank is in that
mesh, which a one-rank owner mesh breaks in two places, and no public hook runs earlier:

* ``broadcast_from_rank0=True``: ``_distribute_tensors`` copies ``full[slices]`` into
  ``to_local()``; for a rank outside the mesh ``compute_local_shape_and_global_offset`` gives
  offset ``()``, so the slice is the whole tensor and the copy into the ``[0, ...]`` local raised
  on non-owners while the owner went on to the next broadcast (a hang). Called from there, a
  non-owner's ``to_local()`` hands out a scratch buffer of the full shape instead: the copy lands
  nowhere (a non-owner holds none of the value), the owner's copy writes its parameter; every rank
  then loads alike.
* without it: ``_distribute_state_dict`` runs ``distribute_tensor`` on the owner mesh, which
  broadcasts over that mesh's process group; owner meshes have none, so the owner raised and the
  others went on. Read from there, the mesh raises a ``ValueError`` on every rank at the same key
  instead (every rank's local state holds the same owned keys).

Why not an owner ``Placement`` on the full data-parallel mesh instead, which would need none of
this: in torch 2.13 a Python ``Placement`` subclass cannot be redistributed (``full_tensor()`` and
any op mixing it with a regular DTensor raise "redistribute from Owned(0) to R not supported"),
DCP treats the unknown placement like ``Replicate`` (its save de-duplication picked a non-owner's
empty local tensor as the writer: a silently corrupt checkpoint), and a ``Shard`` subclass is
refused by ``DTensorSpec._verify_shard_order`` (see ``shared/notes/torch-2.13-cpu-facts.md``).

The callers are recognized by code object identity against the torch functions above
(:func:`called_from`), on the torch versions in :data:`SUPPORTED_TORCH` (``_state_dict_utils.py``
is the same file in 2.13.0, 2.14.1 and 2.15.0; ``tests/checkpoint/test_full_state_load.py``
passes on each), which ``tests/test_layering.py`` pins: a torch upgrade fails that test until
these paths are verified again. On any other version a call from a function of that name raises
:class:`UnverifiedTorchError` (a ``ValueError`` naming the version and loads that work) instead:
every rank reads ``device_mesh`` / ``placements`` of the same local tensor at the same key, so
every rank raises alike (before this, the loaders hung: the owner copied and went on to the
next broadcast while the others raised).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["SUPPORTED_TORCH", "UnverifiedTorchError", "enabled", "called_from", "subclass_dispatch"]

#: torch releases (major.minor) on which the caller checks below are verified
SUPPORTED_TORCH = ("2.11", "2.13", "2.14", "2.15")

_DSD_MODULE = "torch.distributed._state_dict_utils"
_CODES: dict[str, Any] = {}


class UnverifiedTorchError(ValueError):
    """A torch full-state-dict loader met an owned tensor on a torch release whose loaders
    matrixfsdp has not verified."""


def enabled() -> bool:
    return ".".join(torch.__version__.split(".")[:2]) in SUPPORTED_TORCH


_SUBCLASS_DISPATCH: bool | None = None


def subclass_dispatch() -> bool:
    """Whether DTensor's dispatch runs a DTensor subclass's own ``__torch_dispatch__``.

    [Note: DTensor subclasses on torch 2.11]
    torch 2.11 dispatches every DTensor op in C++ (``dispatchDTensorOp``, reached for any
    ``isinstance(arg, DTensor)``): a subclass's ``__torch_dispatch__`` is never called, so results
    of ops on an owned tensor were plain DTensors (``detach()`` in ``state_dict()``, optimizer
    state from ``zeros_like``), and the full state dict gathered them as plain one-rank DTensors:
    empty tensors on every rank but the owner (measured at W=2 and 3). torch 2.13 takes that fast
    path only for subclasses that do not override ``__torch_dispatch__``, and gave the base
    class a ``__torch_dispatch__`` that subclasses delegate to; 2.11's raises
    ``NotImplementedError`` ("should not actually get called"). That is the probe: one call with
    a plain one-element tensor, no mesh, no process group. Where it is False, ``OwnedDTensor``
    adopts op results in ``__torch_function__`` instead, and expert stacks are refused."""
    global _SUBCLASS_DISPATCH
    if _SUBCLASS_DISPATCH is None:
        from torch.distributed.tensor import DTensor

        try:
            DTensor.__torch_dispatch__(torch.ops.aten.detach.default, (torch.Tensor,), (torch.zeros(1),), {})
            _SUBCLASS_DISPATCH = True
        except NotImplementedError:
            _SUBCLASS_DISPATCH = False
    return _SUBCLASS_DISPATCH


def _dsd_code(name: str) -> Any:
    """The code object of ``torch.distributed._state_dict_utils.<name>`` (None if absent)."""
    if name not in _CODES:
        from torch.distributed import _state_dict_utils

        fn = getattr(_state_dict_utils, name, None)
        _CODES[name] = getattr(fn, "__code__", None)
    return _CODES[name]


def called_from(*names: str, depth: int = 2) -> str | None:
    """Which of ``torch.distributed._state_dict_utils.<name>`` for ``name`` in ``names`` is the
    caller ``depth`` frames up (the caller of the function calling this), or None; one frame
    lookup for all names. On a torch release outside :data:`SUPPORTED_TORCH`, a caller of one
    of those names in that module raises :class:`UnverifiedTorchError`."""
    frame = sys._getframe(depth)
    if enabled():
        return next((n for n in names if (code := _dsd_code(n)) is not None and frame.f_code is code), None)
    name = frame.f_code.co_name
    if name in names and frame.f_globals.get("__name__") == _DSD_MODULE:
        raise UnverifiedTorchError(
            f"matrixfsdp: torch {torch.__version__}'s full-state-dict loader ({_DSD_MODULE}.{name}, "
            "reached from set_model_state_dict/set_optimizer_state_dict with "
            "StateDictOptions(full_state_dict=True)) is not verified with matrixfsdp's owned tensors "
            f"(verified on torch {', '.join(SUPPORTED_TORCH)}); load a DCP checkpoint with "
            "matrixfsdp.checkpoint.load (a full state dict on disk converts with `python -m "
            "matrixfsdp.checkpoint import`), or copy each full tensor with "
            "matrixfsdp.set_full_(param, tensor)"
        )
    return None
