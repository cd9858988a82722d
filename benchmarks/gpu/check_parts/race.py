"""Part 1 of ``benchmarks/gpu/check.py``, ``race``: ``fully_shard`` (bf16 compute, fp32 reduction)
+ Muon, stepping every iteration, compared once at the end: with every side stream delayed by
``torch.cuda._sleep`` after its wait against without (bitwise, deterministic kernels), with the
hook against without it (bitwise), and the update against an unsharded fp32 run (a sanity bound);
the process group's calls counted (sequence number) and NCCL's device work seen by the profiler.
The driver runs it again under ``TORCH_CUDA_SANITIZER=1`` (``race-sanitizer``, full mode)."""

from __future__ import annotations

import contextlib
import copy
import os
import time
from typing import Callable

import torch

from .core import (Ctx, bf16_mp, delta, device_sync, lm_loss, local_tensor, pg_sequence, rel_err, shard_decoder,
                   tiny_decoder, tokens_for, w1_group)


def _sleepy_streams(cycles: int) -> Callable[[], None]:
    """Make every side stream sleep after its wait for the compute stream (CUDA): the compute
    stream runs ahead, so a missing wait or a buffer freed too early changes the bits. Patches the
    engine's ``CommContext.use`` in this check process only; returns the undo."""
    from matrixfsdp.engine.streams import CommContext

    orig = CommContext.use

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

    CommContext.use = use
    return lambda: setattr(CommContext, "use", orig)


def _nccl_device_events(fn: Callable[[], None]) -> dict:
    """Device activities with "nccl" in their name during ``fn`` (torch.profiler, CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        nccl = sorted({n for n in names if "nccl" in n.lower()})
        return {"nccl_device_events": sum("nccl" in n.lower() for n in names), "nccl_kernels": nccl[:8],
                "device_events": len(names)}
    except Exception as e:  # a profiler without CUPTI: the sequence number still counts the calls
        return {"profiler_error": f"{type(e).__name__}: {e}"[:200]}


def part_race(ctx: Ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp
    from matrixfsdp.comm.collectives import force_collectives

    dev = ctx.dev
    steps = ctx.steps(20, 8, 3)
    if ctx.cuda:  # bitwise comparisons between two runs need deterministic kernels
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: an op without a deterministic kernel warns (the bitwise test then says so)
        # instead of killing the part
        torch.use_deterministic_algorithms(True, warn_only=True)
    with w1_group(ctx.backend, dev):
        mesh = init_device_mesh(dev.type, (1,))
        pg = mesh.get_group()
        cfg, base = tiny_decoder(0)
        batches = [tokens_for(cfg, s, dev) for s in range(steps)]
        init = {n: p.detach().double().cpu() for n, p in base.named_parameters()}
        runs: dict[str, dict] = {}
        # "no hook": the W=1 short-cuts (no collective), the bits the hook must not change
        # (the CPU has no streams to delay: "delayed" would repeat "plain")
        for name, cycles in (("plain", 0), ("delayed", 20_000_000), ("no hook", 0)):
            if name == "delayed" and not ctx.cuda:
                runs[name] = runs["plain"]
                continue
            model = shard_decoder(copy.deepcopy(base).to(dev), mesh, mp_policy=bf16_mp())
            opt = matrixfsdp.optim.Muon(model, lr=0.02)
            undo = _sleepy_streams(cycles) if cycles else (lambda: None)
            s0, t0 = pg_sequence(pg), time.perf_counter()
            try:
                with force_collectives() if name != "no hook" else contextlib.nullcontext():
                    for s in range(steps):  # no host read per step: iterations may overlap
                        lm_loss(model, batches[s]).backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    device_sync(dev)
            finally:
                undo()
            calls = delta(s0, pg_sequence(pg))
            runs[name] = {"params": {n: local_tensor(p).detach().double().cpu() for n, p in model.named_parameters()},
                          "pg_calls": calls}
            ctx.row(run=name, steps=steps, sleep_cycles=cycles, pg_calls=calls,
                    wall_s=round(time.perf_counter() - t0, 2))
            if name == "plain" and ctx.cuda and not os.environ.get("TORCH_CUDA_SANITIZER"):
                def one_step():
                    with force_collectives():
                        lm_loss(model, batches[0]).backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                runs["profile"] = _nccl_device_events(one_step)
                ctx.row(run="profile one step", **runs["profile"])
        ref = copy.deepcopy(base).to(dev)
        ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02)
        for s in range(steps):
            lm_loss(ref, batches[s]).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        refp = {n: p.detach().double().cpu() for n, p in ref.named_parameters()}
    bitwise = all(torch.equal(runs["delayed"]["params"][n], runs["plain"]["params"][n]) for n in refp)
    hook_bitwise = all(torch.equal(runs["no hook"]["params"][n], runs["plain"]["params"][n]) for n in refp)
    # the whole update (all parameters' change) against the unsharded fp32 run's, relative; per
    # parameter the small AdamW-stepped norms flip signs under bf16 noise (0.25 on the CPU)
    names = sorted(refp)
    mine = torch.cat([(runs["plain"]["params"][n] - init[n]).reshape(-1) for n in names])
    theirs = torch.cat([(refp[n] - init[n]).reshape(-1) for n in names])
    worst = rel_err(mine, theirs)
    per_param = {n: rel_err(runs["plain"]["params"][n] - init[n], refp[n] - init[n]) for n in names}
    worst_name = max(per_param, key=per_param.get)
    # a sanity bound (bf16 compute against fp32; 0.094 measured on the CPU after 3 steps): the
    # bitwise comparisons are the test, this catches a run that trains on garbage
    tol = 0.25
    called = bool(runs["plain"]["pg_calls"]) and bool(runs["delayed"]["pg_calls"]) and runs["no hook"]["pg_calls"] == 0
    ok = bitwise and hook_bitwise and worst < tol and called
    return {"ok": ok, "steps": steps, "streams": ctx.cuda, "delayed_equals_plain_bitwise": bitwise,
            "hook_equals_no_hook_bitwise": hook_bitwise,
            "update_rel_err_vs_unsharded": worst, "worst_param": worst_name,
            "worst_param_rel_err": per_param[worst_name], "tolerance": tol,
            "pg_calls": {k: runs[k]["pg_calls"] for k in ("plain", "delayed", "no hook")}, "profile": runs.get("profile"),
            "key": f"delayed==plain {bitwise}, hook==no-hook {hook_bitwise}, upd_err={worst:.3g}, "
                   f"pg_calls={runs['plain']['pg_calls']}"
                   + (f" nccl_dev={runs['profile'].get('nccl_device_events')}" if "profile" in runs else "")}
