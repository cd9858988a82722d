"""The owner plan: a frozen, serializable record of where every parameter lives.

The planner (``owners.py``: :func:`plan_owners`) produces an :class:`OwnerPlan`; the runtime only executes it.
Nothing here touches a process group, a device or a real tensor.

[Note: row segments]
Every placement is a partition of a parameter's dim 0 into ``world_size`` contiguous row ranges,
one per rank, in rank order:

* ``"matrix"`` / ``"tail"`` (owned): the owner holds rows ``[0, n)``, every other rank ``[0, 0)``
  (an empty ``[0, *shape[1:]]`` tensor);
* ``"even"``: ``torch.chunk`` semantics, as stock FSDP2 ``Shard(0)``: chunk ``c = ceil(n / W)``,
  rank ``r`` holds ``[min(r*c, n), min((r+1)*c, n))``;
* ``"experts"`` (an expert stack ``[E, out, in]``, see [Note: expert placement]): rank ``r`` holds
  ``experts[r]`` whole experts, the ranks' ranges following each other in rank order.

0-dim parameters cannot be split and are always owned. Because both cases are "row ranges in rank
order", materialization and reduction are one piece of segment math for both (see ``local_rows``).

[Note: replicas and step replicas]
On an HSDP mesh of ``replicas`` x ``world_size`` ranks, owners are planned within the shard
dimension (``world_size`` ranks, an owner group, typically one node) and every replica group has
the same layout: shard rank ``s`` of *each* replica holds what the plan gives ``s``. An owned
parameter's gradient is combined across its ``replicas`` owners in one of two ways:

* ``step_replica is None`` (``repeat``): all-reduced; every replica's owner steps it (the matrix
  work is ``replicas``-fold redundant, the step makes no collective);
* ``step_replica = q`` (``split``): reduce-scattered across the owners in whole-tensor intervals,
  so replica ``q``'s owner alone receives the full sum, steps it and keeps its optimizer state;
  the new value is all-gathered back to the other owners at the next forward.

Evenly sharded parameters are reduce-scattered within the group and all-reduced across replicas,
as in torch's HSDP. A flat plan has ``replicas == 1`` and no step replica; its digest is the one
it had before replicas existed.

[Note: expert placement]
An expert stack is ``E`` expert slices along dim 0, each ``splits`` matrices along its rows (see
[Note: one routing rule] in ``rules.py``). The planner balances every expert as a role of its own
with the dense matrices; since the experts of one stack are alike, only how many each rank gets
matters, so the plan records the counts (``experts[r]`` for shard rank ``r``, summing to ``E``)
and rank ``r`` holds the contiguous experts ``[sum(experts[:r]), sum(experts[:r+1]))``. No expert
is ever split, and a rank may hold none (``E < W``). On an HSDP mesh every replica holds the same
experts, all-reduced across replicas and stepped by each (as evenly sharded tensors).

[Note: tensor-parallel micro-groups]
With ``tp > 1`` every weight is also split across a TP group of ``tp`` ranks, and each data-parallel
owner's TP group steps the matrices that owner owns. ``micro_groups[s]`` is owner ``s``'s plan
(:func:`matrixfsdp.planner.micro_groups.plan_micro_groups` over its ``"matrix"`` parameters, whole
costs and bytes): the sequence of fused all-to-alls and the TP rank hosting each matrix's step.
Owners run their sequences in parallel (different TP groups), so the TP step takes about
``max_s sum(makespan)``. This is the planning half of TP; the executor is separate. A plan with
``tp == 1`` has no micro-groups and hashes as before they existed.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .balance import three_term_bound as _three_term_bound
from .micro_groups import MicroGroup

__all__ = [
    "PLACEMENTS",
    "ParamPlan",
    "BlockStats",
    "RankStats",
    "OwnerPlan",
    "even_rows",
    "held_bytes",
    "rank_loads",
    "rank_held_bytes",
    "fsdp2_held_bytes",
    "spread_rows",
    "REPLICA_STEPS",
]

#: The placements a parameter can have (``"hosted"``: see [Note: hosted matrices]).
PLACEMENTS = ("matrix", "tail", "even", "experts", "hosted")
#: How owned parameters combine across replicas (see [Note: replicas and step replicas]).
REPLICA_STEPS = ("auto", "repeat", "split")

_FORMAT_VERSION = 1


def even_rows(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Row range ``[start, end)`` of ``rank`` under ``torch.chunk(n, world_size)`` semantics."""
    chunk = -(-n // world_size) if n else 0
    return min(rank * chunk, n), min((rank + 1) * chunk, n)


@dataclass(frozen=True, kw_only=True)
class ParamPlan:
    """Where one parameter lives and what it costs.

    ``owner`` is the owning rank for ``"matrix"``/``"tail"`` placements and ``None`` for
    ``"even"``. ``block`` is the fqn of the wrapped block the parameter belongs to, ``""`` for the
    root scope. ``nbytes`` is the parameter's storage, ``state_nbytes`` the optimizer state the
    plan's optimizer keeps for it, ``cost`` its optimizer cost in the plan's cost model.
    ``step_replica`` is the one replica whose owner steps it under ``split`` (``None``: every
    replica's owner steps it; see [Note: replicas and step replicas]).
    """

    fqn: str
    placement: str
    owner: int | None
    block: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    state_nbytes: int
    cost: float
    step_replica: int | None = None
    #: ``"experts"`` placement: whole experts per shard rank (see [Note: expert placement])
    experts: tuple[int, ...] = ()
    #: matrices along the rows: per expert slice (``"experts"`` placement), or the head matrices of
    #: a per-head projection (``"matrix"``/``"hosted"``: ``MatrixRule(heads=...)``, stepped as
    #: ``splits`` independent matrices by its owner or host)
    splits: int = 1
    #: ``"hosted"`` placement: the shard rank that steps it whole (see [Note: hosted matrices])
    host: int | None = None
    #: ``"hosted"`` placement: its optimizer state is element-wise and stays on the row shards
    #: (Muon's momentum); ``False``: whole on the host (Shampoo, SOAP)
    state_on_shards: bool = False

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"ParamPlan {self.fqn!r}: placement must be one of {PLACEMENTS}, got {self.placement=!r}"
            )
        owned = self.placement not in ("even", "experts", "hosted")
        if owned != (self.owner is not None):
            raise ValueError(
                f"ParamPlan {self.fqn!r}: {self.placement!r} placement "
                f"{'needs an owner rank' if owned else 'takes no owner'}, got {self.owner=!r}"
            )
        if self.step_replica is not None and (self.owner is None or isinstance(self.step_replica, bool)
                                              or not isinstance(self.step_replica, int) or self.step_replica < 0):
            raise ValueError(
                f"ParamPlan {self.fqn!r}: step_replica must be None or a replica index >= 0 of an "
                f"owned parameter, got {self.step_replica=!r} with {self.placement!r} placement"
            )
        if (self.placement == "hosted") != (self.host is not None) or (
                self.host is not None and (isinstance(self.host, bool) or not isinstance(self.host, int) or self.host < 0)):
            raise ValueError(f"ParamPlan {self.fqn!r}: 'hosted' placement needs a host shard rank >= 0 and "
                             f"no other placement takes one, got {self.host=!r} with {self.placement!r}")
        if self.state_on_shards is not False and (self.state_on_shards is not True or self.placement != "hosted"):
            raise ValueError(f"ParamPlan {self.fqn!r}: state_on_shards is a bool of the 'hosted' placement, "
                             f"got {self.state_on_shards=!r} with {self.placement!r}")
        if self.placement == "hosted" and len(self.shape) != 2:
            raise ValueError(f"ParamPlan {self.fqn!r}: 'hosted' placement needs a 2D parameter, got {self.shape=}")
        if self.placement == "even" and len(self.shape) == 0:
            raise ValueError(f"ParamPlan {self.fqn!r}: a 0-dim parameter cannot be evenly sharded")
        if self.placement == "matrix" and len(self.shape) != 2:
            raise ValueError(
                f"ParamPlan {self.fqn!r}: 'matrix' placement needs a 2D parameter, got {self.shape=}"
            )
        self._check_experts()

    def _check_experts(self) -> None:
        object.__setattr__(self, "experts", tuple(self.experts))
        if self.placement != "experts":
            heads = self.placement in ("matrix", "hosted") and not isinstance(self.splits, bool) and \
                isinstance(self.splits, int) and self.splits >= 1 and self.shape[0] % self.splits == 0
            if self.experts or (self.splits != 1 and not heads):
                raise ValueError(f"ParamPlan {self.fqn!r}: experts belong to the 'experts' placement, and splits "
                                 "to it or to a per-head matrix ('matrix'/'hosted', splits dividing its rows "
                                 f"{self.shape[0] if self.shape else 0}), got {self.experts=} {self.splits=} with "
                                 f"{self.placement!r}")
            return
        if len(self.shape) != 3:
            raise ValueError(f"ParamPlan {self.fqn!r}: 'experts' placement needs a 3-D expert stack, "
                             f"got {self.shape=}")
        if (isinstance(self.splits, bool) or not isinstance(self.splits, int) or self.splits < 1
                or self.shape[1] % self.splits):
            raise ValueError(f"ParamPlan {self.fqn!r}: splits must be an int >= 1 dividing the expert "
                             f"rows {self.shape[1]}, got {self.splits=!r}")
        if (not self.experts or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.experts)
                or sum(self.experts) != self.shape[0]):
            raise ValueError(f"ParamPlan {self.fqn!r}: experts must give each shard rank a count >= 0 of "
                             f"whole experts, summing to E={self.shape[0]}, got {self.experts=!r}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_rows(self, rank: int, world_size: int) -> tuple[int, int]:
        """Row range ``[start, end)`` along dim 0 that ``rank`` stores (see [Note: row segments])."""
        n = self.shape[0] if self.shape else 1
        if self.placement in ("even", "hosted"):
            return even_rows(n, world_size, rank)
        if self.placement == "experts":
            start = sum(self.experts[:rank])
            return start, start + self.experts[rank]
        return (0, n) if rank == self.owner else (0, 0)

    def local_shape(self, rank: int, world_size: int) -> tuple[int, ...]:
        """Shape of the local tensor ``rank`` stores."""
        if not self.shape:
            return () if rank == self.owner else (0,)
        start, end = self.local_rows(rank, world_size)
        return (end - start, *self.shape[1:])

    def share(self, rank: int, world_size: int) -> float:
        """Fraction of this parameter that ``rank`` stores (and updates)."""
        if self.placement == "experts":
            return self.experts[rank] / self.shape[0]
        if self.placement not in ("even", "hosted"):
            return 1.0 if rank == self.owner else 0.0
        start, end = self.local_rows(rank, world_size)
        return (end - start) / self.shape[0] if self.shape[0] else 0.0


def held_bytes(p: ParamPlan) -> int:
    """Parameter + gradient + optimizer-state bytes of ``p`` (its gradient is as large as it)."""
    return 2 * p.nbytes + p.state_nbytes


def rank_loads(params: Sequence[ParamPlan], W: int) -> tuple[list[float], list[float], list[float], list[int], list[int]]:
    """``(parameter bytes, state bytes, cost, owned count, hosted count)`` per shard rank: owned
    parameters on their owner; hosted ones' storage by row share, their cost on the host and their
    state on the host or, ``state_on_shards``, by row share (see [Note: hosted matrices] in
    ``hosting.py``); everything else by its row share. The one per-rank accounting of a plan
    (``OwnerPlan.rank_stats``, the hosting loop)."""
    nbytes, state, cost = [0.0] * W, [0.0] * W, [0.0] * W
    owned, hosted = [0] * W, [0] * W
    for p in params:
        if p.owner is not None:
            nbytes[p.owner] += p.nbytes
            state[p.owner] += p.state_nbytes
            cost[p.owner] += p.cost
            owned[p.owner] += 1
            continue
        if p.host is not None:  # stored evenly, stepped whole on its host
            if not p.state_on_shards:
                state[p.host] += p.state_nbytes
            cost[p.host] += p.cost
            hosted[p.host] += 1
        for lo, hi, sh in _share_runs(p, W):
            # the same products added in the same order as rank by rank with p.share (bitwise)
            b, st, c = p.nbytes * sh, p.state_nbytes * sh, p.cost * sh
            for r in range(lo, hi):
                nbytes[r] += b
                if p.host is None or p.state_on_shards:
                    state[r] += st
                if p.host is None:
                    cost[r] += c
    return nbytes, state, cost, owned, hosted


def _share_runs(p: ParamPlan, W: int) -> list[tuple[int, int, float]]:
    """``(lo, hi, share)``: ranks ``[lo, hi)`` each hold ``share`` of a parameter that is not
    owned (``p.share(r, W)``, the same float, without a call per rank; ranks left out hold none)."""
    n = p.shape[0]
    if p.placement == "experts":
        return [(r, r + 1, k / n) for r, k in enumerate(p.experts) if k]
    if not n:
        return []
    c = -(-n // W)  # torch.chunk: c rows on ranks [0, n // c), the rest on the next (even_rows)
    full, rest = divmod(n, c)
    return ([(0, full, c / n)] if full else []) + ([(full, full + 1, rest / n)] if rest else [])


def rank_held_bytes(params: Sequence[ParamPlan], W: int) -> list[float]:
    """Parameter + gradient + state bytes per shard rank (a gradient is as large as its
    parameter; see :func:`rank_loads`)."""
    nbytes, state, _, _, _ = rank_loads(params, W)
    return [2 * n + st for n, st in zip(nbytes, state)]


def fsdp2_held_bytes(params: Sequence[ParamPlan], W: int) -> list[float]:
    """Parameter + gradient + state bytes per shard rank had FSDP2 sharded every tensor
    (``Shard(0)``, ``torch.chunk`` rows; a 0-dim tensor on rank 0), the same state sharded like
    its parameter: the reference ``memory_budget`` is measured against. Its peak is ``total / W``
    while every tensor has at least ``W`` rows; past that the low ranks hold a row of every
    narrow tensor (Qwen3-0.6B at W=4096: 2.14x ``total / W``)."""
    # full chunks of c rows on ranks [0, n // c), the rest on the next: a difference array over
    # ranks, O(1) per tensor (plans of 4096 ranks and a thousand tensors stay fast)
    diff, tail = [0.0] * (W + 1), [0.0] * W
    for p in params:
        held = held_bytes(p)
        n = p.shape[0] if p.shape else 0
        if not n:
            tail[0] += held if not p.shape else 0.0
            continue
        c = -(-n // W)
        full, rest = divmod(n, c)
        diff[0] += held * c / n
        diff[full] -= held * c / n
        if rest:
            tail[full] += held * rest / n
    load, acc = [], 0.0
    for r in range(W):
        acc += diff[r]
        load.append(acc + tail[r])
    return load


def spread_rows(load: list[float], n: int, nbytes: float, W: int) -> None:
    """Add ``nbytes`` over ``torch.chunk(n, W)`` rows (only ranks with rows are touched)."""
    if not n:
        return
    c = -(-n // W)  # torch.chunk (even_rows): c rows on ranks [0, n // c), the rest on the next
    full, rest = divmod(n, c)
    x = nbytes * c / n
    for r in range(full):
        load[r] += x
    if rest:
        load[full] += nbytes * rest / n


@dataclass(frozen=True, kw_only=True)
class BlockStats:
    """Byte balance of one wrapped block (a unit of materialization).

    ``gamma = max_rank_nbytes / (nbytes / W)``; ``gamma_lower_bound = max(1, W * largest_role /
    nbytes)``: no owner assignment can do better, since the largest role lands whole on one rank.
    The owner fan-out of materializing the block is ``gamma * (W-1)/W * nbytes`` bytes sent by
    the busiest rank, against ``(W-1)/W * nbytes`` for a ring all-gather.
    """

    fqn: str
    nbytes: int
    largest_role_nbytes: int
    max_rank_nbytes: int
    gamma: float
    gamma_lower_bound: float


@dataclass(frozen=True, kw_only=True)
class RankStats:
    """What one rank stores and computes under the plan (even shares included)."""

    rank: int
    nbytes: float
    state_nbytes: float
    cost: float
    num_owned: int
    #: matrices this rank steps whole as their host (see [Note: hosted matrices] in ``hosting.py``)
    num_hosted: int = 0


def _imbalance(values: list[float]) -> float:
    avg = sum(values) / len(values)
    return max(values) / avg if avg > 0 else 1.0


def _l2_bins(asc: list[float], prefix: list[float], cap: float) -> int:
    """Martello-Toth L2 lower bound on the bins of capacity ``cap`` that items ``asc`` need."""
    n = len(asc)
    half = bisect.bisect_right(asc, cap / 2)  # asc[:half] <= cap/2 < asc[half:]
    best = 0
    # K ranges over 0 and the distinct item sizes <= cap/2; J3 = [K, cap/2], J2 = (cap/2, cap-K],
    # J1 = (cap-K, inf).
    ks = [0.0] + sorted(set(asc[:half]))
    for k in ks:
        j1_start = bisect.bisect_right(asc, cap - k)
        j3_start = bisect.bisect_left(asc, k)
        n1 = n - j1_start
        n2 = j1_start - half
        s2 = prefix[j1_start] - prefix[half]
        s3 = prefix[half] - prefix[j3_start]
        extra = (s3 - (n2 * cap - s2)) / cap
        bins = n1 + n2 + max(0, math.ceil(extra - 1e-9))
        best = max(best, bins)
    return best


def _best_bin_load(sizes: list[tuple[float, int]], cap: float, limit: int = 50_000) -> float | None:
    """Largest load <= ``cap`` one rank can hold (subset sum over sizes with multiplicities), or
    ``None`` when the set of sums grows past ``limit`` (then no conclusion is drawn)."""
    sums = {0.0}
    for size, count in sizes:
        if size <= 0:
            continue
        new = set(sums)
        for x in sums:
            y = x
            for _ in range(count):
                y += size
                if y > cap:
                    break
                new.add(y)
            # the set only grows, so stopping here concludes as the check below would; without it
            # thousands of alike expert roles make this loop run for seconds before giving up
            if len(new) > limit:
                return None
        sums = new
        if len(sums) > limit:
            return None
    return max(sums)


def _tight_lower_bound(role_loads: list[float], base: list[float] | float, world_size: int) -> float:
    """Lower bound on the most loaded rank's load.

    Owned roles are atomic; ``base[r]`` is the fixed load of rank ``r`` from even shards (a float
    means that much per rank). The bound is ``max(roles bound + min(base), max(base), total / W)``.
    Starts from the three-term bound and raises it by bisection to the smallest makespan ``T``
    that neither of two bin-packing arguments proves infeasible on W ranks:

    * Martello-Toth L2: a lower bound on the number of bins of capacity ``T`` the roles need;
    * capacity: ``W`` times the fullest load one rank can reach under ``T`` (a subset sum) must
      cover the total. This is what makes few-distinct-size instances (transformer blocks) tight.

    Every value returned is the three-term bound or was proven unreachable, so it stays valid.
    """
    roles = sorted(role_loads, reverse=True)
    lo = _three_term_bound(roles, world_size)
    if len(roles) > world_size and lo > 0:
        asc = roles[::-1]
        prefix = [0.0]
        for x in asc:
            prefix.append(prefix[-1] + x)
        total = prefix[-1]
        counts: dict[float, int] = {}
        for x in roles:
            counts[x] = counts.get(x, 0) + 1
        sizes = sorted(counts.items(), reverse=True)

        def infeasible(t: float) -> bool:
            if _l2_bins(asc, prefix, t) > world_size:
                return True
            best = _best_bin_load(sizes, t)
            return best is not None and best * world_size < total * (1 - 1e-12)

        if infeasible(lo):
            hi = 2 * lo
            while infeasible(hi):
                lo, hi = hi, 2 * hi
            for _ in range(30):
                mid = (lo + hi) / 2
                if infeasible(mid):
                    lo = mid
                else:
                    hi = mid
    if not isinstance(base, list):
        base = [float(base)] * world_size
    return max(lo + min(base), max(base), (sum(roles) + sum(base)) / world_size)


@dataclass(frozen=True, kw_only=True)
class OwnerPlan:
    """Where every parameter of a model lives across ``world_size`` data-parallel ranks.

    Produced by :func:`matrixfsdp.plan_owners`; identical on every rank for the same inputs.
    ``digest`` is the SHA-256 hex of the canonical JSON form: two plans are equal iff their
    digests are. Save with :meth:`to_json`, load with :meth:`from_json`.

    Example::

        plan = matrixfsdp.plan_owners(model, 4, block_types=(Block,))
        plan.owner_of("blocks.0.attn.q_proj.weight")  # -> 2
        plan.owner_of("tok_emb.weight")  # -> None (evenly sharded)
        print(plan.report())
    """

    world_size: int
    policy: str
    cost_model: str
    optimizer: str
    blocks: tuple[str, ...]
    params: tuple[ParamPlan, ...]
    #: Extra policy output, e.g. the bucket cut points of ``alpha_balanced``; JSON-able values.
    meta: tuple[tuple[str, Any], ...] = ()
    #: copies of the ``world_size`` owner group (HSDP's replicate dimension; see [Note: replicas
    #: and step replicas]); the mesh is ``replicas x world_size`` ranks
    replicas: int = 1
    #: tensor-parallel degree of every owner's TP group (see [Note: tensor-parallel micro-groups])
    tp: int = 1
    #: per data-parallel owner ``s`` (``world_size`` entries when ``tp > 1``, else empty): its
    #: matrices' micro-groups in execution order
    micro_groups: tuple[tuple[MicroGroup, ...], ...] = ()
    #: the ``"hosted"`` matrices' micro-groups over the shard ranks, in execution order (hosts are
    #: shard ranks; see [Note: hosted matrices] in ``planner/hosting.py``); empty when none is hosted
    host_groups: tuple[MicroGroup, ...] = ()
    digest: str = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"OwnerPlan: world_size must be an int >= 1, got {self.world_size=!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"OwnerPlan: replicas must be an int >= 1, got {self.replicas=!r}")
        seen: set[str] = set()
        for p in self.params:
            if p.fqn in seen:
                raise ValueError(f"OwnerPlan: parameter {p.fqn!r} appears twice")
            seen.add(p.fqn)
            if p.owner is not None and not 0 <= p.owner < self.world_size:
                raise ValueError(
                    f"OwnerPlan: {p.fqn!r} owner must be in [0, {self.world_size}), got {p.owner=}"
                )
            if p.block not in self.blocks and p.block != "":
                raise ValueError(f"OwnerPlan: {p.fqn!r} names unknown block {p.block!r}")
            if p.step_replica is not None and not p.step_replica < self.replicas:
                raise ValueError(
                    f"OwnerPlan: {p.fqn!r} step_replica must be in [0, {self.replicas}), got "
                    f"{p.step_replica=}"
                )
            if p.host is not None and not p.host < self.world_size:
                raise ValueError(f"OwnerPlan: {p.fqn!r} host must be in [0, {self.world_size}), got {p.host=}")
            if p.placement == "experts" and len(p.experts) != self.world_size:
                raise ValueError(f"OwnerPlan: expert stack {p.fqn!r} needs a count per shard rank "
                                 f"({self.world_size}), got {len(p.experts)}: {p.experts!r}")
        self._check_micro_groups()
        self._check_host_groups()
        payload = json.dumps(self._canonical(), sort_keys=True, separators=(",", ":"))
        object.__setattr__(self, "digest", hashlib.sha256(payload.encode()).hexdigest())

    def _check_micro_groups(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"OwnerPlan: tp must be an int >= 1, got {self.tp=!r}")
        if self.tp == 1:
            if self.micro_groups:
                raise ValueError("OwnerPlan: micro_groups need tp > 1, got tp=1 with "
                                 f"{len(self.micro_groups)} owner sequences")
            return
        if len(self.micro_groups) != self.world_size:
            raise ValueError(f"OwnerPlan: micro_groups must hold one sequence per owner rank "
                             f"({self.world_size}), got {len(self.micro_groups)}")
        for s, groups in enumerate(self.micro_groups):
            want = sorted(p.fqn for p in self.params if p.placement == "matrix" and p.owner == s)
            got = []
            for i, g in enumerate(groups):
                if not isinstance(g, MicroGroup) or g.index != i:
                    raise ValueError(f"OwnerPlan: owner {s}'s micro-group {i} must be a MicroGroup "
                                     f"with index {i}, got {g!r}")
                for fqn, host in g.members:
                    if isinstance(host, bool) or not isinstance(host, int) or not 0 <= host < self.tp:
                        raise ValueError(f"OwnerPlan: {fqn!r} host must be in [0, {self.tp}), got {host=!r}")
                    got.append(fqn)
            if sorted(got) != want:
                raise ValueError(f"OwnerPlan: owner {s}'s micro-groups must hold each of its "
                                 f"{len(want)} matrices once, got {len(got)} members")

    def _check_host_groups(self) -> None:
        want = {p.fqn: p.host for p in self.params if p.placement == "hosted"}
        got: dict[str, int] = {}
        for i, g in enumerate(self.host_groups):
            if not isinstance(g, MicroGroup) or g.index != i:
                raise ValueError(f"OwnerPlan: host group {i} must be a MicroGroup with index {i}, got {g!r}")
            for fqn, host in g.members:
                if fqn in got or want.get(fqn) != host:
                    raise ValueError(f"OwnerPlan: host groups must hold each hosted matrix once with its "
                                     f"plan's host, got {fqn!r} -> {host!r} (plan: {want.get(fqn)!r})")
                got[fqn] = host
        if len(got) != len(want):
            missing = sorted(set(want) - set(got))
            raise ValueError(f"OwnerPlan: hosted matrices {missing[:3]} are in no host group")

    # ----------------------------------------------------------------------------- lookups
    @functools.cached_property
    def _by_fqn(self) -> dict[str, ParamPlan]:
        return {p.fqn: p for p in self.params}

    def __contains__(self, fqn: str) -> bool:
        return fqn in self._by_fqn

    def __getitem__(self, fqn: str) -> ParamPlan:
        try:
            return self._by_fqn[fqn]
        except KeyError:
            raise KeyError(f"OwnerPlan: no parameter {fqn!r} in the plan") from None

    def owner_of(self, fqn: str) -> int | None:
        """Owner rank of parameter ``fqn``, or ``None`` if it is evenly sharded."""
        return self[fqn].owner

    def params_of_block(self, block: str) -> tuple[ParamPlan, ...]:
        """The parameters planned in ``block`` (``""``: root scope), in plan order."""
        return tuple(p for p in self.params if p.block == block)

    def owned_by(self, rank: int) -> tuple[ParamPlan, ...]:
        """The parameters ``rank`` owns whole."""
        return tuple(p for p in self.params if p.owner == rank)

    @property
    def replica_step(self) -> str:
        """``"repeat"``, ``"split"`` or ``"mixed"``: how owned parameters combine across replicas
        (``"repeat"`` for a flat plan; see [Note: replicas and step replicas])."""
        owned = [p for p in self.params if p.owner is not None]
        split = sum(p.step_replica is not None for p in owned)
        return "repeat" if split == 0 else "split" if split == len(owned) else "mixed"

    @functools.cached_property
    def replica_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``(cost, state bytes)`` per replica of the most loaded shard rank's owner set: what
        each replica's owner steps and keeps (``repeat`` parameters count on every replica)."""
        R, W = self.replicas, self.world_size
        cost = [[0.0] * R for _ in range(W)]
        state = [[0.0] * R for _ in range(W)]
        for p in self.params:
            if p.owner is None:
                continue
            targets = range(R) if p.step_replica is None else (p.step_replica,)
            for q in targets:
                cost[p.owner][q] += p.cost
                state[p.owner][q] += p.state_nbytes
        worst = max(range(W), key=lambda s: (max(cost[s]), -s))
        return tuple(cost[worst]), tuple(state[worst])

    # ----------------------------------------------------------------------------- statistics
    @functools.cached_property
    def rank_stats(self) -> tuple[RankStats, ...]:
        nbytes, state, cost, owned, hosted = rank_loads(self.params, self.world_size)
        return tuple(
            RankStats(rank=r, nbytes=nbytes[r], state_nbytes=state[r], cost=cost[r], num_owned=owned[r],
                      num_hosted=hosted[r])
            for r in range(self.world_size)
        )

    @functools.cached_property
    def block_stats(self) -> tuple[BlockStats, ...]:
        W = self.world_size
        out = []
        for block in self.blocks:
            ps = self.params_of_block(block)
            per_rank = [0.0] * W
            for p in ps:
                for r in range(W):
                    per_rank[r] += p.nbytes * p.share(r, W)
            total = sum(p.nbytes for p in ps)
            largest = max((n for n in _role_nbytes(ps).values()), default=0)
            mx = max(per_rank)
            out.append(
                BlockStats(
                    fqn=block,
                    nbytes=total,
                    largest_role_nbytes=largest,
                    max_rank_nbytes=int(round(mx)),
                    gamma=mx * W / total if total else 1.0,
                    gamma_lower_bound=max(1.0, W * largest / total) if total else 1.0,
                )
            )
        return tuple(out)

    def _bound(self, attr: str) -> float:
        roles = _role_loads(self.params, attr)
        W = self.world_size
        # hosted matrices: their storage is spread (base load), their cost and state atomic (roles),
        # unless that state stays on the shards
        even = [p for p in self.params if p.placement == "even" or (p.placement == "hosted" and (
            attr == "nbytes" or (attr == "state_nbytes" and p.state_on_shards)))]
        base = [sum(getattr(p, attr) * p.share(r, W) for p in even) for r in range(W)]
        return _tight_lower_bound(list(roles.values()), base, W)

    @property
    def bytes_imbalance(self) -> float:
        """max/avg of per-rank parameter bytes."""
        return _imbalance([s.nbytes for s in self.rank_stats])

    @property
    def state_imbalance(self) -> float:
        """max/avg of per-rank parameter + optimizer-state bytes."""
        return _imbalance([s.nbytes + s.state_nbytes for s in self.rank_stats])

    @property
    def memory_imbalance(self) -> float:
        """max/avg of per-rank parameter + gradient + optimizer-state bytes (over an even share;
        ``memory_budget`` bounds :attr:`memory_vs_fsdp2`, this over FSDP2's own imbalance)."""
        return _imbalance([2 * st.nbytes + st.state_nbytes for st in self.rank_stats])

    @functools.cached_property
    def fsdp2_memory_imbalance(self) -> float:
        """:attr:`memory_imbalance` of FSDP2 on the same shard mesh (:func:`fsdp2_held_bytes`):
        1.0 unless some tensor has fewer rows than there are shard ranks."""
        return _imbalance(fsdp2_held_bytes(self.params, self.world_size))

    @property
    def memory_vs_fsdp2(self) -> float:
        """The most loaded rank's parameter + gradient + state bytes over FSDP2's most loaded
        rank on the same shard mesh: what ``memory_budget`` bounds (see [Note: hosted matrices])."""
        return self.memory_imbalance / self.fsdp2_memory_imbalance

    @property
    def num_hosted(self) -> int:
        """Matrices stored evenly and stepped whole on a host (``"hosted"`` placement)."""
        return sum(p.placement == "hosted" for p in self.params)

    @property
    def cost_imbalance(self) -> float:
        """max/avg of per-rank optimizer cost."""
        return _imbalance([s.cost for s in self.rank_stats])

    @property
    def bytes_imbalance_bound(self) -> float:
        """Tight lower bound of :attr:`bytes_imbalance` for the same roles (owned roles are atomic)."""
        total = sum(p.nbytes for p in self.params)
        return self._bound("nbytes") / (total / self.world_size) if total else 1.0

    @property
    def cost_imbalance_bound(self) -> float:
        """Tight lower bound of :attr:`cost_imbalance` for the same roles."""
        total = sum(p.cost for p in self.params)
        return self._bound("cost") / (total / self.world_size) if total else 1.0

    @property
    def max_gamma_ratio(self) -> float:
        """Worst ``gamma / gamma_lower_bound`` over blocks (1.0 = every block at its bound)."""
        return max((b.gamma / b.gamma_lower_bound for b in self.block_stats), default=1.0)

    # ----------------------------------------------------------------------------- experts
    @property
    def has_experts(self) -> bool:
        """Whether the plan holds expert stacks (``"experts"`` placement)."""
        return any(p.placement == "experts" for p in self.params)

    @functools.cached_property
    def expert_matrices(self) -> tuple[int, ...]:
        """Expert matrices (experts x ``splits``, every stack) each shard rank holds."""
        from .expert_baselines import expert_matrices_per_rank

        return expert_matrices_per_rank(self.params, self.world_size)

    @property
    def expert_imbalance(self) -> float:
        """max/avg of :attr:`expert_matrices` (1.0 without experts)."""
        return _imbalance([float(n) for n in self.expert_matrices]) if self.has_experts else 1.0

    @functools.cached_property
    def expert_baselines(self) -> dict[str, Any]:
        """``{"round_robin": ExpertBaseline, "chunked": ExpertBaseline}``: this plan's dense
        weights re-planned around experts placed round-robin or in ``torch.chunk`` homes (see
        [Note: expert baselines] in ``expert_baselines.py``); empty without experts."""
        from .expert_baselines import BASELINES, expert_baseline

        if not self.has_experts:
            return {}
        return {name: expert_baseline(self.params, self.world_size, name) for name in BASELINES}

    @property
    def tp_stats(self) -> tuple[tuple[int, float, float], ...]:
        """Per owner rank ``(groups, sum of makespans, sum of bounds)`` of its micro-groups
        (empty when ``tp == 1``)."""
        return tuple((len(gs), sum(g.makespan for g in gs), sum(g.bound for g in gs))
                     for gs in self.micro_groups)

    def summary(self) -> dict[str, Any]:
        """The headline numbers as a flat dict (used by the CLI and the quality table)."""
        return {
            "world_size": self.world_size,
            "replicas": self.replicas,
            "replica_step": self.replica_step,
            "policy": self.policy,
            "cost_model": self.cost_model,
            "optimizer": self.optimizer,
            "num_params": len(self.params),
            "num_blocks": len(self.blocks),
            "cost_imbalance": self.cost_imbalance,
            "cost_imbalance_bound": self.cost_imbalance_bound,
            "bytes_imbalance": self.bytes_imbalance,
            "bytes_imbalance_bound": self.bytes_imbalance_bound,
            "state_imbalance": self.state_imbalance,
            "memory_imbalance": self.memory_imbalance,
            "fsdp2_memory_imbalance": self.fsdp2_memory_imbalance,
            "hosted": self.num_hosted,
            "max_gamma": max((b.gamma for b in self.block_stats), default=1.0),
            "max_gamma_ratio": self.max_gamma_ratio,
            "digest": self.digest,
            **(self._tp_summary() if self.tp > 1 else {}),
            **(self._expert_summary() if self.has_experts else {}),
        }

    def _expert_summary(self) -> dict[str, Any]:
        counts = self.expert_matrices
        out: dict[str, Any] = {
            "expert_stacks": sum(p.placement == "experts" for p in self.params),
            "expert_matrices": sum(counts),
            "expert_matrices_min": min(counts),
            "expert_matrices_max": max(counts),
            "expert_imbalance": self.expert_imbalance,
        }
        for name, b in self.expert_baselines.items():
            out[f"expert_imbalance_{name}"] = b.expert_imbalance
            out[f"cost_imbalance_{name}"] = b.cost_imbalance
            out[f"bytes_imbalance_{name}"] = b.bytes_imbalance
            out[f"max_gamma_ratio_{name}"] = b.max_gamma_ratio
        return out

    def _tp_summary(self) -> dict[str, Any]:
        stats = self.tp_stats
        worst = max(range(len(stats)), key=lambda s: (stats[s][1], -s))
        return {
            "tp": self.tp,
            "tp_groups": sum(n for n, _, _ in stats),
            "tp_makespan": stats[worst][1],
            "tp_bound": stats[worst][2],
            "tp_owner": worst,
        }

    # ----------------------------------------------------------------------------- serialization
    def _canonical(self) -> dict[str, Any]:
        return {
            "format": _FORMAT_VERSION,
            "world_size": self.world_size,
            "policy": self.policy,
            "cost_model": self.cost_model,
            "optimizer": self.optimizer,
            "blocks": list(self.blocks),
            "params": [
                {
                    "fqn": p.fqn,
                    "placement": p.placement,
                    "owner": p.owner,
                    "block": p.block,
                    "shape": list(p.shape),
                    "dtype": p.dtype,
                    "nbytes": p.nbytes,
                    "state_nbytes": p.state_nbytes,
                    "cost": p.cost,
                    # only where set: a flat plan keeps the digest it had before replicas existed
                    **({"step_replica": p.step_replica} if p.step_replica is not None else {}),
                    # only for expert stacks: a dense plan keeps the digest it had before experts
                    **({"experts": list(p.experts), "splits": p.splits} if p.placement == "experts" else {}),
                    # only for hosted matrices: a plan hosting none keeps the digest it had before
                    **({"host": p.host} if p.placement == "hosted" else {}),
                    # only for per-head matrices: a plan without them keeps the digest it had before
                    **({"splits": p.splits} if p.placement != "experts" and p.splits != 1 else {}),
                    **({"state_on_shards": True} if p.state_on_shards else {}),
                }
                for p in self.params
            ],
            "meta": [[k, v] for k, v in self.meta],
            **({"replicas": self.replicas} if self.replicas != 1 else {}),
            # only with TP: a tp=1 plan keeps the digest it had before micro-groups existed
            **({"tp": self.tp} if self.tp != 1 else {}),
            **({"micro_groups": [[_group_json(g) for g in gs] for gs in self.micro_groups]}
               if self.micro_groups else {}),
            **({"host_groups": [_group_json(g) for g in self.host_groups]} if self.host_groups else {}),
        }

    def to_json(self, **kwargs: Any) -> str:
        """The canonical JSON form (``digest`` is recomputed on load, not trusted)."""
        d = self._canonical()
        d["digest"] = self.digest
        return json.dumps(d, sort_keys=True, **kwargs)

    @classmethod
    def from_json(cls, text: str) -> "OwnerPlan":
        """Inverse of :meth:`to_json`; raises ``ValueError`` on a malformed or tampered plan."""
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.get("format") != _FORMAT_VERSION:
                got = d.get("format") if isinstance(d, dict) else type(d).__name__
                raise ValueError(
                    f"OwnerPlan.from_json: expected plan format {_FORMAT_VERSION}, got format={got!r}"
                )
            plan = cls(
                world_size=d["world_size"],
                policy=d["policy"],
                cost_model=d["cost_model"],
                optimizer=d["optimizer"],
                blocks=tuple(d["blocks"]),
                params=tuple(
                    ParamPlan(**{**p, "shape": tuple(p["shape"]), "experts": tuple(p.get("experts", ()))})
                    for p in d["params"]
                ),
                meta=tuple((k, _freeze(v)) for k, v in d.get("meta", [])),
                replicas=d.get("replicas", 1),
                tp=d.get("tp", 1),
                micro_groups=tuple(tuple(_group_from_json(g) for g in gs) for gs in d.get("micro_groups", [])),
                host_groups=tuple(_group_from_json(g) for g in d.get("host_groups", [])),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"OwnerPlan.from_json: malformed plan: {e!r}") from None
        if "digest" in d and d["digest"] != plan.digest:
            raise ValueError(
                f"OwnerPlan.from_json: digest mismatch, the file says {d['digest']!r} but its "
                f"content hashes to {plan.digest!r}"
            )
        return plan

    def report(self, *, per_rank: bool = True, per_block: bool = True) -> str:
        """A human-readable report: who owns what, imbalances next to their bounds, gamma_B, and
        a WARNING section when the plan is poor in absolute terms whatever its bounds (idle ranks,
        a rank above ``MEMORY_BUDGET`` times FSDP2's most loaded rank, a block's gamma_B above
        ``GAMMA_BUDGET``; see ``planner/report.py:plan_warnings``), naming HSDP as the remedy.

        Example::

            plan = matrixfsdp.plan_owners(model, mesh)
            print(plan.report(per_rank=False))   # the CLI: python -m matrixfsdp.plan --help
        """
        from .report import format_plan

        return format_plan(self, per_rank=per_rank, per_block=per_block)


def _group_json(g: MicroGroup) -> dict[str, Any]:
    return {"index": g.index, "members": [[f, h] for f, h in g.members], "makespan": g.makespan,
            "bound": g.bound, "buffer_bytes": g.buffer_bytes}


def _group_from_json(d: dict[str, Any]) -> MicroGroup:
    return MicroGroup(index=d["index"], members=tuple((f, h) for f, h in d["members"]),
                      makespan=d["makespan"], bound=d["bound"], buffer_bytes=d["buffer_bytes"])


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def _role_key(p: ParamPlan) -> tuple[str, int | None] | str:
    # A matrix is a role of its own; the owned tail of a block is one role; even shards are not
    # roles (they are divisible load); each expert of a stack is a role (see _role_loads).
    return p.fqn if p.placement == "matrix" else (p.block, p.owner)


def _role_loads(params: Iterable[ParamPlan], attr: str) -> dict[Any, float]:
    out: dict[Any, float] = {}
    for p in params:
        if p.placement == "experts":
            # every expert is atomic wherever it lands: a bound taking the plan's own expert
            # counts as fixed load would hold for those counts only, not for the best placement
            E = p.shape[0]
            for e in range(E):
                out[(p.fqn, e)] = getattr(p, attr) / E
            continue
        if p.placement == "hosted":  # its step (and whole state) atomic on the host; its bytes spread
            if attr == "cost" or (attr == "state_nbytes" and not p.state_on_shards):
                out[p.fqn] = getattr(p, attr)
            continue
        if p.owner is None:
            continue
        k = _role_key(p)
        out[k] = out.get(k, 0) + getattr(p, attr)
    return out


def _role_nbytes(params: Iterable[ParamPlan]) -> dict[Any, float]:
    return _role_loads(params, "nbytes")
