"""Which part of a parameter's global value this rank's storage holds.

[Note: one answer for where local storage sits]
Every kind of parameter this package makes keeps, on each rank, a *local tensor* (``p`` itself for
a plain tensor, ``p._local_tensor`` for a DTensor) that is one rectangular block of the global
value, or nothing:

* a plain tensor (an unsharded model, ``replicate``'s replicas, ``ignored_params``): the whole;
* an owned parameter (``fully_shard``'s ``"matrix"``/``"tail"``, one-rank owner mesh): the whole
  on every holder (its owner, in each HSDP replica), nothing elsewhere;
* an owned TP-sharded parameter (``fully_shard`` + TP, owner TP-row mesh): this rank's TP shard on
  the owner's row (by its own TP mesh's coordinate), nothing on other rows;
* an expert stack (``ExpertDTensor``): its rows by the plan's counts, not ``torch.chunk``'s;
* any other DTensor: an evenly sharded or data-parallel hosted parameter (``Shard(0)`` on the
  data-parallel mesh, ``(Replicate(), Shard(0))`` on HSDP), a TP parameter (``Shard(d)`` on the
  ``"tp"`` mesh), stock FSDP2's: DTensor's own rule (``compute_local_shape_and_global_offset``),
  with nothing on ranks outside the mesh.

:func:`local_slices` answers, for all of them, which global index ranges the local tensor holds;
``set_full_`` writes a whole value through it, QK-clip (``matrixfsdp.qk_clip``) scales the rows it
holds through :func:`local_rows`. A row-wise transformation applied by every rank to the rows it
holds therefore reaches every stored copy exactly once per copy; what runtimes then move (a
replica exchange, the next unshard) carries the transformed value.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .experts import ExpertDTensor
from .owner import owned_of, tp_mesh_of

__all__ = ["local_slices", "local_rows"]


def local_slices(t: torch.Tensor) -> tuple[slice, ...]:
    """The global index ranges, one ``slice`` per dimension, of ``t``'s local tensor (see [Note:
    one answer for where local storage sits]); empty slices where this rank stores none of it.
    Local: no communication.

    Example::

        index = local_slices(p)
        local_tensor(p).copy_(full[index])    # what set_full_ does
    """
    shape = tuple(t.shape)
    whole = tuple(slice(0, n) for n in shape)
    if not isinstance(t, DTensor):
        return whole
    local = t._local_tensor
    if local.numel() == 0 and any(n for n in shape):
        return tuple(slice(0, 0) for _ in shape)
    if isinstance(t, ExpertDTensor):
        first = t._first_row()
        return (slice(first, first + local.shape[0]), *whole[1:])
    tp = tp_mesh_of(t.device_mesh)
    if owned_of(t) is not None and tp is None:
        return whole
    mesh = tp if tp is not None else t.device_mesh
    placements = tuple(t.placements)
    if any(type(pl) not in (Shard, Replicate) and not pl.is_replicate() and not pl.is_partial()
           for pl in placements):
        return _strided(t, mesh, placements)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    lshape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    if not offset:  # not a member of the mesh
        return tuple(slice(0, 0) for _ in shape)
    return tuple(slice(o, o + n) for o, n in zip(offset, lshape))


def local_rows(t: torch.Tensor) -> range:
    """The global rows (dimension 0) of ``t`` that its local tensor holds, as a ``range`` (empty
    where this rank stores none). Every column of those rows that is stored here is in the local
    tensor's row at the same position: row ``r`` of the global value is local row
    ``r - local_rows(t).start``.

    Example::

        rows = local_rows(model.layers[0].self_attn.q_proj.weight)
        local_tensor(p).mul_(factor[rows.start:rows.stop, None])   # a row-wise scale, any placement
    """
    if t.ndim == 0:
        raise ValueError(f"matrixfsdp.placement.local_rows: a 0-dim tensor has no rows, got shape {tuple(t.shape)}")
    s = local_slices(t)[0]
    return range(s.start, s.stop)


def _strided(t: Any, mesh: Any, placements: tuple[Any, ...]) -> tuple[slice, ...]:
    """Other placements (stock FSDP2 + TP's ``_StridedShard``): the global indices of the local
    rows and columns, from DTensor's own split of index vectors (``src_data_rank=None``: every rank
    cuts its piece locally, no communication); each must be one contiguous range."""
    from torch.distributed.tensor import distribute_tensor

    out = []
    for dim, n in enumerate(t.shape):
        # only the placements that split this dimension; the others leave it whole
        mine = tuple(pl if (pl.is_shard() and getattr(pl, "dim", None) == dim) else Replicate() for pl in placements)
        idx = distribute_tensor(torch.arange(n), mesh, mine, src_data_rank=None).to_local()
        if idx.numel() and not torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + idx.numel())):
            raise ValueError(
                f"matrixfsdp.placement.local_slices: the local tensor of a DTensor with placements {placements} "
                f"holds non-contiguous indices along dimension {dim} (first {idx[:4].tolist()}), which no slice "
                "describes"
            )
        out.append(slice(int(idx[0]), int(idx[0]) + idx.numel()) if idx.numel() else slice(0, 0))
    return tuple(out)
