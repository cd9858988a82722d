"""``matrixfsdp.fully_shard``: ZeRO-3 with owner placement, applied like torch's FSDP2.

The public surface: ``fully_shard``, the class swap (``engine/swap.py``) with FSDP2's controls,
hook installation. Resolution and checks live in ``init.py``, the hooks' logic in ``state.py``,
a block's buffers and collectives in ``param_group.py``, one parameter's two forms in
``param.py``; what both front-ends share in ``engine/``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import warnings
import weakref
from typing import Any, Iterable, NoReturn

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..comm.collectives import CommCounter, collectives_for
from ..engine.backward import dynamo_disable, in_backward
from ..engine.swap import attach_state, swap_class
from ..placement.owned_tensor import local_tensor, owner_meshes
from ..planner.owner_plan import OwnerPlan
from ..engine.plan_check import check_world_size, plans_agree, verify_plan_digest
from ..engine.reducer import check_find_unused
from ..mesh import default_mesh, mesh_info
from ..planner.rules import MatrixRule, check_rule
from .init import (API, CLAIM_ATTR, _check_call, _check_not_torch_fsdp,
                    _collect_managed, _is_planned_model, _resolve,
                    end_call, get_state, plan_call, resolve_call)
from .state import BlockState, RootContext, ShardConfig

__all__ = ["fully_shard", "MatrixFSDPModule", "UnshardHandle", "comm_counter", "get_state",
           "drop_stale_state", "check_layout"]


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
    plan: OwnerPlan | None = None,
    collectives: str = "all_to_all",
    matrix_rule: MatrixRule | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters as ``plan`` says (owner or even placement), FSDP2-style.

    Takes torch's ``fully_shard`` keywords plus the required ``plan``. Apply it to every block
    the plan names, then to the planned model (see [Note: resolution at the root call]); build
    the optimizer afterwards. Returns ``module``, whose class is swapped to a subclass (of the same
    name) of :class:`MatrixFSDPModule` and its own class, with ``unshard``/``reshard``/``set_requires_gradient_sync``/``set_reshard_after_forward``/
    ``set_modules_to_forward_prefetch``/``set_modules_to_backward_prefetch``.

    * ``reshard_after_forward``: ``None`` means True except for the root (like FSDP2).
    * ``mp_policy``: ``param_dtype`` is the compute (and communication) dtype of materialized
      parameters; owners keep their parameters and optimizer state in the original dtype and
      receive gradients reduced in ``reduce_dtype``.
    * ``shard_placement_fn`` is rejected (placement comes from the plan); ``offload_policy`` must
      be left alone; ``collectives`` picks the implementation (``"all_to_all"``, ``"p2p"``, or ``"two_phase"``:
      owner scatter + ring all-gather, bounded at <= 2x ring volume whatever gamma_B is).
    * ``matrix_rule``: the routing rule of a plan-less (drop-in) call (default ``MatrixRule()``;
      see [Note: one routing rule]); with a ``plan``, pass it to ``plan_owners`` instead.

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
    rule = check_rule(matrix_rule, API)
    if plan is not None and matrix_rule is not None:
        raise ValueError(f"{API}: matrix_rule routes a plan-less call's parameters, but a plan was given "
                         "(its matrix_rule decided already); pass matrix_rule to plan_owners instead")
    if reshard_after_forward not in (None, True, False):
        raise ValueError(
            f"{API}: reshard_after_forward must be None, True or False (resharding to a smaller "
            f"world is not supported), got {reshard_after_forward!r}"
        )
    if get_state(module) is not None:
        raise ValueError(f"{API}: already applied to this {type(module).__name__}")
    _check_not_torch_fsdp(module)
    info = mesh_info(mesh if mesh is not None else default_mesh(API), api=API)
    mesh = info.mesh
    collectives_for(info.shard_group, collectives)  # the kind is checked here, before any state
    if plan is not None:
        verify_plan_digest(plan, info, api=API)  # collective: before any plan-dependent check
        check_world_size(plan, info, api=API)
    owner_meshes(mesh)  # collective on an HSDP mesh (the flattened group), every rank calls

    params = _collect_managed(module, set(ignored_params or ()), mesh)
    config = ShardConfig(info=info, reshard_after_forward=reshard_after_forward,
                         mp_policy=mp_policy, collectives=collectives)
    state = BlockState(module, config, params)
    for mp in params:
        setattr(mp.orig, CLAIM_ATTR, weakref.ref(state))
    attach_state(module, state)
    to_sharded = functools.partial(_to_sharded_hook, state)
    state._hook_handles = [
        module.register_forward_pre_hook(functools.partial(_pre_forward_hook, state),
                                         prepend=True, with_kwargs=True),
        # always_call: post-forward runs even when forward raises (see [Note: stale state])
        module.register_forward_hook(functools.partial(_post_forward_hook, state),
                                     prepend=False, always_call=True),
        # state dicts always see the sharded parameters, also between a forward that kept its
        # unsharded leaves in the slots and its backward (as FSDP2)
        module.register_state_dict_pre_hook(to_sharded),
        module.register_state_dict_pre_hook(functools.partial(_settle_hook, state)),
        module._register_load_state_dict_pre_hook(to_sharded),
    ]
    swap_class(module, MatrixFSDPModule, API)
    if plan is None:  # drop-in: shard this call's parameters now (see [Note: drop-in planning])
        adopted = [s for m in module.modules() if (s := get_state(m)) is not None and s is not state]
        call_plan = plan_call(params, info, state, adopted, module, rule) if params else None
        if call_plan is not None:
            if plans_agree(call_plan, info) is not None:  # every rank alike
                # The earlier calls still pending are held weakly; a model dropped in a reference
                # cycle may be collected on some ranks only, so their tallies differ. Collect on
                # every rank and plan once more; a second mismatch is a real one.
                gc.collect()
                call_plan = plan_call(params, info, state, adopted, module, rule)
                verify_plan_digest(call_plan, info, api=API)
        resolve_call(module, state, call_plan, info, rule)
        end_call(state, info, adopted)
    elif _is_planned_model(module, plan):
        _resolve(module, plan, info)
    return module


def comm_counter(module: nn.Module, role: str = "shard") -> CommCounter:
    """The call/byte counter of the collectives ``module``'s blocks use (shared per mesh) over
    the ``role`` dimension: ``"shard"`` (the owner group) or, on an HSDP mesh, ``"replicate"``.

    Example::

        c = comm_counter(model); c.reset()
        loss.backward(); print(c.calls["reduce_scatter"], c.bytes_sent)
    """
    state = _state_of(module, "matrixfsdp.comm_counter")
    info = state.config.info
    if role not in ("shard", "replicate"):
        raise ValueError(f"matrixfsdp.comm_counter: role must be 'shard' or 'replicate', got {role!r}")
    if role == "replicate" and not info.is_hsdp:
        raise ValueError("matrixfsdp.comm_counter: role='replicate' needs an HSDP (2-D) mesh")
    group = info.shard_group if role == "shard" else info.replicate_group
    return collectives_for(group, state.config.collectives).counter


def drop_stale_state(module: nn.Module) -> None:
    """Reshard leftovers of unfinished iterations under ``module``'s root (see [Note: stale
    state] in ``state.py``) and check the parameter layout (meta parameters raise, layouts
    swapped by torch code are repaired); a no-op for modules matrixfsdp does not manage. Call on
    every rank."""
    for m in module.modules():
        state = get_state(m)
        if state is not None and state.ctx is not None and not in_backward():
            if not state.ctx.awaiting_backward:
                state.ctx.begin_iteration()
            check_layout(state.ctx)
            return


def materialized_modules(module: nn.Module) -> list[str]:
    """Names of the ``fully_shard`` modules under ``module`` that hold materialized (unsharded)
    parameters, or whose root awaits a backward: state dicts and checkpoints taken now would not
    see what the pending backward will read. Local, no collective."""
    out = []
    for name, m in module.named_modules():
        st = get_state(m)
        if st is not None and st.resolved and (st.root_ctx.awaiting_backward or not st.group.is_resharded):
            out.append(name or "<root>")
    return out


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` completes it (like FSDP2's)."""

    def __init__(self, state: BlockState | None):
        self._state = state

    def wait(self) -> None:
        if self._state is not None:
            self._state.group.wait_for_unshard()
            self._state.group.to_unsharded()
            self._state = None


