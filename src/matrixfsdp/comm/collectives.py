"""The two collectives the runtime needs, behind one small interface, with byte counting.

The front-ends never call ``torch.distributed`` for their reductions and gathers: they call a
:class:`SegmentCollectives` obtained from :func:`collectives_for` for their process group. Which
primitive carries a call is chosen by the tensor's device (see [Note: collectives by device]).

* ``all_gather_segments``: every rank contributes its chunk (its concatenated local row segments,
  uneven across ranks, possibly empty) and receives every peer's chunk. Only non-empty pieces
  move; nothing is padded.
* ``reduce_scatter_segments``: every rank contributes ``W`` uneven chunks (one per destination);
  rank ``r`` receives the elementwise sum of everyone's chunk ``r``.
* ``all_to_all_single``: one uneven all-to-all of flat buffers (the TP host step's fused gathers
  and scatters, ``tp/host_step.py``), counted like the others.

Implementations:

* :class:`AllToAllCollectives` (default): the gather is one list ``all_to_all`` on NCCL, every
  destination reading the chunk itself, and one ``batch_isend_irecv`` fan-out on gloo (whose list
  all-to-all rejects uneven sizes); no ``W``-fold copy of the chunk is ever made. The reduction is
  one ``reduce_scatter_tensor`` when the chunks are equal, else one ``reduce_scatter(out, list)``
  with uneven sizes (0 included).
* :class:`P2PCollectives`: the gather as one ``batch_isend_irecv`` fan-out (no replicated input
  buffer); same reduction.
* :class:`TwoPhaseCollectives`: bandwidth-bounded whatever the owner imbalance. The gather is an
  owner scatter (uneven ``all_to_all_single``: each rank spreads its chunk over the ``W`` equal
  slices of the block) followed by an equal-chunk ``all_gather_into_tensor`` (ring); the reduction
  is an equal-chunk ``reduce_scatter_tensor`` (ring) followed by an uneven ``all_to_all_single``
  that moves each reduced slice to its owners. The busiest rank moves at most
  ``(W-1)/W * (block + largest chunk)`` bytes, i.e. <= 2x a ring all-gather, instead of
  ``gamma_B * (W-1)/W * block`` for the direct fan-out (see ``benchmarks/scaling_model.py``).

Each instance owns a :class:`CommCounter`; tests and benchmarks read and reset it.

[Note: ordering of collectives]
gloo (like NCCL) matches collectives by issue order within a process group, so every rank must
issue the same collectives in the same order. The runtime guarantees it by construction: all
collectives are issued from forward pre-hooks (program order), backward pre-hooks and the
materialization ``autograd.Function``'s backward, which are ordered by autograd's data
dependencies, not by timing (see [Note: backward ordering] in ``_fully_shard/state.py``). Nothing here issues
a collective on its own initiative.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from ..mesh import backend_map

__all__ = [
    "CommCounter",
    "Handle",
    "current_stream",
    "wait_on_current_stream",
    "SegmentCollectives",
    "AllToAllCollectives",
    "P2PCollectives",
    "TwoPhaseCollectives",
    "collectives_for",
    "KINDS",
]


# ---------------------------------------------------------------- test hook: collectives at W=1
#: depth of open :func:`force_collectives` blocks (a counter, not a thread-local: autograd's
#: device threads issue the reductions of a backward started inside the block)
_FORCED = [0]


@contextlib.contextmanager
def force_collectives():
    """Test hook (``benchmarks/gpu/check.py`` and tests only): inside the block a one-rank group
    still calls its backend, so a single GPU runs NCCL on the gather and reduce streams.

    Outside it, ``W == 1`` takes short-cuts that issue nothing (the results are identities). Inside
    it, the reductions (``reduce_scatter_segments``, ``all_reduce``) and ``all_to_all_single`` run
    their collective on the one rank, and a gather, which has nothing to receive at ``W == 1``,
    sends this rank's chunk to itself into a scratch buffer it drops; ``TwoPhaseCollectives`` runs
    both of its phases. The results are the short-cuts' bit for bit (a sum over one rank is the
    input). ``all_gather_tensors`` stays a no-op: nothing calls it with one rank (a replicate
    group of size 1 is dropped by the engine). Scoped and reentrant, but process-wide while open,
    so open it around a whole single-process run, never in a job that must not change.

    Example::

        with force_collectives():
            loss.backward()      # at W=1: one reduce-scatter per block reaches the process group
    """
    _FORCED[0] += 1
    try:
        yield
    finally:
        _FORCED[0] -= 1


#: the reductions ``all_reduce`` takes (``dist.ReduceOp`` members, by lower-case name)
_REDUCE_OPS = ("sum", "max")


def _solo(world_size: int) -> bool:
    """Whether a call takes the ``W == 1`` short-cut (not under :func:`force_collectives`)."""
    return world_size == 1 and not _FORCED[0]


def _one_rank_gather(group: Any, t: torch.Tensor, *, async_op: bool) -> "Handle":
    """A gather at ``W == 1``: nothing to receive, so nothing is issued, except under
    :func:`force_collectives`, where ``t`` travels to this rank through the backend into a scratch
    copy (dropped once the handle is waited for)."""
    if not _FORCED[0] or t.numel() == 0:
        return Handle()
    scratch = torch.empty_like(t)
    work = dist.all_to_all_single(scratch, t, group=group, async_op=async_op)
    return Handle([work] if async_op else [], then=lambda: scratch)


@dataclass
class CommCounter:
    """Calls and bytes per operation kind (bytes are logical payload, as seen by this rank).

    Example::

        c = comm_counter(model)        # from matrixfsdp._fully_shard
        c.reset(); train_step(); print(c.calls, c.bytes_sent)
    """

    calls: dict[str, int] = field(default_factory=dict)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_recv: dict[str, int] = field(default_factory=dict)

    def record(self, op: str, sent: int, recv: int) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes_sent[op] = self.bytes_sent.get(op, 0) + sent
        self.bytes_recv[op] = self.bytes_recv.get(op, 0) + recv

    def reset(self) -> None:
        self.calls.clear()
        self.bytes_sent.clear()
        self.bytes_recv.clear()

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain-dict copy (picklable, for returning from worker processes)."""
        return {k: dict(v) for k, v in dataclasses.asdict(self).items()}


