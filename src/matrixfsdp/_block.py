"""Execution of one wrapped block: materialize, compute, reshard, reduce.

A :class:`BlockState` is created by every ``matrixfsdp.fully_shard`` call. Once the root call has
resolved the plan (``_runtime.py``), it knows its parameters, their :class:`BlockLayout` and the
:class:`SegmentCollectives` of the mesh, and it runs the hooks below. All block states under one
root share a :class:`RootContext`, built when the root call resolves the plan (FSDP2 finds its
root lazily at the first forward; here resolution already knows it).

Per training step, for each block (``W`` = data-parallel world size, ``r`` = this rank)::

    pre-forward   unshard: one all_gather_segments of the block's chunks (issued early when
                  prefetched), copy-out of multi-piece params, swap module params to full tensors
                  returned by ``_Materialize`` (an autograd.Function), prefetch the next block
    post-forward  reshard (free non-owned storage) if reshard_after_forward; hook outputs
    pre-backward  (first output-grad hook) re-materialize into the same storage; prefetch the
                  previous block
    post-backward ``_Materialize.backward``: one reduce_scatter_segments of all the block's
                  gradients (+ usage flags) issued async, then reshard; the result is divided by
                  ``W`` and written to the sharded ``.grad`` when the next reduction is issued or at
                  the root's final callback.

[Note: owner buffer lifetime]
The owner of a parameter computes on its *own storage*: the full tensor it uses in forward and
backward is a view of the sharded parameter's local tensor (when the compute dtype equals the
parameter dtype), never a copy, and reshard never frees it. Everything else lives in two per-block
buffers, ``_recv`` (peers' chunks, rank-major, plus a self region used only for mixed-precision
casts) and ``_assembled`` (multi-piece even params), which are allocated once and keep their
identity for the life of the block: reshard shrinks their storage to 0 bytes
(``untyped_storage().resize_(0)``) and unshard grows it back and refills it *in the same storage*.
Views saved by autograd in forward therefore stay valid after a reshard-after-forward: backward's
pre-hook re-materializes the same values into the same addresses before any saved view is read.
Writes into the buffers are wrapped in ``_unsafe_preserve_version_counter`` so the refill does not
look like an in-place modification to autograd. The owner's storage is only modified by the
optimizer, after backward, when no saved view from that step is left. Under mixed precision the
owner computes on a low-precision copy in the self region (the fp32 master stays untouched) and
that copy is freed and re-cast like peers' data.

[Note: backward ordering]
``_Materialize`` takes the block's forward inputs that require grad and returns them unchanged
alongside the parameters. Its backward therefore runs only when the gradients of *all* the
block's parameters *and* of its inputs are complete, and the gradient that flows on to the
previous block is released by it. So on every rank the order is: pre-backward(k) (gather k-1 as
prefetch) -> backward of block k -> reduce-scatter(k) -> pre-backward(k-1) -> ... independent of
timing, which is what [Note: ordering of collectives] needs. Ranks must still run the same blocks
forward and backward in a step (as with FSDP2); which *parameters* of a block get a gradient may
differ across ranks (see [Note: unused parameters]).

[Note: stale state]
Some iterations never reach the end of a backward: an exception escapes it (and autograd drops
the queued final callback), an output is discarded without backward, a no-grad forward of a block
prefetches the next block that then does not run. Left alone, blocks would stay "in backward"
(later forwards taken for activation-checkpoint recomputes, gradients lost) or keep gathered
copies taken before the next optimizer step (stale weights). ``_Materialize`` counts a forward as
done when its graph is freed without backward (a weakref finalizer), and at the root's pre-forward
outside backward -- the one point every rank passes at the start of an iteration -- and in the
checkpoint helpers, ``RootContext.drop_stale`` reshards every block with no forward awaiting
backward and, after an aborted backward, waits for and drops its in-flight reduction.

[Note: unused parameters]
Gradient usage may differ across ranks (data-dependent branches), so a rank cannot decide alone
to skip a parameter. Every reduction carries one usage flag per reduced parameter in each
destination's chunk (1 if this rank produced a gradient, summed by the same reduce-scatter), and a
missing gradient contributes zeros. After the reduction every rank knows how many ranks used each
parameter: if none did, ``.grad`` is left untouched (``None`` stays ``None``, exactly like a
single-process run, so optimizers skip it); otherwise ``.grad`` gets ``sum / W`` (``sum / factor``
after ``set_gradient_divide_factor``; zeros from the ranks that did not use it, like DDP). The
decision is identical on all ranks, so grads of a parameter are ``None`` everywhere or set
everywhere (empty local on non-owners).
Frozen parameters (``requires_grad=False``; the set is re-read at every forward) are materialized
but never reduced.

[Note: meta-device initialization]
As with FSDP2, a model may be built under ``torch.device("meta")``, planned (the planner only
reads shapes) and sharded: resolution then creates meta DTensors with each rank's segment shape
and allocates nothing. ``MatrixFSDPModule.to_empty`` gives every parameter fresh storage of that
shape on the device (swapping contents into the same parameter objects, so optimizers built
earlier keep working) and re-creates the block buffers there. It handles our parameters itself
because DTensor's dispatch, on a rank outside an owned parameter's one-rank mesh, returns a 1-D
``tensor([])`` (a scalar for 0-dim parameters) instead of the ``[0, ...]`` segment every layout
computation assumes, and because torch's swap drops the :class:`Owned` metadata. For the same
reason initialization goes through ``set_full_`` (full tensors computed alike on every rank) or a
checkpoint load, not ``torch.nn.init`` on the DTensors (``trunc_normal_`` raises on non-owners).
If torch code swaps our parameters anyway (``to_empty``/``to`` called on an outer wrapper or an
inner submodule), ``BlockState.repair_layout`` -- run at every root forward outside backward and
in the checkpoint helpers -- restores the layout and metadata, keeping correctly shaped data;
parameters still on meta raise there.

Activation checkpointing (non-reentrant) works: a forward pre-hook running while the block is in
its backward is a recomputation; it gets the materialized values as fresh leaves with the params'
``requires_grad`` (so ops save the same tensors as in the original forward), while gradients keep
flowing through the original forward's ``_Materialize``.
"""

