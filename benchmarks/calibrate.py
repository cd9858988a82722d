"""Measure what the scaling model needs on this machine: compute rates and collective costs.

    python benchmarks/calibrate.py --world 4 [--netns] --out benchmarks/results/scaling/calibration_cpu_w4

Spawns W ranks exactly like ``step_bench.py`` (same launcher, FileStore rendezvous, intra-op
threads = cpus // W, optional per-rank network namespaces ``mfb-r<k>``). All ranks measure at the
same time, so every figure includes the contention the step benchmark runs under (W ranks sharing
this machine's cores and, with ``--netns``, the shaped links):

* ``ns``: Newton-Schulz (``matrixfsdp.optim._muon.zeropower_via_newtonschulz``, 5 steps, in the
  bench's NS dtype) per distinct hidden-matrix shape of the bench model: seconds and flop/s
  (``matrixfsdp.planner.cost.newton_schulz_flops``);
* ``fwd_bwd``: forward + backward of the plain bench model on one rank's batch (no communication):
  seconds for the whole model (``scaling_model.py`` splits it over blocks by matmul FLOPs);
* ``adamw``: one ``torch.optim.AdamW(foreach=False)`` step per element (seconds per element);
* ``collectives``: ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``,
  ``all_reduce``, ``broadcast`` and ``reduce`` over buffer sizes 16 KiB-16 MiB: the median over
  repetitions of the slowest rank's time, and a least-squares fit ``t = alpha + beta * wire``
  where ``wire`` is the bytes a rank sends under step_bench's convention (ring all-gather and
  reduce-scatter (W-1)/W n, all-reduce 2(W-1)/W n, broadcast/reduce n, all-to-all (W-1)/W n).
  The fit absorbs how gloo implements each op (e.g. its reduce-scatter moves more than a ring).

Output: one JSON object (``--out X`` writes ``X.json``) read by
``scaling_model.py --validate STEP_BENCH.jsonl --calibration X.json``, which models the step
benchmark's configuration on these figures and compares with what step_bench measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _bench_common as bc  # noqa: E402
from baselines import ADAMW_2D, BenchConfig, batch_for_step, build_model, lm_loss  # noqa: E402

from matrixfsdp.planner.cost import newton_schulz_flops  # noqa: E402
from matrixfsdp.optim._muon import zeropower_via_newtonschulz  # noqa: E402

OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_reduce", "broadcast", "reduce")
SIZES = [1 << k for k in range(14, 25, 2)]  # 16 KiB .. 16 MiB buffers (float32)


def wire_bytes(op: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends for a buffer of ``nbytes`` (step_bench's convention)."""
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        return (world - 1) / world * nbytes
    if op == "all_reduce":
        return 2 * (world - 1) / world * nbytes
    return float(nbytes)  # broadcast, reduce


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Relative least squares ``y = a + b x`` (weights 1/y^2, so the small-message latency counts
    as much as the large-message bandwidth); ``a`` clamped at >= 0."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs))
    sy = sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    a = (sy - b * sx) / sw
    if a < 0:
        a, b = 0.0, sxy / sxx
    return a, b


