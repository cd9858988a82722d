"""One managed parameter: its sharded form, its unsharded leaf, and the module slots holding them.

[Note: sharded and unsharded parameters]
As in FSDP2, every managed parameter has two representations that take turns in the module's
slots (``module._parameters[name]``, every slot of a tied parameter):

* the *sharded* parameter, a DTensor whose local tensor is this rank's row segment (see
  [Note: row segments] in ``planner/owner_plan.py`` and [Note: owned parameter representation] in
  ``placement/owned_tensor.py``): what optimizers, state dicts and checkpoints see, outside forward and backward;
* the *unsharded* parameter, a plain ``nn.Parameter`` *leaf* with the full shape, created once per
  storage: a view of the block's receive buffer (peers' rows, or a mixed-precision cast of the
  owner's), of its assembly buffer (evenly sharded parameters with several pieces), or of the
  owner's own sharded storage (an owner computes on its own storage, never a copy). It sits in the
  slots from pre-forward until reshard, so autograd's ``AccumulateGrad`` fills its ``.grad`` and
  anything that reads ``module.weight`` during forward or backward (activation-checkpoint
  recomputation, a head used outside ``forward`` with ``reshard_after_forward=False``) sees a
  plain full tensor.

Reshard frees the buffers' storage (``untyped_storage().resize_(0)``) and unshard refills the same
storage, so the unsharded leaves, and every view autograd saved of them, keep their identity
across a reshard-after-forward (see [Note: buffer lifetime] in ``param_group.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..mesh import MeshInfo
from ..placement.owner import FQN_ATTR, PLACEMENT_ATTR, StepReceipt, owner_of, set_owner
from ..placement.tp_host import set_tp_host, tp_host_of
from ..placement.experts import expert_rows
from ..placement.owned_tensor import local_tensor, make_sharded_param, owned_of

if TYPE_CHECKING:
    from ..planner.owner_plan import ParamPlan

__all__ = ["ManagedParam", "shard_param"]


@dataclass(eq=False)
class ManagedParam:
    """One parameter of a block (see [Note: sharded and unsharded parameters])."""

    fqn: str
    sites: tuple[tuple[nn.Module, str], ...]  #: (module, attribute) pairs; >1 when tied
    orig: nn.Parameter | None  #: the original parameter until resolution
    plan: "ParamPlan | None" = None
    sharded: Any = None  #: the DTensor parameter after resolution
    unsharded: nn.Parameter | None = None  #: the full-shape leaf (see the Note)
    #: ``(tp mesh, placements)`` of a TP-sharded parameter (see [Note: owners of TP-sharded
    #: parameters] in ``tp_params.py``); the engine then runs on its TP shard
    tp: Any = None

    @property
    def requires_grad(self) -> bool:
        p = self.sharded if self.sharded is not None else self.orig
        return bool(p is not None and p.requires_grad)

    @property
    def local(self) -> torch.Tensor:
        """This rank's row segment (plain tensor, no autograd)."""
        return local_tensor(self.sharded)

    def set_unsharded(self, data: torch.Tensor) -> None:
        """Make the unsharded leaf a parameter over ``data`` (a view; storage is shared); a TP
        DTensor leaf for a TP-sharded parameter."""
        if self.tp is not None:
            from .tp_params import unsharded_leaf

            self.unsharded = unsharded_leaf(data, self.tp, self.sharded.shape, self.requires_grad)
            return
        self.unsharded = nn.Parameter(data, requires_grad=self.requires_grad)

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad`` changes of the sharded parameter (freezing, unfreezing)."""
        u = self.unsharded
        if u is not None and u.requires_grad != self.requires_grad:
            u.requires_grad_(self.requires_grad)

    def to_sharded(self) -> None:
        for m, name in self.sites:
            m._parameters[name] = self.sharded

    def to_unsharded(self) -> None:
        for m, name in self.sites:
            m._parameters[name] = self.unsharded  # a plain Parameter, as FSDP2 does

    def swap_local(self, local: torch.Tensor, mesh: DeviceMesh) -> None:
        """Make ``sharded`` (same object) hold ``local`` with the plan's layout and metadata.

        Parameter identity is kept (``torch.utils.swap_tensors``, as FSDP2's ``to_empty``), so
        optimizers built earlier keep working; a gradient of the old storage is dropped.
        """
        pp, old = self.plan, self.sharded
        shape = tuple(old.shape) if self.tp is not None else tuple(pp.shape)  # TP: pp has the TP shard's
        new = make_sharded_param(local, shape=shape, mesh=mesh, owner=pp.owner,
                                 kind=pp.placement, requires_grad=old.requires_grad,
                                 step_replica=pp.step_replica, tp=self.tp, experts=pp.experts, splits=pp.splits)
        info, host = owner_of(old), tp_host_of(old)
        if host is not None:
            set_tp_host(new, host)
        if info is not None and info.exchange is not None:  # the runtime's, set at resolution
            # a fresh receipt: the gradients are dropped below, on every rank alike
            receipt = StepReceipt() if info.receipt is not None else None
            set_owner(new, dataclasses.replace(owner_of(new), exchange=info.exchange,  # type: ignore[arg-type]
                                               receipt=receipt))
        setattr(new, FQN_ATTR, self.fqn)
        setattr(new, PLACEMENT_ATTR, pp.placement)
        if old.grad is not None:
            old.grad = None  # a use of the old storage would block the swap; it is stale anyway
        torch.utils.swap_tensors(old, new)
        self.to_sharded()

    def check_layout(self, info: MeshInfo, block: str) -> bool:
        """Restore the layout if torch code replaced our DTensor (see ``BlockState.repair_layout``).

        Returns whether anything was swapped (the block then rebuilds its views).
        """
        p, pp = self.sharded, self.plan
        local = local_tensor(p)
        rank = info.shard_rank
        expected = pp.local_shape(rank, info.shard_size)
        good_meta = ((owned_of(p) is not None) == (pp.owner is not None) and isinstance(p, DTensor)
                     and (expert_rows(p) == pp.experts if pp.placement == "experts" else expert_rows(p) is None))
        if tuple(local.shape) == expected and good_meta:
            return False
        if tuple(local.shape) != expected:
            if math.prod(expected) != 0:
                raise RuntimeError(
                    f"matrixfsdp.fully_shard: parameter {self.fqn!r} of block {block!r} has local "
                    f"shape {tuple(local.shape)} on rank {rank}, expected {expected}; it was "
                    "replaced outside matrixfsdp (assign parameters through set_full_ or a "
                    "checkpoint load instead)"
                )
            local = torch.empty(expected, dtype=local.dtype, device=local.device)
        self.swap_local(local, info.mesh)
        return True


def shard_param(mp: ManagedParam, info: MeshInfo) -> None:
    """Replace the original parameter by its row segment (see [Note: row segments])."""
    pp, orig = mp.plan, mp.orig
    if pp is None or orig is None:
        raise RuntimeError(f"matrixfsdp.fully_shard: {mp.fqn!r} is not planned or was already sharded")
    mesh, rank, W = info.mesh, info.shard_rank, info.shard_size
    data = orig.detach()
    if mp.tp is not None:
        data = data._local_tensor  # the engine runs on this rank's TP shard
    if data.is_meta:  # meta-device init: shapes only; model.to_empty(device=...) allocates
        local = torch.empty(pp.local_shape(rank, W), dtype=data.dtype, device="meta")
    else:
        device = info.device
        if data.device != device:
            data = data.to(device)
        if pp.owner is None:
            start, end = pp.local_rows(rank, W)
            local = data[start:end].clone()  # own storage: the full tensor can be freed
        elif pp.owner == rank:
            local = data.contiguous()  # the owner keeps the original storage (no copy)
        else:
            local = data.new_empty(pp.local_shape(rank, W))
    mp.sharded = make_sharded_param(local, shape=tuple(orig.shape), mesh=mesh, owner=pp.owner,
                                    kind=pp.placement, requires_grad=orig.requires_grad,
                                    step_replica=pp.step_replica, tp=mp.tp, experts=pp.experts, splits=pp.splits)
    setattr(mp.sharded, FQN_ATTR, mp.fqn)  # optimizers' warnings name it
    setattr(mp.sharded, PLACEMENT_ATTR, pp.placement)  # the routing invariant checks it
    mp.orig = None
    mp.to_sharded()