from __future__ import annotations

import enum
import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._collectives import Handle, SegmentCollectives
from ._layout import BlockLayout
from ._owned import local_tensor, make_sharded_grad, make_sharded_param, owned_of

if TYPE_CHECKING:
    from ._plan import ParamPlan

__all__ = ["ShardConfig", "ManagedParam", "BlockState", "RootContext", "TrainingState"]


@dataclass(frozen=True)
class ShardConfig:
    """What a ``fully_shard`` call asked for (replaced, never mutated, by the setters)."""

    mesh: DeviceMesh
    reshard_after_forward: bool | None  # None: True, except for the root (like FSDP2's default)
    mp_policy: MixedPrecisionPolicy
    collectives: str = "all_to_all"


@dataclass(eq=False)
class ManagedParam:
    """One parameter of a block: where the module holds it and its sharded form."""

    fqn: str
    sites: tuple[tuple[nn.Module, str], ...]  #: (module, attribute) pairs; >1 when tied
    orig: nn.Parameter | None  #: the original parameter until resolution
    plan: "ParamPlan | None" = None
    sharded: Any = None  #: the DTensor parameter after resolution

    @property
    def requires_grad(self) -> bool:
        p = self.sharded if self.sharded is not None else self.orig
        return bool(p is not None and p.requires_grad)


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


class _Unshard(enum.Enum):
    RESHARDED = "resharded"
    UNSHARDING = "unsharding"  # collective in flight
    UNSHARDED = "unsharded"


def _free(t: torch.Tensor | None) -> None:
    if t is not None and t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor | None) -> None:
    if t is not None:
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().size() != nbytes:
            t.untyped_storage().resize_(nbytes)


