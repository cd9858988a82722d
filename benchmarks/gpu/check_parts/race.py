"""Part 1 of ``benchmarks/gpu/check.py``, ``race``: ``fully_shard`` (bf16 compute, fp32 reduction)
+ Muon, stepping every iteration, compared once at the end: with every side stream delayed by
``torch.cuda._sleep`` after its wait against without (bitwise, deterministic kernels), with the
hook against without it (bitwise), and against two unsharded references run the same steps: one
that mirrors the mixed precision by hand (bf16 copies of fp32 parameters for forward/backward,
their gradients cast to fp32 for the step: the same arithmetic, so bitwise on the CPU; on a GPU
bitwise unless cuBLAS picks other kernels for the flat buffers' views) and a plain fp32 one; the
process group's calls counted (sequence number) and NCCL's device work seen by the profiler.
``race_sanitizer`` (full mode, the last part: the sanitizer cannot be switched off) runs it again
for 3 steps under torch's CUDA sanitizer.

The tolerance against the references, for ``n`` steps: ``RACE_TOL_FIRST + RACE_TOL_PER_STEP *
(n - 1)``. Derivation: bf16 compute against fp32 (the plain reference) is the largest honest
difference (every op rounded to 8 bits against 24; kernels that differ only in accumulation order
perturb less). Measured on the CPU (tiny decoder, Muon lr 0.02, 20 steps; `update rel err` of all
parameters' change): 0.093 after step 1, each further step adding at most 0.018 (0.351 after 20;
the trajectories diverge, so the error grows with the steps, about linearly). The bounds take 1.6x
and 1.4x of those: 0.15 and 0.025 per step, 0.625 at 20 steps, 0.2 at 3. A run that trains on
garbage (a stale or unreduced gradient, an update into the wrong matrix) has a relative error near
or above 1 (1 exactly for no update at all), so the bound must stay below 1: at most 34 steps."""

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


#: the tolerance against the references: first step, and each further step (module docstring)
RACE_TOL_FIRST, RACE_TOL_PER_STEP = 0.15, 0.025


def race_tolerance(steps: int) -> float:
    """The relative-error bound for ``steps`` steps; refused where it could not catch garbage."""
    tol = RACE_TOL_FIRST + RACE_TOL_PER_STEP * (steps - 1)
    if steps < 1 or tol >= 1.0:
        raise ValueError(f"race_tolerance: steps must be 1..34 (the bound {tol:.3f} must stay below 1 to "
                         f"catch a run that trains on garbage), got {steps}")
    return tol


def _unsharded(base, batches, dev: torch.device, bf16: bool) -> dict:
    """Parameters after the same steps unsharded: fp32 throughout, or (``bf16``) forward and
    backward on a bf16 copy of the fp32 parameters, its gradients cast to fp32 for the step (what
    ``MixedPrecisionPolicy(bf16, reduce fp32)`` does at W=1: the reduction of one rank is its input)."""
    import matrixfsdp

    ref = copy.deepcopy(base).to(dev)
    opt = matrixfsdp.optim.Muon(ref, lr=0.02)
    low = copy.deepcopy(base).to(dev, torch.bfloat16) if bf16 else None
    pairs = list(zip(ref.parameters(), low.parameters())) if low is not None else []
    for tokens in batches:
        if low is None:
            lm_loss(ref, tokens).backward()
        else:
            with torch.no_grad():
                for p, q in pairs:
                    q.copy_(p)  # round to nearest, as the engine's cast
            lm_loss(low, tokens).backward()
            for p, q in pairs:
                p.grad, q.grad = q.grad.float(), None
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().double().cpu() for n, p in ref.named_parameters()}


def part_race(ctx: Ctx) -> dict:
    dev = ctx.dev
    steps = ctx.steps(20, 8, 3)
    tol = race_tolerance(steps)
    if ctx.sanitizer:  # for the rest of this process: the driver runs this part last
        from torch.cuda._sanitizer import enable_cuda_sanitizer

        enable_cuda_sanitizer()
    det = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    if ctx.cuda:  # bitwise comparisons between two runs need deterministic kernels
        # (check.py sets CUBLAS_WORKSPACE_CONFIG before CUDA starts: cuBLAS reads it then)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: an op without a deterministic kernel warns (the bitwise test then says so)
        # instead of killing the part
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _race(ctx, dev, steps, tol)
    finally:  # the next part in this process times kernels as they are by default
        torch.use_deterministic_algorithms(det[0], warn_only=det[1])


def _race(ctx: Ctx, dev: torch.device, steps: int, tol: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp
    from matrixfsdp.comm.collectives import force_collectives

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
            if name == "plain" and ctx.cuda and not ctx.sanitizer:
                def one_step():
                    with force_collectives():
                        lm_loss(model, batches[0]).backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                runs["profile"] = _nccl_device_events(one_step)
                ctx.row(run="profile one step", **runs["profile"])
        refs = {"bf16": _unsharded(base, batches, dev, bf16=True), "fp32": _unsharded(base, batches, dev, bf16=False)}
    names = sorted(init)
    bitwise = all(torch.equal(runs["delayed"]["params"][n], runs["plain"]["params"][n]) for n in names)
    hook_bitwise = all(torch.equal(runs["no hook"]["params"][n], runs["plain"]["params"][n]) for n in names)
    # the whole update (all parameters' change) against each reference's, relative: per parameter
    # the small AdamW-stepped norms flip signs under bf16 noise
    mine = torch.cat([(runs["plain"]["params"][n] - init[n]).reshape(-1) for n in names])
    vs: dict[str, dict] = {}
    for kind, refp in refs.items():
        theirs = torch.cat([(refp[n] - init[n]).reshape(-1) for n in names])
        err = rel_err(mine, theirs)
        vs[kind] = {"bitwise": all(torch.equal(runs["plain"]["params"][n], refp[n]) for n in names),
                    "update_rel_err": err, "within_tolerance": err <= tol}
        ctx.row(run=f"vs unsharded {kind}", steps=steps, tolerance=tol, **vs[kind])
    called = bool(runs["plain"]["pg_calls"]) and bool(runs["delayed"]["pg_calls"]) and runs["no hook"]["pg_calls"] == 0
    # on the CPU the bf16 mirror is the same arithmetic: bitwise required there
    mirror_ok = vs["bf16"]["bitwise"] or (ctx.cuda and vs["bf16"]["within_tolerance"])
    ok = bitwise and hook_bitwise and called and mirror_ok and vs["fp32"]["within_tolerance"]
    return {"ok": ok, "steps": steps, "streams": ctx.cuda, "sanitizer": ctx.sanitizer,
            "delayed_equals_plain_bitwise": bitwise, "hook_equals_no_hook_bitwise": hook_bitwise,
            "vs_unsharded": vs, "update_rel_err_vs_unsharded": vs["fp32"]["update_rel_err"], "tolerance": tol,
            "tolerance_rule": f"{RACE_TOL_FIRST} + {RACE_TOL_PER_STEP} * (steps - 1)",
            "pg_calls": {k: runs[k]["pg_calls"] for k in ("plain", "delayed", "no hook")}, "profile": runs.get("profile"),
            "key": f"delayed==plain {bitwise}, hook==no-hook {hook_bitwise}, ==bf16 mirror {vs['bf16']['bitwise']} "
                   f"(err {vs['bf16']['update_rel_err']:.2g}), fp32 err {vs['fp32']['update_rel_err']:.3g} <= {tol:.3g}, "
                   f"pg_calls={runs['plain']['pg_calls']}"
                   + (f" nccl_dev={runs['profile'].get('nccl_device_events')}" if "profile" in runs else "")}
