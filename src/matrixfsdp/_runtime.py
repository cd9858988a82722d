"""``matrixfsdp.fully_shard``: ZeRO-3 with owner placement, applied like torch's FSDP2.

This module is the public surface: argument checking, the ``MatrixFSDP<Cls>`` class swap with
FSDP2's controls, hook installation and the one-time *resolution* that shards parameters
according to the plan. Execution lives in ``_block.py``, segment math in ``_layout.py``,
collectives in ``_collectives.py``, the parameter representation in ``_owned.py``. The checks
(errors name the API, the constraint and the value seen) are at the end of this file.

[Note: resolution at the root call]
The plan names parameters by their fqn in the *planned model* (the module given to
``plan_owners``), but ``fully_shard(block)`` only sees the block, and identical blocks are
indistinguishable by structure. So a call on a block only registers it (hooks, class swap, the
parameters it manages, exactly FSDP2's bottom-up rule: parameters of already wrapped submodules
belong to those); the call on the planned model, recognized because every block of the plan is
one of its submodules, then resolves every registered block by module identity, checks the model
against the plan and shards all parameters at once. Wrap blocks first and the model last, as with
FSDP2; the optimizer must be built after the last call. A block whose root call never came raises
at its first forward.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Iterable, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ._block import BlockState, ManagedParam, RootContext, ShardConfig
from ._collectives import CommCounter, SegmentCollectives, collectives_for
from ._owned import local_tensor, make_sharded_param, owner_meshes
from ._plan import OwnerPlan, ParamPlan

__all__ = ["fully_shard", "MatrixFSDPModule", "UnshardHandle", "comm_counter", "get_state"]

API = "matrixfsdp.fully_shard"
_STATE_ATTR = "_matrixfsdp_state"
# Set on parameters claimed by a fully_shard call before resolution (detects top-down wrapping
# and parameters tied across blocks); a weakref to the claiming BlockState.
_CLAIM_ATTR = "_matrixfsdp_claimed_by"


def get_state(module: nn.Module) -> BlockState | None:
    """The :class:`BlockState` of a ``matrixfsdp.fully_shard``-ed module, else ``None``."""
    return module.__dict__.get(_STATE_ATTR)


def _cls_name(module: nn.Module) -> str:
    """The user's class name (``Block``, not ``MatrixFSDPBlock``)."""
    cls = type(module)
    if issubclass(cls, MatrixFSDPModule):
        cls = cls.__mro__[MatrixFSDPModule._orig_cls_mro_index]
    return cls.__name__


def _state_of(module: nn.Module, what: str) -> BlockState:
    state = get_state(module)
    if state is None:
        raise RuntimeError(f"{what}: {type(module).__name__} is not a matrixfsdp.fully_shard module")
    return state