class MatrixFSDPModule:
    """Mixin placed first in the MRO of ``fully_shard``-ed modules (the swapped class keeps the user's class name)."""

    # [Orig (swapped), MatrixFSDPModule, Orig, ...]
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
        state.group.unshard(async_op=async_op)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def sync_params(self) -> None:
        """Bring every replica's parameters up to date now (HSDP ``split``: the step replicas'
        values since the last ``step()``; a collective then, a no-op otherwise). Call on every
        rank; ``state_dict()``, checkpoints and ``full_tensor()`` do it themselves."""
        state = _state_of(self, "sync_params")  # type: ignore[arg-type]
        if state.ctx is not None and state.ctx.exchange is not None and not in_backward():
            state.ctx.exchange.settle()

    def comm_counter(self, role: str = "shard") -> CommCounter:
        """:func:`comm_counter` of this module (``replicate``'s spelling, the same counter)."""
        return comm_counter(self, role)  # type: ignore[arg-type]

    def reshard(self) -> None:
        """Free the materialized parameters (owners keep their own storage)."""
        state = _state_of(self, "reshard")  # type: ignore[arg-type]
        if state.resolved:
            state.group.reshard()

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

    def reduce_accumulated_grads(self) -> int:
        """Reduce the gradients accumulated under ``set_requires_gradient_sync(False)`` now, one
        reduction per block, without a backward; returns the number of reductions. Call on every
        rank, outside backward, on the root (every block under it). For schedules that run one
        backward per microbatch and have no hook for a last synced one, such as torch's pipelining
        schedules (they call FSDP2's controls on torch ``FSDPModule``s only).

        Example::

            stage.submod.set_requires_gradient_sync(False)
            schedule.step(x, target=y)                  # every microbatch accumulates locally
            stage.submod.set_requires_gradient_sync(True)
            stage.submod.reduce_accumulated_grads()     # one reduction per block
        """
        state = _state_of(self, "reduce_accumulated_grads")  # type: ignore[arg-type]
        if state.ctx is None or state is not state.ctx.root:
            raise ValueError(f"{API}.reduce_accumulated_grads: call it on the root (the planned model), "
                             f"got block {state.fqn!r}")
        return state.ctx.reduce_accumulated()

    def set_find_unused_parameters(self, find_unused_parameters: bool, *, recurse: bool = True) -> None:
        """``False`` promises that every parameter gets a gradient on some rank in every step
        (DDP's ``find_unused_parameters=False``): a rank that did not use a parameter then takes
        the reduced gradient without reading the usage flags, so backward has no host sync at all
        (if the promise is broken, a parameter no rank used gets a zero gradient instead of
        ``None``). Default ``True``: one small asynchronous flag read per step, only where this
        rank left a parameter unused (see [Note: usage-flag host read] in ``engine/reducer.py``)."""
        find = check_find_unused(find_unused_parameters, "matrixfsdp.fully_shard")
        for state in self._states(recurse):
            state.group.find_unused = find

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many gradient reductions may still hold their input buffer (about a block's
        gradients) when the next block copies its gradients in (FSDP2's method of the same name
        and default, 1). With 1 the compute stream waits for the previous block's reduction
        before the next copy-in, which reuses its memory; a larger cap removes that wait where
        the reduction is exposed, at one more block-sized buffer of peak memory each. Read from
        the root (the planned model)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) or max_input_buffers < 1:
            raise ValueError(f"{API}.set_reduce_scatter_max_input_buffers: max_input_buffers must be an int "
                             f">= 1, got {max_input_buffers!r}")
        for state in self._states(recurse):
            state.reduce_inputs_cap = max_input_buffers

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

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``to()``, ``float()``, ...: a conversion that keeps every managed parameter's dtype and
        device is a no-op. torch would still hand each parameter a copy (``.to("cpu:0")`` copies
        CPU tensors, DTensor's ``.to(its own dtype)`` too; Trainer moves the model to
        ``args.device``), and the copies are not the storage the blocks' buffers and the owners'
        leaves were built on: the owners would go on computing with the old values."""
        params = [mp.sharded for s in self._states(recurse) for mp in s.params if mp.sharded is not None]
        if params and all(_keeps_dtype_and_device(fn, local_tensor(p)) for p in params):
            return self
        return super()._apply(fn, recurse)  # type: ignore[misc]

    def share_memory(self) -> "MatrixFSDPModule":
        raise TypeError(f"{API}: share_memory() is not supported: each rank holds its own shards "
                        "(share the unsharded model before fully_shard)")

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
                f"{API}: to_empty on {type(self).__name__} before its blocks were resolved; call "  # type: ignore[arg-type]
                "matrixfsdp.fully_shard on the planned model first"
            )
        dev = torch.device(device) if device is not None else torch.get_default_device()
        for ctx in {id(s.ctx): s.ctx for s in states if s.ctx is not None}.values():
            ctx.begin_iteration()  # nothing of an earlier iteration may point at the old storage
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
                s.group.to_sharded()  # puts every mp.sharded back
        for s in states:
            s.move_to(dev)
        _mark_fresh(states)
        return self

    def _states(self, recurse: bool) -> list[BlockState]:
        mods = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [s for m in mods if (s := get_state(m)) is not None]


# ================================================================================ hooks
def _keeps_dtype_and_device(fn: Any, t: torch.Tensor) -> bool:
    """Whether ``fn`` maps a tensor of ``t``'s dtype and device to the same dtype and device."""
    probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
    return isinstance(probe, torch.Tensor) and probe.dtype == t.dtype and probe.device == t.device


