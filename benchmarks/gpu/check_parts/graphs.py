"""Part 6 of ``benchmarks/gpu/check.py``, ``compile``: the capturable, batched Muon with a 0-dim
device lr under ``LambdaLR`` on a W=1 ``fully_shard`` model: eager against
``torch.compile(opt.step)`` and against a replayed ``torch.cuda.graph`` of the step; frames
compiled and graph breaks reported; it fails unless at least one frame compiled (with none the
"compiled" run is eager, and equal to eager by default). (Named ``graphs``, not ``compile``: that name is the
builtin's and ``torch.compile``'s.)"""

from __future__ import annotations

import copy
import time
import traceback
from typing import Any, Callable

import torch

from .core import Ctx, device_sync, lm_loss, local_tensor, rel_err, shard_decoder, tiny_decoder, tokens_for, w1_group


def part_compile(ctx: Ctx) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp

    dev = ctx.dev
    steps = ctx.steps(6, 4, 3)
    backend = "inductor" if ctx.cuda else "eager"  # the dry run traces (dynamo) without lowering
    tol = 1e-4 if ctx.cuda else 1e-6  # inductor fuses pointwise ops (last-bit differences)
    res: dict[str, Any] = {}
    with w1_group(ctx.backend, dev):
        mesh = init_device_mesh(dev.type, (1,))
        cfg, base = tiny_decoder(0, num_hidden_layers=1)
        batches = [tokens_for(cfg, s, dev, (2, 16)) for s in range(steps)]

        def run(how: str) -> dict:
            model = shard_decoder(copy.deepcopy(base).to(dev), mesh)
            opt = matrixfsdp.optim.Muon(model, lr=torch.tensor(0.02, device=dev), capturable=True, batched=True,
                                        ns_dtype=torch.float32)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
            info: dict[str, Any] = {}
            step: Callable[[], Any] = opt.step
            graph = None
            for s in range(steps):
                # in-place zeroing keeps the gradient tensors (a captured graph reads them); the
                # backward adds into zeros, the same bits as a fresh gradient
                opt.zero_grad(set_to_none=False)
                lm_loss(model, batches[s]).backward()
                if s == 0 and how == "graph":
                    # the first step creates the state; on a side stream it is also the warm-up
                    # torch.cuda.graph asks for (the same kernels as eager's first step)
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        opt.step()
                    torch.cuda.current_stream().wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):  # captured, not run: the replays run it
                        opt.step()
                elif s == 0 or how == "eager":
                    opt.step()  # the first step creates the state, eagerly
                    if s == 0 and how == "compiled":
                        torch._dynamo.reset()
                        counters.clear()
                        counter = CompileCounterWithBackend(backend)
                        step = torch.compile(opt.step, backend=counter)
                elif how == "compiled":
                    step()
                else:
                    graph.replay()  # type: ignore[union-attr]
                sched.step()
            device_sync(dev)
            if how == "compiled":
                info.update(frames=counter.frame_count, unique_graphs=counters["stats"]["unique_graphs"],
                            graph_breaks={r: n for r, n in counters["graph_break"].items()
                                          if "lr_scheduler.py" not in r})
            info["lr_device"] = str(opt.param_groups[0]["lr"].device)
            info["params"] = {n: local_tensor(p).detach().double().cpu() for n, p in model.named_parameters()}
            return info

        t0 = time.perf_counter()
        eager = run("eager")
        ctx.row(run="eager", lr_device=eager["lr_device"], wall_s=round(time.perf_counter() - t0, 1))
        for how in ("graph", "compiled"):  # the slow compile last: a timeout keeps the graph's row
            if how == "graph" and not ctx.cuda:
                res[how] = {"status": "skipped: CUDA graphs need CUDA"}
                ctx.row(run=how, **res[how])
                continue
            t0 = time.perf_counter()
            try:
                r = run(how)
                diff = max(rel_err(r["params"][n], eager["params"][n]) for n in eager["params"])
                r.pop("params")
                res[how] = {"ok": diff <= tol, "max_rel_diff_vs_eager": diff, **r}
            except Exception as e:
                res[how] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400],
                            "traceback": traceback.format_exc()[-1500:]}
            res[how]["wall_s"] = round(time.perf_counter() - t0, 1)
            ctx.row(run=how, **res[how])
    comp = res["compiled"]
    # at least one frame compiled: with none, "compiled" ran eagerly and its equality with eager
    # would show nothing; at most two (the step, and the scheduler's lr update it calls)
    frames = comp.get("frames", 0)
    ok = bool(comp.get("ok")) and 1 <= frames <= 2 and not comp.get("graph_breaks") \
        and res["graph"].get("ok", not ctx.cuda)
    key = (f"frames={comp.get('frames')} breaks={len(comp.get('graph_breaks') or {})} "
           f"compiled diff={comp.get('max_rel_diff_vs_eager', float('nan')):.2g} "
           f"graph diff={res['graph'].get('max_rel_diff_vs_eager', 'n/a')}")
    return {"ok": ok, "steps": steps, "backend": backend, "tolerance": tol, "results": res, "key": key}
