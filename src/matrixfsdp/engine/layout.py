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

[Note: spans]
An evenly sharded parameter has a piece on (nearly) every rank, so listing pieces costs ``W`` per
parameter, and so did every view and copy built from them. Rows are described by runs instead
([Note: row runs] in ``engine/rows.py``), and the ranks are cut at every run's ends into
:class:`Span` s: within a span every rank's chunk has the same size and the same pieces at the
same offsets, each parameter's rows advancing from rank to rank by its piece. A block has
``O(runs)`` spans whatever ``W`` (a decoder block: a handful), so the runtime builds one view
per (span, parameter): the chunks of a span's ranks lie back to back in the receive buffer
(``W``-rank stride: the chunk size) and their pieces back to back in the parameter, which makes
a span's copy one strided copy (``_fully_shard/param_group.py``, ``engine/reducer.py``). The
per-rank tuples a collective takes (``chunk_numel``, ``gather_splits``) stay ``W`` long; what
``pieces`` and ``pieces_of_param`` list is still one entry per rank, for tests and small worlds.

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

import bisect
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from ..planner.owner_plan import ParamPlan
from .rows import RowSplit

__all__ = ["Piece", "ParamLayout", "Span", "BlockLayout", "GatherSplits", "RowSplit", "ALIGN_BYTES", "aligned_numel"]

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
    """The row split of one parameter (``rows[r]`` = the ``[start, end)`` rank ``r`` stores; a
    :class:`~matrixfsdp.engine.rows.RowSplit`, built from a tuple of ``W`` pairs when given one)."""

    fqn: str
    shape: tuple[int, ...]
    owner: int | None
    rows: RowSplit

    def __post_init__(self) -> None:
        if not isinstance(self.rows, RowSplit):
            n = self.shape[0] if self.shape else 1
            object.__setattr__(self, "rows", RowSplit.explicit(self.rows, n, f"BlockLayout: {self.fqn!r}"))

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
class Span:
    """Ranks ``[lo, hi)`` whose chunks are alike (see [Note: spans]): ``chunk`` elements each,
    every parameter's piece at the same chunk offset with the same size. ``pieces`` are rank
    ``lo``'s; rank ``d``'s piece of a parameter starts ``(d - lo) * numel`` elements (``(d - lo)
    * rows``) further into it."""

    lo: int
    hi: int
    chunk: int
    pieces: tuple[Piece, ...]

    def piece_at(self, q: Piece, rank: int) -> Piece:
        """Rank ``rank``'s piece of ``q``'s parameter (``q`` one of :attr:`pieces`)."""
        if rank == q.rank:
            return q
        step = rank - self.lo
        k = q.row_end - q.row_start
        return Piece(q.param, rank, q.row_start + step * k, q.row_end + step * k,
                     q.flat_start + step * q.numel, q.numel, q.offset)


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
        layout.spans              # the ranks in stretches of alike chunks (see [Note: spans])
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
            if p.rows.n != n:  # a RowSplit tiles [0, rows.n) by construction
                raise ValueError(f"BlockLayout: {p.fqn!r} rows {p.rows} do not tile [0, {n})")

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_plans(cls, plans: Sequence[ParamPlan], world_size: int) -> "BlockLayout":
        """The layout of ``plans`` (in the given order) over ``world_size`` ranks."""
        return cls(
            world_size=world_size,
            params=tuple(ParamLayout(fqn=p.fqn, shape=tuple(p.shape), owner=p.owner,
                                     rows=RowSplit.of_plan(p, world_size)) for p in plans),
        )

    # ----------------------------------------------------------------------------- spans
    @functools.cached_property
    def spans(self) -> tuple[Span, ...]:
        """The ranks cut into stretches of alike chunks, in rank order (see [Note: spans]): cut
        at every run's ends, so within a span each parameter's row count per rank is constant
        (zero or not), rows advancing by it from rank to rank."""
        W = self.world_size
        cuts = {0, W}
        for p in self.params:
            for lo, hi, _, _ in p.rows.runs:
                cuts.update((lo, hi))
            if p.owner is not None and 0 <= p.owner < W:  # an owner alone in its span, rows or not (usage flags)
                cuts.update((p.owner, p.owner + 1))
        edges = sorted(cuts)
        at = [0] * len(self.params)  # per parameter, its first run not yet left behind
        out = []
        for lo, hi in zip(edges, edges[1:]):
            pieces, offset = [], 0
            for i, p in enumerate(self.params):
                runs, j = p.rows.runs, at[i]
                while j < len(runs) and runs[j][1] <= lo:
                    j += 1
                at[i] = j
                rn = p.row_numel
                if j == len(runs) or runs[j][0] > lo or rn == 0:
                    continue
                r_lo, _, start, k = runs[j]
                row = start + (lo - r_lo) * k
                pieces.append(Piece(i, lo, row, row + k, row * rn, k * rn, offset))
                offset += k * rn
            out.append(Span(lo, hi, offset, tuple(pieces)))
        return tuple(out)

    def span_of(self, rank: int) -> Span:
        """The span holding ``rank``."""
        spans = self.spans
        return spans[bisect.bisect_right(self._span_starts, rank) - 1]

    @functools.cached_property
    def _span_starts(self) -> list[int]:
        return [s.lo for s in self.spans]

    # ----------------------------------------------------------------------------- pieces
    @functools.cached_property
    def pieces(self) -> tuple[Piece, ...]:
        """All non-empty pieces, rank-major (the wire order), parameters in order within a rank.
        ``W`` pieces per evenly sharded parameter: for tests and small worlds; the runtime works
        on :attr:`spans`."""
        return tuple(s.piece_at(q, d) for s in self.spans for d in range(s.lo, s.hi) for q in s.pieces)

    def pieces_of_rank(self, rank: int) -> tuple[Piece, ...]:
        """Rank ``rank``'s pieces in chunk order."""
        cache = self._rank_pieces
        got = cache.get(rank)
        if got is None:
            s = self.span_of(rank)
            got = cache[rank] = tuple(s.piece_at(q, rank) for q in s.pieces)
        return got

    @functools.cached_property
    def _rank_pieces(self) -> dict[int, tuple[Piece, ...]]:
        return {}

    def pieces_of_param(self, index: int) -> tuple[Piece, ...]:
        """Parameter ``index``'s pieces in rank (= row) order (``W`` of an evenly sharded one)."""
        return tuple(s.piece_at(q, d) for s, q in self.param_spans(index) for d in range(s.lo, s.hi))

    def param_spans(self, index: int) -> tuple[tuple[Span, Piece], ...]:
        """``(span, piece)`` of every span holding parameter ``index``, ``piece`` its rank ``lo``'s."""
        return self._by_param[index]

    @functools.cached_property
    def _by_param(self) -> tuple[tuple[tuple[Span, Piece], ...], ...]:
        out: list[list[tuple[Span, Piece]]] = [[] for _ in self.params]
        for s in self.spans:
            for q in s.pieces:
                out[q.param].append((s, q))
        return tuple(map(tuple, out))

    def piece_count(self, index: int) -> int:
        """How many ranks hold a piece of parameter ``index``."""
        return self._piece_counts[index]

    @functools.cached_property
    def _piece_counts(self) -> tuple[int, ...]:
        return tuple(sum(s.hi - s.lo for s, _ in spans) for spans in self._by_param)

    @functools.cached_property
    def chunk_numel(self) -> tuple[int, ...]:
        """Elements rank ``r`` stores for this block (the size of its chunk)."""
        out: list[int] = []
        for s in self.spans:
            out += [s.chunk] * (s.hi - s.lo)
        return tuple(out)

    @property
    def numel(self) -> int:
        """Elements of the whole block (every parameter in full)."""
        return sum(p.numel for p in self.params)

    # ----------------------------------------------------------------------------- materialization
    def gather_splits(self, rank: int) -> GatherSplits:
        """Split sizes of the uneven all-to-all that materializes the block on ``rank``."""
        chunk = self.chunk_numel
        inp = [chunk[rank]] * self.world_size
        inp[rank] = 0
        out = list(chunk)
        out[rank] = 0
        offs = tuple(itertools.accumulate(out[:-1], initial=0))
        return GatherSplits(chunk[rank], tuple(inp), tuple(out), offs)

    def single_piece(self, index: int) -> Piece | None:
        """The parameter's only piece if it has exactly one (then it is contiguous in place)."""
        spans = self._by_param[index]
        return spans[0][1] if self._piece_counts[index] == 1 else None

    @functools.cached_property
    def _assembled(self) -> tuple[tuple[int | None, ...], int]:
        offs: list[int | None] = []
        acc = 0
        for i, p in enumerate(self.params):
            if self._piece_counts[i] > 1:
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
