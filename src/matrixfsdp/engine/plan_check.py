"""Every rank runs the same plan: the digest exchange both front-ends make before using a plan.

[Note: digest exchange is keyed by plan object]
Whether a call exchanges digests must not depend on the plan's *content*: if it did (say, a
cache keyed by digest), a rank whose plan happens to equal one verified earlier would skip the
collective while a rank with a different plan would enter it, and gloo would hang instead of
raising. We key on the plan *object* (its identity, for as long as it lives), which every rank
creates at the same program point, so all ranks exchange at the same calls.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..comm.agree import agree
from ..mesh import MeshInfo
from ..planner.owner_plan import OwnerPlan

__all__ = ["verify_plan_digest", "plans_agree", "check_world_size"]

_VERIFIED: dict[tuple[int, tuple[int, ...]], Any] = {}


def check_world_size(plan: OwnerPlan, info: MeshInfo, *, api: str) -> None:
    """A plan is executed on the world size it was built for (local check, no collective)."""
    if plan.world_size != info.shard_size or plan.replicas != info.replicate_size:
        built = (f"world_size={plan.world_size}" if plan.replicas == 1 else
                 f"{plan.replicas} replicas x {plan.world_size} shard ranks")
        has = (f"{info.shard_size} ranks" if not info.is_hsdp else
               f"{info.replicate_size} replicas x {info.shard_size} shard ranks")
        raise ValueError(
            f"{api}: the plan was built for {built} but the mesh has {has}; rebuild it with "
            "matrixfsdp.plan_owners(model, mesh, ...) on this mesh"
        )


def plans_agree(plan: OwnerPlan, info: MeshInfo) -> list[str] | None:
    """All ranks of the data-parallel group exchange the plan digest once per plan object:
    ``None`` if they agree (or did before), else every rank's digest (on every rank alike). A
    collective."""
    key = (id(plan), tuple(info.mesh.mesh.flatten().tolist()))
    if key in _VERIFIED:
        return None
    # over every data-parallel rank at once (an HSDP mesh flattened): two exchanges, one per
    # dimension, would let a rank whose own groups agree pass while the others raise
    digests = agree(fingerprint=plan.digest, group=info.dp_group, device=info.device)
    if len(set(digests)) != 1:
        return digests
    _VERIFIED[key] = weakref.finalize(plan, _VERIFIED.pop, key, None)
    return None


def verify_plan_digest(plan: OwnerPlan, info: MeshInfo, *, api: str) -> None:
    """:func:`plans_agree`, raising ``RuntimeError`` on every rank if the plans differ. Run it
    before any check that depends on the plan's content."""
    digests = plans_agree(plan, info)
    if digests is not None:
        by_rank = ", ".join(f"rank {r}: {(d or '')[:12]}" for r, d in enumerate(digests))
        raise RuntimeError(
            f"{api}: the plan differs across ranks ({by_rank}); every rank must build the same "
            "plan (same model, world size and planner arguments, or load one saved plan)"
        )