def _timed(fn, reps: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` over ``reps`` runs, slowest rank per run (all ranks in lockstep)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ts.append(float(t))
    return statistics.median(ts)


def measure_compute(cfg: BenchConfig, rank: int, world: int, reps: int) -> dict[str, Any]:
    model = build_model(cfg)
    out: dict[str, Any] = {}
    # Newton-Schulz per distinct hidden-matrix shape
    shapes = sorted({tuple(p.shape) for n, p in model.named_parameters()
                     if p.ndim == 2 and n not in ADAMW_2D})
    g = torch.Generator().manual_seed(7)
    ns = {}
    for s in shapes:
        x = torch.randn(s, generator=g)
        t = _timed(lambda: zeropower_via_newtonschulz(x, cfg.ns_coefficients, cfg.ns_steps, cfg.eps,
                                                      dtype=cfg.ns_torch_dtype), reps)
        ns["x".join(map(str, s))] = {"s": t, "flops": newton_schulz_flops(s), "flop_per_s": newton_schulz_flops(s) / t}
    out["ns"] = ns
    # forward + backward of the plain model on one rank's batch (step 0's batch), per block
    tokens = batch_for_step(cfg, 0, rank, world)

    def fb() -> None:
        model.zero_grad(set_to_none=True)
        lm_loss(model, tokens).backward()

    out["fwd_bwd_s"] = _timed(fb, reps)
    out["tokens_per_rank"] = int(tokens[:, :-1].numel())
    # AdamW: seconds per element of one step (foreach=False, as matrixfsdp's AdamW route)
    p = torch.nn.Parameter(torch.randn(1 << 20))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=False)
    out["adamw_s_per_elem"] = _timed(opt.step, reps) / p.numel()
    return out


def measure_collectives(world: int, reps: int) -> dict[str, Any]:
    rank = dist.get_rank()
    res: dict[str, Any] = {}
    for op in OPS:
        pts = []
        for nbytes in SIZES:
            n = nbytes // 4
            n -= n % world
            full = torch.ones(n)
            shard = torch.ones(n // world)
            if op == "all_gather_into_tensor":
                fn = lambda: dist.all_gather_into_tensor(full, shard)  # noqa: E731
            elif op == "reduce_scatter_tensor":
                fn = lambda: dist.reduce_scatter_tensor(shard, full)  # noqa: E731
            elif op == "all_to_all_single":
                out = torch.empty(n)
                fn = lambda: dist.all_to_all_single(out, full)  # noqa: E731
            elif op == "all_reduce":
                fn = lambda: dist.all_reduce(full)  # noqa: E731
            elif op == "broadcast":
                fn = lambda: dist.broadcast(full, src=0)  # noqa: E731
            else:
                fn = lambda: dist.reduce(full, dst=0)  # noqa: E731
            t = _timed(fn, reps)
            pts.append({"buf_bytes": n * 4, "wire_bytes": wire_bytes(op, n * 4, world), "s": t})
        a, b = fit([p["wire_bytes"] for p in pts], [p["s"] for p in pts])
        worst = max(abs(a + b * p["wire_bytes"] - p["s"]) / p["s"] for p in pts)
        res[op] = {"points": pts, "alpha_s": a, "beta_s_per_byte": b,
                   "wire_gbit_per_s": 8 / b / 1e9 if b > 0 else None, "fit_max_rel_err": worst}
        if rank == 0:
            print(f"[calibrate] {op}: alpha {a * 1e6:.0f} us, {8 / b / 1e9 if b else float('inf'):.2f} Gbit/s "
                  f"(fit max rel err {worst:.0%})", file=sys.stderr, flush=True)
    return res


def worker_main(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    threads = args.threads or max(1, (os.cpu_count() or 1) // int(os.environ["MFB_WORLD"]))
    torch.set_num_threads(threads)
    rank, world = int(os.environ["MFB_RANK"]), int(os.environ["MFB_WORLD"])
    store = dist.FileStore(os.environ["MFB_STORE"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    cfg = BenchConfig()
    t0 = time.perf_counter()
    comp = measure_compute(cfg, rank, world, args.reps)
    coll = measure_collectives(world, args.reps)
    if rank == 0:
        result = {"world": world, "threads_per_rank": threads, "netns": args.netns, "config": cfg.to_dict(),
                  "compute": comp, "collectives": coll, "env": bc.env_info(),
                  "run_s": round(time.perf_counter() - t0, 1)}
        if args.netns:
            import subprocess

            result["netns_qdisc"] = subprocess.run(["tc", "qdisc", "show", "dev", "mfb0"], capture_output=True,
                                                   text=True, timeout=10).stdout.strip()
        with open(args._result, "w") as f:
            json.dump(result, f, indent=1, default=str)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def driver_main(args: argparse.Namespace) -> int:
    world = args.world
    tmp = tempfile.mkdtemp(prefix="calibrate-")
    result_path = os.path.join(tmp, "result.json")
    argv = [sys.executable, os.path.abspath(__file__), "--_worker", "--_result", result_path,
            "--reps", str(args.reps)] + (["--netns"] if args.netns else [])
    if args.threads:
        argv += ["--threads", str(args.threads)]
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    codes = bc.launch_ranks(world, argv, store_path=os.path.join(tmp, "store"), threads=threads,
                            timeout_s=args.timeout, netns_prefix="mfb-r" if args.netns else None,
                            gloo_ifname="mfb0" if args.netns else None)
    if any(codes) or not os.path.exists(result_path):
        print(f"calibrate: ranks exited with {codes}", file=sys.stderr)
        return 1
    with open(result_path) as f:
        result = json.load(f)
    shutil.rmtree(tmp, ignore_errors=True)
    result["command"] = "python benchmarks/calibrate.py " + " ".join(sys.argv[1:])
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}.json", file=sys.stderr)
    else:
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per measurement (median)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--netns", action="store_true", help="ranks in namespaces mfb-r<k> (benchmarks/netns/setup.sh)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default=None, help="write OUT.json")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return worker_main(args) if args._worker else driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
