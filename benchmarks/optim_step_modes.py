"""Time one Muon step four ways on one device: default, batched, capturable+batched, compiled.

The model is 12 matrices of 2 shapes (half ``--shape-a``, half ``--shape-b``) plus 12 bias
vectors. The command prints a markdown table: the median step time of ``--steps`` steps after
``--warmup`` steps, and the matrix products per step (a dispatch-mode count of
mm/addmm/bmm/baddbmm).

    python benchmarks/optim_step_modes.py --device cpu --ns-dtype float32
    python benchmarks/optim_step_modes.py --device cuda --ns-dtype bfloat16
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from matrixfsdp.optim import Muon

_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += func in _MATMULS
        return func(*args, **(kwargs or {}))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(mode: str, args: argparse.Namespace) -> tuple[float, int]:
    shapes = [args.shape_a] * 6 + [args.shape_b] * 6
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(args.device)) for s in shapes]
    params += [torch.nn.Parameter(torch.zeros(s[0], device=args.device)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(args.device)
    capturable = mode in ("capturable+batched", "compiled")
    opt = Muon(params, lr=torch.tensor(0.02, device=args.device) if capturable else 0.02,
               ns_dtype=getattr(torch, args.ns_dtype), capturable=capturable, batched=mode != "default")
    step = opt.step
    if mode == "compiled":
        opt.step()  # state first; compile the steady state
        step = torch.compile(opt.step)
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        _sync(args.device)
        t0 = time.perf_counter()
        step()
        _sync(args.device)
        times.append(time.perf_counter() - t0)
    count = _Count()
    if mode != "compiled":
        with count:
            opt.step()
    return statistics.median(times), count.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ns-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shape-a", type=int, nargs=2, default=[256, 256])
    parser.add_argument("--shape-b", type=int, nargs=2, default=[256, 512])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, device {args.device}, "
          f"intra-op threads {torch.get_num_threads()}, ns_dtype {args.ns_dtype}, "
          f"6x{tuple(args.shape_a)} + 6x{tuple(args.shape_b)} matrices + 12 biases, median of {args.steps}\n")
    print("| step | median ms | matrix products per step |")
    print("|---|---|---|")
    for mode in ("default", "batched", "capturable+batched", "compiled"):
        t, n = bench(mode, args)
        print(f"| {mode} | {t * 1e3:.1f} | {n if mode != 'compiled' else 'n/a (fused graph)'} |")


if __name__ == "__main__":
    main()
