"""matrixfsdp's optimizer step against its balance limit, and the planner's cost model against time.

    python benchmarks/step_balance.py [--out benchmarks/results/step/step_balance]

The optimizer step under matrixfsdp is purely local, so each rank's step can be timed in one
process: for the step benchmark's model (``step_bench.py`` defaults) and the plan its matrixfsdp
slot uses, this times every parameter's Muon/AdamW update in isolation (one thread, fp32
Newton-Schulz, median of ``--reps`` (7) after 2 warm-ups), sums them per rank, and reports:

* the *balance limit*: the largest per-rank local optimizer compute (what no schedule of these
  owners can beat), next to perfect balance (total / W);
* the measured imbalance (max/avg of the timed per-rank sums) next to the planner's predicted
  cost imbalance (FLOP model) -- the cost model's calibration on this CPU;
* the distributed step, measured here: W gloo ranks on this machine hold the model sharded by
  the same plan, one backward fills the gradients, then ``optimizer.step()`` is timed between
  barriers (median of ``--reps`` after 2 warm-ups; the barrier-to-barrier time is the slowest rank's),
  divided by the balance limit. With W ranks on fewer cores, ranks share cores and the
  distributed time is compared with (W / cores) times the limit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import matrixfsdp
from matrixfsdp import Decoder, DecoderConfig, DecoderLayer

import _bench_common as bc

CFG = DecoderConfig(vocab_size=2048, hidden_size=320, intermediate_size=896, num_hidden_layers=6,
                    num_attention_heads=5, num_key_value_heads=1, head_dim=64)
HP = dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype=torch.float32,
          adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_weight_decay=0.0)


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


def _rank_step(rank: int, W: int, store_path: str, reps: int, out_dir: str) -> None:
    """One rank of the distributed measurement: shard, one backward, time ``opt.step()``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, W), rank=rank, world_size=W)
    try:
        model = Decoder(CFG)
        model.reset_parameters(seed=0)
        mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("dp_shard",))
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(DecoderLayer,))
        for layer in model.model.layers:
            matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
        opt = matrixfsdp.optim.Muon(model.parameters(), **HP)
        x = torch.randint(0, CFG.vocab_size, (2, 128), generator=torch.Generator().manual_seed(rank))
        model(x).float().logsumexp(-1).mean().backward()  # gradients stay for every timed step
        local, total = [], []
        for i in range(reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            if i >= 2:
                local.append(t1 - t0)
                total.append(t2 - t0)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"local_s": statistics.median(local), "step_s": statistics.median(total)}))
    finally:
        dist.destroy_process_group()


def measured_step(W: int, reps: int = 7) -> dict:
    """Run ``W`` ranks; ``step_s`` is the median barrier-to-barrier step, ``local_s`` per rank."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_step, args=(W, os.path.join(tmp, "store"), reps, tmp), nprocs=W,
                           start_method="fork" if sys.platform == "linux" else "spawn")
        res = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(W)]
    return {"step_s": max(r["step_s"] for r in res), "local_s": [r["local_s"] for r in res]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="matrixfsdp's optimizer step against its balance limit.")
    ap.add_argument("--out", default=None, help="write OUT.jsonl and OUT.md; stdout then gets only the summary")
    ap.add_argument("--worlds", nargs="*", type=int, default=[2, 4], help="world sizes to measure")
    ap.add_argument("--reps", type=int, default=7,
                    help="timed repetitions per measurement, after 2 warm-ups; the median is kept (default: %(default)s)")
    args = ap.parse_args(argv)
    command = bc.command_line(__file__, argv)
    torch.set_num_threads(1)
    cores = os.cpu_count() or 1
    with torch.device("meta"):
        model = Decoder(CFG)
    cache: dict[tuple, float] = {}
    rows = []
    for W in args.worlds:
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
                    cache[key] = time_update(shape, matrix, args.reps)
                per_rank[r] += cache[key]
        limit = max(per_rank)
        avg = sum(per_rank) / W
        measured = measured_step(W, args.reps)
        dist = measured["step_s"]
        share = max(1.0, W / cores)  # ranks per core in the distributed run
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
            "distributed_local_step_s": [round(x, 4) for x in measured["local_s"]],
        }
        if not args.out:
            print(json.dumps(row), flush=True)
        rows.append(row)
    md = [
        f"<!-- produced by: {command} -->",
        f"<!-- {datetime.date.today()} torch {torch.__version__} python {platform.python_version()} cpus={cores} -->",
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
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        Path(args.out + ".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
