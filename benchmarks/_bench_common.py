"""Shared helpers of ``benchmarks/step_bench.py``: communication counting, timing, memory, spawning.

Everything here is independent of the implementations being measured (``baselines/``).

* :class:`CommCounter` / :func:`install_comm_counter` wrap the ``torch.distributed`` collective
  and point-to-point functions (in both ``torch.distributed`` and ``distributed_c10d``, so the
  deprecated aliases that call each other are seen once) and the Python functional collectives
  (``torch.distributed._functional_collectives``, which DTensor redistribution uses), and count
  calls and bytes per *phase* (``fwd``/``bwd``/``step``/``other``), a flag the benchmark sets around
  each phase. Collectives issued from C++ (DDP's reducer, ``_broadcast_coalesced``) are invisible
  to Python: the DDP baseline therefore registers a Python all-reduce comm hook.
* byte accounting, per call and per rank (documented in ``BYTES_DOC``): ``buf`` is the size of
  the call's main buffer, ``wire`` an estimate of the bytes this rank puts on the wire under the
  usual ring / NCCL-tests "bus bandwidth" convention (exact for all-to-all and p2p).
* :func:`local_nbytes`, :func:`gather_full_state` (owner/shard-agnostic gathering of parameters on
  rank 0, for the parity check), :func:`summarize`, environment info, and the process launcher
  (:func:`launch_ranks`: one subprocess per rank, FileStore rendezvous, optional network
  namespace per rank, hard timeout that kills only the processes it started).
* devices: :func:`resolve_device` (``--backend gloo`` -> CPU, ``nccl`` -> ``cuda:<local rank>``,
  with a clear ``ValueError`` instead of a hang when the GPUs are missing) and
  :func:`device_sync` (``torch.cuda.synchronize`` before a timer is read; nothing on CPU).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "BYTES_DOC",
    "CommCounter",
    "install_comm_counter",
    "comm_counter",
    "local_nbytes",
    "gather_full_state",
    "max_abs_diff",
    "summarize",
    "env_info",
    "launch_ranks",
    "PHASES",
    "proc_cpu_ticks",
    "machine_cpu_ticks",
    "foreign_cpu_share",
    "wait_quiet",
    "nic_bytes",
    "p2p_throughput",
    "BACKENDS",
    "resolve_device",
    "device_sync",
]

PHASES = ("fwd", "bwd", "step", "other")

BYTES_DOC = (
    "calls/bytes per rank per step, counted by wrapping torch.distributed collectives, p2p and "
    "functional collectives in Python. buf = bytes of the call's main buffer (all_reduce/reduce/"
    "broadcast: the tensor; all_gather: the gathered output; reduce_scatter: the unreduced input; "
    "all_to_all: max(input, output); p2p: the tensor). wire = estimated bytes this rank sends "
    "(ring/NCCL-tests bus convention: all_reduce 2(W-1)/W*n, all_gather and reduce_scatter "
    "(W-1)/W*n, broadcast and reduce n; all_to_all: input minus this rank's own split, exact; "
    "send/isend: n; recv: 0)."
)


# ================================================================================ devices
BACKENDS = ("gloo", "nccl")


def resolve_device(backend: str, *, rank: int = 0, local_rank: int | None = None,
                   local_world: int | None = None) -> torch.device:
    """The device a rank of ``--backend backend`` computes on; sets nothing.

    ``gloo`` -> ``cpu``. ``nccl`` -> ``cuda:<local_rank>`` (``LOCAL_RANK`` under torchrun), else
    ``cuda:<rank % torch.cuda.device_count()>``. Raises ``ValueError`` (naming ``--backend nccl``,
    what is missing and the value seen) when CUDA or NCCL is unavailable or this node has fewer
    GPUs than ``local_world`` ranks, so that a run fails before any rendezvous instead of hanging.
    """
    if backend == "gloo":
        return torch.device("cpu")
    if backend != "nccl":
        raise ValueError(f"--backend {backend!r}: unknown backend; choose from {list(BACKENDS)}")
    if not torch.cuda.is_available():
        raise ValueError(
            "--backend nccl needs CUDA GPUs, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, torch.version.cuda={torch.version.cuda!r}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use --backend gloo on CPU")
    if not dist.is_nccl_available():
        raise ValueError(f"--backend nccl: this torch build ({torch.__version__}) has no NCCL "
                         "(torch.distributed.is_nccl_available() is False)")
    n = torch.cuda.device_count()
    if local_world is not None and n < local_world:
        raise ValueError(f"--backend nccl needs one GPU per rank on this node: {local_world} ranks per node "
                         f"but torch.cuda.device_count() is {n} "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    index = local_rank if local_rank is not None else rank % n
    if not 0 <= index < n:
        raise ValueError(f"--backend nccl: local rank {index} has no GPU; torch.cuda.device_count() is {n}")
    return torch.device("cuda", index)


def device_sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA); CPU ops are synchronous: nothing to do."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ================================================================================ comm counting
class CommCounter:
    """Calls and bytes per (phase, op); ``phase`` is set by the benchmark around each phase."""

    def __init__(self) -> None:
        self.phase = "other"
        self._tls = threading.local()
        self.reset()

    def reset(self) -> None:
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.buf: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.wire: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        old, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = old

    def record(self, op: str, buf: int, wire: int) -> None:
        p = self.phase
        self.calls[p][op] += 1
        self.buf[p][op] += int(buf)
        self.wire[p][op] += int(wire)

    def snapshot(self) -> dict[str, Any]:
        """``{phase: {"calls": n, "buf": bytes, "wire": bytes, "ops": {op: [calls, buf, wire]}}}``."""
        out: dict[str, Any] = {}
        for p in PHASES:
            ops = {op: [self.calls[p][op], self.buf[p][op], self.wire[p][op]] for op in sorted(self.calls[p])}
            out[p] = {
                "calls": sum(v[0] for v in ops.values()),
                "buf": sum(v[1] for v in ops.values()),
                "wire": sum(v[2] for v in ops.values()),
                "ops": ops,
            }
        return out

    # re-entrancy: count only the outermost wrapped call (aliases call each other)
    def _enter(self) -> bool:
        depth = getattr(self._tls, "depth", 0)
        self._tls.depth = depth + 1
        return depth == 0

    def _exit(self) -> None:
        self._tls.depth -= 1


_COUNTER: CommCounter | None = None


def comm_counter() -> CommCounter:
    if _COUNTER is None:
        raise RuntimeError("install_comm_counter() was not called")
    return _COUNTER


def _nb(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nb(x) for x in t)
    return 0


def _ws(group: Any) -> int:
    try:
        return dist.get_world_size(group)
    except Exception:
        return dist.get_world_size()


def _grank(group: Any) -> int:
    try:
        return dist.get_rank(group)
    except Exception:
        return dist.get_rank()


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _a2a_sizes(args: tuple, kwargs: dict) -> tuple[int, int]:
    out, inp = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 1, "input")
    out_splits = _arg(args, kwargs, 2, "output_split_sizes")
    in_splits = _arg(args, kwargs, 3, "input_split_sizes")
    group = _arg(args, kwargs, 4, "group")
    W, r = _ws(group), _grank(group)
    row = inp.element_size() * (inp[0].numel() if inp.dim() > 0 and inp.size(0) else 0)
    if in_splits:
        own = in_splits[r] * row
    else:
        own = _nb(inp) // max(W, 1)
    return max(_nb(out), _nb(inp)), _nb(inp) - own


def _bytes_of(op: str, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(buf, wire) for one call of ``op`` (see BYTES_DOC)."""
    group = kwargs.get("group")
    if op in ("all_reduce", "all_reduce_coalesced"):
        group = _arg(args, kwargs, 2, "group")
        n = _nb(_arg(args, kwargs, 0, "tensor", _arg(args, kwargs, 0, "tensors")))
        W = _ws(group)
        return n, 2 * (W - 1) * n // W
    if op in ("reduce", "broadcast"):
        n = _nb(_arg(args, kwargs, 0, "tensor"))
        return n, n
    if op in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
        group = _arg(args, kwargs, 2, "group")
        n = _nb(_arg(args, kwargs, 0, "output_tensor"))
        W = _ws(group)
        return n, (W - 1) * n // W
    if op in ("all_gather", "all_gather_coalesced"):
        group = _arg(args, kwargs, 2, "group")
        n = _nb(_arg(args, kwargs, 0, "tensor_list", _arg(args, kwargs, 0, "output_tensor_lists")))
        W = _ws(group)
        return n, (W - 1) * n // W
    if op in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        group = _arg(args, kwargs, 3, "group")
        n = _nb(_arg(args, kwargs, 1, "input"))
        W = _ws(group)
        return n, (W - 1) * n // W
    if op == "reduce_scatter":
        group = _arg(args, kwargs, 3, "group")
        inputs = _arg(args, kwargs, 1, "input_list")
        r = _grank(group)
        n = _nb(inputs)
        own = _nb(inputs[r]) if isinstance(inputs, (list, tuple)) and len(inputs) > r else 0
        return n, n - own  # wire: each rank's piece goes to that rank once (direct algorithm)
    if op == "all_to_all_single":
        return _a2a_sizes(args, kwargs)
    if op == "all_to_all":
        outs, ins = _arg(args, kwargs, 0, "output_tensor_list"), _arg(args, kwargs, 1, "input_tensor_list")
        group = _arg(args, kwargs, 2, "group")
        r = _grank(group)
        own = _nb(ins[r]) if len(ins) > r else 0
        return max(_nb(outs), _nb(ins)), _nb(ins) - own
    if op in ("send", "isend"):
        n = _nb(_arg(args, kwargs, 0, "tensor"))
        return n, n
    if op in ("recv", "irecv"):
        return _nb(_arg(args, kwargs, 0, "tensor")), 0
    return 0, 0


