"""Expert stacks: whole experts per rank, how they are stored, described and checkpointed.

[Note: expert stack representation]
An expert stack (plan placement ``"experts"``, [Note: expert placement] in
``planner/owner_plan.py``) is an :class:`ExpertDTensor`: a DTensor on the data-parallel mesh with
``Shard(0)`` (``(Replicate(), Shard(0))`` on an HSDP mesh) whose local tensor is this shard rank's
whole experts, ``[counts[r], out, in]``. The counts are the plan's, not ``torch.chunk``'s, so the
tensor carries them (:class:`ExpertStack`, :func:`expert_stack_of`) and answers the calls whose
answer depends on where rows live from them, not from DTensor's chunk rule:

* ``full_tensor()`` / ``redistribute(..., [Replicate()])``: one in-place all-gather of the rows
  over the shard group (every rank of the data-parallel mesh must call);
* torch.distributed.checkpoint (``__create_write_items__``, ``__create_chunk_list__``,
  ``__get_tensor_shard__``): rank ``r`` writes and reads its rows at offset
  ``sum(counts[:r])``; DCP reshards them into any other layout (other counts, stock FSDP2's
  ``Shard(0)``, one process). On an HSDP mesh only replica 0 writes.

Element-wise ops and ``zeros_like`` run on the local rows and keep the class and counts (what
optimizers and their state need); ops that move rows (indexing dim 0, views across it) are not
defined on it and raise. Optimizer state of a stack is presented with the same class: one row per
matrix (``splits`` rows per expert, [Note: expert optimizer state] in ``optim/_expert_step.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_flatten, tree_map

from ._compat import called_from, dtensor_dispatch, subclass_dispatch, subclass_torch_function
from .owner import coordinates

__all__ = ["ExpertStack", "ExpertDTensor", "expert_stack_of", "make_expert_param", "wrap_expert_tensor",
           "expert_rows", "adopt_expert_stack"]

_ATTR = "_matrixfsdp_experts"


@dataclass(frozen=True)
class ExpertStack:
    """An expert stack's layout: shard rank ``r`` of ``mesh`` holds ``counts[r]`` whole experts,
    each ``splits`` matrices along its rows, ranks' ranges in rank order.

    Example::

        info = matrixfsdp.placement.expert_stack_of(model.layers[0].mlp.experts.down_proj)
        first, stop = info.local_experts          # this rank's experts [first, stop)
    """

    counts: tuple[int, ...]
    splits: int = 1
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)

    @property
    def num_experts(self) -> int:
        return sum(self.counts)

    def experts_of(self, shard_rank: int) -> tuple[int, int]:
        """The experts ``[first, stop)`` shard rank ``shard_rank`` holds."""
        first = sum(self.counts[:shard_rank])
        return first, first + self.counts[shard_rank]

    @property
    def local_experts(self) -> tuple[int, int]:
        """This rank's experts ``[first, stop)`` (``(0, 0)`` off the mesh)."""
        if self.mesh is None:
            raise ValueError(f"matrixfsdp: expert stack {self!r} has no data-parallel mesh")
        _, s = coordinates(self.mesh)
        return (0, 0) if s is None else self.experts_of(s)


def expert_stack_of(t: Any) -> ExpertStack | None:
    """The :class:`ExpertStack` of an expert stack placed by ``fully_shard``, else ``None``."""
    return getattr(t, _ATTR, None)


def expert_rows(t: Any) -> tuple[int, ...] | None:
    """Rows per shard rank along dim 0 of an :class:`ExpertDTensor` (a parameter's counts, or its
    state's ``counts * rows per expert``), else ``None``."""
    return getattr(t, "_rows", None) if isinstance(t, ExpertDTensor) else None


