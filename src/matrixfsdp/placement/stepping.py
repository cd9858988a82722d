"""The stepping descriptor: what an optimizer needs to know to step one parameter on this rank.

[Note: one stepping descriptor]
Two descriptors say where a parameter lives: the owner descriptor (``owner_of``, [Note: one owner
descriptor] in ``owner.py``) and the TP host descriptor (``tp_host_of``, [Note: TP hosts] in
``tp_host.py``); under ``fully_shard`` + TP a parameter has both. Optimizers and their state
dicts do not combine the two themselves: :func:`stepping_of` answers, in one lookup, the
questions they ask of a parameter (its planned rule, whether this rank keeps its state, whether
one rank alone keeps it, whether a TP host step takes it and where that host presents its
state, whether another replica received its gradient). It is computed from the descriptors at
every call (nothing cached that could go stale).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch.distributed.device_mesh import DeviceMesh

from .experts import expert_stack_of
from .owner import FQN_ATTR, PLACEMENT_ATTR, keeps_state, owner_of
from .tp_host import tp_host_of

try:  # torch builds without distributed have no DTensor; then nothing is one.
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover
    _DTensor = None

__all__ = ["Stepping", "stepping_of", "planned_kind", "expert_splits_of", "check_planned", "KIND_OF_PLACEMENT"]


class Stepping(NamedTuple):
    """How this rank steps one parameter (see [Note: one stepping descriptor])."""

    #: ``"matrix"``: a plan made it a whole-matrix parameter (owned with placement ``"matrix"``,
    #: or TP-hosted); ``"experts"``: an expert stack, whole experts per rank; ``"elementwise"``:
    #: a plan made it element-wise (an owned tail, an evenly sharded or other DTensor); ``None``:
    #: a plain tensor, whose shape (and param group) decides
    planned: str | None
    #: this rank steps it (itself or as a TP host) and keeps its state
    keeps_state: bool
    #: one rank alone keeps its state (owned by ``fully_shard``, or TP-hosted): elsewhere state
    #: dicts present its keys
    single_keeper: bool
    #: TP-hosted: stepped whole on its host, with whole-matrix state, while its local tensor is
    #: a TP shard
    hosted: bool
    #: the TP host step that takes it on this rank (its TP row steps it), else ``None``
    executor: Any
    #: TP-hosted: the one-rank mesh of its host, where its whole state is presented
    host_mesh: DeviceMesh | None
    #: HSDP ``split``: this rank holds it without stepping it and its step replica holds a
    #: reduced gradient, so its state exists there as if this rank had a ``.grad`` (see [Note:
    #: step receipts] in ``owner.py``)
    reduced_elsewhere: bool = False
    #: hosted, with its (element-wise) state on every rank's shard like an evenly sharded
    #: parameter's: the host keeps none of it (see [Note: state on the shards] in ``optim/rule.py``)
    state_on_shards: bool = False


def planned_kind(p: Any) -> str | None:
    """:attr:`Stepping.planned` of ``p`` alone (the routing question, asked at every step)."""
    if tp_host_of(p) is not None:
        return "matrix"  # a TP-sharded matrix stepped whole on its host
    if expert_stack_of(p) is not None:
        return "experts"
    info = owner_of(p)
    if info is not None and info.storage == "sharded":
        return "matrix" if info.kind == "matrix" else "elementwise"
    if _DTensor is not None and isinstance(p, _DTensor):
        return "elementwise"  # evenly sharded: the plan made it element-wise
    return None


#: the kind (see [Note: one routing rule]) each plan placement (``OwnerPlan.PLACEMENTS``) stands for
KIND_OF_PLACEMENT = {"matrix": "matrix", "hosted": "matrix", "experts": "experts", "tail": "elementwise",
                     "even": "elementwise"}


def check_planned(p: Any, where: str, name: str | None = None) -> None:
    """The routing invariant (see [Note: routing invariant] in ``planner/rules.py``): a parameter
    the plan placed as a matrix (owned, hosted or an expert stack) must be stepped as one, i.e.
    :func:`planned_kind` says ``"matrix"`` or ``"experts"``; an evenly sharded matrix without a
    host would silently get AdamW. Local and deterministic (the same plan on every rank gives the
    same answer), so every rank raises alike; ``where`` names the plan or API for the message."""
    placement = getattr(p, PLACEMENT_ATTR, None)
    if KIND_OF_PLACEMENT.get(placement) not in ("matrix", "experts"):
        return
    kind = planned_kind(p)
    if kind in ("matrix", "experts"):
        return
    label = name or getattr(p, FQN_ATTR, None) or f"a parameter of shape {tuple(p.shape)}"
    raise RuntimeError(
        f"matrixfsdp internal error ({where}): parameter {label!r} of shape {tuple(p.shape)} has plan "
        f"placement {placement!r} (a matrix) but is stored as {type(p).__name__} with no owner, host or "
        f"expert record, so an optimizer would step it element-wise (planned kind {kind!r}); this is a bug "
        "in matrixfsdp: please report it with the plan (plan.report()); plan_owners(..., placement='owned') "
        "avoids hosting meanwhile"
    )


def expert_splits_of(p: Any) -> int:
    """Matrices per expert of an expert stack placed by ``fully_shard``, else 0."""
    info = expert_stack_of(p)
    return info.splits if info is not None else 0


def stepping_of(p: Any, *, elementwise_state: bool = False) -> Stepping:
    """The :class:`Stepping` descriptor of parameter ``p`` on this rank. ``elementwise_state``:
    the rule that steps ``p`` can keep its state on the shards (``UpdateRule.shards_state``); a
    hosted matrix whose host step does so (``TPHosted.shard_state``) then keeps its state like an
    evenly sharded parameter: on every rank of the shard group, none on the host alone."""
    info, host = owner_of(p), tp_host_of(p)
    owned = info is not None and info.storage == "sharded"
    # under fully_shard + TP only the owner's TP row steps a hosted matrix
    executor = host.executor if host is not None and (info is None or info.is_local) else None
    if host is not None and host.shard_state and elementwise_state and not owned:
        return Stepping(planned="matrix", keeps_state=executor is not None, single_keeper=False, hosted=True,
                        executor=executor, host_mesh=None, state_on_shards=True)
    return Stepping(
        planned=planned_kind(p),
        keeps_state=keeps_state(p),
        single_keeper=owned or host is not None,
        hosted=host is not None,
        executor=executor,
        host_mesh=host.host_mesh if host is not None else None,
        reduced_elsewhere=info is not None and info.reduced_elsewhere,
    )
