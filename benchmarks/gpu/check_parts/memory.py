"""Part 5 of ``benchmarks/gpu/check.py``, ``memory``: ``max_memory_allocated`` against stock FSDP2
at equal settings (W=1, bf16 compute, fp32 reduction, AdamW), with and without the hook; passes
when matrixfsdp's peak is at most ``FSDP2's * MEM_FACTOR + MEM_SLACK`` (1.10 and 64 MiB). Each
run's peak is measured above a baseline: the allocated bytes before its model is built, once the
previous run's model is freed (no reference left, the hooks' cycles collected, the cache emptied;
a weak reference checks that it is gone) and the peak statistics reset after the build. Earlier
parts in the same process therefore do not count."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from typing import Any

import torch

from .core import Ctx, bf16_mp, lm_loss, shard_decoder, tiny_decoder, tokens_for, w1_group

#: matrixfsdp's peak may exceed FSDP2's by this factor plus this slack
MEM_FACTOR, MEM_SLACK = 1.10, 64 << 20


def _release(dev: torch.device) -> None:
    """Collect unreachable objects (the hooks' reference cycles) and give cached blocks back."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def _stock_fsdp2(model, mesh) -> None:
    """Stock FSDP2 per layer, then the root (in a function: a loop variable left bound to the last
    layer would keep the whole model alive through the layers' shared FSDP state)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        torch_fully_shard(layer, mesh=mesh, mp_policy=mp)
    torch_fully_shard(model, mesh=mesh, mp_policy=mp)


def part_memory(ctx: Ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from matrixfsdp._fully_shard import get_state
    from matrixfsdp.comm.collectives import force_collectives

    dev = ctx.dev
    steps = ctx.steps(20, 8, 2)
    if ctx.cuda:
        size = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4 if not ctx.quick else 2,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=32768)
        shape = (4, 256)
    else:
        size, shape = {}, (2, 16)
    out: dict[str, Any] = {}
    freed: dict[str, bool] = {}
    with w1_group(ctx.backend, dev):
        mesh = init_device_mesh(dev.type, (1,))
        cfg, base = tiny_decoder(0, **size)  # on the CPU: each run's copy is the only one on the device
        # equal settings: bf16 compute and fp32 reduction on both (FSDP2 then copies parameters
        # into its bf16 all-gather buffers, matrixfsdp into its cast buffers), the same AdamW
        for name in ("fsdp2", "matrixfsdp", "matrixfsdp+hook"):
            _release(dev)  # what earlier parts and runs left, before the baseline
            row: dict[str, Any] = {"run": name}
            if ctx.cuda:
                row["baseline_allocated"] = base0 = torch.cuda.memory_allocated(dev)
            model = copy.deepcopy(base).to(dev)
            if name == "fsdp2":
                _stock_fsdp2(model, mesh)
            else:
                shard_decoder(model, mesh, mp_policy=bf16_mp())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            if ctx.cuda:
                torch.cuda.synchronize(dev)
                row["built_allocated"] = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)  # the peak from here: this run's only
                before = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0)
            with force_collectives() if name.endswith("hook") else contextlib.nullcontext():
                for step in range(steps):
                    lm_loss(model, tokens_for(cfg, step, dev, shape)).backward()
                    opt.step()
                    opt.zero_grad()
            if ctx.cuda:
                torch.cuda.synchronize(dev)
                # the run's footprint: its peak above what was allocated before it was built
                # (parameters, gradients, optimizer state, buffers, activations)
                row["peak_above_baseline"] = torch.cuda.max_memory_allocated(dev) - base0
                row["num_alloc_retries"] = torch.cuda.memory_stats(dev).get("num_alloc_retries", 0) - before
            if name != "fsdp2":
                states = [get_state(model), *(get_state(layer) for layer in model.model.layers)]
                row["temp_bytes_peak_max"] = max(s.group.temp_bytes_peak for s in states)
                row["held_bytes_peak_sum"] = sum(s.group.held_bytes_peak for s in states)
                del states  # holds the model's states: the model would outlive its run
            # freed before the next run's baseline: no reference left here, the hooks' cycles
            # (module -> hook -> state -> module) collected by _release; checked, not assumed
            alive = weakref.ref(model)
            del model, opt
            _release(dev)
            freed[name] = alive() is None
            row["model_freed"] = freed[name]
            if ctx.cuda:
                row["left_allocated_after_free"] = torch.cuda.memory_allocated(dev) - base0
            out[name] = ctx.row(steps=steps, **row)
    all_freed = all(freed.values())
    if not ctx.cuda:
        return {"ok": all_freed, "dry": True, "steps": steps, "results": out, "models_freed": freed,
                "key": f"dry run: the three runs ran, each model freed after its run: {all_freed} "
                       "(no CUDA peak on the CPU)"}
    ref = out["fsdp2"]["peak_above_baseline"]
    limit = ref * MEM_FACTOR + MEM_SLACK
    ratios = {k: out[k]["peak_above_baseline"] / ref for k in ("matrixfsdp", "matrixfsdp+hook")}
    ok = all(out[k]["peak_above_baseline"] <= limit for k in ratios) and all_freed
    return {"ok": ok, "steps": steps, "results": out, "models_freed": freed,
            "threshold": f"peak above baseline <= FSDP2's * {MEM_FACTOR} + {MEM_SLACK >> 20} MiB",
            "limit_bytes": limit, "ratios": ratios,
            "key": f"peak/FSDP2 {ratios['matrixfsdp']:.3f} (hook {ratios['matrixfsdp+hook']:.3f}); FSDP2 "
                   f"{ref / 2**20:.0f} MiB above baseline; limit x{MEM_FACTOR}+{MEM_SLACK >> 20}MiB; "
                   f"models freed {all_freed}"}
