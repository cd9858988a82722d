"""Planner quality on the Qwen3 presets: imbalance next to its lower bounds, gamma_B, timing.

    python benchmarks/planner_quality.py [--out benchmarks/results/planner/planner_quality]

Prints one JSON object per row (machine-readable), then a markdown table; with --out, writes
``<out>.jsonl`` and ``<out>.md``. If scipy is installed (``pip install -e .[bench]``), each cell
also gets an *ILP bound*: the optimal makespan of the roles' configuration integer program (roles
grouped by distinct cost, per-block caps dropped), a certified lower bound that shows where the
three-term bound is unreachable by any assignment.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

import _bench_common as bc

from matrixfsdp import plan_owners
from matrixfsdp.models.decoder import PRESETS, Decoder, DecoderLayer
from matrixfsdp.planner.owner_plan import _role_loads, _three_term_bound

WORLDS = (8, 16, 32, 64, 128, 256)
MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")


def ilp_bound(roles: list[float], W: int, upper: float) -> float | None:
    """Smallest makespan an assignment of ``roles`` to W ranks can reach (within 1e-6), by
    bisection over a configuration ILP; None without scipy. Roles below 1e-4 of the largest are
    dropped (keeps configurations few; the result stays a lower bound)."""
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError:
        return None
    big = max(roles)
    counts: dict[float, int] = {}
    for r in roles:
        if r >= 1e-4 * big:
            counts[r] = counts.get(r, 0) + 1
    sizes = sorted(counts, reverse=True)

    def feasible(T: float) -> bool:
        cfgs: list[tuple[int, ...]] = []

        def rec(i: int, cur: list[int], load: float) -> None:
            if i == len(sizes):
                if any(cur):
                    cfgs.append(tuple(cur))
                return
            k = 0
            while load + k * sizes[i] <= T and k <= counts[sizes[i]]:
                rec(i + 1, cur + [k], load + k * sizes[i])
                k += 1

        rec(0, [], 0.0)
        if not cfgs or len(cfgs) > 200_000:
            return not cfgs and False
        A = np.array(cfgs, dtype=float).T
        res = milp(
            np.zeros(len(cfgs)),
            constraints=[
                LinearConstraint(np.ones((1, len(cfgs))), 0, W),
                LinearConstraint(A, [counts[s] for s in sizes], np.inf),
            ],
            integrality=np.ones(len(cfgs)),
            bounds=Bounds(0, W),
        )
        return res.status == 0

    lo = _three_term_bound(sorted(roles, reverse=True), W)
    hi = upper
    if feasible(lo):
        return lo
    for _ in range(30):
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return lo


def timed_plan(model, W, **kw):
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        plan = plan_owners(model, W, block_types=(DecoderLayer,), **kw)
        best = min(best, time.perf_counter() - t)
    return plan, best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Planner quality against lower bounds (and Canzona's partitions).")
    ap.add_argument("--out", default=None, help="write OUT.jsonl (row by row, as they come) and OUT.md; "
                                                "stdout then gets only the markdown summary")
    ap.add_argument("--models", nargs="*", default=list(MODELS), help="presets to plan")
    ap.add_argument("--worlds", nargs="*", type=int, default=list(WORLDS), help="world sizes")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bar on stderr (default: when stderr is a terminal)")
    args = ap.parse_args(argv)
    command = bc.command_line(__file__, argv)
    from tqdm.auto import tqdm

    sink = None
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        sink = open(args.out + ".jsonl", "w")

    def emit(row: dict) -> None:
        if sink is not None:  # as it goes: an interrupted run keeps its finished rows
            sink.write(json.dumps(row) + "\n")
            sink.flush()
        else:
            print(json.dumps(row), flush=True)

    cells = len(args.models) * len(args.worlds) + (4 if "qwen3-32b" in args.models else 0)
    bar = tqdm(total=cells, unit="plan", file=sys.stderr,
               disable=(not sys.stderr.isatty()) if args.progress is None else not args.progress)
    rows = []
    for name in args.models:
        with torch.device("meta"):
            model = Decoder(PRESETS[name])
        for W in args.worlds:
            bar.set_description(f"{name} W={W}")
            plan, secs = timed_plan(model, W)
            roles = list(_role_loads(plan.params, "cost").values())
            total = sum(p.cost for p in plan.params)
            avg = total / W
            even = total - sum(roles)
            three = (_three_term_bound(sorted(roles, reverse=True), W) + even / W) / avg
            ilp = ilp_bound(roles, W, plan.cost_imbalance * avg)
            row = {
                "model": name,
                "world": W,
                "policy": "balanced",
                "cost_imbalance": round(plan.cost_imbalance, 4),
                "bound_three_term": round(three, 4),
                "bound_l2_capacity": round(plan.cost_imbalance_bound, 4),
                "bound_ilp": None if ilp is None else round((ilp + even / W) / avg, 4),
                "bytes_imbalance": round(plan.bytes_imbalance, 4),
                "bytes_bound": round(plan.bytes_imbalance_bound, 4),
                "max_gamma": round(max(b.gamma for b in plan.block_stats), 3),
                "gamma_over_bound": round(plan.max_gamma_ratio, 4),
                "plan_ms": round(secs * 1e3, 1),
            }
            best_bound = max(x for x in (row["bound_three_term"], row["bound_l2_capacity"], row["bound_ilp"]) if x)
            row["cost_over_best_bound"] = round(plan.cost_imbalance / best_bound, 4)
            emit(row)
            rows.append(row)
            bar.update(1)
    # Canzona comparison (Fig. 3c: Qwen3-32B, DP=32, FLOPs 1.43x, memory 1.11x)
    canz = []
    if "qwen3-32b" in args.models:
        with torch.device("meta"):
            model = Decoder(PRESETS["qwen3-32b"])
        for policy in ("naive_static", "alpha_balanced"):
            for bucket in (40_000_000, 500_000_000):
                bar.set_description(f"qwen3-32b W=32 {policy}")
                plan, secs = timed_plan(model, 32, policy=policy, bucket_numel=bucket)
                r = {
                    "model": "qwen3-32b", "world": 32, "policy": policy, "bucket_numel": bucket,
                    "flops_imbalance": round(plan.cost_imbalance, 4),
                    "memory_imbalance": round(plan.state_imbalance, 4),
                    "plan_ms": round(secs * 1e3, 1),
                }
                emit(r)
                canz.append(r)
                bar.update(1)
    bar.close()
    md = render(rows, canz, command)
    print(md)
    if sink is not None:
        sink.close()
        Path(args.out + ".md").write_text(md)
        print(f"wrote {args.out}.jsonl and {args.out}.md", file=sys.stderr)
    return 0


def render(rows, canz, command: str) -> str:
    head = (
        f"<!-- produced by: {command} -->\n"
        f"<!-- {datetime.date.today()} torch {torch.__version__} python {platform.python_version()} -->\n\n"
        "| model | W | cost imb. | 3-term bound | L2/capacity bound | ILP bound | cost / best bound | "
        "bytes imb. (bound) | worst gamma_B / bound | max gamma_B | plan ms |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        ilp = "-" if r["bound_ilp"] is None else f"{r['bound_ilp']:.3f}"
        lines.append(
            f"| {r['model']} | {r['world']} | {r['cost_imbalance']:.3f} | {r['bound_three_term']:.3f} | "
            f"{r['bound_l2_capacity']:.3f} | {ilp} | {r['cost_over_best_bound']:.3f} | "
            f"{r['bytes_imbalance']:.3f} ({r['bytes_bound']:.3f}) | {r['gamma_over_bound']:.3f} | "
            f"{r['max_gamma']:.2f} | {r['plan_ms']:.1f} |"
        )
    out = head + "\n".join(lines) + "\n"
    if canz:
        out += (
            "\nZeRO-1 bucket partitions, Qwen3-32B at DP=32 (Canzona Fig. 3c reports naive 3.24x/2.46x and "
            "alpha-balanced 1.43x FLOPs / 1.11x memory):\n\n"
            "| policy | bucket (elements) | FLOPs imbalance | memory (params+state) imbalance |\n|---|---:|---:|---:|\n"
        )
        for r in canz:
            out += f"| {r['policy']} | {r['bucket_numel']:,} | {r['flops_imbalance']:.3f} | {r['memory_imbalance']:.3f} |\n"
    return out


if __name__ == "__main__":
    sys.exit(main())
