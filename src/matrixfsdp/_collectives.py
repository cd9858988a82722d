"""The two collectives the runtime needs, behind one small interface, with byte counting.

The runtime (``_block.py``) never calls ``torch.distributed`` directly: it calls a
:class:`SegmentCollectives` obtained from :func:`collectives_for` for its process group.

* ``all_gather_segments``: every rank contributes its chunk (its concatenated local row segments,
  uneven across ranks, possibly empty) and receives every peer's chunk. Only non-empty pieces
  move; nothing is padded.
* ``reduce_scatter_segments``: every rank contributes ``W`` uneven chunks (one per destination);
  rank ``r`` receives the elementwise sum of everyone's chunk ``r``.

Implementations:

* :class:`AllToAllCollectives` (default; gloo and NCCL): one uneven ``all_to_all_single`` for the
  gather (the chunk is replicated once per peer in the input, a transient buffer about the size of
  the block) and one ``reduce_scatter(out, list)`` with uneven sizes for the reduction. On gloo,
  ``all_gather(list)`` with uneven sizes does not work, while these two do (including 0 sizes).
* :class:`P2PCollectives`: the gather as one ``batch_isend_irecv`` fan-out (no replicated input
  buffer); same reduction.

Each instance owns a :class:`CommCounter`; tests and benchmarks read and reset it.

[Note: ordering of collectives]
gloo (like NCCL) matches collectives by issue order within a process group, so every rank must
issue the same collectives in the same order. The runtime guarantees it by construction: all
collectives are issued from forward pre-hooks (program order), backward pre-hooks and the
materialization ``autograd.Function``'s backward, which are ordered by autograd's data
dependencies, not by timing (see [Note: backward ordering] in ``_block.py``). Nothing here issues
a collective on its own initiative.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

__all__ = [
    "CommCounter",
    "Handle",
    "SegmentCollectives",
    "AllToAllCollectives",
    "P2PCollectives",
    "collectives_for",
]


@dataclass
class CommCounter:
    """Calls and bytes per operation kind (bytes are logical payload, as seen by this rank).

    Example::

        c = comm_counter(model)        # from matrixfsdp._runtime
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


class Handle:
    """A waitable for one issued collective (wraps zero or more ``dist.Work``)."""

    __slots__ = ("_works",)

    def __init__(self, works: Sequence[Any] = ()):
        self._works = [w for w in works if w is not None]

    def wait(self) -> None:
        works, self._works = self._works, []
        for w in works:
            w.wait()

    @property
    def done(self) -> bool:
        return not self._works


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

    def all_gather_fixed(self, t: torch.Tensor) -> torch.Tensor:
        """All-gather a small tensor of identical shape on every rank -> ``[W, *t.shape]``."""
        ...

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """Broadcast ``t`` from group rank ``src`` in place."""
        ...


class _Base:
    def __init__(self, group: Any):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.counter = CommCounter()

    def reduce_scatter_segments(
        self, out: torch.Tensor, inp: torch.Tensor, splits: Sequence[int], *, async_op: bool
    ) -> Handle:
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
        es = inp.element_size()
        self.counter.record(
            "reduce_scatter",
            (inp.numel() - splits[self.rank]) * es,
            (self.world_size - 1) * splits[self.rank] * es,
        )
        if self.world_size == 1:
            out.copy_(inp)
            return Handle()
        chunks = list(torch.split(inp, splits))
        work = dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=self.group,
                                   async_op=async_op)
        return Handle([work] if async_op else [])

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
        dist.broadcast(t, group_src=src, group=self.group)

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
    """Gather via one uneven ``all_to_all_single`` (chunk replicated once per peer)."""

    def all_gather_segments(
        self, send: torch.Tensor, recv: torch.Tensor, recv_splits: Sequence[int], *, async_op: bool
    ) -> Handle:
        self._check_gather(send, recv, recv_splits)
        W, r = self.world_size, self.rank
        if W == 1:
            return Handle()
        n = send.numel()
        inp = send.reshape(1, n).expand(W - 1, n).contiguous().reshape(-1)
        in_splits = [n if d != r else 0 for d in range(W)]
        work = dist.all_to_all_single(
            recv, inp, output_split_sizes=list(recv_splits), input_split_sizes=in_splits,
            group=self.group, async_op=async_op,
        )
        return Handle([work] if async_op else [])


class P2PCollectives(_Base):
    """Gather via one ``batch_isend_irecv`` fan-out (sends the chunk itself to each peer)."""

    def all_gather_segments(
        self, send: torch.Tensor, recv: torch.Tensor, recv_splits: Sequence[int], *, async_op: bool
    ) -> Handle:
        self._check_gather(send, recv, recv_splits)
        W, r = self.world_size, self.rank
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


_IMPLS = {"all_to_all": AllToAllCollectives, "p2p": P2PCollectives}
# Process groups are not weak-referenceable; they live as long as the process group does anyway.
_CACHE: dict[Any, dict[str, SegmentCollectives]] = {}


def collectives_for(group: Any, kind: str | None = None) -> SegmentCollectives:
    """The (cached, one per group and kind) :class:`SegmentCollectives` for ``group``.

    ``kind`` is ``"all_to_all"`` (default for every backend: gloo and NCCL both support uneven
    ``all_to_all_single`` and list ``reduce_scatter``) or ``"p2p"``.

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
