"""Part 4 of ``benchmarks/gpu/check.py``, ``kernels``: the project's batched bf16 Newton-Schulz on
Qwen3 shapes (1024 to 5120 wide, aspect 1 to 5), TFLOP/s and % of the GPU's dense bf16 peak;
compiled variants, each its own ``torch.compile`` object with the frames it compiled recorded;
Muon's Gram Newton-Schulz when ``Muon`` has ``ns_method``; ``eigh``/``qr`` timings for the planner
(full mode)."""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable

import torch

from .core import Ctx

#: dense bf16 tensor-core peak (TFLOP/s, without sparsity) by device name; first match wins
BF16_PEAK = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0))
ANCHORS = ("60%: cuBLAS Gram 4096x8192 at 647 TFLOP/s on an H100 (pytorch#184886); "
           "59%: grouped MuonH (marin#6493)")


def _time_ms(fn: Callable[[], Any], reps: int, dev: torch.device) -> float:
    fn()
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def ns_flops(batch: int, m: int, n: int, steps: int = 5) -> int:
    """FLOPs of ``steps`` quintic Newton-Schulz iterations on ``batch`` m x n matrices (m <= n):
    per iteration ``X X^T`` (2 m^2 n), ``b A + c A A`` (2 m^3), ``a X + B X`` (2 m^2 n)."""
    m, n = min(m, n), max(m, n)
    return batch * steps * (4 * m * m * n + 2 * m * m * m)


def bf16_peak(name: str) -> float | None:
    for key, peak in BF16_PEAK:
        if key in name:
            return peak
    return None


#: Qwen3 projection shapes (out, in): 0.6B (1024 wide), 4B (2560), 8B (4096), 14B/32B (5120)
QWEN3_SHAPES = ((1024, 1024), (3072, 1024), (1024, 4096), (9728, 2560), (4096, 4096), (12288, 4096),
                (5120, 5120), (25600, 5120))


