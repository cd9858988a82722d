"""Hosted matrices under ``fully_shard``: evenly sharded storage, whole-matrix steps on hosts.

A ``"hosted"`` plan entry (``plan_owners(..., placement="auto")`` past the memory budget; see
[Note: hosted matrices] in ``planner/hosting.py``) is stored, gathered and reduce-scattered
exactly as an ``"even"`` one: a ``Shard(0)`` DTensor on the data-parallel mesh (``(Replicate(),
Shard(0))`` on an HSDP mesh), ``torch.chunk`` rows. What differs is its step: the TP host step
(``tp/host_step.py``, [Note: TP hosts]) runs over the shard group instead of a TP group, with
the plan's ``host_groups`` as its micro-groups. There is one executor per root, and every hosted
matrix gets a host descriptor (``tp_host_of``, with ``shard_state``): optimizers hand it their
hosted matrices with their update rules. A rule with element-wise state (Muon) keeps it on every
rank's rows, presented in state dicts like an even parameter's, and the host keeps nothing
([Note: state on the shards] in ``optim/rule.py``); other rules (Shampoo, SOAP) keep it whole
on the host, presented on a one-rank mesh of the shard group (the same keys on every rank).

On an HSDP mesh every replica's shard group runs the same host step on the same (all-reduced)
gradients: each replica keeps identical state (Muon: on its shard ranks' rows, presented with
the parameter's ``(Replicate(), Shard(0))`` layout; others: on its host, presented within its
replica), and DCP writes one of the identical chunks, as HSDP x TP does with ``repeat``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.distributed.device_mesh import DeviceMesh

from ..placement.owner import shard_dim_mesh

if TYPE_CHECKING:
    from ..planner.owner_plan import OwnerPlan

__all__ = ["attach_dp_hosts"]

API = "matrixfsdp.fully_shard"


def attach_dp_hosts(states: list[Any], plan: "OwnerPlan", dp: DeviceMesh, *, pipeline: bool = True) -> Any:
    """Give every hosted matrix of the root's ``states`` its host descriptor and this rank's
    executor over the shard group; returns the executor (``None`` when nothing is hosted).
    Local: no collective (every rank calls it at resolution with the same plan)."""
    if not plan.host_groups:
        return None
    from ..tp.attach import attach_hosts, row_hosts

    hosted = {mp.fqn: mp for s in states for mp in s.params if mp.plan is not None and mp.plan.placement == "hosted"}
    planned = {f for g in plan.host_groups for f, _ in g.members}
    missing = sorted(planned - set(hosted))
    if missing:
        raise ValueError(f"{API}: the plan hosts {missing[0]!r}, which no fully_shard call of this model "
                         "manages; wrap every block the plan names (and the root) with fully_shard")
    shard = shard_dim_mesh(dp)
    rows = [[(g.index, [(f, hosted[f].sharded, h) for f, h in g.members]) for g in plan.host_groups]]
    hosts = row_hosts([shard.mesh.flatten().tolist()], shard)
    # the gradients land through the engine's reductions over this very group: on every rank or none
    return attach_hosts(shard, rows, 0, hosts, pipeline=pipeline, shard_state=True, grads_agree=True)
