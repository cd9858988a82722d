"""The prepared one-GPU check (issues 19 and 29): one command, one CUDA GPU, at most 6 minutes.

    python benchmarks/gpu/check.py                 # all parts, part limits summing to 6 minutes
    python benchmarks/gpu/check.py --quick         # the same parts, smaller, limits summing to 3 minutes
    python benchmarks/gpu/check.py --device cpu --quick --inline   # the dry run CI runs (no GPU)

Results go to ``--out`` (default ``$OUT/gpu`` when ``$OUT`` is set, else
``benchmarks/results/gpu/<date>``): ``rows.jsonl`` gets every row as it is produced (appended and
flushed, so a part killed at its time limit keeps what it measured), ``<part>.json`` each part's
result, ``summary.json`` and ``summary.md`` the table printed at the end (part, status, key figure,
what it shows, what it cannot show). Each part runs in its own subprocess with its own process
group at W=1 and its own time limit (``--inline``: in this process, the limit checked afterwards).

At W=1 every collective of the engine short-cuts (a sum over one rank is its input), so without
help no NCCL call would run. The parts that exercise the engine run inside
``matrixfsdp.comm.collectives.force_collectives()``, a scoped test hook with which a one-rank group
still calls NCCL on the gather and reduce streams, with the short-cut's results bit for bit.

Parts:

1. ``race``: ``fully_shard`` (bf16 compute, fp32 reduction) + Muon, stepping every iteration,
   compared once at the end: with every side stream delayed by ``torch.cuda._sleep`` after its
   wait against without (bitwise, deterministic kernels), with the hook against without it
   (bitwise), and the update against an unsharded fp32 run (a sanity bound); the process group's
   calls counted (sequence number) and NCCL's device work seen by the profiler. Again under
   ``TORCH_CUDA_SANITIZER=1`` (full mode).
2. ``smoke``: every API that touches collectives (``fully_shard`` with each ``collectives=``,
   ``replicate`` stage 1 and 2, clipping, ``full_tensor``, checkpoint save/load, HF
   ``save_pretrained``) under ``"nccl"`` and ``"cpu:gloo,cuda:nccl"``; the 2-D meshes (1,1)
   (HSDP, TP), recording whether the replica phase and the TP host step ran.
3. ``sync_debug``: host syncs per phase counted with ``torch.cuda.set_sync_debug_mode("warn")``
   plus the project's own host read (``FlagRead.resolve``'s event wait, invisible to torch's
   sync debug), with declared expectations: Muon with an unused parameter (one read per backward),
   Muon with ``set_find_unused_parameters(False)`` (none), Shampoo and SOAP (none but one
   ``eigh`` error-flag read per ``torch.linalg.eigh`` call at preconditioner refreshes).
4. ``kernels``: the project's batched bf16 Newton-Schulz on Qwen3 shapes (1024 to 5120 wide,
   aspect 1 to 5), TFLOP/s and % of the GPU's dense bf16 peak; compiled variants, each its own
   ``torch.compile`` object with the frames it compiled recorded; Muon's Gram Newton-Schulz when
   ``Muon`` has ``ns_method``; ``eigh``/``qr`` timings for the planner (full mode).
5. ``memory``: ``max_memory_allocated`` against stock FSDP2 at equal settings (W=1, bf16 compute,
   fp32 reduction, AdamW), with and without the hook; passes when matrixfsdp's peak is at most
   ``FSDP2's * 1.10 + 64 MiB``.
6. ``compile``: the capturable, batched Muon with a 0-dim device lr under ``LambdaLR`` on a W=1
   ``fully_shard`` model: eager against ``torch.compile(opt.step)`` and against a replayed
   ``torch.cuda.graph`` of the step; frames compiled and graph breaks reported.

Without CUDA (or with ``--device cpu``) the parts run their CUDA path on the CPU where they can
(gloo, tiny sizes, ``aot_eager`` for compiles): a dry run whose statuses say ``dry-run``; what only
a GPU shows is listed as not shown. ``tests/bench/test_gpu_check.py`` runs it in CI.
One GPU cannot show: cross-rank collective order, HSDP's replica phase and exchange, TP host steps,
bandwidth and overlap; ``benchmarks/gpu/nccl_sweep.py`` covers parity at W=2..8 under torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("race", "smoke", "sync_debug", "kernels", "memory", "compile")
#: seconds per part; each mode's limits sum to at most its budget (6 and 3 minutes)
LIMITS = {"race": 50, "race_sanitizer": 35, "smoke": 60, "sync_debug": 35, "kernels": 70, "memory": 40,
          "compile": 70}
QUICK_LIMITS = {"race": 25, "race_sanitizer": 0, "smoke": 40, "sync_debug": 20, "kernels": 30, "memory": 20,
                "compile": 45}
#: smoke runs under two backends: the first (all checks) gets this share of its limit, the
#: second (the collectives' checks only) the rest
SMOKE_SHARE = 0.6
BUDGET_S, QUICK_BUDGET_S = 360, 180
if sum(LIMITS.values()) > BUDGET_S or sum(QUICK_LIMITS.values()) > QUICK_BUDGET_S:
    raise ValueError(f"check.py: part limits sum to {sum(LIMITS.values())} s (budget {BUDGET_S}) and "
                     f"{sum(QUICK_LIMITS.values())} s in --quick (budget {QUICK_BUDGET_S})")

#: dense bf16 tensor-core peak (TFLOP/s, without sparsity) by device name; first match wins
BF16_PEAK = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0))
ANCHORS = ("60%: cuBLAS Gram 4096x8192 at 647 TFLOP/s on an H100 (pytorch#184886); "
           "59%: grouped MuonH (marin#6493)")
#: memory part: matrixfsdp's peak may exceed FSDP2's by this factor plus this slack
MEM_FACTOR, MEM_SLACK = 1.10, 64 << 20

#: what each part shows, and what it cannot show on one GPU (the summary table)
SHOWS = {
    "race": ("stream ordering of copy-in/gather/reduce vs compute under delayed side streams, NCCL "
             "called on them (W=1 hook), training parity vs unsharded",
             "cross-rank order; peers' chunks (W=1 gathers receive nothing); HSDP/TP phases"),
    "race-sanitizer": ("the same run under torch's CUDA sanitizer (unsynchronized stream accesses)",
                       "as race"),
    "smoke": ("every collectives-using API runs under nccl and cpu:gloo,cuda:nccl with the hook",
              "HSDP replica phase and exchange, TP host step: (1,1) meshes run but skip them "
              "(not shown on one GPU)"),
    "sync_debug": ("host syncs per phase incl. the project's flag read; find_unused=False has none; "
                   "eigh's error-flag reads are the only step syncs of Shampoo/SOAP",
                   "syncs only W>1 paths make (replica phase, TP host step)"),
    "kernels": ("batched bf16 Newton-Schulz TFLOP/s and % of dense peak on Qwen3 shapes; each "
                "compiled variant really compiled", "multi-GPU effects (owner imbalance, overlap)"),
    "memory": ("peak allocated vs FSDP2 at equal settings (bf16 compute, W=1), threshold "
               f"{MEM_FACTOR:.2f}x + {MEM_SLACK >> 20} MiB", "savings that need W>1 (sharded state)"),
    "compile": ("capturable batched Muon, device lr, LambdaLR: compiled and CUDA-graph-replayed "
                "steps equal eager; frames compiled", "compiled steps with W>1 collectives"),
}
NOT_ON_CPU = "on the CPU: no streams, NCCL, CUDA syncs, CUDA memory or CUDA graphs (dry run)"


# ============================================================================ shared helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _group(backend: str, dev: torch.device):
    """A W=1 process group (``backend`` may be the composite ``"cpu:gloo,cuda:nccl"``)."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kw = {"device_id": dev} if "nccl" in backend else {}
    dist.init_process_group(backend, rank=0, world_size=1, **kw)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _seq(group: Any) -> int | None:
    """Collectives ``group`` issued so far (its sequence number), None where the backend has none."""
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:  # a backend without sequence numbers: reported as unknown
        return None


