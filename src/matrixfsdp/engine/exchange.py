"""Deferred parameter gathers: after ``step()`` only some ranks hold the new values; the others
receive them at the next forward, overlapped with it.

Both front-ends run this mechanism: ``replicate`` (ZeRO-1/2: owners update, every rank holds the
bucket) and ``fully_shard`` on an HSDP mesh with ``split`` (the step replica updates, the owners
of the other replicas hold copies).

[Note: deferred gathers]
An :class:`Exchange` is a list of :class:`GatherUnit` (a bucket, a block), each of which knows how
to issue its gather. It is *stale* from any event that may have changed the source values (a
reducing backward that finished, whether or not the user then steps: a redundant gather is
harmless, a missing one is not; the ``step()`` of any ``torch.optim.Optimizer`` holding one of its
parameters, see :func:`watch_optimizer_steps`) until it is issued. It is issued at the root's
pre-forward, one program point on every rank, every unit in a fixed order; each unit is waited
for where its parameters are first read (a module's pre-forward, a block's unshard). A unit
waited for while the exchange is stale (a forward that did not start at the root) issues
everything first. Everything that reads parameters between ``step()`` and the next forward
(``state_dict()``, DCP, ``full_tensor()``, ``sync_params()``) calls :meth:`Exchange.settle`: the
same gathers, waited for at once. With ``refresh_after_settle`` (``fully_shard``'s HSDP
exchange) a settle leaves the next forward due to gather once more: a write after it that no
optimizer step announces (a hand-written update) still reaches every replica, at the cost of one
gather per settle that a step did not follow (one per checkpoint taken after ``step()``).
``replicate`` keeps DDP's collective count per step instead (its Trainer parity pins it). Every rank that shares a unit's group decides stale-ness from
the same events, so the collectives stay matched ([Note: ordering of collectives]).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch

from ..comm.collectives import Handle

__all__ = ["Exchange", "GatherUnit", "watch_optimizer_steps"]


class GatherUnit:
    """One deferred gather: ``start()`` issues it and returns its :class:`Handle`."""

    __slots__ = ("_start", "_handle")

    def __init__(self, start: Callable[[], Handle]):
        self._start = start
        self._handle: Handle | None = None

    def issue(self) -> None:
        self._handle = self._start()

    def wait(self) -> None:
        h, self._handle = self._handle, None
        if h is not None:
            h.wait()

    @property
    def in_flight(self) -> bool:
        return self._handle is not None


class Exchange:
    """The deferred gathers of one model (see [Note: deferred gathers])."""

    def __init__(self, units: Iterable[GatherUnit] = (), params: Iterable[torch.Tensor] = (), *,
                 refresh_after_settle: bool = False):
        self.units = list(units)
        self.refresh_after_settle = refresh_after_settle
        #: ids of the parameters whose optimizer step makes the exchange stale
        self.param_ids = {id(p) for p in params}
        self.stale = False
        #: a settle happened since the last forward's gathers (see the Note)
        self.due = False

    def mark_stale(self) -> None:
        self.stale = True

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
        self.issue(forward=False)
        for u in self.units:
            u.wait()
        self.due = self.refresh_after_settle


_WATCHED: "weakref.WeakSet[Exchange]" = weakref.WeakSet()
_STEP_HOOK: Any = None


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for ex in list(_WATCHED):
        if not ex.stale and any(id(p) in ex.param_ids for g in optimizer.param_groups for p in g["params"]):
            ex.mark_stale()


def watch_optimizer_steps(exchange: Exchange) -> None:
    """Mark ``exchange`` stale after the ``step()`` of any optimizer holding one of its parameters
    (one step post-hook for all exchanges, registered with torch once)."""
    global _STEP_HOOK
    _WATCHED.add(exchange)
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK = register_optimizer_step_post_hook(_after_optimizer_step)
