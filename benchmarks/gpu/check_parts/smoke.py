"""Part 2 of ``benchmarks/gpu/check.py``, ``smoke``: every API that touches collectives
(``fully_shard`` with each ``collectives=``, ``replicate`` stage 1 and 2, clipping,
``full_tensor``, checkpoint save/load, HF ``save_pretrained``) under ``"nccl"`` and
``"cpu:gloo,cuda:nccl"`` (one after the other in one process; the composite backend runs the
collectives' checks only); the 2-D meshes (1,1) (HSDP, TP), recording whether the replica phase
and the TP host step ran."""

from __future__ import annotations

import copy
import os
import tempfile
import time
from typing import Any, Callable

from .core import Ctx, bf16_mp, delta, lm_loss, pg_sequence, shard_decoder, tiny_decoder, tokens_for, w1_group


def part_smoke(ctx: Ctx) -> dict:
    """Under ``"nccl"``, then the composite ``"cpu:gloo,cuda:nccl"`` (its collectives' checks only),
    in this process one after the other; on the CPU under ``"gloo"``."""
    backends = ["nccl", "cpu:gloo,cuda:nccl"] if ctx.cuda else ["gloo"]
    per = {b: _smoke(ctx, b) for b in backends}
    first = per[backends[0]]
    checks = {f"{b}: {name}": v for b, r in per.items() for name, v in r["checks"].items()}
    ok = all(r["ok"] for r in per.values())
    key = ", ".join(f"{b} {r['n_ok']}/{len(r['checks'])} ok" for b, r in per.items())
    shown = first["shown_on_one_device"]
    return {"ok": ok, "device": str(ctx.dev), "backends": backends, "per_backend": per, "checks": checks,
            "shown_on_one_device": shown,
            "key": f"{key}; HSDP replica phase ran={shown['hsdp_replica_phase']}, TP host step ran={shown['tp_host_step']}"}