@dataclass(eq=False)
class RootContext:
    """State shared by all blocks under one root (the first module to run forward)."""

    root: "BlockState"
    states: list["BlockState"]
    #: Recorded during the first forward: pre-forward order (forward prefetch: the next one) and
    #: post-forward order (backward runs in its reverse: backward prefetch is the previous one;
    #: the root finishes forward last, so its backward prefetches the last block).
    forward_order: list["BlockState"] = field(default_factory=list)
    post_forward_order: list["BlockState"] = field(default_factory=list)
    order_complete: bool = False
    callback_queued: bool = False
    checked: bool = False  # first-forward checks done
    pending_reduce: "tuple[BlockState, Handle, torch.Tensor, torch.Tensor] | None" = None

    def queue_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            Variable._execution_engine.queue_callback(self.final_callback)

    def finish_pending_reduce(self) -> None:
        pending, self.pending_reduce = self.pending_reduce, None
        if pending is not None:
            state, handle, out, _inp = pending
            handle.wait()
            state._finish_reduce(out)

    def final_callback(self) -> None:
        """After the whole backward: finish the last reduction, reshard everything, reset."""
        self.finish_pending_reduce()
        for s in self.states:
            s._end_of_backward()
        self.callback_queued = False

    def drop_stale(self) -> None:
        """Bring every block back to a clean between-iterations state (see [Note: stale state]).

        Called outside backward (the root's pre-forward, checkpoint save/load), on every rank at
        the same point of the program, and issues no collective of its own: it only waits for
        collectives already issued on every rank.
        """
        if self.callback_queued:  # an exception escaped the last backward: its callback is gone
            self.callback_queued = False
            pending, self.pending_reduce = self.pending_reduce, None
            if pending is not None:
                pending[1].wait()  # issued on every rank; the partial result is dropped
            for s in self.states:
                s._open_forwards = 0
        for s in self.states:
            if s._open_forwards <= 0:
                s._open_forwards = 0
                if s._unshard_state is not _Unshard.RESHARDED:
                    s.reshard()
                s.training_state = TrainingState.IDLE


def _graph_released(state: "BlockState", released: list[bool]) -> None:
    if not released[0]:
        released[0] = True
        state._open_forwards -= 1


