"""The prepared one-GPU check (issues 19, 29 and 40): one command, one CUDA GPU, no install.

    PYTHONPATH=src python3 benchmarks/gpu/check.py            # every part, on a cold machine in <= 500 s
    PYTHONPATH=src python3 benchmarks/gpu/check.py --quick    # smaller runs, <= 380 s; no sanitizer
    PYTHONPATH=src python3 benchmarks/gpu/check.py --parts race,compile --budget 240   # a rerun of two parts
    PYTHONPATH=src python3 benchmarks/gpu/check.py --device cpu   # the dry run CI runs (no GPU)

``PYTHONPATH=src`` is optional (this file puts the tree's ``src`` first on ``sys.path`` and on
the workers' ``PYTHONPATH``); ``matrixfsdp`` need not be installed; transformers and torchtitan
are optional (``smoke``'s Hugging Face check is skipped without transformers).

Results go to ``--out``: default ``$OUT`` when set, else ``runs/gpu-check/<time>/`` (git ignores
``runs/``); the folder is printed at the start and the end. It holds at most five files, with
names of letters, digits, ``.``, ``_`` and ``-`` only (the GPU machine returns at most 8 such files):

* ``rows.jsonl``: every row as a part produces it (appended and flushed: a part killed at its
  limit keeps what it measured);
* ``summary.json`` and ``summary.md``: the table (part, status, key figure, wall and limit, what
  it shows, what it cannot show), rewritten after every part;
* ``gpu-check.tar.gz``: everything, rewritten after every part: the above, each part's result
  (``<part>.json``) and output (``<part>.log``); while it is rewritten, ``gpu-check.tar.gz.tmp``.

Processes: the parts run one after the other in ONE worker process (every fresh process pays the
torch import, CUDA's and NCCL's start and cold compiles once), watched by this driver: a part
past its limit is killed with its worker, reported ``TIMEOUT``, and the parts after it continue
in a new worker; a worker that dies mid-part reports that part ``CRASHED``. ``--isolate``: one
worker per part. ``--inline``: the parts run in this process (no limit can be enforced: a part
over its limit is reported as failed afterwards). The parts (``check_parts/``, one module each,
whose docstrings say what they run and check; shared helpers in ``check_parts/core.py``):

0. ``preflight`` (``check_parts/preflight.py``): versions, start-up costs and the event-wait
   probe (a cross-stream wait orders work); fails fast: the other parts are skipped.
1. ``race`` (``race.py``): stream ordering of copy-in/gather/reduce against compute, side streams
   delayed against not (bitwise), hook against none (bitwise), against unsharded references.
2. ``smoke`` (``smoke.py``): every API that touches collectives under ``"nccl"`` and
   ``"cpu:gloo,cuda:nccl"``; the (1,1) HSDP and TP meshes.
3. ``sync_debug`` (``sync_debug.py``): host syncs per phase against declared expectations, after
   a positive control (one deliberate ``.item()`` must be counted).
4. ``memory`` (``memory.py``): peak above a baseline against stock FSDP2, previous model freed.
5. ``kernels`` (``kernels.py``): batched bf16 Newton-Schulz TFLOP/s and % of dense peak on
   Qwen3 shapes, compiled variants, ``eigh``/``qr`` timings.
6. ``compile`` (``graphs.py``): the capturable Muon step compiled (at least one frame) and
   replayed as a CUDA graph, against eager.
7. ``race_sanitizer`` (``race.py``, full mode): ``race`` for 3 steps under torch's CUDA sanitizer;
   last, because the sanitizer cannot be switched off in a process.

At W=1 every collective of the engine short-cuts (a sum over one rank is its input), so the
parts that exercise the engine run inside ``matrixfsdp.comm.collectives.force_collectives()``, a
scoped test hook with which a one-rank group still calls NCCL on the gather and reduce streams.
Without CUDA (or with ``--device cpu``) the parts run their CUDA path on the CPU where they can
(gloo, tiny sizes, ``aot_eager``): a dry run whose statuses say ``dry-run`` and whose limits are
the CPU's (``DRY_LIMITS``); ``tests/bench/test_gpu_check.py`` runs it in CI. One GPU cannot show
cross-rank collective order, HSDP's replica phase and exchange, TP host steps, bandwidth and
overlap; ``benchmarks/gpu/nccl_sweep.py`` covers parity at W=2..8 under torchrun.
"""

