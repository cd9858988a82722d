"""The prepared GPU check of issue 19: one command, one CUDA GPU, at most 8 minutes, one folder.

    python benchmarks/gpu/check.py [--out benchmarks/results/gpu/<date>] [--parts race,smoke,...]

Parts (each in its own subprocess, with its own process group at W=1 and its own time limit;
results in ``<out>/<part>*.json``, a summary in ``<out>/summary.json``):

1. ``race``: ``fully_shard`` with bf16/fp32 mixed precision under NCCL, 20 steps, gradients
   compared bitwise against the same run without delays and within bf16 error against an
   unsharded fp32 copy, while ``CommContext.use`` is patched to enqueue ``torch.cuda._sleep`` on
   the side streams after their waits (a reduction copy-in on the reduce stream, issue 19 item 1,
   then reads freed gradients). Run once more under ``TORCH_CUDA_SANITIZER=1``.
2. ``smoke``: every API that touches collectives (``fully_shard`` with each collectives option,
   ``replicate`` stage 1 and 2, clipping with no gradients, checkpoint save/load, HF
   ``save_pretrained`` when ``transformers`` is installed, ``full_tensor``), under
   ``init_process_group("nccl")`` and ``"cpu:gloo,cuda:nccl"``.
3. ``sync_debug``: ``torch.cuda.set_sync_debug_mode("error")`` over forward, backward and step with
   one parameter unused, for Muon, Shampoo and SOAP (including a preconditioner refresh).
4. ``kernels``: Newton-Schulz per Qwen3 shape in bf16, fp32 and TF32 (loop, batched, compiled);
   ``eigh`` and ``qr`` from 1024 to 8192 in fp32 and fp64. Written for the planner's cost model.
5. ``memory``: W=1 against stock FSDP2: ``max_memory_allocated`` over 20 steps,
   ``num_alloc_retries``, and the runtime's temp/held-byte counters against the allocator.
6. ``compile``: ``torch.compile`` of a Muon step and a ``torch.cuda.graph`` capture of one.

Without CUDA the script says so, runs what a CPU can run (``race`` without streams, as a
parity check, and ``smoke`` under gloo at W=1), reports the GPU-only parts as skipped and exits 0
unless a part that ran failed. ``tests/bench/test_gpu_check.py`` runs it that way in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

PARTS = ("race", "smoke", "sync_debug", "kernels", "memory", "compile")
GPU_ONLY = {"sync_debug", "kernels", "memory", "compile"}
#: seconds per part (the sum stays under 8 minutes with the sanitizer rerun)
LIMITS = {"race": 60, "race_sanitizer": 60, "smoke": 90, "sync_debug": 45, "kernels": 120,
          "memory": 45, "compile": 60}
ROOT = Path(__file__).resolve().parents[2]


# ============================================================================ process group
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _group(backend: str):
    """A W=1 process group (``backend`` may be a composite ``"cpu:gloo,cuda:nccl"``)."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    kw = {"device_id": torch.device("cuda", 0)} if "nccl" in backend else {}
    dist.init_process_group(backend, rank=0, world_size=1, **kw)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _tiny_decoder(seed: int = 0, **over: Any):
    import dataclasses

    from matrixfsdp.models.decoder import PRESETS, Decoder

    torch.manual_seed(seed)
    cfg = dataclasses.replace(PRESETS["tiny"], **over)
    return cfg, Decoder(cfg)


def _shard(model, mesh, plan=None, **kw):
    import matrixfsdp
    from matrixfsdp.models.decoder import DecoderLayer

    if plan is None:
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(DecoderLayer,))
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan, **kw)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan, **kw)
    return model


def _loss(model, tokens):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             tokens.roll(-1, 1).reshape(-1))


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


# ============================================================================ 1. stream race
def _sleepy_streams(cycles: int):
    """Patch ``CommContext.use`` so every side stream sleeps after its wait (on CUDA)."""
    from matrixfsdp._fully_shard import param_group

    orig = param_group.CommContext.use

    def use(self, stream):
        cm = orig(self, stream)
        if stream is None:
            return cm

        @contextlib.contextmanager
        def delayed():
            with cm:
                torch.cuda._sleep(cycles)
                yield
        return delayed()

    param_group.CommContext.use = use
    return lambda: setattr(param_group.CommContext, "use", orig)