class ExpertDTensor(DTensor):
    """A DTensor whose dim-0 rows are split over the shard group by explicit counts (see
    [Note: expert stack representation])."""

    _rows: tuple[int, ...]

    if not subclass_dispatch():  # torch 2.11: [Note: DTensor subclasses on torch 2.11] (_compat.py)
        __torch_function__ = classmethod(subclass_torch_function)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name == "aten::copy_" and _replicated_full(args):  # a whole value into a stack: its rows
            dst, src = args[0], args[1]
            first = dst._first_row()
            dst._local_tensor.copy_(src._local_tensor[first:first + dst._local_tensor.shape[0]])
            return dst
        # A foreach op is element-wise per list position: each position is checked (and its
        # result laid out) on its own, so stacks of different counts can share one call.
        flat = tree_flatten((args, kwargs or {}))[0]
        groups = _positions(args, kwargs) if name.startswith("aten::_foreach_") else None
        layouts = [_layout_of(name, g) for g in (groups if groups is not None else [flat])]
        mine = [a for a in flat if isinstance(a, ExpertDTensor)]
        if not _row_local(func):
            raise ValueError(
                f"matrixfsdp: {name} is not defined on an expert stack (rows {mine[0]._rows} per shard "
                "rank, not torch.chunk's): only element-wise ops, copies and sums/norms run on its local "
                "experts; take p.full_tensor() for the whole stack or p.to_local() for this rank's experts"
            )
        out = dtensor_dispatch(func, types, args, kwargs)
        ids = {id(a._local_tensor): a for a in mine}
        # the stack itself in new storage (see [Note: expert stack metadata survives torch's swaps])
        stack = expert_stack_of(mine[0]) if len(mine) == 1 and name in _SAME_STACK else None

        def rewrap(x: Any, layout: tuple[tuple[int, ...], int] | None) -> Any:
            if not isinstance(x, DTensor):
                return x
            same = ids.get(id(x._local_tensor))
            if same is not None and same._spec == x._spec:
                return same
            if layout is not None and any(pl.is_shard() for pl in x.placements):  # the inputs' rows
                new = _as_expert(x, layout[0])
                if stack is not None and tuple(x.shape) == tuple(mine[0].shape):
                    setattr(new, _ATTR, stack)
                return new
            return x  # a reduction (Partial/Replicate): no rows of its own

        if groups is not None and isinstance(out, (list, tuple)) and len(out) == len(layouts):
            return type(out)(rewrap(x, lay) for x, lay in zip(out, layouts))
        return tree_map(lambda x: rewrap(x, layouts[0]), out)

    # [Note: torch's full state-dict loaders and expert stacks] torch 2.13's loaders cut a full
    # tensor by torch.chunk rows (compute_local_shape_and_global_offset of the placements), which
    # are not a stack's rows: a copy of the wrong rows, a shape error on some ranks while the
    # others wait in the next broadcast. Read from `_distribute_tensors` alone (the
    # broadcast_from_rank0=True path; placement/_compat.py, version-gated), a stack says it is
    # replicated -- torch then slices the whole tensor -- and its `to_local()` is a sink that keeps
    # this rank's rows of it. Without broadcast_from_rank0 the loaders refuse owned tensors anyway
    # ([Note: torch's full state-dict loaders and owned tensors]); a replicated whole value copied
    # into a stack (`copy_`) is read by rows (see __torch_dispatch__).
    @property
    def placements(self) -> tuple[Any, ...]:  # type: ignore[override]
        if called_from("_distribute_tensors"):
            return tuple(Replicate() for _ in self._spec.placements)
        return self._spec.placements

    def to_local(self, *, grad_placements: Any = None) -> torch.Tensor:  # type: ignore[override]
        if called_from("_distribute_tensors"):
            first, n = self._first_row(), self._local_tensor.shape[0]
            return _RowSink(self._local_tensor, first, n)  # type: ignore[return-value]
        return super().to_local(grad_placements=grad_placements)

    def _first_row(self) -> int:
        _, s = coordinates(self._spec.mesh)
        return sum(self._rows[:s]) if s is not None else 0

    def _shard_group(self) -> Any:
        mesh = self._spec.mesh
        return mesh.get_group(mesh.ndim - 1)

    def full_tensor(self, *, grad_placements: Any = None) -> torch.Tensor:  # type: ignore[override]
        """The whole stack on every rank (one in-place all-gather of rows over the shard group)."""
        from ..comm.collectives import collectives_for

        local = self._local_tensor.detach()
        row = int(torch.Size(self.shape[1:]).numel())
        out = torch.empty(tuple(self.shape), dtype=local.dtype, device=local.device)
        first = self._first_row()
        out[first:first + local.shape[0]].copy_(local)
        splits = [n * row for n in self._rows]
        collectives_for(self._shard_group()).all_gather_inplace(out.view(-1), splits, async_op=False).wait()
        return out

    def redistribute(self, device_mesh: DeviceMesh | None = None, placements: Any = None,
                     *, async_op: bool = False, forward_dtype: Any = None,
                     backward_dtype: Any = None) -> DTensor:  # type: ignore[override]
        """To ``[Replicate()]`` on its mesh (every rank gets the whole stack); anything else raises."""
        mesh = self.device_mesh if device_mesh is None else device_mesh
        placements = tuple(placements) if placements is not None else tuple(self.placements)
        if mesh == self.device_mesh and all(pl.is_replicate() for pl in placements) and len(placements) == mesh.ndim:
            full = self.full_tensor()
            return DTensor.from_local(full, mesh, placements, run_check=False, shape=self.shape, stride=full.stride())
        raise ValueError(
            f"matrixfsdp: an expert stack (rows {self._rows} per shard rank) can be redistributed to "
            f"[Replicate()] on its own mesh; got mesh {mesh} and placements {placements}; take "
            "p.full_tensor() and distribute that"
        )

    # ---- torch.distributed.checkpoint (see [Note: expert stack representation])
    def _chunk(self) -> tuple[torch.Size, torch.Size]:
        """This rank's rows as DCP's chunk: ``(sizes, offsets)``."""
        n = self._local_tensor.shape[0]
        return torch.Size((n, *self.shape[1:])), torch.Size((self._first_row(), *([0] * (self.ndim - 1))))

    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        r, _ = coordinates(self._spec.mesh)
        sizes, offsets = self._chunk()
        if r not in (0, None) or sizes[0] == 0:
            return []  # HSDP: replica 0 writes; a rank without experts has nothing to write
        return [WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=TensorProperties.create_from_tensor(self._local_tensor),
                size=self.size(),
            ),
        )]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        sizes, offsets = self._chunk()
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self._local_tensor