def current_stream(device: torch.device) -> Any:
    """``device``'s current stream as its device module's type (``torch.cuda.Stream`` on CUDA),
    never the generic ``torch.Stream`` (see [Note: event waits])."""
    return torch.get_device_module(device.type).current_stream(device)


def wait_on_current_stream(event: Any) -> None:
    """Make the current stream of ``event``'s device wait for ``event`` (no host sync).

    [Note: event waits]
    Every device wait of the runtime is ``event.wait(stream)``, with the event recorded on a
    device-module stream (so a ``torch.cuda.Event``) and the stream from
    :func:`current_stream`, as FSDP2 does. The event's own type then picks the implementation.
    The generic ``torch.Stream.wait_event`` must not be given a ``torch.cuda.Event``: in torch's
    C++ (``torch/csrc/Stream.cpp``, ``THPStream_wait_event``) it casts the event to the generic
    ``THPEvent`` and blocks on its base ``c10::Event``, which ``torch.cuda.Event``'s constructor
    never initializes (``THCPEvent`` keeps its CUDA event in its own ``cuda_event`` member), so
    ``c10::Event::block`` returns at ``if (!was_marked_for_recording_)``: the wait is silently
    skipped, a data race. ``tests/engine/test_event_waits.py`` pins the rule."""
    event.wait(current_stream(event.device))


class Handle:
    """A waitable for one issued collective: zero or more ``dist.Work`` (host-waited, as gloo's
    async works are), an optional device ``event`` (accelerators: the waiting stream is made to
    wait for it, no host sync) and ``then``, run once after they complete (e.g. to issue a
    dependent second phase or unpack a staging buffer)."""

    __slots__ = ("_works", "_then", "_event")

    def __init__(self, works: Sequence[Any] = (), then: Any = None, event: Any = None):
        self._works = [w for w in works if w is not None]
        self._then = then
        self._event = event

    def wait(self) -> None:
        works, self._works = self._works, []
        for w in works:
            w.wait()
        event, self._event = self._event, None
        if event is not None:
            wait_on_current_stream(event)
        then, self._then = self._then, None
        if then is not None:
            then()

    @property
    def done(self) -> bool:
        return not self._works and self._then is None and self._event is None