from __future__ import annotations

import time

_T_MAIN = time.time()  # before torch: the driver's own start-up counts against the budget

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import queue  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402

_T_TORCH = time.time()

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SRC = ROOT / "src"
# the parts' package sits beside this file (already on sys.path when run as a script; added when
# imported by the tests), and this tree's matrixfsdp comes first: no install needed
for _p in (str(SRC), str(HERE)):
    if _p not in sys.path[:2]:
        sys.path.insert(0, _p)

from check_parts import preflight as _preflight  # noqa: E402
from check_parts.core import Ctx  # noqa: E402
from check_parts.graphs import part_compile  # noqa: E402
from check_parts.kernels import part_kernels  # noqa: E402
from check_parts.memory import MEM_FACTOR, MEM_SLACK, part_memory  # noqa: E402
from check_parts.preflight import part_preflight  # noqa: E402
from check_parts.race import part_race  # noqa: E402
from check_parts.smoke import part_smoke  # noqa: E402
from check_parts.sync_debug import part_sync_debug  # noqa: E402

#: in the order they run: the most telling first, slow compiles late, the sanitizer last
PARTS = ("preflight", "race", "smoke", "sync_debug", "memory", "kernels", "compile", "race_sanitizer")

# ============================================================================ time limits
# Derived from start-up costs measured on this project's CPU box (2 cores shared with other jobs,
# `/usr/bin/time`, 3 runs each): `python -c pass` 0.02-0.07 s; `python -c "import torch"`
# 3.2-5.3 s (torch 2.13) and 4.9-6.9 s (2.11); `import torch, matrixfsdp` 7.5-9.1 s (2.13) and
# 10.5-11.3 s (2.11); with a gloo W=1 group and one all_reduce at most 1.3 s more.
MEASURED_PROCESS_IMPORT_S = 11.3  # the worst: a process with torch and matrixfsdp imported (2.11)
MEASURED_TORCH_IMPORT_S = 6.9  # the driver imports torch only
# Assumed for the GPU machine, a cold one (fresh machine: empty page cache, no compile caches):
#: the CUDA build reads ~2 GiB more shared libraries (libtorch_cuda, cuBLAS, cuDNN, NCCL) from a
#: cold disk; its 16 idle cores against 2 shared ones make up for part of it
ASSUMED_IMPORT_FACTOR = 2.0
#: CUDA context creation with lazy module loading: typically 1-3 s on an H100, up to ~10 s when
#: the driver is not yet persistent
ASSUMED_CUDA_INIT_S = 10
#: the first NCCL communicator (library load, topology probe) at W=1: typically 1-2 s
ASSUMED_NCCL_INIT_S = 10
#: the first torch.compile(inductor) in a process: inductor's imports, the compile worker pool,
#: triton's first kernels without a cache; then each further graph (dynamo reset between variants)
ASSUMED_FIRST_COMPILE_S, ASSUMED_NEXT_COMPILE_S = 45, 15
#: what a fresh worker pays before its first part's work: given to the first part of each worker
STARTUP_S = math.ceil(MEASURED_PROCESS_IMPORT_S * ASSUMED_IMPORT_FACTOR + ASSUMED_CUDA_INIT_S + ASSUMED_NCCL_INIT_S)
#: the driver's own start (interpreter and torch import) before its clock can run parts
DRIVER_START_S = math.ceil(MEASURED_TORCH_IMPORT_S * ASSUMED_IMPORT_FACTOR)
#: the GPU machine runs one command for at most 10 minutes; the check stays 100 s inside it
#: (archive, a slow kill, a worker slow to exit)
DEVICE_COMMAND_S = 600
BUDGET_S, QUICK_BUDGET_S = 500, 380
#: seconds of work per part after the worker's start-up, on the GPU (estimates: full, quick):
#: preflight: the probe (9 trials of a 0.1 s sleep), versions, and slack for a start slower than
#: assumed (everything after it depends on it: a timeout there skips the rest); race: 3 sharded runs of 20 (8)
#: steps of the tiny decoder, the delayed one sleeping 20M cycles per side-stream use (~0.2 s a
#: step), two references, one profiled step (CUPTI start); smoke: ~6 more communicators, DCP
#: saves/loads, transformers' import, twice (two backends); sync_debug: 4 cases of 5 steps;
#: memory: 3 runs of 20 (8) steps of a 1024-wide 4-layer model; kernels: first compile + 3 more
#: (quick: 1) + 8 eager shapes + eigh/qr; compile: first compile + the Muon step's graph (large:
#: one matrix per parameter) + eager and CUDA-graph runs; race_sanitizer: 3 steps, every op
#: tracked on the host
LIMITS = {"preflight": 30, "race": 40, "smoke": 60, "sync_debug": 30, "memory": 30,
          "kernels": ASSUMED_FIRST_COMPILE_S + 3 * ASSUMED_NEXT_COMPILE_S + 15,
          "compile": 2 * ASSUMED_FIRST_COMPILE_S + 10, "race_sanitizer": 45}
