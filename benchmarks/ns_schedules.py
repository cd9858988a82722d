"""Newton-Schulz schedules: time and distance from the exact polar factor, per schedule, dtype, shape.

    python benchmarks/ns_schedules.py [--shapes 512x512,512x1536,1024x4096]
                                      [--schedules quintic,polar_express,cubic5]
                                      [--dtypes float32,bfloat16] [--methods standard,gram]
                                      [--reps 3] [--threads 2] [--wait-quiet 0]
                                      [--out benchmarks/results/optim/ns_schedules_cpu]

One JSON row on stdout per shape, dtype, method and schedule (``--out X``: ``X.jsonl`` and a
markdown report ``X.md`` headed by the command, torch version, CPU model, date and load averages):
one call of Muon's Newton-Schulz (``ns_steps=5``, [Note: Newton-Schulz schedules] in
``src/matrixfsdp/optim/newton_schulz.py``) on a seeded Gaussian matrix,

* ``ms`` / ``cpu_ms``: the minimum wall / process CPU time over ``--reps`` calls (after one warm-up
  call each; the schedules of a shape, dtype and method interleaved, so load hits them alike) -- a
  shared machine inflates wall times, the minimum least; with ``--threads 1`` the CPU time is the
  work alone; ``vs_quintic`` / ``cpu_vs_quintic``: over the quintic's (same shape, dtype, method);
* ``products``: matrix products dispatched (standard: 3 per quintic step, 2 per cubic one; Gram: see
  [Note: Gram Newton-Schulz]);
* ``foreign_cpu``: the share of the machine's CPU time other processes used while that block ran;
* ``dist_polar``: ``||O - U V^T||_F / ||U V^T||_F``, ``U V^T`` the exact polar factor (float64 SVD);
* ``dist_map``: the same distance from the schedule's own map in float64 (``U p(S) V^T``): the
  rounding of the dtype and method alone;
* ``sv_min``/``sv_max``: extreme singular values of ``O`` (1 for the exact polar factor).

A Gaussian matrix's singular values lie within a factor of about ``(1 + sqrt(m/n)) / (1 - sqrt(m/n))``
of each other (a square one's reach 0); a momentum's spectrum decays faster, where every schedule
leaves its smallest singular values further from 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import _bench_common as bc  # noqa: E402

try:
    import matrixfsdp  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(HERE, "..", "src"))
from matrixfsdp.optim.newton_schulz import (  # noqa: E402
    SCHEDULE_NAMES,
    gram_newtonschulz,
    resolve_schedule,
    zeropower_via_newtonschulz,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
METHODS: dict[str, Callable[..., torch.Tensor]] = {"standard": zeropower_via_newtonschulz, "gram": gram_newtonschulz}
STEPS, EPS = 5, 1e-7


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        rows, sep, cols = item.lower().partition("x")
        if not sep:
            raise argparse.ArgumentTypeError(f"ns_schedules: a shape is ROWSxCOLS, got {item!r}")
        out.append((int(rows), int(cols)))
    return out


def parse_list(allowed: Any, what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"ns_schedules: {what} takes {sorted(allowed)}, got {bad}")
        return items
    return parse


class CountProducts(TorchDispatchMode):
    """Matrix products dispatched (mm, addmm, bmm, baddbmm)."""

    OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in self.OPS
        return func(*args, **(kwargs or {}))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def shape_rows(shape: tuple[int, int], schedules: list[str], dtypes: list[str], methods: list[str],
               reps: int, wait_quiet_s: float) -> list[dict[str, Any]]:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    polar = u @ vh
    norm = float(s.norm())
    rows = []
    for method in methods:
        if method == "gram" and shape[0] == shape[1]:
            continue  # a square matrix takes the standard iteration
        for dtype in dtypes:
            fns = {name: (lambda name=name: METHODS[method](x, name, STEPS, EPS, DTYPES[dtype])) for name in schedules}
            outs, products = {}, {}
            for name, fn in fns.items():  # warm-up: the output measured, its products counted
                with CountProducts() as counter:
                    outs[name] = fn()
                products[name] = counter.count
            if wait_quiet_s > 0:
                bc.wait_quiet(wait_quiet_s)
            machine0, ours0 = bc.machine_cpu_ticks(), bc.proc_cpu_ticks()
            times: dict[str, list[float]] = {name: [] for name in fns}
            cpu: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(reps):
                for name, fn in fns.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
            foreign = bc.foreign_cpu_share(machine0, bc.machine_cpu_ticks(), bc.proc_cpu_ticks() - ours0)
            for name in schedules:
                schedule = resolve_schedule(name, STEPS)
                sv = s / (norm * schedule.norm_scale)
                for a, b, c in schedule.coefficients:
                    sv = a * sv + b * sv**3 + c * sv**5
                exact_map = (u * sv) @ vh
                out_sv = torch.linalg.svdvals(outs[name].double())
                row = {"shape": f"{shape[0]}x{shape[1]}", "dtype": dtype, "method": method, "schedule": name,
                       "products": products[name], "ms": min(times[name]) * 1e3, "cpu_ms": min(cpu[name]) * 1e3,
                       "vs_quintic": min(times[name]) / min(times["quintic"]) if "quintic" in times else None,
                       "cpu_vs_quintic": min(cpu[name]) / min(cpu["quintic"]) if "quintic" in cpu else None,
                       "dist_polar": rel(outs[name], polar), "dist_map": rel(outs[name], exact_map),
                       "sv_min": float(out_sv.min()), "sv_max": float(out_sv.max()),
                       "foreign_cpu": None if foreign is None else round(foreign, 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def report(rows: list[dict[str, Any]], header: list[str]) -> str:
    out = header + ["", "| shape | dtype | method | schedule | products | CPU ms (min) | CPU vs quintic | "
                    "wall ms (min) | wall vs quintic | dist from U V^T | dist from its f64 map | singular values | "
                    "other load |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}"

    for r in rows:
        out.append(f"| {r['shape']} | {r['dtype']} | {r['method']} | {r['schedule']} | {r['products']} | "
                   f"{r['cpu_ms']:.1f} | {ratio(r['cpu_vs_quintic'])} | {r['ms']:.1f} | {ratio(r['vs_quintic'])} | "
                   f"{r['dist_polar']:.4f} | {r['dist_map']:.2e} | {r['sv_min']:.3f}-{r['sv_max']:.3f} | "
                   f"{'n/a' if r['foreign_cpu'] is None else format(r['foreign_cpu'], '.0%')} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shapes, default=parse_shapes("512x512,512x1536,1024x4096"))
    ap.add_argument("--schedules", type=parse_list(SCHEDULE_NAMES, "--schedules"), default=list(SCHEDULE_NAMES))
    ap.add_argument("--dtypes", type=parse_list(DTYPES, "--dtypes"), default=list(DTYPES))
    ap.add_argument("--methods", type=parse_list(METHODS, "--methods"), default=["standard"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="before timing each shape/method/dtype, wait up to this many seconds for a quiet machine")
    ap.add_argument("--out", default=None, help="write OUT.jsonl and OUT.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = {**bc.env_info(), "cpu": bc.cpu_model(), "threads": args.threads, "load_before": os.getloadavg()}
    print(json.dumps({"kind": "env", **env}), flush=True)
    t0 = time.perf_counter()
    rows = [r for shape in args.shapes
            for r in shape_rows(shape, args.schedules, args.dtypes, args.methods, args.reps, args.wait_quiet)]
    env["load_after"], env["wall_s"] = os.getloadavg(), round(time.perf_counter() - t0, 1)
    print(json.dumps({"kind": "done", "load_after": env["load_after"], "wall_s": env["wall_s"]}), flush=True)
    if args.out:
        load = lambda v: ", ".join(f"{x:.2f}" for x in v)  # noqa: E731
        header = ["# Newton-Schulz schedules (CPU)", "",
                  f"- command: `{bc.command_line(__file__, argv)}`",
                  f"- torch {env['torch']}, CPU {env['cpu']} ({os.cpu_count()} cores, {args.threads} threads), "
                  f"git {env.get('git')}, date {datetime.date.today().isoformat()}",
                  f"- load average (1, 5, 15 min) before: {load(env['load_before'])}; after: "
                  f"{load(env['load_after'])}; shared machine; {env['wall_s']} s in all",
                  f"- one call, ns_steps={STEPS}, seeded Gaussian input; times: min of {args.reps} interleaved "
                  "calls after a warm-up, as this process's CPU time (with one thread: the work itself, "
                  "least touched by other processes) and as wall time; distances relative Frobenius, against the float64 SVD; products: "
                  "matrix products dispatched; other load: the share of the machine's CPU time used by other "
                  "processes while the row's block was timed"]
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".jsonl", "w") as f:
            f.write(json.dumps({"kind": "env", **env}) + "\n")
            for row in rows:
                f.write(json.dumps(row) + "\n")
        with open(args.out + ".md", "w") as f:
            f.write(report(rows, header))


if __name__ == "__main__":
    main()