def part_race(backend: str) -> dict:
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from matrixfsdp import MixedPrecisionPolicy

    steps = int(os.environ.get("MATRIXFSDP_CHECK_STEPS", "20"))
    dev = _device()
    on_cuda = dev.type == "cuda"
    if on_cuda:  # bitwise comparisons between two runs need deterministic kernels
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    with _group(backend):
        mesh = init_device_mesh(dev.type, (1,))
        cfg, base = _tiny_decoder(0)
        ref = copy.deepcopy(base).to(dev)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_cuda \
            else MixedPrecisionPolicy()
        runs = {}
        for name, cycles in (("plain", 0), ("delayed", 50_000_000 if on_cuda else 0)):
            model = _shard(copy.deepcopy(base).to(dev), mesh, mp_policy=mp)
            undo = _sleepy_streams(cycles) if cycles else (lambda: None)
            grads = []
            try:
                for step in range(steps):
                    tokens = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(step)).to(dev)
                    _loss(model, tokens).backward()
                    grads.append({n: _local(p.grad).detach().float().cpu().clone()
                                  for n, p in model.named_parameters() if p.grad is not None})
                    model.zero_grad(set_to_none=True)
            finally:
                undo()
            runs[name] = grads
        worst_ref = 0.0
        bitwise = True
        for step in range(steps):
            tokens = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(step)).to(dev)
            _loss(ref, tokens).backward()
            for n, p in ref.named_parameters():
                g = runs["delayed"][step][n]
                bitwise &= torch.equal(g, runs["plain"][step][n])
                r = p.grad.float().cpu()
                worst_ref = max(worst_ref, ((g - r).norm() / (r.norm() + 1e-12)).item())
            ref.zero_grad(set_to_none=True)
    tol = 5e-2 if on_cuda else 1e-5
    return {"ok": bool(bitwise and worst_ref < tol), "steps": steps, "streams": on_cuda,
            "delayed_equals_plain_bitwise": bool(bitwise), "worst_rel_err_vs_unsharded": worst_ref,
            "tolerance": tol, "mixed_precision": "bf16/fp32" if on_cuda else "none (CPU)"}


# ============================================================================ 2. API smoke
def part_smoke(backend: str) -> dict:
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp

    dev = _device()
    checks: dict[str, str] = {}

    def check(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            checks[name] = "ok"
        except Exception as e:  # recorded, the other checks still run
            checks[name] = f"FAILED {type(e).__name__}: {e}"[:500]

    with _group(backend), tempfile.TemporaryDirectory() as tmp:
        mesh = init_device_mesh(dev.type, (1,))
        cfg, base = _tiny_decoder(0)
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).to(dev)

        for coll in ("all_to_all", "p2p", "two_phase"):
            def fs(coll=coll):
                model = _shard(copy.deepcopy(base).to(dev), mesh, collectives=coll)
                opt = matrixfsdp.optim.Muon(model, lr=0.02)
                for _ in range(2):
                    _loss(model, tokens).backward()
                    matrixfsdp.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
                norm = matrixfsdp.clip_grad_norm_(model.parameters(), 1.0)  # no gradients at all
                assert norm.device.type == dev.type and float(norm) == 0.0, norm
                full = matrixfsdp.full_tensor(model.lm_head.weight)
                assert full.shape == model.lm_head.weight.shape
                path = os.path.join(tmp, f"ckpt-{coll}")
                matrixfsdp.checkpoint.save(path, model, opt)
                matrixfsdp.checkpoint.load(path, model, opt)
            check(f"fully_shard[{coll}] fwd/bwd/step/clip/full_tensor/save/load", fs)

        for stage in (1, 2):
            def rep(stage=stage):
                model = matrixfsdp.replicate(copy.deepcopy(base).to(dev), mesh=mesh, stage=stage)
                opt = matrixfsdp.optim.Muon(model, lr=0.02)
                norm = matrixfsdp.clip_grad_norm_(model.parameters(), 1.0)  # before any backward
                assert norm.device.type == dev.type, norm
                for _ in range(2):
                    _loss(model, tokens).backward()
                    matrixfsdp.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    opt.zero_grad()
                path = os.path.join(tmp, f"ckpt-rep{stage}")
                matrixfsdp.checkpoint.save(path, model, opt)
                matrixfsdp.checkpoint.load(path, model, opt)
            check(f"replicate[stage={stage}] fwd/bwd/step/clip/save/load", rep)

        def hf():
            try:
                from transformers import Qwen3Config, Qwen3ForCausalLM
                from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer
            except ImportError:
                checks["hf save_pretrained"] = "skipped: transformers not installed"
                return
            hcfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16)
            model = Qwen3ForCausalLM(hcfg).to(dev)
            plan = matrixfsdp.plan_owners(model, mesh, block_types=(Qwen3DecoderLayer,))
            for layer in model.model.layers:
                matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
            matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
            matrixfsdp.checkpoint.save_pretrained(model, os.path.join(tmp, "hf"))
        check("hf save_pretrained", hf)
    ok = all(v == "ok" or v.startswith("skipped") for v in checks.values())
    return {"ok": ok, "backend": backend, "device": str(dev), "checks": checks}


# ============================================================================ 3. sync debug
def _with_unused(base):
    """The tiny decoder plus a root-level projection no forward uses."""
    base.unused = torch.nn.Linear(base.cfg.hidden_size, base.cfg.hidden_size, bias=False)
    return base


