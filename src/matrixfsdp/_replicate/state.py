"""Runtime of the ZeRO-1/2 mode: flat buckets, uneven reduce-scatter in backward, all-gather at
the next forward (Canzona's data-parallel half, arXiv 2602.06079).

Per training step::

    backward start   (root output's ``_BackwardStart``) decide the mode, mark the parameters the
                     engine will not reach as unused, stash reduced gradients still in ``.grad``
    post-accumulate  (each parameter's hook) copy ``grad / W`` into its bucket slot, drop ``.grad``;
                     launch every bucket that is complete, strictly in bucket order
    final callback   complete and launch what is left, wait, give each owner its parameters'
                     averaged gradients (``.grad``); every other ``.grad`` stays ``None``
    optimizer.step() the user's optimizer: it sees gradients only on the parameters this rank owns,
                     so it updates (and keeps state for) those alone, with no communication
    next forward     (root pre-forward) issue one all-gather per bucket in forward order; each
                     module's pre-forward waits for the buckets of its own parameters

[Note: bucket launch order]
Every rank must issue the same collectives in the same order. Buckets are launched strictly in
reduction order (bucket ``n-1`` first: backward produces the last layers' gradients first, as in
DDP), whenever the next bucket becomes complete; a bucket waiting for a parameter another rank
already reduced simply launches later, so timing differences never reorder collectives. The
gathers are issued at the root's pre-forward (one program point on every rank), in forward order.

A bucket's reduction is the engine's :class:`~matrixfsdp.engine.reducer.Reducer` over the
bucket's layout, filled parameter by parameter as gradients become ready (DDP's pre-division
while copying), in the engine's one wire format ([Note: usage flags] in ``engine/reducer.py``: an
owner reads only its own parameters' flags). Parameters the engine will not reach are marked
unused at backward start (``torch._C._will_engine_execute_node``), so their buckets launch on
time.

[Note: replicas in buckets]
On an HSDP mesh ``(dp_replicate, dp_shard)`` the buckets are planned within ``dp_shard`` and
every replica holds the same layout. A bucket's reduction is the engine's, with its replica phase
(see [Note: replica phase] in ``engine/reducer.py``): ``repeat`` parameters are all-reduced
across the replicas, so every replica's owner steps them alike and the in-replica gather suffices;
a ``split`` parameter's full sum reaches its step replica's owner alone. Those lead each owner's
interval, by step replica, so the gather first all-gathers that prefix in place across the
replicas (each step replica sends its part), then the in-replica gather sends the whole interval.

[Note: stale parameters]
After ``step()`` only owners hold the new values until the next forward's gathers complete: one
:class:`~matrixfsdp.engine.exchange.Exchange` with a gather unit per bucket, the engine's
mechanism that ``fully_shard``'s HSDP ``split`` runs too (see [Note: deferred gathers]).
Everything that reads parameters between the two (``state_dict()``, DCP, ``sync_params()``)
settles it first. A reducing backward that finished marks it stale on every rank; a settle
gathers only once some rank's parameters moved since their last gather (their version counters,
agreed over the group), so a ``state_dict()`` between backward and ``step()`` cannot hide the
update from the next forward, whichever optimizer or hand-written update makes it. A forward
that does not start at the root (a submodule called directly) gathers at its first managed
module's pre-forward instead, and waits for every bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn

from ..comm.collectives import Handle, SegmentCollectives
from ..engine.backward import BackwardTracker, dynamo_disable, in_backward, wrap_grad_tensors
from ..engine.exchange import Exchange, GatherUnit, any_rank, version_stamp
from ..engine.reducer import PendingReduce, PinnedStaging, Reducer, ReplicaComm, read_flags
from ..engine.streams import CommContext
from .bucket_layout import BucketLayout

__all__ = ["Bucket", "ReplicateState"]

class Bucket:
    """One bucket's flat parameter buffer, gradient buffer and in-flight reduction."""

    def __init__(self, layout: BucketLayout, params: list[nn.Parameter], *, rank: int,
                 coll: SegmentCollectives, comm: CommContext, reduce_dtype: torch.dtype | None,
                 persistent: bool, replicas: ReplicaComm | None = None,
                 step_replicas: Sequence[int | None] | None = None):
        self.layout = layout
        self.params = params  # slot order
        self.rank, self.coll, self.comm = rank, coll, comm
        p0 = params[0]
        self.device = p0.device
        self.param_dtype = p0.dtype
        self.reduce_dtype = reduce_dtype or p0.dtype
        self.persistent = persistent  # ZeRO-1: the gradient buffer lives for the whole run
        self.reducer = Reducer(layout.block, rank=rank, coll=coll, comm=comm, reduce_dtype=self.reduce_dtype,
                               grad_dtypes=[self.param_dtype] * len(params), replicas=replicas,
                               step_replicas=step_replicas, predivide=True, flags_to="holders",
                               api="matrixfsdp.replicate")
        self.replicas = self.reducer.replicas
        # ([Note: atomic intervals]) parameters become views of one flat buffer, so the gather
        # writes them in place
        self.flat = torch.empty(layout.numel, dtype=self.param_dtype, device=self.device)
        for slot, p in zip(layout.slots, params):
            view = self.flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
            view.copy_(p.detach())
            p.data = view
        self.mine = [i for i, s in enumerate(layout.slots) if s.owner == rank]
        self.grad_buf: torch.Tensor | None = self.reducer.new_input(self.device) if persistent else None
        self.ready = [False] * len(params)
        self.n_ready = 0
        self.used = [False] * len(params)
        self.pending: PendingReduce | None = None
        #: the deferred in-place gather of the owners' new values (see [Note: stale parameters]);
        #: the parameters keep their own version counters (``p.data = view`` does not share the
        #: bucket's), so they are what the stamp reads
        self.gather = GatherUnit(self._start_gather, lambda: version_stamp(self.params))

    def _start_gather(self) -> Handle:
        """The owners' values to every rank, in place, on the gather stream (the compute stream
        waits for its event where the parameters are read). On an HSDP mesh with ``split``
        parameters the step replicas' new values first reach every replica's owner (see [Note:
        replicas in buckets])."""
        comm = self.comm
        with torch.no_grad(), comm.use(comm.gather):
            m, splits, _ = self.reducer.split_prefix
            if m:
                start = sum(self.layout.param_splits[: self.rank])
                h = self.replicas.coll.all_gather_inplace(  # type: ignore[union-attr]
                    self.flat[start: start + m], splits, async_op=not comm.on_device)
                if not comm.on_device:
                    h.wait()  # the shard gather below sends these values (a device orders it)
            handle = self.coll.all_gather_inplace(self.flat, self.layout.param_splits,
                                                  async_op=not comm.on_device)
            if comm.on_device:
                handle = Handle(event=comm.gather.record_event())
        return handle

    @property
    def grad_numel(self) -> int:
        """Elements of the gradient buffer (every rank's interval, flags and padding)."""
        return self.reducer.numel

    # ----------------------------------------------------------------------------- backward
    def begin(self) -> None:
        self.ready = [False] * len(self.params)
        self.n_ready = 0
        self.used = [False] * len(self.params)
        if self.grad_buf is None:
            self.grad_buf = self.reducer.new_input(self.device)

    @property
    def complete(self) -> bool:
        return self.n_ready == len(self.params)

    def put(self, i: int, grad: torch.Tensor | None) -> None:
        """Slot ``i``'s contribution: ``grad / W`` (DDP's pre-divide), or zeros for a parameter
        this rank did not use."""
        if self.grad_buf is None or self.ready[i]:
            raise RuntimeError(f"matrixfsdp.replicate: internal error, slot {i} of bucket "
                               f"{self.layout.index} written twice or outside a backward")
        self.reducer.put(self.grad_buf, i, grad)
        self.used[i] = grad is not None
        self.ready[i] = True
        self.n_ready += 1

    def launch(self) -> None:
        buf = self.grad_buf
        if buf is None:
            raise RuntimeError(f"matrixfsdp.replicate: internal error, bucket {self.layout.index} "
                               "launched outside a backward")
        self.reducer.write_flags(buf, self.used)
        self.pending = self.reducer.launch(buf, self.used, prescaled=True)

    def finish(self) -> list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None]]:
        """Wait for the reduction; ``(param, averaged grad, summed flag or None)`` for every
        parameter this rank owns (the flag only where this rank did not use the parameter)."""
        if self.pending is None:
            raise RuntimeError(f"matrixfsdp.replicate: internal error, bucket {self.layout.index} "
                               "finished without a reduction in flight")
        pending, self.pending = self.pending, None
        red = self.reducer.finish(pending)
        if not self.persistent:
            self.grad_buf = None  # ZeRO-2: only this rank's interval survives the reduction
        # a ``split`` parameter another replica steps has no gradient here
        return [(self.params[i], red.grads[i], None if red.used[i] else red.flags[i])  # type: ignore[misc]
                for i in self.mine if red.grads[i] is not None]

    def drop(self) -> None:
        """After an aborted backward: wait for an issued reduction and discard it."""
        pending, self.pending = self.pending, None
        if pending is not None:
            Reducer.drop(pending)  # the engine's abort: issued on every rank, result dropped
        if not self.persistent:
            self.grad_buf = None


