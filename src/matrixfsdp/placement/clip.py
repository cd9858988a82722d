"""Gradient clipping for owner-placed parameters.

``torch.nn.utils.clip_grad_norm_`` cannot be used on a matrixfsdp model: owned gradients live on
one-rank owner meshes, and DTensor refuses to combine tensors of different meshes; under
``matrixfsdp.replicate`` each gradient exists on its owner only. Every element
of every gradient lives on exactly one rank (owned: the owner; even: its row shard), so the global
norm is one all-reduce of the ranks' local partial sums.

[Note: clip device and group]
Every rank must enter the same all-reduce, over the same group, with a tensor on a device that
group's backend serves. Both are therefore taken from the *parameters'* data-parallel mesh, which
every rank shares, never from the gradients: under ``replicate`` a rank that owns nothing has no
gradient at all, and a CPU scalar (the old fallback) handed to an NCCL group raises on that rank
while the others hang in the all-reduce.

On an HSDP mesh the all-reduce spans every data-parallel rank (the flattened mesh), and each
gradient element counts once: a ``split`` gradient on its step replica (the only one holding
it), every other sharded gradient (identical in every replica) on replica 0.

Under ``fully_shard`` + TP (a ``("dp_shard", "tp")`` mesh) it spans the whole 2-D mesh: a
TP-sharded gradient counts on every rank of its owner's TP row (each holds a different shard),
every other gradient (identical in every TP column) on TP rank 0.

Under pipeline parallelism (``pp_mesh``) each stage holds other parameters: the stage's partial
sum (its own data-parallel all-reduce, as above) is summed once more over the pipeline mesh, the
ranks at the same data-parallel coordinate of every stage (for the max norm: the maximum).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..comm.agree import agreement_device
from ..mesh import flat_dp_mesh, mesh_device
from .owned_tensor import local_tensor
from .owner import coordinates, dp_tp_mesh, owner_of, tp_mesh_of

__all__ = ["clip_grad_norm_", "reduction_device_and_group", "data_parallel_device_and_group"]


def reduction_device_and_group(params: Iterable[torch.Tensor], process_group: dist.ProcessGroup | None = None
                               ) -> tuple[torch.device, dist.ProcessGroup | None]:
    """The device and group of the norm's all-reduce, from the parameters (with or without a
    gradient; see [Note: clip device and group]): the first data-parallel mesh among them gives
    both (its group unless ``process_group`` is given); without one, a plain parameter's device,
    else a device the group's backend serves."""
    mesh = None
    plain = None
    for p in params:
        info = owner_of(p)
        m = info.mesh if info is not None else getattr(p, "device_mesh", None)
        if m is not None:
            if mesh is None or (mesh.size() == 1 and m.size() > 1):
                mesh = m
        elif plain is None:
            plain = p.device
    group = process_group
    if group is None and mesh is not None and mesh.size() > 1:
        group = flat_dp_mesh(mesh).get_group()
    if mesh is not None:
        return mesh_device(mesh), group
    if plain is not None:
        return plain, group
    if dist.is_available() and dist.is_initialized():
        return agreement_device(group), group
    return torch.device("cpu"), group


def data_parallel_device_and_group(params: Iterable[torch.Tensor], process_group: dist.ProcessGroup | None = None
                                   ) -> tuple[torch.device, dist.ProcessGroup | None]:
    """The device and group of a reduction over every rank that may hold a different part of
    ``params``' values or see different data: :func:`reduction_device_and_group`, widened under
    ``fully_shard`` + TP to the whole ``(dp, tp)`` mesh (each TP rank of an owner's row holds
    another TP shard). ``clip_grad_norm_``'s norm and QK-clip's max logits (``matrixfsdp.qk_clip``)
    reduce over it. An explicit ``process_group`` is taken as it is."""
    every = list(params)
    device, group = reduction_device_and_group(every, process_group)
    tp = _tp_mesh(every)
    if tp is not None and process_group is None:  # fully_shard + TP: over the whole (dp, tp) mesh
        group = flat_dp_mesh(dp_tp_mesh(_dp_of(every), tp)).get_group()
    return device, group


def _tp_mesh(params: list[torch.Tensor]) -> DeviceMesh | None:
    """This rank's TP mesh when ``params`` hold TP-sharded owned parameters (fully_shard + TP)."""
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        tp = tp_mesh_of(mesh) if mesh is not None else None
        if tp is not None and tp.size() > 1:
            return tp
    return None


def _dp_of(params: list[torch.Tensor]) -> DeviceMesh:
    return next(info.mesh for p in params if (info := owner_of(p)) is not None and info.mesh is not None)


