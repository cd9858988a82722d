"""Flat-buffer layout of the ZeRO-1/2 runtime: pure Python over the owner plan.

A :class:`BucketLayout` lists the parameters of one bucket in buffer order and, for every rank,
the contiguous interval of the flat buffer holding the parameters that rank owns (and updates).

[Note: atomic intervals]
Every parameter is owned whole by one rank (Canzona's atomicity: a matrix optimizer needs the
whole matrix). Inside a bucket the parameters are sorted by owner, then registration order (on
an HSDP mesh ``split`` parameters lead each interval, by step replica), so each rank's
parameters form one contiguous interval and the bucket's gradient is one reduce-scatter
with uneven splits, its parameters one all-gather. The partitions of ``alpha_balanced`` and
``naive_static`` are contiguous runs of the registration order already, so their buffer order
*is* the registration order; for the owner policies (``balanced``, ``scope_greedy``: the
layer-wise baseline) the sort makes any owner assignment one collective per bucket.

A bucket's gradient is reduced by the engine's ``Reducer`` over ``block``, whose wire format puts
one usage flag per owned parameter after each rank's gradients (``counts``; see [Note: usage
flags] in ``engine/reducer.py``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..engine.layout import BlockLayout
from ..planner.partition import make_buckets
from ..planner.owner_plan import OwnerPlan, ParamPlan

__all__ = ["Slot", "BucketLayout", "build_layout"]


@dataclass(frozen=True)
class Slot:
    fqn: str
    owner: int
    shape: tuple[int, ...]
    offset: int  # element offset in the bucket's flat parameter buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: the engine's segment layout of its parameters, each owned whole (one piece).

    ``block`` is the :class:`~..engine.layout.BlockLayout` of the bucket's parameters in owner
    order (rank-major, registration order within a rank): its chunks are the ranks' intervals of
    the flat buffer, so a slot's offset is its piece's offset plus the chunks before it.
    """

    index: int
    dtype: str
    block: BlockLayout

    @functools.cached_property
    def slots(self) -> tuple[Slot, ...]:
        """The parameters in buffer order (zero-size ones too, which have no piece)."""
        out, offset = [], 0
        for p in self.block.params:
            out.append(Slot(p.fqn, int(p.owner), p.shape, offset))
            offset += p.numel
        return tuple(out)

    @property
    def param_splits(self) -> tuple[int, ...]:
        """Elements of each rank's interval, rank order (the block's chunk sizes)."""
        return self.block.chunk_numel

    @functools.cached_property
    def counts(self) -> tuple[int, ...]:
        """Parameters each rank owns in this bucket (its usage flags)."""
        W = self.block.world_size
        return tuple(sum(1 for p in self.block.params if p.owner == r) for r in range(W))

    @property
    def numel(self) -> int:
        return self.block.numel


def build_layout(plan: OwnerPlan, fqns: list[str], *, bucket_numel: int | None = None) -> tuple[BucketLayout, ...]:
    """Buckets over ``fqns`` (trainable parameters in registration order) for ``plan``.

    The bucket boundaries are the plan's (``alpha_balanced``/``naive_static`` record them in
    ``plan.meta``) restricted to ``fqns``; owner plans are cut every ``bucket_numel`` elements
    (Megatron's default ``max(40M, 1M * W)``). A bucket holds one dtype: a dtype change splits it.
    Buckets are returned in registration (forward) order; the runtime reduces them in reverse.
    """
    W = plan.world_size
    wanted = set(fqns)
    meta = dict(plan.meta)
    if "buckets" in meta:
        groups = [[f for f in names if f in wanted] for names, _cuts in meta["buckets"]]
    else:
        size = bucket_numel if bucket_numel is not None else max(40_000_000, 1_000_000 * W)
        numels = [plan[f].numel for f in fqns]
        groups = [fqns[a:b] for a, b in make_buckets(numels, size)]
    layouts: list[BucketLayout] = []
    for group in groups:
        runs: list[list[str]] = []
        for f in group:  # split on dtype changes (one flat buffer per bucket)
            if runs and plan[runs[-1][-1]].dtype == plan[f].dtype:
                runs[-1].append(f)
            else:
                runs.append([f])
        for run in runs:
            order = sorted(range(len(run)), key=lambda i: _wire_key(plan[run[i]], i))
            block = BlockLayout.from_plans([plan[run[i]] for i in order], W)
            layouts.append(BucketLayout(len(layouts), plan[run[0]].dtype, block))
    return tuple(layouts)


def _wire_key(p: ParamPlan, i: int) -> tuple[int, bool, int, int]:
    """Buffer order: by owner (one interval per rank), then on an HSDP mesh the ``split``
    parameters first, by step replica (the engine's [Note: replica phase]), then the rest; within
    each, registration order. A flat plan has no step replicas: ``(owner, i)`` order."""
    step = p.step_replica
    return (int(p.owner), step is None, step if step is not None else 0, i)  # type: ignore[arg-type]
