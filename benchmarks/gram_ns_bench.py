"""Gram against standard Newton-Schulz, float32 against bfloat16, batched against per-matrix Muon.

    python benchmarks/gram_ns_bench.py [--shapes 1024x1024,1024x3072,4096x1024,2048x6144]
                                       [--dtypes float32,bfloat16] [--reps 3] [--threads 2]
                                       [--step-shapes 1024x1024,1024x3072] [--step-count 8]
                                       [--out benchmarks/results/optim/gram_ns_cpu]

Three measurements, each a JSON row on stdout (``--out X``: ``X.jsonl`` and a markdown report
``X.md`` headed by the command, torch version, CPU model, its AMX / avx512_bf16 flags and the date):

* ``kind="ns"``, per shape and dtype: one Newton-Schulz call (Muon's 5 quintic steps,
  ``ns_coefficients=(3.4445, -4.775, 2.0315)``) on a Gaussian matrix, ``method="standard"``
  (``matrixfsdp.optim._muon.zeropower_via_newtonschulz``) and ``method="gram"``
  (``gram_newtonschulz``, [Note: Gram Newton-Schulz]): median seconds of ``--reps`` calls, the two
  methods interleaved after a warm-up call each; ``time_vs_standard`` (the Gram row's time over
  the standard row's, same run) and ``time_vs_fp32`` (a row's time over the float32 row's of its
  method, same run: issue 29's "bf16 is faster on AMX" check); ``dist_polar``: the relative
  Frobenius distance ``|O - U V^T| / |U V^T|`` from the exact polar factor (float64 SVD), and
  ``dist_f64``: from the standard iteration run in float64 (the polynomial both evaluate).
* ``kind="step"``: one ``Muon`` step on ``--step-count`` matrices of each ``--step-shapes`` shape
  (float32 parameters; Newton-Schulz in each dtype), ``batched=False`` (the per-matrix default),
  ``batched=True`` (chunks of ``NS_CHUNK_BYTES_CPU``) and ``batched=True`` with one unbounded
  chunk per shape (the whole stack in one ``bmm``, as before issue 29): median seconds, ratios to
  the per-matrix step (issue 29 item 5: should ``batched`` become a default).

* ``kind="restart"`` (``--restart-shapes``, e.g. ``512x1536,256x1280,1536x512``; none by default):
  how far Gram Newton-Schulz in bfloat16 lands from the standard bfloat16 iteration with no
  restart and with one restart before each iteration 1..4, on matrices with singular values
  spread log-uniformly from 1 to 1e-3 (the choice behind ``GRAM_RESTARTS``).

The distances use a seeded Gaussian input; a momentum's spectrum decays faster, where Muon's five
steps leave small singular values further from 1 (both methods alike in float32).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402

import _bench_common as bc  # noqa: E402

try:
    import matrixfsdp  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(HERE, "..", "src"))
from matrixfsdp.optim import Muon  # noqa: E402
from matrixfsdp.optim import _expert_step  # noqa: E402
from matrixfsdp.optim._muon import gram_newtonschulz, zeropower_via_newtonschulz  # noqa: E402

NS = (3.4445, -4.775, 2.0315)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for item in filter(None, (t.strip() for t in text.split(","))):  # "" is no shape
        rows, sep, cols = item.strip().lower().partition("x")
        if not sep:
            raise argparse.ArgumentTypeError(f"gram_ns_bench: a shape is ROWSxCOLS, got {item!r}")
        out.append((int(rows), int(cols)))
    return out


def cpu_flags() -> list[str]:
    """The CPU's AMX and avx512_bf16 flags (what decides whether bf16 matmul is fast)."""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("flags"):
                    return sorted({fl for fl in ln.split() if fl.startswith("amx") or fl == "avx512_bf16"})
    except OSError:
        pass
    return []


def interleaved(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median seconds of each function, run round-robin ``reps`` times after one warm-up each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def ns_rows(shape: tuple[int, int], dtypes: list[str], reps: int) -> list[dict[str, Any]]:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    polar = u @ vh
    exact = zeropower_via_newtonschulz(x.double(), NS, 5, 1e-7, torch.float64)
    rows, fp32_time = [], {}
    for name in dtypes:
        dt = DTYPES[name]
        fns = {"standard": lambda: zeropower_via_newtonschulz(x, NS, 5, 1e-7, dt),
               "gram": lambda: gram_newtonschulz(x, NS, 5, 1e-7, dt)}
        med = interleaved(fns, reps)
        for method, fn in fns.items():
            out = fn()
            row = {"kind": "ns", "shape": f"{shape[0]}x{shape[1]}", "dtype": name, "method": method,
                   "seconds": med[method], "time_vs_standard": med[method] / med["standard"],
                   "dist_polar": rel(out, polar), "dist_f64": rel(out, exact)}
            if name == "float32":
                fp32_time[method] = med[method]
            if method in fp32_time:
                row["time_vs_fp32"] = med[method] / fp32_time[method]
            rows.append(row)
    return rows


def step_rows(shapes: list[tuple[int, int]], count: int, dtypes: list[str], reps: int) -> list[dict[str, Any]]:
    rows = []
    for name in dtypes:
        g = torch.Generator().manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes for _ in range(count)]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opts = {mode: Muon(params, lr=1e-9, ns_dtype=DTYPES[name], batched=mode != "loop")  # lr ~0: params stay
                for mode in ("loop", "batched", "batched_one_stack")}
        saved = _expert_step.NS_CHUNK_BYTES_CPU

        def step(mode: str) -> Callable[[], None]:
            def run() -> None:
                _expert_step.NS_CHUNK_BYTES_CPU = 2**62 if mode == "batched_one_stack" else saved
                try:
                    opts[mode].step()
                finally:
                    _expert_step.NS_CHUNK_BYTES_CPU = saved
            return run

        med = interleaved({mode: step(mode) for mode in opts}, reps)
        for mode in opts:
            rows.append({"kind": "step", "shapes": ",".join(f"{r}x{c}" for r, c in shapes), "count": count,
                         "dtype": name, "mode": mode, "seconds": med[mode], "time_vs_loop": med[mode] / med["loop"]})
    return rows