def _delta(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


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


def _tokens(cfg, step: int, dev: torch.device, shape=(4, 32)) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(step)).to(dev)


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _bf16_mp():
    from matrixfsdp import MixedPrecisionPolicy

    # bf16 compute also on the CPU: the owner then computes on a cast copy, so each block's
    # gather runs (without a cast the W=1 owner computes on its own storage and gathers nothing)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@dataclass
class Ctx:
    """What a part runs with: device, backend, mode, and the row writer."""

    dev: torch.device
    backend: str
    quick: bool
    out: Path
    part: str

    @property
    def cuda(self) -> bool:
        return self.dev.type == "cuda"

    def steps(self, full: int, quick: int, dry: int) -> int:
        env = os.environ.get("MATRIXFSDP_CHECK_STEPS")
        if env:
            return int(env)
        return full if self.cuda and not self.quick else quick if self.cuda else dry

    def row(self, **row: Any) -> dict:
        """Append one row to ``rows.jsonl`` now (a part killed later keeps it)."""
        row = {"part": self.part, "at": datetime.datetime.now().isoformat(timespec="seconds"), **row}
        with open(self.out / "rows.jsonl", "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
        return row


# ============================================================================ 1. stream race
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
    with _group(ctx.backend, dev):
        mesh = init_device_mesh(dev.type, (1,))
        pg = mesh.get_group()
        cfg, base = _tiny_decoder(0)
        batches = [_tokens(cfg, s, dev) for s in range(steps)]
        init = {n: p.detach().double().cpu() for n, p in base.named_parameters()}
        runs: dict[str, dict] = {}
        # "no hook": the W=1 short-cuts (no collective), the bits the hook must not change
        # (the CPU has no streams to delay: "delayed" would repeat "plain")
        for name, cycles in (("plain", 0), ("delayed", 20_000_000), ("no hook", 0)):
            if name == "delayed" and not ctx.cuda:
                runs[name] = runs["plain"]
                continue
            model = _shard(copy.deepcopy(base).to(dev), mesh, mp_policy=_bf16_mp())
            opt = matrixfsdp.optim.Muon(model, lr=0.02)
            undo = _sleepy_streams(cycles) if cycles else (lambda: None)
            s0, t0 = _seq(pg), time.perf_counter()
            try:
                with force_collectives() if name != "no hook" else contextlib.nullcontext():
                    for s in range(steps):  # no host read per step: iterations may overlap
                        _loss(model, batches[s]).backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    _sync(dev)
            finally:
                undo()
            calls = _delta(s0, _seq(pg))
            runs[name] = {"params": {n: _local(p).detach().double().cpu() for n, p in model.named_parameters()},
                          "pg_calls": calls}
            ctx.row(run=name, steps=steps, sleep_cycles=cycles, pg_calls=calls,
                    wall_s=round(time.perf_counter() - t0, 2))
            if name == "plain" and ctx.cuda and not os.environ.get("TORCH_CUDA_SANITIZER"):
                def one_step():
                    with force_collectives():
                        _loss(model, batches[0]).backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                runs["profile"] = _nccl_device_events(one_step)
                ctx.row(run="profile one step", **runs["profile"])
        ref = copy.deepcopy(base).to(dev)
        ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02)
        for s in range(steps):
            _loss(ref, batches[s]).backward()
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
    worst = _rel(mine, theirs)
    per_param = {n: _rel(runs["plain"]["params"][n] - init[n], refp[n] - init[n]) for n in names}
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


