"""Expert placement figures of a plan, and two baselines to read them against.

[Note: expert baselines]
The planner places every expert as a role of its own (see [Note: expert placement] in
``owner_plan.py``). Two placements a mixture-of-experts job would otherwise use, with the same
``E`` experts per stack, every stack alike:

* ``round_robin``: expert ``e`` of every stack on rank ``e mod W`` (``round_robin_counts``);
* ``chunked``: Megatron's expert-parallel homes, ``E / W`` contiguous experts per rank with
  ``torch.chunk`` semantics (``ceil(E / W)`` per rank while experts last; ``chunked_counts``).

Both give every stack the same per-rank counts, so the first ``E mod W`` ranks get one expert more
of *every* stack, and with ``E < W`` only the first ``E`` ranks hold experts at all. A baseline
keeps the plan's evenly sharded tensors and re-plans its dense roles (each matrix, each block's
owned tail) with the ``balanced`` policy around the baseline's experts, held fixed: the same
dense balance as the plan, so the numbers differ by the expert placement alone. All of it is pure
over the plan's :class:`ParamPlan` records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from .balance import _Role, balanced

if TYPE_CHECKING:
    from .owner_plan import ParamPlan

__all__ = ["BASELINES", "ExpertBaseline", "round_robin_counts", "chunked_counts", "expert_matrices_per_rank",
           "expert_baseline"]


def _check(api: str, num_experts: int, world_size: int) -> None:
    for name, v in (("num_experts", num_experts), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{api}: {name} must be an int >= 1, got {name}={v!r}")


def round_robin_counts(num_experts: int, world_size: int) -> tuple[int, ...]:
    """Experts per rank when expert ``e`` lives on rank ``e mod world_size``."""
    _check("round_robin_counts", num_experts, world_size)
    return tuple(len(range(r, num_experts, world_size)) for r in range(world_size))


def chunked_counts(num_experts: int, world_size: int) -> tuple[int, ...]:
    """Experts per rank under ``torch.chunk(num_experts, world_size)`` (Megatron's expert-parallel
    homes): ``ceil(E / W)`` contiguous experts per rank while they last (the ``even`` rows rule)."""
    _check("chunked_counts", num_experts, world_size)
    c = -(-num_experts // world_size)
    return tuple(min((r + 1) * c, num_experts) - min(r * c, num_experts) for r in range(world_size))


#: name -> per-stack counts of each baseline (see [Note: expert baselines])
BASELINES: dict[str, Callable[[int, int], tuple[int, ...]]] = {
    "round_robin": round_robin_counts,
    "chunked": chunked_counts,
}


def _imbalance(values: Iterable[float]) -> float:
    values = list(values)
    avg = sum(values) / len(values)
    return max(values) / avg if avg > 0 else 1.0


def expert_matrices_per_rank(params: Iterable["ParamPlan"], world_size: int,
                             counts: Callable[[int, int], tuple[int, ...]] | None = None) -> tuple[int, ...]:
    """Expert matrices (experts x ``splits``, every stack) each shard rank holds: under the plan's
    counts, or under ``counts(E, W)`` for every stack."""
    out = [0] * world_size
    for p in params:
        if p.placement != "experts":
            continue
        per_rank = p.experts if counts is None else counts(p.shape[0], world_size)
        for r in range(world_size):
            out[r] += per_rank[r] * p.splits
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class ExpertBaseline:
    """Per-rank figures of one placement: expert matrices, optimizer cost, parameter bytes."""

    name: str
    expert_matrices: tuple[int, ...]
    cost: tuple[float, ...]
    nbytes: tuple[float, ...]
    #: worst ``gamma_B / its lower bound`` over the wrapped blocks, as ``OwnerPlan.max_gamma_ratio``:
    #: what the placement costs the blocks' collectives (the plan keeps it at 1 where it can)
    max_gamma_ratio: float = 1.0

    @property
    def expert_imbalance(self) -> float:
        """max/avg of expert matrices per rank."""
        return _imbalance(self.expert_matrices)

    @property
    def cost_imbalance(self) -> float:
        """max/avg of optimizer cost per rank (dense and experts)."""
        return _imbalance(self.cost)

    @property
    def bytes_imbalance(self) -> float:
        """max/avg of parameter bytes per rank (dense and experts)."""
        return _imbalance(self.nbytes)


def expert_baseline(params: Iterable["ParamPlan"], world_size: int, name: str) -> ExpertBaseline:
    """The baseline ``name`` (in :data:`BASELINES`) for a plan's ``params`` on ``world_size``
    shard ranks: its experts fixed, the dense roles re-planned around them (see
    [Note: expert baselines])."""
    if name not in BASELINES:
        raise ValueError(f"expert_baseline: name must be one of {tuple(BASELINES)}, got name={name!r}")
    W = world_size
    counts = BASELINES[name]
    params = sorted(params, key=lambda p: p.fqn)  # the roles' order must not depend on the caller's
    base_b, base_c = [0.0] * W, [0.0] * W
    fixed_block: dict[str, list[float]] = {}  # per-block bytes the fixed placements put on each rank
    roles: list[_Role] = []
    tails: dict[str, list["ParamPlan"]] = {}
    for p in params:
        if p.placement in ("experts", "even"):
            E = p.shape[0]
            shares = ([n / E for n in counts(E, W)] if p.placement == "experts"
                      else [p.share(r, W) for r in range(W)])
            use = fixed_block.setdefault(p.block, [0.0] * W)
            for r, s in enumerate(shares):
                base_b[r] += p.nbytes * s
                base_c[r] += p.cost * s
                use[r] += p.nbytes * s
        elif p.placement == "matrix":
            roles.append(_Role(p.fqn, p.block, (), "matrix", p.nbytes, p.cost))
        else:
            tails.setdefault(p.block, []).append(p)
    # a block's owned element-wise tensors are one role, as the planner makes them
    roles += [_Role(f"{b}#tail", b, (), "tail", sum(p.nbytes for p in ps), sum(p.cost for p in ps))
              for b, ps in sorted(tails.items())]
    assign = balanced(roles, base_b, base_c, fixed_block, W)
    block_bytes = {b: list(use) for b, use in fixed_block.items()}
    for role in roles:
        base_b[assign[role.key]] += role.nbytes
        base_c[assign[role.key]] += role.cost
        block_bytes.setdefault(role.block, [0.0] * W)[assign[role.key]] += role.nbytes
    return ExpertBaseline(name=name, expert_matrices=expert_matrices_per_rank(params, W, counts),
                          cost=tuple(base_c), nbytes=tuple(base_b),
                          max_gamma_ratio=_max_gamma_ratio(params, roles, block_bytes, W))


def _max_gamma_ratio(params: list["ParamPlan"], roles: list[_Role], block_bytes: dict[str, list[float]],
                     W: int) -> float:
    """``OwnerPlan.max_gamma_ratio``'s figure for per-block bytes per rank ``block_bytes``: the
    largest role of a block is a dense role or one expert (the root scope is no block)."""
    largest: dict[str, float] = {}
    for r in roles:
        largest[r.block] = max(largest.get(r.block, 0.0), r.nbytes)
    for p in params:
        if p.placement == "experts":
            largest[p.block] = max(largest.get(p.block, 0.0), p.nbytes / p.shape[0])
    worst = 1.0
    for block, per_rank in block_bytes.items():
        total = sum(per_rank)
        if block == "" or total <= 0:
            continue
        gamma = max(per_rank) * W / total
        worst = max(worst, gamma / max(1.0, W * largest.get(block, 0.0) / total))
    return worst
