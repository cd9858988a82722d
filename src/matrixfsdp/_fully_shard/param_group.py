"""A block's parameter group: its buffers, its two collectives and the streams they run on.

One :class:`ParamGroup` per ``fully_shard``-ed module. It knows the block's
:class:`~matrixfsdp.engine.layout.BlockLayout` and moves data; *when* it does so is decided by the hooks
in ``state.py``. Per step (``W`` ranks, this rank ``r``)::

    unshard       copy-in (this rank's chunk) -> all_gather_segments of the block's chunks
    wait          copy-out (pieces of evenly sharded params into the assembly buffer)
    reshard       free the receive and assembly buffers (owners keep their own storage)
    reduce        the block's :class:`~matrixfsdp.engine.reducer.Reducer`: one copy-in of the unsharded
                  grads (+ usage flags, padding) -> reduce_scatter_segments (+ replica phase)
    finish        write the sharded ``.grad``, run post-accumulate-grad hooks

[Note: gather streams]
The reduction's streams are the engine's ([Note: streams] in ``engine/reducer.py``). As in
FSDP2, the gather's copy-in runs on a copy-in stream and the gather on a gather stream; the
compute stream waits for a gather only when the block's parameters are about to be used. Buffers
are resized (allocated) on the compute stream before the gather stream writes them and freed on
the compute stream after it waited, so the caching allocator never hands memory to another user
while a collective still writes it.

[Note: buffer lifetime]
Everything that is not the owner's own storage lives in per-block buffers: ``recv`` (peers'
chunks in rank order), ``cast`` (this rank's chunk in the compute dtype, for mixed precision
only), ``assembled`` (evenly sharded params with several pieces) and ``kept`` (see [Note: receive
buffer after copy-out]). They are allocated once and keep their identity for
the life of the block: reshard shrinks their storage to 0 bytes and unshard grows it back and
refills it *in the same storage*, so the unsharded leaves (views of them) and every tensor autograd
saved in forward stay valid after a reshard-after-forward. Writes are wrapped in
``_unsafe_preserve_version_counter`` so a refill does not look like an in-place modification. Per
materialization the only other temporary is the send buffer: this rank's chunk, and not even that
when the chunk is a single tensor in the compute dtype (no ``W``-fold copy on any backend, see
``comm/collectives.py``); ``temp_bytes_peak`` reports the peak (send + every buffer, at copy-out)
and ``held_bytes_peak`` what stays allocated after the copy-out.

[Note: receive buffer after copy-out]
The copy-out moves peers' pieces of evenly sharded parameters from ``recv`` into ``assembled``;
kept after that, they would be held twice until reshard (for a root with Qwen3-8B's embedding
and head at W=8 that is the whole receive buffer, as large as the assembled one, through the
whole backward). FSDP2 frees its all-gather output after the copy-out; here ``recv`` may also
hold peers' *single-piece* parameters, which are leaves viewing it. So, per block, from the
layout: when peers' single-piece elements are no more than their multi-piece ones, the copy-out
also moves the single-piece ones into the compact ``kept`` buffer (their leaves view it) and
``recv`` is freed right after the copy-out; otherwise (a transformer block whose evenly sharded
tensors are its norms) the copy would cost more than the duplicate it saves, and ``recv``
stays until reshard. Either way the duplicate held is at most ``min(single, multi)`` peer
elements, and only when ``recv`` is kept.

[Note: replica steps]
On an HSDP mesh a block's parameters are ordered so that every chunk starts with its ``split``
pieces, in step-replica order (the engine's [Note: replica phase] in ``engine/reducer.py``).
After ``step()`` the step replica's new values go back to the other owners through the engine's
deferred gathers ([Note: deferred gathers]), awaited by :meth:`ParamGroup.unshard` before the
block's own gather sends them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..comm.collectives import Handle, SegmentCollectives
from ..engine.exchange import Exchange, GatherUnit
from ..engine.layout import BlockLayout
from ..engine.reducer import PendingReduce, Reducer, ReplicaComm
from ..engine.streams import CommContext
from ..placement.owned_tensor import make_sharded_grad
from ..placement.owner import owner_of
from .param import ManagedParam

__all__ = ["BlockReduce", "CommContext", "ParamGroup", "ReplicaComm", "accumulate_grad", "land_grad"]


def _free(t: torch.Tensor | None) -> None:
    if t is not None and t.untyped_storage().size() != 0:
        t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor | None) -> None:
    if t is not None:
        nbytes = t.numel() * t.element_size()
        if t.untyped_storage().size() != nbytes:
            t.untyped_storage().resize_(nbytes)


@dataclass(eq=False)
class BlockReduce:
    """One issued reduction of a block: the engine's pending reduction and the trainable
    parameters it covers (indices into the block's parameters)."""

    group: "ParamGroup"
    trainable: tuple[int, ...]
    pending: PendingReduce

    @property
    def handle(self) -> Handle:
        return self.pending.handle


class ParamGroup:
    """Buffers and collectives of one block (see module docstring)."""

    def __init__(self, params: list[ManagedParam], mp_policy: MixedPrecisionPolicy):
        self.params = params
        self.mp_policy = mp_policy
        self.unsharded = False  #: unsharded leaves are valid (gather waited for)
        self._pending_gather: tuple[Handle, torch.Tensor | None] | None = None
        self.accum: torch.Tensor | None = None  #: no-sync accumulated reduction input
        self.accum_used: tuple[bool, ...] = ()  #: params this rank used while accumulating
        self.trainable: tuple[int, ...] = ()
        self.temp_bytes_peak = 0  #: largest send + buffer bytes of one unshard (at copy-out)
        self.held_bytes_peak = 0  #: largest buffer bytes held after a copy-out (until reshard)
        #: read the summed usage flags of parameters this rank did not use (see [Note: usage-flag
        #: host read] in ``engine/reducer.py``); ``set_find_unused_parameters(False)`` clears it
        self.find_unused = True
        self.replicas: ReplicaComm | None = None
        #: HSDP split: the deferred gather of the step replicas' new values (see [Note: replica steps])
        self.exchange: tuple[Exchange, GatherUnit] | None = None
        self._reducer: Reducer | None = None

    # ============================================================================ resolution
    def resolve(self, *, fqn: str, rank: int, coll: SegmentCollectives, comm: CommContext,
                replicas: ReplicaComm | None = None) -> None:
        self.fqn, self.rank, self.coll, self.comm = fqn, rank, coll, comm
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        self.world_size = coll.world_size
        self.layout = BlockLayout.from_plans([p.plan for p in self.params], self.world_size)
        self._splits = self.layout.gather_splits(rank)
        self.refresh_dtypes()
        self.refresh_trainable()
        device = self.params[0].local.device if self.params else torch.device("cpu")
        self.realloc(device)

    def refresh_dtypes(self) -> bool:
        """(Re)derive the compute and reduce dtypes from the parameters (resolution, and after
        ``model.to(dtype)``); returns whether anything changed (the buffers must follow)."""
        check_one_dtype(f"block {self.fqn!r}", [p.sharded.dtype for p in self.params], self.mp_policy)
        param_dtype = self.params[0].sharded.dtype if self.params else torch.float32
        new = (param_dtype, self.mp_policy.param_dtype or param_dtype)
        if new == (getattr(self, "param_dtype", None), getattr(self, "compute_dtype", None)):
            return False
        if self.accum is not None:
            raise RuntimeError(f"matrixfsdp.fully_shard: the parameters of block {self.fqn!r} changed "
                               "dtype while unreduced gradients are accumulated; run a synced backward first")
        self.param_dtype, self.compute_dtype = new
        self.reduce_dtype = self.mp_policy.reduce_dtype or self.compute_dtype
        self._cast = any(p.sharded.dtype != self.compute_dtype for p in self.params)
        return True

    def realloc(self, device: torch.device) -> None:
        """(Re)create the buffers and unsharded leaves on ``device`` (resolution, ``to_empty``,
        a repaired layout). Views are built while the storage exists, then it is freed."""
        self.unsharded = False
        kw = dict(dtype=self.compute_dtype, device=device)
        self._recv = torch.empty(self._splits.recv_numel, **kw)
        self._cast_buf = torch.empty(self.layout.chunk_numel[self.rank] if self._cast else 0, **kw)
        self._assembled = torch.empty(self.layout.assembled_numel, **kw)
        self._kept = torch.empty(self._kept_numel(), **kw)
        self._build_views()
        for t in self._buffers:
            _free(t)

    @property
    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return (self._recv, self._cast_buf, self._assembled, self._kept)

    def _kept_numel(self) -> int:
        """Elements of the compact buffer peers' single-piece parameters are copied into when the
        receive buffer is freed after copy-out (see [Note: receive buffer after copy-out]); 0 when
        it is kept."""
        lay, r = self.layout, self.rank
        mine = {q.param: q.numel for q in lay.pieces_of_rank(r)}
        single = multi = 0
        for i, p in enumerate(lay.params):
            n = lay.piece_count(i)
            if n == 0:
                continue
            peers = p.numel - mine.get(i, 0)  # the pieces tile the parameter
            if n == 1:
                single += peers
            else:
                multi += peers
        self._free_recv = multi > 0 and single <= multi
        return single if self._free_recv else 0

    def _build_views(self) -> None:
        """Unsharded leaves and the copy lists of copy-in / copy-out (storage must exist). Peers'
        pieces of a multi-piece parameter are copied out one span of alike peers at a time (a
        strided view of their chunks, see [Note: spans] in ``engine/layout.py``), not one per
        rank: the lists grow with the block's spans, not with ``W``."""
        lay, offs = self.layout, self._splits.recv_offsets
        r = self.rank
        kept = 0  # next free element of the compact buffer
        own_dst: list[torch.Tensor] = []  # copy-in: own pieces into assembled / the cast region
        own_src: list[torch.Tensor] = []
        out_dst: list[torch.Tensor] = []  # copy-out: peers' pieces of multi-piece params
        out_src: list[torch.Tensor] = []
        own = {q.param: q for q in lay.pieces_of_rank(r)}
        for i, p in enumerate(lay.params):
            mp = self.params[i]
            off = lay.assembled_offset(i)
            if off is not None:
                for s, q in lay.param_spans(i):
                    # the span's peers before this rank and after it (its chunk is not received)
                    for lo, hi in ((s.lo, min(s.hi, r)), (max(s.lo, r + 1), s.hi)):
                        if lo >= hi:
                            continue
                        k = hi - lo
                        start = off + q.flat_start + (lo - s.lo) * q.numel
                        dst = self._assembled[start: start + k * q.numel]
                        # peers lo..hi-1's chunks lie back to back: a k x chunk view, its piece columns
                        src = self._recv[offs[lo]: offs[lo] + k * s.chunk].view(k, s.chunk)
                        out_dst.append(dst.view(k, q.numel) if k > 1 else dst)
                        out_src.append(src[:, q.offset: q.offset + q.numel] if k > 1 else
                                       src[0, q.offset: q.offset + q.numel])
                q = own.get(i)
                if q is not None:
                    own_dst.append(self._assembled[off + q.flat_start: off + q.flat_start + q.numel])
                    # mixed precision: from the chunk cast once for the send (unshard)
                    own_src.append(self._cast_buf[q.offset: q.offset + q.numel] if self._cast
                                   else mp.local.reshape(-1))
                mp.set_unsharded(self._assembled[off: off + p.numel].view(p.shape))
                continue
            q = lay.single_piece(i)
            if q is None:  # no elements at all
                data = torch.empty(p.shape, dtype=self.compute_dtype, device=self._recv.device)
            elif q.rank != r:
                data = self._recv[offs[q.rank] + q.offset: offs[q.rank] + q.offset + q.numel]
                if self._free_recv:  # copied out with the pieces, so the receive side can go
                    out_dst.append(self._kept[kept: kept + q.numel])
                    out_src.append(data)
                    data = out_dst[-1]
                    kept += q.numel
                data = data.view(p.shape)
            elif self._cast:  # the owner computes on a low-precision copy, which is also what
                # it sends (the cast chunk, written once per unshard); its master stays
                data = self._cast_buf[q.offset: q.offset + q.numel].view(p.shape)
            else:  # the owner's own storage (see [Note: sharded and unsharded parameters])
                data = mp.local.view(p.shape)
            mp.set_unsharded(data)
        self._own_copy = (own_dst, own_src)
        # contiguous pairs apart from strided ones: a foreach copy fuses only the former
        flat = [k for k, t in enumerate(out_src) if t.dim() == 1]
        rest = [k for k, t in enumerate(out_src) if t.dim() != 1]
        self._out_copy = tuple(([out_dst[k] for k in ks], [out_src[k] for k in ks]) for ks in (flat, rest))

    def refresh_trainable(self) -> None:
        """(Re)build the reduction layout from the parameters' current ``requires_grad``.

        Called at resolution and at every forward (every rank must freeze or unfreeze parameters
        alike, as for any module).
        """
        for mp in self.params:
            mp.sync_requires_grad()
        trainable = tuple(i for i, p in enumerate(self.params) if p.requires_grad)
        if trainable == self.trainable and hasattr(self, "reduce_layout"):
            return
        if self.accum is not None:
            raise RuntimeError(
                f"matrixfsdp.fully_shard: requires_grad of a parameter in block {self.fqn!r} "
                "changed while unreduced gradients are accumulated (set_requires_gradient_sync"
                "(False)); run a synced backward first"
            )
        self.trainable = trainable
        self.reduce_layout = BlockLayout.from_plans([self.params[i].plan for i in trainable],
                                                    self.world_size)

    # ============================================================================ materialization
    @property
    def is_resharded(self) -> bool:
        return not self.unsharded and self._pending_gather is None

    @property
    def unshard_state(self) -> str:
        """``"resharded"``, ``"unsharding"`` (gather in flight) or ``"unsharded"``."""
        return "unsharded" if self.unsharded else "resharded" if self._pending_gather is None else "unsharding"

    def unshard(self, async_op: bool = True) -> None:
        """Issue the block's materialization (no-op if in flight or done)."""
        if not self.is_resharded:
            return
        if self.layout.numel == 0 or self.world_size == 1 and not self._own_copy[0] and not self._cast:
            if self.exchange is not None:  # no gather follows: the compute stream waits itself
                self.exchange[0].wait(self.exchange[1])
            self._pending_gather = (Handle(), None)
            return
        for t in self._buffers:  # on the compute stream, see [Note: gather streams]
            _alloc(t)
        comm, lay = self.comm, self.layout
        with torch.no_grad(), comm.use(comm.copy_in):
            if self.exchange is not None:
                # the step replica's new values first (sent below). Waited for on the copy-in
                # stream: a prefetch must not make the compute stream, still running the current
                # block, wait for the next block's cross-replica transfer; the compute stream
                # waits for it through the gather's event
                self.exchange[0].wait(self.exchange[1])
            pieces = lay.pieces_of_rank(self.rank)
            locals_ = [mp.local for mp in self.params]
            if self._cast:
                # mixed precision: the chunk cast once, into the buffer the owner's own pieces
                # are read from (its single-piece leaves view it): one cast kernel per unshard
                send = self._cast_buf
                if pieces:
                    with _preserve(self._cast_buf):
                        torch.cat([locals_[q.param].reshape(-1) for q in pieces], out=send)
            elif len(pieces) == 1 and locals_[pieces[0].param].dtype == self.compute_dtype:
                send = locals_[pieces[0].param].reshape(-1)  # the chunk is one tensor: no copy
            else:
                send = torch.empty(lay.chunk_numel[self.rank], dtype=self.compute_dtype,
                                   device=self._recv.device)
                if pieces:
                    torch.cat([locals_[q.param].reshape(-1) for q in pieces], out=send)
            dst, src = self._own_copy
            if dst:
                with _preserve(self._cast_buf, self._assembled):
                    torch._foreach_copy_(dst, src)
        self._note_temp_bytes(send)
        recv = self._recv
        with torch.no_grad(), comm.use(comm.gather), _preserve(self._recv):
            if comm.on_device:
                comm.gather.wait_stream(comm.copy_in)
            handle = self.coll.all_gather_segments(send, recv, self._splits.output_splits,
                                                   async_op=async_op and not comm.on_device)
            if comm.on_device:
                handle = Handle(event=comm.gather.record_event())
        self._pending_gather = (handle, send)

    def _note_temp_bytes(self, send: torch.Tensor) -> None:
        ptr = send.untyped_storage().data_ptr()
        own = ptr == self._cast_buf.untyped_storage().data_ptr() or any(
            ptr == mp.local.untyped_storage().data_ptr() for mp in self.params if mp.local.numel())
        n = (0 if own else send.nbytes) + sum(t.nbytes for t in self._buffers)
        self.temp_bytes_peak = max(self.temp_bytes_peak, n)

    @property
    def held_bytes(self) -> int:
        """Bytes of the block's buffers allocated now (what an unsharded block holds between
        materializations; see [Note: receive buffer after copy-out])."""
        return sum(t.untyped_storage().nbytes() for t in self._buffers)

    def wait_for_unshard(self) -> None:
        """Complete an in-flight materialization; afterwards the unsharded leaves are valid."""
        if self.unsharded:
            return
        if self._pending_gather is None:
            self.unshard(async_op=False)
        handle, _send = self._pending_gather  # type: ignore[misc]
        self._pending_gather = None
        handle.wait()
        for dst, src in self._out_copy:
            if dst:
                with torch.no_grad(), _preserve(self._assembled, self._kept):
                    # one fused copy-out of the contiguous pieces, one copy per strided span
                    torch._foreach_copy_(dst, src)
        if self._free_recv:
            _free(self._recv)  # on the compute stream, after it waited for the gather
        self.held_bytes_peak = max(self.held_bytes_peak, self.held_bytes)
        self.unsharded = True

    def reshard(self) -> None:
        """Put the sharded params back in the slots and free the buffers."""
        if self._pending_gather is not None:
            handle, _ = self._pending_gather
            self._pending_gather = None
            handle.wait()  # never free a buffer a collective is writing into
        for mp in self.params:
            mp.to_sharded()
        for t in self._buffers:
            _free(t)
        self.unsharded = False

    def to_unsharded(self) -> None:
        for mp in self.params:
            mp.to_unsharded()

    def to_sharded(self) -> None:
        for mp in self.params:
            mp.to_sharded()

    # ============================================================================ reduction
    def take_grads(self) -> list[torch.Tensor | None]:
        """The unsharded gradients of the trainable params (cleared on the leaves)."""
        grads = []
        for i in self.trainable:
            mp = self.params[i]
            u = mp.unsharded
            g = None if u is None else u.grad
            if g is not None and mp.tp is not None:
                from .tp_params import local_grad

                g = local_grad(g, mp.tp)  # a TP leaf's gradient: its local shard is reduced
            grads.append(g)
            if u is not None:
                u.grad = None
        return grads

    def drop_grads(self) -> None:
        """Clear the unsharded leaves' gradients as they are, never taking them (after an aborted
        backward): taking a TP leaf's Partial gradient reduces it over TP, and only the ranks
        whose backward got that far hold one (a hang)."""
        for mp in self.params:
            if mp.unsharded is not None:
                mp.unsharded.grad = None

    def has_unsharded_grads(self) -> bool:
        return any(mp.unsharded is not None and mp.unsharded.grad is not None for mp in self.params)

    @property
    def reducer(self) -> Reducer:
        """The engine's reduction of the trainable parameters (rebuilt when they or their dtypes
        change)."""
        grad_dtypes = tuple(self.params[i].sharded.dtype for i in self.trainable)
        r = self._reducer
        if (r is None or r.layout is not self.reduce_layout or r.reduce_dtype != self.reduce_dtype
                or r.grad_dtypes != grad_dtypes or r.coll is not self.coll):
            r = self._reducer = Reducer(
                self.reduce_layout, rank=self.rank, coll=self.coll, comm=self.comm,
                reduce_dtype=self.reduce_dtype, grad_dtypes=grad_dtypes, replicas=self.replicas,
                step_replicas=[self.params[i].plan.step_replica for i in self.trainable],  # type: ignore[union-attr]
                api="matrixfsdp.fully_shard")
        return r

    def reduce(self, grads: Sequence[torch.Tensor | None], *, sync: bool,
               divide_factor: float | None) -> BlockReduce | None:
        """Copy the gradients into one buffer and issue its reduction (``sync``), or add it to
        the no-sync accumulation. No host sync: the usage flags are built on the device (see
        [Note: usage flags] and [Note: streams] in ``engine/reducer.py``)."""
        reducer = self.reducer
        with torch.no_grad():
            buf = reducer.copy_in(grads, self._recv.device)
            used = tuple(g is not None for g in grads)
            if self.accum is not None:
                buf.add_(self.accum)
                used = tuple(a or b for a, b in zip(used, self.accum_used))
            self.accum = None
            if not sync:
                self.accum, self.accum_used = buf, used
                return None
            pending = reducer.launch(buf, used, divide_factor=divide_factor)
        return BlockReduce(self, self.trainable, pending)

    def finish(self, br: BlockReduce) -> list[tuple[nn.Parameter, torch.Tensor | None, torch.Tensor]]:
        """Wait for ``br`` and write the sharded gradients of the parameters this rank used
        (running their post-accumulate-grad hooks). Returns ``(param, grad, summed_flag)`` for the
        others, which the root resolves with :func:`land_grad` (see [Note: unused parameters])."""
        red = br.pending.reducer.finish(br.pending)
        undecided = []
        # gradients of the block still here: this backward accumulates onto the step replicas'
        # too (no zero_grad since), so their receipts stand (see [Note: step receipts])
        carried = any(self.params[i].sharded.grad is not None for i in br.trainable)
        for j, i in enumerate(br.trainable):
            sharded = self.params[i].sharded
            if red.grads[j] is None:
                # HSDP split: another replica steps it (and only it gets the gradient); this
                # owner learns whether that replica got one, as the other ranks do from .grad
                receipt = owner_of(sharded).receipt  # type: ignore[union-attr]
                if receipt is not None:
                    if not carried:
                        receipt.reduced = False
                    if red.used[j]:
                        receipt.reduced = True
                    else:
                        undecided.append((sharded, None, red.flags[j]))
                continue
            if red.used[j]:
                accumulate_grad(sharded, red.grads[j])
            else:
                undecided.append((sharded, red.grads[j], red.flags[j]))
        return undecided

    # ============================================================================ replicas
    def replica_gather(self) -> Handle:
        """Issue the step replicas' new values of this block's ``split`` parameters to the other
        owners (see [Note: replica steps]): one whole-tensor exchange over the replicate group."""
        rep = self.replicas
        if rep is None:
            return Handle()
        by_source: list[list[torch.Tensor]] = [[] for _ in range(rep.size)]
        # trainable now, or at the last reduction (a parameter frozen after its last step still
        # carries that step's value); every rank freezes alike, so the lists match
        last = {id(self.params[i]) for i in self.trainable}
        for mp in self.params:
            pp = mp.plan
            if (pp.step_replica is not None and pp.owner == self.rank  # type: ignore[union-attr]
                    and (mp.requires_grad or id(mp) in last)):
                by_source[pp.step_replica].append(mp.local)  # type: ignore[union-attr]
        if not any(by_source):
            return Handle()
        return rep.coll.all_gather_tensors(by_source, async_op=True)


def check_one_dtype(where: str, dtypes: Sequence[torch.dtype], mp_policy: MixedPrecisionPolicy) -> None:
    """A block's parameters are materialized in one dtype: theirs, or ``mp_policy.param_dtype``
    (checked when a block is wrapped and again after ``model.to(dtype)``)."""
    names = sorted({str(d).removeprefix("torch.") for d in dtypes})
    if len(names) > 1 and mp_policy.param_dtype is None:
        raise ValueError(f"matrixfsdp.fully_shard: {where} mixes parameter dtypes {names}; set "
                         "mp_policy.param_dtype to materialize them in one dtype")


def land_grad(param: Any, grad: torch.Tensor | None) -> None:
    """A reduced gradient some rank contributed to: :func:`accumulate_grad`, or for ``None`` (an
    HSDP split parameter another replica steps) the receipt that its step replica holds it."""
    if grad is None:
        owner_of(param).receipt.reduced = True  # type: ignore[union-attr]
    else:
        accumulate_grad(param, grad)


def accumulate_grad(param: Any, grad: torch.Tensor) -> None:
    """Write (or add) the local ``grad`` as ``param``'s sharded gradient, then run its
    post-accumulate-grad hooks, as FSDP2 does after its reduction."""
    with torch.no_grad():
        if param.grad is None:
            param.grad = make_sharded_grad(param, grad)
        else:
            param.grad._local_tensor.add_(grad)
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)


def _preserve(*tensors: torch.Tensor) -> contextlib.ExitStack:
    """Refills of buffers autograd holds views of are not in-place modifications (see
    [Note: buffer lifetime])."""
    stack = contextlib.ExitStack()
    for t in tensors:
        stack.enter_context(torch.autograd._unsafe_preserve_version_counter(t))
    return stack
