"""Peak tensor memory of a region of code on the CPU, from the allocator's own events.

[Note: peak memory from allocator events]
torch's profiler, with ``profile_memory=True``, records every allocation and free the CPU
allocator makes (``[memory]`` events of signed byte counts): tensors created by operators, the
buffers collectives receive into, and storages resized in place (``fully_shard`` frees a layer's
unsharded parameters with ``untyped_storage().resize_(0)`` and refills them the same way), each
counted once, when the allocator acts. The peak is the bytes live at entry plus the
highest running sum of those events. Operator events are switched off while it records
(``torch.autograd._enable_record_function(False)``, restored on exit): only the allocator's
events are kept, so the cost grows with allocations, not operators (a dry-run step at W=4096
issues millions of point-to-point operators, whose events outgrew 24 GB of memory). torch's
``MemTracker`` (per-module attribution, Python per operator over every module) took 30x the run's
own time on a Qwen3-0.6B layer stack at W=256 (150 s against 5 s).

Bytes live at entry are the caller's to name (``baseline``): the profiler cannot see
allocations made before it started, nor their frees (the allocator learns a block's size only
while it records), so the baseline names what stays live through the block: a model's
parameters, buffers and optimizer state in a dry run.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from typing import Any, Iterable, Iterator

import torch

__all__ = ["PeakMemory", "storage_bytes"]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local tensor);
    ``None`` entries count nothing."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        local = getattr(t, "_local_tensor", t)
        st = local.untyped_storage()
        seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def _without_profiler_lines() -> Iterator[None]:
    """Drop the lines torch's profiler (kineto) prints to file descriptor 2 on start and stop
    (``STAGE:... Completed Stage``, ``USDT:... profiler_start``): nothing a user can act on, and no
    setting turns them off. Anything else written meanwhile is passed on."""
    import sys

    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stderr: nothing reaches the terminal
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True)
                    if not _PROFILER_LINE.match(line)]
            if kept:
                os.write(fd, b"".join(kept))


_PROFILER_LINE = re.compile(rb"^(STAGE|USDT):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] ")


class PeakMemory:
    """``with PeakMemory(baseline) as pm: ...``; then ``pm.peak_bytes`` is the most bytes the CPU
    allocator held at once inside the block, counting ``baseline`` bytes live at entry (see
    [Note: peak memory from allocator events]). Re-entering starts a new measurement; the peak
    kept is the highest over all of them (the baseline is re-read each time)."""

    def __init__(self, baseline: Any = 0):
        # an int, or a callable returning the bytes live now (re-read on each entry)
        self._baseline = baseline
        self._prof: Any = None
        self.peak_bytes = 0

    def __enter__(self) -> "PeakMemory":
        from torch.profiler import ProfilerActivity, profile

        self._start = int(self._baseline() if callable(self._baseline) else self._baseline)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _without_profiler_lines():
            self._prof.__enter__()
        torch.autograd._enable_record_function(False)  # allocator events only (see the Note)
        return self

    def __exit__(self, *exc: Any) -> None:
        prof, self._prof = self._prof, None
        torch.autograd._enable_record_function(True)
        with _without_profiler_lines():
            prof.__exit__(*exc)
        # stable by time: events of one nanosecond keep the allocator's order
        events = sorted(((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                         if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                        key=lambda ev: ev[0])
        live = peak = self._start
        for _, n in events:
            live += n
            peak = max(peak, live)
        self.peak_bytes = max(self.peak_bytes, peak)
