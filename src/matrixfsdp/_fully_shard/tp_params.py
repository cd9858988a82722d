"""``fully_shard`` over tensor-parallel parameters: torch's FSDP2 + TP pattern with owners.

[Note: owners of TP-sharded parameters]
The calls are torch's::

    mesh = init_device_mesh(dev, (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    parallelize_module(block, mesh["tp"], {...})           # Shard(0)/Shard(1) DTensors on "tp"
    plan = matrixfsdp.plan_owners(model, mesh, ...)         # owners over dp_shard; tp from the mesh
    matrixfsdp.fully_shard(block, mesh=mesh["dp_shard"], plan=plan)

Owners are planned over ``dp_shard`` from the global shapes, so every TP column holds the same
plan. What a data-parallel rank stores of a TP-sharded parameter is its *TP shard*: the engine
runs on TP-local tensors (each TP column reduces and gathers its own shards over its own
``dp_shard`` group, exactly as for plain parameters), and the plan's shapes are localized per
rank (``localize``). The planner never shards such a parameter evenly: the owner's whole TP row
holds it, the other rows hold empty shards.

The three representations:

* sharded (optimizers, state dicts, DCP): a DTensor with the parameter's TP placements on the
  owner's *TP-row mesh* (``placement/owner.py: owner_tp_meshes``), the TP shard on that row and an
  empty tensor elsewhere; ``full_tensor()`` broadcasts each TP shard down its column, then
  all-gathers over TP;
* unsharded (forward, backward): a DTensor leaf on this rank's own TP mesh with the TP placements,
  as FSDP2's unsharded TP parameters, so ``parallelize_module``'s styles run unchanged; its
  gradient's local tensor is what the reduction sends;
* the step: every ``"matrix"`` parameter with a ``Shard(d)`` placement is stepped whole on one
  host of its owner's TP row between two fused all-to-alls per micro-group, the plan's
  ``micro_groups[owner]`` (``tp/host_step.py``, [Note: TP hosts]). Only the owner's row runs
  them: across data parallelism the step stays free of communication.

HSDP x TP composes the two without new machinery: a ``("dp_replicate", "dp_shard", "tp")`` mesh,
``plan_owners(model, mesh)`` and ``fully_shard(block, mesh=mesh["dp_replicate", "dp_shard"])``.
Each TP column is an HSDP mesh of its own, so the engine reduces, combines replicas (``repeat``:
all-reduce; ``split``: reduce-scatter to the step replica, then the deferred all-gather) and
exchanges TP-local tensors exactly as plain HSDP does its tensors. The owner's TP row exists in
every replica; a parameter is presented on the row of this rank's replica (the replicas' chunks
are identical: DCP writes one). Under ``repeat`` every replica's row runs its host step and each
host keeps the state, presented among its replica's ranks; under ``split`` only the step
replica's row steps (the others have no gradient) and its host's state is presented on a one-rank
mesh among all ranks, where the other replicas present the same keys empty.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..placement.owned_tensor import OwnedDTensor
from ..placement.owner import dp_tp_mesh, owner_of, owner_tp_meshes, shard_dim_mesh
from ..mesh import flat_dp_mesh

if TYPE_CHECKING:
    from ..planner.owner_plan import OwnerPlan, ParamPlan

__all__ = ["tp_layout", "localize", "check_plan_tp", "attach_tp_hosts"]

API = "matrixfsdp.fully_shard"

TPLayout = tuple[DeviceMesh, tuple[Any, ...]]  # (this rank's TP mesh, the TP placements)


def tp_layout(name: str, p: torch.Tensor, dp: DeviceMesh) -> TPLayout:
    """The TP layout of DTensor parameter ``p`` under ``fully_shard(mesh=dp)``; raises for a
    DTensor of any other origin (another sharding API, a mesh that is not ``dp``'s TP sibling)."""
    mesh = p.device_mesh  # type: ignore[attr-defined]
    if isinstance(p, OwnedDTensor) or mesh.ndim != 1 or mesh == dp:
        raise ValueError(f"{API}: parameter {name!r} is already a DTensor on {mesh}; it is managed by "
                         "another sharding API")
    placements = tuple(p.placements)  # type: ignore[attr-defined]
    if any(type(pl) not in (Shard, Replicate) for pl in placements):
        raise ValueError(f"{API}: TP parameter {name!r} has placements {placements}; fully_shard "
                         "takes Shard(d) or Replicate() on the TP mesh (parallelize_module's styles)")
    dp_tp_mesh(dp, mesh)  # checks the meshes are dimensions of one (["dp_replicate",] "dp_shard", "tp") mesh
    return mesh, placements


def localize(pp: "ParamPlan", p: torch.Tensor, fqn: str) -> "ParamPlan":
    """The plan entry with this rank's TP-shard shape: the engine runs on TP-local tensors."""
    if pp.owner is None:
        raise ValueError(
            f"{API}: the plan shards TP parameter {fqn!r} evenly, but a TP-sharded parameter must be "
            "owned; build the plan from the parallelized model (plan_owners(model, mesh) after "
            "parallelize_module), which owns every DTensor parameter"
        )
    return dataclasses.replace(pp, shape=tuple(p._local_tensor.shape))  # type: ignore[attr-defined]


def check_plan_tp(plan: "OwnerPlan", params: list[Any]) -> None:
    """The plan was built for the model's TP degree (local; before anything is sharded)."""
    for mp in params:
        if mp.tp is not None and plan.tp != mp.tp[0].size():
            raise ValueError(
                f"{API}: the model's TP mesh has {mp.tp[0].size()} ranks but the plan was built with "
                f"tp={plan.tp}; plan with the (\"dp_shard\", \"tp\") mesh: plan_owners(model, mesh, ...)"
            )


def unsharded_leaf(data: torch.Tensor, tp: TPLayout, shape: torch.Size, requires_grad: bool) -> torch.nn.Parameter:
    """The unsharded TP DTensor leaf over ``data`` (this rank's TP shard; no copy)."""
    dt = DTensor.from_local(data, tp[0], tp[1], run_check=False, shape=shape,
                            stride=torch.empty(shape, device="meta").stride())
    return torch.nn.Parameter(dt, requires_grad=requires_grad)


def local_grad(grad: torch.Tensor, tp: TPLayout) -> torch.Tensor:
    """The local tensor of an unsharded TP leaf's gradient, in the parameter's TP placements (a
    gradient that DTensor left ``Partial``, e.g. of a replicated norm under sequence parallelism,
    is reduced over TP first, as FSDP2 does: a TP collective, so only where every TP rank takes
    the same gradients, in a reduction; an aborted backward's are dropped untaken)."""
    if isinstance(grad, DTensor):
        if tuple(grad.placements) != tp[1]:
            grad = grad.redistribute(tp[0], tp[1])
        return grad._local_tensor
    return grad


def attach_tp_hosts(states: list[Any], plan: "OwnerPlan", dp: DeviceMesh, shard_rank: int, *,
                    pipeline: bool = True) -> None:
    """Give every TP-sharded ``"matrix"`` parameter its host descriptor and this rank's executor
    (its owner row's micro-groups; see the module Note). Collective once (the host meshes' flat
    group); every rank calls at resolution."""
    from ..tp.attach import attach_hosts, row_hosts

    hosted: dict[str, Any] = {}
    for s in states:
        for mp in s.params:
            if mp.tp is not None and mp.plan.placement == "matrix" and any(isinstance(pl, Shard) for pl in mp.tp[1]):
                hosted[mp.fqn] = mp
    if not hosted:
        return
    tp_mesh = next(iter(hosted.values())).tp[0]
    if tp_mesh.size() == 1:
        return  # a one-rank TP mesh: every owner holds its matrices whole, stepped locally
    rows = [[(g.index, [(f, hosted[f].sharded, h) for f, h in g.members if f in hosted])
             for g in (plan.micro_groups[s] if plan.micro_groups else ())] for s in range(plan.world_size)]
    planned = {f for row in rows for _, members in row for f, _, _ in members}
    missing = [f for f in hosted if f not in planned]
    if missing:
        raise ValueError(f"{API}: the plan has no micro-group for TP matrix {missing[0]!r}; build the "
                         "plan from the parallelized model with the (\"dp_shard\", \"tp\") mesh")
    # the hosts' state is presented among the rows of this rank's replica (collective: flattens)
    mine = row_hosts([r.mesh.flatten().tolist() for r in owner_tp_meshes(dp, tp_mesh)],
                     flat_dp_mesh(dp_tp_mesh(shard_dim_mesh(dp), tp_mesh)))
    host_meshes = mine
    # (the same plan on every rank: all make the flattening below, or none)
    if dp.ndim == 2 and any(owner_of(mp.sharded).step_replica is not None for mp in hosted.values()):
        # HSDP x TP split: the step replica's hosts alone keep the state, presented among every
        # rank of the (R, S, T) mesh (see the module Note)
        grid = dp_tp_mesh(dp, tp_mesh)
        world = row_hosts([row for rep in grid.mesh.tolist() for row in rep], flat_dp_mesh(grid))
        S = grid.mesh.shape[1]

        def split_hosts(s: int, h: int, p: Any) -> DeviceMesh:
            q = owner_of(p).step_replica  # type: ignore[union-attr]
            return mine(s, h, p) if q is None else world(q * S + s, h, p)
        host_meshes = split_hosts
    # grads_agree: each TP column's gradients land through its reduction (on every dp rank or
    # none), and a row's TP ranks run one forward (their TP collectives match), so one usage
    attach_hosts(tp_mesh, [[(k, m) for k, m in row if m] for row in rows], shard_rank, host_meshes,
                 pipeline=pipeline, grads_agree=True)
