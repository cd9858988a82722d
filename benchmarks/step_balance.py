"""matrixfsdp's optimizer step against its balance limit, and the planner's cost model against time.

    python benchmarks/step_balance.py [--out benchmarks/results/step_balance]

The optimizer step under matrixfsdp is purely local, so each rank's step can be timed in one
process: for the step benchmark's model (``step_bench.py`` defaults) and the plan its matrixfsdp
slot uses, this times every parameter's Muon/AdamW update in isolation (one thread, fp32
Newton-Schulz, median of 7 after 2 warm-ups), sums them per rank, and reports:

* the *balance limit*: the largest per-rank local optimizer compute (what no schedule of these
  owners can beat), next to perfect balance (total / W);
* the measured imbalance (max/avg of the timed per-rank sums) next to the planner's predicted
  cost imbalance (FLOP model) -- the cost model's calibration on this CPU;
* the distributed step time measured by ``step_bench.py`` (``benchmarks/results/step_cpu_w{W}.jsonl``,
  clean repeats) divided by the balance limit. At W=2 each rank has a core of its own; at W=4
  four ranks share two cores, so the distributed time is compared with twice the limit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import matrixfsdp
from matrixfsdp import Decoder, DecoderConfig, DecoderLayer

CFG = DecoderConfig(vocab_size=2048, hidden_size=320, intermediate_size=896, num_hidden_layers=6,
                    num_attention_heads=5, num_key_value_heads=1, head_dim=64)
HP = dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype=torch.float32,
          adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_weight_decay=0.0)
RESULTS = Path(__file__).parent / "results"


def time_update(shape: tuple[int, ...], matrix: bool, reps: int = 7) -> float:
    p = torch.nn.Parameter(torch.randn(shape) * 0.02)
    opt = matrixfsdp.optim.Muon([dict(params=[p], algorithm="muon" if matrix else "adamw")], **HP)
    g = torch.randn(shape) * 1e-3
    ts = []
    for i in range(reps + 2):
        p.grad = g.clone()
        t = time.perf_counter()
        opt.step()
        if i >= 2:
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measured_step(W: int) -> float | None:
    path = RESULTS / f"step_cpu_w{W}.jsonl"
    if not path.exists():
        return None
    xs = [json.loads(l) for l in path.read_text().splitlines()]
    xs = [x["step_s"] for x in xs if x.get("impl") == "matrixfsdp" and x.get("status") == "ok"
          and (x.get("foreign_cpu_share") or 0) <= 0.15]
    return statistics.median(xs) if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = Decoder(CFG)
    cache: dict[tuple, float] = {}
    rows = []
    for W in (2, 4):
        plan = matrixfsdp.plan_owners(model, W, block_types=(DecoderLayer,))
        per_rank = [0.0] * W
        for pp in plan.params:
            matrix = pp.placement == "matrix"
            for r in range(W):
                shape = pp.local_shape(r, W)
                if not shape or 0 in shape:
                    continue
                key = (shape, matrix)
                if key not in cache:
                    cache[key] = time_update(shape, matrix)
                per_rank[r] += cache[key]
        limit = max(per_rank)
        avg = sum(per_rank) / W
        dist = measured_step(W)
        share = 1 if W <= 2 else W / 2  # ranks per core in the distributed run
        row = {
            "world": W,
            "per_rank_local_step_s": [round(x, 4) for x in per_rank],
            "balance_limit_s": round(limit, 4),
            "perfect_balance_s": round(avg, 4),
            "measured_time_imbalance": round(limit / avg, 4),
            "planner_cost_imbalance": round(plan.cost_imbalance, 4),
            "distributed_step_s": None if dist is None else round(dist, 4),
            "distributed_over_limit": None if dist is None else round(dist / (limit * share), 3),
            "ranks_per_core": share,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    md = [
        "<!-- produced by: python benchmarks/step_balance.py --out benchmarks/results/step_balance -->",
        f"<!-- {datetime.date.today()} torch {torch.__version__} python {platform.python_version()} -->",
        "",
        "matrixfsdp's Muon step (step_bench.py model, plan_owners plan, fp32 Newton-Schulz, 1 thread):",
        "",
        "| W | balance limit s (largest rank) | perfect balance s | measured max/avg | planner max/avg (FLOPs) | distributed step s | distributed / limit |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        dist = "-" if r["distributed_step_s"] is None else f"{r['distributed_step_s']:.3f}"
        ratio = "-" if r["distributed_over_limit"] is None else f"{r['distributed_over_limit']:.3f}"
        if r["ranks_per_core"] != 1 and ratio != "-":
            ratio += f" (vs {r['ranks_per_core']:.0f}x limit: {r['ranks_per_core']:.0f} ranks per core)"
        md.append(f"| {r['world']} | {r['balance_limit_s']:.3f} | {r['perfect_balance_s']:.3f} | "
                  f"{r['measured_time_imbalance']:.3f} | {r['planner_cost_imbalance']:.3f} | {dist} | {ratio} |")
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        Path(args.out + ".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        Path(args.out + ".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