# ================================================================================ public API
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    shard_placement_fn: Any = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: Any = None,
    ignored_params: set[nn.Parameter] | None = None,
    plan: OwnerPlan,
    collectives: str = "all_to_all",
) -> nn.Module:
    """Shard ``module``'s parameters as ``plan`` says (owner or even placement), FSDP2-style.

    Takes torch's ``fully_shard`` keywords plus the required ``plan``. Apply it to every block
    the plan names, then to the planned model (see [Note: resolution at the root call]); build
    the optimizer afterwards. Returns ``module``, whose class is swapped to ``MatrixFSDP<Cls>``
    with ``unshard``/``reshard``/``set_requires_gradient_sync``/``set_reshard_after_forward``/
    ``set_modules_to_forward_prefetch``/``set_modules_to_backward_prefetch``.

    * ``reshard_after_forward``: ``None`` means True except for the root (like FSDP2).
    * ``mp_policy``: ``param_dtype`` is the compute (and communication) dtype of materialized
      parameters; owners keep their parameters and optimizer state in the original dtype and
      receive gradients reduced in ``reduce_dtype``.
    * ``shard_placement_fn`` is rejected (placement comes from the plan); ``offload_policy`` must
      be left alone; ``collectives`` picks the implementation (``"all_to_all"``, ``"p2p"``, or ``"two_phase"``:
      owner scatter + ring all-gather, bounded at <= 2x ring volume whatever gamma_B is).

    Example::

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,))
        for block in model.blocks:
            matrixfsdp.fully_shard(block, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
        whole = [p for p in model.parameters() if (o := matrixfsdp.owned_of(p)) and o.kind == "matrix"]
        rest = [p for p in model.parameters() if p.requires_grad and not any(p is q for q in whole)]
        opt = matrixfsdp.optim.Muon([dict(params=whole), dict(params=rest, algorithm="adamw")],
                                    lr=0.02, ns_dtype=torch.float32)
    """
    _check_call(module, plan, shard_placement_fn, offload_policy)
    if reshard_after_forward not in (None, True, False):
        raise ValueError(
            f"{API}: reshard_after_forward must be None, True or False (resharding to a smaller "
            f"world is not supported), got {reshard_after_forward!r}"
        )
    if get_state(module) is not None:
        raise ValueError(f"{API}: already applied to this {_cls_name(module)}")
    _check_not_torch_fsdp(module)
    mesh = mesh if mesh is not None else _default_mesh()
    _check_mesh(mesh)
    coll = collectives_for(mesh.get_group(), collectives)
    _verify_plan_digest(plan, mesh, coll)  # collective: before any plan-dependent check
    _check_world_size(plan, mesh)
    owner_meshes(mesh)  # collective on the first call per mesh (same call on every rank)

    params = _collect_managed(module, set(ignored_params or ()))
    config = ShardConfig(mesh=mesh, reshard_after_forward=reshard_after_forward,
                         mp_policy=mp_policy, collectives=collectives)
    state = BlockState(module, config, params)
    for mp in params:
        setattr(mp.orig, _CLAIM_ATTR, weakref.ref(state))
    module.__dict__[_STATE_ATTR] = state
    state._hook_handles = [
        module.register_forward_pre_hook(functools.partial(_pre_forward_hook, state),
                                         prepend=True, with_kwargs=True),
        module.register_forward_hook(functools.partial(_post_forward_hook, state),
                                     prepend=False),
    ]
    _swap_class(module)
    if _is_planned_model(module, plan):
        _resolve(module, plan, mesh)
    return module


def comm_counter(module: nn.Module) -> CommCounter:
    """The call/byte counter of the collectives ``module``'s blocks use (shared per mesh).

    Example::

        c = comm_counter(model); c.reset()
        loss.backward(); print(c.calls["reduce_scatter"], c.bytes_sent)
    """
    state = _state_of(module, "matrixfsdp.comm_counter")
    return collectives_for(state.config.mesh.get_group(), state.config.collectives).counter


