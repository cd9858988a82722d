"""Hooks and ordering: when each block unshards, reshards and reduces (FSDP2's execution model).

A :class:`BlockState` is created by every ``matrixfsdp.fully_shard`` call and owns the block's
:class:`~.param_group.ParamGroup`. All block states under one root share a
:class:`RootContext`, built when the root call resolves the plan. Per training step, per block::

    pre-forward    unshard (prefetched by the previous block), put the unsharded leaves in the
                   module's slots, pass the inputs that require grad through a post-backward hook
    post-forward   reshard if reshard_after_forward (else keep the leaves in the slots); wrap the
                   outputs that require grad through a pre-backward hook; always runs, also if forward raised
    pre-backward   (the outputs' hook) unshard again, prefetch the previous block
    post-backward  (the inputs' hook, or the root's final callback for blocks whose
                   inputs need no grad) take the leaves' ``.grad``, reshard, issue the reduction
    final callback post-backward of what is left, finish every reduction, reshard everything

[Note: gradient path]
The unsharded parameters are leaves (see ``param.py``), so autograd's ``AccumulateGrad`` writes
their ``.grad`` exactly as for an unsharded model; nothing else produces gradients. A backward that
does not accumulate into leaves (``torch.autograd.grad``, ``backward(inputs=...)``) leaves every
``.grad`` alone and issues no reduction: the root's :class:`~..engine.backward.BackwardTracker`
decides at the first pre-backward (see [Note: backward tracking]; the pre-backward hooks carry its
anchor).
Double backward: ``torch.autograd.grad(..., create_graph=True)`` builds a graph that holds the
unsharded leaves, so the root *pins* every block unsharded until the next accumulating backward
has finished; that backward defers every reduction to its final callback (second-order
contributions may reach a leaf after its block's post-backward) and reduces the blocks in a fixed
order there, giving the single-process gradients. ``backward(create_graph=True)`` (higher-order
gradients *into* ``.grad``) raises on every rank at its first pre-backward.

[Note: backward ordering]
The post-backward hook wraps the block's inputs, so it runs once the gradients of the inputs
are complete; autograd runs every ``AccumulateGrad`` that is ready before any node created earlier
in forward, so the block's leaf gradients are in place then. The order of pre-backward,
post-backward and final callback follows autograd's data dependencies, identical on every rank,
which is what [Note: ordering of collectives] needs. Blocks whose inputs need no gradient (the root,
which takes token ids) are post-backwarded by the final callback in a fixed order. Ranks must run
the same blocks forward and backward (as with FSDP2); which *parameters* get a gradient may differ
(see [Note: unused parameters]). At most ``max_reduce_inputs`` reductions (default
``MAX_REDUCE_INPUTS``, one: FSDP2's default) hold their input buffers when a new block's gradients
are copied in: the oldest input is released first, which waits (on an accelerator, the compute
stream) for its reduce-scatter only, not for the HSDP replica phase after it, and its memory is
reused for the next (FSDP2's ``set_reduce_scatter_max_input_buffers`` dial, same name and
meaning). Reduced gradients land with a lag of at most ``MAX_REDUCES_IN_FLIGHT`` reductions.

[Note: stale state]
Nothing depends on garbage collection or on which outputs a rank kept. Some iterations never finish
a backward: an exception escapes it (autograd drops the queued final callback), an output is
discarded, a forward raises. Post-forward runs even when forward raises (``always_call``), and the
root's pre-forward outside backward -- the one point every rank passes at the start of an iteration
-- calls :meth:`RootContext.begin_iteration`: after an aborted backward it waits for the reductions
already issued (on every rank) and drops them with the partial leaf gradients, it resolves pending
usage flags, and it reshards *every* block. Resharding a block whose forward still awaits a
backward (several forwards before one backward) is safe: its pre-backward refills the same storage
with the same values, so it costs one more gather and never uses stale weights after an optimizer
step. The checkpoint helpers call it too (``drop_stale_state``).

Activation checkpointing (non-reentrant, torch's or Hugging Face's) works as with FSDP2: a forward
pre-hook running while the block is in its backward is a recomputation; the unsharded leaves are
already in the slots (pre-backward put them there), so the recomputation saves exactly what the
original forward saved and gradients reach the same leaves.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..engine.backward import BackwardTracker, dynamo_disable, in_backward, wrap_grad_tensors
from ..engine.exchange import Exchange
from ..mesh import MeshInfo

from ..comm.collectives import SegmentCollectives
from .param import ManagedParam
from ..engine.reducer import PinnedStaging, Reducer, read_flags
from .param_group import BlockReduce, CommContext, ParamGroup, ReplicaComm, land_grad

__all__ = ["ShardConfig", "BlockState", "RootContext", "TrainingState", "MAX_REDUCES_IN_FLIGHT",
           "MAX_REDUCE_INPUTS"]

#: default cap on reductions holding their input buffer (about the block's size) when the next
#: one copies in: FSDP2's default, one
MAX_REDUCE_INPUTS = 1
#: reductions issued but not finished (their results are this rank's chunks, small): the oldest
#: lands its gradients when a new one would exceed this, so the replica phase has a block of slack
MAX_REDUCES_IN_FLIGHT = 2


@dataclass(frozen=True)
class ShardConfig:
    """What a ``fully_shard`` call asked for (replaced, never mutated, by the setters)."""

    info: MeshInfo  #: the mesh's roles (see [Note: mesh roles])
    reshard_after_forward: bool | None  # None: True, except for the root (like FSDP2's default)
    mp_policy: MixedPrecisionPolicy
    collectives: str = "all_to_all"

    @property
    def mesh(self) -> DeviceMesh:
        return self.info.mesh


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


@dataclass(eq=False)
class RootContext:
    """State shared by all blocks under one root."""

    root: "BlockState"
    states: list["BlockState"]
    comm: CommContext
    #: Recorded during the first forward: pre-forward order (forward prefetch: the next one) and
    #: post-forward order (backward runs in its reverse: backward prefetch is the previous one).
    forward_order: list["BlockState"] = field(default_factory=list)
    post_forward_order: list["BlockState"] = field(default_factory=list)
    order_complete: bool = False
    checked: bool = False  # first-forward checks done
    pinned: bool = False  # blocks stay unsharded for a double backward
    #: a grad-mode forward ran since the last backward or iteration start (checkpoint helpers
    #: refuse to touch parameters a pending backward would read)
    awaiting_backward: bool = False
    pending: list[BlockReduce] = field(default_factory=list)
    #: gradients of parameters this rank did not use, awaiting the summed usage flags (``None``:
    #: an HSDP split parameter another replica steps, see [Note: step receipts])
    undecided: list[tuple[nn.Parameter, torch.Tensor | None, torch.Tensor]] = field(default_factory=list)
    #: HSDP split: the step replicas' values to the other owners (see [Note: deferred gathers])
    exchange: Exchange | None = None
    #: set by ``to_empty``: (param, local storage, its version counter) of every non-empty floating
    #: segment it allocated (NaN-filled); checked once at the next root forward, then None
    #: (see [Note: unwritten parameters] in ``api.py``)
    fresh: list[tuple[Any, torch.Tensor, int]] | None = None

    def __post_init__(self) -> None:
        #: the anchor, the running backward and its final callback (see [Note: backward tracking])
        self.backward = BackwardTracker(self.comm.device, "matrixfsdp.fully_shard")
        #: the flag reads' host buffer, reused every step (accelerators)
        self.staging = PinnedStaging()

    @property
    def accumulating(self) -> bool:
        """Whether the running backward accumulates into ``.grad`` (see [Note: gradient path])."""
        return self.backward.accumulating

    # ---------------------------------------------------------------------------- iteration
    def begin_iteration(self) -> None:
        """Bring every block to a clean between-iterations state (see [Note: stale state]).

        Called outside backward, on every rank at the same program point; issues no collective
        of its own, it only waits for collectives already issued on every rank.
        """
        if self.backward.take_aborted():  # an exception escaped the last backward
            pending, self.pending = self.pending, []
            for p in pending:
                Reducer.drop(p.pending)  # the engine's abort: issued on every rank, result dropped
            self.undecided = []
            for s in self.states:
                s.group.drop_grads()
        self.pinned = False
        self.awaiting_backward = False
        for s in self.states:
            if not s.group.is_resharded:
                s.group.reshard()
            s.training_state = TrainingState.IDLE

    def on_backward_start(self) -> None:
        """At every pre-backward: the first one of a backward decides its mode."""
        tracker = self.backward
        if tracker.is_current():
            return
        create_graph = torch.is_grad_enabled()
        accumulating = tracker.will_accumulate()
        if create_graph and accumulating:
            tracker.refuse_create_graph()
        tracker.start(accumulating)
        if create_graph:
            self.pinned = True
        tracker.queue_final_callback(self.final_callback)

    @dynamo_disable
    def final_callback(self) -> None:
        """After the whole backward: remaining post-backwards, every reduction, reshard."""
        try:
            for s in reversed(self.states):  # fixed order: same on every rank
                if s.training_state is TrainingState.PRE_BACKWARD:
                    s.post_backward()
            if self.pinned and self.accumulating:
                for s in reversed(self.states):
                    if s.group.trainable and s.group.has_unsharded_grads():
                        self.issue_reduce(s, s.group.take_grads())
                self.pinned = False
            while self.pending:
                self.finish_oldest()
            # one asynchronous flag read, waited for after the reshards are enqueued (see
            # [Note: usage-flag host read])
            entries, self.undecided = self.undecided, []
            read = read_flags(entries, staging=self.staging)
            for s in self.states:
                if not self.pinned and not s.group.is_resharded:
                    s.group.reshard()
                s.training_state = TrainingState.IDLE
            read.resolve(land_grad)
            if self.exchange is not None and self.accumulating:
                self.exchange.mark_stale()  # a step may follow (see [Note: deferred gathers])
        finally:
            self.backward.finished()
            self.awaiting_backward = self.pinned

    # ---------------------------------------------------------------------------- reductions
    def reduce_accumulated(self) -> int:
        """Reduce every block's no-sync accumulation now, one reduction per block that holds one
        (see ``MatrixFSDPModule.reduce_accumulated_grads``); returns how many. Outside backward,
        on every rank at the same point: every rank ran the same blocks' backwards, so the same
        blocks hold an accumulation and the reductions match."""
        if in_backward():
            raise RuntimeError("matrixfsdp.fully_shard: reduce_accumulated_grads() was called inside a "
                               "backward; call it after the backward passes have finished")
        n = 0
        for s in reversed(self.states):  # fixed order: the same on every rank
            if s.group.accum is not None:
                self._make_room()
                p = s.group.reduce([None] * len(s.group.trainable), sync=True,
                                   divide_factor=s.gradient_divide_factor)
                if p is not None:
                    self.pending.append(p)
                    n += 1
        while self.pending:
            self.finish_oldest()
        entries, self.undecided = self.undecided, []
        read_flags(entries, staging=self.staging).resolve(land_grad)
        if n and self.exchange is not None:
            self.exchange.mark_stale()  # a step may follow (see [Note: deferred gathers])
        return n

    @property
    def max_reduce_inputs(self) -> int:
        """Reductions that may hold their input when the next copies in (the root's setting)."""
        return self.root.reduce_inputs_cap

    def _make_room(self) -> None:
        """Before a new input is allocated: release the oldest inputs until it fits under the cap
        (the copy-in reuses their memory, as FSDP2's), and land the oldest results beyond
        ``MAX_REDUCES_IN_FLIGHT``."""
        held = [p.pending for p in self.pending if p.pending.inp is not None]
        while len(held) >= self.max_reduce_inputs:
            held.pop(0).release_input()
        while len(self.pending) >= max(MAX_REDUCES_IN_FLIGHT, self.max_reduce_inputs):
            self.finish_oldest()

    def issue_reduce(self, state: "BlockState", grads: list[torch.Tensor | None]) -> None:
        if state.requires_gradient_sync:
            self._make_room()
        p = state.group.reduce(grads, sync=state.requires_gradient_sync,
                               divide_factor=state.gradient_divide_factor)
        if p is not None:
            self.pending.append(p)

    def finish_oldest(self) -> None:
        p = self.pending.pop(0)
        undecided = p.group.finish(p)
        if p.group.find_unused:
            self.undecided.extend(undecided)  # resolved at the end of backward, one host read
        else:  # set_find_unused_parameters(False): the reduced sum, unread
            for param, grad, _ in undecided:
                land_grad(param, grad)


class BlockState:
    """Runtime state of one ``matrixfsdp.fully_shard``-ed module (see module docstring)."""

    def __init__(self, module: nn.Module, config: ShardConfig, params: list[ManagedParam]):
        self.module = module
        self.config = config
        self.params = params
        self.group = ParamGroup(params, config.mp_policy)
        self.fqn: str | None = None  # set at resolution
        self.resolved = False
        self.requires_gradient_sync = True
        self.gradient_divide_factor: float | None = None  # None: W (the DDP average)
        #: the root's is used: see ``set_reduce_scatter_max_input_buffers``
        self.reduce_inputs_cap = MAX_REDUCE_INPUTS
        self.forward_prefetch: list[BlockState] | None = None
        self.backward_prefetch: list[BlockState] | None = None
        self.ctx: RootContext | None = None
        self.is_root: bool | None = None
        self.training_state = TrainingState.IDLE
        self._hook_handles: list[Any] = []
        #: a plan-less call's owned bytes per rank (see [Note: drop-in planning] in ``init.py``)
        self.dropin_loads: list[float] | None = None

    @property
    def root_ctx(self) -> RootContext:
        """The shared root context (set when the planned model is resolved)."""
        if self.ctx is None:
            raise RuntimeError(f"matrixfsdp.fully_shard: block {self.fqn!r} has no root context; was the planned "
                               "model passed to matrixfsdp.fully_shard?")
        return self.ctx

    def resolve(self, *, fqn: str, rank: int, coll: SegmentCollectives, comm: CommContext,
                replicas: ReplicaComm | None = None) -> None:
        self.fqn = fqn
        self.group.resolve(fqn=fqn, rank=rank, coll=coll, comm=comm, replicas=replicas)
        self.resolved = True

    # ============================================================================ prefetch order
    def _reshard_after_forward(self) -> bool:
        raf = self.config.reshard_after_forward
        return (not self.is_root) if raf is None else raf

    def _forward_targets(self) -> list["BlockState"]:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        ctx = self.ctx
        if ctx is None or not ctx.order_complete or self not in ctx.forward_order:
            return []
        i = ctx.forward_order.index(self)
        return ctx.forward_order[i + 1: i + 2]

    def _backward_targets(self) -> list["BlockState"]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        ctx = self.ctx
        if ctx is None or not ctx.order_complete or self not in ctx.post_forward_order:
            return []
        i = ctx.post_forward_order.index(self)
        return ctx.post_forward_order[i - 1: i] if i > 0 else []

    # ============================================================================ forward
    def pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        ctx = self.root_ctx
        in_bwd = in_backward()
        if in_bwd and self.training_state is TrainingState.PRE_BACKWARD:
            # Recomputation inside backward (activation checkpointing): the leaves are in place.
            self.group.wait_for_unshard()
            self.group.to_unsharded()
            return args, kwargs
        if self.is_root and not in_bwd:
            ctx.begin_iteration()
            if ctx.exchange is not None:
                ctx.exchange.issue()  # every block's, now; each unshard waits for its own
        self.training_state = TrainingState.FORWARD
        if not ctx.order_complete and self not in ctx.forward_order:
            ctx.forward_order.append(self)
        self.group.unshard()
        for target in self._forward_targets():
            target.group.unshard()
        self.group.wait_for_unshard()
        args, kwargs = self._cast_inputs(args, kwargs)
        self.group.refresh_trainable()
        self.group.to_unsharded()
        if torch.is_grad_enabled():
            args, kwargs = wrap_grad_tensors(self.post_backward, None, (args, kwargs))
        return args, kwargs

    def post_forward(self, output: Any) -> Any:
        if in_backward() and self.training_state is TrainingState.PRE_BACKWARD:
            return output  # recomputation: the block stays unsharded for its backward
        if self._reshard_after_forward() or not torch.is_grad_enabled():
            # Without autograd no backward follows: keeping full params would leave them stale
            # after the next optimizer step.
            self.group.reshard()
        self.training_state = TrainingState.IDLE
        ctx = self.root_ctx
        if not ctx.order_complete:
            if self not in ctx.post_forward_order:
                ctx.post_forward_order.append(self)
            ctx.order_complete = bool(self.is_root)
        if output is None:
            return None
        if torch.is_grad_enabled():
            wrapped = wrap_grad_tensors(self.pre_backward, ctx.backward.anchor, output)
            ctx.awaiting_backward |= wrapped is not output
            output = wrapped
        return self._cast_output(output)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        mp = self.config.mp_policy
        if not (mp.cast_forward_inputs and mp.param_dtype):
            return args, kwargs
        return _cast_floating((args, kwargs), mp.param_dtype)

    def _cast_output(self, output: Any) -> Any:
        dt = self.config.mp_policy.output_dtype
        return output if dt is None else _cast_floating(output, dt)

    # ============================================================================ backward
    @dynamo_disable
    def pre_backward(self) -> None:
        ctx = self.root_ctx
        ctx.on_backward_start()
        if self.training_state is TrainingState.PRE_BACKWARD:
            return  # once per backward, whichever forward's outputs get their gradient first
        self.training_state = TrainingState.PRE_BACKWARD
        self.group.unshard()
        for target in self._backward_targets():
            if target.training_state is not TrainingState.POST_BACKWARD:
                target.group.unshard()
        self.group.wait_for_unshard()
        self.group.to_unsharded()

    @dynamo_disable
    def post_backward(self) -> None:
        ctx = self.root_ctx
        self.training_state = TrainingState.POST_BACKWARD
        if ctx.pinned:
            return  # reduced by the final callback (see [Note: gradient path])
        if ctx.accumulating and self.group.trainable:
            grads = self.group.take_grads()
            self.group.reshard()
            ctx.issue_reduce(self, grads)
        else:
            self.group.reshard()  # frozen blocks too: ZeRO-3's memory saving

    # ============================================================================ layout upkeep
    def repair_layout(self) -> None:
        """Restore the runtime's parameter representation after torch code replaced it.

        torch's ``nn.Module.to_empty``/``_apply`` called on a module that is not ours (an outer
        wrapper, an inner submodule) swaps our DTensors for ones DTensor's dispatch built: they lose
        the :class:`Owned` metadata, and ranks outside an owned tensor's one-rank mesh get a 1-D
        ``tensor([])`` instead of their ``[0, ...]`` segment. Data of correctly shaped segments is
        kept; wrong empty segments are re-created; the buffers follow the parameters' device and
        dtype (``model.to(torch.float64)`` after sharding).
        """
        g = self.group
        swapped = [mp.check_layout(self.config.info, str(self.fqn))
                   for mp in self.params]
        devices = {mp.local.device for mp in self.params}
        if len(devices) > 1:
            raise RuntimeError(f"matrixfsdp.fully_shard: block {self.fqn!r} has parameters on several "
                               f"devices {sorted(map(str, devices))}; move the whole model with to_empty")
        device = next(iter(devices)) if devices else g._recv.device
        retyped = g.refresh_dtypes()  # always evaluated: model.to(dtype) also swaps tensors
        if any(swapped) or retyped or g._recv.device != device:
            g.reshard()
            g.realloc(device)

    def move_to(self, device: torch.device) -> None:
        """Give every parameter fresh, uninitialized storage on ``device`` (``to_empty``; see
        [Note: meta-device initialization] in ``init.py``); unreduced accumulation is dropped."""
        for mp in self.params:
            local = mp.local
            mp.swap_local(torch.empty(local.shape, dtype=local.dtype, device=device), self.config.mesh)
        if self.ctx is not None and self.ctx.exchange is not None:
            self.ctx.exchange.mark_current()  # fresh storage: initialized (or loaded) on every replica
        self.group.accum = None
        self.group.realloc(device)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    flat, spec = tree_flatten(tree)
    return tree_unflatten([x.to(dtype) if isinstance(x, torch.Tensor) and torch.is_floating_point(x)
                           and x.dtype != dtype else x for x in flat], spec)