def _batch_for(shape: tuple[int, int]) -> int:
    """A stack of about 64M elements (2 to 16 matrices), as the batched step stacks same-shape ones."""
    return max(2, min(16, (1 << 26) // (shape[0] * shape[1])))


def part_kernels(ctx: Ctx) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend

    from matrixfsdp.optim import Muon
    from matrixfsdp.optim._muon import batched_newtonschulz

    dev = ctx.dev
    name = torch.cuda.get_device_name(dev) if ctx.cuda else "cpu"
    peak = bf16_peak(name) if ctx.cuda else None
    coeffs, eps = (3.4445, -4.775, 2.0315), 1e-7
    if ctx.cuda:
        shapes = QWEN3_SHAPES if not ctx.quick else ((1024, 4096), (4096, 4096), (12288, 4096), (25600, 5120))
        dtype, reps = torch.bfloat16, 3
    else:  # dry run: the same code on tiny shapes
        shapes, dtype, reps = ((64, 64), (192, 64)), torch.float32, 1
    rows: list[dict] = []

    def emit(**r):
        rows.append(ctx.row(device=name, **r))

    ctx.row(device=name, peak_bf16_dense_tflops=peak, anchors=ANCHORS)
    # 1. eager, batched: what Muon's batched step runs per stack of same-shape matrices
    for shape in shapes:
        b = _batch_for(shape) if ctx.cuda else 2
        x = torch.randn(b, *shape, device=dev, dtype=dtype)
        flops = ns_flops(b, *shape)
        try:
            ms = _time_ms(lambda x=x: batched_newtonschulz(x, coeffs, 5, eps, dtype), reps, dev)
            tf = flops / ms / 1e9
            emit(op="newton_schulz", how="batched eager", shape=shape, batch=b, dtype=str(dtype)[6:], ms=ms,
                 tflops=tf, pct_of_peak=None if peak is None else 100 * tf / peak)
        except Exception as e:
            emit(op="newton_schulz", how="batched eager", shape=shape, error=f"{type(e).__name__}: {e}"[:300])
        del x
    # 2. compiled: one torch.compile object per variant (dynamic=False), dynamo reset between, so
    # no variant meets the recompile limit and silently runs eager; frames compiled recorded
    variants = [(s, dtype, False) for s in (shapes[1:3] if ctx.cuda and not ctx.quick else shapes[1:2] if ctx.cuda
                                            else shapes[:1])]
    if ctx.cuda and not ctx.quick:
        variants += [((4096, 4096), torch.float32, False), ((4096, 4096), torch.float32, True)]
    backend = "inductor" if ctx.cuda else "aot_eager"
    compiled_all = True
    for shape, dt, tf32 in variants:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        fn = torch.compile(batched_newtonschulz, backend=counter, dynamic=False)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        b = _batch_for(shape) if ctx.cuda else 2
        x = torch.randn(b, *shape, device=dev, dtype=dt)
        label = ("tf32" if tf32 else str(dt)[6:])
        try:
            t0 = time.perf_counter()
            fn(x, coeffs, 5, eps, dt)
            compile_s = time.perf_counter() - t0
            ms = _time_ms(lambda x=x, fn=fn: fn(x, coeffs, 5, eps, dt), reps, dev)
            compiled = counter.frame_count >= 1
            compiled_all &= compiled
            tf = ns_flops(b, *shape) / ms / 1e9
            emit(op="newton_schulz", how=f"batched compiled ({backend})", shape=shape, batch=b, dtype=label, ms=ms,
                 tflops=tf, pct_of_peak=None if peak is None or label != "bfloat16" else 100 * tf / peak,
                 frames_compiled=counter.frame_count, compiled=compiled, compile_s=round(compile_s, 1))
        except Exception as e:
            compiled_all = False
            emit(op="newton_schulz", how=f"batched compiled ({backend})", shape=shape, dtype=label,
                 error=f"{type(e).__name__}: {e}"[:300])
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        del x
    # 3. Muon's Gram Newton-Schulz, when the optimizer has it (another change adds ns_method)
    if "ns_method" in inspect.signature(Muon).parameters:
        for shape in (shapes[2], shapes[-1]) if ctx.cuda else shapes[:1]:
            b = _batch_for(shape) if ctx.cuda else 2
            for method in ("default", "gram"):
                try:
                    g = torch.Generator(device=dev).manual_seed(0)
                    params = [torch.nn.Parameter(torch.randn(shape, device=dev, generator=g)) for _ in range(b)]
                    for p in params:
                        p.grad = torch.randn(shape, device=dev, generator=g)
                    kw = {} if method == "default" else {"ns_method": "gram"}
                    opt = Muon(params, lr=0.02, batched=True, **kw)
                    ms = _time_ms(opt.step, reps, dev)
                    tf = ns_flops(b, *shape) / ms / 1e9
                    emit(op="muon_step", how=f"ns_method={method}", shape=shape, batch=b, ms=ms,
                         effective_tflops=tf, pct_of_peak=None if peak is None else 100 * tf / peak,
                         note="standard Newton-Schulz FLOPs over the whole step's time")
                except Exception as e:
                    emit(op="muon_step", how=f"ns_method={method}", shape=shape, error=f"{type(e).__name__}: {e}"[:300])
    else:
        emit(op="muon_step", how="ns_method=gram", status="skipped: matrixfsdp.optim.Muon has no ns_method")
    # 4. eigh and qr for the planner's cost model (full mode)
    if ctx.cuda and not ctx.quick:
        for n in (1024, 2048, 4096):
            for dt in (torch.float32, torch.float64):
                if dt == torch.float64 and n > 2048:
                    continue
                a = torch.randn(n, n, device=dev, dtype=dt)
                s = a @ a.mT + n * torch.eye(n, device=dev, dtype=dt)
                for op, fn in (("eigh", lambda: torch.linalg.eigh(s)), ("qr", lambda: torch.linalg.qr(a))):
                    emit(op=op, n=n, dtype=str(dt)[6:], ms=_time_ms(fn, 1 if n >= 4096 else 2, dev))
    eager = [r for r in rows if r.get("how") == "batched eager" and "tflops" in r]
    best = max(eager, key=lambda r: r["tflops"]) if eager else None
    errors = [r for r in rows if "error" in r]
    ok = bool(eager) and compiled_all and not errors
    key = "no rows" if best is None else (
        f"best batched bf16 NS {best['tflops']:.0f} TFLOP/s at {best['shape']}"
        + (f" = {best['pct_of_peak']:.0f}% of {peak:.0f}" if peak else " (peak unknown)") + "; anchor 60%")
    if not ctx.cuda:
        key = f"dry run: {len(eager)} eager + {len(variants)} compiled variants ran (CPU timings meaningless)"
    return {"ok": ok, "device": name, "torch": torch.__version__, "peak_bf16_dense_tflops": peak, "anchors": ANCHORS,
            "compiled_all_variants": compiled_all, "errors": len(errors), "key": key}