def _smoke(ctx: Ctx, backend: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp
    from matrixfsdp._fully_shard import comm_counter
    from matrixfsdp.comm.collectives import force_collectives

    dev = ctx.dev
    checks: dict[str, str] = {}
    info: dict[str, dict] = {}

    class Skip(Exception):
        pass

    def check(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        info[name] = {}
        try:
            info[name] = fn() or {}
            checks[name] = "ok"
        except Skip as e:
            checks[name] = f"skipped: {e}"
        except Exception as e:  # recorded, the other checks still run
            checks[name] = f"FAILED {type(e).__name__}: {e}"[:500]
        ctx.row(backend=backend, check=name, status=checks[name], wall_s=round(time.perf_counter() - t0, 2),
                **info[name])

    with w1_group(backend, dev), tempfile.TemporaryDirectory() as tmp, force_collectives():
        mesh = init_device_mesh(dev.type, (1,))
        pg = mesh.get_group()
        cfg, base = tiny_decoder(0)
        tokens = tokens_for(cfg, 0, dev, (2, 16))

        def train(model, opt, n=2):
            for _ in range(n):
                lm_loss(model, tokens).backward()
                matrixfsdp.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()

        for coll in ("all_to_all", "p2p", "two_phase"):
            def fs(coll=coll):
                model = shard_decoder(copy.deepcopy(base).to(dev), mesh, collectives=coll, mp_policy=bf16_mp())
                opt = matrixfsdp.optim.Muon(model, lr=0.02)
                s0 = pg_sequence(pg)
                train(model, opt)
                calls = delta(s0, pg_sequence(pg))
                if calls == 0:
                    raise RuntimeError("no collective reached the process group under force_collectives()")
                norm = matrixfsdp.clip_grad_norm_(model.parameters(), 1.0)  # no gradients at all
                if norm.device.type != dev.type or float(norm) != 0.0:
                    raise RuntimeError(f"clip_grad_norm_ without gradients gave {norm}")
                full = matrixfsdp.full_tensor(model.lm_head.weight)
                if full.shape != model.lm_head.weight.shape:
                    raise RuntimeError(f"full_tensor shape {tuple(full.shape)}")
                path = os.path.join(tmp, f"ckpt-{coll}")
                matrixfsdp.checkpoint.save(path, model, opt)
                matrixfsdp.checkpoint.load(path, model, opt)
                return {"pg_calls": calls}
            check(f"fully_shard[{coll}] fwd/bwd/step/clip/full_tensor/save/load", fs)

        for stage in (1, 2):
            def rep(stage=stage):
                model = matrixfsdp.replicate(copy.deepcopy(base).to(dev), mesh=mesh, stage=stage)
                opt = matrixfsdp.optim.Muon(model, lr=0.02)
                norm = matrixfsdp.clip_grad_norm_(model.parameters(), 1.0)  # before any backward
                if norm.device.type != dev.type:
                    raise RuntimeError(f"clip_grad_norm_ on {norm.device}")
                s0 = pg_sequence(pg)
                train(model, opt)
                path = os.path.join(tmp, f"ckpt-rep{stage}")
                matrixfsdp.checkpoint.save(path, model, opt)
                matrixfsdp.checkpoint.load(path, model, opt)
                return {"pg_calls": delta(s0, pg_sequence(pg))}
            check(f"replicate[stage={stage}] fwd/bwd/step/clip/save/load", rep)

        def hsdp():
            m2 = init_device_mesh(dev.type, (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
            model = shard_decoder(copy.deepcopy(base).to(dev), m2, mp_policy=bf16_mp())
            opt = matrixfsdp.optim.Muon(model, lr=0.02)
            counter = comm_counter(model, "replicate")
            counter.reset()
            train(model, opt)
            # the replica phase's all-reduce: the engine drops replicate groups of size 1
            return {"replica_phase_ran": counter.calls.get("all_reduce", 0) > 0,
                    "replicate_counter": dict(counter.calls)}
        second = backend != "nccl" and ctx.cuda  # the composite backend: the collectives' checks only
        if not second:
            check("fully_shard on a (dp_replicate=1, dp_shard=1) mesh", hsdp)

        def tp():
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            m2 = init_device_mesh(dev.type, (1, 1), mesh_dim_names=("dp_shard", "tp"))
            model = copy.deepcopy(base).to(dev)
            for layer in model.model.layers:
                parallelize_module(layer.mlp, m2["tp"], {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                         "down_proj": RowwiseParallel()})
            from matrixfsdp.models.decoder import DecoderLayer

            plan = matrixfsdp.plan_owners(model, m2, block_types=(DecoderLayer,))
            shard_decoder(model, m2["dp_shard"], plan=plan, mp_policy=bf16_mp())
            opt = matrixfsdp.optim.Muon(model, lr=0.02)
            train(model, opt)
            hosted = sum(matrixfsdp.tp.tp_host_of(p) is not None for p in model.parameters())
            return {"plan_tp": plan.tp, "tp_hosted_matrices": hosted, "tp_host_step_ran": hosted > 0}
        if not second:
            check("fully_shard + TP on a (dp_shard=1, tp=1) mesh", tp)

        def hf():
            try:
                from transformers import Qwen3Config, Qwen3ForCausalLM
                from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer
            except ImportError:
                raise Skip("transformers not installed") from None
            hcfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16)
            model = Qwen3ForCausalLM(hcfg).to(dev)
            plan = matrixfsdp.plan_owners(model, mesh, block_types=(Qwen3DecoderLayer,))
            for layer in model.model.layers:
                matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
            matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
            matrixfsdp.checkpoint.save_pretrained(model, os.path.join(tmp, "hf"))
            return None
        if not second:
            check("hf save_pretrained", hf)
    ok = all(v == "ok" or v.startswith("skipped") for v in checks.values())
    shown = {"hsdp_replica_phase": info.get("fully_shard on a (dp_replicate=1, dp_shard=1) mesh", {}).get("replica_phase_ran"),
             "tp_host_step": info.get("fully_shard + TP on a (dp_shard=1, tp=1) mesh", {}).get("tp_host_step_ran")}
    return {"ok": ok, "backend": backend, "checks": checks, "shown_on_one_device": shown,
            "n_ok": sum(v == "ok" for v in checks.values())}