@runtime_checkable
class SegmentCollectives(Protocol):
    """Uneven segment gather / reduce-scatter over one process group (see module docstring)."""

    group: Any
    rank: int
    world_size: int
    counter: CommCounter

    def all_gather_segments(
        self, send: torch.Tensor, recv: torch.Tensor, recv_splits: Sequence[int], *, async_op: bool
    ) -> Handle:
        """Send the 1-D ``send`` (this rank's chunk) to every peer; receive peer ``s``'s chunk
        (``recv_splits[s]`` elements, 0 for self) into the 1-D ``recv``, peers in rank order."""
        ...

    def reduce_scatter_segments(
        self, out: torch.Tensor, inp: torch.Tensor, splits: Sequence[int], *, async_op: bool
    ) -> Handle:
        """``inp`` (1-D) is ``W`` chunks of sizes ``splits`` in rank order; ``out`` receives the sum
        over ranks of chunk ``rank`` (``splits[rank]`` elements)."""
        ...

    def all_gather_inplace(self, buf: torch.Tensor, splits: Sequence[int], *, async_op: bool) -> Handle:
        """``buf`` (1-D) is ``W`` intervals of sizes ``splits`` in rank order, this rank's holding
        its values; fill every peer's interval from its rank, in place (``replicate``'s buckets)."""
        ...

    def all_gather_fixed(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather a small tensor of identical shape on every rank -> ``[W, *t.shape]``."""
        ...

    def all_reduce(self, t: torch.Tensor, *, async_op: bool, op: str = "sum") -> Handle:
        """Reduce the 1-D ``t`` over the group in place: ``op="sum"`` (HSDP's cross-replica
        reduction, counted as ``"all_reduce"``) or ``"max"`` (QK-clip's packed max logits,
        counted as ``"all_reduce_max"``)."""
        ...

    def all_gather_tensors(self, tensors: Sequence[Sequence[torch.Tensor]], *, async_op: bool) -> Handle:
        """``tensors[q]`` hold group rank ``q``'s values on rank ``q``; fill them in place on every
        other rank (HSDP ``split``'s parameter exchange: whole tensors, nothing packed)."""
        ...

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """Broadcast ``t`` from group rank ``src`` in place."""
        ...

    def all_to_all_single(self, recv: torch.Tensor, send: torch.Tensor, recv_splits: Sequence[int],
                          send_splits: Sequence[int], *, async_op: bool) -> Handle:
        """Uneven all-to-all of 1-D buffers: ``send`` is ``W`` chunks of sizes ``send_splits``
        (chunk ``d`` goes to rank ``d``), ``recv`` receives ``W`` chunks of sizes ``recv_splits``
        (chunk ``s`` from rank ``s``), in rank order (the TP host step's gathers and scatters)."""
        ...


class _Base:
    def __init__(self, group: Any):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.counter = CommCounter()
        self._backends = backend_map(group)

    def _uneven_lists(self, t: torch.Tensor) -> bool:
        """[Note: collectives by device] Whether the backend serving ``t``'s device takes uneven
        list collectives (list ``all_to_all`` and ``reduce_scatter``: NCCL); gloo, which refuses
        them, gets the P2P forms. Decided per tensor: a ``"cpu:gloo,cuda:nccl"`` group serves CUDA
        tensors with NCCL and CPU tensors with gloo, and a group reporting ``"undefined"`` or a
        composite string still gets the right path."""
        return self._backends.get(t.device.type) == "nccl"

    def _list_reduce_scatter(self, t: torch.Tensor) -> bool:
        """Whether the reduction takes the list ``reduce_scatter`` (NCCL's form, no staging): also
        on torch's fake backend, which stands in for NCCL in dry runs (``matrixfsdp.dryrun``) and
        takes uneven lists there, so a dry run allocates what an NCCL job does, not the P2P form's
        ``W - 1`` staged chunks (its list ``all_to_all`` copies whole tensors, so gathers keep
        the fan-out, whose buffers are the NCCL form's)."""
        return self._backends.get(t.device.type) in ("nccl", "fake")

    def reduce_scatter_segments(
        self, out: torch.Tensor, inp: torch.Tensor, splits: Sequence[int], *, async_op: bool
    ) -> Handle:
        splits = self._check_reduce(out, inp, splits)
        es = inp.element_size()
        self.counter.record(
            "reduce_scatter",
            (inp.numel() - splits[self.rank]) * es,
            (self.world_size - 1) * splits[self.rank] * es,
        )
        if _solo(self.world_size):
            out.copy_(inp)
            return Handle()
        if not self._list_reduce_scatter(inp) and self.world_size > 1:
            return self._p2p_reduce_scatter(out, inp, splits, async_op)
        if len(set(splits)) == 1:
            # equal chunks: one ring reduce-scatter (a list becomes W coalesced reduces on NCCL)
            work = dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, group=self.group,
                                              async_op=async_op)
        else:
            # uneven chunks (owners): W reduces to their destinations, coalesced by the backend
            chunks = list(torch.split(inp, splits))
            work = dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=self.group,
                                       async_op=async_op)
        return Handle([work] if async_op else [])

    def all_gather_inplace(self, buf: torch.Tensor, splits: Sequence[int], *, async_op: bool) -> Handle:
        """``buf`` (1-D) is ``W`` intervals of sizes ``splits`` in rank order; fill every peer's
        interval from its owner, in place (this rank's interval is the send buffer). NCCL: one list
        ``all_to_all`` over views of ``buf``; gloo: one ``batch_isend_irecv`` fan-out. Nothing is
        copied or padded."""
        splits = self._check_inplace(buf, splits)
        W, r = self.world_size, self.rank
        es = buf.element_size()
        self.counter.record("all_gather", splits[r] * (W - 1) * es, (buf.numel() - splits[r]) * es)
        if W == 1:
            return _one_rank_gather(self.group, buf, async_op=async_op)
        views = list(torch.split(buf, splits))
        mine = views[r]
        if self._uneven_lists(buf):
            outs = [v if s != r else mine[:0] for s, v in enumerate(views)]
            ins = [mine if d != r else mine[:0] for d in range(W)]
            work = dist.all_to_all(outs, ins, group=self.group, async_op=async_op)
            return Handle([work] if async_op else [])
        return self._fan_out([[v] for v in views], async_op)

    def _check_inplace(self, buf: torch.Tensor, splits: Sequence[int]) -> list[int]:
        splits = list(splits)
        if len(splits) != self.world_size or sum(splits) != buf.numel():
            raise ValueError(f"all_gather_inplace: splits {splits} do not match W={self.world_size} "
                             f"and buffer numel {buf.numel()}")
        return splits

    def _p2p_reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, splits: list[int],
                            async_op: bool) -> Handle:
        """gloo: each rank sends chunk ``d`` to rank ``d`` (one ``batch_isend_irecv``) and sums the
        ``W`` chunks it receives, in rank order, when the handle is waited. Measured on this CPU
        (W=4, 1.5M fp32 elements, uneven): 12.7 ms, against 29.5 ms for gloo's list
        ``reduce_scatter`` and 16.1 ms for a full ``all_reduce``. Temporary: ``W - 1`` chunks of
        this rank's size."""
        W, r = self.world_size, self.rank
        own = splits[r]
        chunks = list(torch.split(inp, splits))
        stage = inp.new_empty((W - 1) * own)
        recv = list(torch.split(stage, [own] * (W - 1))) if own else []
        peers = [s for s in range(W) if s != r]
        ops = [dist.P2POp(dist.irecv, v, group=self.group, group_peer=s) for s, v in zip(peers, recv)]
        ops += [dist.P2POp(dist.isend, chunks[d], group=self.group, group_peer=d)
                for d in range(W) if d != r and splits[d]]

        def reduce() -> None:  # summed in rank order, the same on every rank
            parts = {s: v for s, v in zip(peers, recv)}
            parts[r] = chunks[r]
            out.copy_(parts[0])
            for s in range(1, W):
                out.add_(parts[s])

        h = Handle(dist.batch_isend_irecv(ops) if ops else [], then=reduce if own else None)
        if not async_op:
            h.wait()
        return h

    def all_reduce(self, t: torch.Tensor, *, async_op: bool, op: str = "sum") -> Handle:
        if op not in _REDUCE_OPS:
            raise ValueError(f"SegmentCollectives.all_reduce: op must be one of {list(_REDUCE_OPS)}, got {op!r}")
        W, n = self.world_size, t.nbytes
        # a ring all-reduce's payload: a reduce-scatter plus an all-gather of (W-1)/W of t each way
        moved = 2 * (W - 1) * n // W if W > 1 else 0
        self.counter.record("all_reduce" if op == "sum" else f"all_reduce_{op}", moved, moved)
        if _solo(W) or t.numel() == 0:
            return Handle()
        work = dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()), group=self.group, async_op=async_op)
        return Handle([work] if async_op else [])

    def all_gather_tensors(self, tensors: Sequence[Sequence[torch.Tensor]], *, async_op: bool) -> Handle:
        """One ``batch_isend_irecv`` on every backend: rank ``q`` sends each of its tensors to every
        peer, which receives it into its own copy. Whole tensors travel as they are (no staging
        buffer, no padding); NCCL coalesces the batch into one group call."""
        W, r = self.world_size, self.rank
        if len(tensors) != W:
            raise ValueError(f"all_gather_tensors: expected {W} tensor lists (one per rank), got {len(tensors)}")
        mine = sum(t.nbytes for t in tensors[r])
        self.counter.record("all_gather_tensors", mine * (W - 1),
                            sum(t.nbytes for q, ts in enumerate(tensors) if q != r for t in ts))
        if W == 1:
            return Handle()
        return self._fan_out(tensors, async_op)

    def _fan_out(self, tensors: Sequence[Sequence[torch.Tensor]], async_op: bool) -> Handle:
        """One ``batch_isend_irecv``: this rank's ``tensors[r]`` to every peer, each peer's
        ``tensors[q]`` received in place (matched in list order on both sides)."""
        W, r = self.world_size, self.rank
        ops = [dist.P2POp(dist.irecv, t, group=self.group, group_peer=q)
               for q, ts in enumerate(tensors) if q != r for t in ts if t.numel()]
        ops += [dist.P2POp(dist.isend, t, group=self.group, group_peer=d)
                for t in tensors[r] if t.numel() for d in range(W) if d != r]
        if not ops:
            return Handle()
        h = Handle(dist.batch_isend_irecv(ops))
        if not async_op:
            h.wait()
        return h

    def all_gather_fixed(self, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty(self.world_size * t.numel())  # gloo wants a flat output
        self.counter.record("all_gather_fixed", t.nbytes * (self.world_size - 1),
                            t.nbytes * (self.world_size - 1))
        dist.all_gather_single(out, t.contiguous().reshape(-1), group=self.group)
        return out.view(self.world_size, *t.shape)

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        n = t.nbytes
        self.counter.record("broadcast", n * (self.world_size - 1) if self.rank == src else 0,
                            0 if self.rank == src else n)
        # gloo sends and receives a tensor's storage as is: a non-contiguous one (a transposed
        # view, SOAP's eigenbases from eigh) would arrive scrambled; go through a contiguous copy
        buf = t if t.is_contiguous() else t.contiguous()
        dist.broadcast(buf, group_src=src, group=self.group)
        if buf is not t and self.rank != src:
            t.copy_(buf)

    def all_to_all_single(self, recv: torch.Tensor, send: torch.Tensor, recv_splits: Sequence[int],
                          send_splits: Sequence[int], *, async_op: bool) -> Handle:
        """One ``all_to_all_single``: NCCL and gloo both take uneven splits in this form (a
        ``"cpu:gloo,cuda:nccl"`` group serves it by the tensors' device); one rank copies."""
        W, r = self.world_size, self.rank
        recv_splits, send_splits = list(recv_splits), list(send_splits)
        if len(recv_splits) != W or len(send_splits) != W or sum(recv_splits) != recv.numel() \
                or sum(send_splits) != send.numel():
            raise ValueError(
                f"all_to_all_single: splits must have W={W} entries summing to the buffers' sizes, got "
                f"recv_splits {recv_splits} for {recv.numel()} and send_splits {send_splits} for "
                f"{send.numel()} elements"
            )
        es = send.element_size()
        self.counter.record("all_to_all_single", (send.numel() - send_splits[r]) * es,
                            (recv.numel() - recv_splits[r]) * es)
        if _solo(W):
            recv.copy_(send)
            return Handle()
        if send.numel() == 0 and self._backends.get(send.device.type) == "fake":
            # torch's fake process group (the dry run) moves no data, fills the receive buffer from
            # the send buffer and so refuses an empty one (a rank with no rows of a hosted matrix);
            # the call is counted above as on any backend
            return Handle()
        work = dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                      group=self.group, async_op=async_op)
        return Handle([work] if async_op else [])

    def _check_reduce(self, out: torch.Tensor, inp: torch.Tensor, splits: Sequence[int]) -> list[int]:
        splits = list(splits)
        if len(splits) != self.world_size or sum(splits) != inp.numel():
            raise ValueError(
                f"reduce_scatter_segments: splits {splits} do not match W={self.world_size} "
                f"and input numel {inp.numel()}"
            )
        if out.numel() != splits[self.rank]:
            raise ValueError(
                f"reduce_scatter_segments: out has {out.numel()} elements, chunk {self.rank} "
                f"has {splits[self.rank]}"
            )
        return splits

    def _check_gather(self, send: torch.Tensor, recv: torch.Tensor, recv_splits: Sequence[int]):
        if len(recv_splits) != self.world_size or recv_splits[self.rank] != 0:
            raise ValueError(
                f"all_gather_segments: recv_splits {list(recv_splits)} must have W="
                f"{self.world_size} entries and 0 for self (rank {self.rank})"
            )
        if sum(recv_splits) != recv.numel():
            raise ValueError(
                f"all_gather_segments: recv has {recv.numel()} elements, splits sum to "
                f"{sum(recv_splits)}"
            )
        es = send.element_size()
        self.counter.record(
            "all_gather_segments", send.numel() * (self.world_size - 1) * es, recv.numel() * es
        )


