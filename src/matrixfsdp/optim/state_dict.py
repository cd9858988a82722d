"""Optimizer state in state-dict form: local state tensors <-> DTensors with the parameter's layout.

[Note: optimizer state in state dicts]
The matrix optimizers keep the state of a DTensor parameter as *plain local tensors* (``step()``
never touches a DTensor). DCP can only reshard what it can place in the
global tensor, so ``MatrixOptimizer.state_dict()`` presents every state tensor of a DTensor
parameter as a DTensor (:func:`present_state`), and ``load_state_dict`` accepts those DTensors
(or plain local tensors, as before) and keeps their local tensors (:func:`accept_state`):

* **owned parameter** (``matrixfsdp.owned_of(p)`` is set): every non-scalar state tensor
  (momentum, Adam moments, Shampoo/SOAP factors ``L``/``R``, roots, eigenbases ``QL``/``QR``)
  and its 0-dim ``step`` counter become ``[Replicate()]`` (owned) DTensors on the parameter's
  one-rank owner mesh, with the state tensor's own shape. Only the owner has the data; once it
  has state, every other rank presents the same keys as empty owned DTensors (shapes from the
  optimizer's state initializer run on a ``meta`` tensor), so all ranks hold the same keys (DCP's
  full state dict gathers them key by key) and DCP writes each one once, as one full chunk, from
  the owner;
* **evenly sharded (``Shard(0)``) or any other DTensor parameter** (also stock FSDP2's, and a
  hosted matrix whose state stays on the shards, ``opt.state_on_shards(p)``): a state
  tensor with the local shard's shape becomes a DTensor with the parameter's mesh, placements and
  global shape; DCP writes each rank's rows;
* a parameter whose local tensor is empty (an owned one on a non-owner) gets an empty state
  entry, so ``set_optimizer_state_dict(strict=True)`` finds nothing missing;
* scalars of evenly sharded parameters (the 0-dim ``step`` counters) stay plain tensors: every
  rank with a non-empty shard has the same value and DCP's de-duplication writes it once;
* **expert stack** (``expert_rows(p)`` is set, [Note: expert stack representation] in
  ``placement/experts.py``): the state of this rank's ``n`` experts has ``n * f`` rows (``f =
  splits`` per-matrix rows per expert under the matrix rule, [Note: expert optimizer state] in
  ``optim/_expert_step.py``; ``f = 1`` for element-wise state) and becomes an ``ExpertDTensor`` of
  global shape ``[E * f, ...]`` whose rows per shard rank are ``counts * f``: DCP writes each
  rank's rows at the offset of its first expert and reads them back into any other expert
  assignment (other counts, a plain stack in one process). A rank holding none of the stack's
  experts keeps no state for it; once the stack has a gradient it presents the same keys as
  zero-row ``ExpertDTensor``s (shapes from the optimizer's state schema), as non-owners do for
  owned parameters. Loading takes ``ExpertDTensor``s of the stack's rows or plain tensors of the
  local stacked shape; a state of another layout (another expert count or ``splits``) is refused
  naming the shapes.

The DTensors alias the live state tensors (no copy): ``dcp.save`` reads them, ``dcp.load`` writes
into them in place. Loading then reshards like any FSDP2 state: the saved chunk(s) of a tensor are
read into whatever layout the *loading* optimizer presents (a new owner, ``Shard(0)`` rows, or a
plain tensor in a single process), so optimizer state follows its parameter.

State whose *keys* depend on history would not survive that template-driven load (DCP only loads
keys the loading side presents): Shampoo's inverse roots appear only once preconditioning starts.
``_state_placeholders`` (the rule class's ``state_placeholders``, ``{key: key it accompanies}``)
makes ``state_dict()`` present such keys as zeros when absent, and ``load_state_dict`` drops them
again when they are still all zero (a real inverse root is positive definite, never zero).

The optimizers' ``state_dict``/``load_state_dict`` are :func:`optimizer_state_dict` and
:func:`load_optimizer_state_dict` here: each param group records the rule of each of its
parameters (``"routes"``), checked at load.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..placement.experts import expert_rows, wrap_expert_tensor
from ..placement.owned_tensor import empty_local, local_tensor, owned_of, wrap_dtensor
from ..placement.owner import owner_of, tp_mesh_of
from ..placement.stepping import stepping_of
from .routing import routes
from .rules.base import wide_dtype
from .step_modes import sync_host_steps

if TYPE_CHECKING:
    from ._base import MatrixOptimizer

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["present_state", "accept_state", "optimizer_state_dict", "load_optimizer_state_dict", "state_schema",
           "note_remote"]


def _replicated(p: Tensor) -> Any:
    """The owner descriptor of a ``matrixfsdp.replicate`` parameter (whole on every rank)."""
    info = owner_of(p)
    return info if info is not None and info.storage == "replicated" else None


def _as_dtensor(opt_name: str, key: str, p: Tensor, value: Any, host_mesh: Any) -> Any:
    """``value`` (a local state tensor of DTensor parameter ``p``) as a DTensor; see the Note.
    ``host_mesh``: where its TP host presents a hosted matrix's whole state (``None``: not
    hosted, or hosted with its state on the shards, presented like an even parameter's)."""
    if not isinstance(value, Tensor) or isinstance(value, DTensor):
        return value
    info = owned_of(p)
    if host_mesh is not None:  # whole on its TP host (placement/tp_host.py)
        # counters too: every other rank presents the same keys on the host's mesh (_remote_entry),
        # so a full state dict gathers each from the host alone
        return wrap_dtensor(value, host_mesh, (Replicate(),), tuple(value.shape))
    counts = expert_rows(p)
    if counts is not None and value.ndim > 0:
        return _expert_state(opt_name, key, p, counts, value)
    if value.ndim == 0 and info is None:
        return value  # an even parameter's step counter: the same on every rank with a shard
    if info is not None:
        if info.mesh is None:  # pragma: no cover - make_sharded_param always sets it
            raise RuntimeError(f"{opt_name}.state_dict: owned parameter without a mesh ({key})")
        mesh, placements, shape = info.owner_mesh, (Replicate(),), tuple(value.shape)
        if tp_mesh_of(p.device_mesh) is not None and tuple(value.shape) == tuple(local_tensor(p).shape):
            # a TP-sharded owned tensor's element-wise state: sharded like the parameter
            mesh, placements, shape = p.device_mesh, tuple(p.placements), tuple(p.shape)  # type: ignore[attr-defined]
    else:
        local = local_tensor(p)
        if tuple(value.shape) != tuple(local.shape):
            raise RuntimeError(
                f"{opt_name}.state_dict: state {key!r} of a DTensor parameter with placements "
                f"{p.placements} has shape {tuple(value.shape)}, not the local shard's shape "  # type: ignore[attr-defined]
                f"{tuple(local.shape)}; only owned (whole-matrix) parameters may carry state of "
                "another shape"
            )
        mesh, placements, shape = p.device_mesh, tuple(p.placements), tuple(p.shape)  # type: ignore[attr-defined]
    return wrap_dtensor(value, mesh, placements, shape)