# [Note: expert stack metadata survives torch's swaps]
# torch's ``nn.Module.to_empty`` / ``.to()`` / ``_apply`` replace a DTensor parameter by
# ``torch.utils.swap_tensors(param, nn.Parameter(fn(param)))``: the parameter object then holds
# the attributes of the tensor dispatch built (``empty_like``/``_to_copy``, then ``detach``). The
# row layout (``_rows``) is re-attached to every same-layout output anyway; the
# :class:`ExpertStack` (what routes a parameter to the matrix rule, ``expert_stack_of``) is
# re-attached only to these ops' outputs -- the same stack, or a copy of it in new storage -- so
# a stack outside ``fully_shard``'s care (torchtitan's expert-parallel stacks re-described by
# :func:`adopt_expert_stack`, which the Trainer's ``model.to_empty`` swaps) keeps it, while
# optimizer state (``zeros_like``) and results of arithmetic never claim to be a stack.
_SAME_STACK = frozenset({"aten::empty_like", "aten::_to_copy", "aten::clone", "aten::detach", "aten::alias"})

_ROW_LOCAL = frozenset({
    "aten::detach", "aten::alias", "aten::clone", "aten::copy_", "aten::_to_copy", "aten::zeros_like",
    "aten::empty_like", "aten::ones_like", "aten::full_like", "aten::zero_", "aten::fill_",
    "aten::linalg_vector_norm", "aten::norm", "aten::sum", "aten::lerp_", "aten::lerp", "aten::addcmul_",
    "aten::addcdiv_", "aten::addcmul", "aten::addcdiv", "aten::_local_scalar_dense", "aten::equal",
})


def _row_local(func: Any) -> bool:
    """Whether ``func`` on DTensors of one row layout is computed on local rows alone (what
    DTensor's chunk rule would otherwise re-lay out): element-wise, copies, sums and norms."""
    name = func._schema.name
    return (torch.Tag.pointwise in func.tags or name.startswith("aten::_foreach_") or name in _ROW_LOCAL)


def _replicated_full(args: Any) -> bool:
    """``copy_(stack, src)`` with ``src`` the whole value, replicated (a state dict's full tensor
    distributed by torch's loader, or a user's ``distribute_tensor(full, mesh, [Replicate()])``)."""
    return (len(args) >= 2 and isinstance(args[0], ExpertDTensor) and isinstance(args[1], DTensor)
            and not isinstance(args[1], ExpertDTensor) and all(pl.is_replicate() for pl in args[1]._spec.placements)
            and tuple(args[1].shape) == tuple(args[0].shape))