def drop_stale_state(module: nn.Module) -> None:
    """Reshard leftovers of unfinished iterations under ``module``'s root (see [Note: stale
    state] in ``_block.py``) and check the parameter layout (meta parameters raise, layouts
    swapped by torch code are repaired); a no-op for modules matrixfsdp does not manage. Call on
    every rank."""
    for m in module.modules():
        state = get_state(m)
        if state is not None and state.ctx is not None and torch._C._current_graph_task_id() == -1:
            state.ctx.drop_stale()
            check_layout(state.ctx)
            return


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` completes it (like FSDP2's)."""

    def __init__(self, state: BlockState | None):
        self._state = state

    def wait(self) -> None:
        if self._state is not None:
            self._state.wait_for_unshard()
            self._state.to_unsharded_plain()
            self._state = None


class MatrixFSDPModule:
    """Mixin placed first in the MRO of ``fully_shard``-ed modules (``MatrixFSDP<Cls>``)."""

    # [MatrixFSDP<Orig>, MatrixFSDPModule, Orig, ...]
    _orig_cls_mro_index = 2

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers (e.g. nn.Sequential slicing) construct ``type(self)(...)``: build the
        # original class instead, as FSDP2 does.
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Materialize this module's parameters now (``async_op``: return a handle to wait on).

        Example::

            h = model.blocks[1].unshard(async_op=True)  # overlaps with other work
            h.wait()
        """
        state = _state_of(self, "unshard")  # type: ignore[arg-type]
        _lazy_init(state)
        state.unshard(async_op=async_op)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the materialized parameters (owners keep their own storage)."""
        state = _state_of(self, "reshard")  # type: ignore[arg-type]
        if state.resolved:
            state.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward accumulates unreduced gradients locally; the next synced backward
        reduces their sum (gradient accumulation without communication).

        Example::

            model.set_requires_gradient_sync(False)
            for mb in micro_batches[:-1]:
                model(mb).sum().backward()
            model.set_requires_gradient_sync(True)
            model(micro_batches[-1]).sum().backward()   # one reduction for all micro-batches
        """
        for state in self._states(recurse):
            state.requires_gradient_sync = bool(requires_gradient_sync)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduced gradients are ``sum / factor`` instead of ``sum / W`` (torch's FSDP2 method;
        e.g. ``1.0`` when the loss is already normalized by the global token count, as
        torchtitan does). Applies to this module and every module under it."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive number, got {factor=!r}")
        for state in self._states(recurse=True):
            state.gradient_divide_factor = float(factor)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free materialized parameters after forward (re-materialize in backward)."""
        import dataclasses

        for state in self._states(recurse):
            state.config = dataclasses.replace(state.config,
                                               reshard_after_forward=bool(reshard_after_forward))

    def set_modules_to_forward_prefetch(self, modules: Iterable["MatrixFSDPModule"]) -> None:
        """Materialize ``modules`` asynchronously when this module's forward starts."""
        _state_of(self, "set_modules_to_forward_prefetch").forward_prefetch = [  # type: ignore[arg-type]
            _state_of(m, "set_modules_to_forward_prefetch") for m in modules  # type: ignore[arg-type]
        ]

    def set_modules_to_backward_prefetch(self, modules: Iterable["MatrixFSDPModule"]) -> None:
        """Materialize ``modules`` asynchronously when this module's backward starts."""
        _state_of(self, "set_modules_to_backward_prefetch").backward_prefetch = [  # type: ignore[arg-type]
            _state_of(m, "set_modules_to_backward_prefetch") for m in modules  # type: ignore[arg-type]
        ]

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> "MatrixFSDPModule":
        """Allocate uninitialized storage on ``device`` (meta-device init, as with FSDP2).

        Every rank allocates only its own segments: owners the whole tensor, other ranks an
        empty ``[0, ...]`` tensor, evenly sharded parameters their rows (see
        [Note: meta-device initialization]). Parameter objects keep their identity, as with
        FSDP2. Initialize afterwards with :func:`matrixfsdp.set_full_` from full tensors every
        rank computes alike (e.g. ``set_full_(p, init_fn(torch.empty(p.shape), generator=g))``,
        which also makes the init independent of the world size) or with a checkpoint load.
        ``torch.nn.init`` functions applied to the sharded parameters are not safe: on ranks
        outside an owned tensor's one-rank mesh some raise (``trunc_normal_``) and random ones
        advance only the owner's generator.

        Example::

            with torch.device("meta"):
                model = Model()
            plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,))
            for block in model.blocks:
                matrixfsdp.fully_shard(block, mesh=mesh, plan=plan)
            matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
            model.to_empty(device="cpu")
            g = torch.Generator().manual_seed(0)
            for p in model.parameters():   # or matrixfsdp.checkpoint.load(...)
                matrixfsdp.set_full_(p, torch.nn.init.normal_(torch.empty(p.shape), std=0.02, generator=g))
        """
        states = self._states(recurse)
        unresolved = [s for s in states if not s.resolved]
        if unresolved:
            raise RuntimeError(
                f"{API}: to_empty on {_cls_name(self)} before its blocks were resolved; call "  # type: ignore[arg-type]
                "matrixfsdp.fully_shard on the planned model first"
            )
        dev = torch.device(device) if device is not None else torch.get_default_device()
        for ctx in {id(s.ctx): s.ctx for s in states if s.ctx is not None}.values():
            ctx.drop_stale()  # nothing of an earlier iteration may point at the old storage
        # Our parameters are taken out of the modules while torch's to_empty handles everything
        # else (buffers, ignored parameters): DTensor's empty_like on a rank outside a parameter's
        # one-rank owner mesh would return a 1-D ``tensor([])`` (a 0-dim one: a scalar), not the
        # ``[0, ...]`` segment the runtime relies on.
        managed = [mp for s in states for mp in s.params]
        for mp in managed:
            for m, attr in mp.sites:
                m._parameters[attr] = None
        try:
            nn.Module.to_empty(self, device=dev, recurse=recurse)  # type: ignore[arg-type]
        finally:
            for s in states:
                s.to_sharded()  # puts every mp.sharded back
        for s in states:
            s.move_to(dev)
        return self

    def _states(self, recurse: bool) -> list[BlockState]:
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [s for m in mods if (s := get_state(m)) is not None]


_CLS_CACHE: dict[type, type] = {}


def _unimplemented_deepcopy(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError(f"{API}: deepcopy is not supported; use a state dict")


def _swap_class(module: nn.Module) -> None:
    cls = type(module)
    new_cls = _CLS_CACHE.get(cls)
    if new_cls is None:
        new_cls = type(f"MatrixFSDP{cls.__name__}", (MatrixFSDPModule, cls),
                       {"__deepcopy__": _unimplemented_deepcopy})
        _CLS_CACHE[cls] = new_cls
    module.__class__ = new_cls


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(f"{API}: torch.distributed is not initialized and no mesh was given")
    device_type = "cpu" if dist.get_backend() == "gloo" else "cuda"
    return init_device_mesh(device_type, (dist.get_world_size(),))


# ================================================================================ hooks
def _pre_forward_hook(state: BlockState, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    _lazy_init(state)
    return state.pre_forward(args, kwargs)


def _post_forward_hook(state: BlockState, module: nn.Module, args: Any, output: Any) -> Any:
    return state.post_forward(output)


def _lazy_init(state: BlockState) -> None:
    """Checks deferred to the first forward/unshard (the root context itself is built at
    resolution, when the planned model and all its blocks are known)."""
    if not state.resolved:
        raise RuntimeError(
            f"{API}: {_cls_name(state.module)} was registered but never resolved against "
            "its plan; after wrapping the blocks, call matrixfsdp.fully_shard on the planned "
            "model (the module given to plan_owners) before running forward"
        )
    ctx = state.root_ctx
    if state is ctx.root and torch._C._current_graph_task_id() == -1:
        check_layout(ctx)  # once per iteration, at the root's forward outside backward
    if not ctx.checked:
        # torch's fully_shard applied after ours would otherwise fail obscurely (or silently).
        _check_not_torch_fsdp(ctx.root.module)
        ctx.checked = True


def check_layout(ctx: RootContext) -> None:
    """Refuse parameters still on meta; repair representations torch code swapped in (see
    ``BlockState.repair_layout``). Local, no collective; call on every rank at the same point."""
    meta = [mp.fqn for s in ctx.states for mp in s.params if local_tensor(mp.sharded).is_meta]
    if meta:
        raise RuntimeError(
            f"{API}: parameters are still on the meta device ({meta[:3]}"
            f"{'...' if len(meta) > 3 else ''}); call model.to_empty(device=...) and "
            "initialize them (or load a checkpoint) before using the model"
        )
    for s in ctx.states:
        s.repair_layout()


# ================================================================================ registration
def _collect_managed(module: nn.Module, ignored: set[nn.Parameter]) -> list[ManagedParam]:
    """Parameters of ``module`` not under an already wrapped submodule (FSDP2's rule)."""
    by_id: dict[int, ManagedParam] = {}
    visited: set[int] = set()

    def visit(m: nn.Module, prefix: str) -> None:
        if id(m) in visited:
            return
        visited.add(id(m))
        for attr, p in m._parameters.items():
            name = prefix + attr
            if p is None or p in ignored:
                continue
            claim = getattr(p, _CLAIM_ATTR, None)
            owner = claim() if claim is not None else None
            if owner is not None:
                raise ValueError(
                    f"{API}: parameter {name!r} of {_cls_name(module)} is already managed by "
                    f"the fully_shard call on {_cls_name(owner.module)}; wrap blocks "
                    "bottom-up (blocks first, the model last) and keep tied parameters inside "
                    "one wrapped module"
                )
            if isinstance(p, DTensor):
                raise ValueError(
                    f"{API}: parameter {name!r} of {_cls_name(module)} is already a DTensor; "
                    "it is managed by another sharding API"
                )
            mp = by_id.get(id(p))
            if mp is None:
                by_id[id(p)] = ManagedParam(fqn="", sites=((m, attr),), orig=p)
            else:
                mp.sites = (*mp.sites, (m, attr))
        for child_name, child in m.named_children():
            if get_state(child) is None:
                visit(child, f"{prefix}{child_name}.")

    visit(module, "")
    return list(by_id.values())


def _is_planned_model(module: nn.Module, plan: OwnerPlan) -> bool:
    names = {name for name, _ in module.named_modules()}
    return all(b in names for b in plan.blocks)


def _resolve(root: nn.Module, plan: OwnerPlan, mesh: DeviceMesh) -> None:
    """Check the whole model against the plan, then shard every parameter (root call only)."""
    entries = [(name, m, s) for name, m in root.named_modules() if (s := get_state(m)) is not None]
    wrapped = {name for name, _, _ in entries}
    for b in plan.blocks:
        if b not in wrapped:
            raise ValueError(
                f"{API}: the plan has block {b!r} but that module was not passed to "
                "matrixfsdp.fully_shard before the planned model; wrap every planned block first"
            )
    for name, _, s in entries:
        if s.resolved:
            raise RuntimeError(f"{API}: {name!r} was already resolved by another root")
        if name and name not in plan.blocks:
            raise ValueError(
                f"{API}: fully_shard was applied to {name!r} but the plan has no such block "
                f"(plan blocks: {list(plan.blocks)[:6]}{'...' if len(plan.blocks) > 6 else ''}); "
                "plan with the same blocks you wrap"
            )

    fqns_of: dict[int, list[str]] = {}
    for fqn, p in root.named_parameters(remove_duplicate=False):
        fqns_of.setdefault(id(p), []).append(fqn)
    for name, _, s in entries:
        for mp in s.params:
            fqns = fqns_of[id(mp.orig)]
            sites = {(id(m), attr) for m, attr in mp.sites}
            for alias in fqns:
                mod_path, _, attr = alias.rpartition(".")
                if (id(root.get_submodule(mod_path)), attr) not in sites:
                    raise ValueError(
                        f"{API}: parameter {fqns[0]!r} is tied to {alias!r} in another wrapped "
                        "module; tied parameters must live inside one fully_shard module"
                    )
            mp.fqn = fqns[0]
            mp.plan = _check_param(mp.fqn, mp.orig, plan, name)  # type: ignore[arg-type]
    _check_plan_covered(plan, (f for fs in fqns_of.values() for f in fs))

    for name, _, s in entries:
        if s.config.mesh != mesh:
            raise ValueError(
                f"{API}: {name!r} was wrapped with mesh {s.config.mesh} but the planned model "
                f"with {mesh}; use one data-parallel mesh for the whole model"
            )
        dtypes = sorted({str(mp.orig.dtype).removeprefix("torch.") for mp in s.params})  # type: ignore[union-attr]
        if s.config.mp_policy.param_dtype is None and len(dtypes) > 1:
            raise ValueError(
                f"{API}: block {name!r} mixes parameter dtypes {dtypes}; set "
                "mp_policy.param_dtype to materialize them in one dtype"
            )

    order = {p.fqn: i for i, p in enumerate(plan.params)}
    rank = mesh.get_local_rank()
    for name, _, s in entries:
        s.params.sort(key=lambda mp: order[mp.fqn])  # plan order: identical on every rank
        for mp in s.params:
            _shard_param(mp, mesh, rank)
        s.resolve(fqn=name, rank=rank, coll=collectives_for(mesh.get_group(), s.config.collectives))
    # The planned model is the root of every state under it (FSDP2 picks its root lazily, at the
    # first forward; here resolution already knows it, so running one block alone is fine too).
    root_state = entries[0][2]
    ctx = RootContext(root=root_state, states=[s for _, _, s in entries])
    for _, _, s in entries:
        s.ctx = ctx
        s.is_root = s is root_state


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _shard_param(mp: ManagedParam, mesh: DeviceMesh, rank: int) -> None:
    """Replace the original parameter by its row segment (see [Note: row segments])."""
    pp, orig = mp.plan, mp.orig
    if pp is None or orig is None:
        raise RuntimeError(f"{API}: {mp.fqn!r} is not planned or was already sharded")
    W = mesh.size()
    data = orig.detach()
    if data.is_meta:  # meta-device init: shapes only; model.to_empty(device=...) allocates
        local = torch.empty(pp.local_shape(rank, W), dtype=data.dtype, device="meta")
    else:
        device = _mesh_device(mesh)
        if data.device != device:
            data = data.to(device)
        if pp.owner is None:
            start, end = pp.local_rows(rank, W)
            local = data[start:end].clone()  # own storage: the full tensor can be freed
        elif pp.owner == rank:
            local = data.contiguous()  # the owner keeps the original storage (no copy)
        else:
            local = data.new_empty(pp.local_shape(rank, W))
    sharded = make_sharded_param(local, shape=tuple(pp.shape), mesh=mesh, owner=pp.owner,
                                 kind=pp.placement, requires_grad=orig.requires_grad)
    mp.sharded = sharded
    mp.orig = None
    for m, attr in mp.sites:
        m._parameters[attr] = sharded


# ================================================================================ checks
# Local checks raise before any collective. The one collective check, verify_plan_digest, runs at
# the first fully_shard call of each (plan object, mesh) pair on every rank, *before* any check
# that depends on the plan's content, so that ranks holding different plans all fail together
# instead of some of them raising and the rest hanging in a later collective.
# See also [Note: digest exchange is keyed by plan object].


def _check_call(module: Any, plan: Any, shard_placement_fn: Any, offload_policy: Any) -> None:
    """Argument types and keywords we do not support."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{API}: expects one nn.Module (grouping several modules is not supported), "
            f"got {type(module).__name__}"
        )
    if not isinstance(plan, OwnerPlan):
        raise TypeError(
            f"{API}: plan must be a matrixfsdp OwnerPlan (from matrixfsdp.plan_owners), "
            f"got {type(plan).__name__}"
        )
    if shard_placement_fn is not None:
        raise ValueError(
            f"{API}: shard_placement_fn is not supported, placement comes from the plan "
            f"(got {shard_placement_fn!r}); change placements with matrixfsdp.plan_owners"
        )
    from torch.distributed.fsdp import OffloadPolicy

    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError(
            f"{API}: offload_policy is not supported, got {type(offload_policy).__name__}"
        )


def _check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{API}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"{API}: mesh must be 1-D (the data-parallel shard dimension), got a {mesh.ndim}-D "
            f"mesh of shape {tuple(mesh.shape)}; pass mesh['dp_shard'] or a 1-D mesh"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"{API}: this rank is not part of the mesh {mesh}")


def _check_world_size(plan: OwnerPlan, mesh: DeviceMesh) -> None:
    if plan.world_size != mesh.size():
        raise ValueError(
            f"{API}: the plan was built for world_size={plan.world_size} but the mesh has "
            f"{mesh.size()} ranks; rebuild it with matrixfsdp.plan_owners(model, mesh)"
        )


def _check_not_torch_fsdp(module: nn.Module) -> None:
    """Refuse modules (or submodules) already managed by torch's ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    for name, m in module.named_modules():
        if isinstance(m, FSDPModule):
            where = "the module" if not name else f"submodule {name!r}"
            raise RuntimeError(
                f"{API}: {where} ({type(m).__name__}) is already managed by torch's "
                "torch.distributed.fsdp.fully_shard; matrixfsdp.fully_shard and torch's "
                "fully_shard cannot be mixed in one model"
            )


# [Note: digest exchange is keyed by plan object]
# Whether a call exchanges digests must not depend on the plan's *content*: if it did (say, a
# cache keyed by digest), a rank whose plan happens to equal one verified earlier would skip the
# collective while a rank with a different plan would enter it, and gloo would hang instead of
# raising. We key on the plan *object* (its identity, for as long as it lives), which every rank
# creates at the same program point, so all ranks exchange at the same calls.
_VERIFIED: dict[tuple[int, tuple[int, ...]], Any] = {}

_DIGEST_BYTES = 32


def _verify_plan_digest(plan: OwnerPlan, mesh: DeviceMesh, coll: SegmentCollectives) -> None:
    """All ranks exchange the plan digest (one all-gather of 32 bytes); raise on mismatch."""
    key = (id(plan), tuple(mesh.mesh.flatten().tolist()))
    if key in _VERIFIED:
        return
    mine = torch.frombuffer(bytearray(bytes.fromhex(plan.digest)), dtype=torch.uint8)
    if mine.numel() != _DIGEST_BYTES:
        raise ValueError(f"{API}: malformed plan digest {plan.digest!r}")
    device = torch.device("cpu") if mesh.device_type == "cpu" else torch.device(
        mesh.device_type, torch.accelerator.current_device_index()
    )
    gathered = coll.all_gather_fixed(mine.to(device)).cpu()
    digests = [bytes(row.tolist()).hex() for row in gathered]
    if len(set(digests)) != 1:
        by_rank = ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
        raise RuntimeError(
            f"{API}: the plan differs across ranks ({by_rank}); every rank must build the same "
            "plan (same model, world size and planner arguments, or load one saved plan)"
        )
    _VERIFIED[key] = weakref.finalize(plan, _VERIFIED.pop, key, None)


def _check_param(fqn: str, param: torch.Tensor, plan: OwnerPlan, block: str) -> ParamPlan:
    """The plan entry of ``fqn``, checked against the live parameter and its block."""
    if fqn not in plan:
        raise ValueError(
            f"{API}: parameter {fqn!r} is not in the plan (the plan has {len(plan.params)} "
            f"parameters, digest {plan.digest[:12]}); was the plan built for another model?"
        )
    pp = plan[fqn]
    if tuple(param.shape) != tuple(pp.shape):
        raise ValueError(
            f"{API}: parameter {fqn!r} has shape {tuple(param.shape)} but the plan says "
            f"{tuple(pp.shape)}; was the plan built for another model?"
        )
    dtype = str(param.dtype).removeprefix("torch.")
    if pp.dtype != dtype:
        raise ValueError(
            f"{API}: parameter {fqn!r} has dtype {dtype} but the plan says {pp.dtype}; "
            "plan after casting the model"
        )
    if pp.block != block:
        raise ValueError(
            f"{API}: the plan puts {fqn!r} in block {pp.block!r} but fully_shard was applied "
            f"to {block!r} as its closest enclosing module; plan with the same blocks you wrap"
        )
    return pp


def _check_plan_covered(plan: OwnerPlan, seen: Iterable[str]) -> None:
    """Every planned parameter must exist in the model."""
    seen = set(seen)
    missing = [p.fqn for p in plan.params if p.fqn not in seen]
    if missing:
        raise ValueError(
            f"{API}: the plan has {len(missing)} parameter(s) the model lacks, e.g. "
            f"{missing[0]!r}; was the plan built for another model?"
        )