# ============================================================================ 2. API smoke
def part_smoke(ctx: Ctx) -> dict:
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
        ctx.row(check=name, status=checks[name], wall_s=round(time.perf_counter() - t0, 2), **info[name])

    with _group(ctx.backend, dev), tempfile.TemporaryDirectory() as tmp, force_collectives():
        mesh = init_device_mesh(dev.type, (1,))
        pg = mesh.get_group()
        cfg, base = _tiny_decoder(0)
        tokens = _tokens(cfg, 0, dev, (2, 16))

        def train(model, opt, n=2):
            for _ in range(n):
                _loss(model, tokens).backward()
                matrixfsdp.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()

        for coll in ("all_to_all", "p2p", "two_phase"):
            def fs(coll=coll):
                model = _shard(copy.deepcopy(base).to(dev), mesh, collectives=coll, mp_policy=_bf16_mp())
                opt = matrixfsdp.optim.Muon(model, lr=0.02)
                s0 = _seq(pg)
                train(model, opt)
                calls = _delta(s0, _seq(pg))
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
                s0 = _seq(pg)
                train(model, opt)
                path = os.path.join(tmp, f"ckpt-rep{stage}")
                matrixfsdp.checkpoint.save(path, model, opt)
                matrixfsdp.checkpoint.load(path, model, opt)
                return {"pg_calls": _delta(s0, _seq(pg))}
            check(f"replicate[stage={stage}] fwd/bwd/step/clip/save/load", rep)

        def hsdp():
            m2 = init_device_mesh(dev.type, (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
            model = _shard(copy.deepcopy(base).to(dev), m2, mp_policy=_bf16_mp())
            opt = matrixfsdp.optim.Muon(model, lr=0.02)
            counter = comm_counter(model, "replicate")
            counter.reset()
            train(model, opt)
            # the replica phase's all-reduce: the engine drops replicate groups of size 1
            return {"replica_phase_ran": counter.calls.get("all_reduce", 0) > 0,
                    "replicate_counter": dict(counter.calls)}
        second = ctx.backend != "nccl" and ctx.cuda  # the composite backend: the collectives' checks only
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
            _shard(model, m2["dp_shard"], plan=plan, mp_policy=_bf16_mp())
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
    n_ok = sum(v == "ok" for v in checks.values())
    return {"ok": ok, "backend": ctx.backend, "device": str(dev), "checks": checks, "shown_on_one_device": shown,
            "key": f"{n_ok}/{len(checks)} ok; HSDP replica phase ran={shown['hsdp_replica_phase']}, "
                   f"TP host step ran={shown['tp_host_step']}"}


# ============================================================================ 3. sync debug
class _CountCalls(torch.overrides.TorchFunctionMode):
    """Counts ``torch.linalg.eigh`` and ``qr`` calls (each checks an error flag on the host)."""

    def __init__(self):
        super().__init__()
        self.calls = {"eigh": 0, "qr": 0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.linalg.eigh:
            self.calls["eigh"] += 1
        elif func is torch.linalg.qr:
            self.calls["qr"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _flag_waits():
    """Counts ``FlagRead.resolve``'s host waits (its event's ``synchronize``): the project's one
    documented host read, which torch's sync debug mode does not see. Patches the engine's class
    in this check process only, restored on exit."""
    from matrixfsdp.engine import reducer

    box = {"waits": 0, "resolves": 0}
    orig = reducer.FlagRead.resolve

    def resolve(self, *a, **kw):
        box["resolves"] += 1
        if self.host is not None and self.event is not None:
            box["waits"] += 1
        return orig(self, *a, **kw)

    reducer.FlagRead.resolve = resolve
    try:
        yield box
    finally:
        reducer.FlagRead.resolve = orig


def _torch_syncs(fn: Callable[[], Any], cuda: bool) -> int | None:
    """Synchronizing CUDA calls torch's sync debug mode reports during ``fn`` (None on the CPU)."""
    if not cuda:
        fn()
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def part_sync_debug(ctx: Ctx) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp
    from matrixfsdp.comm.collectives import force_collectives
    from matrixfsdp.engine import reducer

    dev = ctx.dev
    steps = ctx.steps(4, 3, 3)
    cases = (  # name, optimizer, kwargs, model has an unused parameter, find_unused
        ("Muon unused find_unused=True", "Muon", dict(lr=0.02), True, True),
        ("Muon find_unused=False", "Muon", dict(lr=0.02), False, False),
        ("Shampoo find_unused=False", "Shampoo", dict(lr=3e-3, precondition_frequency=2, start_preconditioning_step=1),
         False, False),
        ("SOAP find_unused=False", "SOAP", dict(lr=3e-3, precondition_frequency=2), False, False),
    )
    out: dict[str, Any] = {}
    with _group(ctx.backend, dev), force_collectives():
        mesh = init_device_mesh(dev.type, (1,))
        for case, name, kw, unused, find_unused in cases:
            cfg, base = _tiny_decoder(0)
            if unused:  # a root-level projection no forward uses
                base.unused = torch.nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
            # Muon with bf16 compute, so the gathers run too; Shampoo and SOAP in fp32 (with
            # bf16 compute their CPU dry run took 30 s instead of 1 s)
            mp = {"mp_policy": _bf16_mp()} if name == "Muon" else {}
            model = _shard(base.to(dev), mesh, **mp)
            model.set_find_unused_parameters(find_unused)
            opt = getattr(matrixfsdp.optim, name)(model, **kw)
            tokens = _tokens(cfg, 0, dev, (2, 16))
            _loss(model, tokens).backward()  # warm-up: lazy state, first-step allocations
            opt.step()
            opt.zero_grad()
            _sync(dev)
            per_step = []
            for s in range(steps):
                reads0 = reducer.host_reads[0]
                with _flag_waits() as waits:
                    fb = _torch_syncs(lambda: _loss(model, tokens).backward(), ctx.cuda)
                counted = _CountCalls()
                with counted:
                    st = _torch_syncs(opt.step, ctx.cuda)
                opt.zero_grad()
                r = {"step": s, "fwd_bwd_syncs": fb, "step_syncs": st, "host_reads": reducer.host_reads[0] - reads0,
                     "flag_waits": waits["waits"], **counted.calls}
                per_step.append(r)
                ctx.row(case=case, **r)
            reads = sum(r["host_reads"] for r in per_step)
            flag_waits = sum(r["flag_waits"] for r in per_step)
            eigh = sum(r["eigh"] for r in per_step)
            syncs = [r["fwd_bwd_syncs"] for r in per_step] + [r["step_syncs"] for r in per_step]
            expected_reads = steps if unused and find_unused else 0
            problems = []
            if reads != expected_reads:
                problems.append(f"{reads} flag reads, expected {expected_reads}")
            if ctx.cuda and flag_waits != expected_reads:
                problems.append(f"{flag_waits} flag waits, expected {expected_reads}")
            if ctx.cuda:
                if any(r["fwd_bwd_syncs"] for r in per_step):
                    problems.append("torch syncs in forward/backward")
                # declared: one error-flag read per torch.linalg.eigh call, nothing else (qr calls
                # are counted and reported, not excused)
                extra = [r for r in per_step if r["step_syncs"] > r["eigh"]]
                if extra:
                    problems.append(f"step syncs beyond one per eigh: {[(r['step'], r['step_syncs'], r['eigh']) for r in extra]}")
            if name in ("Shampoo", "SOAP") and eigh + sum(r["qr"] for r in per_step) == 0:
                problems.append("no eigh or qr ran: the preconditioner refresh was not exercised")
            out[case] = {"ok": not problems, "problems": problems, "flag_reads": reads, "flag_waits": flag_waits,
                         "eigh_calls": eigh, "qr_calls": sum(r["qr"] for r in per_step), "torch_syncs": None if not ctx.cuda else sum(syncs),
                         "expected": {"flag_reads": expected_reads, "torch_syncs": f"<= eigh calls ({eigh})"}}
    ok = all(v["ok"] for v in out.values())
    key = "; ".join(f"{k.split()[0]}{'' if 'True' in k else '/nofind'}: syncs={v['torch_syncs']} reads={v['flag_reads']}"
                    for k, v in out.items())
    return {"ok": ok, "steps": steps, "results": out, "key": key}


# ============================================================================ 4. kernels
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
            ms = _time_ms(lambda: batched_newtonschulz(x, coeffs, 5, eps, dtype), reps, dev)
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
            ms = _time_ms(lambda: fn(x, coeffs, 5, eps, dt), reps, dev)
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


# ============================================================================ 5. memory
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
    with _group(ctx.backend, dev):
        mesh = init_device_mesh(dev.type, (1,))
        cfg, base = _tiny_decoder(0, **size)
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
                _shard(model, mesh, mp_policy=_bf16_mp())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            if ctx.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            with force_collectives() if name.endswith("hook") else contextlib.nullcontext():
                for step in range(steps):
                    _loss(model, _tokens(cfg, step, dev, shape)).backward()
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


# ============================================================================ 6. compile / graphs
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
    with _group(ctx.backend, dev):
        mesh = init_device_mesh(dev.type, (1,))
        cfg, base = _tiny_decoder(0, num_hidden_layers=1)
        batches = [_tokens(cfg, s, dev, (2, 16)) for s in range(steps)]

        def run(how: str) -> dict:
            model = _shard(copy.deepcopy(base).to(dev), mesh)
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
                _loss(model, batches[s]).backward()
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
            _sync(dev)
            if how == "compiled":
                info.update(frames=counter.frame_count, unique_graphs=counters["stats"]["unique_graphs"],
                            graph_breaks={r: n for r, n in counters["graph_break"].items()
                                          if "lr_scheduler.py" not in r})
            info["lr_device"] = str(opt.param_groups[0]["lr"].device)
            info["params"] = {n: _local(p).detach().double().cpu() for n, p in model.named_parameters()}
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
                diff = max(_rel(r["params"][n], eager["params"][n]) for n in eager["params"])
                r.pop("params")
                res[how] = {"ok": diff <= tol, "max_rel_diff_vs_eager": diff, **r}
            except Exception as e:
                res[how] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400],
                            "traceback": traceback.format_exc()[-1500:]}
            res[how]["wall_s"] = round(time.perf_counter() - t0, 1)
            ctx.row(run=how, **res[how])
    comp = res["compiled"]
    ok = bool(comp.get("ok")) and comp.get("frames", 99) <= 2 and not comp.get("graph_breaks") \
        and res["graph"].get("ok", not ctx.cuda)
    key = (f"frames={comp.get('frames')} breaks={len(comp.get('graph_breaks') or {})} "
           f"compiled diff={comp.get('max_rel_diff_vs_eager', float('nan')):.2g} "
           f"graph diff={res['graph'].get('max_rel_diff_vs_eager', 'n/a')}")
    return {"ok": ok, "steps": steps, "backend": backend, "tolerance": tol, "results": res, "key": key}


WORKERS: dict[str, Callable[[Ctx], dict]] = {
    "race": part_race, "smoke": part_smoke, "sync_debug": part_sync_debug, "kernels": part_kernels,
    "memory": part_memory, "compile": part_compile,
}


# ============================================================================ driver
def _default_out() -> Path:
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu"
    return ROOT / "benchmarks" / "results" / "gpu" / datetime.date.today().isoformat()


def _run_inline(part: str, ctx: Ctx, tag: str) -> tuple[dict, int]:
    try:
        result = WORKERS[part](ctx)
    except Exception as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    (ctx.out / f"{tag}.json").write_text(json.dumps(result, indent=1, default=str))
    return result, 0 if result.get("ok") else 1


def _run_subprocess(part: str, args: argparse.Namespace, out: Path, tag: str, backend: str, limit: int,
                    env: dict | None = None) -> tuple[dict, int, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", part, "--backend", backend,
           "--out", str(out), "--tag", tag, "--device", args.device] + (["--quick"] if args.quick else [])
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), e.get("PYTHONPATH", "")])
    e.update(env or {})
    # its own session: a timeout kills the worker and whatever it started (compile workers)
    proc = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=limit)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        rc = 124
    res_file = out / f"{tag}.json"
    result = json.loads(res_file.read_text()) if res_file.exists() and rc != 124 else {"ok": False}
    return result, rc, (log or "")[-3000:]


