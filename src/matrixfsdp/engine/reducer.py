"""The one gradient reduction of both front-ends: a segment layout's reduce-scatter, with its
usage flags (and their one host read), division, replica phase, streams, finish and abort.

``fully_shard`` reduces one :class:`Reducer` per block (all gradients at once, at the block's
post-backward: :meth:`Reducer.copy_in`); ``replicate`` one per bucket (each gradient as its
post-accumulate-grad hook fires: :meth:`Reducer.put`, then :meth:`Reducer.write_flags`). Both
lay the same wire format out at the same offsets and then share every later stage::

    copy-in     the gradients destination-major into one buffer (+ usage flags, padding)
    launch      pre-divide and reduce-scatter on the reduce stream; on an accelerator the replica
                phase (on the all-reduce stream), the post-division and the cast follow
    finish      wait; (CPU) the replica phase, post-division and cast; per-parameter views
    drop        after an aborted backward: wait for the issued reduction and discard it

[Note: usage flags]
The engine's [Note: unused parameters] rule, in one wire format: every destination's chunk is its
pieces (see [Note: chunks and pieces] in ``engine/layout.py``), then one usage flag for each
parameter *flagged to* that destination (1 where this rank contributed a gradient, 0 where it
sent zeros), in layout order, then zeros up to a 16-byte boundary (see [Note: aligned reduce
chunks]). Which parameters are flagged to a destination is the one policy knob:

* ``flags_to="all"`` (``fully_shard``): every parameter, to every destination. Every rank learns,
  for every parameter, whether any rank used it, including those it holds no rows of, so every
  rank gives the same ``.grad is None`` answer (FSDP2's).
* ``flags_to="holders"`` (``replicate``): a parameter's flag goes only to the ranks that hold it
  (its owner, or the ranks its rows land on): non-owners get no ``.grad`` anyway, so the flags
  cost one scalar per parameter, not ``W``, on the wire.

Only a flag's sign is read.

[Note: streams]
As in FSDP2, on an accelerator the copy-in runs on the *compute* stream and the reduce stream
waits for it (FSDP2's ``foreach_reduce`` order): the gradients are autograd's tensors, whose
memory the caching allocator hands to the next kernels of the compute stream once their last
reference dies; read on the compute stream, that reuse is ordered after the copy. The input
buffer is allocated on the compute stream and kept by :class:`PendingReduce` until the compute
stream waited for the reduction (:meth:`Reducer.finish`); tensors the reduce stream allocates
(its output, the cast gradients) are ``record_stream``-ed to the compute stream, which reads them
from then on. The compute stream waits for a reduction only when its gradients are written to
``.grad``, so the host never waits for the device in backward. On the CPU (gloo) there are no
streams: the same kernels in the same order, host-ordered, so the bits are those of an
unstreamed reduction.

[Note: replica phase]
On an HSDP mesh the shard reduction is followed by a second phase over this rank's replicate
group (see [Note: replicas and step replicas] in ``planner/owner_plan.py``). The layout's parameters
are ordered so that every chunk starts with its ``split`` pieces, in step-replica order, and ends
with the rest; the replicas then reduce-scatter the split prefix in whole-tensor intervals (the
step replica alone receives each sum) and all-reduce the remainder (``repeat`` pieces, evenly
sharded rows, usage flags and padding). On an accelerator the phase follows the shard reduction
on its own all-reduce stream (FSDP2's), so a block's cross-replica phase overlaps the next
block's in-node reduce-scatter; on the CPU it runs when the reduction is finished. Divisions use the whole
data-parallel world (``R * S``), as HSDP's average.

[Note: unused parameters]
A rank may not use every parameter in a step (conditional layers, MoE, a head used on some ranks
only). Each reduction carries one usage flag per parameter next to the gradients (1 where this
rank contributed a gradient, 0 where it sent zeros), summed with them. A rank that used the
parameter itself knows without looking; one that did not must learn whether *any* rank did: if
none did, the parameter gets no ``.grad`` (DDP's and FSDP2's behaviour), otherwise it gets the
reduced sum. That needs the summed flags on the host: :func:`read_flags` starts one transfer of
all of them at the end of backward, only in steps where this rank left something unused, and
:meth:`FlagRead.resolve` reads it as late as the backward allows.

[Note: usage-flag host read]
The flags are the only device value the host needs in a step; reading them is a host sync. On
the CPU it is a plain read. On an accelerator :func:`read_flags` concatenates the summed flags
on the device (one kernel) and copies them *asynchronously* into pinned host memory (one small
D2H copy per step, whatever the number of blocks or buckets), recording an event; the front-end
then enqueues what is left of its backward (reshards, frees) before :meth:`FlagRead.resolve`
waits for that event, the last point before ``backward()`` returns, which is when DDP's
semantics (``.grad`` is ``None`` where no rank used a parameter) must hold.

``set_find_unused_parameters(False)`` (both front-ends; DDP's ``find_unused_parameters`` with the
opposite default) skips the read altogether: the user promises every parameter gets a gradient
on some rank in every step, so a rank that did not use one takes the reduced sum unread (zeros
if the promise was broken: a gradient of zeros instead of ``None``, never a wrong value). Then a
step has no host sync at all, also when conditional layers or MoE experts go unused on a rank.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..comm.collectives import (Handle, SegmentCollectives, collectives_for, current_stream,
                                wait_on_current_stream)
from ..mesh import MeshInfo
from .layout import BlockLayout, aligned_numel
from .streams import CommContext

__all__ = ["PendingReduce", "ReplicaComm", "Reducer", "replica_comm", "divide_factors", "read_flags", "FlagRead",
           "PinnedStaging", "check_find_unused", "host_reads"]


#: flag reads done by this process (tests count them: at most one per step)
host_reads = [0]


def divide_factors(world_size: int, factor: float | None, dtype: torch.dtype, *,
                   predivide: bool = False) -> tuple[float, float]:
    """``(pre, post)``: a reduced gradient is ``sum(g / pre) / post`` with ``pre * post = factor``
    (default ``world_size``: the average).

    ``fully_shard`` sums first where the dtype has the range (fp32, fp64, bf16: ``pre = 1``, as
    FSDP2); narrower types (fp16) pre-divide by a power of two near ``sqrt(factor)`` so the sum
    cannot overflow at large ``W``. ``predivide=True`` is DDP's rule, which ``replicate`` follows for
    bitwise DDP parity: every contribution is multiplied by ``1 / factor`` before the sum
    (``post = 1``).
    """
    f = float(factor) if factor is not None else float(world_size)
    if predivide:
        return f, 1.0
    if dtype in (torch.float32, torch.float64, torch.bfloat16) or f != int(f):
        return 1.0, f
    pre = 1
    while f % (pre * 2) == 0 and f / (pre * 2) >= pre * 2:
        pre *= 2
    return float(pre), f / pre


@dataclass(eq=False)
class FlagRead:
    """One started read of summed usage flags (see [Note: usage-flag host read])."""

    entries: Sequence[tuple[Any, torch.Tensor, torch.Tensor]]
    host: torch.Tensor | None = None  #: the flags on the host (pinned on an accelerator)
    event: Any = None  #: recorded after the D2H copy (accelerators)

    def resolve(self, used: Callable[[Any, torch.Tensor], None],
                unused: Callable[[Any], None] | None = None) -> None:
        """For each ``(param, reduced_grad, summed_flag)``: ``used(param, grad)`` if some rank used
        it, else ``unused(param)``; a read without flags (``find_unused=False``) calls ``used``
        for every entry."""
        if self.host is None:
            for param, grad, _ in self.entries:
                used(param, grad)
            return
        if self.event is not None:
            self.event.synchronize()  # the one host wait of the step, as late as possible
        counts = self.host.tolist()
        for (param, grad, _), n in zip(self.entries, counts):
            if n > 0:
                used(param, grad)
            elif unused is not None:
                unused(param)


class PinnedStaging:
    """The host side of one model's flag reads on an accelerator: one page-locked buffer, grown
    when a read needs more and reused by every later step (pinning memory is a slow host call;
    FSDP2 does not pin per step either). A read's buffer is free again once it resolved, before
    ``backward()`` returned, so steps never share it."""

    def __init__(self, pin_memory: bool = True):
        self.pin_memory = pin_memory
        self._buf: torch.Tensor | None = None
        self.allocations = 0  #: buffers made (tests: one per model, not one per step)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        b = self._buf
        if b is None or b.numel() < numel or b.dtype != dtype:
            b = self._buf = torch.empty(numel, dtype=dtype, pin_memory=self.pin_memory)
            self.allocations += 1
        return b[:numel]


def read_flags(entries: Sequence[tuple[Any, torch.Tensor, torch.Tensor]], *,
               find_unused: bool = True, staging: PinnedStaging | None = None) -> FlagRead:
    """Start reading the summed flags of ``entries`` (none when ``entries`` is empty or
    ``find_unused`` is False) into ``staging``'s buffer on an accelerator; see [Note: usage-flag
    host read]."""
    if not entries or not find_unused:
        return FlagRead(entries)
    host_reads[0] += 1
    flags = torch.cat([f for _, _, f in entries])
    if flags.device.type == "cpu":
        return FlagRead(entries, flags)
    host = (staging or PinnedStaging()).take(flags.numel(), flags.dtype)
    host.copy_(flags, non_blocking=True)
    event = current_stream(flags.device).record_event()
    return FlagRead(entries, host, event)


def check_find_unused(value: Any, api: str) -> bool:
    """``set_find_unused_parameters``' argument check (both front-ends)."""
    if not isinstance(value, bool):
        raise TypeError(f"{api}.set_find_unused_parameters: find_unused_parameters must be a bool, "
                        f"got {value!r}")
    return value