def _p2p_bytes(ops: Sequence[Any]) -> tuple[int, int, int]:
    buf = wire = 0
    for o in ops:
        n = _nb(o.tensor)
        buf += n
        if getattr(o.op, "__name__", "") in ("isend", "send"):
            wire += n
    return len(ops), buf, wire


_C10D_OPS = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast",
    "all_gather", "all_gather_coalesced", "all_gather_single", "all_gather_into_tensor", "_all_gather_base",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
)

_FUNCOL_OPS = {
    # funcol name -> (buffer, wire) from (tensor, group size)
    "all_reduce": lambda n, W: (n, 2 * (W - 1) * n // W),
    "all_gather_tensor": lambda n, W: (n * W, (W - 1) * n),
    "all_gather_tensor_autograd": lambda n, W: (n * W, (W - 1) * n),
    "reduce_scatter_tensor": lambda n, W: (n, (W - 1) * n // W),
    "reduce_scatter_tensor_autograd": lambda n, W: (n, (W - 1) * n // W),
    "all_to_all_single": lambda n, W: (n, (W - 1) * n // W),
    "broadcast": lambda n, W: (n, n),
}


def _funcol_group_size(args: tuple, kwargs: dict) -> int:
    for a in list(args[1:]) + list(kwargs.values()):
        try:
            return _group_size_any(a)
        except Exception:
            continue
    return dist.get_world_size()


def _group_size_any(g: Any) -> int:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(g, DeviceMesh):
        return g.size() if g.ndim == 1 else g.size(0)
    if isinstance(g, tuple) and len(g) == 2 and isinstance(g[0], DeviceMesh):
        return g[0].size(g[1])
    if isinstance(g, dist.ProcessGroup):
        return g.size()
    if isinstance(g, (list, tuple)) and g and all(isinstance(x, int) for x in g):
        return len(g)
    raise TypeError


def install_comm_counter() -> CommCounter:
    """Wrap the collectives once per process (idempotent); returns the global counter."""
    global _COUNTER
    if _COUNTER is not None:
        return _COUNTER
    counter = CommCounter()
    c10d = dist.distributed_c10d

    def wrap(op: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            outer = counter._enter()
            try:
                if outer:
                    try:
                        buf, wire = _bytes_of(op, args, kwargs)
                    except Exception:  # never break the program because of accounting
                        buf, wire = 0, 0
                    counter.record(op, buf, wire)
                return fn(*args, **kwargs)
            finally:
                counter._exit()

        wrapper._bench_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    originals: dict[str, Callable] = {}
    for op in _C10D_OPS:
        fn = getattr(c10d, op, None)
        if fn is None or getattr(fn, "_bench_wrapped", False):
            continue
        originals[op] = fn
        w = wrap(op, fn)
        setattr(c10d, op, w)
        if getattr(dist, op, None) is fn:
            setattr(dist, op, w)

    # P2POp checks ``op in [isend, irecv]`` against c10d's globals (now the wrappers); accept the
    # originals too, for code that captured them before we patched.
    orig_isend, orig_irecv = originals.get("isend"), originals.get("irecv")

    def _check_op(op: Any) -> None:
        if op not in (c10d.isend, c10d.irecv, orig_isend, orig_irecv):
            raise ValueError("Invalid ``op``. Expected ``op`` to be of type ``torch.distributed.isend`` "
                             "or ``torch.distributed.irecv``.")

    c10d._check_op = _check_op

    orig_batch = c10d.batch_isend_irecv

    @functools.wraps(orig_batch)
    def batch_isend_irecv(p2p_op_list: Any) -> Any:
        outer = counter._enter()
        try:
            if outer:
                n, buf, wire = _p2p_bytes(p2p_op_list)
                p = counter.phase
                counter.calls[p]["batch_isend_irecv"] += 1
                counter.calls[p]["p2p_ops"] += n
                counter.buf[p]["batch_isend_irecv"] += buf
                counter.wire[p]["batch_isend_irecv"] += wire
            return orig_batch(p2p_op_list)
        finally:
            counter._exit()

    c10d.batch_isend_irecv = batch_isend_irecv
    dist.batch_isend_irecv = batch_isend_irecv

    # functional collectives (DTensor redistribution)
    try:
        from torch.distributed import _functional_collectives as fc
    except Exception:  # pragma: no cover
        fc = None
    if fc is not None:
        for name, sizes in _FUNCOL_OPS.items():
            fn = getattr(fc, name, None)
            if fn is None:
                continue

            def make(name: str = name, fn: Callable = fn, sizes: Callable = sizes) -> Callable:
                @functools.wraps(fn)
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    outer = counter._enter()
                    try:
                        if outer:
                            try:
                                t = args[0] if args else next(iter(kwargs.values()))
                                W = _funcol_group_size(args, kwargs)
                                buf, wire = sizes(_nb(t), W)
                            except Exception:
                                buf, wire = 0, 0
                            counter.record("funcol." + name, buf, wire)
                        return fn(*args, **kwargs)
                    finally:
                        counter._exit()

                return wrapper

            setattr(fc, name, make())
    _COUNTER = counter
    return counter


# ================================================================================ memory, state
def _local(t: torch.Tensor) -> torch.Tensor:
    try:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t._local_tensor
    except ImportError:  # pragma: no cover
        pass
    return t


def local_nbytes(tensors: Iterable[Any]) -> int:
    """Sum of local (per-rank) nbytes of the tensors (DTensors count their local shard)."""
    total = 0
    seen: set[int] = set()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        loc = _local(t)
        if id(loc) in seen:
            continue
        seen.add(id(loc))
        total += loc.numel() * loc.element_size()
    return total


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


def _piece(p: torch.Tensor) -> tuple[tuple[int, ...], torch.Tensor] | None:
    """(global offset, local values) of this rank's piece of ``p``; None if it holds none."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return (0,) * p.dim(), p.detach().to("cpu", copy=True)
    mesh = p.device_mesh
    if dist.get_rank() not in mesh.mesh.flatten().tolist():
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    loc = p._local_tensor.detach()
    if loc.numel() == 0:
        return None
    if any(pl.is_partial() for pl in p.placements):
        raise RuntimeError("gather_full_state: Partial placement")
    rows = getattr(p, "_rows", None)  # matrixfsdp's expert stacks: rows per shard rank from the plan's counts
    if rows is not None:
        s = mesh.get_local_rank(mesh.ndim - 1)
        return (sum(rows[:s]),) + (0,) * (p.dim() - 1), loc.to("cpu", copy=True)
    _, offset = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
    return tuple(int(o) for o in offset), loc.to("cpu", copy=True)


def gather_full_state(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """Assemble the full value of every named tensor on rank 0 (None elsewhere).

    Works for plain replicated tensors, FSDP2 ``Shard(0)`` DTensors and owner placements (a
    ``Replicate`` DTensor on a one-rank sub-mesh, empty elsewhere): each rank contributes the
    non-empty local pieces it holds with their global offsets; rank 0 pastes them. A collective
    (``gather_object``); not timed. Pieces are copied to host memory first and the result is on
    CPU whatever the device (pickled CUDA tensors would be rebuilt on the sender's GPU index).
    """
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    pieces: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
    rank = dist.get_rank()
    for name, p in named:
        shapes[name] = (tuple(p.shape), p.dtype)
        from torch.distributed.tensor import DTensor

        if not isinstance(p, DTensor) and rank != 0:
            continue  # replicated plain tensor: rank 0's copy is enough
        pc = _piece(p)
        if pc is not None:
            pieces.append((name, pc[0], pc[1]))
    got: list[Any] = [None] * dist.get_world_size() if rank == 0 else None  # type: ignore[assignment]
    dist.gather_object(pieces, got, dst=0)
    if rank != 0:
        return None
    full = {n: torch.full(s, float("nan"), dtype=dt) for n, (s, dt) in shapes.items()}
    for rank_pieces in got:
        for name, offset, val in rank_pieces:
            idx = tuple(slice(o, o + s) for o, s in zip(offset, val.shape))
            full[name][idx] = val
    return full


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str, int]:
    """(max |a-b| over all common tensors, the worst tensor's name, number of NaNs in a)."""
    worst, worst_name, nans = 0.0, "", 0
    for k, v in a.items():
        nans += int(torch.isnan(v).sum())
        if k not in b:
            continue
        d = float((v.double() - b[k].double()).abs().max()) if v.numel() else 0.0
        if d > worst or worst_name == "":
            worst, worst_name = d, k
    return worst, worst_name, nans


# ================================================================================ CPU accounting
def proc_cpu_ticks() -> int:
    """user+system clock ticks of this process (all threads, gloo's included); -1 if unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of proc(5))
    except Exception:
        return -1


def machine_cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine from /proc/stat; (-1, -1) if unknown."""
    try:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        user, nice, system, idle, iowait, irq, softirq = vals[:7]
        steal = vals[7] if len(vals) > 7 else 0
        # irq/softirq are left out of "busy": loopback/veth packet processing for our own ranks
        # lands there without being charged to our processes.
        busy = user + nice + system + steal
        return busy, busy + idle + iowait + irq + softirq
    except Exception:
        return -1, -1


def foreign_cpu_share(machine0: tuple[int, int], machine1: tuple[int, int], ours: int) -> float | None:
    """Fraction of the machine's CPU capacity used by processes other than ours in an interval."""
    busy, total = machine1[0] - machine0[0], machine1[1] - machine0[1]
    if machine0[0] < 0 or total <= 0 or ours < 0:
        return None
    return max(0.0, (busy - ours) / total)


def wait_quiet(max_wait_s: float, threshold: float = 0.10, window_s: float = 2.0, need: int = 2) -> list[float]:
    """Sample the machine's busy share in ``window_s`` windows until ``need`` consecutive ones are
    below ``threshold`` or ``max_wait_s`` passed; returns the samples (for the log)."""
    samples: list[float] = []
    deadline = time.monotonic() + max_wait_s
    while True:
        a = machine_cpu_ticks()
        time.sleep(window_s)
        b = machine_cpu_ticks()
        if a[0] < 0 or b[1] <= a[1]:
            break
        samples.append((b[0] - a[0]) / (b[1] - a[1]))
        if len(samples) >= need and all(x < threshold for x in samples[-need:]):
            break
        if time.monotonic() >= deadline:
            break
    return samples


def nic_bytes(ifname: str | None) -> tuple[int, int] | None:
    """(tx_bytes, rx_bytes) of interface ``ifname`` as this process's network namespace sees it
    (under ``ip netns exec`` /sys is the namespace's own, so this is the rank's own veth)."""
    if not ifname:
        return None
    try:
        base = f"/sys/class/net/{ifname}/statistics/"
        with open(base + "tx_bytes") as f:
            tx = int(f.read())
        with open(base + "rx_bytes") as f:
            rx = int(f.read())
        return tx, rx
    except OSError:
        return None


def p2p_throughput(pairs: Sequence[tuple[int, int]], nbytes: int, reps: int = 3) -> dict[str, Any]:
    """Collective (every rank calls it): each ``(src, dst)`` in ``pairs`` sends ``nbytes`` at the same
    time (gloo send/recv, after a barrier), ``reps`` times. Returns, on every rank, the per-rep wall
    seconds (max over the ranks involved) and the median achieved throughput per pair in Mbit/s."""
    rank = dist.get_rank()
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    times: list[float] = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        for src, dst in pairs:
            if rank == src:
                dist.send(buf, dst=dst)
            elif rank == dst:
                dist.recv(buf, src=src)
        dt = torch.tensor([time.perf_counter() - t0 if any(rank in pr for pr in pairs) else 0.0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
    med = statistics.median(times)
    return {"pairs": [list(pr) for pr in pairs], "bytes": buf.numel() * 4, "seconds": [round(t, 4) for t in times],
            "mbit_s_per_pair": round(buf.numel() * 4 * 8 / med / 1e6, 1)}


# ================================================================================ stats
def summarize(xs: Sequence[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """The command that is running, as typed from the repository root (for results headers).

    ``script`` is the benchmark's ``__file__``; ``argv`` the arguments its ``main`` parsed
    (``None``: ``sys.argv[1:]``), so the header records the ``--out`` and options actually used.
    """
    import shlex

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.relpath(os.path.abspath(script), root)
    args = list(sys.argv[1:] if argv is None else argv)
    return "python " + shlex.join([path, *args])


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` says)."""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def env_info(device: torch.device | None = None) -> dict[str, Any]:
    """Versions and machine; with a CUDA ``device`` also the CUDA/NCCL versions and the GPU."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    if device is not None and device.type == "cuda":
        info["cuda"] = torch.version.cuda
        try:
            info["gpu"] = torch.cuda.get_device_name(device)
            info["gpu_count"] = torch.cuda.device_count()
            info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        except Exception as e:  # never fail a finished run because of the report
            info["gpu"] = f"unknown ({e})"
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception:
            info["nccl"] = None
    try:
        import importlib.metadata as md

        info["torchtitan"] = md.version("torchtitan")
    except Exception:
        info["torchtitan"] = None
    try:
        import matrixfsdp

        info["matrixfsdp"] = getattr(matrixfsdp, "__version__", "?")
    except Exception as e:
        info["matrixfsdp"] = f"import failed: {e}"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=os.path.dirname(os.path.abspath(__file__)), timeout=5)
        info["git"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:
        info["git"] = None
    return info


# ================================================================================ launching
def launch_ranks(
    world: int,
    worker_argv: list[str],
    *,
    store_path: str,
    threads: int,
    timeout_s: float,
    netns_prefix: str | None = None,
    gloo_ifname: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> list[int]:
    """Start ``world`` copies of ``worker_argv`` (with ``--_rank r``), wait, return exit codes.

    Each rank gets ``MFB_RANK``, ``MFB_WORLD``, ``MFB_STORE`` (a FileStore path, which works across
    network namespaces because the filesystem is shared) and ``OMP_NUM_THREADS``. With
    ``netns_prefix`` rank r runs under ``ip netns exec <prefix>r``. Output is inherited. If any rank
    fails, the others get 20 s, then are killed; after ``timeout_s`` all are killed (by the process
    group of each child we started, never by name). Returns the exit codes (-9 for killed).
    """
    procs: list[subprocess.Popen] = []
    for r in range(world):
        env = dict(os.environ)
        env.update({
            "MFB_RANK": str(r), "MFB_WORLD": str(world), "MFB_STORE": store_path,
            "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
        })
        if gloo_ifname:
            env["GLOO_SOCKET_IFNAME"] = gloo_ifname
        env.update(extra_env or {})
        cmd = list(worker_argv) + ["--_rank", str(r)]
        if netns_prefix:
            cmd = ["ip", "netns", "exec", f"{netns_prefix}{r}"] + cmd
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = [None] * world
    first_fail: float | None = None
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            if codes[i] is None:
                codes[i] = p.poll()
                if codes[i] not in (None, 0) and first_fail is None:
                    first_fail = time.monotonic()
        now = time.monotonic()
        if now > deadline or (first_fail is not None and now > first_fail + 20):
            why = "timeout" if now > deadline else "another rank failed"
            for i, p in enumerate(procs):
                if codes[i] is None:
                    print(f"[launcher] killing rank {i} ({why})", file=sys.stderr)
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    p.wait()
                    codes[i] = -9
            break
        time.sleep(0.2)
    return [int(c) for c in codes]  # type: ignore[arg-type]


def dumps(row: dict[str, Any]) -> str:
    return json.dumps(row, sort_keys=False, default=str)
