"""``matrixfsdp.replicate``: ZeRO-1/2 for replicated parameters on Canzona's balanced buckets."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import Any, Callable, Iterator, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm.agree import agree, encode_error
from ..comm.collectives import KINDS, CommCounter, collectives_for
from ..engine.plan_check import check_world_size, verify_plan_digest
from ..engine.reducer import check_find_unused, replica_comm
from ..engine.streams import CommContext
from ..mesh import MeshInfo, default_mesh, mesh_info
from ..placement.owner import Owned, keeps_state, owner_of, set_owner
from ..engine.swap import attach_state, attached_state, front_end_of, swap_class
from ..planner.owner_plan import OwnerPlan
from .bucket_layout import build_layout
from .state import Bucket, ReplicateState

__all__ = ["replicate", "MatrixReplicateModule"]

API = "matrixfsdp.replicate"


def replicate(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    plan: OwnerPlan | None = None,
    stage: int = 2,
    reduce_dtype: torch.dtype | None = None,
    bucket_numel: int | None = None,
    broadcast_from_rank0: bool = True,
    collectives: str = "all_to_all",
) -> nn.Module:
    """Data parallelism with full parameters on every rank and a sharded optimizer step (ZeRO-1/2).

    Each trainable parameter is owned whole by one rank, as ``plan`` says (default:
    ``plan_owners(module, mesh, policy="alpha_balanced", elementwise="owned")``, Canzona's
    balanced partition of DDP-style buckets). In backward each bucket's gradient is
    reduce-scattered with uneven splits, so the owner of each parameter receives its averaged
    gradient in ``.grad`` and every other rank gets ``None``. Any optimizer then updates (and keeps
    state for) only this rank's parameters, locally; the next forward all-gathers the updated
    parameters bucket by bucket, each bucket awaited just before the first module that uses it.

    ``stage=1`` keeps each bucket's gradient buffer for the whole run (as Megatron's contiguous
    gradient buffer); ``stage=2`` allocates it in backward and frees it after the reduction, so a
    rank keeps only its own gradients. Gradient values are identical in both.

    Args:
        module: the model (the same parameters on every rank; with ``broadcast_from_rank0`` rank
            0's values are copied to the others, as DDP does at construction).
        mesh: a 1-D data-parallel mesh (default: every rank of the default group), or an HSDP
            mesh ``(dp_replicate, dp_shard)``: buckets are planned within ``dp_shard`` and the
            gradients combined across replicas as ``plan``'s ``replica_step`` says (see
            docs/hsdp.md).
        plan: an :class:`OwnerPlan` with every parameter owned (no ``"even"`` placement).
        stage: 1 or 2.
        reduce_dtype: dtype of the gradient reduction (default: the parameter dtype).
        bucket_numel: bucket size for plans without recorded buckets (owner policies).
        collectives: the reduce-scatter and all-gather implementation, as ``fully_shard``'s
            (``"all_to_all"``, ``"p2p"`` or ``"two_phase"``: bandwidth-bounded at large W, with
            a staging buffer of the bucket's size for the gather).

    Example::

        model = matrixfsdp.replicate(model, stage=2)                    # alpha-balanced buckets
        opt = matrixfsdp.optim.Muon(model, lr=0.02)
        for x, y in data:
            loss_fn(model(x), y).backward()   # one reduce-scatter per bucket, overlapped
            opt.step()                         # local: only this rank's parameters
            opt.zero_grad()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"{API}: expects an nn.Module, got {type(module).__name__}")
    if attached_state(module, ReplicateState) is not None:
        raise ValueError(f"{API}: the module is already managed by matrixfsdp.replicate")
    if stage not in (1, 2) or isinstance(stage, bool):
        raise ValueError(f"{API}: stage must be 1 or 2, got stage={stage!r}")
    if collectives not in KINDS:
        raise ValueError(f"{API}: collectives must be one of {KINDS}, got collectives={collectives!r}")
    if reduce_dtype is not None and not isinstance(reduce_dtype, torch.dtype):
        raise TypeError(f"{API}: reduce_dtype must be a torch.dtype or None, got {reduce_dtype!r}")
    _check_not_sharded(module)
    info = mesh_info(mesh if mesh is not None else default_mesh(API), api=API)
    mesh = info.mesh
    if plan is None:
        from ..planner.owners import plan_owners

        plan = plan_owners(module, mesh, policy="alpha_balanced", elementwise="owned",
                           bucket_numel=bucket_numel)
    if not isinstance(plan, OwnerPlan):
        raise TypeError(f"{API}: plan must be None or a matrixfsdp OwnerPlan, got {type(plan).__name__}")
    # collective, first: a plan wrong on some ranks only fails on every rank here, before any
    # local check could raise on those ranks alone and leave the others waiting in it
    verify_plan_digest(plan, info, api=API)
    check_world_size(plan, info, api=API)
    named = dict(module.named_parameters())
    missing = sorted(set(named) - {p.fqn for p in plan.params})
    if missing:
        raise ValueError(f"{API}: the plan has no entry for {missing[:3]} (plan the same model)")
    given = plan
    plan = _stacks_owned(plan)  # the buckets' view: an expert stack is one owned tensor
    _check_whole(plan, named)
    coll = collectives_for(info.shard_group, collectives)
    rank, W = info.shard_rank, info.shard_size
    trainable = [f for f, p in named.items() if p.requires_grad]
    devices = {p.device for p in named.values()}
    error = None
    if len(devices) > 1 or any(d.type == "meta" for d in devices):
        error = f"{API}: parameters must be materialized on one device, got {sorted(map(str, devices))}"
    layouts = build_layout(plan, trainable, bucket_numel=bucket_numel)
    _agree_on_layout(layouts, stage, reduce_dtype, collectives, error, info)
    comm = CommContext(info.device)
    replicas = replica_comm(info, collectives)
    buckets = [
        Bucket(lay, [named[s.fqn] for s in lay.slots], rank=rank, coll=coll, comm=comm,
               reduce_dtype=reduce_dtype, persistent=stage == 1, replicas=replicas,
               step_replicas=[plan[s.fqn].step_replica for s in lay.slots])
        for lay in layouts
    ]
    if broadcast_from_rank0 and info.world_size > 1:
        # (HSDP) replica 0's values to every replica, then shard rank 0's to its shard group:
        # rank 0's values everywhere
        with torch.no_grad():
            tensors = [b.flat for b in buckets] + [p.data for p in named.values() if not p.requires_grad]
            for t in tensors + [buf.data for buf in module.buffers()]:
                if replicas is not None:
                    replicas.coll.broadcast(t, 0)
                coll.broadcast(t, 0)
    from ..placement.owned_tensor import owner_meshes

    owner_meshes(mesh)  # optimizer state is presented on them (see [Note: optimizer state in state dicts])
    state = ReplicateState(module, buckets, named, rank=rank, world_size=W, coll=coll, comm=comm, stage=stage,
                           replicas=replicas, agree=collectives_for(info.dp_group, collectives))
    state.plan = given
    state.mesh = mesh
    on_grad = _grad_hook(state)
    for b in buckets:
        for slot, p in zip(b.layout.slots, b.params):
            pp = plan[slot.fqn]
            set_owner(p, Owned(owner=slot.owner, kind=given[slot.fqn].placement, mesh=mesh, storage="replicated",
                               step_replica=pp.step_replica))
            p.register_post_accumulate_grad_hook(on_grad)
    _install_hooks(module, state)
    attach_state(module, state)
    swap_class(module, MatrixReplicateModule, API)
    return module


