"""One parameter's row ranges over ``W`` ranks, described by runs instead of ``W`` pairs.

[Note: row runs]
Every placement gives rank ``r`` a contiguous row range, the ranges in rank order (see [Note: row
segments] in ``planner/owner_plan.py``). Listing them costs ``W`` entries per parameter, and
everything built from such a list (pieces, buffer views, copy lists) grows with ``W`` too: at
thousands of ranks that made sharding one rank take several times longer at ``W=4096`` than at
``W=1024`` (issue 44). But the ranges have a short description: a *run* ``(lo, hi, start, k)``
says that ranks ``d`` in ``[lo, hi)`` hold rows ``[start + (d - lo) * k, start + (d - lo + 1) * k)``,
``k > 0``; ranks in no run hold no row. An evenly sharded parameter (``torch.chunk``, chunk
``c``) is at most two runs, ``(0, n // c, 0, c)`` and the remainder's rank; an owned one is one
run on its owner; an expert stack one run per stretch of ranks holding the same number of
experts. :class:`RowSplit` keeps the runs (and answers ``rows[r]`` in O(1)), and the block
layout (``layout.py``) cuts the ranks into spans on the runs' ends: per block, work in the
number of runs, not of ranks. Only the per-rank split sizes a collective takes stay ``W`` long.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Iterator, Sequence

__all__ = ["RowSplit", "Run"]

#: ``(lo, hi, start, k)``: ranks ``[lo, hi)`` hold ``k`` rows each from row ``start`` on
Run = tuple[int, int, int, int]


class RowSplit(Sequence[tuple[int, int]]):
    """The row ranges of one parameter of ``n`` rows over ``world_size`` ranks (see [Note: row
    runs]). A sequence of ``world_size`` ``(start, end)`` pairs, as the plan's ``local_rows``
    gives them, stored as :attr:`runs`; build with :meth:`of_plan` or :meth:`explicit`."""

    __slots__ = ("world_size", "n", "runs", "_kind", "_data")

    def __init__(self, world_size: int, n: int, runs: tuple[Run, ...], kind: str, data: Any):
        self.world_size, self.n, self.runs = world_size, n, runs
        self._kind, self._data = kind, data

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def of_plan(cls, p: Any, world_size: int) -> "RowSplit":
        """The rows a :class:`~matrixfsdp.planner.owner_plan.ParamPlan` gives each rank (its
        ``local_rows``), in O(1) for owned and evenly sharded parameters and O(W) for an expert
        stack (its counts are ``W`` long already)."""
        W = world_size
        n = p.shape[0] if p.shape else 1
        if p.placement in ("even", "hosted"):
            c = -(-n // W) if n else 0
            full = n // c if c else 0
            rest = n - full * c
            runs = ((0, full, 0, c),) if full else ()
            if rest:
                runs += ((full, full + 1, full * c, rest),)
            return cls(W, n, runs, "even", c)
        if p.placement == "experts":
            counts = tuple(p.experts)
            return cls(W, n, _runs_of_counts(counts), "starts", _starts(counts))
        return cls(W, n, ((p.owner, p.owner + 1, 0, n),) if n else (), "owned", p.owner)

    @classmethod
    def explicit(cls, rows: Sequence[tuple[int, int]], n: int, where: str = "RowSplit") -> "RowSplit":
        """From ``W`` explicit ``(start, end)`` pairs; ``ValueError`` unless they tile ``[0, n)`` in
        rank order (an empty range may sit anywhere)."""
        rows = tuple((int(a), int(b)) for a, b in rows)
        pos = 0
        for start, end in rows:
            if end < start or (end > start and start != pos):
                raise ValueError(f"{where} rows {rows} do not tile [0, {n})")
            pos = max(pos, end)
        if pos != n:
            raise ValueError(f"{where} rows {rows} do not tile [0, {n})")
        return cls(len(rows), n, _runs_of_counts(tuple(b - a for a, b in rows)), "explicit", rows)

    # ----------------------------------------------------------------------------- sequence
    def __len__(self) -> int:
        return self.world_size

    def __getitem__(self, rank: Any) -> Any:
        if isinstance(rank, slice):
            return tuple(self[r] for r in range(*rank.indices(self.world_size)))
        if rank < 0:
            rank += self.world_size
        if not 0 <= rank < self.world_size:
            raise IndexError(f"RowSplit: rank {rank} out of range for {self.world_size} ranks")
        kind, data, n = self._kind, self._data, self.n
        if kind == "even":  # torch.chunk: planner.owner_plan.even_rows
            return min(rank * data, n), min((rank + 1) * data, n)
        if kind == "owned":
            return (0, n) if rank == data else (0, 0)
        if kind == "starts":
            return data[rank], data[rank + 1]
        return data[rank]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return (self[r] for r in range(self.world_size))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RowSplit):
            return (self.world_size, self.n, self.runs) == (other.world_size, other.n, other.runs)
        if isinstance(other, (tuple, list)):
            return len(other) == self.world_size and all(self[r] == tuple(x) for r, x in enumerate(other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.world_size, self.n, self.runs))

    def __repr__(self) -> str:
        return f"RowSplit(world_size={self.world_size}, n={self.n}, runs={self.runs})"

    def holds(self, rank: int) -> bool:
        """Whether ``rank`` holds at least one row."""
        start, end = self[rank]
        return end > start


@functools.lru_cache(maxsize=64)
def _starts(counts: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(itertools.accumulate(counts, initial=0))


@functools.lru_cache(maxsize=64)
def _runs_of_counts(counts: tuple[int, ...]) -> tuple[Run, ...]:
    """Runs of equal non-zero counts (rows advance by the count from rank to rank). Cached: the
    stacks of a block (and often of a model) share their counts."""
    runs: list[Run] = []
    lo = start = 0
    for k, group in itertools.groupby(counts):  # C-speed over the W counts
        hi = lo + len(list(group))
        if k:
            runs.append((lo, hi, start, k))
            start += (hi - lo) * k
        lo = hi
    return tuple(runs)
