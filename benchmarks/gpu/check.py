"""The prepared one-GPU check (issues 19 and 29): one command, one CUDA GPU, at most 6 minutes.

    python benchmarks/gpu/check.py                 # all parts, part limits summing to 6 minutes
    python benchmarks/gpu/check.py --quick         # the same parts, smaller, limits summing to 3 minutes
    python benchmarks/gpu/check.py --device cpu --quick --inline   # the dry run CI runs (no GPU)

Results go to ``--out`` (default ``$OUT/gpu`` when ``$OUT`` is set, else
``benchmarks/results/gpu/<date>``): ``rows.jsonl`` gets every row as it is produced (appended and
flushed, so a part killed at its time limit keeps what it measured), ``<part>.json`` each part's
result, ``summary.json`` and ``summary.md`` the table printed at the end (part, status, key figure,
what it shows, what it cannot show). Each part runs in its own subprocess with its own process
group at W=1 and its own time limit (``--inline``: in this process, the limit checked afterwards).

At W=1 every collective of the engine short-cuts (a sum over one rank is its input), so without
help no NCCL call would run. The parts that exercise the engine run inside
``matrixfsdp.comm.collectives.force_collectives()``, a scoped test hook with which a one-rank group
still calls NCCL on the gather and reduce streams, with the short-cut's results bit for bit.

This file is the entry point: the command line, the part limits and the summary table's texts,
and the driver (``main``, the inline and subprocess runners, the table). The parts live in
``check_parts/`` (beside this file), one module each, whose docstrings say what they run and
check; what they share (the W=1 group, the tiny decoder, ``Ctx``) is ``check_parts/core.py``:

1. ``race`` (``check_parts/race.py``): stream ordering of copy-in/gather/reduce against compute,
   side streams delayed against not (bitwise), with the hook against without; again under
   ``TORCH_CUDA_SANITIZER=1`` (full mode).
2. ``smoke`` (``check_parts/smoke.py``): every API that touches collectives under ``"nccl"`` and
   ``"cpu:gloo,cuda:nccl"``; the (1,1) HSDP and TP meshes.
3. ``sync_debug`` (``check_parts/sync_debug.py``): host syncs per phase against declared
   expectations (torch's sync debug mode and the project's flag reads).
4. ``kernels`` (``check_parts/kernels.py``): batched bf16 Newton-Schulz TFLOP/s and % of dense
   peak on Qwen3 shapes, compiled variants, ``eigh``/``qr`` timings.
5. ``memory`` (``check_parts/memory.py``): peak allocated against stock FSDP2 at equal settings.
6. ``compile`` (``check_parts/graphs.py``): the capturable Muon step compiled and replayed as a
   CUDA graph, against eager.

Without CUDA (or with ``--device cpu``) the parts run their CUDA path on the CPU where they can
(gloo, tiny sizes, ``aot_eager`` for compiles): a dry run whose statuses say ``dry-run``; what only
a GPU shows is listed as not shown. ``tests/bench/test_gpu_check.py`` runs it in CI.
One GPU cannot show: cross-rank collective order, HSDP's replica phase and exchange, TP host steps,
bandwidth and overlap; ``benchmarks/gpu/nccl_sweep.py`` covers parity at W=2..8 under torchrun.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

# the parts' package sits beside this file: already on sys.path when run as a script, added when
# this file is imported as a module (tests)
HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from check_parts.core import Ctx  # noqa: E402
from check_parts.graphs import part_compile  # noqa: E402
from check_parts.kernels import part_kernels  # noqa: E402
from check_parts.memory import MEM_FACTOR, MEM_SLACK, part_memory  # noqa: E402
from check_parts.race import part_race  # noqa: E402
from check_parts.smoke import part_smoke  # noqa: E402
from check_parts.sync_debug import part_sync_debug  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("race", "smoke", "sync_debug", "kernels", "memory", "compile")
#: seconds per part; each mode's limits sum to at most its budget (6 and 3 minutes)
LIMITS = {"race": 50, "race_sanitizer": 35, "smoke": 60, "sync_debug": 35, "kernels": 70, "memory": 40,
          "compile": 70}
QUICK_LIMITS = {"race": 25, "race_sanitizer": 0, "smoke": 40, "sync_debug": 20, "kernels": 30, "memory": 20,
                "compile": 45}
#: smoke runs under two backends: the first (all checks) gets this share of its limit, the
#: second (the collectives' checks only) the rest
SMOKE_SHARE = 0.6
BUDGET_S, QUICK_BUDGET_S = 360, 180
if sum(LIMITS.values()) > BUDGET_S or sum(QUICK_LIMITS.values()) > QUICK_BUDGET_S:
    raise ValueError(f"check.py: part limits sum to {sum(LIMITS.values())} s (budget {BUDGET_S}) and "
                     f"{sum(QUICK_LIMITS.values())} s in --quick (budget {QUICK_BUDGET_S})")

#: what each part shows, and what it cannot show on one GPU (the summary table)
SHOWS = {
    "race": ("stream ordering of copy-in/gather/reduce vs compute under delayed side streams, NCCL "
             "called on them (W=1 hook), training parity vs unsharded",
             "cross-rank order; peers' chunks (W=1 gathers receive nothing); HSDP/TP phases"),
    "race-sanitizer": ("the same run under torch's CUDA sanitizer (unsynchronized stream accesses)",
                       "as race"),
    "smoke": ("every collectives-using API runs under nccl and cpu:gloo,cuda:nccl with the hook",
              "HSDP replica phase and exchange, TP host step: (1,1) meshes run but skip them "
              "(not shown on one GPU)"),
    "sync_debug": ("host syncs per phase incl. the project's flag read; find_unused=False has none; "
                   "eigh's error-flag reads are the only step syncs of Shampoo/SOAP",
                   "syncs only W>1 paths make (replica phase, TP host step)"),
    "kernels": ("batched bf16 Newton-Schulz TFLOP/s and % of dense peak on Qwen3 shapes; each "
                "compiled variant really compiled", "multi-GPU effects (owner imbalance, overlap)"),
    "memory": ("peak allocated vs FSDP2 at equal settings (bf16 compute, W=1), threshold "
               f"{MEM_FACTOR:.2f}x + {MEM_SLACK >> 20} MiB", "savings that need W>1 (sharded state)"),
    "compile": ("capturable batched Muon, device lr, LambdaLR: compiled and CUDA-graph-replayed "
                "steps equal eager; frames compiled", "compiled steps with W>1 collectives"),
}
NOT_ON_CPU = "on the CPU: no streams, NCCL, CUDA syncs, CUDA memory or CUDA graphs (dry run)"


WORKERS: dict[str, Callable[[Ctx], dict]] = {
    "race": part_race, "smoke": part_smoke, "sync_debug": part_sync_debug, "kernels": part_kernels,
    "memory": part_memory, "compile": part_compile,
}


# ============================================================================ driver
def _default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu"
    return ROOT / "benchmarks" / "results" / "gpu" / datetime.date.today().isoformat()


def _run_inline(part: str, ctx: Ctx, tag: str) -> tuple[dict, int]:
    try:
        result = WORKERS[part](ctx)
    except Exception as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    (ctx.out / f"{tag}.json").write_text(json.dumps(result, indent=1, default=str))
    return result, 0 if result.get("ok") else 1


def _run_subprocess(part: str, args: argparse.Namespace, out: Path, tag: str, backend: str, limit: int,
                    env: dict | None = None) -> tuple[dict, int, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", part, "--backend", backend,
           "--out", str(out), "--tag", tag, "--device", args.device] + (["--quick"] if args.quick else [])
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), e.get("PYTHONPATH", "")])
    e.update(env or {})
    # its own session: a timeout kills the worker and whatever it started (compile workers)
    proc = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=limit)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        rc = 124
    res_file = out / f"{tag}.json"
    result = json.loads(res_file.read_text()) if res_file.exists() and rc != 124 else {"ok": False}
    return result, rc, (log or "")[-3000:]


def _status(result: dict, rc: int, dry: bool) -> str:
    if rc == 124:
        return "TIMEOUT (rows kept)"
    if rc != 0 and result.get("ok"):
        return f"FAILED (rc={rc})"
    word = "passed" if result.get("ok") else "FAILED"
    return f"dry-run {word}" if dry else word


def _table(rows: list[dict]) -> str:
    head = ["part", "status", "key figure", "what it shows", "what it cannot show"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[k]).replace("|", "/") for k in ("part", "status", "key", "shows", "cannot"))
                     + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default $OUT/gpu, else benchmarks/results/gpu/<date>)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--quick", action="store_true", help=f"smaller runs, part limits summing to {QUICK_BUDGET_S} s")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cpu: the dry run of the CUDA path on the CPU (auto: cuda when available)")
    ap.add_argument("--inline", action="store_true", help="run the parts in this process (the CPU dry run)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tag", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else _default_out()
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    cuda = torch.cuda.is_available() and args.device != "cpu"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")

    if args.worker:  # one part in this process
        ctx = Ctx(dev, args.backend, args.quick, out, args.tag)
        return _run_inline(args.worker, ctx, args.tag)[1]

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown part(s) {bad}; choose from {list(PARTS)}")
    if args.inline and str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))  # this tree's matrixfsdp, as the workers get it
    limits = QUICK_LIMITS if args.quick else LIMITS
    if not cuda:
        print("benchmarks/gpu/check.py: no CUDA device (or --device cpu): dry run of the CUDA path on the CPU "
              "(gloo, tiny sizes, aot_eager); what only a GPU shows is reported as not shown.")
    summary: dict[str, Any] = {"cuda": cuda, "quick": args.quick, "torch": torch.__version__,
                               "started": datetime.datetime.now().isoformat(timespec="seconds"),
                               "device": torch.cuda.get_device_name(0) if cuda else "cpu", "budget_s":
                               QUICK_BUDGET_S if args.quick else BUDGET_S, "limits": limits, "parts": {}, "table": []}
    t_all = time.monotonic()
    for part in parts:
        backends = (["nccl", "cpu:gloo,cuda:nccl"] if part == "smoke" else ["nccl"]) if cuda else ["gloo"]
        runs = [(b, part if len(backends) == 1 else f"{part}-{b.replace(':', '_').replace(',', '+')}", {}, limits[part])
                for b in backends]
        if part == "race" and cuda:
            if limits["race_sanitizer"]:
                runs.append(("nccl", "race-sanitizer", {"TORCH_CUDA_SANITIZER": "1", "MATRIXFSDP_CHECK_STEPS": "3"},
                             limits["race_sanitizer"]))
            else:
                summary["parts"]["race-sanitizer"] = "skipped: --quick"
                summary["table"].append({"part": "race-sanitizer", "status": "skipped: --quick", "key": "",
                                         "shows": SHOWS["race-sanitizer"][0], "cannot": SHOWS["race-sanitizer"][1]})
        for backend, tag, env, limit in runs:
            if len(backends) > 1:  # the part's limit is shared by its backends
                limit = int(limit * SMOKE_SHARE) if backend == backends[0] else limit - int(limit * SMOKE_SHARE)
            t0 = time.monotonic()
            if args.inline:
                ctx = Ctx(dev, backend, args.quick, out, tag)
                result, rc = _run_inline(part, ctx, tag)
                log = ""
            else:
                result, rc, log = _run_subprocess(part, args, out, tag, backend, limit, env)
            wall = round(time.monotonic() - t0, 1)
            if args.inline and wall > limit:  # inline parts cannot be stopped; noted, the budget decides
                result["over_limit"] = f"{wall} s > {limit} s"
            result.update({"rc": rc, "wall_s": wall, "limit_s": limit, "backend": backend})
            if log and (rc != 0 or not result.get("ok")):
                result["log_tail"] = log
            (out / f"{tag}.json").write_text(json.dumps(result, indent=1, default=str))
            status = _status(result, rc, not cuda)
            if result.get("over_limit"):
                status += f" (over its own limit: {result['over_limit']})"
            summary["parts"][tag] = status
            base = "race-sanitizer" if tag == "race-sanitizer" else part
            cannot = SHOWS[base][1] + ("" if cuda else "; " + NOT_ON_CPU)
            summary["table"].append({"part": tag, "status": status, "key": str(result.get("key", ""))[:160],
                                     "shows": SHOWS[base][0], "cannot": cannot, "wall_s": wall})
            with open(out / "rows.jsonl", "a") as f:
                f.write(json.dumps({"part": tag, "kind": "result", "status": status, "wall_s": wall,
                                    "key": result.get("key")}, default=str) + "\n")
    summary["wall_s"] = round(time.monotonic() - t_all, 1)
    # the inline (dry) run's test of time: the whole run inside the mode's budget (per part, CPU
    # timings say little about a GPU's)
    summary["within_budget"] = summary["wall_s"] <= summary["budget_s"]
    summary["not_on_one_gpu"] = ("cross-rank collective order, HSDP's replica phase and exchange, TP host steps, "
                                 "bandwidth and overlap at W>1: benchmarks/gpu/nccl_sweep.py under torchrun")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    table = _table(summary["table"])
    (out / "summary.md").write_text(f"# GPU check ({summary['device']}, torch {summary['torch']}, "
                                    f"{'quick' if args.quick else 'full'})\n\n{table}\n\nNot shown on one GPU: "
                                    f"{summary['not_on_one_gpu']}\n")
    print(table)
    print(f"not shown on one GPU: {summary['not_on_one_gpu']}")
    print(f"results in {out} ({summary['wall_s']} s; budget {summary['budget_s']} s)")
    bad_parts = [k for k, v in summary["parts"].items() if not (v.startswith("skipped") or "passed" in v)]
    if not summary["within_budget"]:
        print(f"OVER BUDGET: {summary['wall_s']} s > {summary['budget_s']} s")
    return 1 if bad_parts or not summary["within_budget"] else 0


if __name__ == "__main__":
    sys.exit(main())