def _status(result: dict, rc: int, dry: bool) -> str:
    if rc == 124:
        return "TIMEOUT (rows kept)"
    if rc != 0 and result.get("ok"):
        return f"FAILED (rc={rc})"
    word = "passed" if result.get("ok") else "FAILED"
    return f"dry-run {word}" if dry else word


def _table(rows: list[dict]) -> str:
    head = ["part", "status", "key figure", "what it shows", "what it cannot show"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[k]).replace("|", "/") for k in ("part", "status", "key", "shows", "cannot"))
                     + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default $OUT/gpu, else benchmarks/results/gpu/<date>)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--quick", action="store_true", help=f"smaller runs, part limits summing to {QUICK_BUDGET_S} s")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cpu: the dry run of the CUDA path on the CPU (auto: cuda when available)")
    ap.add_argument("--inline", action="store_true", help="run the parts in this process (the CPU dry run)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tag", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else _default_out()
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    cuda = torch.cuda.is_available() and args.device != "cpu"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")

    if args.worker:  # one part in this process
        ctx = Ctx(dev, args.backend, args.quick, out, args.tag)
        return _run_inline(args.worker, ctx, args.tag)[1]

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown part(s) {bad}; choose from {list(PARTS)}")
    if args.inline and str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))  # this tree's matrixfsdp, as the workers get it
    limits = QUICK_LIMITS if args.quick else LIMITS
    if not cuda:
        print("benchmarks/gpu/check.py: no CUDA device (or --device cpu): dry run of the CUDA path on the CPU "
              "(gloo, tiny sizes, aot_eager); what only a GPU shows is reported as not shown.")
    summary: dict[str, Any] = {"cuda": cuda, "quick": args.quick, "torch": torch.__version__,
                               "started": datetime.datetime.now().isoformat(timespec="seconds"),
                               "device": torch.cuda.get_device_name(0) if cuda else "cpu", "budget_s":
                               QUICK_BUDGET_S if args.quick else BUDGET_S, "limits": limits, "parts": {}, "table": []}
    t_all = time.monotonic()
    for part in parts:
        backends = (["nccl", "cpu:gloo,cuda:nccl"] if part == "smoke" else ["nccl"]) if cuda else ["gloo"]
        runs = [(b, part if len(backends) == 1 else f"{part}-{b.replace(':', '_').replace(',', '+')}", {}, limits[part])
                for b in backends]
        if part == "race" and cuda:
            if limits["race_sanitizer"]:
                runs.append(("nccl", "race-sanitizer", {"TORCH_CUDA_SANITIZER": "1", "MATRIXFSDP_CHECK_STEPS": "3"},
                             limits["race_sanitizer"]))
            else:
                summary["parts"]["race-sanitizer"] = "skipped: --quick"
                summary["table"].append({"part": "race-sanitizer", "status": "skipped: --quick", "key": "",
                                         "shows": SHOWS["race-sanitizer"][0], "cannot": SHOWS["race-sanitizer"][1]})
        for backend, tag, env, limit in runs:
            if len(backends) > 1:  # the part's limit is shared by its backends
                limit = int(limit * SMOKE_SHARE) if backend == backends[0] else limit - int(limit * SMOKE_SHARE)
            t0 = time.monotonic()
            if args.inline:
                ctx = Ctx(dev, backend, args.quick, out, tag)
                result, rc = _run_inline(part, ctx, tag)
                log = ""
            else:
                result, rc, log = _run_subprocess(part, args, out, tag, backend, limit, env)
            wall = round(time.monotonic() - t0, 1)
            if args.inline and wall > limit:  # inline parts cannot be stopped; noted, the budget decides
                result["over_limit"] = f"{wall} s > {limit} s"
            result.update({"rc": rc, "wall_s": wall, "limit_s": limit, "backend": backend})
            if log and (rc != 0 or not result.get("ok")):
                result["log_tail"] = log
            (out / f"{tag}.json").write_text(json.dumps(result, indent=1, default=str))
            status = _status(result, rc, not cuda)
            if result.get("over_limit"):
                status += f" (over its own limit: {result['over_limit']})"
            summary["parts"][tag] = status
            base = "race-sanitizer" if tag == "race-sanitizer" else part
            cannot = SHOWS[base][1] + ("" if cuda else "; " + NOT_ON_CPU)
            summary["table"].append({"part": tag, "status": status, "key": str(result.get("key", ""))[:160],
                                     "shows": SHOWS[base][0], "cannot": cannot, "wall_s": wall})
            with open(out / "rows.jsonl", "a") as f:
                f.write(json.dumps({"part": tag, "kind": "result", "status": status, "wall_s": wall,
                                    "key": result.get("key")}, default=str) + "\n")
    summary["wall_s"] = round(time.monotonic() - t_all, 1)
    # the inline (dry) run's test of time: the whole run inside the mode's budget (per part, CPU
    # timings say little about a GPU's)
    summary["within_budget"] = summary["wall_s"] <= summary["budget_s"]
    summary["not_on_one_gpu"] = ("cross-rank collective order, HSDP's replica phase and exchange, TP host steps, "
                                 "bandwidth and overlap at W>1: benchmarks/gpu/nccl_sweep.py under torchrun")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    table = _table(summary["table"])
    (out / "summary.md").write_text(f"# GPU check ({summary['device']}, torch {summary['torch']}, "
                                    f"{'quick' if args.quick else 'full'})\n\n{table}\n\nNot shown on one GPU: "
                                    f"{summary['not_on_one_gpu']}\n")
    print(table)
    print(f"not shown on one GPU: {summary['not_on_one_gpu']}")
    print(f"results in {out} ({summary['wall_s']} s; budget {summary['budget_s']} s)")
    bad_parts = [k for k, v in summary["parts"].items() if not (v.startswith("skipped") or "passed" in v)]
    if not summary["within_budget"]:
        print(f"OVER BUDGET: {summary['wall_s']} s > {summary['budget_s']} s")
    return 1 if bad_parts or not summary["within_budget"] else 0


if __name__ == "__main__":
    sys.exit(main())
