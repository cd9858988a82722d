"""Deferred parameter gathers: after ``step()`` only some ranks hold the new values; the others
receive them at the next forward, overlapped with it.

Both front-ends run this mechanism: ``replicate`` (ZeRO-1/2: owners update, every rank holds the
bucket) and ``fully_shard`` on an HSDP mesh with ``split`` (the step replica updates, the owners
of the other replicas hold copies).

[Note: deferred gathers]
An :class:`Exchange` is a list of :class:`GatherUnit` (a bucket, a block), each of which knows how
to issue its gather and how to *stamp* the tensors its source ranks may write (the parameters'
version counters, which torch bumps at every in-place write: an optimizer's step, a hand-written
``p.add_``, ``load_state_dict``). No optimizer hook is involved, global or not.

The exchange is *stale* from the end of a reducing backward (a step may follow; a redundant
gather is harmless, a missing one is not) until it is issued. It is issued at the root's
pre-forward, one program point on every rank, every unit in a fixed order, with no further
check: the training step keeps its collective count and has no host sync. Each unit is waited
for where its parameters are first read (a module's pre-forward, a block's unshard); a unit
waited for while the exchange is stale (a forward that did not start at the root) issues
everything first. When a gather completes, its unit records the stamp.

Everything that reads parameters between ``step()`` and the next forward (``state_dict()``, DCP,
``full_tensor()``, ``sync_params()``) calls :meth:`Exchange.settle`. A settle of a stale exchange
first *agrees* whether any rank's stamps moved since its last gather: one 4-byte all-reduce over
the units' group (counted with the group's collectives) read on the host. If one moved (the step
ran), it issues and waits for every unit and the exchange is no longer stale. If none moved (a
``state_dict()`` between backward and ``step()``), every rank already holds the current values:
nothing is gathered and the exchange stays stale, so the step that may follow still reaches
every rank at the next settle or forward (each settle agrees again meanwhile: ``fully_shard``'s
state-dict hook on every block makes that one all-reduce per block in such a ``state_dict()``).
With ``refresh_after_settle`` (``fully_shard``'s HSDP exchange) any settle also leaves the next
forward due to gather once more, so a write after it that no backward precedes (a hand-written
update) still reaches every replica, at the cost of one gather per settle; ``replicate`` keeps
DDP's collective count per step instead (its Trainer parity pins it).

The invariant: every rank of a unit's group takes the same branch at every decision. ``stale``
and ``due`` change only at program points every rank passes alike (a reducing backward's final
callback, the root's pre-forward, a settle), and the one input that differs across ranks (only
owners step, so only their stamps move) enters a decision only through the all-reduce, so the
collectives stay matched ([Note: ordering of collectives]). What no rule here sees is a write
made on some ranks only after the forward's gathers with no backward before the next forward
(e.g. a second ``step()`` on the same gradients): make such writes on every rank alike, or run a
backward first. A rank-0-only settle (DDP's rank-0 save) is collective-free once a settle on
every rank after ``step()`` has gathered (``sync_params()``), or a forward has.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..comm.collectives import Handle, SegmentCollectives

__all__ = ["Exchange", "GatherUnit", "version_stamp", "any_rank"]


def version_stamp(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """Identity and version counter of each tensor (and of a DTensor's local tensor: writes to it
    directly, as ``matrixfsdp.optim`` makes them, bump only its own counter)."""
    out: list[int] = []
    for t in tensors:
        out += (id(t), t._version)
        local = getattr(t, "_local_tensor", None)
        if local is not None:
            out += (id(local), local._version)
    return tuple(out)


def any_rank(coll: SegmentCollectives, device: torch.device) -> Callable[[bool], bool]:
    """Whether ``flag`` holds on any rank of ``coll``'s group: a counted 4-byte all-reduce and one
    host read (a collective: every rank of the group calls it)."""

    def agree(flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        coll.all_reduce(t, async_op=False).wait()
        return bool(t.item())

    return agree


class GatherUnit:
    """One deferred gather: ``start()`` issues it and returns its :class:`Handle`; ``stamp()``
    stamps the tensors its source ranks may write (see [Note: deferred gathers]). A handle is
    never dropped: issuing again waits for the one in flight first."""

    __slots__ = ("_start", "_stamp", "_handle", "baseline")

    def __init__(self, start: Callable[[], Handle], stamp: Callable[[], tuple[int, ...]] = tuple):
        self._start = start
        self._stamp = stamp
        self._handle: Handle | None = None
        #: the stamp when the last gather completed (or at construction)
        self.baseline = stamp()

    def issue(self) -> None:
        if self._handle is not None:
            # the last gather was never waited for (a forward that skipped or aborted before the
            # unit's first read): complete it before the next one writes the same buffers; a
            # dropped handle would leave its work (and on a device, its event) unwaited
            self.wait()
        self._handle = self._start()

    def wait(self) -> None:
        h, self._handle = self._handle, None
        if h is not None:
            h.wait()
            self.baseline = self._stamp()

    def moved(self) -> bool:
        """Whether this rank wrote the unit's tensors since its last gather."""
        return self._stamp() != self.baseline

    def mark_current(self) -> None:
        self.baseline = self._stamp()

    @property
    def in_flight(self) -> bool:
        return self._handle is not None


class Exchange:
    """The deferred gathers of one model (see [Note: deferred gathers]). ``agree(flag)`` answers
    whether ``flag`` holds on any rank of the units' group (:func:`any_rank`)."""

    def __init__(self, units: Iterable[GatherUnit] = (), *, agree: Callable[[bool], bool],
                 refresh_after_settle: bool = False):
        self.units = list(units)
        self.agree = agree
        self.refresh_after_settle = refresh_after_settle
        self.stale = False
        #: a settle happened since the last forward's gathers (``refresh_after_settle`` only)
        self.due = False

    def mark_stale(self) -> None:
        self.stale = True

    def mark_current(self) -> None:
        """Every rank holds the current values (fresh storage, initialized alike everywhere)."""
        self.stale = self.due = False
        for u in self.units:
            u.mark_current()

    def issue(self, *, forward: bool = True) -> bool:
        """Issue every unit's gather if the exchange is stale (or, at a forward, due); returns
        whether it did."""
        if not (self.stale or (forward and self.due)):
            return False
        self.stale = False
        if forward:
            self.due = False
        for u in self.units:
            u.issue()
        return True

    def wait(self, unit: GatherUnit) -> None:
        """Before ``unit``'s values are read: issue everything if still stale, then wait for it."""
        if self.stale:
            self.issue()
        unit.wait()

    def settle(self) -> None:
        """Bring every value up to date now (a collective when stale or in flight)."""
        # stale is the same on every rank of the group: all of them agree here, or none does
        if self.stale and self.units and not self.agree(any(u.moved() for u in self.units)):
            pass  # nobody wrote since the last gather: current everywhere, still stale for the step
        else:
            self.issue(forward=False)
        for u in self.units:
            u.wait()
        if self.refresh_after_settle:
            self.due = True
