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
is the same file in 2.13.0, 2.14.1 and 2.15.0, and 2.11.0's differs only in ShardedTensor's
all-gather call and type hints; ``tests/checkpoint/test_full_state_load.py`` passes on each, on
2.11 through [Note: DTensor subclasses on torch 2.11]), which ``tests/test_layering.py`` pins: a torch upgrade fails that test until
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

__all__ = ["SUPPORTED_TORCH", "UnverifiedTorchError", "enabled", "called_from", "subclass_dispatch",
           "dtensor_dispatch", "subclass_torch_function"]

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
    torch 2.11 dispatches every DTensor op in C++ (``dispatchDTensorOp``, taken for any
    ``isinstance(arg, DTensor)``): a subclass's ``__torch_dispatch__`` is never called. Results of
    ops on an owned tensor were then plain DTensors (``detach()`` in ``state_dict()``, optimizer
    state from ``zeros_like``), so the full state dict gathered plain one-rank DTensors: empty
    tensors on every rank but the owner, silently (measured at W=2 and 3); expert stacks lost
    their row layout the same way. torch 2.13 takes that path only for subclasses that do not
    override ``__torch_dispatch__`` and gave the base class a ``__torch_dispatch__`` that
    subclasses delegate to; 2.11's raises ``NotImplementedError`` ("should not actually get
    called"). That is the probe: one call on a plain one-element tensor, no mesh, no process
    group. Where it is False, :func:`subclass_torch_function` (the subclasses'
    ``__torch_function__``) runs each torch call under :class:`_SubclassDispatchMode`, a dispatch
    mode -- modes are asked before any subclass, the C++ fast path included -- that hands an op
    on one of our subclasses to that subclass's ``__torch_dispatch__``, and
    :func:`dtensor_dispatch` stands in for 2.13's base ``DTensor.__torch_dispatch__``. The
    subclasses' dispatch code is then the same on every release. Ops torch runs with no torch call
    on the subclass around them (autograd's backward) take DTensor's path on 2.11; matrixfsdp's
    runtimes build gradients themselves and compute on local tensors (measured on 2.11: a
    direct ``(p * p).sum().backward()`` on an owned parameter leaves an ``OwnedDTensor`` grad
    whose ``full_tensor()`` is right on every rank)."""
    global _SUBCLASS_DISPATCH
    if _SUBCLASS_DISPATCH is None:
        from torch.distributed.tensor import DTensor

        try:
            DTensor.__torch_dispatch__(torch.ops.aten.detach.default, (torch.Tensor,), (torch.zeros(1),), {})
            _SUBCLASS_DISPATCH = True
        except NotImplementedError:
            _SUBCLASS_DISPATCH = False
    return _SUBCLASS_DISPATCH


def dtensor_dispatch(func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """``super().__torch_dispatch__`` of a DTensor subclass: DTensor's own dispatch of ``func``
    with subclass instances seen as plain DTensors (2.13's base ``__torch_dispatch__``; on 2.11,
    which has none, the same unwrapping, then the C++ fast path)."""
    from torch.distributed.tensor import DTensor

    if subclass_dispatch():
        return DTensor.__torch_dispatch__(func, types, args, kwargs)

    def unwrap(t: Any) -> Any:
        if isinstance(t, DTensor) and type(t) is not DTensor:
            return DTensor(t._local_tensor, t._spec, requires_grad=t.requires_grad)
        return t

    from torch.utils._pytree import tree_map

    return func(*tree_map(unwrap, tuple(args)), **tree_map(unwrap, kwargs or {}))


def _own_dispatch(t: Any) -> Any:
    """The ``__torch_dispatch__`` of ``t``'s class if it is a DTensor subclass overriding it."""
    from torch.distributed.tensor import DTensor

    cls = type(t)
    if cls is DTensor or not isinstance(t, DTensor):
        return None
    own = cls.__torch_dispatch__
    return None if own.__func__ is DTensor.__torch_dispatch__.__func__ else own


_MODE_CLS: Any = None


def _mode() -> Any:
    """A fresh :class:`_SubclassDispatchMode` (built on first use: torch 2.11 only)."""
    global _MODE_CLS
    if _MODE_CLS is None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        class _SubclassDispatchMode(TorchDispatchMode):
            """Hands an op on one of matrixfsdp's DTensor subclasses to its ``__torch_dispatch__``
            (see [Note: DTensor subclasses on torch 2.11]); the mode is off while it runs."""

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                for a in tree_flatten((args, kwargs or {}))[0]:
                    handler = _own_dispatch(a)
                    if handler is not None:
                        return handler(func, types, args, kwargs)
                return func(*args, **(kwargs or {}))

        _MODE_CLS = _SubclassDispatchMode
    return _MODE_CLS()


def subclass_torch_function(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """``__torch_function__`` of matrixfsdp's DTensor subclasses where :func:`subclass_dispatch`
    is False (torch 2.11): the call as is, with its aten ops routed to the subclasses' dispatch."""
    with torch._C.DisableTorchFunctionSubclass(), _mode():
        return func(*args, **(kwargs or {}))


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