def _tp_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is owned with a ``Shard`` placement on its owner's TP row (each TP rank holds
    a different part of its gradient)."""
    mesh = getattr(p, "device_mesh", None)
    return mesh is not None and tp_mesh_of(mesh) is not None and any(pl.is_shard() for pl in p.placements)


def _replica_copy(p: torch.Tensor) -> bool:
    """Whether ``p``'s gradient here is an HSDP replica's copy of one counted on replica 0."""
    info = owner_of(p)
    if info is not None:
        if info.step_replica is not None or info.mesh is None or info.mesh.ndim == 1:
            return False
        return coordinates(info.mesh)[0] != 0
    mesh = getattr(p, "device_mesh", None)
    if mesh is None or mesh.ndim != 2:
        return False
    c = mesh.get_coordinate()
    return c is not None and c[0] != 0


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    process_group: dist.ProcessGroup | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip the gradients of a matrixfsdp model to a global norm of ``max_norm``, in place.

    Same semantics as ``torch.nn.utils.clip_grad_norm_`` (scale by ``max_norm / (norm + 1e-6)``
    when that is < 1; returns the total norm, a plain tensor, identical on every rank;
    ``error_if_nonfinite`` raises before touching any gradient). Call on every rank. One
    all-reduce of a scalar over ``process_group`` (default: the data-parallel mesh's group, taken
    from the parameters; the default group otherwise). Gradients that are plain tensors (e.g. of
    ``ignored_params``) are taken as replicated and counted once. ``pp_mesh``: the pipeline
    mesh (torchtitan's ``parallel_dims.get_mesh("pp")``) when ``parameters`` are this rank's
    stages' only; one more all-reduce over it combines the stages.

    Example::

        loss.backward()
        matrixfsdp.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    every = list(parameters)
    params = [p for p in every if p.grad is not None]
    max_norm, norm_type = float(max_norm), float(norm_type)
    if max_norm < 0 or math.isnan(max_norm):
        raise ValueError(f"matrixfsdp.clip_grad_norm_: max_norm must be >= 0, got {max_norm=}")
    if norm_type <= 0 or math.isnan(norm_type):
        raise ValueError(f"matrixfsdp.clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type=}")
    if pp_mesh is not None and (not isinstance(pp_mesh, DeviceMesh) or pp_mesh.ndim != 1):
        raise TypeError(f"matrixfsdp.clip_grad_norm_: pp_mesh must be a 1-D DeviceMesh (the pipeline "
                        f"dimension), got {pp_mesh!r}")
    device, group = data_parallel_device_and_group(every, process_group)
    tp = _tp_mesh(every)
    grads = [local_tensor(p.grad).detach() for p in params]
    inf = math.isinf(norm_type)
    distributed = dist.is_available() and dist.is_initialized()
    # a replicated (plain) gradient is summed on one rank only; for the max norm it does not matter
    first = not distributed or inf or dist.get_rank(group) == 0
    counted: list[torch.Tensor] = []
    for p, g in zip(params, grads):
        # owned gradients (DTensor, or replicate's: only the owner has one) count on their rank
        sharded = isinstance(p.grad, DTensor) or owner_of(p) is not None
        if g.numel() == 0 or (not sharded and not first) or (sharded and not inf and _replica_copy(p)):
            continue
        if tp is not None and not inf and tp.get_local_rank() != 0 and not _tp_sharded(p):
            continue  # the same in every TP column: counted on TP rank 0
        counted.append(g)
    local = _local_norm_term(counted, norm_type, device)
    if dist.is_available() and dist.is_initialized():
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
        dist.all_reduce(local, op=op, group=group)
        if pp_mesh is not None and pp_mesh.size() > 1:  # the stages hold disjoint parameters
            dist.all_reduce(local, op=op, group=pp_mesh.get_group())
    total = local if inf else local.pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"matrixfsdp.clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
            "non-finite, so it cannot be clipped (error_if_nonfinite=True); gradients are unchanged"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (dev, dtype), gs in _by_device_and_dtype(g for g in grads if g.numel()).items():
        # the coefficient rounded to the gradients' dtype first, as g.mul_(coef.to(dtype)) did
        torch._foreach_mul_(gs, coef.to(device=dev, dtype=dtype))
    return total


def _by_device_and_dtype(tensors: Iterable[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """Foreach ops take one device and dtype per call (torch's clip_grad_norm_ groups the same)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _local_norm_term(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's float32 term of the global norm: the max of ``|g|`` (``inf``), else the sum of
    ``norm(g) ** norm_type``. ``torch._foreach_norm`` per device and dtype, accumulating in float32
    (``dtype=``) without a float32 copy of a low-precision gradient where the backend fuses it
    (CUDA's multi-tensor kernel; torch's CPU fallback casts per tensor inside the kernel). Against
    the earlier ``sum(g.float().abs() ** p)``: the max norm is bitwise the same; a p-norm rounds
    each tensor's root once more (a few float32 ulps of the total, as torch's clip_grad_norm_,
    which takes the norm of the per-tensor norms)."""
    local = torch.zeros((), dtype=torch.float32, device=device)
    inf = math.isinf(norm_type)
    for gs in _by_device_and_dtype(grads).values():
        if inf:
            norms = torch._foreach_norm(gs, norm_type)  # exact in any dtype
            local = torch.maximum(local, torch.stack(norms).max().to(device=device, dtype=torch.float32))
        else:
            norms = torch._foreach_norm(gs, norm_type, dtype=torch.float32)
            local = local + torch.stack(norms).pow(norm_type).sum().to(device)
    return local