def _expert_state(opt_name: str, key: str, p: Tensor, counts: tuple[int, ...], value: Tensor) -> Any:
    """State ``value`` of this rank's experts of stack ``p`` as an ExpertDTensor (see the Note)."""
    n = local_tensor(p).shape[0]
    f = value.shape[0] // n if n else 0
    if f == 0 or value.shape[0] != n * f:  # pragma: no cover - the optimizer stacks state per expert
        raise RuntimeError(
            f"{opt_name}.state_dict: state {key!r} of an expert stack with {n} local experts has shape "
            f"{tuple(value.shape)}, not a whole number of rows per expert"
        )
    return wrap_expert_tensor(value, p.device_mesh, tuple(c * f for c in counts),  # type: ignore[attr-defined]
                              (sum(counts) * f, *value.shape[1:]))


def _param_list(opt: torch.optim.Optimizer) -> list[Tensor]:
    return list(chain.from_iterable(g["params"] for g in opt.param_groups))


def present_state(opt: "MatrixOptimizer", sd: dict[str, Any]) -> dict[str, Any]:
    """Turn ``Optimizer.state_dict()``'s local state of DTensor parameters into DTensors.

    Returns a new ``"state"`` mapping (the live per-parameter dicts are never mutated).
    """
    name = type(opt).__name__
    params = _param_list(opt)
    placeholders = getattr(opt, "_state_placeholders", {})
    state: dict[Any, Any] = {}
    for idx, st in sd["state"].items():
        p = params[idx]
        st = dict(st)
        for key, dep in placeholders.items():
            if key not in st and isinstance(st.get(dep), Tensor):
                st[key] = torch.zeros_like(st[dep])
        if DTensor is not None and isinstance(p, DTensor):
            host_mesh = opt._stepping(p).host_mesh
            st = {k: _as_dtensor(name, f"state[{idx}][{k!r}]", p, v, host_mesh) for k, v in st.items()}
        state[idx] = st
    # A DTensor parameter whose local tensor is empty (an owned parameter on a non-owner, an
    # empty even shard), an owned one held outside its HSDP split step replica, or one never
    # stepped has no state here. Once its owner has state, such a rank presents the
    # same keys, as empty owned DTensors of the owner's global shapes (the optimizer's own state
    # initializer run on a meta tensor): every rank then holds the same keys, which DCP's full
    # state dict gathers key by key. Otherwise an explicit empty entry (on every rank alike) tells
    # set_optimizer_state_dict(strict=True) that nothing is missing.
    remote = opt._remote_state
    for idx, p in enumerate(params):
        replica = _replicated(p)
        if replica is not None:
            if p.requires_grad:
                state[idx] = _replica_entry(opt, p, replica, state.get(idx))
            continue
        if idx not in state and DTensor is not None and isinstance(p, DTensor) and p.requires_grad:
            info = owned_of(p)
            st = opt._stepping(p)
            # a TP-hosted matrix: the ranks of its TP group other than the host (and, under
            # fully_shard + TP, every other row) present the host's keys
            hosted_elsewhere = st.host_mesh is not None and not st.keeps_state
            no_rows = local_tensor(p).numel() == 0
            counts = expert_rows(p)
            if counts is not None:  # a stack with none of its experts here
                state[idx] = _expert_remote_entry(opt, p, counts) if id(p) in remote and no_rows else {}
                continue
            # an owned one on a non-owner, or (HSDP split) on an owner outside its step replica
            elsewhere = info is not None and (no_rows or not st.keeps_state)
            remote_entry = id(p) in remote and (hosted_elsewhere or elsewhere)
            state[idx] = _remote_entry(opt, p, info) if remote_entry else {}
    return {**sd, "state": dict(sorted(state.items()))}