QUICK_LIMITS = {"preflight": 30, "race": 25, "smoke": 50, "sync_debug": 25, "memory": 20,
                "kernels": ASSUMED_FIRST_COMPILE_S + 15, "compile": 2 * ASSUMED_FIRST_COMPILE_S + 10,
                "race_sanitizer": 0}
#: the CPU dry run (gloo, tiny sizes, no CUDA start, one CPU thread), its start-up the measured
#: process import: at least 2x the walls measured on the 2-core box under a load average of 15
#: (torch 2.13 / 2.11: race 2.3 / 2.6 s, smoke 11.8 / 10.2, sync_debug 2.2 / 1.4, memory 5.9 / 5.6,
#: kernels 2.1 / 2.0, compile 14.8 / 5.8); the parts that ran in 1-6 s get 20 s: a first call's
#: lazy imports can land in any of them
DRY_LIMITS = {"preflight": 5, "race": 20, "smoke": 40, "sync_debug": 20, "memory": 20, "kernels": 20, "compile": 40,
              "race_sanitizer": 0}
DRY_STARTUP_S = math.ceil(MEASURED_PROCESS_IMPORT_S * 1.5)
DRY_BUDGET_S = DRIVER_START_S + DRY_STARTUP_S + sum(DRY_LIMITS.values())
for _name, _lim, _budget in (("full", LIMITS, BUDGET_S), ("quick", QUICK_LIMITS, QUICK_BUDGET_S)):
    if DRIVER_START_S + STARTUP_S + sum(_lim.values()) > _budget or _budget > DEVICE_COMMAND_S - 60:
        raise ValueError(f"check.py: {_name} limits {sum(_lim.values())} s + start-up {STARTUP_S + DRIVER_START_S} s "
                         f"exceed the budget {_budget} s, or it leaves under a minute of the device's "
                         f"{DEVICE_COMMAND_S} s")

#: what each part shows, and what it cannot show on one GPU (the summary table)
SHOWS = {
    "preflight": ("versions; start-up costs; a cross-stream wait (event.wait(stream), device module's "
                  "types) orders work, against a control without the wait",
                  "the engine's own waits (race does: delayed side streams)"),
    "race": ("stream ordering of copy-in/gather/reduce vs compute under delayed side streams, NCCL "
             "called on them (W=1 hook), training parity vs unsharded (bf16 mirror, fp32)",
             "cross-rank order; peers' chunks (W=1 gathers receive nothing); HSDP/TP phases"),
    "race_sanitizer": ("the same run under torch's CUDA sanitizer (unsynchronized stream accesses)",
                       "as race"),
    "smoke": ("every collectives-using API runs under nccl and cpu:gloo,cuda:nccl with the hook",
              "HSDP replica phase and exchange, TP host step: (1,1) meshes run but skip them "
              "(not shown on one GPU)"),
    "sync_debug": ("host syncs per phase incl. the project's flag read, after a positive control "
                   "(one .item() counted); find_unused=False has none; eigh's error-flag reads are "
                   "the only step syncs of Shampoo/SOAP", "syncs only W>1 paths make (replica phase, TP host step)"),
    "kernels": ("batched bf16 Newton-Schulz TFLOP/s and % of dense peak on Qwen3 shapes; each "
                "compiled variant really compiled", "multi-GPU effects (owner imbalance, overlap)"),
    "memory": ("peak above baseline vs FSDP2 at equal settings (bf16 compute, W=1), threshold "
               f"{MEM_FACTOR:.2f}x + {MEM_SLACK >> 20} MiB; each model freed", "savings that need W>1 (sharded state)"),
    "compile": ("capturable batched Muon, device lr, LambdaLR: compiled (>= 1 frame) and "
                "CUDA-graph-replayed steps equal eager", "compiled steps with W>1 collectives"),
}
NOT_ON_CPU = "on the CPU: no streams, NCCL, CUDA syncs, CUDA memory or CUDA graphs (dry run)"
NOT_ON_ONE_GPU = ("cross-rank collective order, HSDP's replica phase and exchange, TP host steps, bandwidth "
                  "and overlap at W>1: benchmarks/gpu/nccl_sweep.py under torchrun")