class _RowSink(torch.Tensor):
    """What an expert stack's ``to_local()`` gives torch's ``_distribute_tensors``: ``copy_(full)``
    writes this rank's rows of ``full`` into the stack's local tensor (see [Note: torch's full
    state-dict loaders and expert stacks])."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, first: int, n: int) -> "_RowSink":
        out = torch.Tensor._make_subclass(cls, local.new_empty(0), False)
        out._target, out._first, out._n = local, first, n
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and isinstance(args[0], _RowSink):
            sink, src = args[0], args[1]
            sink._target.copy_(src[sink._first:sink._first + sink._n])
            return sink
        raise ValueError(f"matrixfsdp: an expert stack's row sink takes copy_ of the whole tensor only, got {func}")


def _positions(args: Any, kwargs: Any) -> list[list[Any]]:
    """The operands of a foreach op at each list position (scalars and lone tensors join every one)."""
    operands = list(args) + list((kwargs or {}).values())
    lists = [a for a in operands if isinstance(a, (list, tuple))]
    n = max((len(a) for a in lists), default=0)
    shared = [a for a in operands if not isinstance(a, (list, tuple))]
    return [[a[i] for a in lists if i < len(a)] + shared for i in range(n)]


def _layout_of(name: str, operands: list[Any]) -> tuple[tuple[int, ...], int] | None:
    """The one row layout ``(rows, dim-0 size)`` of the expert stacks among ``operands`` (one
    element-wise application), or ``None`` without any; any other row-sharded DTensor raises (a
    0-dim or replicated one, a broadcast scalar, is fine)."""
    dts = [a for a in operands if isinstance(a, DTensor)]
    experts = [a for a in dts if isinstance(a, ExpertDTensor)]
    if not experts:
        return None
    layout = (experts[0]._rows, experts[0].shape[0])
    for a in dts:
        if not any(pl.is_shard() for pl in a.placements):
            continue
        if expert_rows(a) != layout[0] or a.shape[0] != layout[1]:
            raise ValueError(
                f"matrixfsdp: {name} mixes an expert stack (rows {layout[0]} per shard rank) with a DTensor "
                f"of another row layout ({expert_rows(a) or tuple(a.placements)}); expert stacks support "
                "element-wise ops with tensors of their own layout (their gradients, optimizer state) and "
                "scalars; for anything else take p.full_tensor() or p.to_local()"
            )
    return layout


def _as_expert(x: DTensor, rows: tuple[int, ...]) -> ExpertDTensor:
    out = ExpertDTensor(x._local_tensor, x._spec, requires_grad=x.requires_grad)
    out._rows = rows
    return out


def wrap_expert_tensor(local: torch.Tensor, mesh: DeviceMesh, rows: tuple[int, ...], shape: tuple[int, ...],
                       *, requires_grad: bool = False) -> ExpertDTensor:
    """An :class:`ExpertDTensor` of global ``shape`` around ``local`` (this shard rank's rows of
    ``rows``), no copy, no dispatch."""
    placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, placements, TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    out = ExpertDTensor(local, spec, requires_grad=requires_grad)
    out._rows = tuple(rows)
    return out


def make_expert_param(local: torch.Tensor, *, shape: tuple[int, ...], mesh: DeviceMesh, counts: tuple[int, ...],
                      splits: int, requires_grad: bool) -> torch.Tensor:
    """The sharded parameter of an expert stack around ``local`` (used as is)."""
    dt = wrap_expert_tensor(local.detach(), mesh, counts, shape, requires_grad=requires_grad)
    dt._is_param = True  # isinstance(dt, nn.Parameter), as nn.Parameter(dt) would make it
    setattr(dt, _ATTR, ExpertStack(counts=tuple(counts), splits=splits, mesh=mesh))
    return dt


def adopt_expert_stack(model: torch.nn.Module, fqn: str, p: DTensor, counts: tuple[int, ...], splits: int) -> torch.Tensor:
    """Register, in place of ``model``'s parameter ``fqn`` (``p``: a stack already sharded by whole
    experts, ``Shard(0)`` on a 1-D mesh, as torchtitan's expert parallelism leaves it), the
    expert stack parameter over the same local rows, so optimizers, clipping and checkpoints see
    the plan's layout (``counts``: ``p``'s rows per rank, checked here)."""
    _, s = coordinates(p.device_mesh)
    local = p._local_tensor
    if s is None or p.device_mesh.ndim != 1 or len(counts) != p.device_mesh.size() or local.shape[0] != counts[s]:
        raise ValueError(
            f"matrixfsdp: expert stack {fqn!r} holds {local.shape[0]} experts on this rank of its mesh "
            f"{tuple(p.device_mesh.shape)}, but the plan gives it {counts} per rank; plan the model after "
            "distributing its experts (plan_owners records their layout)"
        )
    new = make_expert_param(local, shape=tuple(p.shape), mesh=p.device_mesh, counts=counts, splits=splits,
                            requires_grad=p.requires_grad)
    mod_path, _, attr = fqn.rpartition(".")
    model.get_submodule(mod_path)._parameters[attr] = new  # type: ignore[assignment]
    return new