@dataclass(frozen=True, eq=False)
class ReplicaComm:
    """This rank's replicate group (HSDP): its collectives, coordinate and size."""

    coll: SegmentCollectives
    rank: int
    size: int


def replica_comm(info: MeshInfo, kind: str) -> ReplicaComm | None:
    """The replicate group's collectives on an HSDP mesh (``kind`` as the shard group's), else
    ``None``: both front-ends combine replicas through it."""
    if not info.is_hsdp:
        return None
    return ReplicaComm(collectives_for(info.replicate_group, kind), info.replicate_rank, info.replicate_size)


@dataclass(eq=False)
class PendingReduce:
    """One issued reduction: what :meth:`Reducer.finish` needs once it completed."""

    reducer: "Reducer"
    handle: Handle
    out: torch.Tensor  #: this rank's chunk (+ summed usage flags)
    inp: torch.Tensor | None  #: kept alive until the collective completed (see release_input)
    post: float
    used: tuple[bool, ...]  #: per parameter: this rank contributed a gradient
    #: on an accelerator: the reduced gradients (and the tensors behind them) the reduce stream
    #: produced after the collective; ``None`` on the CPU (made by ``finish``)
    reduced: tuple[list[torch.Tensor | None], list[torch.Tensor]] | None = None
    #: on an accelerator: recorded on the reduce stream right after the reduce-scatter, before
    #: the replica phase (FSDP2's ``reduce_scatter_event``)
    rs_event: Any = None

    def release_input(self) -> None:
        """Give the input buffer back once the reduce-scatter that reads it is done, without
        waiting for the rest (the replica phase, the division, the cast): on an accelerator the
        current stream waits for :attr:`rs_event` (FSDP2's input-buffer cap waits for just that),
        on the CPU the host waits for the collective. :meth:`Reducer.finish` follows later."""
        if self.inp is None:
            return
        if self.rs_event is not None:
            wait_on_current_stream(self.rs_event)  # see [Note: event waits] in comm/collectives.py
        else:
            self.handle.wait()  # the reduce-scatter only: the CPU replica phase runs at finish
        self.inp = None


