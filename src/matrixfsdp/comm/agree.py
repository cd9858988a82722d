"""Every rank agrees or every rank raises: one exchange of short strings over a process group.

A check that fails on one rank only (a file missing on one host, a plan built with other
arguments, a parameter on another device) must fail on every rank, or the others enter the next
collective and hang. :func:`agree` gathers each rank's error (if any) and fingerprint (if any),
raises the lowest-rank error on every rank, and returns the fingerprints for the caller to
compare. It is the one place the package does this: ``fully_shard``'s plan digest,
``replicate``'s bucket layout and every checkpoint entry point call it.

[Note: collectives right before exit]
The agreement is often the last collective of a program: a script catches the
``FileNotFoundError`` of a missing checkpoint (or finishes after a save) and exits. Gloo runs a
collective on a worker thread, which signals completion and only then drops its references to
the collective's tensors. Dropping a reference to a tensor that has a Python object takes the
GIL (``TensorImpl::decref_pyobject``). If the main thread has meanwhile reached interpreter
finalization, taking the GIL ends the worker thread with a forced unwind through a ``noexcept``
destructor (``~AsyncAllgatherWork``): ``terminate called without an active exception``, SIGABRT
(seen in about 1 of 6 runs at W=2; a core dump shows exactly that stack). ``all_gather_object``
allocates its tensors internally, so the agreement uses ``all_gather`` on tensors of its own
and returns only once the backend holds no reference to them (their use count is back to 1).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ..mesh import backend_devices

__all__ = ["agree", "all_gather_strings", "agreement_device", "encode_error", "is_distributed"]

#: exception types an error may be re-raised as on the other ranks (anything else: RuntimeError)
_EXC: dict[str, type[Exception]] = {
    "FileNotFoundError": FileNotFoundError, "ValueError": ValueError, "TypeError": TypeError,
    "RuntimeError": RuntimeError,
}


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def encode_error(e: BaseException | None) -> str | None:
    """``"ExcName|message"`` (the form :func:`agree` exchanges), or None."""
    if e is None:
        return None
    # the nearest exception type every rank can re-raise (a ValueError subclass stays a ValueError)
    name = next((c.__name__ for c in type(e).__mro__ if c.__name__ in _EXC and _EXC[c.__name__] is c),
                "RuntimeError")
    return f"{name}|{e}"


def agreement_device(group: Any = None) -> torch.device:
    """A device the group's backend can communicate on, for the agreement's small tensors: the CPU
    when the group has a CPU backend (gloo, or ``"cpu:gloo,cuda:nccl"``), else the current
    accelerator (an NCCL-only group)."""
    devices = backend_devices(group)
    if "cpu" in devices or not devices:
        return torch.device("cpu")
    acc = torch.accelerator.current_accelerator()
    if acc is None:
        return torch.device("cpu")
    return torch.device(acc.type, torch.accelerator.current_device_index())


def _wait_released(tensors: list[torch.Tensor], timeout_s: float = 10.0) -> None:
    """Wait until no other owner (a backend's worker thread) references ``tensors``."""
    deadline = time.monotonic() + timeout_s
    while any(t._use_count() > 1 for t in tensors) and time.monotonic() < deadline:
        time.sleep(1e-4)


def all_gather_strings(msg: str | None, group: Any = None, device: torch.device | None = None) -> list[str | None]:
    """``all_gather_object`` for short strings (or None), safe right before exit (see the Note)."""
    if device is None:
        device = agreement_device(group)
    world = dist.get_world_size(group)
    data = b"" if msg is None else b"\x01" + msg.encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    # receive buffers start as this rank's own entry: a collective that moves no data (torch's
    # fake process group, see [Note: dry runs]) then shows every peer agreeing with this rank,
    # and this rank's own error still raises
    # (the receive tensors are views of one buffer, decoded at once: the same collectives as
    # one tensor per rank, without W tensor copies and reads at thousands of ranks)
    all_sizes = size.repeat(world)
    sizes = list(all_sizes.split(1))
    dist.all_gather(sizes, size, group=group)
    lengths = all_sizes.cpu().tolist()
    n = max(1, max(lengths))
    buf = torch.zeros(n, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    everything = buf.repeat(world)
    outs = list(everything.split(n))
    dist.all_gather(outs, buf, group=group)
    blob = everything.cpu().numpy().tobytes()
    rows = [None if k == 0 else blob[i * n + 1: i * n + k].decode() for i, k in enumerate(lengths)]
    _wait_released([size, *sizes, buf, *outs])
    return rows


def agree(error: str | None = None, fingerprint: str | None = None, *, group: Any = None,
          device: torch.device | None = None) -> list[str | None]:
    """Exchange ``error`` (``"ExcName|message"``, see :func:`encode_error`) and ``fingerprint``
    among the ranks of ``group``; raise the lowest-rank error on every rank (other ranks add
    "(reported by rank r)"); else return every rank's fingerprint, in rank order.

    Without an initialized process group this is the local check alone. A collective: every
    rank of ``group`` calls it at the same program point.
    """
    if not is_distributed():
        rows: list[tuple[str | None, str | None]] = [(error, fingerprint)]
        rank = 0
    else:
        rank = dist.get_rank(group)
        mine = ("E" + error if error is not None else "-") + "\x00" + (fingerprint or "")
        rows = []
        for row in all_gather_strings(mine, group, device):
            e, _, f = (row or "").partition("\x00")
            rows.append((e[1:] if e.startswith("E") else None, f or None))
    for r, (e, _) in enumerate(rows):
        if e is not None:
            name, _, msg = e.partition("|")
            if r != rank:
                msg = f"{msg} (reported by rank {r})"
            raise _EXC.get(name, RuntimeError)(msg)
    return [f for _, f in rows]
