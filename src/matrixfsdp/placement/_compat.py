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
(:func:`called_from`), and only on the torch versions in :data:`SUPPORTED_TORCH`, which
``tests/test_layering.py`` pins: a torch upgrade fails that test until these paths are verified
again (``tests/checkpoint/test_full_state_load.py``). On any other version the workaround is off, and the
full-state-dict loaders fail as torch's own code does.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["SUPPORTED_TORCH", "enabled", "called_from"]

#: torch releases (major.minor) on which the caller checks below are verified
SUPPORTED_TORCH = ("2.13",)

_CODES: dict[str, Any] = {}


def enabled() -> bool:
    return ".".join(torch.__version__.split(".")[:2]) in SUPPORTED_TORCH


def _dsd_code(name: str) -> Any:
    """The code object of ``torch.distributed._state_dict_utils.<name>`` (None if absent)."""
    if name not in _CODES:
        from torch.distributed import _state_dict_utils

        fn = getattr(_state_dict_utils, name, None)
        _CODES[name] = getattr(fn, "__code__", None)
    return _CODES[name]


def called_from(name: str, depth: int = 2) -> bool:
    """Whether the caller ``depth`` frames up (the caller of the function calling this) is
    ``torch.distributed._state_dict_utils.<name>``; False on unsupported torch versions."""
    if not enabled():
        return False
    code = _dsd_code(name)
    return code is not None and sys._getframe(depth).f_code is code