class AllToAllCollectives(_Base):
    """Gather via one all-to-all whose every destination reads the same send buffer.

    NCCL: a list ``all_to_all`` with the chunk itself as every peer's input (uneven sizes are
    fine, nothing is copied). gloo rejects uneven list all-to-alls and its ``all_to_all_single``
    would need the chunk replicated ``W - 1`` times in one contiguous input, so on gloo the same
    exchange is issued as one ``batch_isend_irecv`` fan-out (:class:`P2PCollectives`): the only
    temporary is the chunk, never a ``W``-fold copy.
    """

    def all_gather_segments(
        self, send: torch.Tensor, recv: torch.Tensor, recv_splits: Sequence[int], *, async_op: bool
    ) -> Handle:
        if not self._uneven_lists(send):
            return P2PCollectives.all_gather_segments(self, send, recv, recv_splits,  # type: ignore[arg-type]
                                                      async_op=async_op)
        self._check_gather(send, recv, recv_splits)
        W, r = self.world_size, self.rank
        if W == 1:
            return _one_rank_gather(self.group, send, async_op=async_op)
        outs = list(torch.split(recv, list(recv_splits)))
        ins = [send if d != r else send[:0] for d in range(W)]
        work = dist.all_to_all(outs, ins, group=self.group, async_op=async_op)
        return Handle([work] if async_op else [])


