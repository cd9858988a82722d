"""An exchange never drops a gather's handle (issue 29, item 1d): a unit issued again before its
values were read (a forward that skipped or aborted before the unit's block) completes the
gather in flight before the next one starts, in issue order, and takes its stamp."""

from __future__ import annotations

import torch

from matrixfsdp.comm.collectives import Handle
from matrixfsdp.engine.exchange import Exchange, GatherUnit, version_stamp


class _Work:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(("wait", self.name))


def _unit(log, name, t):
    n = [0]

    def start():
        n[0] += 1
        log.append(("start", f"{name}{n[0]}"))
        return Handle([_Work(log, f"{name}{n[0]}")])

    return GatherUnit(start, lambda: version_stamp([t]))


def test_issuing_a_unit_again_waits_for_the_gather_in_flight_first():
    log: list = []
    t = torch.zeros(3)
    unit = _unit(log, "u", t)
    ex = Exchange([unit], agree=lambda flag: flag)
    ex.mark_stale()
    assert ex.issue() and unit.in_flight
    t.add_(1)  # an owner's step: the stamp moves while the first gather is still unread
    ex.mark_stale()  # the next reducing backward
    assert ex.issue()
    # before: ("start", "u2") directly, u1's work dropped without a wait
    assert log == [("start", "u1"), ("wait", "u1"), ("start", "u2")], log
    assert unit.in_flight
    ex.wait(unit)
    assert log[-1] == ("wait", "u2") and not unit.in_flight
    unit.issue()  # nothing in flight: no extra wait
    assert log[-2:] == [("wait", "u2"), ("start", "u3")], log