def _remote_entry(opt: "MatrixOptimizer", p: Tensor, info: Any) -> dict[str, Any]:
    """The keys and global shapes of the owner's state of ``p``, as empty owned DTensors."""
    schema = _schema(opt, p)
    host_mesh = opt._stepping(p).host_mesh
    mesh = host_mesh if host_mesh is not None else info.owner_mesh
    local = local_tensor(p)
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if isinstance(v, Tensor):
            shape = tuple(v.shape)
            v = wrap_dtensor(empty_local(shape, v.dtype, local.device), mesh, (Replicate(),), shape)
        out[k] = v
    return out


def _expert_remote_entry(opt: "MatrixOptimizer", p: Tensor, counts: tuple[int, ...]) -> dict[str, Any]:
    """The keys of the state the ranks holding experts of stack ``p`` keep, as zero-row
    ExpertDTensors of the global shapes (the schema runs on ``meta`` with ``p``'s global shape,
    so its rows are already ``E * f``). 0-dim values (an AdamW-routed stack's step counter) stay
    out, as an empty even shard keeps none: DCP de-duplicates plain values across ranks and might
    otherwise write this rank's made-up one."""
    E = sum(counts)
    local = local_tensor(p)
    out: dict[str, Any] = {}
    for k, v in _schema(opt, p).items():
        if isinstance(v, Tensor):
            if v.ndim == 0:
                continue
            f = v.shape[0] // E
            v = wrap_expert_tensor(empty_local(tuple(v.shape), v.dtype, local.device), p.device_mesh,  # type: ignore[attr-defined]
                                   tuple(c * f for c in counts), tuple(v.shape))
        out[k] = v
    return out


