"""Segment math for one wrapped block: who stores which rows, and where they travel.

Pure functions of an :class:`~matrixfsdp.planner.owner_plan.OwnerPlan`'s parameters and the world size: no
process group, no tensor. The front-ends (``_fully_shard/param_group.py``, ``_replicate/bucket_layout.py``) turn these numbers into buffer views and
collective split sizes; the property tests in ``tests/engine/test_layout.py`` pin the invariants.

[Note: chunks and pieces]
Every parameter is partitioned along dim 0 into ``W`` contiguous row ranges in rank order (see
[Note: row segments] in ``planner/owner_plan.py``). A *piece* is one non-empty row range of one parameter on
one rank; since rows are contiguous in a row-major tensor, a piece is also a contiguous range
``[flat_start, flat_start + numel)`` of the flattened parameter. Rank ``r``'s *chunk* is the
concatenation of its pieces in parameter order: ``chunk_numel[r]`` elements, piece ``p`` at
``p.offset``. Chunks are the unit on the wire, in both directions:

* materialization (``all_gather_segments``): rank ``r`` sends its chunk to every peer and receives
  every peer's chunk; its receive buffer holds the peers' chunks in rank order, *without* its own
  (the owner computes on its own storage, see [Note: buffer lifetime] in ``_fully_shard/param_group.py``);
* reduction (``reduce_scatter_segments``): every rank lays its full gradients out as all ``W``
  chunks in rank order (chunk ``d`` = the rows rank ``d`` stores, followed by ``extra`` scalars,
  the usage flags); the reduce-scatter leaves chunk ``r`` summed on rank ``r``.

A parameter with exactly one piece (every owned parameter, and even ones with fewer rows than
ranks' chunks) is contiguous in whichever buffer holds that piece, so the runtime views it in
place; a parameter with several pieces (even placement) is assembled by copying its pieces into
a parameter-major buffer (``assembled_offset``).

[Note: aligned reduce chunks]
The reduce-scatter input is ``W`` destination chunks back to back, each followed by ``extra``
usage flags (see [Note: unused parameters] in ``engine/reducer.py``). With ``F`` flags, chunk
``d`` starts at ``sum(n_e + F for e < d)`` elements: any ``F`` that is not a multiple of
``16 / itemsize`` pushes every later chunk off a 16-byte boundary (unpadded, ``plan_owners`` on the
Qwen3-8B preset misaligns 259 of 296 chunk starts at W=8 in bf16 and 518 of 592 at W=16; see
``tests/engine/test_layout.py``), and NCCL and the copy kernels fall back to narrower loads on misaligned
buffers. So the flag block of every chunk is padded with zeros up to the next multiple
of :data:`ALIGN_BYTES` (``reduce_splits(extra, itemsize=...)``): every chunk start is aligned, at
a cost of fewer than ``16 / itemsize`` elements per destination (< 16 bytes per destination and
block). ``replicate``'s gradient buffer pads each rank's interval by the same rule
(:func:`aligned_numel`). The padding is never read; it is summed like the rest.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from ..planner.owner_plan import ParamPlan

__all__ = ["Piece", "ParamLayout", "BlockLayout", "GatherSplits", "ALIGN_BYTES", "aligned_numel"]

#: every reduce-scatter destination chunk starts at a multiple of this many bytes (see
#: [Note: aligned reduce chunks])
ALIGN_BYTES = 16


def aligned_numel(numel: int, itemsize: int | None) -> int:
    """``numel`` rounded up so that ``numel * itemsize`` is a multiple of :data:`ALIGN_BYTES`
    (``itemsize=None``: no padding, the bare layout)."""
    if itemsize is None:
        return numel
    if not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"aligned_numel: itemsize must be a positive int or None, got {itemsize!r}")
    step = max(1, ALIGN_BYTES // itemsize)
    return -(-numel // step) * step


@dataclass(frozen=True)
class Piece:
    """One non-empty row segment of one parameter, stored on one rank."""

    param: int  #: index into :attr:`BlockLayout.params`
    rank: int
    row_start: int
    row_end: int
    flat_start: int  #: element offset in the flattened full parameter
    numel: int
    offset: int  #: element offset in the rank's chunk


@dataclass(frozen=True)
class ParamLayout:
    """The row split of one parameter (``rows[r]`` = the ``[start, end)`` rank ``r`` stores)."""

    fqn: str
    shape: tuple[int, ...]
    owner: int | None
    rows: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        """Elements per row (a 0-dim parameter is one row of one element)."""
        return math.prod(self.shape[1:]) if self.shape else 1

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor: ``[rows, *shape[1:]]`` (0-dim: ``()`` on the owner)."""
        start, end = self.rows[rank]
        if not self.shape:
            return () if end > start else (0,)
        return (end - start, *self.shape[1:])