WORKERS: dict[str, Callable[[Ctx], dict]] = {
    "preflight": part_preflight, "race": part_race, "smoke": part_smoke, "sync_debug": part_sync_debug,
    "memory": part_memory, "kernels": part_kernels, "compile": part_compile, "race_sanitizer": part_race,
}
ARCHIVE = "gpu-check.tar.gz"
#: every file this check writes into its results folder (at most 8 come back from the machine)
RESULT_FILES = ("rows.jsonl", "summary.json", "summary.md", ARCHIVE)
SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
MARK = "@@check-part"


# ============================================================================ worker
def _run_part(part: str, ctx: Ctx, stage: Path) -> dict:
    try:
        result = WORKERS[part](ctx)
    except Exception as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}
    (stage / f"{part}.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def _ctx(part: str, dev: torch.device, quick: bool, out: Path) -> Ctx:
    backend = "nccl" if dev.type == "cuda" else "gloo"
    return Ctx(dev, backend, quick, out, part, sanitizer=part == "race_sanitizer")


def _startup_stamps() -> dict[str, float]:
    stamps = {"torch_import_s": _T_TORCH - _T_MAIN}
    spawned = os.environ.get("MATRIXFSDP_CHECK_SPAWNED")
    if spawned:  # the driver's clock at the spawn: the interpreter's own start
        stamps["process_start_s"] = _T_MAIN - float(spawned)
    return stamps


def worker(parts: list[str], dev: torch.device, quick: bool, out: Path, stage: Path) -> int:
    """Run ``parts`` in this process, announcing each on stdout for the driver's clock."""
    _preflight.STARTUP.update(_startup_stamps())
    for part in parts:
        print(f"{MARK} start {part}", flush=True)
        result = _run_part(part, _ctx(part, dev, quick, out), stage)
        print(f"{MARK} end {part} {int(bool(result.get('ok')))}", flush=True)
        if part == "preflight" and not result.get("ok"):
            return 3  # fail fast: the driver skips the rest
    return 0


# ============================================================================ driver
def default_out() -> Path:
    """``$OUT`` when set (the GPU machine's returned folder), else a new folder under ``runs/``,
    which git ignores: results never land in the tracked tree by default."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return ROOT / "runs" / "gpu-check" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


class _Reader(threading.Thread):
    """Copies a worker's output into ``<stage>/<part>.log`` (output before the first marker to the
    first part's log) and puts its markers on a queue."""

    def __init__(self, proc: subprocess.Popen, stage: Path, first: str, events: queue.Queue):
        super().__init__(daemon=True)
        self.proc, self.stage, self.part, self.events = proc, stage, first, events

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                _, what, part, *rest = line.split()
                if what == "start":
                    self.part = part
                self.events.put((what, part, rest, time.monotonic()))
                continue
            with open(self.stage / f"{self.part}.log", "a") as f:
                f.write(line)
        self.events.put(("exit", None, [], time.monotonic()))


class Driver:
    def __init__(self, args: argparse.Namespace, cuda: bool, out: Path, stage: Path):
        self.args, self.cuda, self.out, self.stage = args, cuda, out, stage
        self.mode = "full" if cuda and not args.quick else "quick" if cuda else "dry"
        self.limits = {"full": LIMITS, "quick": QUICK_LIMITS, "dry": DRY_LIMITS}[self.mode]
        self.startup_s = STARTUP_S if cuda else DRY_STARTUP_S
        default_budget = {"full": BUDGET_S, "quick": QUICK_BUDGET_S, "dry": DRY_BUDGET_S}[self.mode]
        self.budget_s = args.budget or default_budget
        self.deadline = _T_MAIN + self.budget_s  # wall clock: counted from before the torch import
        self.results: dict[str, dict] = {}
        self.summary: dict[str, Any] = {
            "cuda": cuda, "mode": self.mode, "torch": torch.__version__, "python": sys.version.split()[0],
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "started": datetime.datetime.fromtimestamp(_T_MAIN).isoformat(timespec="seconds"),
            "budget_s": self.budget_s, "startup_allowance_s": self.startup_s, "limits": self.limits,
            "driver_start_s": round(time.time() - _T_MAIN, 2), "out": str(out), "parts": {}, "table": []}

    # -- bookkeeping
    def limit(self, part: str) -> float:
        return self.limits[part] if self.args.limit.get(part) is None else self.args.limit[part]

    def record(self, part: str, result: dict, status: str, wall: float | None, limit: float | None,
               log: str = "") -> None:
        result.update({"status": status, "wall_s": wall, "limit_s": limit})
        if log and not status.endswith("passed"):
            result["log_tail"] = log[-3000:]
        self.results[part] = result
        (self.stage / f"{part}.json").write_text(json.dumps(result, indent=1, default=str))
        cannot = SHOWS[part][1] + ("" if self.cuda else "; " + NOT_ON_CPU)
        self.summary["parts"][part] = status
        self.summary["table"].append({"part": part, "status": status, "key": str(result.get("key", ""))[:200],
                                      "wall_s": wall, "limit_s": limit, "shows": SHOWS[part][0], "cannot": cannot})
        with open(self.out / "rows.jsonl", "a") as f:
            f.write(json.dumps({"part": part, "kind": "result", "status": status, "wall_s": wall, "limit_s": limit,
                                "key": result.get("key")}, default=str) + "\n")
        at = round(time.time() - _T_MAIN, 1)
        print(f"[{at:6.1f} s] {part}: {status}" + (f" ({wall} s of {limit:.0f} s)" if wall is not None else "")
              + (f": {result.get('key')}" if result.get("key") else ""), flush=True)
        if not (status.endswith("passed") or status.startswith("skipped")):
            tail = result.get("error") or (log or "")[-1500:]
            if tail:
                print(f"    {part} output tail:\n{tail}", flush=True)
        self.write()

    def status(self, result: dict, how: str = "") -> str:
        word = how or ("passed" if result.get("ok") else "FAILED")
        return f"dry-run {word}" if not self.cuda and not word.startswith("skipped") else word

    def write(self) -> None:
        """summary.json, summary.md and the archive, now (a kill later keeps them)."""
        s = self.summary
        s["wall_s"] = round(time.time() - _T_MAIN, 1)
        s["within_budget"] = s["wall_s"] <= s["budget_s"]
        s["not_on_one_gpu"] = NOT_ON_ONE_GPU
        pre = self.results.get("preflight", {})
        s["versions"], s["startup"] = pre.get("versions"), pre.get("startup")
        (self.out / "summary.json").write_text(json.dumps(s, indent=1, default=str))
        (self.out / "summary.md").write_text(
            f"# GPU check ({s['device']}, torch {s['torch']}, {s['mode']})\n\n{table(s['table'])}\n\n"
            f"Wall {s['wall_s']} s of a {s['budget_s']} s budget. Start-up measured by the preflight: "
            f"{s['startup']}. Not shown on one GPU: {NOT_ON_ONE_GPU}\n")
        tmp = self.out / f"{ARCHIVE}.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for name in ("rows.jsonl", "summary.json", "summary.md"):
                if (self.out / name).exists():
                    tar.add(self.out / name, arcname=f"gpu-check/{name}")
            for f in sorted(self.stage.iterdir()):
                tar.add(f, arcname=f"gpu-check/parts/{f.name}")
        os.replace(tmp, self.out / ARCHIVE)

    # -- running
    def run(self, parts: list[str]) -> None:
        skip = "needs CUDA" if not self.cuda else "--quick" if self.args.quick else None
        todo = [p for p in parts if not (p == "race_sanitizer" and skip)]
        self.run_parts(todo)
        if len(todo) < len(parts):
            self.record("race_sanitizer", {"key": ""}, f"skipped: {skip}", None, None)

    def run_parts(self, todo: list[str]) -> None:
        if self.args.inline:
            self.run_inline(todo)
            return
        groups = [[p] for p in todo] if self.args.isolate else [todo]
        for group in groups:
            while group:
                group = self.run_worker(group)
                if "preflight" in self.results and not self.results["preflight"].get("ok"):
                    for p in [q for g in groups for q in g if q not in self.results]:
                        self.record(p, {"key": ""}, "skipped: preflight failed", None, None)
                    return

    def run_inline(self, parts: list[str]) -> None:
        dev = self.device()
        if not self.cuda and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)  # as the worker's OMP_NUM_THREADS=1 (run_worker)
        _preflight.STARTUP.update(_startup_stamps())
        for part in parts:
            t0 = time.monotonic()
            log_path = self.stage / f"{part}.log"
            result = _run_part(part, _ctx(part, dev, self.args.quick, self.out), self.stage)
            wall = round(time.monotonic() - t0, 1)
            limit = self.limit(part) + (self.startup_s if part == parts[0] else 0)
            status = self.status(result)
            if wall > limit:  # inline parts cannot be stopped: over its limit is a failure, noted after
                result["over_limit"] = f"{wall} s > {limit} s"
                status = self.status({}, f"FAILED: over its limit ({wall} s > {limit} s)")
            self.record(part, result, status, wall, limit, log_path.read_text() if log_path.exists() else "")
            if part == "preflight" and not result.get("ok"):
                for p in parts[parts.index(part) + 1:]:
                    self.record(p, {"key": ""}, "skipped: preflight failed", None, None)
                return

    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    def run_worker(self, parts: list[str]) -> list[str]:
        """Start a worker for ``parts``; returns the parts still to run after a timeout or crash."""
        if self.deadline - time.time() < 5:
            for p in parts:
                self.record(p, {"key": ""}, f"skipped: budget spent ({self.budget_s} s)", None, None)
            return []
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(SRC)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                           if p and Path(p).resolve() != SRC])
        env.update(PYTHONUNBUFFERED="1", MATRIXFSDP_CHECK_SPAWNED=repr(time.time()))
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # race's bitwise runs; read when cuBLAS starts
        if not self.cuda:  # the dry run's tiny matrices: one thread (OpenMP's spinning threads on a
            env.setdefault("OMP_NUM_THREADS", "1")  # shared 2-core box made race 6x slower)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", ",".join(parts), "--stage", str(self.stage),
               "--out", str(self.out), "--device", "cuda" if self.cuda else "cpu"] + (["--quick"] if self.args.quick else [])
        # its own session: a timeout kills the worker and whatever it started (compile workers)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True, cwd=str(ROOT))
        events: queue.Queue = queue.Queue()
        reader = _Reader(proc, self.stage, parts[0], events)
        reader.start()
        current, started = None, time.monotonic()
        # the first part's clock starts at the spawn and has the worker's start-up added
        part_deadline = started + self.startup_s + self.limit(parts[0])
        done: list[str] = []
        while True:
            remaining = min(part_deadline - time.monotonic(), self.deadline - time.time())
            try:
                what, part, rest, at = events.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                reader.join(timeout=10)
                if len(done) == len(parts):  # every part reported; the worker hung on its way out
                    self.summary["worker_killed_at_exit"] = True
                    return []
                victim = current or parts[len(done)]
                why = "TIMEOUT (rows kept)" if time.monotonic() >= part_deadline else \
                    f"TIMEOUT: budget spent ({self.budget_s:.0f} s; rows kept)"
                self.record(victim, {"ok": False}, why, round(time.monotonic() - started, 1),
                            self._lim(victim, done), self._log(victim))
                return parts[parts.index(victim) + 1:]
            if what == "start":
                current = part
                if done:  # later parts: their own clock
                    started, part_deadline = at, at + self.limit(part)
            elif what == "end":
                res_file = self.stage / f"{part}.json"
                result = json.loads(res_file.read_text()) if res_file.exists() else {"ok": False}
                self.record(part, result, self.status(result), round(at - started, 1), self._lim(part, done),
                            self._log(part))
                done.append(part)
                current = None
                # until the next start marker: the next part's limit (or, after the last, the
                # worker's exit: NCCL teardown, compile workers)
                part_deadline = time.monotonic() + (self.limit(parts[len(done)]) if len(done) < len(parts) else 60)
            elif what == "exit":
                rc = proc.wait()
                reader.join(timeout=10)
                if current is not None:  # died mid-part
                    self.record(current, {"ok": False, "rc": rc}, f"CRASHED (rc={rc})", round(time.monotonic() - started, 1),
                                self._lim(current, done), self._log(current))
                    return parts[parts.index(current) + 1:]
                left = [p for p in parts if p not in done]
                if left and not (rc == 3 and "preflight" in done):
                    self.record(left[0], {"ok": False, "rc": rc}, f"CRASHED before it started (rc={rc})", None,
                                None, self._log(left[0]))
                    return left[1:]
                return []

    def _lim(self, part: str, done: list[str]) -> float:
        return self.limit(part) + (0 if done else self.startup_s)

    def _log(self, part: str) -> str:
        path = self.stage / f"{part}.log"
        return path.read_text()[-3000:] if path.exists() else ""


