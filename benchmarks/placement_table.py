"""Owned vs adaptive placement on the Qwen3 presets, flat meshes from 64 to 4096 ranks and HSDP.

    python benchmarks/placement_table.py [--out benchmarks/results/scaling/placement]

Per (model, mesh, placement): the most loaded rank's parameter + gradient + Muon-state bytes over
an even share and over FSDP2's most loaded rank on the same mesh, the hosted matrices and their micro-groups, the step's
bytes sent by the busiest rank against DistMuon's (torchtitan's all-to-all to a step owner:
every rank sends its shard of every matrix, ``(W-1)/W`` of the matrices' bytes over ``W``, and
receives as much back), and the planning time. Pure planning (``plan_owners`` on ``meta``
models): the dry run (``python -m matrixfsdp.dryrun``) checks at tiny and W=64/1024 that what a
rank holds is exactly what the plan says (``tests/dryrun/test_dryrun.py``).

Prints one JSON object per row, then a markdown table; ``--out`` writes ``<out>.jsonl`` and
``<out>.md`` with the command, versions and date.
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

from matrixfsdp import plan_owners
from matrixfsdp.models.decoder import PRESETS, Decoder, DecoderLayer
from scaling_model import hosted_step_bytes

MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b")
MESHES = ((1, 64), (1, 256), (1, 1024), (1, 4096), (8, 8), (32, 8), (128, 8), (512, 8))


def step_bytes(plan) -> tuple[float, float, float]:
    """``(busiest rank's step bytes sent, mean over ranks, DistMuon's per rank)`` (bytes)."""
    W = plan.world_size
    mats = [p for p in plan.params if p.placement in ("matrix", "hosted")]
    distmuon = 2 * (W - 1) / W * sum(p.nbytes for p in mats) / W
    sent = [hosted_step_bytes(plan, r) for r in range(W)] if plan.num_hosted else [0.0]
    return max(sent), sum(sent) / W, distmuon


def row(model: str, R: int, S: int, placement: str) -> dict:
    with torch.device("meta"):
        net = Decoder(PRESETS[model]).to(torch.bfloat16)
    t = time.perf_counter()
    plan = plan_owners(net, (R, S) if R > 1 else S, block_types=(DecoderLayer,), placement=placement)
    seconds = time.perf_counter() - t
    busiest, mean, distmuon = step_bytes(plan)
    return {
        "model": model, "world": R * S, "replicas": R, "shard": S, "placement": placement,
        "memory_x_even": round(plan.memory_imbalance, 3), "params_x_even": round(plan.bytes_imbalance, 3),
        # FSDP2 on this mesh (OwnerPlan.fsdp2_memory_imbalance: torch.chunk rows of every tensor)
        "fsdp2_memory_x_even": round(plan.fsdp2_memory_imbalance, 3),
        "memory_x_fsdp2": round(plan.memory_vs_fsdp2, 3),
        "hosted": plan.num_hosted, "owned_matrices": sum(p.placement == "matrix" for p in plan.params),
        "host_groups": len(plan.host_groups), "step_bytes_busiest": busiest,
        "step_bytes_mean": mean, "distmuon_bytes_per_rank": distmuon,
        "plan_s": round(seconds, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="write <out>.jsonl and <out>.md")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=sorted(PRESETS))
    args = ap.parse_args()
    rows = []
    for model in args.models:
        for R, S in MESHES:
            for placement in ("owned", "auto"):
                r = row(model, R, S, placement)
                print(json.dumps(r), flush=True)
                rows.append(r)
    mib = 2.0**20
    md = ["| model | mesh | placement | held / even | FSDP2 / even | held / FSDP2 | hosted | groups | step MiB busiest | step MiB mean | DistMuon MiB | plan s |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mesh = f"{r['world']}" if r["replicas"] == 1 else f"{r['replicas']} x {r['shard']}"
        md.append(f"| {r['model']} | {mesh} | {r['placement']} | {r['memory_x_even']:.2f} | "
                  f"{r['fsdp2_memory_x_even']:.2f} | {r['memory_x_fsdp2']:.2f} | {r['hosted']} | "
                  f"{r['host_groups']} | {r['step_bytes_busiest'] / mib:.1f} | {r['step_bytes_mean'] / mib:.1f} | {r['distmuon_bytes_per_rank'] / mib:.1f} | "
                  f"{r['plan_s']:.2f} |")
    print("\n".join(md))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        head = (f"# Owned vs adaptive placement\n\nCommand: `python benchmarks/placement_table.py --out {args.out}`  \n"
                f"Date: {datetime.date.today()}; torch {torch.__version__}; Python {platform.python_version()}; "
                f"{platform.processor() or platform.machine()}\n\nheld / even: the most loaded rank's parameter + "
                "gradient + Muon-state bytes (bf16) over an even share (total / shard ranks). FSDP2 / even: the "
                "same for FSDP2 on this mesh (every tensor Shard(0) in torch.chunk rows: a matrix with fewer rows "
                "than ranks lands on its first ranks, so FSDP2 exceeds 1.00 at large W); held / FSDP2: the ratio "
                "of the two, the issue's goal (<= 1.25). Step MiB: bytes the busiest "
                "rank sends in the optimizer step (hosted matrices' all-to-alls; 0 when every matrix is owned; the host "
                "of a large matrix scatters nearly all of it), and the mean over ranks; "
                "DistMuon MiB: what each rank sends in DistMuon's all-to-all to a step owner and back.\n\n")
        out.with_suffix(".md").write_text(head + "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