@dataclass(eq=False)
class Reduced:
    """A finished reduction, per parameter of the layout: ``grads[j]`` (this rank's rows of the
    averaged gradient, in the parameter's dtype; ``None`` for a ``split`` parameter another
    replica steps), ``flags[j]`` (the summed usage flag; ``None`` where it is not flagged to this
    rank) and ``used[j]`` (this rank contributed)."""

    grads: list[torch.Tensor | None]
    flags: list[torch.Tensor | None]
    used: tuple[bool, ...]


class Reducer:
    """The reduction of one segment layout (a block, or a bucket of whole parameters).

    Args:
        layout: the parameters reduced, in wire order.
        rank, coll: this rank and the shard group's collectives.
        comm: the model's streams.
        reduce_dtype: the dtype summed on the wire.
        grad_dtypes: each parameter's gradient dtype (the cast target).
        replicas: this rank's replicate group on an HSDP mesh (``None``: none, or of size 1).
        step_replicas: each parameter's step replica (``split``) or ``None`` (see [Note: replica
            phase]); the chunk must hold split pieces first, in step-replica order.
        predivide: DDP's rule, every contribution times ``1 / factor`` before the sum
            (``replicate``: bitwise DDP parity), else FSDP2's (see :func:`divide_factors`).
        flags_to: ``"all"`` or ``"holders"`` (see [Note: usage flags]).
        api: the front-end's name, for errors.
    """

    def __init__(self, layout: BlockLayout, *, rank: int, coll: SegmentCollectives, comm: CommContext,
                 reduce_dtype: torch.dtype, grad_dtypes: Sequence[torch.dtype],
                 replicas: ReplicaComm | None = None, step_replicas: Sequence[int | None] | None = None,
                 predivide: bool = False, flags_to: str = "all", api: str = "matrixfsdp"):
        self.layout, self.rank, self.coll, self.comm = layout, rank, coll, comm
        self.world_size = coll.world_size
        self.reduce_dtype = reduce_dtype
        self.grad_dtypes = tuple(grad_dtypes)
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        self.predivide = predivide
        self.api = api
        F = self.num_flags = len(layout.params)
        W = self.world_size
        if flags_to == "all":
            flagged: tuple[tuple[int, ...], ...] = (tuple(range(F)),) * W
        elif flags_to == "holders":  # alike within a span (cut at every owner and run end)
            per_rank: list[tuple[int, ...]] = []
            for sp in layout.spans:
                held = tuple(j for j, p in enumerate(layout.params) if p.owner == sp.lo or p.rows.holds(sp.lo))
                per_rank += [held] * (sp.hi - sp.lo)
            flagged = tuple(per_rank)
        else:
            raise ValueError(f"{api}: flags_to must be 'all' or 'holders', got {flags_to!r}")
        #: the parameters flagged to each destination, in layout order (see [Note: usage flags])
        self.flagged = flagged
        n = layout.chunk_numel
        self.splits = tuple(aligned_numel(n[d] + len(flagged[d]), reduce_dtype.itemsize) for d in range(W))
        ends = tuple(itertools.accumulate(self.splits, initial=0))
        self.offsets = ends[:-1]
        self.numel = ends[-1]
        self.chunk = n[rank]
        self._pads = [self.splits[d] - n[d] - len(flagged[d]) for d in range(W)]
        self._max_pad = max(self._pads, default=0)
        #: where each destination's flags start in the flag block (see :meth:`_flag_block`)
        self._flag_starts = tuple(itertools.accumulate((len(f) for f in flagged), initial=0))
        self.step_replicas = tuple(step_replicas) if step_replicas is not None else (None,) * F
        #: ``(m, splits, start)``: this rank's chunk begins with ``m`` elements of ``split``
        #: pieces, ``splits[q]`` stepped by replica ``q``, this replica's from ``start``
        self.split_prefix = self._split_prefix()
        #: DDP's pre-division, applied by :meth:`put` while copying (as DDP's bucket copy)
        self._put_scale = 1.0 / divide_factors(self._group_size, None, reduce_dtype, predivide=True)[0]
        #: index tensors of the padding and the flag blocks, made once per device (no host-to-
        #: device copy per backward)
        self._index_cache: dict[tuple[str, torch.device], torch.Tensor] = {}
        #: every destination's flags per usage pattern (see :meth:`_flag_block`)
        self._flag_cache: dict[tuple, torch.Tensor] = {}

    # ============================================================================ copy-in
    def copy_in(self, grads: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
        """The whole input in one fused copy (a block's gradients at its post-backward): zeros
        stand in for missing gradients and fill the padding; the flags come from a device constant
        per usage pattern, so there is no host-to-device copy.

        Every source is made in one dtype, the gradients': where it is not the wire's (bf16
        gradients, fp32 ``reduce_dtype``), one ``_foreach_copy_`` casts while it copies (a fused
        multi-tensor kernel on an accelerator, as FSDP2's ``chunk_cat`` casts), where
        ``torch.cat`` into a buffer of another dtype would fall back to one copy per part.

        One kernel takes one part per (destination, piece): the parts are listed from the
        layout's spans (see [Note: spans] in ``engine/layout.py``), without a piece object each.
        """
        lay, dt = self.layout, self.reduce_dtype
        flat = [None if g is None else g.reshape(-1) for g in grads]
        dtypes = {g.dtype for g in flat if g is not None}
        src_dt = dtypes.pop() if len(dtypes) == 1 else dt  # mixed gradient dtypes: cat casts each
        used = tuple(g is not None for g in grads)
        flag_block = self._flag_block(used, src_dt, device)
        # as large as the largest missing piece or padding
        n_zero = max([q.numel for sp in lay.spans for q in sp.pieces if flat[q.param] is None]
                     + [self._max_pad, 1])
        zeros = torch.zeros(n_zero, dtype=src_dt, device=device)
        parts: list[torch.Tensor] = []
        starts = self._flag_starts  # of each destination's flags in flag_block
        for sp in lay.spans:
            for d in range(sp.lo, sp.hi):
                step = d - sp.lo  # rank d's pieces lie this many pieces further into each parameter
                for q in sp.pieces:
                    g = flat[q.param]
                    a = q.flat_start + step * q.numel
                    parts.append(zeros[: q.numel] if g is None else g[a: a + q.numel])
                parts.append(flag_block[starts[d]: starts[d + 1]])
                if self._pads[d]:
                    parts.append(zeros[: self._pads[d]])
        buf = torch.empty(self.numel, dtype=dt, device=device)
        if src_dt == dt:
            torch.cat(parts, out=buf)  # one copy-in kernel, on the compute stream
        else:
            parts = [t for t in parts if t.numel()]
            torch._foreach_copy_(list(buf.split([t.numel() for t in parts])), parts)
        return buf

    def _flag_block(self, used: tuple[bool, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Every destination's usage flags, concatenated in wire order (``used[j]`` is parameter
        ``j``'s flag): a device constant, made once per usage pattern without a host-to-device
        copy (one block per destination in the copy-in, not one element per flag)."""
        key = (used, dtype, torch.device(device))
        t = self._flag_cache.get(key)
        if t is None:
            flags = torch.ones(self.num_flags, dtype=dtype, device=device)
            for j, u in enumerate(used):
                if not u:
                    flags[j: j + 1].fill_(0.0)
            if all(len(f) == self.num_flags for f in self.flagged):  # flags_to="all"
                t = flags.repeat(self.world_size)
            else:  # (an index built once per reducer)
                t = flags.index_select(0, self._index("flag_src", device))
            if len(self._flag_cache) >= 4:  # patterns seen: all used, plus a few unused sets
                self._flag_cache.pop(next(iter(self._flag_cache)))
            self._flag_cache[key] = t
        return t

    def new_input(self, device: torch.device) -> torch.Tensor:
        """An input for :meth:`put` (a bucket's gradients as they become ready). Its padding is
        zeroed here, once (one kernel), and never written again, so the reduction never sums
        uninitialized memory; every piece and flag is written before each launch."""
        buf = torch.empty(self.numel, dtype=self.reduce_dtype, device=device)
        if any(self._pads):
            buf.index_fill_(0, self._index("pads", device), 0)
        return buf

    def _index(self, what: str, device: torch.device) -> torch.Tensor:
        """The positions in the input of its padding (``"pads"``), of every destination's flags
        (``"flag_dst"``) and the parameter each of those flags is (``"flag_src"``)."""
        key = (what, torch.device(device))
        t = self._index_cache.get(key)
        if t is None:
            W, n = self.world_size, self.layout.chunk_numel
            end = [self.offsets[d] + self.splits[d] for d in range(W)]
            values = {
                "pads": [i for d in range(W) for i in range(end[d] - self._pads[d], end[d])],
                "flag_dst": [self.offsets[d] + n[d] + k for d in range(W) for k in range(len(self.flagged[d]))],
                "flag_src": [j for d in range(W) for j in self.flagged[d]],
            }[what]
            t = self._index_cache[key] = torch.tensor(values, dtype=torch.long, device=device)
        return t

    def put(self, buf: torch.Tensor, j: int, grad: torch.Tensor | None) -> None:
        """Parameter ``j``'s pieces into ``buf`` (zeros for a parameter this rank did not use),
        times ``1 / factor`` with ``predivide`` (DDP multiplies while copying into its bucket; the
        launch then must say ``prescaled=True``)."""
        flat = None if grad is None else grad.reshape(-1)
        for q in self.layout.pieces_of_param(j):
            start = self.offsets[q.rank] + q.offset
            dst = buf[start: start + q.numel]
            if flat is None:
                dst.zero_()
            elif self.predivide:
                src = flat[q.flat_start: q.flat_start + q.numel]
                if src.dtype == dst.dtype:
                    torch.mul(src, self._put_scale, out=dst)
                else:  # multiply in the wire's dtype: mul(out=) would round in the gradient's
                    dst.copy_(src).mul_(self._put_scale)
            else:
                dst.copy_(flat[q.flat_start: q.flat_start + q.numel])

    def write_flags(self, buf: torch.Tensor, used: Sequence[bool]) -> None:
        """Every destination's flag block (after :meth:`put`): 1 where this rank used the
        parameter, in one scatter from the device constant of this usage pattern (no host-to-
        device copy, no kernel per parameter)."""
        if not self.num_flags:
            return
        buf.index_copy_(0, self._index("flag_dst", buf.device),
                        self._flag_block(tuple(used), self.reduce_dtype, buf.device))

    # ============================================================================ launch
    @property
    def _group_size(self) -> int:
        """The data-parallel world the average runs over (``R * S`` on an HSDP mesh)."""
        return self.world_size * (self.replicas.size if self.replicas else 1)

    def launch(self, buf: torch.Tensor, used: Sequence[bool], *, divide_factor: float | None = None,
               prescaled: bool = False) -> PendingReduce:
        """Divide ``buf`` (unless :meth:`put` did, ``prescaled``) and issue its reduce-scatter
        (see [Note: streams])."""
        comm, dt = self.comm, self.reduce_dtype
        pre, post = divide_factors(self._group_size, divide_factor, dt, predivide=self.predivide)
        with torch.no_grad(), comm.use(comm.reduce):  # the reduce stream waits for the copy-in
            if pre != 1 and not prescaled:
                # times the reciprocal, as DDP (bitwise DDP parity); FSDP2's pre-divisors are
                # powers of two, for which this is the division's exact result
                buf.mul_(1.0 / pre)
            out = torch.empty(self.splits[self.rank], dtype=dt, device=buf.device)
            handle = self.coll.reduce_scatter_segments(out, buf, self.splits, async_op=not comm.on_device)
            reduced = rs_event = None
            if comm.on_device:
                rs_event = comm.reduce.record_event()
                # the replica phase, the division and the cast follow the collective off the
                # compute stream (FSDP2's post-reduce): on the reduce stream, or with replicas on
                # the all-reduce stream (after the reduce stream), so the next block's in-node
                # reduce-scatter does not queue behind this block's cross-replica phase
                post_stream = comm.reduce
                if self.replicas is not None:
                    post_stream = comm.all_reduce
                    out.record_stream(post_stream)  # freed after an aborted backward too
                with comm.use(post_stream) if post_stream is not comm.reduce else contextlib.nullcontext():
                    mine = self._combine_replicas(out, async_op=False)
                    reduced = self._reduced_grads(out, post, mine)
                    handle = Handle(event=post_stream.record_event())
        return PendingReduce(self, handle, out, buf, post, tuple(used), reduced, rs_event)

    # ============================================================================ replicas
    def _split_prefix(self) -> tuple[int, list[int], int]:
        """``(m, splits, start)``: the first ``m`` elements of this rank's chunk are its ``split``
        pieces, ``splits[q]`` of them stepped by replica ``q``, this replica's from ``start``."""
        if self.replicas is None:
            return 0, [0], 0
        R = self.replicas.size
        splits = [0] * R
        m, last, rest = 0, 0, False
        for q in self.layout.pieces_of_rank(self.rank):
            st = self.step_replicas[q.param]
            if st is None:
                rest = True
                continue
            if rest or st < last or q.offset != m:
                raise RuntimeError(f"{self.api}: internal error, a reduction chunk is not ordered by "
                                   "step replica")
            splits[st] += q.numel
            m += q.numel
            last = st
        return m, splits, sum(splits[: self.replicas.rank])

    def _combine_replicas(self, out: torch.Tensor, *, async_op: bool) -> torch.Tensor | None:
        """The replica phase (see [Note: replica phase]); returns this replica's reduced split
        interval (``None`` without HSDP or split pieces). Waited for before returning."""
        if self.replicas is None:
            return None
        rep = self.replicas
        m, splits, _ = self.split_prefix
        handles = []
        mine = None
        if m:
            mine = out.new_empty(splits[rep.rank])
            handles.append(rep.coll.reduce_scatter_segments(mine, out[:m], splits, async_op=async_op))
        handles.append(rep.coll.all_reduce(out[m:], async_op=async_op))
        for h in handles:
            h.wait()
        return mine

    def _reduced_grads(self, out: torch.Tensor, post: float, split_mine: torch.Tensor | None
                       ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """Divide this rank's reduced chunk by ``post`` and cast it to the gradients' dtype, once
        for the whole chunk when they share one (an elementwise cast: the same bits as per
        parameter). Returns the gradient per parameter (``None`` for a ``split`` parameter another
        replica steps) and the tensors the compute stream must keep alive (``record_stream``)."""
        lay, n = self.layout, self.chunk
        m, _, start = self.split_prefix
        targets = set(self.grad_dtypes)
        made: list[torch.Tensor] = []

        def finish(t: torch.Tensor) -> torch.Tensor:
            if post != 1:
                t.div_(post)
            if len(targets) == 1 and t.dtype not in targets:
                t = t.to(next(iter(targets)))
                made.append(t)
            return t

        data = finish(out[m:n])  # the split prefix, reduce-scattered, is in split_mine
        if split_mine is not None:
            made.append(split_mine)  # made on the reduce stream: the compute stream keeps it alive
        own = finish(split_mine) if split_mine is not None and split_mine.numel() else None
        mine = {q.param: q for q in lay.pieces_of_rank(self.rank)}
        grads: list[torch.Tensor | None] = []
        for j, p in enumerate(lay.params):
            dtype = self.grad_dtypes[j]
            shape = p.local_shape(self.rank)
            q = mine.get(j)
            if q is None:  # no rows on this rank: an empty gradient
                g = torch.empty(shape, dtype=dtype, device=out.device)
            elif q.offset < m:  # split: only the step replica holds the sum
                if self.step_replicas[j] != self.replicas.rank:  # type: ignore[union-attr]
                    grads.append(None)
                    continue
                g = own[q.offset - start: q.offset - start + q.numel].view(shape)  # type: ignore[index]
                if g.dtype != dtype:
                    g = g.to(dtype)
                    made.append(g)
            else:
                g = data[q.offset - m: q.offset - m + q.numel].view(shape)
                if g.dtype != dtype:  # mixed gradient dtypes: one cast each
                    g = g.to(dtype)
                    made.append(g)
            grads.append(g)
        return grads, made

    # ============================================================================ finish
    def finish(self, pending: PendingReduce) -> Reduced:
        """Wait for ``pending``; this rank's averaged gradients and the summed usage flags."""
        pending.handle.wait()
        out = pending.out
        with torch.no_grad():
            if pending.reduced is None:  # CPU: the host waited for the collective, divide now
                with self.comm.use(self.comm.reduce):  # (no stream on the CPU: one program order)
                    mine = self._combine_replicas(out, async_op=True)
                grads, made = self._reduced_grads(out, pending.post, mine)
            else:
                grads, made = pending.reduced
                # allocated on the reduce stream, read by the compute stream from now on
                # (gradients are views of them): their memory must not return to the reduce
                # stream's pool early
                compute = current_stream(out.device)
                for t in (out, *made):
                    t.record_stream(compute)
        n = self.chunk
        flags: list[torch.Tensor | None] = [None] * self.num_flags
        for k, j in enumerate(self.flagged[self.rank]):
            flags[j] = out[n + k: n + k + 1]
        return Reduced(grads, flags, pending.used)

    @staticmethod
    def drop(pending: PendingReduce) -> None:
        """After an aborted backward: wait for the issued reduction (every rank issued it) and
        discard its result."""
        pending.handle.wait()
