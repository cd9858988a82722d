"""Batched against per-expert Newton-Schulz: Muon's expert-stack step on one rank's local experts.

    python benchmarks/expert_ns_bench.py [--experts 16] [--threads 1] [--reps 9]
                                         [--out benchmarks/results/moe/expert_ns_cpu]

A rank that holds ``E`` whole experts of a stack steps them with ``matrixfsdp.optim.Muon``'s
expert step (``Muon(model)`` on a module named ``*Experts*``: momentum and weight decay once over
the stack, Newton-Schulz batched with ``bmm``/``baddbmm``; see [Note: expert optimizer state] in
``optim/_expert_step.py``). The alternative is what a user without stacks writes: every expert matrix
its own 2-D parameter, stepped one by one (``Muon`` on ``E * splits`` parameters, the per-matrix
2-D rule, ``torch.optim.Muon``'s op sequence). For each stack shape (default: ``[E, 512, 256]``,
``[E, 256, 512]`` and the fused ``gate_up_proj [E, 1024, 256]``, two ``[512, 256]`` matrices per
expert) and each Newton-Schulz dtype (float32, bfloat16; parameters, gradients and momentum in
float32) this times one optimizer step both ways on the same values:

* ``--reps`` timed steps of each, interleaved (batched, loop, batched, ...) after ``--warmup``
  of each, same gradient every step; medians, and the median of the per-pair ratios
  ``loop / batched`` (the speedup; the goal of issue 26 is >= 1.5x);
* parity after all steps (both sides took the same steps): ``torch.equal`` per matrix of the
  stack against the loop's parameter (how many of the ``E * splits`` matrices are bitwise equal)
  and the largest absolute difference;
* noise: the share of the machine's CPU used by other processes during the timed steps of a
  (shape, dtype); above ``--max-foreign`` the measurement is repeated (``--retries``) after
  waiting (``--quiet-wait`` s at most) for a quiet second.

Output: one JSON row per (shape, dtype) on stdout (``--out X``: ``X.jsonl``), then a markdown table
(``X.md``) headed by the command, versions, CPU model and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import _bench_common as bc  # noqa: E402

try:
    import matrixfsdp  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(HERE, "..", "src"))
from matrixfsdp.optim import Muon  # noqa: E402
from matrixfsdp.optim import _expert_step as _experts  # noqa: E402



def shapes(F: int, D: int) -> list[tuple[str, str, int, int, int]]:
    """(label, stack parameter name, rows, cols, splits) per stack; rows/cols of one expert slice:
    ``w1 [E, F, D]``, ``w2 [E, D, F]`` and the fused ``gate_up_proj [E, 2F, D]`` (two per expert)."""
    return [(f"w1 [E, {F}, {D}]", "w1", F, D, 1), (f"w2 [E, {D}, {F}]", "w2", D, F, 1),
            (f"gate_up_proj [E, {2 * F}, {D}], split 2", "gate_up_proj", 2 * F, D, 2)]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HP = dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True, ns_steps=5)


class Experts(nn.Module):
    """One expert stack, as a rank holds it (a module whose class name says ``Experts``)."""

    def __init__(self, name: str, stack: torch.Tensor) -> None:
        super().__init__()
        self.register_parameter(name, nn.Parameter(stack))


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("flags"):
                    fl = ln.split(":", 1)[1].split()
                    return " ".join(x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if x in fl)
    except OSError:
        pass
    return "?"


def measure(E: int, name: str, rows: int, cols: int, splits: int, ns_dtype: torch.dtype,
            args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1234)
    stack = torch.randn(E, rows, cols, generator=g) / cols ** 0.5
    grad = torch.randn(E, rows, cols, generator=g) * 1e-2
    model = Experts(name, stack.clone())
    p = model.get_parameter(name)
    batched = Muon(model, ns_dtype=ns_dtype, **HP)
    routes = [(grp["algorithm"], grp.get("experts")) for grp in batched.param_groups]
    assert routes == [("muon", splits)], routes  # the expert route, `splits` matrices per expert
    r = rows // splits
    # diagnostic: the same expert step with Newton-Schulz chunks of `chunk` matrices (both byte bounds lowered)
    model_c = Experts(name, stack.clone())
    p_c = model_c.get_parameter(name)
    chunked = Muon(model_c, ns_dtype=ns_dtype, **HP)
    chunk = args.chunk
    per = (r * cols * 2 + 2 * min(r, cols) ** 2) * torch.empty((), dtype=ns_dtype).element_size()
    mats = [nn.Parameter(stack[e, k * r:(k + 1) * r].clone()) for e in range(E) for k in range(splits)]
    mat_grads = [grad[e, k * r:(k + 1) * r].clone() for e in range(E) for k in range(splits)]
    loop = Muon([{"params": mats, "algorithm": "muon"}], ns_dtype=ns_dtype, **HP)

    def step_batched() -> float:
        p.grad = grad
        t0 = time.perf_counter()
        batched.step()
        return time.perf_counter() - t0

    def step_chunked() -> float:
        p_c.grad = grad
        saved = _experts.NS_CHUNK_BYTES, _experts.NS_CHUNK_BYTES_CPU
        _experts.NS_CHUNK_BYTES = _experts.NS_CHUNK_BYTES_CPU = chunk * per
        try:
            t0 = time.perf_counter()
            chunked.step()
            return time.perf_counter() - t0
        finally:
            _experts.NS_CHUNK_BYTES, _experts.NS_CHUNK_BYTES_CPU = saved

    def step_loop() -> float:
        for m, gm in zip(mats, mat_grads):
            m.grad = gm
        t0 = time.perf_counter()
        loop.step()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step_batched()
        step_loop()
        step_chunked()
    tb, tl, tc = [], [], []
    proc0, mach0 = bc.proc_cpu_ticks(), bc.machine_cpu_ticks()
    for _ in range(args.reps):
        tb.append(step_batched())
        tl.append(step_loop())
        tc.append(step_chunked())
    foreign = bc.foreign_cpu_share(mach0, bc.machine_cpu_ticks(), bc.proc_cpu_ticks() - proc0)

    def parity(t: torch.Tensor) -> tuple[int, float]:
        got = t.detach().view(E * splits, r, cols)
        return (sum(bool(torch.equal(got[i], mats[i].detach())) for i in range(E * splits)),
                max(float((got[i] - mats[i].detach()).abs().max()) for i in range(E * splits)))

    equal, diff = parity(p)
    equal_c, diff_c = parity(p_c)
    b, lp, c = statistics.median(tb), statistics.median(tl), statistics.median(tc)
    return {
        "shape": f"[{E}, {rows}, {cols}]", "stack": name, "splits": splits, "matrices": E * splits,
        "matrix_shape": [r, cols], "ns_dtype": str(ns_dtype).replace("torch.", ""), "param_dtype": "float32",
        "threads": torch.get_num_threads(), "steps_each": args.warmup + args.reps,
        "batched_ms": round(b * 1e3, 3), "loop_ms": round(lp * 1e3, 3),
        "batched_ms_min": round(min(tb) * 1e3, 3), "loop_ms_min": round(min(tl) * 1e3, 3),
        "speedup_median": round(lp / b, 3),
        "speedup_pairs": round(statistics.median(l_ / b_ for l_, b_ in zip(tl, tb)), 3),
        "bitwise_equal": equal, "max_abs_diff": diff,
        "chunk_matrices": chunk, "chunked_ms": round(c * 1e3, 3),
        "chunked_speedup_pairs": round(statistics.median(l_ / c_ for l_, c_ in zip(tl, tc)), 3),
        "chunked_bitwise_equal": equal_c, "chunked_max_abs_diff": diff_c,
        "foreign_cpu_share": None if foreign is None else round(foreign, 3),
    }


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], command: str) -> str:
    L = [f"<!-- produced by: {command} -->",
         f"<!-- {meta['date']} torch {meta['torch']} python {meta['python']} git {meta['git']} {meta['platform']} -->",
         "", f"# Batched against per-expert Newton-Schulz on one rank's {meta['experts']} local experts", "",
         f"Command: `{command}`  ",
         f"Date: {meta['date']}; torch {meta['torch']}; python {meta['python']}; git {meta['git']}; CPU: "
         f"{meta['cpu_model']} ({meta['cpus']} cores, shared with other jobs; flags: {meta['cpu_flags']}); "
         f"{meta['threads']} intra-op thread(s) (one step_bench rank's).  ",
         "One optimizer step of `matrixfsdp.optim.Muon` on a rank's expert stack, two ways: **batched** = "
         "`Muon(model)` on the stack (the expert route: element-wise ops once over the stack, Newton-Schulz "
         "with `bmm`/`baddbmm` in chunks of <= 64 MiB on accelerators, <= 1 MiB on the CPU, where a batch gains "
         "only while it stays in a core's cache: a chunk of one matrix is the 2-D iteration); **loop** = every expert matrix its own 2-D parameter, "
         "stepped one after another by the per-matrix rule (`torch.optim.Muon`'s op sequence). Muon lr 0.02, "
         "wd 0.01, momentum 0.95, Nesterov, 5 Newton-Schulz steps in the given dtype; parameters, gradients "
         "and momentum float32. Times: medians over "
         f"{meta['reps']} steps of each, interleaved, after {meta['warmup']} warm-up steps of each; speedup = "
         "loop / batched, the median of the per-pair ratios. Parity after all steps: matrices whose batched "
         "result `torch.equal`s the loop's, and the largest absolute difference. Diagnostic (not the shipped "
         f"setting): the same batched step with the chunk bounds set so that each Newton-Schulz batch holds "
         f"{meta['chunk']} matrices, measured in the same "
         "interleaved sequence.", "",
         "| stack (per rank) | matrices | NS dtype | batched ms | loop ms | speedup (loop / batched) | "
         f"bitwise equal | max abs diff | batched, chunks of {meta['chunk']} ms | its speedup | its bitwise equal | "
         "foreign CPU |",
         "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        L.append(f"| {r['label']} | {r['matrices']} x {r['matrix_shape'][0]}x{r['matrix_shape'][1]} | {r['ns_dtype']} | "
                 f"{r['batched_ms']:.1f} | {r['loop_ms']:.1f} | **{r['speedup_pairs']:.2f}x** | "
                 f"{r['bitwise_equal']}/{r['matrices']} | {r['max_abs_diff']:.2e} | {r['chunked_ms']:.1f} | "
                 f"{r['chunked_speedup_pairs']:.2f}x | {r['chunked_bitwise_equal']}/{r['matrices']} | "
                 + ("n/a" if r["foreign_cpu_share"] is None else f"{r['foreign_cpu_share']:.0%}") + " |")
    L.append("")
    met = [r for r in rows if r["speedup_pairs"] >= 1.5]
    L.append(f"Goal (issue 26): batched >= 1.5x the per-expert loop: met in {len(met)}/{len(rows)} cases"
             + (" (" + ", ".join(f"{r['label']} {r['ns_dtype']}" for r in met) + ")" if met else "") + ".")
    L.append("")
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=16, help="experts the rank holds (default 16)")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (default 1, as one rank of step_bench --world 4 on this 2-core machine)")
    p.add_argument("--dims", default="512,256", help="F,D: expert hidden and model dims (default 512,256)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--chunk", type=int, default=4,
                   help="diagnostic column: matrices per Newton-Schulz batch (NS_CHUNK_BYTES lowered to fit)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--max-foreign", type=float, default=0.15)
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--quiet-wait", type=float, default=20)
    p.add_argument("--out", default=None, help="write OUT.jsonl and OUT.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    F, D = (int(x) for x in args.dims.split(","))
    for label, name, rws, cols, splits in shapes(F, D):
        for dt in args.dtypes.split(","):
            for attempt in range(args.retries + 1):
                if args.quiet_wait > 0:
                    bc.wait_quiet(args.quiet_wait, threshold=args.max_foreign, window_s=1.0, need=1)
                row = measure(args.experts, name, rws, cols, splits, DTYPES[dt], args)
                row.update(label=label.replace("E,", f"{args.experts},"), attempt=attempt + 1)
                f = row["foreign_cpu_share"]
                if f is None or f <= args.max_foreign or attempt == args.retries:
                    break
                print(f"[expert_ns_bench] {label} {dt}: foreign CPU {f:.0%} -> retry", file=sys.stderr, flush=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = bc.env_info()
    meta = {"date": env["date"], "torch": env["torch"], "python": env["python"], "git": env.get("git"),
            "platform": env["platform"], "cpus": env["cpus"], "cpu_model": bc.cpu_model(), "cpu_flags": cpu_flags(),
            "threads": args.threads, "experts": args.experts, "chunk": args.chunk, "reps": args.reps, "warmup": args.warmup,
            "run_s": round(time.perf_counter() - t_start, 1)}
    command = bc.command_line(__file__, argv)
    md = markdown(rows, meta, command)
    print()
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".jsonl", "w") as fh:
            fh.write("\n".join([json.dumps({"meta": meta})] + [json.dumps(r) for r in rows]) + "\n")
        with open(args.out + ".md", "w") as fh:
            fh.write(md)
        print(f"wrote {args.out}.jsonl and {args.out}.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