class _Materialize(torch.autograd.Function):
    """Forward: return the block's forward inputs unchanged followed by its trainable full params.
    Backward: reduce the params' gradients (see [Note: backward ordering])."""

    @staticmethod
    def forward(ctx: Any, state: "BlockState", num_inputs: int, anchor: torch.Tensor,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        ctx.num_inputs = num_inputs
        ctx.set_materialize_grads(False)
        # A graph dropped without backward (an output discarded) must not keep the block
        # "awaiting backward" forever (see [Note: stale state]).
        ctx.released = released = [False]
        weakref.finalize(ctx, _graph_released, state, released)
        params = tuple(state._full[i].view_as(state._full[i]) for i in state._trainable)
        return (*inputs, *params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        n = ctx.num_inputs
        ctx.released[0] = True  # the backward accounts for this forward
        ctx.state._post_backward(grads[n:])
        return (None, None, None, *grads[:n])


class BlockState:
    """Runtime state of one ``matrixfsdp.fully_shard``-ed module (see module docstring)."""

    def __init__(self, module: nn.Module, config: ShardConfig, params: list[ManagedParam]):
        self.module = module
        self.config = config
        self.params = params
        self.fqn: str | None = None  # set at resolution
        self.resolved = False
        self.requires_gradient_sync = True
        self.gradient_divide_factor: float | None = None  # None: W (the DDP average)
        self.forward_prefetch: list[BlockState] | None = None
        self.backward_prefetch: list[BlockState] | None = None
        self.ctx: RootContext | None = None
        self.is_root: bool | None = None
        self.training_state = TrainingState.IDLE
        self._unshard_state = _Unshard.RESHARDED
        self._pending_gather: tuple[Handle, torch.Tensor] | None = None
        self._open_forwards = 0  # _Materialize nodes whose backward has not run yet
        self._accum: torch.Tensor | None = None  # no-sync accumulated reduce-scatter input
        self._anchor = torch.empty(0, requires_grad=True)
        self._hook_handles: list[Any] = []

    @property
    def root_ctx(self) -> RootContext:
        """The shared root context (set when the planned model is resolved)."""
        if self.ctx is None:
            raise RuntimeError(f"matrixfsdp.fully_shard: block {self.fqn!r} has no root context; was the planned "
                               "model passed to matrixfsdp.fully_shard?")
        return self.ctx

    # ============================================================================ resolution
    def resolve(self, *, fqn: str, rank: int, coll: SegmentCollectives) -> None:
        """Build layouts and buffers once every param has its plan and sharded form."""
        self.fqn = fqn
        self.rank = rank
        self.world_size = coll.world_size
        self.coll = coll
        W = self.world_size
        self.layout = BlockLayout.from_plans([p.plan for p in self.params], W)
        self._trainable: tuple[int, ...] = ()
        self._refresh_trainable()
        dtypes = {p.sharded.dtype for p in self.params}  # one dtype unless mp.param_dtype is set
        mp = self.config.mp_policy
        self.param_dtype = next(iter(dtypes)) if dtypes else torch.float32
        self.compute_dtype = mp.param_dtype or self.param_dtype
        self.reduce_dtype = mp.reduce_dtype or self.compute_dtype
        self._cast = any(p.sharded.dtype != self.compute_dtype for p in self.params)
        self._splits = self.layout.gather_splits(rank)
        self_region = self.layout.chunk_numel[rank] if self._cast else 0
        device = self.params[0].sharded._local_tensor.device if self.params else torch.device("cpu")
        self._recv = torch.empty(self._splits.recv_numel + self_region,
                                 dtype=self.compute_dtype, device=device)
        self._assembled = torch.empty(self.layout.assembled_numel, dtype=self.compute_dtype,
                                      device=device)
        _free(self._recv)
        _free(self._assembled)
        self._full: list[torch.Tensor] = []
        self.resolved = True

    def move_to(self, device: torch.device) -> None:
        """Give every parameter fresh, uninitialized storage on ``device`` (``to_empty``).

        See [Note: meta-device initialization]. The parameter objects keep their identity (their
        contents are swapped, as torch's ``to_empty`` does for tensor subclasses), so an optimizer
        built earlier still holds them; unreduced accumulated gradients are dropped.
        """
        for mp in self.params:
            local = local_tensor(mp.sharded)
            self._swap_in(mp, torch.empty(local.shape, dtype=local.dtype, device=device))
        self._accum = None
        self._realloc_buffers(device)

    def repair_layout(self) -> None:
        """Restore the runtime's parameter representation after torch code replaced it.

        torch's ``nn.Module.to_empty``/``_apply`` called on a module that is not ours (an outer
        wrapper, an inner submodule) swaps our DTensors for ones DTensor's dispatch built: they lose
        the :class:`Owned` metadata, and ranks outside an owned tensor's one-rank mesh get a 1-D
        ``tensor([])`` (a scalar for 0-dim parameters) instead of their ``[0, ...]`` segment. Data
        of correctly shaped segments is kept; wrong empty segments are re-created on the device of
        the parameters; the block buffers follow that device.
        """
        devices = set()
        for mp in self.params:
            p, pp = mp.sharded, mp.plan
            local = local_tensor(p)
            devices.add(local.device)
            expected = pp.local_shape(self.rank, self.world_size)
            good_meta = (owned_of(p) is not None) == (pp.owner is not None) and isinstance(p, DTensor)
            if tuple(local.shape) == expected and good_meta:
                continue
            if tuple(local.shape) != expected:
                if math.prod(expected) != 0:
                    raise RuntimeError(
                        f"matrixfsdp.fully_shard: parameter {mp.fqn!r} has local shape "
                        f"{tuple(local.shape)} on rank {self.rank}, expected {expected}; it was "
                        "replaced outside matrixfsdp (assign parameters through set_full_ or a "
                        "checkpoint load instead)"
                    )
                local = torch.empty(expected, dtype=local.dtype, device=local.device)
            self._swap_in(mp, local)
        if len(devices) > 1:
            raise RuntimeError(f"matrixfsdp.fully_shard: block {self.fqn!r} has parameters on several "
                               f"devices {sorted(map(str, devices))}; move the whole model with to_empty")
        if devices and self._recv.device != next(iter(devices)):
            self._realloc_buffers(next(iter(devices)))

    def _swap_in(self, mp: ManagedParam, local: torch.Tensor) -> None:
        """Make ``mp.sharded`` (same object) hold ``local`` with the plan's layout and metadata."""
        pp = mp.plan
        old = mp.sharded
        new = make_sharded_param(local, shape=tuple(pp.shape), mesh=self.config.mesh, owner=pp.owner,
                                 kind=pp.placement, requires_grad=old.requires_grad)
        if old.grad is not None:
            old.grad = None  # a use of the old storage would block the swap; it is stale anyway
        torch.utils.swap_tensors(old, new)
        for m, attr in mp.sites:
            m._parameters[attr] = old

    def _realloc_buffers(self, device: torch.device) -> None:
        self._recv = torch.empty(self._recv.shape, dtype=self._recv.dtype, device=device)
        self._assembled = torch.empty(self._assembled.shape, dtype=self._assembled.dtype, device=device)
        _free(self._recv)
        _free(self._assembled)
        self._full = []

    def _refresh_trainable(self) -> None:
        """(Re)build the reduction layout from the parameters' current ``requires_grad``.

        Called at resolution and, when a parameter was frozen or unfrozen since, at the next
        forward (every rank must change ``requires_grad`` the same way, as for any module).
        """
        trainable = tuple(i for i, p in enumerate(self.params) if p.requires_grad)
        if trainable == self._trainable and hasattr(self, "reduce_layout"):
            return
        if self._accum is not None:
            raise RuntimeError(
                f"matrixfsdp.fully_shard: requires_grad of a parameter in block {self.fqn!r} "
                "changed while unreduced gradients are accumulated (set_requires_gradient_sync"
                "(False)); run a synced backward first"
            )
        self._trainable = trainable
        self.reduce_layout = BlockLayout.from_plans([self.params[i].plan for i in trainable],
                                                    self.world_size)

    # ============================================================================ materialization
    def _locals(self) -> list[torch.Tensor]:
        return [local_tensor(p.sharded) for p in self.params]

    def _build_send(self, locals_: Sequence[torch.Tensor]) -> torch.Tensor:
        pieces = self.layout.pieces_of_rank(self.rank)
        if len(pieces) == 1 and locals_[pieces[0].param].dtype == self.compute_dtype:
            return locals_[pieces[0].param].reshape(-1)  # the chunk is one tensor: no copy
        send = torch.empty(self.layout.chunk_numel[self.rank], dtype=self.compute_dtype,
                           device=self._recv.device)
        if pieces:
            torch.cat([locals_[q.param].reshape(-1) for q in pieces], out=send)
        return send

    def unshard(self, async_op: bool = True) -> None:
        """Issue the block's materialization (no-op if in flight or done)."""
        if self._unshard_state is not _Unshard.RESHARDED:
            return
        if self.layout.numel == 0:  # nothing to move (same decision on every rank)
            self._pending_gather = (Handle(), self._recv)
            self._unshard_state = _Unshard.UNSHARDING
            return
        _alloc(self._recv)
        _alloc(self._assembled)
        locals_ = self._locals()
        send = self._build_send(locals_)
        recv = self._recv[: self._splits.recv_numel]
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self._recv):
            handle = self.coll.all_gather_segments(
                send, recv, self._splits.output_splits, async_op=async_op
            )
            self._copy_own_pieces(locals_)  # overlaps with the collective
        self._pending_gather = (handle, send)
        self._unshard_state = _Unshard.UNSHARDING

    def _copy_own_pieces(self, locals_: Sequence[torch.Tensor]) -> None:
        lay, base = self.layout, self._splits.recv_numel
        for q in lay.pieces_of_rank(self.rank):
            src = locals_[q.param].reshape(-1)
            off = lay.assembled_offset(q.param)
            if off is not None:
                with torch.autograd._unsafe_preserve_version_counter(self._assembled):
                    self._assembled[off + q.flat_start: off + q.flat_start + q.numel].copy_(src)
            elif self._cast:
                self._recv[base + q.offset: base + q.offset + q.numel].copy_(src)

    def wait_for_unshard(self) -> None:
        """Complete an in-flight materialization and build the full-tensor views."""
        if self._unshard_state is _Unshard.UNSHARDED:
            return
        if self._unshard_state is _Unshard.RESHARDED:
            self.unshard(async_op=False)
        handle, _send = self._pending_gather  # type: ignore[misc]
        handle.wait()
        self._pending_gather = None
        lay, offs, base = self.layout, self._splits.recv_offsets, self._splits.recv_numel
        full: list[torch.Tensor] = []
        locals_ = self._locals()
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self._assembled):
            for i, p in enumerate(lay.params):
                off = lay.assembled_offset(i)
                if off is not None:  # several pieces: copy peers' pieces next to our own
                    for q in lay.pieces_of_param(i):
                        if q.rank != self.rank:
                            src = self._recv[offs[q.rank] + q.offset: offs[q.rank] + q.offset + q.numel]
                            self._assembled[off + q.flat_start: off + q.flat_start + q.numel].copy_(src)
                    full.append(self._assembled[off: off + p.numel].view(p.shape))
                    continue
                q = lay.single_piece(i)
                if q is None:  # no elements at all
                    full.append(torch.empty(p.shape, dtype=self.compute_dtype, device=self._recv.device))
                elif q.rank != self.rank:
                    start = offs[q.rank] + q.offset
                    full.append(self._recv[start: start + q.numel].view(p.shape))
                elif self._cast:
                    full.append(self._recv[base + q.offset: base + q.offset + q.numel].view(p.shape))
                else:  # our own storage: see [Note: owner buffer lifetime]
                    full.append(locals_[i].view(p.shape))
        self._full = full
        self._unshard_state = _Unshard.UNSHARDED

    def _swap(self, tensors: Sequence[torch.Tensor]) -> None:
        for p, t in zip(self.params, tensors):
            for m, name in p.sites:
                m._parameters[name] = t  # bypasses the nn.Parameter type check, like FSDP2

    def to_sharded(self) -> None:
        self._swap([p.sharded for p in self.params])

    def to_unsharded_plain(self) -> None:
        """Swap in the full tensors without autograd tracking (``unshard()``, no-grad forward)."""
        self._swap(self._full)

    def reshard(self) -> None:
        """Swap the sharded params back and free the non-owned storage."""
        if self._unshard_state is _Unshard.UNSHARDING:
            handle, _ = self._pending_gather  # type: ignore[misc]
            handle.wait()  # never free a buffer a collective is writing into
            self._pending_gather = None
        self.to_sharded()
        _free(self._recv)
        _free(self._assembled)
        self._full = []
        self._unshard_state = _Unshard.RESHARDED

    # ============================================================================ forward hooks
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

    def pre_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        ctx = self.root_ctx
        in_backward = torch._C._current_graph_task_id() != -1
        if self.is_root and not in_backward:
            ctx.drop_stale()
        if self.training_state is TrainingState.PRE_BACKWARD and in_backward:
            # Recomputation inside backward (non-reentrant activation checkpointing): gradients
            # flow through the original forward's graph, the recomputed one only re-saves
            # tensors. Leaves with the params' requires_grad make ops save what they saved then.
            self.wait_for_unshard()
            self._swap([t.detach().requires_grad_(p.requires_grad)
                        for t, p in zip(self._full, self.params)])
            return args, kwargs
        self.training_state = TrainingState.FORWARD
        if not ctx.order_complete and self not in ctx.forward_order:
            ctx.forward_order.append(self)
        self.unshard()
        for target in self._forward_targets():
            target.unshard()
        self.wait_for_unshard()
        args, kwargs = self._cast_inputs(args, kwargs)
        self._refresh_trainable()
        if not (torch.is_grad_enabled() and self._trainable):
            self.to_unsharded_plain()
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
        outs = _Materialize.apply(self, len(idx), self._anchor, *[flat[i] for i in idx])
        for j, i in enumerate(idx):
            flat[i] = outs[j]
        trainable_full = outs[len(idx):]
        tensors = list(self._full)
        for j, i in enumerate(self._trainable):
            tensors[i] = trainable_full[j]
        self._swap(tensors)
        self._open_forwards += 1
        args, kwargs = tree_unflatten(flat, spec)
        return args, kwargs

    def post_forward(self, output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return output
        if self._reshard_after_forward() or not torch.is_grad_enabled():
            # Without autograd no backward follows: keeping the root's full params would leave
            # them stale after the next optimizer step.
            self.reshard()
        else:
            # Keep the gathered buffers for backward, but give the module its sharded params
            # back: full tensors in its slots would keep this forward's graph alive, so a
            # discarded output could never be detected (see [Note: stale state]).
            self.to_sharded()
        self.training_state = TrainingState.IDLE
        if torch.is_grad_enabled():
            flat, _ = tree_flatten(output)
            for t in flat:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        ctx = self.ctx
        if ctx is not None and not ctx.order_complete:
            if self not in ctx.post_forward_order:
                ctx.post_forward_order.append(self)
            ctx.order_complete = self.is_root
        return self._cast_output(output)

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        mp = self.config.mp_policy
        if not (mp.cast_forward_inputs and mp.param_dtype):
            return args, kwargs
        dt = mp.param_dtype

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dt:
                return x.to(dt)
            return x

        flat, spec = tree_flatten((args, kwargs))
        return tree_unflatten([cast(x) for x in flat], spec)

    def _cast_output(self, output: Any) -> Any:
        dt = self.config.mp_policy.output_dtype
        if dt is None:
            return output
        flat, spec = tree_flatten(output)
        return tree_unflatten(
            [x.to(dt) if isinstance(x, torch.Tensor) and torch.is_floating_point(x) else x
             for x in flat], spec)

    # ============================================================================ backward hooks
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            return grad  # once per backward, whichever output's gradient arrives first
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.root_ctx
        ctx.queue_final_callback()
        self.unshard()
        for target in self._backward_targets():
            if target.training_state is not TrainingState.POST_BACKWARD:
                target.unshard()
        self.wait_for_unshard()
        return grad

    def _post_backward(self, grads: Sequence[torch.Tensor | None]) -> None:
        ctx = self.root_ctx
        ctx.queue_final_callback()
        self._open_forwards -= 1
        if self._trainable:
            self._reduce(grads)
        if self._open_forwards <= 0:
            self.reshard()
            self.training_state = TrainingState.POST_BACKWARD

    def _reduce(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Build the rank-major gradient buffer; accumulate it (no sync) or reduce-scatter it."""
        rl, W = self.reduce_layout, self.world_size
        F = len(rl.params)
        dev = self._recv.device
        flags = torch.tensor([0.0 if g is None else 1.0 for g in grads], dtype=self.reduce_dtype,
                             device=dev)
        flat = [None if g is None else g.reshape(-1) for g in grads]
        parts: list[torch.Tensor] = []
        for d in range(W):
            for q in rl.pieces_of_rank(d):
                g = flat[q.param]
                if g is None:
                    parts.append(torch.zeros(q.numel, dtype=self.reduce_dtype, device=dev))
                else:
                    parts.append(g[q.flat_start: q.flat_start + q.numel])
            parts.append(flags)
        buf = torch.empty(sum(rl.reduce_splits(F)), dtype=self.reduce_dtype, device=dev)
        with torch.no_grad():
            torch.cat(parts, out=buf)
            if self._accum is not None:
                buf.add_(self._accum)
        self._accum = None
        if not self.requires_gradient_sync:
            self._accum = buf
            return
        ctx = self.root_ctx
        ctx.finish_pending_reduce()  # at most one reduction in flight (bounds buffer memory)
        out = torch.empty(rl.reduce_splits(F)[self.rank], dtype=self.reduce_dtype, device=dev)
        handle = self.coll.reduce_scatter_segments(out, buf, rl.reduce_splits(F), async_op=True)
        ctx.pending_reduce = (self, handle, out, buf)

    def _finish_reduce(self, out: torch.Tensor) -> None:
        """Divide by W and write the sharded gradients (see [Note: unused parameters])."""
        rl, W = self.reduce_layout, self.world_size
        n = rl.chunk_numel[self.rank]
        with torch.no_grad():
            data = out[:n]
            data.div_(self.gradient_divide_factor or W)
            used = (out[n:] > 0).tolist()
            mine = {q.param: q for q in rl.pieces_of_rank(self.rank)}
            for j, i in enumerate(self._trainable):
                if not used[j]:
                    continue
                p = self.params[i]
                sharded = p.sharded
                shape = rl.params[j].local_shape(self.rank)
                q = mine.get(j)
                if q is None:
                    g = torch.empty(shape, dtype=sharded.dtype, device=out.device)
                else:
                    g = data[q.offset: q.offset + q.numel].view(shape)
                    if g.dtype != sharded.dtype:
                        g = g.to(sharded.dtype)
                if sharded.grad is None:
                    sharded.grad = make_sharded_grad(sharded, g)
                else:
                    local_tensor(sharded.grad).add_(g)

    def _end_of_backward(self) -> None:
        if self._unshard_state is not _Unshard.RESHARDED:
            self.reshard()
        self._open_forwards = 0
        self.training_state = TrainingState.IDLE