def _group_of(opt: "MatrixOptimizer", p: Tensor) -> dict[str, Any]:
    """The param group holding ``p``."""
    return next(g for g in opt.param_groups if any(q is p for q in g["params"]))


def _schema(opt: "MatrixOptimizer", p: Tensor) -> dict[str, Any]:
    """The optimizer's state schema of ``p`` (keys and global shapes, on ``meta``)."""
    return state_schema(opt, p, _group_of(opt, p))


def _replica_entry(opt: "MatrixOptimizer", p: Tensor, info: Any, st: dict[str, Any] | None) -> dict[str, Any]:
    """State of a ``matrixfsdp.replicate`` parameter, as owned DTensors on its owner's one-rank
    mesh: the same checkpoint layout as ``fully_shard``'s owned parameters. Every rank presents
    every trainable parameter's keys without communicating: non-owners as empty owned DTensors,
    the owner its state or, before its first step, the state a first step starts from (see
    [Note: state-initialization step]: loading it is the same as having none)."""
    if not info.is_local:
        return _remote_entry(opt, p, info)
    if not st:
        st = state_schema(opt, p, _group_of(opt, p), like=p.detach())
    mesh = info.owner_mesh
    return {k: wrap_dtensor(v, mesh, (Replicate(),), tuple(v.shape)) if isinstance(v, Tensor) else v
            for k, v in st.items()}