def part_sync_debug(backend: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp

    dev = _device()
    out: dict[str, Any] = {}
    with _group(backend):
        mesh = init_device_mesh(dev.type, (1,))
        for name, kw in (("Muon", dict(lr=0.02)),
                         ("Shampoo", dict(lr=3e-3, precondition_frequency=2, start_preconditioning_step=1)),
                         ("SOAP", dict(lr=3e-3, precondition_frequency=2))):
            cfg, base = _tiny_decoder(0)
            model = _shard(_with_unused(base).to(dev), mesh)
            opt = getattr(matrixfsdp.optim, name)(model, **kw)
            tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0)).to(dev)
            _loss(model, tokens).backward()  # warm-up: lazy state, first-step allocations
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            res = {"forward+backward": "ok", "step": "ok"}
            for step in range(3):  # precondition_frequency=2: steps 1 and 3 refresh
                for phase, fn in (("forward+backward", lambda: _loss(model, tokens).backward()),
                                  ("step", opt.step)):
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        fn()
                    except RuntimeError as e:
                        if res[phase] == "ok":
                            res[phase] = f"host sync at step {step}: {e}"[:400]
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                opt.zero_grad()
            out[name] = res
    ok = all(v == "ok" for r in out.values() for v in r.values())
    return {"ok": ok, "results": out}


# ============================================================================ 4. kernels
def _time_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _ns(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Quintic Newton-Schulz (Muon's coefficients) on a matrix or a batch of matrices."""
    a, b, c = 3.4445, -4.7750, 2.0315
    t = x.shape[-2] > x.shape[-1]
    if t:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = x @ x.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c) if A.ndim == 3 else torch.addmm(A, A, A, beta=b, alpha=c)
        x = torch.baddbmm(x, B, x, beta=a) if x.ndim == 3 else torch.addmm(x, B, x, beta=a)
    return x.mT if t else x


def part_kernels(backend: str) -> dict:
    dev = _device()
    rows: list[dict] = []
    shapes = [(4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096)]
    batch = 4
    compiled = torch.compile(_ns)
    for shape in shapes:
        for mode in ("bf16", "fp32", "tf32"):
            dt = torch.bfloat16 if mode == "bf16" else torch.float32
            torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
            xs = torch.randn(batch, *shape, device=dev, dtype=dt)
            m, n = min(shape), max(shape)
            flops = batch * 5 * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)
            for how, fn in (("loop", lambda: [_ns(x) for x in xs]), ("batched", lambda: _ns(xs)),
                            ("compiled", lambda: compiled(xs))):
                try:
                    ms = _time_ms(fn, 3)
                    rows.append({"op": "newton_schulz", "shape": shape, "batch": batch, "dtype": mode,
                                 "how": how, "ms": ms, "tflops": flops / ms / 1e9})
                except Exception as e:
                    rows.append({"op": "newton_schulz", "shape": shape, "dtype": mode, "how": how,
                                 "error": f"{type(e).__name__}: {e}"[:300]})
    torch.backends.cuda.matmul.allow_tf32 = False
    for n in (1024, 2048, 4096, 8192):
        for dt in (torch.float32, torch.float64):
            a = torch.randn(n, n, device=dev, dtype=dt)
            s = a @ a.mT + n * torch.eye(n, device=dev, dtype=dt)
            for op, fn in (("eigh", lambda: torch.linalg.eigh(s)), ("qr", lambda: torch.linalg.qr(a))):
                reps = 1 if n >= 4096 else 3
                rows.append({"op": op, "n": n, "dtype": str(dt).removeprefix("torch."),
                             "ms": _time_ms(fn, reps)})
    return {"ok": True, "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows,
            "note": "inputs for the planner's cost model (planner FLOP model assumes CPU behaviour)"}


# ============================================================================ 5. memory
def part_memory(backend: str, steps: int = 20) -> dict:
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from matrixfsdp._fully_shard import get_state

    dev = _device()
    out: dict[str, Any] = {}
    with _group(backend):
        mesh = init_device_mesh(dev.type, (1,))
        cfg, base = _tiny_decoder(0, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=32768)
        for name in ("matrixfsdp", "fsdp2"):
            model = copy.deepcopy(base).to(dev)
            if name == "matrixfsdp":
                _shard(model, mesh)
            else:
                for layer in model.model.layers:
                    torch_fully_shard(layer, mesh=mesh)
                torch_fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            for step in range(steps):
                tokens = torch.randint(0, cfg.vocab_size, (4, 256), generator=torch.Generator().manual_seed(step)).to(dev)
                _loss(model, tokens).backward()
                opt.step()
                opt.zero_grad()
            torch.cuda.synchronize()
            row = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
                   "num_alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - before}
            if name == "matrixfsdp":
                states = [get_state(model), *(get_state(layer) for layer in model.model.layers)]
                row["temp_bytes_peak_sum"] = sum(s.group.temp_bytes_peak for s in states)
                row["temp_bytes_peak_max"] = max(s.group.temp_bytes_peak for s in states)
                row["held_bytes_peak_sum"] = sum(s.group.held_bytes_peak for s in states)
            out[name] = row
            del model, opt
            torch.cuda.empty_cache()
    return {"ok": True, "steps": steps, "results": out}


