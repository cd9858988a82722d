"""A small multi-process harness for gloo tests (CPU, several processes on one machine).

Two entry points:

* :class:`DistPool` keeps ``world_size`` worker processes alive, with a gloo process group
  initialized once, and runs picklable top-level functions on every rank::

      with DistPool(2) as pool:
          results = pool.run(my_check, 3, seed=0)   # my_check(3, seed=0) on ranks 0 and 1
          # results[r] is what rank r returned

* :func:`run_distributed` is a one-shot ``DistPool(world_size).run(...)``.

Failures never hang: if any rank raises, the others get a short grace period, then every worker
is killed and :class:`DistributedTestError` carries all ranks' tracebacks; if the ranks do not all
answer within ``timeout`` seconds, the workers are killed and :class:`DistributedTestTimeout` is
raised. After a failure the pool restarts its workers on the next :meth:`DistPool.run` (a failed
collective may leave the process group unusable).

Startup cost is kept low: workers come from a ``forkserver`` that has already imported torch, and
each worker uses one intra-op thread (W processes share a 2-core CI box). Rendezvous is a
``FileStore`` in a fresh temporary directory, so concurrent pools never collide on ports.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["DistPool", "DistributedTestError", "DistributedTestTimeout", "run_distributed", "get_pool",
           "forkserver_context"]

# matrixfsdp imports torch._dynamo (via its hooks): preloading it once in the forkserver saves every
# worker the import, which on a loaded 2-core box took longer than some tests' whole timeout
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
            "torch._dynamo", "matrixfsdp"]
# how long the ranks may take to start and unpickle a function (importing its test module) before
# the test's own timeout starts counting
_STARTUP_S = 300.0
_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def forkserver_context() -> Any:
    """The pools' ``forkserver`` multiprocessing context: each process it starts is a fresh fork
    of a server that has imported torch and matrixfsdp and run nothing, so a test that needs a new
    process per run (no state carried over) gets one without a torch import each."""
    return _context()


class DistributedTestError(RuntimeError):
    """At least one rank raised; ``errors`` maps rank -> formatted traceback."""

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        body = "\n".join(f"----- rank {r} -----\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{body}")


class DistributedTestTimeout(TimeoutError):
    """Not every rank answered in time; the workers were killed."""


def _worker(rank: int, world_size: int, store_path: str, conn: Any, backend: str, threads: int,
            pg_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # on a timeout the parent sends SIGUSR1 and reports every rank's Python stacks
    stacks = open(_stack_file(store_path, rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    try:
        while True:
            raw = conn.recv_bytes()
            try:
                msg = pickle.loads(raw)  # imports the function's module
            except BaseException as e:  # noqa: BLE001 - a test module that fails to import
                conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
                continue
            if msg is None:
                break
            fn, args, kwargs = msg
            conn.send(("started", None))
            if conn.recv() is None:  # the parent's go, once every rank has started
                break
            try:
                conn.send(("ok", fn(*args, **kwargs)))
            except BaseException as e:  # noqa: BLE001 - report everything to the parent
                conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _stack_file(store_path: str, rank: int) -> str:
    return os.path.join(os.path.dirname(store_path), f"stacks.{rank}")


class DistPool:
    """``world_size`` long-lived gloo ranks that run functions on demand (see module docstring)."""

    def __init__(self, world_size: int, *, timeout: float = 120.0, backend: str = "gloo",
                 threads: int = 1, grace: float = 10.0):
        if world_size < 1:
            raise ValueError(f"DistPool: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.backend = backend
        self.threads = threads
        self.grace = grace
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._tmpdir: str | None = None

    # ----------------------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        ctx = _context()
        self._tmpdir = tempfile.mkdtemp(prefix="matrixfsdp-harness-")
        store_path = os.path.join(self._tmpdir, "store")
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, store_path, child, self.backend, self.threads,
                      max(self.timeout, 30.0)),
                daemon=True,
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)

    def close(self) -> None:
        """Stop the workers (politely if idle, by force otherwise)."""
        for c in self._conns:
            try:
                c.send(None)
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5.0)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _stacks(self, ranks: dict[int, Any]) -> str:
        """Every silent rank's Python stacks (faulthandler, on SIGUSR1), for the timeout report."""
        if self._tmpdir is None:
            return ""
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except (OSError, AttributeError, TypeError):
                pass
        time.sleep(1.0)
        out = []
        for r in sorted(ranks):
            try:
                with open(_stack_file(os.path.join(self._tmpdir, "store"), r)) as f:
                    out.append(f"\n----- rank {r} stacks -----\n{f.read()}")
            except OSError:
                pass
        return "".join(out)

    def _answer(self, rank: int) -> tuple[str, Any]:
        """Rank ``rank``'s next message, or an error if it died."""
        try:
            return self._conns[rank].recv()
        except EOFError:
            return "err", f"rank {rank} died (exit code {self._procs[rank].exitcode})"

    def _barrier(self, fn: Callable[..., Any]) -> None:
        """Wait until every rank has unpickled ``fn`` (imported its module), then let all run it.

        Imports under load must neither count against the test's timeout nor leave the fast ranks
        waiting in a collective for a rank that is still importing.
        """
        waiting = dict(enumerate(self._conns))
        deadline = time.monotonic() + _STARTUP_S
        failed: dict[int, str] = {}
        while waiting and not failed:
            ready = mpc.wait(list(waiting.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = next(r for r, c in waiting.items() if c is conn)
                del waiting[rank]
                status, payload = self._answer(rank)
                if status != "started":
                    failed[rank] = payload
        if waiting or failed:
            self._kill()
            if failed:
                raise DistributedTestError(failed)
            raise DistributedTestTimeout(
                f"{getattr(fn, '__name__', fn)}: ranks {sorted(waiting)} did not start within "
                f"{_STARTUP_S:.0f}s; all workers were killed")
        for c in self._conns:
            c.send(True)

    def __enter__(self) -> "DistPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------------------- running
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        ``fn`` must be picklable (a top-level function of an importable module).
        """
        if not self._procs:
            self._start()
        timeout = self.timeout if timeout is None else timeout
        for c in self._conns:
            c.send((fn, args, kwargs))
        self._barrier(fn)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if errors:
                left = min(left, self.grace)
            if left <= 0:
                break
            ready = mpc.wait(list(pending.values()), timeout=left)
            if not ready:
                break
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                status, payload = self._answer(rank)
                if status == "ok":
                    results[rank] = payload
                else:
                    errors[rank] = payload
            if errors:
                deadline = min(deadline, time.monotonic() + self.grace)
        if errors or pending:
            stacks = self._stacks(pending) if pending and not errors else ""
            self._kill()
            if errors:
                for r in pending:
                    errors[r] = "(no answer: killed after another rank failed)"
                raise DistributedTestError(errors)
            raise DistributedTestTimeout(
                f"{getattr(fn, '__name__', fn)}: ranks {sorted(pending)} did not answer within "
                f"{timeout:.0f}s; all workers were killed{stacks}"
            )
        return [results[r] for r in range(self.world_size)]


_POOLS: dict[int, DistPool] = {}


def get_pool(world_size: int) -> DistPool:
    """A shared pool per world size (closed after each test module by conftest.py, and at exit)."""
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = DistPool(world_size)
    return pool


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                    **kwargs: Any) -> list[Any]:
    """One-shot: start ``world_size`` ranks, run ``fn`` on each, stop them, return results."""
    with DistPool(world_size, timeout=timeout) as pool:
        return pool.run(fn, *args, **kwargs)


import atexit  # noqa: E402

atexit.register(close_pools)
