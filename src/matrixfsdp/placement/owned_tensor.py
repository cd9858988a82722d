"""Owned parameters: how a whole-tensor-on-one-rank shard is stored and described.

[Note: owned parameter representation]
An owned parameter (plan placement ``"matrix"`` or ``"tail"``) is an ``nn.Parameter`` DTensor with
placements ``[Replicate()]`` on a *one-rank owner sub-mesh* containing just the owner. On the owner
its local tensor is the whole parameter; on every other rank (not a member of that mesh) it is an
empty ``[0, *shape[1:]]`` tensor. The plan's metadata rides along as :class:`Owned`, reachable with
:func:`owned_of` (stored as an attribute of the parameter).

Why this and not a custom ``Placement`` or a tensor wrapper (measured on torch 2.13):

* A Python ``Placement`` subclass cannot be redistributed (``full_tensor()`` and any op mixing it
  with a regular DTensor fail) and DCP treats unknown placements like ``Replicate``: when DCP's
  save de-duplication picked a non-owner (empty local tensor) as the writer, the checkpoint was
  silently corrupt.
* ``[Replicate()]`` on a one-rank mesh is plain DTensor semantics: ``full_tensor()`` on the owner is
  its local tensor (no communication); elementwise ops and optimizers run locally on the owner and
  are no-ops elsewhere (DTensor skips ranks outside a mesh), so ``optimizer.step()`` on these
  parameters issues no collective; DCP saves the tensor once, from the owner, and reshards it into
  any other layout (measured: saved at W=4, reloaded at W=2 with another owner map, into a
  ``Shard(0)`` DTensor and in a single process).
* A tensor wrapper implementing ``__create_write_items__``/``__create_chunk_list__``/
  ``__get_tensor_shard__`` also checkpoints correctly, but would need its own op coverage for
  optimizers; the DTensor gets that for free.

The one-rank sub-meshes are created once per data-parallel mesh by :func:`owner_meshes`, without
a process group (a one-rank ``[Replicate()]`` tensor never communicates). Evenly sharded parameters are plain
``Shard(0)`` DTensors on the data-parallel mesh, exactly like stock FSDP2's.

Parameters are constructed with ``DTensor(..., requires_grad=...)`` and marked as parameters
directly: ``nn.Parameter(dtensor)`` would run ``detach`` through DTensor dispatch, which on a rank
outside the owner mesh replaces the local tensor by a shapeless ``[0]`` tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_flatten, tree_map

from ._compat import called_from, dtensor_dispatch, subclass_dispatch, subclass_torch_function
from .owner import (Owned, is_owned, owned_of, owner_meshes, owner_of, owner_source, owner_tp_meshes, set_owner,
                    tp_mesh_of)

__all__ = [
    "Owned",
    "OwnedDTensor",
    "owned_of",
    "is_owned",
    "owner_meshes",
    "make_sharded_param",
    "make_sharded_grad",
    "wrap_dtensor",
    "local_tensor",
    "full_tensor",
    "set_full_",
]

class OwnedDTensor(DTensor):
    """A DTensor stored whole on one rank of a data-parallel mesh.

    [Note: owned tensors to every consumer]
    It is a ``[Replicate()]`` DTensor on a one-rank owner sub-mesh, so every op, optimizer and DCP
    save treats it as plain DTensor; what differs is the two calls through which consumers ask for
    the *full* value, which DTensor alone would answer with the empty local tensor on every rank
    but the owner: ``full_tensor()`` and ``redistribute(..., [Replicate()])`` broadcast it from
    the owner over the data-parallel mesh (a collective: every rank of that mesh must call; the
    redistributed tensor holds the whole value as its local tensor on every rank), and
    ``redistribute(dp_mesh, [Shard(d)])`` gives the evenly sharded layout. Results of ops on it
    stay ``OwnedDTensor`` (optimizer state created by ``zeros_like``, ``detach()`` in state dicts).

    Example::

        w = model.blocks[0].mlp.up_proj.weight     # owned by rank 1 of 4
        w.full_tensor()                            # the whole matrix on every rank
    """

    if not subclass_dispatch():  # torch 2.11: [Note: DTensor subclasses on torch 2.11] (_compat.py)
        __torch_function__ = classmethod(subclass_torch_function)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # DTensor's own dispatch, then: a result that *is* an argument (in-place and out= ops)
        # is handed back as the caller's object; new results on an owner mesh stay owned.
        mine = {id(a._local_tensor): a for a in tree_flatten((args, kwargs or {}))[0]
                if isinstance(a, OwnedDTensor)}
        _refuse_plain_write_target(func, args)
        _refuse_mixed_owner_meshes(func, args, kwargs)
        out = dtensor_dispatch(func, types, args, kwargs)

        def rewrap(x: Any) -> Any:
            if isinstance(x, DTensor):
                same = mine.get(id(x._local_tensor))
                if same is not None and same._spec == x._spec:
                    return same
            return _as_owned_if_owner_mesh(x)

        return tree_map(rewrap, out)

    # [Note: torch's full state-dict loaders and owned tensors] (in _compat.py): the two
    # members below answer torch's full state-dict loaders differently, on verified torch only.

    def to_local(self, *, grad_placements: Any = None) -> torch.Tensor:  # type: ignore[override]
        if self._spec.mesh.get_coordinate() is None and called_from("_distribute_tensors"):
            local = self._local_tensor
            return torch.empty(tuple(self.shape), dtype=local.dtype, device=local.device)
        return super().to_local(grad_placements=grad_placements)

    @property
    def device_mesh(self) -> DeviceMesh:  # type: ignore[override]
        # Read by both loaders on every rank at the same key (to_local above: only on non-owners),
        # so on an unverified torch every rank raises here alike.
        if called_from("_distribute_tensors", "_distribute_state_dict") == "_distribute_state_dict":
            dp, owner = self._dp()
            raise ValueError(
                "matrixfsdp: set_model_state_dict/set_optimizer_state_dict with "
                "StateDictOptions(full_state_dict=True) and broadcast_from_rank0=False would "
                f"distribute a tensor of shape {tuple(self.shape)} with distribute_tensor on its "
                f"one-rank owner mesh {self._spec.mesh.mesh_dim_names} (rank {owner} of the "
                "data-parallel mesh), which has no process group; pass "
                "StateDictOptions(full_state_dict=True, broadcast_from_rank0=True) (rank 0's "
                "dict is used, other ranks may pass {}) or write tensors with "
                "matrixfsdp.set_full_"
            )
        return self._spec.mesh

    def _dp(self) -> tuple[DeviceMesh, int]:
        found = owner_source(self.device_mesh)
        if found is None:
            raise RuntimeError(f"matrixfsdp: {self.device_mesh} is not a matrixfsdp owner mesh")
        return found

    def full_tensor(self, *, grad_placements: Any = None) -> torch.Tensor:  # type: ignore[override]
        """The whole tensor on every rank of the data-parallel mesh (broadcast from the owner)."""
        info = owner_of(self)
        if info is not None:
            info.settle()  # HSDP split: no replica may broadcast a value it has not received yet
        dp, owner = self._dp()
        local = self._local_tensor.detach()
        tp = tp_mesh_of(self.device_mesh)
        shape = tuple(self.shape)
        if tp is not None:  # FSDP2 + TP: this rank's TP shard from the owner's row, then TP's gather
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape = tuple(compute_local_shape_and_global_offset(self.shape, tp, self.placements)[0])
        out = local if dp.get_local_rank() == owner else torch.empty(shape, dtype=self.dtype, device=local.device)
        from ..comm.collectives import collectives_for

        collectives_for(dp.get_group()).broadcast(out, owner)
        if tp is not None:
            return DTensor.from_local(out, tp, self.placements, run_check=False, shape=self.shape,
                                      stride=self.stride()).full_tensor()
        return out

    def redistribute(self, device_mesh: DeviceMesh | None = None, placements: Any = None,
                     *, async_op: bool = False, forward_dtype: Any = None,
                     backward_dtype: Any = None) -> DTensor:  # type: ignore[override]
        """To ``[Replicate()]`` (on its own mesh or the data-parallel one) or ``[Shard(d)]`` on
        the data-parallel mesh; anything else raises."""
        dp, owner = self._dp()
        mesh = self.device_mesh if device_mesh is None else device_mesh
        placements = tuple(placements) if placements is not None else tuple(self.placements)
        if len(placements) == 1 and mesh in (dp, self.device_mesh):
            (pl,) = placements
            if pl.is_replicate():
                # Every rank gets the whole tensor as its local tensor. On its own owner mesh the
                # result stays an OwnedDTensor (torchtitan's state-dict hooks redistribute to
                # Replicate on the tensor's mesh and copy the result back into the parameter,
                # which only the owner applies; DCP's full state dict reads its to_local()).
                return wrap_dtensor(self.full_tensor(), mesh, (Replicate(),), tuple(self.shape))
            if pl.is_shard() and mesh == dp and type(pl) is Shard and -self.ndim <= pl.dim < self.ndim:
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                full = self.full_tensor()
                shape, offset = compute_local_shape_and_global_offset(self.shape, dp, (pl,))
                index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
                return wrap_dtensor(full[index].clone(), dp, (pl,), tuple(self.shape))
        raise ValueError(
            "matrixfsdp: an owned tensor (whole on rank "
            f"{owner} of its data-parallel mesh) can be redistributed to [Replicate()] or, on the "
            f"data-parallel mesh {dp}, to [Shard(d)]; got mesh {mesh} and placements {placements}"
        )


def _refuse_plain_write_target(func: Any, args: Any) -> None:
    """An in-place op writing a plain tensor from owned operands has no sound meaning (the owner
    would update it, the other ranks not, and the copies diverge silently). It happens after
    set_optimizer_state_dict(full_state_dict=True) with a torch optimizer and a 0-dim owned
    parameter: torch's loader passes 0-dim state (e.g. AdamW's exp_avg) as plain tensors."""
    schema = func._schema
    if (args and schema.arguments and type(args[0]) is torch.Tensor
            and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write):
        raise ValueError(
            f"matrixfsdp: {schema.name} would write a plain tensor of shape {tuple(args[0].shape)} "
            "from an owned (one-rank-mesh) DTensor; a torch optimizer's state of a 0-dim owned "
            "parameter becomes a plain tensor when loaded with set_optimizer_state_dict("
            "full_state_dict=True) (torch keeps 0-dim state values as plain tensors); load it "
            "from a DCP (sharded) checkpoint, or use matrixfsdp.optim, whose state is local"
        )


def _refuse_mixed_owner_meshes(func: Any, args: Any, kwargs: Any) -> None:
    """DTensor refuses ops on tensors of different meshes; say why owned ones have different
    meshes and what computes the usual cross-parameter reductions instead."""
    # by value, as DTensor compares meshes: owner meshes of two equal data-parallel meshes with
    # their own process groups are distinct objects (see [Note: mesh caches die with their meshes])
    meshes = {a._spec.mesh for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, DTensor)}
    if len(meshes) > 1:
        names = sorted(str(m.mesh_dim_names or m) for m in meshes)
        raise ValueError(
            f"matrixfsdp: {func._schema.name} combines DTensors on different meshes {names}: "
            "owned parameters (and their gradients) live whole on one-rank owner meshes, one per "
            "owner, so arithmetic across parameters of different owners is not a DTensor op; "
            "clip with matrixfsdp.clip_grad_norm_(model.parameters(), max_norm), or reduce local "
            "terms (p.to_local()) and all-reduce them"
        )


def empty_local(shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """What a rank that does not own a tensor of global ``shape`` holds: ``[0, *shape[1:]]``
    (``[0]`` for a 0-dim tensor)."""
    return torch.empty((0, *shape[1:]) if shape else (0,), dtype=dtype, device=device)


def _as_owned_if_owner_mesh(x: Any) -> Any:
    if type(x) is DTensor and owner_source(x.device_mesh) is not None:
        local = x._local_tensor
        if x.device_mesh.get_coordinate() is None:
            # DTensor gives ranks outside a mesh a shapeless [0] tensor; ours hold empty_local
            local = empty_local(tuple(x.shape), local.dtype, local.device)
        return OwnedDTensor(local, x._spec, requires_grad=x.requires_grad)
    return x


def wrap_dtensor(local: torch.Tensor, mesh: DeviceMesh, placements: Any, shape: tuple[int, ...],
                 *, requires_grad: bool = False) -> DTensor:
    """A DTensor of global ``shape`` (contiguous strides) around ``local`` as is: no copy, no
    dispatch (``DTensor.from_local`` would run ops that, on a rank outside a one-rank owner mesh,
    replace the local tensor). The one place the runtime, optimizers and checkpoints build one;
    on an owner sub-mesh it is an :class:`OwnedDTensor`."""
    stride = torch.empty(shape, device="meta").stride() if shape else ()
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    cls = OwnedDTensor if owner_source(mesh) is not None else DTensor
    return cls(local, spec, requires_grad=requires_grad)


def make_sharded_param(
    local: torch.Tensor,
    *,
    shape: tuple[int, ...],
    mesh: DeviceMesh,
    owner: int | None,
    kind: str,
    requires_grad: bool,
    step_replica: int | None = None,
    tp: tuple[DeviceMesh, tuple[Any, ...]] | None = None,
    experts: tuple[int, ...] = (),
    splits: int = 1,
) -> nn.Parameter:
    """Wrap ``local`` (this rank's row segment) as the sharded parameter.

    ``owner=None``: an evenly sharded ``Shard(0)`` DTensor on ``mesh`` (``(Replicate(),
    Shard(0))`` on an HSDP mesh, as torch's HSDP); otherwise an owned parameter (see [Note: owned
    parameter representation]) carrying :class:`Owned`. ``tp=(tp_mesh, placements)``: a
    TP-sharded parameter (FSDP2 + TP), owned, with ``local`` its TP shard: presented with its TP
    placements on the owner's TP-row mesh (``owner_tp_meshes``).
    ``kind="experts"``: an expert stack, ``experts[r]`` whole experts on shard rank ``r`` (see
    [Note: expert stack representation] in ``experts.py``).
    ``local`` is used as is (no copy): on the owner it may be the original parameter's storage.
    """
    if kind == "experts":
        from .experts import make_expert_param

        if tp is not None:
            raise ValueError("matrixfsdp: an expert stack cannot be tensor-parallel here")
        return make_expert_param(local, shape=shape, mesh=mesh, counts=experts, splits=splits,
                                 requires_grad=requires_grad)  # type: ignore[return-value]
    if tp is not None:
        if owner is None:
            raise ValueError("matrixfsdp: a TP-sharded parameter must be owned (the planner never "
                             "shards one evenly); plan it with plan_owners(model, mesh, ...)")
        row = owner_tp_meshes(mesh, tp[0])[owner]
        dt = wrap_dtensor(local.detach(), row, tp[1], shape, requires_grad=requires_grad)
    elif owner is None:
        placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
        dt = wrap_dtensor(local.detach(), mesh, placements, shape, requires_grad=requires_grad)
    else:
        dt = wrap_dtensor(local.detach(), owner_meshes(mesh)[owner], (Replicate(),), shape,
                          requires_grad=requires_grad)
    dt._is_param = True  # makes isinstance(dt, nn.Parameter) true, as nn.Parameter(dt) would
    if owner is not None:
        set_owner(dt, Owned(owner=owner, kind=kind, mesh=mesh, step_replica=step_replica))
    return dt  # type: ignore[return-value]


def make_sharded_grad(param: DTensor, local_grad: torch.Tensor) -> DTensor:
    """A gradient DTensor with ``param``'s layout around ``local_grad`` (same local shape)."""
    from .experts import expert_rows, wrap_expert_tensor

    rows = expert_rows(param)
    if rows is not None:
        return wrap_expert_tensor(local_grad, param.device_mesh, rows, tuple(param.shape))
    return wrap_dtensor(local_grad, param.device_mesh, param.placements, tuple(param.shape))


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise), without autograd."""
    return t._local_tensor if isinstance(t, DTensor) else t


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The full value of a sharded parameter on every rank (a collective: call on all ranks).

    ``DTensor.full_tensor()`` (owned parameters are :class:`OwnedDTensor`: broadcast from their
    owner, who gets its own local tensor back, no copy); plain tensors are returned unchanged.

    Example::

        w = matrixfsdp.full_tensor(model.blocks[0].mlp.up.weight)  # same on every rank
    """
    return param.full_tensor() if isinstance(param, DTensor) else param  # owned: OwnedDTensor's


@torch.no_grad()
def set_full_(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Write ``full`` (the whole tensor, same on every rank) into ``param``'s local segment.

    No communication: the owner of an owned parameter copies everything, other ranks nothing;
    an evenly sharded parameter copies its rows; an owned TP-sharded parameter (``fully_shard`` +
    TP) its TP shard, on the owner's TP row; a plain tensor is copied whole. Gives a sharded
    model exactly the values of an unsharded one initialized with the same ``full`` tensors
    (e.g. after meta-device init and ``to_empty``). Returns ``param``.

    Example::

        for name, p in model.named_parameters():
            set_full_(p, reference_state_dict[name])
    """
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"matrixfsdp.set_full_: shape mismatch, param {tuple(param.shape)} vs "
                         f"full {tuple(full.shape)}")
    if not isinstance(param, DTensor):
        param.copy_(full)
        return param
    local = param._local_tensor
    if local.numel() == 0:
        return param
    from .rows import local_slices

    # the one answer for which part of the value this rank stores (an owner: all of it; an even
    # or TP-sharded one: its block; an expert stack: its experts; see placement/rows.py)
    local.copy_(full[local_slices(param)])
    return param