# ============================================================================ 6. compile / graphs
def part_compile(backend: str) -> dict:
    import matrixfsdp

    dev = _device()
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    mods = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False)).to(dev)
    x = torch.randn(32, 256, device=dev)
    opt = matrixfsdp.optim.Muon(mods, lr=0.02)
    mods(x).square().mean().backward()
    try:
        step = torch.compile(opt.step)
        for _ in range(3):
            step()
        out["torch.compile(opt.step)"] = "ok"
    except Exception as e:
        out["torch.compile(opt.step)"] = f"FAILED {type(e).__name__}: {e}"[:400]
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            opt.step()  # warm-up on a side stream, as torch.cuda.graph requires
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            opt.step()
        g.replay()
        torch.cuda.synchronize()
        out["cuda graph capture of one Muon step"] = "ok"
    except Exception as e:
        out["cuda graph capture of one Muon step"] = f"FAILED {type(e).__name__}: {e}"[:400]
    return {"ok": all(v == "ok" for v in out.values()), "results": out}


WORKERS: dict[str, Callable[[str], dict]] = {
    "race": part_race, "smoke": part_smoke, "sync_debug": part_sync_debug, "kernels": part_kernels,
    "memory": part_memory, "compile": part_compile,
}


# ============================================================================ driver
def _run_worker(part: str, backend: str, out: Path, tag: str, limit: int, env: dict | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", part, "--backend", backend,
           "--out", str(out), "--tag", tag]
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), e.get("PYTHONPATH", "")])
    e.update(env or {})
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=limit)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        rc, tail = 124, f"timed out after {limit} s"
    res_file = out / f"{tag}.json"
    result = json.loads(res_file.read_text()) if res_file.exists() else {"ok": False}
    result.update({"rc": rc, "wall_s": round(time.monotonic() - t0, 2), "backend": backend})
    if rc != 0 or not result.get("ok"):
        result["log_tail"] = tail
    res_file.write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results/gpu/<date>)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tag", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out or ROOT / "benchmarks" / "results" / "gpu" / datetime.date.today().isoformat())
    out.mkdir(parents=True, exist_ok=True)

    if args.worker:  # one part in this process
        try:
            result = WORKERS[args.worker](args.backend)
        except Exception as e:
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        (out / f"{args.tag}.json").write_text(json.dumps(result, indent=1, default=str))
        return 0 if result.get("ok") else 1

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown part(s) {bad}; choose from {list(PARTS)}")
    cuda = torch.cuda.is_available()
    if not cuda:
        print("benchmarks/gpu/check.py: no CUDA device. Running the CPU-runnable parts (race as a "
              "parity check without streams, smoke under gloo at W=1); GPU-only parts are skipped.")
    summary: dict[str, Any] = {"cuda": cuda, "torch": torch.__version__, "started": datetime.datetime.now().isoformat(),
                               "device": torch.cuda.get_device_name(0) if cuda else "cpu", "parts": {}}
    t0 = time.monotonic()
    for part in parts:
        if part in GPU_ONLY and not cuda:
            summary["parts"][part] = "skipped: needs a CUDA GPU"
            continue
        backends = (["nccl", "cpu:gloo,cuda:nccl"] if part == "smoke" else ["nccl"]) if cuda else ["gloo"]
        for backend in backends:
            tag = part if len(backends) == 1 else f"{part}-{backend.replace(':', '_').replace(',', '+')}"
            r = _run_worker(part, backend, out, tag, LIMITS[part])
            summary["parts"][tag] = "passed" if r.get("ok") and r["rc"] == 0 else f"FAILED (rc={r['rc']}, see {tag}.json)"
        if part == "race" and cuda:
            r = _run_worker("race", "nccl", out, "race-sanitizer", LIMITS["race_sanitizer"],
                            env={"TORCH_CUDA_SANITIZER": "1", "MATRIXFSDP_CHECK_STEPS": "3"})
            summary["parts"]["race-sanitizer"] = "passed" if r.get("ok") and r["rc"] == 0 else \
                f"FAILED (rc={r['rc']}, see race-sanitizer.json)"
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for k, v in summary["parts"].items():
        print(f"  {k:<34} {v}")
    print(f"results in {out} ({summary['wall_s']} s)")
    return 1 if any(str(v).startswith("FAILED") for v in summary["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