class ReplicateState:
    """Everything ``matrixfsdp.replicate`` attaches to one model."""

    def __init__(self, module: nn.Module, buckets: list[Bucket], params: dict[str, nn.Parameter], *,
                 rank: int, world_size: int, coll: SegmentCollectives, comm: CommContext, stage: int,
                 agree: SegmentCollectives, replicas: ReplicaComm | None = None):
        self.module = module
        self.replicas = replicas  # this rank's replicate group (HSDP), else None
        self.buckets = buckets  # forward (registration) order; reduced in reverse
        self.params = params
        self.rank, self.W, self.coll, self.comm, self.stage = rank, world_size, coll, comm, stage
        self.where: dict[int, tuple[Bucket, int]] = {}
        for b in buckets:
            for i, p in enumerate(b.params):
                self.where[id(p)] = (b, i)
        self.requires_gradient_sync = True
        self.find_unused = True  # set_find_unused_parameters (see [Note: usage-flag host read])
        self.staging = PinnedStaging()  # the flag reads' host buffer, reused every step
        # whether anyone wrote is agreed over every data-parallel rank (``agree``: the shard group,
        # or the flattened HSDP group, since a bucket's gather spans the replicas too)
        self.exchange = Exchange((b.gather for b in buckets), agree=any_rank(agree, comm.device))
        self.active = False  # the running backward reduces
        self.next_launch = 0  # index into the reduction order
        self.stash: dict[int, torch.Tensor] = {}  # reduced grads held over an accumulating backward
        self.assigned: dict[int, torch.Tensor] = {}
        #: the anchor, the running backward and its final callback (see [Note: backward tracking])
        self.backward = BackwardTracker(buckets[0].device if buckets else "cpu", "matrixfsdp.replicate")
        # strong references to the AccumulateGrad nodes, as DDP keeps them (hooks live on tensors,
        # but the unused-parameter check asks the engine about these nodes)
        self.acc_nodes = {id(p): p.view_as(p).grad_fn.next_functions[0][0]
                          for b in buckets for p in b.params}
        #: modules whose forward pre-hook waits for a bucket: filled in the first forward
        self.covered: set[int] = set()
        self.uncovered_buckets: list[Bucket] | None = None

    # ----------------------------------------------------------------------------- forward
    @dynamo_disable
    def pre_forward_root(self) -> None:
        if in_backward():
            return  # a recomputation inside backward: parameters are current
        if self._issue_gathers():
            for b in self.uncovered_buckets or ():
                b.gather.wait()

    @dynamo_disable
    def pre_forward_module(self, module: nn.Module, buckets: list[Bucket]) -> None:
        if (self.exchange.stale or self.backward.callback_queued) and not in_backward():
            # a forward that did not start at the root (a submodule called directly): the root's
            # pre-forward did not gather; bring every bucket up to date before reading any
            self._issue_gathers()
            self.exchange.settle()
        if self.uncovered_buckets is None:
            self.covered.add(id(module))
        for b in buckets:
            b.gather.wait()

    @dynamo_disable
    def post_forward_root(self, output: Any) -> Any:
        for b in self.buckets:  # a bucket no module waited for (its parameters went unused)
            b.gather.wait()
        if self.uncovered_buckets is None:
            self.uncovered_buckets = self._find_uncovered()
        if not torch.is_grad_enabled():
            return output
        return wrap_grad_tensors(self._backward_start_from_output, self.backward.anchor, output)

    def _find_uncovered(self) -> list[Bucket]:
        """Buckets holding a parameter whose module ran no forward (used functionally, e.g. a tied
        head read by its parent): their gathers are awaited at the root's pre-forward."""
        owner_mod: dict[int, int] = {}
        for m in self.module.modules():
            for p in m.parameters(recurse=False):
                owner_mod.setdefault(id(p), id(m))
        out = []
        for b in self.buckets:
            if any(owner_mod.get(id(p)) not in self.covered for p in b.params):
                out.append(b)
        return out

    def sync_params(self) -> None:
        """Bring every rank's parameters up to date now (a collective when they are stale)."""
        if in_backward():
            return
        if self.backward.take_aborted():
            self._abort_backward()
        self.exchange.settle()  # collective only when stale (see [Note: deferred gathers])

    def _issue_gathers(self) -> bool:
        """At a forward, outside backward: clean up after a backward an exception escaped (its
        callback is gone), then issue every bucket's all-gather if the parameters are stale.
        Returns whether it issued them."""
        if self.backward.take_aborted():
            self._abort_backward()
        return self.exchange.issue()

    # ----------------------------------------------------------------------------- backward
    @dynamo_disable
    def _backward_start_from_output(self) -> None:
        self.on_backward_start(from_output=True)

    def on_backward_start(self, *, from_output: bool) -> None:
        tracker = self.backward
        if tracker.is_current():
            return
        # a post-accumulate hook firing proves accumulation; the root output asks the engine
        accumulating = (not from_output) or tracker.will_accumulate()
        if not accumulating:
            return  # torch.autograd.grad / backward(inputs=...) on other tensors: .grad untouched
        if tracker.callback_queued:
            # another graph task while a reducing backward has not finished: a backward run inside
            # a backward (torch.utils.checkpoint(use_reentrant=True) recomputes and differentiates
            # each segment in its own nested backward). Its parameters are invisible to the outer
            # graph, so they were counted unused and their buckets may be reduced already.
            raise RuntimeError(
                "matrixfsdp.replicate: a backward that accumulates into .grad ran inside another "
                "backward that reduces gradients (reentrant activation checkpointing, "
                "torch.utils.checkpoint(..., use_reentrant=True), backward() called from a backward "
                "hook, or a second backward after one that raised with no forward in between); use "
                "torch.utils.checkpoint(..., use_reentrant=False) (Hugging Face: "
                "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))"
            )
        self.check_views()
        if torch.is_grad_enabled():
            tracker.refuse_create_graph()
        tracker.start(True)
        # reduced gradients still in .grad (no zero_grad since the last step) accumulate like DDP's:
        # hold them out of this backward's reduction and add them back after it
        for key, g in list(self.assigned.items()):
            p = self._param_by_id(key)
            if p is not None and p.grad is g:
                self.stash[key] = g
                p.grad = None
        self.assigned = {}
        self.active = self.requires_gradient_sync
        if not self.active:
            return
        tracker.queue_final_callback(self.final_callback)
        self.next_launch = 0
        for b in self.buckets:
            b.begin()
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if not torch._C._will_engine_execute_node(self.acc_nodes[id(p)]):
                    self._contribute(b, i, p)
        self._launch_ready()

    def check_views(self) -> None:
        """Every managed parameter must still be a view of its bucket (the gathers write there and
        the reductions read the hooks of these very tensors)."""
        for b in self.buckets:
            base = b.flat.data_ptr()
            size = b.flat.element_size()
            for slot, p in zip(b.layout.slots, b.params):
                # a zero-element view has no storage address to compare (data_ptr() is 0)
                if (p.dtype != b.flat.dtype or p.device != b.flat.device
                        or (slot.numel and p.data_ptr() != base + slot.offset * size)):
                    raise ValueError(
                        f"matrixfsdp.replicate: parameter {slot.fqn!r} is no longer a view of its flat "
                        f"bucket (now {p.dtype} on {p.device}, bucket {b.flat.dtype} on {b.flat.device}): "
                        "its dtype, device or storage was changed after replicate (e.g. submodule.to(), "
                        "param.data = ...); convert the model before matrixfsdp.replicate"
                    )

    def rebind(self) -> None:
        """After a same-dtype, same-device module conversion (``to_empty``, ``share_memory``, swap
        of parameter tensors): copy each parameter's new value into its bucket slot and make it a
        view of the bucket again."""
        with torch.no_grad():
            for b in self.buckets:
                base, size = b.flat.data_ptr(), b.flat.element_size()
                for slot, p in zip(b.layout.slots, b.params):
                    if p.dtype == b.flat.dtype and (not slot.numel or p.data_ptr() == base + slot.offset * size):
                        continue
                    view = b.flat[slot.offset:slot.offset + slot.numel].view(slot.shape)
                    view.copy_(p.detach())
                    p.data = view

    def _param_by_id(self, key: int) -> nn.Parameter | None:
        hit = self.where.get(key)
        return hit[0].params[hit[1]] if hit is not None else None

    @dynamo_disable
    def on_grad(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook of every managed parameter."""
        if not self.backward.is_current():
            self.on_backward_start(from_output=False)
        if not self.active:
            return
        b, i = self.where[id(p)]
        if b.ready[i]:
            raise RuntimeError(
                "matrixfsdp.replicate: a parameter received a second gradient after its bucket "
                "was reduced in the same backward (a parameter used again after backward reached "
                "it, e.g. by a reentrant checkpoint); use non-reentrant activation checkpointing"
            )
        self._contribute(b, i, p)
        self._launch_ready()

    def _contribute(self, b: Bucket, i: int, p: nn.Parameter) -> None:
        # p.grad holds this step's local gradient plus any no_sync accumulation
        b.put(i, p.grad)
        p.grad = None

    def _launch_ready(self) -> None:
        order = self.buckets[::-1]
        while self.next_launch < len(order) and order[self.next_launch].complete:
            order[self.next_launch].launch()
            self.next_launch += 1

    @dynamo_disable
    def final_callback(self) -> None:
        try:
            order = self.buckets[::-1]
            for b in order[self.next_launch:]:
                for i, p in enumerate(b.params):
                    if not b.ready[i]:
                        self._contribute(b, i, p)
            self._launch_ready()
            undecided: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []
            for b in order:
                for p, g, flag in b.finish():
                    if flag is None:
                        self._assign(p, g)
                    elif not p.requires_grad:
                        # frozen (on every rank alike, as for any module): no rank used it, which
                        # needs no flag read, also with set_find_unused_parameters(False)
                        self._restore_stashed(p)
                    else:
                        undecided.append((p, g, flag))
            read = read_flags(undecided, find_unused=self.find_unused, staging=self.staging)  # [Note: usage-flag host read]
            self.exchange.mark_stale()
            read.resolve(self._assign, self._restore_stashed)
        finally:
            self.active = False
            self.backward.finished()

    def _restore_stashed(self, p: nn.Parameter) -> None:
        """No rank used ``p`` in this backward: it keeps the reduced gradient it held before."""
        if id(p) in self.stash:
            p.grad = self.stash.pop(id(p))

    def _assign(self, p: nn.Parameter, g: torch.Tensor) -> None:
        prev = self.stash.pop(id(p), None)
        if prev is not None:
            g = prev.add_(g)
        p.grad = g
        self.assigned[id(p)] = g

    def _abort_backward(self) -> None:
        """An exception escaped a reducing backward: its callback is gone. Ranks may have
        launched different prefixes of the reduction order (a bucket launches early where this
        rank left its parameters unused, and the exception stops each rank at its own point), so
        every rank first launches the rest, zeros for what it had not contributed: then every
        rank has issued every bucket's reduction, in the same order, and waits for all of them
        and drops them with the partial gradients (no rank-dependent collective count)."""
        if self.active:
            order = self.buckets[::-1]
            for b in order[self.next_launch:]:
                if b.grad_buf is None:
                    b.begin()
                for i in range(len(b.params)):
                    if not b.ready[i]:
                        b.put(i, None)
                b.launch()
            self.next_launch = len(order)
        for b in self.buckets:
            b.drop()
        # a rank that finished this backward marked the exchange stale (a step may follow): so
        # does this one, or it would skip the next forward's gathers the others issue
        self.exchange.mark_stale()
        # the reduced gradients held out of the dropped backward go back, as if it never ran
        for key, g in self.stash.items():
            p = self._param_by_id(key)
            if p is not None:
                p.grad = g
                self.assigned[key] = g
        self.stash = {}
        self.active = False