def _grad_hook(state: ReplicateState) -> Callable[[torch.Tensor], None]:
    """The parameters' post-accumulate-grad hook, holding the state weakly: torch keeps such a
    hook alive from C++ (the tensor's hook dict), an edge gc cannot see, so a hook holding the
    state would keep the model alive for good."""
    ref = weakref.ref(state)

    def on_grad(p: torch.Tensor) -> None:
        s = ref()
        if s is not None:
            s.on_grad(p)

    return on_grad


def _agree_on_layout(layouts: Any, stage: int, reduce_dtype: Any, collectives: str, error: str | None,
                     info: MeshInfo) -> None:
    """One exchange: every rank must run the same buckets and collectives (the plan digest does not
    cover ``bucket_numel``, which parameters are trainable, ``stage``, ``reduce_dtype`` or
    ``collectives``), and a local check that failed on one rank fails on all of them (first)."""
    import hashlib

    what = repr(([(lay.dtype, lay.slots, lay.param_splits) for lay in layouts], stage, str(reduce_dtype),
                 collectives))
    fingerprints = agree(None if error is None else encode_error(ValueError(error)),
                         hashlib.sha256(what.encode()).hexdigest(), group=info.dp_group, device=info.device)
    if len(set(fingerprints)) != 1:
        raise ValueError(
            f"{API}: the ranks disagree on the bucket layout (bucket_numel, stage, reduce_dtype, "
            "collectives or which parameters require grad differ); call replicate with the same "
            "model and arguments on every rank"
        )