class P2PCollectives(_Base):
    """Gather via one ``batch_isend_irecv`` fan-out (sends the chunk itself to each peer)."""

    def all_gather_segments(
        self, send: torch.Tensor, recv: torch.Tensor, recv_splits: Sequence[int], *, async_op: bool
    ) -> Handle:
        self._check_gather(send, recv, recv_splits)
        W, r = self.world_size, self.rank
        if W == 1:
            return _one_rank_gather(self.group, send, async_op=async_op)
        ops = []
        offset = 0
        for s in range(W):
            n = recv_splits[s]
            if s != r and n:
                ops.append(dist.P2POp(dist.irecv, recv[offset:offset + n], group=self.group,
                                      group_peer=s))
            offset += n
        if send.numel():
            for d in range(W):
                if d != r:
                    ops.append(dist.P2POp(dist.isend, send, group=self.group, group_peer=d))
        if not ops:
            return Handle()
        works = dist.batch_isend_irecv(ops)
        h = Handle(works)
        if not async_op:
            h.wait()
        return h


def _overlaps(sizes: Sequence[int], chunk: int, W: int) -> list[list[tuple[int, int, int]]]:
    """For pieces of ``sizes`` laid end to end, ``out[r]`` lists ``(q, lo, hi)``: the part
    ``[lo, hi)`` of piece ``r`` (piece-local offsets) that falls in equal slice ``q`` of size
    ``chunk``."""
    out: list[list[tuple[int, int, int]]] = []
    off = 0
    for n in sizes:
        parts = []
        pos = off
        while pos < off + n:
            q = pos // chunk
            end = min(off + n, (q + 1) * chunk)
            parts.append((q, pos - off, end - off))
            pos = end
        out.append(parts)
        off += n
    return out


