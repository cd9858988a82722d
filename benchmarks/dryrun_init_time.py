"""One rank's init time per phase (plan, shard, to_empty) against the world size (issue 44).

    python benchmarks/dryrun_init_time.py --models qwen3-8b deepseek-v3 --worlds 1024 4096 \
        --repeats 3 --label after --out /tmp/init_time.jsonl
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/dryrun_init_time.py ... --label before
    python benchmarks/dryrun_init_time.py --render /tmp/init_time.jsonl

Each cell runs rank 0 of a W-rank job of a built-in preset through the dry run (``run_rank`` with
``steps=0``: the real planner, ``fully_shard`` per layer and on the root, ``to_empty`` and the dry
run's random init, on torch's fake process group; [Note: dry runs] in
``matrixfsdp/dryrun/rank.py``), each repeat in a fresh process, and keeps the least wall and CPU
seconds per phase over the repeats (the CPU seconds are this process's: on a loaded machine the
wall seconds include waiting for a core). The code measured is whatever ``matrixfsdp`` the
environment imports (``PYTHONPATH``), so a before/after pair is two runs with two labels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import types


def _cell(model: str, world: int) -> dict:
    import torch

    from matrixfsdp.dryrun import preset_builder
    from matrixfsdp.dryrun import rank as R

    class Stamp:  # run_rank's clock, read as wall and CPU seconds at once
        def __init__(self) -> None:
            self.w, self.c = time.perf_counter(), time.process_time()

        def __sub__(self, o: "Stamp") -> tuple[float, float]:
            return self.w - o.w, self.c - o.c

    R.time = types.SimpleNamespace(perf_counter=Stamp)  # type: ignore[attr-defined]
    rep = R.run_rank(preset_builder(model, torch.bfloat16), name=model, world_size=world, rank=0,
                     role="rank0", steps=0)
    return {"wall": {k: v[0] for k, v in rep.seconds.items()}, "cpu": {k: v[1] for k, v in rep.seconds.items()},
            "param_bytes": rep.param_bytes}


def _measure(model: str, world: int, repeats: int) -> dict:
    best: dict = {"wall": {}, "cpu": {}}
    for _ in range(repeats):
        out = subprocess.run([sys.executable, __file__, "--cell", model, str(world)], capture_output=True,
                             text=True, check=True)
        got = json.loads(out.stdout.splitlines()[-1])
        for clock in ("wall", "cpu"):
            for k, v in got[clock].items():
                best[clock][k] = min(best[clock].get(k, v), v)
        best["param_bytes"] = got["param_bytes"]
    return best


def _render(path: str) -> str:
    rows = [json.loads(line) for line in open(path)]
    lines = ["| model | W | code | plan s | shard s | to_empty s | plan CPU s | shard CPU s | to_empty CPU s | load |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["world"], r["label"] != "before")):
        w, c = r["wall"], r["cpu"]
        lines.append(f"| {r['model']} | {r['world']} | {r['label']} | {w['plan']:.2f} | {w['shard']:.2f} | "
                     f"{w['to_empty']:.2f} | {c['plan']:.2f} | {c['shard']:.2f} | {c['to_empty']:.2f} | "
                     f"{r['load']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3-8b", "deepseek-v3"])
    p.add_argument("--worlds", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per cell (least seconds kept)")
    p.add_argument("--label", default="", help="names the code measured (before, after)")
    p.add_argument("--out", help="append one JSON row per cell here")
    p.add_argument("--render", help="print the markdown table of a .jsonl")
    p.add_argument("--cell", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cell:
        print(json.dumps(_cell(args.cell[0], int(args.cell[1]))))
        return
    if args.render:
        print(_render(args.render))
        return
    for model in args.models:
        for world in args.worlds:
            row = {"model": model, "world": world, "label": args.label, **_measure(model, world, args.repeats),
                   "load": os.getloadavg()[0], "cpu_model": platform.processor() or platform.machine(),
                   "omp_threads": os.environ.get("OMP_NUM_THREADS", "")}
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