def _stacks_owned(plan: OwnerPlan) -> OwnerPlan:
    """Buckets hold whole tensors: an expert stack whose experts the plan puts on one rank (the
    bucket policies do, [Note: expert placement]) is owned by that rank here, its experts stepped
    there as independent matrices; a plan that spreads a stack's experts over ranks (the owner
    policies) is refused with the plan that fits."""
    out = []
    for p in plan.params:
        if p.placement == "experts":
            holders = [r for r, n in enumerate(p.experts) if n]
            if len(holders) > 1:
                raise ValueError(
                    f"{API}: its buckets hold whole tensors, so an expert stack must be held by one "
                    f"rank, but the plan (policy={plan.policy!r}) spreads {p.fqn!r}'s experts over ranks "
                    f"{holders} (counts {p.experts}); plan with plan_owners(..., policy='alpha_balanced', "
                    "elementwise='owned') (replicate's default), or shard experts per rank with fully_shard"
                )
            p = dataclasses.replace(p, placement="tail", owner=holders[0] if holders else 0, experts=(), splits=1)
        out.append(p)
    return dataclasses.replace(plan, params=tuple(out))


def _check_whole(plan: OwnerPlan, named: dict[str, Any]) -> None:
    """Refuse evenly sharded ('even' or 'hosted') entries. The hint keeps the caller's policy and
    asks for ``elementwise='owned'`` and ``placement='owned'``, the options that never yield them
    (so never the caller's)."""
    even = [p.fqn for p in plan.params if p.fqn in named and p.owner is None]
    if even:
        kinds = sorted({plan[f].placement for f in even})
        raise ValueError(
            f"{API}: every parameter must be owned whole by one rank, but the plan "
            f"(policy={plan.policy!r}, W={plan.world_size}) shards {len(even)} parameter(s) evenly "
            f"({' and '.join(repr(k) for k in kinds)} placement), e.g. {even[:3]}; rebuild it with plan_owners(..., "
            f"policy={plan.policy!r}, elementwise='owned', placement='owned')"
        )