class TwoPhaseCollectives(_Base):
    """Owner scatter + ring all-gather; ring reduce-scatter + owner gather (see module docstring).

    Both phases are asynchronous: phase 1 is issued at once, phase 2 when the handle is waited
    for (every rank waits at the same program point), so a prefetch overlaps phase 1 too.

    [Note: two-phase layout]
    The block's chunks, in rank order, form a virtual flat buffer of ``N`` elements padded to
    ``W * c`` with ``c = ceil(N / W)``; rank ``q`` is responsible for slice ``[q*c, (q+1)*c)``.
    Gather: phase 1 sends every piece of a rank's chunk to the rank whose slice holds it, phase 2
    all-gathers the slices, and the caller's ``recv`` is the buffer minus this rank's own chunk.
    Reduction: phase 1 reduce-scatters the padded buffer by slices, phase 2 sends each part of a
    reduced slice to the rank whose chunk it belongs to. Phase 2 is issued from the handle's wait,
    which every rank reaches at the same point, so every rank issues the same collectives in the
    same order ([Note: ordering of collectives]).
    """

    def _sizes(self, own: int, others: Sequence[int]) -> list[int]:
        sizes = list(others)
        sizes[self.rank] = own
        return sizes

    def all_gather_segments(
        self, send: torch.Tensor, recv: torch.Tensor, recv_splits: Sequence[int], *, async_op: bool
    ) -> Handle:
        self._check_gather(send, recv, recv_splits)
        W, r = self.world_size, self.rank
        if _solo(W):
            return Handle()
        sizes = self._sizes(send.numel(), recv_splits)
        N = sum(sizes)
        if N == 0:
            return Handle()
        c = -(-N // W)
        parts = _overlaps(sizes, c, W)
        # phase 1: my pieces to the slice owners; I receive, from every rank, its part of my slice
        in_splits = [0] * W
        for q, lo, hi in parts[r]:
            in_splits[q] += hi - lo
        out_splits = [sum(hi - lo for q, lo, hi in parts[s] if q == r) for s in range(W)]
        my_slice = send.new_zeros(c)
        got = my_slice[: sum(out_splits)]
        work1 = dist.all_to_all_single(got, send, output_split_sizes=out_splits,
                                       input_split_sizes=in_splits, group=self.group, async_op=True)
        off = sum(sizes[:r])
        es = send.element_size()
        self.counter.record("two_phase_scatter", (send.numel() - in_splits[r]) * es, (sum(out_splits) - out_splits[r]) * es)
        self.counter.record("two_phase_all_gather", c * (W - 1) * es, c * (W - 1) * es)

        def phase2() -> None:
            # Issued when phase 1 is waited for: on every rank at the same program point (the
            # caller's wait), so the issue order stays identical ([Note: ordering of collectives]).
            work1.wait()
            full = send.new_empty(W * c)
            dist.all_gather_into_tensor(full, my_slice, group=self.group)
            # ``recv`` is the block's materialization buffer, which autograd may hold views of:
            # write it outside autograd, like the collectives of the other implementations do
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(recv):
                recv[:off].copy_(full[:off])
                recv[off:].copy_(full[off + sizes[r]:N])

        h = Handle(then=phase2)
        if not async_op:
            h.wait()
        return h

    def all_gather_inplace(self, buf: torch.Tensor, splits: Sequence[int], *, async_op: bool) -> Handle:
        """The in-place gather in two phases: :meth:`all_gather_segments` of this rank's interval
        into a staging buffer of the peers' intervals (its one temporary: the bucket less this
        rank's interval), unpacked into ``buf`` when the second phase completes."""
        splits = self._check_inplace(buf, splits)
        W, r = self.world_size, self.rank
        if _solo(W):
            return Handle()
        off = sum(splits[:r])
        recv_splits = [n if s != r else 0 for s, n in enumerate(splits)]
        staging = buf.new_empty(sum(recv_splits))
        inner = self.all_gather_segments(buf[off: off + splits[r]], staging, recv_splits, async_op=True)

        def unpack() -> None:
            inner.wait()
            with torch.no_grad():
                buf[:off].copy_(staging[:off])
                buf[off + splits[r]:].copy_(staging[off:])

        h = Handle(then=unpack)
        if not async_op:
            h.wait()
        return h

    def reduce_scatter_segments(
        self, out: torch.Tensor, inp: torch.Tensor, splits: Sequence[int], *, async_op: bool
    ) -> Handle:
        splits = self._check_reduce(out, inp, splits)
        W, r = self.world_size, self.rank
        if _solo(W):
            out.copy_(inp)
            return Handle()
        N = inp.numel()
        if N == 0:
            return Handle()
        c = -(-N // W)
        padded = inp.new_zeros(W * c)
        padded[:N] = inp
        mine = inp.new_empty(c)
        work1 = dist.reduce_scatter_tensor(mine, padded, op=dist.ReduceOp.SUM, group=self.group,
                                           async_op=True)
        # phase 2: the parts of my reduced slice go to the ranks whose chunks they belong to
        parts = _overlaps(splits, c, W)
        in_splits = [sum(hi - lo for q, lo, hi in parts[d] if q == r) for d in range(W)]
        out_splits = [0] * W
        for q, lo, hi in parts[r]:
            out_splits[q] += hi - lo
        es = inp.element_size()
        self.counter.record("two_phase_reduce_scatter", c * (W - 1) * es, c * (W - 1) * es)
        self.counter.record("two_phase_gather", (sum(in_splits) - in_splits[r]) * es, (out.numel() - out_splits[r]) * es)

        def phase2() -> None:  # issued at the caller's wait, like the gather's second phase
            work1.wait()
            dist.all_to_all_single(out, mine[: sum(in_splits)], output_split_sizes=out_splits,
                                   input_split_sizes=in_splits, group=self.group)
            del padded_ref[:]

        padded_ref = [padded]  # the input stays alive until phase 1 is done
        h = Handle(then=phase2)
        if not async_op:
            h.wait()
        return h


_IMPLS = {"all_to_all": AllToAllCollectives, "p2p": P2PCollectives, "two_phase": TwoPhaseCollectives}
#: the implementations ``collectives=`` selects (both front-ends)
KINDS = tuple(_IMPLS)
# Process groups are not weak-referenceable; they live as long as the process group does anyway.
_CACHE: dict[Any, dict[str, SegmentCollectives]] = {}


def collectives_for(group: Any, kind: str | None = None) -> SegmentCollectives:
    """The (cached, one per group and kind) :class:`SegmentCollectives` for ``group``.

    ``kind`` is ``"all_to_all"`` (default for every backend: gloo and NCCL both support uneven
    ``all_to_all_single`` and list ``reduce_scatter``), ``"p2p"`` or ``"two_phase"`` (bounded
    bandwidth at large W, see :class:`TwoPhaseCollectives`).

    Example::

        coll = collectives_for(mesh.get_group())
        coll.all_gather_segments(send, recv, splits, async_op=True).wait()
    """
    kind = kind or "all_to_all"
    if kind not in _IMPLS:
        raise ValueError(f"collectives_for: kind must be one of {sorted(_IMPLS)}, got {kind!r}")
    per_group = _CACHE.setdefault(group, {})
    if kind not in per_group:
        per_group[kind] = _IMPLS[kind](group)
    return per_group[kind]
