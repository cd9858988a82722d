"""Part 0 of ``benchmarks/gpu/check.py``, ``preflight``: runs first and fails fast (the driver then
skips every other part). It records the versions (Python, torch, CUDA, cuDNN, NCCL, triton,
transformers and torchtitan where present, the GPU), that ``matrixfsdp`` is imported from this
tree's ``src`` (no install needed), the start-up costs the time limits are derived from (process
start, ``import torch``, ``import matrixfsdp``, CUDA init, the W=1 process group's first
collective), and the event-wait probe.

The event-wait probe shows that a cross-stream wait orders work, in the form FSDP2 uses: the
device module's streams and events (``torch.get_device_module("cuda").Stream/Event``), the
consumer stream made to wait with ``event.wait(stream)``. A producer stream sleeps
(``torch.cuda._sleep``) and then fills a buffer; the consumer copies the buffer after its wait.
With the wait the copy must read the fill. The control, the same without the wait, must read the
stale buffer (the consumer ran ahead): only then does the probe prove the order (a sleep too short
to be overtaken would pass either way). The generic mix issue 40 asks about,
``torch.accelerator.current_stream().wait_event(cuda_event)`` (a ``torch.Stream`` waiting on a
``torch.cuda.Event``), is run the same way and reported, not required. On the CPU there are no
streams: the probe is reported as skipped (dry run)."""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .core import Ctx, w1_group

#: filled by check.py before the preflight runs: wall-clock stamps of this process's start-up
STARTUP: dict[str, float] = {}
#: the producer's sleep in GPU cycles (about 0.1 s at 1.7-2 GHz): far longer than the consumer's
#: 4 MiB copy takes to launch and run, so a consumer that does not wait always reads stale data
PROBE_SLEEP_CYCLES = 200_000_000
PROBE_TRIALS = 3


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def event_wait_probe(dev: torch.device, cycles: int = PROBE_SLEEP_CYCLES, trials: int = PROBE_TRIALS) -> dict:
    """Per wait form, the fraction of trials whose consumer read the producer's fill (see the
    module docstring). ``device``: ``event.wait(stream)`` with the device module's types (must be
    1.0); ``none``: no wait (the control: must be below 1.0); ``generic``: a ``torch.Stream``
    from ``torch.accelerator`` waiting on the device module's event (reported)."""
    mod = torch.get_device_module(dev.type)
    producer, consumer = mod.Stream(device=dev), mod.Stream(device=dev)
    buf = torch.zeros(1 << 20, device=dev)
    out = torch.empty_like(buf)
    seen: dict[str, Any] = {}
    for how in ("device", "none", "generic"):
        good = 0
        try:
            good = _trials(how, trials, cycles, dev, mod, producer, consumer, buf, out)
        except Exception as e:  # the generic mix may refuse the device module's event: reported
            if how != "generic":
                raise
            seen["generic_error"] = f"{type(e).__name__}: {e}"[:300]
        seen[how] = good / trials
    return seen


def _trials(how: str, trials: int, cycles: int, dev, mod, producer, consumer, buf, out) -> int:
    """How many of ``trials`` consumers read the producer's fill, waiting as ``how`` says."""
    good = 0
    for _ in range(trials):
        buf.zero_()
        out.fill_(-1.0)
        mod.synchronize(dev)
        with mod.stream(producer):
            torch.cuda._sleep(cycles)
            buf.fill_(1.0)
        event = mod.Event()
        event.record(producer)
        with mod.stream(consumer):
            if how == "device":
                event.wait(consumer)  # FSDP2's form: the device module's stream and event
            elif how == "generic":
                torch.accelerator.current_stream(dev).wait_event(event)
            out.copy_(buf)
        mod.synchronize(dev)
        good += bool((out == 1.0).all())
    return good


def part_preflight(ctx: Ctx) -> dict:
    dev = ctx.dev
    t: dict[str, Any] = {k: round(v, 2) for k, v in STARTUP.items()}
    problems: list[str] = []
    t0 = time.perf_counter()
    import matrixfsdp  # the first import in this process (the parts import it lazily)

    t["import_matrixfsdp_s"] = round(time.perf_counter() - t0, 2)
    src = Path(__file__).resolve().parents[3] / "src"
    mine = Path(matrixfsdp.__file__).resolve()
    from_tree = src in mine.parents
    if not from_tree:
        problems.append(f"matrixfsdp imported from {mine}, not from this tree's {src}: run "
                        f"PYTHONPATH=src python3 benchmarks/gpu/check.py from the repository root")
    versions: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "torch_git": torch.version.git_version,
        "cuda": torch.version.cuda, "transformers": _dist_version("transformers"), "triton": _dist_version("triton"),
        "torchtitan": _dist_version("torchtitan"), "matrixfsdp": str(mine.parent), "platform": platform.platform(),
        "executable": sys.executable,
    }
    gpu: dict[str, Any] = {}
    if ctx.cuda:
        t0 = time.perf_counter()
        torch.cuda.init()
        torch.empty(1, device=dev)
        torch.cuda.synchronize(dev)
        t["cuda_init_s"] = round(time.perf_counter() - t0, 2)
        p = torch.cuda.get_device_properties(dev)
        gpu = {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
               "sms": p.multi_processor_count, "count": torch.cuda.device_count()}
        versions["cudnn"] = torch.backends.cudnn.version()
        nccl = torch.cuda.nccl.version()  # a tuple (2, 27, 7) in recent releases
        versions["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    t0 = time.perf_counter()
    import torch.distributed as dist

    with w1_group(ctx.backend, dev):
        x = torch.ones(4, device=dev)
        dist.all_reduce(x)  # the communicator is created here (NCCL: lazily, at the first collective)
        if ctx.cuda:
            torch.cuda.synchronize(dev)
        if x.sum().item() != 4:
            problems.append(f"W=1 all_reduce of ones gave {x.tolist()}")
    t[f"{ctx.backend}_w1_init_first_collective_s"] = round(time.perf_counter() - t0, 2)
    if ctx.cuda:
        t0 = time.perf_counter()
        seen = event_wait_probe(dev)
        probe: dict[str, Any] = {"consumer_read_fill": seen, "sleep_cycles": PROBE_SLEEP_CYCLES, "trials": PROBE_TRIALS,
                                 "wall_s": round(time.perf_counter() - t0, 2)}
        probe["control_raced"] = seen["none"] < 1.0
        probe["device_form_orders"] = seen["device"] == 1.0 and probe["control_raced"]
        probe["generic_mix_orders"] = seen["generic"] == 1.0 and probe["control_raced"]
        if seen["device"] != 1.0:
            problems.append(f"event.wait(stream) did not order the consumer after the producer: {seen}")
        elif not probe["control_raced"]:
            problems.append(f"the control (no wait) read the fill too, the probe proves nothing: {seen}; "
                            f"raise PROBE_SLEEP_CYCLES")
        probe["status"] = "proved" if probe["device_form_orders"] else "FAILED"
    else:
        probe = {"status": "skipped: no streams on the CPU (dry run)"}
    ok = not problems
    key = (f"torch {torch.__version__} cuda {versions['cuda']} nccl {versions.get('nccl')} "
           f"py {versions['python']} tf {versions['transformers']}; {gpu.get('name', 'cpu')}; "
           f"event wait: {probe['status']}"
           + (f" (generic mix orders: {probe['generic_mix_orders']})" if ctx.cuda else ""))
    row = {"versions": versions, "gpu": gpu, "startup": t, "event_wait_probe": probe, "from_tree": from_tree}
    ctx.row(**row)
    return {"ok": ok, "problems": problems, **row, "key": key}
