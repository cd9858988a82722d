"""``matrixfsdp.tp.host_matrices``: give every TP-sharded matrix a host rank and a micro-group."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..comm.collectives import CommCounter
from ..placement.tp_host import tp_host_of
from ..planner.rules import default_matrix_filter
from .attach import attach_hosts, row_hosts

__all__ = ["host_matrices", "set_pipeline", "comm_counter"]

API = "matrixfsdp.tp.host_matrices"


def _tp_mesh(mesh: Any) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{API}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        raise ValueError(f"{API}: a {mesh.ndim}-D mesh needs a dimension named 'tp', got names {names}; "
                         "pass the tp mesh itself (mesh['tp'])")
    return mesh["tp"]


def host_matrices(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    groups: Sequence[Sequence[tuple[str, int]]] | None = None,
    c_max: int | None = None,
    optimizer: str = "muon",
    precondition_frequency: int = 10,
    matrix_filter: Callable[[str, torch.Tensor, nn.Module, frozenset[int]], bool] | None = None,
    pipeline: bool = True,
) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Give each TP-sharded matrix of ``model`` (a 2D ``Shard(0)``/``Shard(1)`` DTensor on the TP
    mesh, as ``parallelize_module``'s ``ColwiseParallel``/``RowwiseParallel`` make them, that
    ``matrix_filter`` selects) a host TP rank and a micro-group; a ``matrixfsdp.optim``
    optimizer then steps them whole on their hosts (see [Note: TP hosts]). Call on every TP rank,
    after ``parallelize_module`` and before building the optimizer.

    ``groups`` (``[[(fqn, host), ...], ...]``) gives the micro-groups and hosts; by default the
    planner's :func:`~matrixfsdp.planner.micro_groups.plan_micro_groups` packs them by optimizer
    cost (``optimizer``, ``precondition_frequency``) into fused buffers of at most ``c_max`` bytes.
    Returns the groups used. No collective. ``pipeline=False`` runs the micro-groups one after
    another (no overlap of group k+1's gather with group k's step; the same result bitwise).

    Example::

        tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for b in model.blocks:
            parallelize_module(b, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        matrixfsdp.tp.host_matrices(model, tp)
        opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"{API}: model must be an nn.Module, got {type(model).__name__}")
    tp = _tp_mesh(mesh)
    filt = matrix_filter or default_matrix_filter
    head_rows = frozenset(m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding))
    found: dict[str, Any] = {}
    for mod_name, mod in model.named_modules():
        for attr, p in mod.named_parameters(recurse=False):
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            if not (isinstance(p, DTensor) and p.ndim == 2 and p.requires_grad):
                continue
            if p.device_mesh != tp or len(p.placements) != 1 or not isinstance(p.placements[0], Shard):
                continue
            if tp_host_of(p) is not None:
                raise ValueError(f"{API}: {fqn!r} already has a TP host; call host_matrices once per model")
            if filt(fqn, p, mod, head_rows) and id(p) not in {id(q) for q in found.values()}:
                found[fqn] = p
    if groups is None:
        from ..planner.cost import ParamInfo, resolve_cost
        from ..planner.micro_groups import plan_micro_groups

        _, cost_fn = resolve_cost("flops", optimizer, precondition_frequency)
        rows = []
        for fqn, p in found.items():
            dt = str(p.dtype).removeprefix("torch.")
            info = ParamInfo(fqn=fqn, shape=tuple(p.shape), dtype=dt, itemsize=p.element_size(),
                             is_matrix=True, requires_grad=True)
            rows.append((fqn, tuple(p.shape), cost_fn(info), math.prod(p.shape) * p.element_size()))
        groups = [g.members for g in plan_micro_groups(rows, tp.size(), c_max=c_max)]
    groups = tuple(tuple((str(f), int(h)) for f, h in g) for g in groups)
    seen = [f for g in groups for f, _ in g]
    if sorted(seen) != sorted(found) or len(set(seen)) != len(seen):
        missing = sorted(set(found) - set(seen))[:3]
        extra = sorted(set(seen) - set(found))[:3]
        raise ValueError(f"{API}: groups must name every TP-sharded matrix exactly once; missing "
                         f"{missing}, unknown or repeated {extra or [f for f in seen if seen.count(f) > 1][:3]}")
    bad = [(f, h) for g in groups for f, h in g if not 0 <= h < tp.size()]
    if bad:
        raise ValueError(f"{API}: host ranks must be in [0, {tp.size()}), got {bad[:3]}")
    # fully_shard + TP's attach on a (1, T) mesh: one owner row, the TP group itself
    rows = [[(k, [(f, found[f], h) for f, h in g]) for k, g in enumerate(groups)]]
    attach_hosts(tp, rows, 0, row_hosts([tp.mesh.flatten().tolist()], tp), pipeline=pipeline)
    return groups


def set_pipeline(model: nn.Module, enabled: bool) -> int:
    """Pipeline the micro-groups of every TP host step of ``model`` (``True``, the default: group
    k+1's gather overlaps group k's step) or run them one after another (``False``; the same
    result bitwise). Works for both ways of hosting: ``host_matrices`` (dp=1) and
    ``fully_shard`` over TP parameters. Returns how many executors were set (0: nothing is
    hosted on this rank). Local; call on every rank alike.

    Example::

        matrixfsdp.tp.set_pipeline(model, False)   # Canzona's sequential micro-groups
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"matrixfsdp.tp.set_pipeline: enabled must be a bool, got {type(enabled).__name__}")
    executors = {id(e): e for p in model.parameters()
                 if (h := tp_host_of(p)) is not None and (e := h.executor) is not None}
    for e in executors.values():
        e.pipeline = enabled
    return len(executors)


def comm_counter(model: nn.Module) -> CommCounter:
    """The call/byte counter of the collectives this rank's TP host step makes for ``model``
    (comm/'s :class:`~matrixfsdp.comm.collectives.CommCounter`; ``"all_to_all_single"``: two per
    micro-group and step, within the TP row that steps them). Works for both ways of hosting. A
    rank whose TP row steps none of ``model``'s matrices (under fully_shard: a row that owns none)
    makes none; it gets a counter of its own, which stays empty. Local.

    Example::

        c = matrixfsdp.tp.comm_counter(model); c.reset()
        opt.step(); print(c.calls["all_to_all_single"], c.bytes_sent["all_to_all_single"])
    """
    hosts = [h for p in model.parameters() if (h := tp_host_of(p)) is not None]
    if not hosts:
        raise ValueError("matrixfsdp.tp.comm_counter: the model has no TP-hosted matrix (host_matrices, or "
                         "fully_shard over TP-sharded parameters with tp > 1)")
    executors = {id(h.executor): h.executor for h in hosts if h.executor is not None}
    if len(executors) > 1:
        raise ValueError(f"matrixfsdp.tp.comm_counter: the model's matrices are hosted by {len(executors)} "
                         "executors (host_matrices called on parts of it); read each one's .counter "
                         "(matrixfsdp.tp.tp_host_of(p).executor.counter)")
    return next(iter(executors.values())).counter if executors else CommCounter()
