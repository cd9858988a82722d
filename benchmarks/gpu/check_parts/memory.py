"""Part 5 of ``benchmarks/gpu/check.py``, ``memory``: ``max_memory_allocated`` against stock FSDP2
at equal settings (W=1, bf16 compute, fp32 reduction, AdamW), with and without the hook; passes
when matrixfsdp's peak is at most ``FSDP2's * MEM_FACTOR + MEM_SLACK`` (1.10 and 64 MiB)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from .core import Ctx, bf16_mp, lm_loss, shard_decoder, tiny_decoder, tokens_for, w1_group

#: matrixfsdp's peak may exceed FSDP2's by this factor plus this slack
MEM_FACTOR, MEM_SLACK = 1.10, 64 << 20


def part_memory(ctx: Ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

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
    with w1_group(ctx.backend, dev):
        mesh = init_device_mesh(dev.type, (1,))
        cfg, base = tiny_decoder(0, **size)
        # equal settings: bf16 compute and fp32 reduction on both (FSDP2 then copies parameters
        # into its bf16 all-gather buffers, matrixfsdp into its cast buffers), the same AdamW
        for name in ("fsdp2", "matrixfsdp", "matrixfsdp+hook"):
            model = copy.deepcopy(base).to(dev)
            if name == "fsdp2":
                mp = TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for layer in model.model.layers:
                    torch_fully_shard(layer, mesh=mesh, mp_policy=mp)
                torch_fully_shard(model, mesh=mesh, mp_policy=mp)
            else:
                shard_decoder(model, mesh, mp_policy=bf16_mp())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            if ctx.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            with force_collectives() if name.endswith("hook") else contextlib.nullcontext():
                for step in range(steps):
                    lm_loss(model, tokens_for(cfg, step, dev, shape)).backward()
                    opt.step()
                    opt.zero_grad()
            row: dict[str, Any] = {"run": name}
            if ctx.cuda:
                torch.cuda.synchronize()
                row["max_memory_allocated"] = torch.cuda.max_memory_allocated()
                row["num_alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - before
            if name != "fsdp2":
                states = [get_state(model), *(get_state(layer) for layer in model.model.layers)]
                row["temp_bytes_peak_max"] = max(s.group.temp_bytes_peak for s in states)
                row["held_bytes_peak_sum"] = sum(s.group.held_bytes_peak for s in states)
            out[name] = ctx.row(steps=steps, **row)
            del model, opt
            if ctx.cuda:
                torch.cuda.empty_cache()
    if not ctx.cuda:
        return {"ok": True, "dry": True, "steps": steps, "results": out,
                "key": "dry run: the three runs ran (no CUDA peak on the CPU)"}
    ref = out["fsdp2"]["max_memory_allocated"]
    limit = ref * MEM_FACTOR + MEM_SLACK
    ratios = {k: out[k]["max_memory_allocated"] / ref for k in ("matrixfsdp", "matrixfsdp+hook")}
    ok = all(out[k]["max_memory_allocated"] <= limit for k in ratios)
    return {"ok": ok, "steps": steps, "results": out, "threshold": f"peak <= FSDP2 * {MEM_FACTOR} + {MEM_SLACK >> 20} MiB",
            "limit_bytes": limit, "ratios": ratios,
            "key": f"peak/FSDP2 {ratios['matrixfsdp']:.3f} (hook {ratios['matrixfsdp+hook']:.3f}); FSDP2 "
                   f"{ref / 2**20:.0f} MiB; limit x{MEM_FACTOR}+{MEM_SLACK >> 20}MiB"}