def restart_rows(shape: tuple[int, int]) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    u, _, vh = torch.linalg.svd(torch.randn(shape, generator=g, dtype=torch.float64), full_matrices=False)
    x = ((u * torch.logspace(0, -3, u.shape[1], dtype=torch.float64)) @ vh).float()
    standard = zeropower_via_newtonschulz(x, NS, 5, 1e-7, torch.bfloat16).double()
    rows = []
    for restarts in [(), (1,), (2,), (3,), (4,)]:
        out = gram_newtonschulz(x, NS, 5, 1e-7, torch.bfloat16, restarts=restarts)
        rows.append({"kind": "restart", "shape": f"{shape[0]}x{shape[1]}", "dtype": "bfloat16",
                     "restarts": list(restarts), "dist_standard": rel(out, standard)})
    return rows


def report(rows: list[dict[str, Any]], header: list[str]) -> str:
    out = header + ["", "## Newton-Schulz (5 steps): standard against Gram", "",
                    "| shape | dtype | method | ms | vs standard | vs fp32 | dist from U V^T | dist from f64 iteration |",
                    "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "ns":
            vs32 = f"{r['time_vs_fp32']:.2f}" if "time_vs_fp32" in r else ""
            out.append(f"| {r['shape']} | {r['dtype']} | {r['method']} | {r['seconds'] * 1e3:.1f} | "
                       f"{r['time_vs_standard']:.2f} | {vs32} | {r['dist_polar']:.4f} | {r['dist_f64']:.2e} |")
    out += ["", "## Muon step: per-matrix against batched", "",
            "| matrices | ns dtype | mode | ms | vs per-matrix |", "|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "step":
            out.append(f"| {r['count']} x ({r['shapes']}) | {r['dtype']} | {r['mode']} | {r['seconds'] * 1e3:.1f} | "
                       f"{r['time_vs_loop']:.2f} |")
    restart = [r for r in rows if r["kind"] == "restart"]
    if restart:
        out += ["", "## Gram restarts (bfloat16, singular values 1 to 1e-3): distance from the standard bf16 iteration",
                "", "| shape | restart before iteration | distance |", "|---|---|---|"]
        out += [f"| {r['shape']} | {r['restarts'] or 'none'} | {r['dist_standard']:.3f} |" for r in restart]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1024x1024,1024x3072,4096x1024,2048x6144"))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--step-shapes", type=parse_shapes, default=parse_shapes("1024x1024,1024x3072"))
    ap.add_argument("--step-count", type=int, default=8, help="matrices of each step shape (0: no step rows)")
    ap.add_argument("--restart-shapes", type=parse_shapes, default=[], help="shapes of the restart sweep (default none)")
    ap.add_argument("--out", default=None, help="write OUT.jsonl and OUT.md")
    args = ap.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"gram_ns_bench: --dtypes takes {sorted(DTYPES)}, got {d!r}")
    torch.set_num_threads(args.threads)
    env = {**bc.env_info(), "cpu": bc.cpu_model(), "cpu_flags": cpu_flags(), "threads": args.threads}
    header = ["# Gram Newton-Schulz, fp32 vs bf16, batched Muon (CPU)", "",
              f"- command: `{bc.command_line(__file__, argv)}`",
              f"- torch {env['torch']}, CPU {env['cpu']} ({os.cpu_count()} cores, {args.threads} threads; "
              f"flags: {' '.join(env['cpu_flags']) or 'no AMX/avx512_bf16'}), git {env.get('git')}, "
              f"date {datetime.date.today().isoformat()}",
              f"- medians of {args.reps} interleaved runs after one warm-up each; shared machine"]
    rows: list[dict[str, Any]] = []
    print(json.dumps({"kind": "env", **env}), flush=True)
    for shape in args.restart_shapes:
        for row in restart_rows(shape):
            rows.append(row)
            print(json.dumps(row), flush=True)
    for shape in args.shapes:
        for row in ns_rows(shape, dtypes, args.reps):
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.step_count:
        for row in step_rows(args.step_shapes, args.step_count, dtypes, args.reps):
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".jsonl", "w") as f:
            f.write(json.dumps({"kind": "env", **env}) + "\n")
            for row in rows:
                f.write(json.dumps(row) + "\n")
        with open(args.out + ".md", "w") as f:
            f.write(report(rows, header))


if __name__ == "__main__":
    main()