def _check_not_sharded(module: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for name, m in module.named_modules():
        if isinstance(m, FSDPModule) or front_end_of(m) not in (None, MatrixReplicateModule):
            raise ValueError(f"{API}: submodule {name or '<root>'!r} is already sharded by fully_shard; "
                             "replicate manages plain (replicated) parameters")
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            raise ValueError(f"{API}: parameter {name!r} is a DTensor; replicate manages plain parameters")


def _install_hooks(module: nn.Module, state: ReplicateState) -> None:
    by_param = {id(p): b for b in state.buckets for p in b.params}
    for m in module.modules():
        mine = []
        for p in m.parameters(recurse=False):
            b = by_param.get(id(p))
            if b is not None and b not in mine:
                mine.append(b)
        if mine:
            m.register_forward_pre_hook(lambda mod, args, _b=mine: state.pre_forward_module(mod, _b))
    module.register_forward_pre_hook(lambda mod, args: state.pre_forward_root(), prepend=True)
    module.register_forward_hook(lambda mod, args, out: state.post_forward_root(out))
    module.register_state_dict_pre_hook(lambda *a, **k: state.sync_params())


def _drop_foreign_state(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook of an optimizer given to :meth:`MatrixReplicateModule.register_optimizer`:
    drop the state it holds for ``replicate`` parameters another rank owns.

    Only owners step a parameter, but torch's DCP helpers create state for *every* parameter of
    a torch optimizer before loading (``get_state_dict`` runs a zero-gradient step on a fresh
    optimizer), so after a standard-path resume each rank would keep DDP-sized state for good.
    ``matrixfsdp.optim`` never creates it; this frees it for torch's optimizers at their next
    step (after ``set_state_dict`` has read it).

    It reads ``param_groups`` before ``state``: under ``torch.compile(opt.step)`` this hook is
    traced first, and a parameter dynamo first meets as a key of ``state`` has its gradient
    guarded by identity, a recompile per step (see [Note: compiled steps and sources] in
    ``optim/_base.py``)."""
    for g in optimizer.param_groups:
        for p in g["params"]:
            # replicate's own parameters only: a torch optimizer keeps (empty) state for a
            # fully_shard non-owner's empty shard, as for any Shard(0) shard
            if _is_replica(p) and not keeps_state(p) and p in optimizer.state:
                del optimizer.state[p]


def _is_replica(p: Any) -> bool:
    info = owner_of(p)
    return info is not None and info.storage == "replicated"


def state_of(module: nn.Module, what: str = "") -> ReplicateState:
    state = attached_state(module, ReplicateState)
    if state is None:
        raise ValueError(f"{what or API}: the module is not managed by matrixfsdp.replicate")
    return state


class MatrixReplicateModule:
    """Controls added to a module by :func:`replicate` (its class is swapped, as FSDP2 does)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """``False``: backward accumulates local gradients in ``.grad`` without communicating
        (gradient accumulation); the next backward with ``True`` reduces the sum."""
        state_of(self).requires_gradient_sync = bool(requires_gradient_sync)  # type: ignore[arg-type]

    def set_find_unused_parameters(self, find_unused_parameters: bool) -> None:
        """``False`` promises that every parameter gets a gradient on some rank in every step
        (DDP's ``find_unused_parameters=False``): an owner whose parameter it did not use takes
        the reduced gradient without reading the usage flags, so backward has no host sync (if
        the promise is broken, a parameter no rank used gets a zero gradient instead of ``None``).
        Default ``True``: one small asynchronous flag read per step, only where this rank left a
        parameter it owns unused (see [Note: usage-flag host read] in ``engine/reducer.py``)."""
        state_of(self).find_unused = check_find_unused(find_unused_parameters, API)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's spelling of ``set_requires_gradient_sync(False)`` for the enclosed backwards."""
        state = state_of(self)  # type: ignore[arg-type]
        old = state.requires_gradient_sync
        state.requires_gradient_sync = False
        try:
            yield
        finally:
            state.requires_gradient_sync = old

    def sync_params(self) -> None:
        """Finish the parameter all-gathers now (they otherwise run at the next forward)."""
        state_of(self).sync_params()  # type: ignore[arg-type]

    def register_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer`` drop, before each of its steps, the state it holds for parameters
        another rank owns; returns the hook's ``RemovableHandle`` (idempotent per optimizer).

        Needed only for a torch optimizer resumed through torch's own DCP helpers
        (``get_state_dict``/``set_state_dict``), which create state for every parameter: without
        it each rank keeps DDP-sized state. ``matrixfsdp.optim`` never creates that state. The
        hook is this optimizer's alone (``Optimizer.register_step_pre_hook``), nothing global.

        Example::

            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            model.register_optimizer(opt)
            msd, osd = get_state_dict(model, opt)   # ... dcp.load, set_state_dict
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{API}.register_optimizer: expects a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        state_of(self, f"{API}.register_optimizer")  # type: ignore[arg-type]
        hooks = optimizer._optimizer_step_pre_hooks
        for key, hook in hooks.items():
            if hook is _drop_foreign_state:  # already registered: a handle to that hook
                handle = torch.utils.hooks.RemovableHandle(hooks)
                handle.id = key
                return handle
        return optimizer.register_step_pre_hook(_drop_foreign_state)

    @property
    def owner_plan(self) -> OwnerPlan:
        return state_of(self).plan  # type: ignore[arg-type]

    def comm_counter(self, role: str = "shard") -> CommCounter:
        """Calls and bytes of this model's collectives over the shard group, or (``role=
        "replicate"``, an HSDP mesh) over this rank's replicate group."""
        state = state_of(self)  # type: ignore[arg-type]
        if role not in ("shard", "replicate"):
            raise ValueError(f"{API}.comm_counter: role must be 'shard' or 'replicate', got {role!r}")
        if role == "shard":
            return state.coll.counter
        if state.replicas is None:
            raise ValueError(f"{API}.comm_counter: role='replicate' needs an HSDP (2-D) mesh")
        return state.replicas.coll.counter

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``to()``, ``double()``, ``to_empty()``...: the parameters are views of the flat buckets,
        so a conversion that changes their dtype or device is refused before anything changes;
        one that keeps both (``to_empty``, ``share_memory``) is applied and the parameters are
        made views of their buckets again, holding the new values."""
        state = state_of(self)  # type: ignore[arg-type]
        for b in state.buckets:
            probe = fn(torch.empty(0, dtype=b.flat.dtype, device=b.flat.device))
            if isinstance(probe, torch.Tensor) and (probe.dtype, probe.device) != (b.flat.dtype, b.flat.device):
                raise ValueError(
                    f"{API}: the parameters are views of flat {b.flat.dtype} buckets on {b.flat.device}, "
                    f"so a conversion to {probe.dtype} on {probe.device} after replicate is not supported; "
                    "convert the model (model.to(...)) before matrixfsdp.replicate"
                )
        out = super()._apply(fn, recurse)  # type: ignore[misc]
        state.rebind()
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if assign:
            raise ValueError(
                f"{API}: load_state_dict(assign=True) would replace the parameters, which are views of "
                "the flat buckets the collectives read and write; use assign=False (copies in place)"
            )
        return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]