@dataclass(frozen=True)
class GatherSplits:
    """What one rank passes to an uneven all-to-all that materializes a block.

    ``input_splits[d]`` elements go to rank ``d`` (the whole chunk to every peer, 0 to self);
    ``output_splits[s]`` elements arrive from rank ``s`` at ``recv_offsets[s]`` of the receive
    buffer (0 from self).
    """

    send_numel: int
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    recv_offsets: tuple[int, ...]

    @property
    def recv_numel(self) -> int:
        return sum(self.output_splits)


@dataclass(frozen=True)
class BlockLayout:
    """Chunk layout of a block's parameters (see [Note: chunks and pieces]).

    Example::

        layout = BlockLayout.from_plans(plan.params_of_block("blocks.0"), plan.world_size)
        layout.chunk_numel        # elements each rank stores for the block
        layout.gather_splits(r)   # all-to-all split sizes for rank r
        layout.reduce_splits(extra=len(layout.params))  # reduce-scatter sizes, one flag per param
    """

    world_size: int
    params: tuple[ParamLayout, ...]

    def __post_init__(self) -> None:
        W = self.world_size
        if W < 1:
            raise ValueError(f"BlockLayout: world_size must be >= 1, got {W}")
        for p in self.params:
            if len(p.rows) != W:
                raise ValueError(f"BlockLayout: {p.fqn!r} has {len(p.rows)} row ranges for W={W}")
            n = p.shape[0] if p.shape else 1
            pos = 0
            for start, end in p.rows:
                # Row ranges are in rank order and tile [0, n); an empty range may sit anywhere.
                if end < start or (end > start and start != pos):
                    raise ValueError(f"BlockLayout: {p.fqn!r} rows {p.rows} do not tile [0, {n})")
                pos = max(pos, end)
            if pos != n:
                raise ValueError(f"BlockLayout: {p.fqn!r} rows {p.rows} do not tile [0, {n})")

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_plans(cls, plans: Sequence[ParamPlan], world_size: int) -> "BlockLayout":
        """The layout of ``plans`` (in the given order) over ``world_size`` ranks."""
        return cls(
            world_size=world_size,
            params=tuple(
                ParamLayout(
                    fqn=p.fqn,
                    shape=tuple(p.shape),
                    owner=p.owner,
                    rows=tuple(p.local_rows(r, world_size) for r in range(world_size)),
                )
                for p in plans
            ),
        )

    # ----------------------------------------------------------------------------- pieces
    @functools.cached_property
    def pieces(self) -> tuple[Piece, ...]:
        """All non-empty pieces, rank-major (the wire order), parameters in order within a rank."""
        out = []
        for r in range(self.world_size):
            offset = 0
            for i, p in enumerate(self.params):
                start, end = p.rows[r]
                if end == start or p.row_numel == 0:
                    continue
                numel = (end - start) * p.row_numel
                out.append(Piece(i, r, start, end, start * p.row_numel, numel, offset))
                offset += numel
        return tuple(out)

    @functools.cached_property
    def _by_rank(self) -> tuple[tuple[Piece, ...], ...]:
        # one pass (a scan per rank would make sharding O(W^2) at thousands of ranks)
        out: list[list[Piece]] = [[] for _ in range(self.world_size)]
        for q in self.pieces:
            out[q.rank].append(q)
        return tuple(map(tuple, out))

    @functools.cached_property
    def _by_param(self) -> tuple[tuple[Piece, ...], ...]:
        out: list[list[Piece]] = [[] for _ in self.params]
        for q in self.pieces:
            out[q.param].append(q)
        return tuple(map(tuple, out))

    def pieces_of_rank(self, rank: int) -> tuple[Piece, ...]:
        """Rank ``rank``'s pieces in chunk order."""
        return self._by_rank[rank]

    def pieces_of_param(self, index: int) -> tuple[Piece, ...]:
        """Parameter ``index``'s pieces in rank (= row) order."""
        return self._by_param[index]

    @functools.cached_property
    def chunk_numel(self) -> tuple[int, ...]:
        """Elements rank ``r`` stores for this block (the size of its chunk)."""
        return tuple(sum(q.numel for q in self._by_rank[r]) for r in range(self.world_size))

    @property
    def numel(self) -> int:
        """Elements of the whole block (every parameter in full)."""
        return sum(p.numel for p in self.params)

    # ----------------------------------------------------------------------------- materialization
    def gather_splits(self, rank: int) -> GatherSplits:
        """Split sizes of the uneven all-to-all that materializes the block on ``rank``."""
        W, chunk = self.world_size, self.chunk_numel
        inp = tuple(chunk[rank] if d != rank else 0 for d in range(W))
        out = tuple(chunk[s] if s != rank else 0 for s in range(W))
        offs, acc = [], 0
        for n in out:
            offs.append(acc)
            acc += n
        return GatherSplits(chunk[rank], inp, out, tuple(offs))

    def single_piece(self, index: int) -> Piece | None:
        """The parameter's only piece if it has exactly one (then it is contiguous in place)."""
        ps = self._by_param[index]
        return ps[0] if len(ps) == 1 else None

    @functools.cached_property
    def _assembled(self) -> tuple[tuple[int | None, ...], int]:
        offs: list[int | None] = []
        acc = 0
        for i, p in enumerate(self.params):
            if len(self._by_param[i]) > 1:
                offs.append(acc)
                acc += p.numel
            else:
                offs.append(None)
        return tuple(offs), acc

    def assembled_offset(self, index: int) -> int | None:
        """Offset of a multi-piece parameter in the assembled buffer (``None``: single piece)."""
        return self._assembled[0][index]

    @property
    def assembled_numel(self) -> int:
        """Size of the parameter-major buffer multi-piece parameters are copied into."""
        return self._assembled[1]

    # ----------------------------------------------------------------------------- reduction
    def reduce_splits(self, extra: int = 0, *, itemsize: int | None = None) -> tuple[int, ...]:
        """Per-destination sizes of the reduce-scatter input: chunk ``d`` plus ``extra`` scalars,
        padded to :data:`ALIGN_BYTES` for elements of ``itemsize`` bytes (``None``: unpadded; see
        [Note: aligned reduce chunks])."""
        return tuple(aligned_numel(n + extra, itemsize) for n in self.chunk_numel)

    def reduce_offsets(self, extra: int = 0, *, itemsize: int | None = None) -> tuple[int, ...]:
        """Where chunk ``d`` starts in the reduce-scatter input."""
        offs, acc = [], 0
        for n in self.reduce_splits(extra, itemsize=itemsize):
            offs.append(acc)
            acc += n
        return tuple(offs)

    # ----------------------------------------------------------------------------- accounting
    def gather_bytes(self, rank: int, itemsize: int) -> tuple[int, int]:
        """``(sent, received)`` bytes of ``rank`` for one materialization."""
        s = self.gather_splits(rank)
        return sum(s.input_splits) * itemsize, s.recv_numel * itemsize

    def reduce_bytes(self, rank: int, itemsize: int, extra: int = 0, *, aligned: bool = False) -> tuple[int, int]:
        """``(sent, received)`` bytes of ``rank`` for one reduction, counted as a direct
        reduce-scatter: each rank sends every peer that peer's chunk and receives ``W - 1``
        contributions to its own. Summed over ranks this equals a ring reduce-scatter of the same
        chunks, ``(W - 1) * total``. ``aligned``: with the runtime's padding (see
        [Note: aligned reduce chunks])."""
        splits = self.reduce_splits(extra, itemsize=itemsize if aligned else None)
        mine = splits[rank]
        return (sum(splits) - mine) * itemsize, (self.world_size - 1) * mine * itemsize