def accept_state(opt: "MatrixOptimizer", sd: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`present_state` for ``load_state_dict``: DTensor values become their
    local tensors (checked against the parameter's layout); state of an owned parameter on a
    non-owner is dropped; placeholders still all zero are dropped."""
    name = type(opt).__name__
    saved_ids = list(chain.from_iterable(g["params"] for g in sd["param_groups"]))
    id_map = dict(zip(saved_ids, _param_list(opt)))
    placeholders = getattr(opt, "_state_placeholders", {})
    state: dict[Any, Any] = {}
    for key, st in sd["state"].items():
        p = id_map.get(key)
        if p is None or not isinstance(st, dict):
            state[key] = st
            continue
        out: dict[str, Any] = {}
        replica = _replicated(p)
        st_p = opt._stepping(p)
        if replica is not None:  # matrixfsdp.replicate: only the owner keeps state
            if st_p.keeps_state:
                state[key] = {k: local_tensor(v) if isinstance(v, Tensor) else v for k, v in st.items()
                              if not (k in placeholders and isinstance(v, Tensor) and not bool(torch.any(v)))}
            continue
        counts = expert_rows(p)
        if counts is not None:
            if local_tensor(p).shape[0] == 0:
                # no expert of the stack here: no state (an entry, even empty, would stop
                # present_state from presenting the keys the ranks holding its experts have)
                if st:
                    opt._remote_state.add(id(p))
                continue
            state[key] = _accept_expert_state(opt, key, p, counts, st, placeholders)
            continue
        is_dt = DTensor is not None and isinstance(p, DTensor)
        info = owned_of(p)
        if st_p.hosted and not st_p.keeps_state:
            if st:  # its host keeps (and loads) the state; this rank presents its keys from now on
                opt._remote_state.add(id(p))
            continue
        if is_dt and info is not None and not st_p.keeps_state:
            if st:  # non-owners keep no state for an owned parameter, only that its owner has some
                opt._remote_state.add(id(p))
            continue
        for k, v in st.items():
            if DTensor is not None and isinstance(v, DTensor):
                if not is_dt:
                    v = v.full_tensor()  # a sharded state dict into a plain parameter
                else:
                    v = _check_local(name, key, k, p, v, st_p.host_mesh)
            elif is_dt and isinstance(v, Tensor) and v.ndim > 0 and info is None and st_p.host_mesh is None:
                local = local_tensor(p)
                if tuple(v.shape) != tuple(local.shape):
                    raise ValueError(
                        f"{name}.load_state_dict: state {k!r} of parameter {key!r} has shape "
                        f"{tuple(v.shape)} but this rank's shard of the parameter has shape "
                        f"{tuple(local.shape)}; load sharded state with torch.distributed.checkpoint"
                    )
            if k in placeholders and isinstance(v, Tensor) and not bool(torch.any(v)):
                continue
            out[k] = v
        state[key] = out
    return {**sd, "state": state}


def _accept_expert_state(opt: "MatrixOptimizer", key: Any, p: Tensor, counts: tuple[int, ...],
                         st: dict[str, Any], placeholders: dict[str, str]) -> dict[str, Any]:
    """This rank's rows of the state of expert stack ``p`` (see the Note): ExpertDTensors with the
    stack's rows per shard rank, or plain tensors of the local stacked shape; any other layout (a
    state dict of another expert count or another ``splits``) raises a ValueError naming the
    parameter, the shapes and the fix (on a rank holding experts of the stack)."""
    name = type(opt).__name__
    n = local_tensor(p).shape[0]
    E = sum(counts)
    group = _group_of(opt, p)
    schema = state_schema(opt, p, group)
    # rows per expert of state the schema does not list: the matrix rule's splits, or 1 (AdamW)
    f_route = opt._expert_splits(group, p) or 1
    out: dict[str, Any] = {}
    for k, v in st.items():
        if isinstance(v, Tensor) and v.ndim > 0:
            want = schema.get(k)
            glob = (tuple(want.shape) if isinstance(want, Tensor) and want.ndim > 0
                    else (E * f_route, *v.shape[1:]))
            f = glob[0] // E
            mine = (n * f, *glob[1:])
            rows = tuple(c * f for c in counts)
            fix = ("the state dict was saved for another expert layout (another number of experts, or "
                   "another number of matrices per expert); load a checkpoint of this model with "
                   "torch.distributed.checkpoint (get_state_dict + dcp.load + set_state_dict), which "
                   "reshards experts, or start the optimizer afresh")
            if DTensor is not None and isinstance(v, DTensor):
                if tuple(v.shape) != glob or expert_rows(v) != rows or v.device_mesh != p.device_mesh:
                    raise ValueError(
                        f"{name}.load_state_dict: state {k!r} of expert stack {key!r} (global shape "
                        f"{tuple(p.shape)}, experts per shard rank {counts}) is a DTensor of global shape "
                        f"{tuple(v.shape)} with rows per shard rank {expert_rows(v)}, but this optimizer "
                        f"keeps it as {glob} with rows {rows} ({f} per expert); {fix}"
                    )
                v = local_tensor(v)
            elif tuple(v.shape) != mine:
                raise ValueError(
                    f"{name}.load_state_dict: state {k!r} of expert stack {key!r} has shape "
                    f"{tuple(v.shape)}, but this optimizer keeps it as {mine} on this rank, which holds "
                    f"{n} of its experts (global shape {tuple(p.shape)}; state {glob} in all, {f} per "
                    f"expert); {fix}"
                )
        if k in placeholders and isinstance(v, Tensor) and not bool(torch.any(v)):
            continue
        out[k] = v
    return out


def _check_local(name: str, key: Any, k: str, p: Tensor, v: Any, host_mesh: Any) -> Tensor:
    if host_mesh is not None and v.device_mesh == host_mesh:
        return local_tensor(v)  # a TP host's whole state (placement/tp_host.py)
    info = owned_of(p)
    if info is None and (v.device_mesh != p.device_mesh or tuple(v.placements) != tuple(p.placements)):
        raise ValueError(
            f"{name}.load_state_dict: state {k!r} of parameter {key!r} is a DTensor with "
            f"placements {tuple(v.placements)} on {v.device_mesh}, but the parameter has "
            f"{tuple(p.placements)} on {p.device_mesh}; load it with torch.distributed.checkpoint "
            "(get_state_dict + dcp.load + set_state_dict), which reshards"
        )
    local = local_tensor(v)
    if info is None and v.shape != p.shape:
        raise ValueError(
            f"{name}.load_state_dict: state {k!r} of parameter {key!r} has global shape "
            f"{tuple(v.shape)} but the parameter has {tuple(p.shape)}"
        )
    return local


# ----------------------------------------------------------------------------- the optimizers' own
def optimizer_state_dict(opt: "MatrixOptimizer", sd: dict[str, Any]) -> dict[str, Any]:
    """``MatrixOptimizer.state_dict()`` from torch's ``sd``: DTensor state presented, each
    group's ``"routes"`` added, dtypes as strings."""
    sd = present_state(opt, sd)
    # dtypes (Muon's ns_dtype) as strings: DCP's full state dicts only carry plain values
    sd["param_groups"] = [{**{k: str(v) if isinstance(v, torch.dtype) else v for k, v in g.items()},
                           "routes": r} for g, r in zip(sd["param_groups"], routes(opt))]
    return sd


def load_optimizer_state_dict(opt: "MatrixOptimizer", state_dict: dict[str, Any], load: Any) -> None:
    """``MatrixOptimizer.load_state_dict``: routes checked, dtypes restored, DTensor state
    accepted, then torch's loader ``load``; wide (float32) matrix statistics keep their dtype."""
    name, mine = type(opt).__name__, routes(opt)
    for i, saved in enumerate(state_dict["param_groups"]):
        got = saved.get("routes")
        if got is not None and i < len(mine) and list(got) != mine[i]:
            diff = [k for k, (a, b) in enumerate(zip(got, mine[i])) if a != b]
            raise ValueError(
                f"{name}.load_state_dict: param group {i} was saved with other "
                f"update rules than this optimizer applies (parameter {diff[0] if diff else len(got)}: "
                f"saved {got[diff[0]] if diff else len(got)!r}, now "
                f"{mine[i][diff[0]] if diff else len(mine[i])!r}); build both optimizers the same way, "
                "e.g. Optimizer(model), which routes a sharded and a plain model alike"
            )

    def restore(k: str, v: Any) -> Any:  # "torch.float32" -> torch.float32 (see optimizer_state_dict)
        if isinstance(v, str) and v.startswith("torch.") and any(
                isinstance(g.get(k), torch.dtype) for g in opt.param_groups):
            dt = getattr(torch, v.removeprefix("torch."), None)
            return dt if isinstance(dt, torch.dtype) else v
        return v

    state_dict = {**state_dict, "param_groups": [{k: restore(k, v) for k, v in g.items() if k != "routes"}
                                                 for g in state_dict["param_groups"]]}
    state_dict = accept_state(opt, state_dict)
    load(state_dict)
    sync_host_steps(opt)
    if not opt.rule_class.wide_state:
        return
    id_map = dict(zip(chain.from_iterable(g["params"] for g in state_dict["param_groups"]), _param_list(opt)))
    route_of = {id(p): route for _, _, p, route in opt._routed()}
    for key, saved in state_dict["state"].items():
        p = id_map.get(key)
        if p is None or route_of[id(p)] == "adamw":
            continue
        device = local_tensor(p).device
        for k, value in saved.items():
            if k != "step" and isinstance(value, Tensor) and value.is_floating_point():
                opt.state[p][k] = value.to(device=device, dtype=wide_dtype(p.dtype), copy=True)


def state_schema(opt: "MatrixOptimizer", p: Tensor, group: dict[str, Any], *, like: Tensor | None = None
                 ) -> dict[str, Any]:
    """The state keys (and global shapes, on ``meta``) the owner of ``p`` holds, with the
    placeholders its state dict adds; given ``like`` (``p``'s whole tensor), the state a first
    step starts from, allocated like it."""
    base = like if like is not None else torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")
    route = opt._route(group, p)
    schema = opt._rule(group, route).init_state(base, splits=opt._expert_splits(group, p, route))
    for key, dep in opt._state_placeholders.items():
        if key not in schema and isinstance(schema.get(dep), Tensor):
            schema[key] = torch.zeros_like(schema[dep])
    return schema


def note_remote(opt: "MatrixOptimizer", p: Tensor, st: Any = None) -> None:
    """An owned parameter stepped on its owner, a TP-hosted one on its host (every rank sees
    the same gradients, or under HSDP split its step replica's receipt): its state exists
    there, and this rank presents its keys."""
    if (st if st is not None else stepping_of(p)).single_keeper:
        opt._remote_state.add(id(p))