def table(rows: list[dict]) -> str:
    head = ["part", "status", "key figure", "wall / limit (s)", "what it shows", "what it cannot show"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        wall = "" if r.get("wall_s") is None else f"{r['wall_s']} / {r['limit_s']:.0f}"
        cells = [r["part"], r["status"], r["key"], wall, r["shows"], r["cannot"]]
        lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def _limit_arg(text: str) -> dict[str, float]:
    out = {}
    for item in filter(None, text.split(",")):
        name, _, sec = item.partition("=")
        if name not in PARTS or not sec:
            raise argparse.ArgumentTypeError(f"--limit: expected part=seconds with a part of {list(PARTS)}, got {item!r}")
        out[name] = float(sec)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default $OUT, else runs/gpu-check/<time>, git-ignored)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated subset of {','.join(PARTS)} (preflight always runs, first)")
    ap.add_argument("--quick", action="store_true", help=f"smaller runs, no sanitizer; budget {QUICK_BUDGET_S} s")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole run, start-up included (default {BUDGET_S}; --quick {QUICK_BUDGET_S}; "
                         "the CPU dry run its own): parts left when it is spent are skipped")
    ap.add_argument("--limit", type=_limit_arg, default={}, help="override part limits: part=seconds,...")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cpu: the dry run of the CUDA path on the CPU (auto: cuda when available)")
    ap.add_argument("--inline", action="store_true", help="run the parts in this process (no limit enforced)")
    ap.add_argument("--isolate", action="store_true", help="one worker process per part")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    cuda = torch.cuda.is_available() and args.device != "cpu"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts (inline, worker)
    out = Path(args.out) if args.out else default_out()
    if args.worker:
        return worker(args.worker.split(","), torch.device("cuda", 0) if cuda else torch.device("cpu"), args.quick,
                      out, Path(args.stage))

    asked = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in asked if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown part(s) {bad}; choose from {list(PARTS)}")
    parts = [p for p in PARTS if p == "preflight" or p in asked]
    out.mkdir(parents=True, exist_ok=True)
    for name in RESULT_FILES:  # this check's own files from an earlier run into the same folder
        (out / name).unlink(missing_ok=True)
    stage = Path(tempfile.mkdtemp(prefix="matrixfsdp-gpu-check-"))
    drv = Driver(args, cuda, out, stage)
    print(f"benchmarks/gpu/check.py: {drv.mode} mode on {drv.summary['device']} (torch {torch.__version__}); "
          f"budget {drv.budget_s:.0f} s; results in {out}", flush=True)
    if not cuda:
        print("no CUDA device (or --device cpu): dry run of the CUDA path on the CPU (gloo, tiny sizes, aot_eager); "
              "what only a GPU shows is reported as not shown.", flush=True)
    try:
        drv.run(parts)
    finally:
        drv.write()
        shutil.rmtree(stage, ignore_errors=True)
    s = drv.summary
    print(table(s["table"]))
    print(f"not shown on one GPU: {NOT_ON_ONE_GPU}")
    print(f"results in {out}: {', '.join(sorted(p.name for p in out.iterdir()))} ({s['wall_s']} s; budget "
          f"{s['budget_s']:.0f} s)")
    bad_parts = [k for k, v in s["parts"].items() if not (v.startswith("skipped: needs") or v.startswith("skipped: --quick")
                                                          or v.endswith("passed"))]
    if not s["within_budget"]:
        print(f"OVER BUDGET: {s['wall_s']} s > {s['budget_s']} s")
    if bad_parts:
        print(f"not passed: {bad_parts}")
    return 1 if bad_parts or not s["within_budget"] else 0


if __name__ == "__main__":
    sys.exit(main())
