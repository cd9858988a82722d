"""Micro-groups: the planning half of tensor parallelism (Canzona Algorithm 2, LPT with greedy rollback).

Under tensor parallelism every matrix is split across the ``tp`` ranks of a TP group, and a
whole-matrix optimizer needs it whole. Each matrix gets one *host* rank of the TP group; the
matrices are stepped in a sequence of *micro-groups*, one fused all-to-all each way per group
(gradient shards to the hosts, update shards back). This module plans that sequence; it is pure
Python over ``(fqn, shape, cost, nbytes)`` (no process group, no tensors) and the runtime that
executes it is separate.

[Note: micro-group rule]
1. Sort the matrices by cost descending, ties by fqn ascending (deterministic, independent of the
   input order).
2. Walk them in that order, adding each to the current group ``M``. Within ``M`` hosts are assigned
   by min-heap LPT: the next matrix goes to the least-loaded host rank; ties go to the host least
   loaded over the earlier groups, then to the lowest rank (so groups of one matrix, e.g. under a
   small ``c_max``, rotate over the hosts instead of all landing on rank 0).
   Because the global order is already descending, this equals the paper's MinHeapSolver re-run
   on ``M + {p}`` (its local sort is the same order), so it is done incrementally.
3. A matrix ``p`` is accepted into ``M`` iff ``M + {p}`` satisfies both capacities:

   * **buffer**: ``sum(nbytes) <= c_max`` (the fused all-to-all buffer);
   * **balance**: ``makespan <= (1 + BALANCE_SLACK) * bound``, where ``makespan`` is the most
     loaded host's summed cost and ``bound = max(sum(cost) / tp, max(cost))`` is the group's
     lower bound (no assignment of its members can do better).

   Otherwise **greedy rollback**: ``M`` is finalized without ``p`` and ``p`` seeds the next group.
   A seed is always accepted (a single matrix is at its bound; one larger than ``c_max`` gets a
   group of its own). The last group is finalized at the end.

Why this capacity. The paper's constraint is ``max_r L_{k,r} <= C_max`` with one ``C_max`` standing
for "either the memory buffer limit for the fused all-to-all or the maximum acceptable makespan".
Canzona's cost is ``numel``, so a host's load is its receive buffer and one number serves both;
with a FLOP cost (ours) they are different units, so we keep the two apart: bytes against
``c_max``, and the makespan against the group's own bound. A relative balance rule needs no
absolute time budget (which would depend on the model and the hardware), and it keeps every
finalized group within ``1 + BALANCE_SLACK`` of the best any assignment of its members could do,
so the sum of the makespans is within that factor of the sum of the bounds. ``BALANCE_SLACK =
0.05`` (5%): LPT's worst case is 4/3 of the optimum, and a smaller slack mostly closes groups one
matrix earlier (more all-to-alls) for a gain below the noise of a real step.

A known consequence of the greedy rule: ``tp`` matrices of one cost fill a group exactly, and the
``tp + 1``-th would double the makespan, so runs of equal matrices form groups of exactly ``tp``
(when ``c_max`` allows); the group never grows through the transient imbalance to ``2 tp``.

[Note: default c_max]
``default_c_max(tp, largest) = max(DEFAULT_C_MAX_FLOOR, tp * largest)`` bytes:

* ``tp * largest`` lets a group hold ``tp`` of the largest matrices, one per host; below it the
  heaviest groups leave hosts idle. It is also what one rank must hold anyway: each rank sends
  ``1/tp`` of every member (``buffer / tp`` = one largest matrix) and a host receives the whole of
  the matrices it hosts, which it materializes for its step regardless;
* ``DEFAULT_C_MAX_FLOOR = 512 MiB`` is where Canzona's Fig. 14 (Qwen3, DP=16 x TP=8) sees the fused
  all-to-all's latency plateau; smaller buffers are bandwidth-starved, so a model of small
  matrices still fuses that much. (The review we work from does not say whether the paper's
  ``C_max`` counts one rank's buffer or the group's; we count the group's, the sum of the
  members' full ``nbytes``.)
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = [
    "MicroGroup",
    "plan_micro_groups",
    "default_c_max",
    "group_loads",
    "BALANCE_SLACK",
    "DEFAULT_C_MAX_FLOOR",
]

#: A group is closed when adding a matrix would put its makespan above (1 + this) x its bound.
BALANCE_SLACK = 0.05
#: Lower end of the default fused all-to-all buffer (bytes); see [Note: default c_max].
DEFAULT_C_MAX_FLOOR = 512 * 2**20
# float sums of equal costs can differ in the last bits depending on the order they were added
_REL_TOL = 1e-12


@dataclass(frozen=True)
class MicroGroup:
    """One fused all-to-all's worth of matrices and the TP rank that hosts each one's step.

    ``members`` are ``(fqn, host tp rank)`` in the group's execution order (cost descending, ties
    by fqn); ``makespan`` is the most loaded host's summed member cost; ``bound =
    max(sum cost / tp, largest member cost)`` is a lower bound of any assignment's makespan;
    ``buffer_bytes`` is the fused all-to-all buffer, the sum of the members' full ``nbytes``.
    """

    index: int
    members: tuple[tuple[str, int], ...]
    makespan: float
    bound: float
    buffer_bytes: int

    @property
    def ratio(self) -> float:
        """``makespan / bound`` (1.0: the group is at its lower bound; 1.0 for zero cost)."""
        return self.makespan / self.bound if self.bound > 0 else 1.0


def default_c_max(tp: int, largest_nbytes: int) -> int:
    """The default fused buffer: ``max(DEFAULT_C_MAX_FLOOR, tp * largest_nbytes)`` bytes
    (see [Note: default c_max])."""
    return max(DEFAULT_C_MAX_FLOOR, tp * largest_nbytes)


def _check_int(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"plan_micro_groups: {name} must be an int >= {lo}, got {name}={value!r}")


def plan_micro_groups(matrices: Sequence[tuple[str, tuple[int, ...], float, int]],
                      tp: int, *, c_max: int | None = None,
                      hosts: Mapping[str, int] | None = None) -> tuple[MicroGroup, ...]:
    """Pack TP-split matrices into micro-groups and give each a host TP rank (see
    [Note: micro-group rule]).

    Args:
        matrices: ``(fqn, full shape, cost, nbytes)`` per matrix; fqns unique, cost and nbytes
            finite and ``>= 0``. The order does not matter.
        tp: the tensor-parallel degree (host ranks ``0 .. tp-1``), ``>= 1``.
        c_max: the most bytes of one group's fused buffer (sum of member ``nbytes``), ``>= 1``;
            default :func:`default_c_max` of ``tp`` and the largest matrix.
        hosts: ``{fqn: host rank}`` fixing every matrix's host (a planner that chose the hosts
            itself, as the data-parallel hosting of [Note: hosted matrices] in ``hosting.py``
            does): only the packing is planned, by the same rule, the makespan counting the
            given hosts.

    Returns:
        The groups in execution order, ``index`` 0, 1, ...; every matrix in exactly one group.

    Example::

        plan_micro_groups([("a", (4, 4), 16.0, 64), ("b", (4, 2), 8.0, 32),
                           ("c", (2, 4), 8.0, 32)], tp=2)
        # -> (MicroGroup(index=0, members=(("a", 0), ("b", 1), ("c", 1)), makespan=16.0,
        #                bound=16.0, buffer_bytes=128),)
    """
    _check_int("tp", tp, 1)
    if c_max is not None:
        _check_int("c_max", c_max, 1)
    items: list[tuple[str, float, int]] = []
    seen: set[str] = set()
    for m in matrices:
        try:
            fqn, shape, cost, nbytes = m
        except (TypeError, ValueError):
            raise ValueError(
                f"plan_micro_groups: each matrix must be (fqn, shape, cost, nbytes), got {m!r}"
            ) from None
        if not isinstance(fqn, str):
            raise ValueError(f"plan_micro_groups: fqn must be a str, got {fqn!r}")
        if fqn in seen:
            raise ValueError(f"plan_micro_groups: fqns must be unique, got {fqn!r} twice")
        seen.add(fqn)
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost) or cost < 0:
            raise ValueError(f"plan_micro_groups: cost must be a finite number >= 0, got {fqn!r} cost={cost!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"plan_micro_groups: nbytes must be an int >= 0, got {fqn!r} nbytes={nbytes!r}")
        items.append((fqn, float(cost), nbytes))
    if hosts is not None:
        for fqn, _, _ in items:
            h = hosts.get(fqn) if isinstance(hosts, Mapping) else None
            if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < tp:
                raise ValueError(f"plan_micro_groups: hosts must give every matrix a host rank in [0, {tp}), "
                                 f"got {fqn!r} -> {h!r}")
    if not items:
        return ()
    items.sort(key=lambda it: (-it[1], it[0]))
    if c_max is None:
        c_max = default_c_max(tp, max(it[2] for it in items))

    groups: list[MicroGroup] = []
    members: list[tuple[str, int]] = []
    heap: list[tuple[float, float, int]] = []
    carried = [0.0] * tp  # each host's cost over the finalized groups (tie-breaks, see the Note)
    total = largest = makespan = 0.0
    buffer = 0

    def finalize() -> None:
        groups.append(MicroGroup(index=len(groups), members=tuple(members), makespan=makespan,
                                 bound=max(total / tp, largest), buffer_bytes=buffer))

    for fqn, cost, nbytes in items:
        if members:
            load = fixed[hosts[fqn]] if hosts is not None else heap[0][0]
            t_total, t_largest = total + cost, max(largest, cost)
            t_makespan = max(makespan, load + cost)
            t_bound = max(t_total / tp, t_largest)
            fits = buffer + nbytes <= c_max
            balanced = t_makespan <= (1 + BALANCE_SLACK) * t_bound * (1 + _REL_TOL)
            if not (fits and balanced):  # greedy rollback: close the group, p seeds the next
                finalize()
                members = []
        if not members:
            heap = [(0.0, carried[r], r) for r in range(tp)]
            heapq.heapify(heap)
            fixed = [0.0] * tp
            total = largest = makespan = 0.0
            buffer = 0
        if hosts is not None:  # the host is given: its load in this group decides the makespan
            host = hosts[fqn]
            load = fixed[host]
            fixed[host] += cost
        else:
            load, _, host = heapq.heappop(heap)  # least loaded; ties: least carried, then lowest rank
            heapq.heappush(heap, (load + cost, carried[host] + cost, host))
        carried[host] += cost
        members.append((fqn, host))
        total += cost
        largest = max(largest, cost)
        makespan = max(makespan, load + cost)
        buffer += nbytes
    finalize()
    return tuple(groups)


def group_loads(group: MicroGroup, costs: dict[str, float], tp: int) -> list[float]:
    """Summed member cost per host rank of ``group`` (``costs``: fqn -> cost)."""
    loads = [0.0] * tp
    for fqn, host in group.members:
        loads[host] += costs[fqn]
    return loads
