"""Every device wait of the runtime goes through ``event.wait(stream)`` with the device module's
types (issue 40, [Note: event waits] in ``comm/collectives.py``).

On CUDA, ``torch.Stream.wait_event(torch.cuda.Event)`` blocks on the event's base ``c10::Event``,
which a ``torch.cuda.Event`` never initializes: the wait is silently skipped (torch's
``THPStream_wait_event``). The CPU cannot run that, so the tests model it: a fake ``cuda`` device
module whose events log their waits, and a generic ``torch.accelerator.current_stream()`` whose
``wait_event`` skips, as torch's does for such an event. A static scan keeps the generic calls out
of the whole package."""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import matrixfsdp
from matrixfsdp.comm.collectives import Handle
from matrixfsdp.engine.reducer import PendingReduce
from matrixfsdp.engine.streams import CommContext

CUDA0 = torch.device("cuda", 0)


class _Event:
    """A device-module event (``torch.cuda.Event``): its own ``wait`` orders work."""

    def __init__(self, log):
        self.log, self.device, self.stream = log, None, None

    def record(self, stream):
        self.device, self.stream = CUDA0, stream

    def wait(self, stream):
        self.log.append(("wait", self, stream))


class _Stream:
    """A device-module stream (``torch.cuda.Stream``): ``wait_event`` is ``event.wait(self)``."""

    def __init__(self, log, name="side", **_):
        self.log, self.name = log, name

    def record_event(self, event=None):
        event = event or _Event(self.log)
        event.record(self)
        return event

    def wait_event(self, event):
        event.wait(self)

    def wait_stream(self, other):
        self.wait_event(other.record_event())


class _GenericStream:
    """``torch.accelerator.current_stream()``: given a device-module event, its ``wait_event``
    does nothing (the base ``c10::Event`` it blocks on was never recorded)."""

    def __init__(self, log):
        self.log = log

    def wait_event(self, event):
        self.log.append(("skipped", event, self))

    def record_event(self, event=None):
        raise AssertionError("an event recorded through the generic torch.Stream")


@pytest.fixture
def fake_cuda(monkeypatch):
    log: list = []
    compute = _Stream(log, "compute")
    mod = SimpleNamespace(Stream=lambda device=None, priority=0: _Stream(log, "side"),
                          current_stream=lambda device=None: compute,
                          stream=lambda s: contextlib.nullcontext())
    real = torch.get_device_module
    monkeypatch.setattr(torch, "get_device_module",
                        lambda d=None: mod if torch.device(d).type == "cuda" else real(d))
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: _GenericStream(log))
    return SimpleNamespace(log=log, compute=compute, mod=mod)


def test_handle_wait_orders_the_compute_stream(fake_cuda):
    side = fake_cuda.mod.Stream(device=CUDA0)
    ev = side.record_event()
    h = Handle(event=ev)
    h.wait()
    assert fake_cuda.log == [("wait", ev, fake_cuda.compute)]
    assert h.done


def test_release_input_waits_for_the_reduce_scatter(fake_cuda):
    ev = fake_cuda.mod.Stream(device=CUDA0).record_event()
    p = PendingReduce(reducer=None, handle=Handle(), out=torch.zeros(1), inp=torch.zeros(4),
                      post=1.0, used=(), rs_event=ev)
    p.release_input()
    assert fake_cuda.log == [("wait", ev, fake_cuda.compute)]
    assert p.inp is None


def test_side_stream_waits_for_the_compute_stream(fake_cuda):
    comm = CommContext(CUDA0)
    with comm.use(comm.gather):
        pass
    ((kind, ev, stream),) = fake_cuda.log
    assert (kind, stream, ev.stream) == ("wait", comm.gather, fake_cuda.compute)


# ------------------------------------------------------------------------------ static scan
def _generic_uses(tree: ast.AST) -> list[tuple[int, str]]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "wait_event":
            bad.append((node.lineno, "<stream>.wait_event(...): use event.wait(stream)"))
        if (isinstance(node, ast.Attribute) and node.attr in ("current_stream", "Stream", "Event")
                and isinstance(node.value, ast.Attribute) and node.value.attr == "accelerator"):
            bad.append((node.lineno, f"torch.accelerator.{node.attr}: use the device module's"))
        if (isinstance(node, ast.Attribute) and node.attr in ("Stream", "Event")
                and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            bad.append((node.lineno, f"torch.{node.attr}: use the device module's"))
    return bad


def test_scan_flags_the_generic_mix():
    old = ("torch.accelerator.current_stream().wait_event(event)\n"
           "torch.accelerator.current_stream(x.device).wait_event(e)\n"
           "s = torch.Stream(device='cuda')\n")
    assert sorted(n for n, _ in _generic_uses(ast.parse(old))) == [1, 1, 2, 2, 3]


def test_no_generic_stream_or_event_in_the_package():
    root = Path(matrixfsdp.__file__).parent
    found = [f"{path.relative_to(root)}:{line}: {why}"
             for path in sorted(root.rglob("*.py"))
             for line, why in _generic_uses(ast.parse(path.read_text(), str(path)))]
    assert not found, "\n".join(found)