@dynamo_disable
def _pre_forward_hook(state: BlockState, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    _lazy_init(state)
    return state.pre_forward(args, kwargs)


@dynamo_disable
def _post_forward_hook(state: BlockState, module: nn.Module, args: Any, output: Any) -> Any:
    return state.post_forward(output)


def _settle_hook(state: BlockState, *args: Any, **kwargs: Any) -> None:
    """State dicts see every replica's current values (HSDP split, see [Note: deferred gathers])."""
    if state.ctx is not None and state.ctx.exchange is not None and not in_backward():
        state.ctx.exchange.settle()


def _to_sharded_hook(state: BlockState, *args: Any, **kwargs: Any) -> None:
    if state.resolved:
        state.group.to_sharded()


def _lazy_init(state: BlockState) -> None:
    """Checks deferred to the first forward/unshard (the root context itself is built at
    resolution, when the planned model and all its blocks are known)."""
    if not state.resolved:
        raise RuntimeError(
            f"{API}: {type(state.module).__name__} was registered but never resolved against "
            "its plan; after wrapping the blocks, call matrixfsdp.fully_shard on the planned "
            "model (the module given to plan_owners) before running forward"
        )
    ctx = state.root_ctx
    if state is ctx.root and not in_backward():
        check_layout(ctx)  # once per iteration, at the root's forward outside backward
        if ctx.fresh is not None:  # the first forward after to_empty only
            _warn_unwritten(ctx)
    if not ctx.checked:
        # torch's fully_shard applied after ours would otherwise fail obscurely (or silently).
        _check_not_torch_fsdp(ctx.root.module)
        ctx.checked = True


# [Note: unwritten parameters]
# After meta-device init, ``to_empty`` storage holds whatever memory held; a parameter nobody
# initializes (a missed ``set_full_``, a checkpoint without that key) trains on garbage or NaN,
# silently, on every step (stock FSDP2 is equally silent). ``to_empty`` fills every segment it
# allocates with NaN and records its version counter; the first root forward warns, naming them,
# about segments whose counter has not moved *and* which are still all NaN (writes through
# ``.data`` bypass the counter, hence the content check, run on those candidates only). Local,
# no collective: each rank names the segments it holds. A warning, not an error: a raise on the
# owner ranks only would leave the others waiting in the forward's collectives. After that
# forward the check costs one ``is None`` test per root forward.
_UNWRITTEN = "parameters never written since to_empty"


def _mark_fresh(states: list[BlockState]) -> None:
    mine = {id(s) for s in states}
    for ctx in {id(s.ctx): s.ctx for s in states if s.ctx is not None}.values():
        fresh = []
        for s in ctx.states:
            if id(s) not in mine:
                continue
            for mp in s.params:
                local = mp.local
                if local.numel() and local.is_floating_point():
                    local.fill_(float("nan"))
                    fresh.append((mp, local, local._version))
        ctx.fresh = fresh


def _warn_unwritten(ctx: RootContext) -> None:
    fresh, ctx.fresh = ctx.fresh or [], None
    # storage swapped since (a checkpoint load, repair_layout) counts as written
    candidates = [(mp.fqn, t) for mp, t, v in fresh if mp.local is t and t._version == v]
    if not candidates:
        return
    with torch.no_grad():
        flags = torch.stack([t.isnan().all() for _, t in candidates]).tolist()  # one host sync
    unwritten = [fqn for (fqn, _), nan in zip(candidates, flags) if nan]
    if unwritten:
        warnings.warn(
            f"{API}: {len(unwritten)} {_UNWRITTEN} (still NaN): {', '.join(unwritten[:8])}"
            f"{', ...' if len(unwritten) > 8 else ''}; initialize them with matrixfsdp.set_full_ or load "
            "a checkpoint after model.to_empty(...) (see docs/fully_shard.md, meta-device init)",
            stacklevel=4)


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

