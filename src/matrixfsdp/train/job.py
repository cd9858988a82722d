"""The main job's training loop (``python -m matrixfsdp.train``), one process per data-parallel rank.

:func:`run_rank` runs on every rank with the process group initialized: it trains the
matrixfsdp run (``matrixfsdp.fully_shard`` + the chosen optimizer) and, with ``compare``, the
stock FSDP2 + AdamW run on the same data and token budget, then writes the plot on rank 0.

Files under ``out`` (rank 0 writes the logs; every rank writes its checkpoint shards)::

    <run>.jsonl                 one record per step (+ held-out evals, + a final record)
    ckpt/<run>/step-000100/     DCP checkpoint (matrixfsdp.checkpoint.save: atomic)
    ckpt/<run>/step-000100.json trainer state: step (= data position), RNG state, fingerprint
    loss.png                    loss curves of all runs

[Note: bitwise resume]
Everything a step depends on is in the checkpoint or is a function of the step: parameters and
optimizer state (DCP), the learning rate (a closed-form schedule of the step, written into the
param groups before each step), the batch (a function of ``(seed, step)``, see ``data.py``)
and the torch RNG state (saved, restored; the loop itself draws nothing from it). Per-rank thread
count is fixed by the command. So a run resumed at the same world size computes bit for bit what
the uninterrupted run computes. At another world size the global batch is the same, but the
gradient is summed over another number of ranks in another order: the result agrees to float32
rounding, not bitwise (W=2 -> 4 at the default size: losses within 2.2e-7 relative, see
benchmarks/results/train/default/README.md). The same holds across ``--replicas`` (the HSDP mesh
is not part of the fingerprint: DCP reshards between the flat and the (R, W/R) meshes and between
``repeat`` and ``split``); tests/train/test_job.py resumes a flat W=4 checkpoint on (2, 2).

[Note: resuming with more steps]
``--resume --steps N`` with N past the step count the run was started with trains on to N (as
torchtitan and nanoGPT do). The learning-rate schedule is a function of the *original* step
count, recorded in every checkpoint as ``schedule_steps``: warmup and cosine decay end where the
first run ended, and the extra steps run at the schedule's floor (0.1x the base rate), like
nanoGPT past ``lr_decay_iters``. So the steps the first run took are unchanged (bitwise), and a
run extended from 200 to 250 steps is *not* the run a fresh ``--steps 250`` computes (whose
cosine is stretched over 250 steps); start afresh for that. A resume may not ask for fewer steps
than its checkpoint holds. Any other changed setting of the fingerprint is an error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..models.decoder import Decoder, DecoderConfig, DecoderLayer
from ..models.moe import MoEConfig, MoEDecoder, MoEDecoderLayer
from ..placement.owned_tensor import local_tensor
from .data import VOCAB_SIZE, Corpus, heldout_windows, load_corpus, local_batch

__all__ = ["TrainConfig", "DeviceChoice", "choose_device", "MODEL_SIZES", "OPTIMIZER_LRS", "run_rank", "TrainError", "latest_checkpoint",
           "run_names", "mesh_record", "mesh_str"]


class TrainError(ValueError):
    """A user-facing error of ``matrixfsdp.train``: printed as one ``error:`` line, exit status 2."""


def _cfg(hidden: int, inter: int, layers: int, heads: int, kv: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                         head_dim=hidden // heads, tie_word_embeddings=False)


#: Byte-level Qwen3-style decoders (q/k RMSNorm, GQA, SwiGLU) sized for CPUs, and a Qwen3-MoE-style
#: mixture of experts (8 experts of hidden 96, top-2, fused gate_up_proj: docs/experts.md).
MODEL_SIZES: dict[str, DecoderConfig | MoEConfig] = {
    "nano": _cfg(64, 192, 2, 4, 2),       # 0.13M parameters: tests and smoke runs
    "small": _cfg(128, 384, 4, 4, 2),     # 0.8M: the default, ~1 minute per run on 2 cores
    "base": _cfg(256, 768, 6, 8, 4),      # 4.6M: minutes per run on a laptop
    "tiny-moe": MoEConfig(vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=96, fused=True),  # 1.45M, 0.56M active per token
}

#: Matrix learning rate (and the AdamW rate of the other parameters) per ``--optimizer``.
OPTIMIZER_LRS: dict[str, tuple[float, float]] = {
    "muon": (0.02, 3e-3),
    "shampoo": (3e-3, 3e-3),
    "soap": (3e-3, 3e-3),
    "adamw": (1.5e-3, 1.5e-3),  # the best held-out loss of 7e-4 ... 1e-2 at the default budget
}


@dataclass(frozen=True)
class DeviceChoice:
    """Where a job runs and what follows from it (:func:`choose_device`)."""

    device: str  #: "cpu" or "cuda"
    backend: str  #: the process group's: "gloo" for cpu, "nccl" for cuda
    #: fully_shard's compute dtype (bf16 mixed precision on cuda, gradients reduced in fp32); None:
    #: fp32 throughout (the CPU default: bf16 matmuls are slow there and the tests pin fp32 bits)
    param_dtype: torch.dtype | None
    ns_dtype: torch.dtype  #: Muon's Newton-Schulz dtype (bf16 on cuda, as Muon's reference runs it)


def choose_device(flag: str = "auto", cuda_available: bool | None = None) -> DeviceChoice:
    """``--device``: ``auto`` takes cuda where ``torch.cuda.is_available()``, else cpu; ``cuda``
    without CUDA raises :class:`TrainError` naming the flag."""
    if flag not in ("auto", "cpu", "cuda"):
        raise TrainError(f"--device must be one of auto, cpu, cuda, got {flag!r}")
    if flag != "cpu" and cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if flag == "cuda" and not cuda_available:
        raise TrainError("--device cuda: CUDA is not available here (torch.cuda.is_available() is False; "
                         f"torch {torch.__version__}); pass --device cpu, or --device auto to take CUDA where it is")
    if flag == "cpu" or not cuda_available:
        return DeviceChoice("cpu", "gloo", None, torch.float32)
    return DeviceChoice("cuda", "nccl", torch.bfloat16, torch.bfloat16)


def device_choice(device: str) -> DeviceChoice:
    """The :class:`DeviceChoice` of a resolved ``TrainConfig.device`` (no availability check)."""
    return choose_device(device, cuda_available=device == "cuda")


@dataclass(frozen=True)
class TrainConfig:
    out: str
    model: str = "small"
    optimizer: str = "muon"
    steps: int = 200
    batch: int = 16
    seq_len: int = 128
    seed: int = 0
    collectives: str = "all_to_all"
    replicas: int = 1              # HSDP: an (replicas, W / replicas) (dp_replicate, dp_shard) mesh
    replica_step: str = "auto"     # plan_owners(replica_step=) with replicas > 1
    lr: float | None = None        # None: OPTIMIZER_LRS[optimizer]
    adamw_lr: float | None = None
    compare: bool = True
    ckpt_every: int = 100
    eval_every: int = 50
    eval_windows: int = 32
    sample_bytes: int = 200
    resume: bool = False
    stop_after: int | None = None
    threads: int = 1
    max_corpus_bytes: int | None = None
    progress: bool | None = None  # None: when stderr is a terminal
    device: str = "cpu"  # resolved by choose_device: "cpu" (gloo, fp32) or "cuda" (nccl, bf16 mixed precision)
    qk_clip: float | None = None  # QK-clip's tau in the matrixfsdp run (matrixfsdp.qk_clip.QKClip), else off
    per_head: bool = False  # per-head Muon in the matrixfsdp run (MatrixRule.per_head: plan and optimizer)

    def fingerprint(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint's run. ``steps`` is not part of it:
        a resume may train on past the checkpointed run's end (see [Note: resuming with more
        steps])."""
        got = {k: getattr(self, k) for k in ("model", "optimizer", "batch", "seq_len", "seed",
                                               "max_corpus_bytes", "lr", "adamw_lr")}
        if self.qk_clip is not None:  # absent when off: checkpoints from before the option still match
            got["qk_clip"] = self.qk_clip
        if self.per_head:  # (likewise; the optimizer state's layout differs, "muon:heads/H")
            got["per_head"] = True
        return got

    def lrs(self) -> tuple[float, float]:
        """(matrix lr, AdamW lr) of the matrixfsdp run."""
        lr, adamw_lr = OPTIMIZER_LRS[self.optimizer]
        return (lr if self.lr is None else self.lr, adamw_lr if self.adamw_lr is None else self.adamw_lr)


def run_names(cfg: TrainConfig) -> list[str]:
    names = [f"matrixfsdp-{cfg.optimizer}"]
    if cfg.compare:
        names.append("fsdp2-adamw")
    return names


# ------------------------------------------------------------------------------------------------
# checkpoints
# ------------------------------------------------------------------------------------------------
def latest_checkpoint(out: str | Path, run: str) -> tuple[Path, dict[str, Any]] | None:
    """The newest ``ckpt/<run>/step-N`` with a readable trainer-state file, or None."""
    d = Path(out) / "ckpt" / run
    if not d.is_dir():
        return None
    for state_file in sorted(d.glob("step-*.json"), reverse=True):
        try:
            state = json.loads(state_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise TrainError(f"--resume: the trainer state {str(state_file)!r} is damaged ({e}); remove "
                             f"it and {str(state_file.with_suffix(''))!r} to resume from an earlier one") from None
        return state_file.with_suffix(""), state
    return None


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def lr_multiplier(step: int, steps: int) -> float:
    """Linear warmup over the first 10% (at most 20 steps), then cosine to 10%."""
    warm = max(1, min(20, steps // 10))
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t)))


def _scalar(t: torch.Tensor) -> float:
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def _param_digest(model: nn.Module) -> str:
    """sha256 over every rank's local shards (equal digests <=> bitwise equal models at the same W)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(local_tensor(p).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, h.hexdigest())
    return hashlib.sha256("".join(parts).encode()).hexdigest()


@dataclass
class _Run:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    base_lrs: list[tuple[float, float | None]]  # per group: (lr, adamw_lr)
    clip: Callable[[Any, float], torch.Tensor]
    counter: Any  # matrixfsdp CommCounter or None
    qk: Any = None  # matrixfsdp.qk_clip.QKClip (--qk-clip), its clip a post-hook of opt.step()


def _build_model(cfg: TrainConfig) -> Decoder | MoEDecoder:
    shape = MODEL_SIZES[cfg.model]
    model = MoEDecoder(shape) if isinstance(shape, MoEConfig) else Decoder(shape)
    model.reset_parameters(seed=cfg.seed)  # every rank draws the same full tensors (on the CPU)
    return model.to(cfg.device)


def _mesh(cfg: TrainConfig) -> Any:
    """The data-parallel mesh of both runs: 1-D ``dp_shard`` over the world, or with
    ``replicas > 1`` the HSDP mesh ``(replicas, W / replicas)`` named ``(dp_replicate, dp_shard)``
    (consecutive ranks share a shard group, as ranks of one node would)."""
    from torch.distributed.device_mesh import init_device_mesh

    W, R = dist.get_world_size(), cfg.replicas
    if W % R:
        raise TrainError(f"--replicas {R} must divide --world {W}")
    if R == 1:
        return init_device_mesh(cfg.device, (W,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(cfg.device, (R, W // R), mesh_dim_names=("dp_replicate", "dp_shard"))


def mesh_record(cfg: TrainConfig, world: int) -> dict[str, Any]:
    """How the logs describe the mesh: dimension names and sizes (and the replica mode under HSDP)."""
    if cfg.replicas == 1:
        return {"dim_names": ["dp_shard"], "shape": [world]}
    return {"dim_names": ["dp_replicate", "dp_shard"], "shape": [cfg.replicas, world // cfg.replicas],
            "replica_step": cfg.replica_step}


def mesh_str(mesh: dict[str, Any]) -> str:
    """``(dp_replicate=2, dp_shard=2)`` for a :func:`mesh_record`."""
    return "(" + ", ".join(f"{n}={k}" for n, k in zip(mesh["dim_names"], mesh["shape"])) + ")"


def _build_matrixfsdp(cfg: TrainConfig) -> _Run:
    import matrixfsdp

    from .._fully_shard import comm_counter

    model = _build_model(cfg)
    mesh = _mesh(cfg)
    rule = matrixfsdp.MatrixRule.per_head(model) if cfg.per_head else None  # one rule: plan and optimizer
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(DecoderLayer, MoEDecoderLayer), optimizer=cfg.optimizer,
                                  replica_step=cfg.replica_step, matrix_rule=rule)
    choice = device_choice(cfg.device)
    kw: dict[str, Any] = {"collectives": cfg.collectives}
    if choice.param_dtype is not None:
        kw["mp_policy"] = matrixfsdp.MixedPrecisionPolicy(param_dtype=choice.param_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan, **kw)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan, **kw)
    lr, adamw_lr = cfg.lrs()
    opt: torch.optim.Optimizer
    # the model, not its parameters: the optimizer routes by the plan's rule (one routing rule)
    if cfg.optimizer == "muon":
        opt = matrixfsdp.optim.Muon(model, lr=lr, weight_decay=0.0, adamw_lr=adamw_lr, ns_dtype=choice.ns_dtype,
                                    matrix_rule=rule)
    elif cfg.optimizer == "shampoo":
        opt = matrixfsdp.optim.Shampoo(model, lr=lr, adamw_lr=adamw_lr)
    elif cfg.optimizer == "soap":
        opt = matrixfsdp.optim.SOAP(model, lr=lr, adamw_lr=adamw_lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    base = [(g["lr"], g.get("adamw_lr")) for g in opt.param_groups]
    qk = None
    if cfg.qk_clip is not None:
        import warnings

        from ..qk_clip import QKClip

        with warnings.catch_warnings():  # the built-in models' QK-norm: said once, in --help and the docs
            warnings.filterwarnings("ignore", message=".*normalize queries and keys per head")
            qk = QKClip(model, opt, tau=cfg.qk_clip)
    return _Run(f"matrixfsdp-{cfg.optimizer}", model, opt, base, matrixfsdp.clip_grad_norm_, comm_counter(model), qk)


def _build_fsdp2(cfg: TrainConfig) -> _Run:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _build_model(cfg)
    mesh = _mesh(cfg)  # 2-D: torch's own HSDP
    choice = device_choice(cfg.device)
    kw: dict[str, Any] = {}
    if choice.param_dtype is not None:  # the same mixed precision as the matrixfsdp run
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=choice.param_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    lr, _ = OPTIMIZER_LRS["adamw"]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    return _Run("fsdp2-adamw", model, opt, [(lr, None)], torch.nn.utils.clip_grad_norm_, None)


def _set_lr(run: _Run, mult: float) -> float:
    for g, (lr, adamw_lr) in zip(run.opt.param_groups, run.base_lrs):
        g["lr"] = lr * mult
        if adamw_lr is not None:
            g["adamw_lr"] = adamw_lr * mult
    return run.base_lrs[0][0] * mult


def _comm(counter: Any) -> tuple[int, int]:
    if counter is None:
        return 0, 0
    return sum(counter.bytes_sent.values()), counter.total_calls


@torch.no_grad()
def _heldout_loss(model: nn.Module, windows: torch.Tensor, device: str = "cpu") -> float:
    rank, W = dist.get_rank(), dist.get_world_size()
    mine = windows[rank::W].to(device)
    logits = model(mine[:, :-1])
    s = F.cross_entropy(logits.flatten(0, 1).float(), mine[:, 1:].flatten(), reduction="sum")
    tot = torch.stack([s.double(), torch.tensor(float(mine[:, 1:].numel()), dtype=torch.float64, device=device)])
    dist.all_reduce(tot)
    return float(tot[0] / tot[1])


@torch.no_grad()
def _sample(model: nn.Module, cfg: TrainConfig, prompt: bytes = b"def ") -> str:
    """Sample ``cfg.sample_bytes`` bytes (temperature 0.8); rank 0 draws, every rank runs the model."""
    g = torch.Generator().manual_seed(cfg.seed)  # drawn on the CPU on every device
    toks = torch.tensor([list(prompt)], dtype=torch.long, device=cfg.device)
    for _ in range(cfg.sample_bytes):
        logits = model(toks[:, -cfg.seq_len:])[0, -1].float().cpu()
        nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=g).view(1, 1).to(cfg.device)
        dist.broadcast(nxt, src=0)
        toks = torch.cat([toks, nxt], dim=1)
    return bytes(toks[0].cpu().tolist()).decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------------
def _resume_point(cfg: TrainConfig, name: str) -> tuple[str, dict[str, Any]] | None:
    """The checkpoint a ``--resume`` of run ``name`` continues from (None: start afresh), checked
    against ``cfg`` before anything runs, identically on every rank (rank 0 reads, broadcasts).
    Raises :class:`TrainError` for a damaged trainer state, another configuration, or a
    ``--steps`` below the checkpoint's step."""
    info: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            found = latest_checkpoint(cfg.out, name) if cfg.resume else None
            if found is not None:
                _check_resumable(cfg, str(found[0]), found[1])
            info[0] = ("ok", None if found is None else (str(found[0]), found[1]))
        except TrainError as e:
            info[0] = ("error", str(e))
    dist.broadcast_object_list(info, src=0)
    if info[0][0] == "error":
        raise TrainError(info[0][1])
    return info[0][1]


def _check_resumable(cfg: TrainConfig, ckpt_path: str, state: dict[str, Any]) -> None:
    # checkpoints written before schedule_steps existed carry "steps" in their fingerprint
    saved = {k: v for k, v in state.get("fingerprint", {}).items() if k != "steps"}
    now = cfg.fingerprint()
    if saved != now:
        diff = {k: (saved.get(k), now.get(k)) for k in {*saved, *now} if saved.get(k) != now.get(k)}
        raise TrainError(f"--resume: {ckpt_path!r} was written by another configuration; "
                         + ", ".join(f"--{k.replace('_', '-')} was {a!r}, now {b!r}" for k, (a, b) in sorted(diff.items())))
    if int(state["step"]) > cfg.steps:
        raise TrainError(f"--resume: {ckpt_path!r} is at step {state['step']}, past --steps {cfg.steps}; "
                         f"pass --steps {state['step']} or more")


def _schedule_steps(cfg: TrainConfig, state: dict[str, Any] | None) -> int:
    """The step count the learning-rate schedule spans (see [Note: resuming with more steps])."""
    if state is None:
        return cfg.steps
    return int(state.get("schedule_steps", state.get("fingerprint", {}).get("steps", cfg.steps)))


def _train_run(cfg: TrainConfig, corpus: Corpus, build: Callable[[TrainConfig], _Run], name: str,
               found: tuple[str, dict[str, Any]] | None) -> dict | None:
    """Train (or resume from ``found``) one run; returns its final record on rank 0 (None
    elsewhere or if stopped)."""
    from .. import checkpoint as mckpt

    rank, W = dist.get_rank(), dist.get_world_size()
    out = Path(cfg.out)
    log_path = out / f"{name}.jsonl"
    ckpt_dir = out / "ckpt" / name

    run = build(cfg)
    start = 0
    schedule_steps = _schedule_steps(cfg, None if found is None else found[1])
    if found is not None:
        ckpt_path, state = found
        if state.get("corpus_sha256") != corpus.sha256:
            raise TrainError(f"--resume: {ckpt_path!r} was trained on other data (corpus sha256 "
                             f"{state.get('corpus_sha256', '?')[:12]} vs {corpus.sha256[:12]}: another Python version?)")
        try:
            mckpt.load(ckpt_path, run.model, run.opt)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            raise TrainError(f"--resume: cannot load {ckpt_path!r} ({e}); remove it and its .json to "
                             "resume from an earlier checkpoint") from None
        torch.set_rng_state(torch.tensor(bytearray.fromhex(state["torch_rng"]), dtype=torch.uint8))
        start = int(state["step"])

    if rank == 0:
        mesh = mesh_record(cfg, W)
        print(f"{name}: W={W} on mesh {mesh_str(mesh)}"
              + (f", replica_step {cfg.replica_step}" if cfg.replicas > 1 and name.startswith("matrixfsdp") else "")
              + (f", resuming from step {start}" if start else "")
              + (f" to step {cfg.steps} (the learning-rate schedule ends at step {schedule_steps}, the first "
                 f"run's --steps; the steps past it run at its final rate)" if schedule_steps < cfg.steps else ""),
              flush=True)

    # The log: keep what the checkpoint covers (steps <= start), drop the rest (it is recomputed).
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if start > 0 and log_path.exists():
            for line in log_path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
                if "final" not in rec and rec.get("step", 0) <= start:
                    kept.append(line)
        else:
            kept.append(json.dumps({"run": name, "header": True, "config": dataclasses.asdict(cfg),
                                    "world_size": W, "mesh": mesh_record(cfg, W), "model_params": MODEL_SIZES[cfg.model].num_params,
                                    "corpus": {"files": corpus.files, "train_bytes": corpus.train.numel(),
                                               "heldout_bytes": corpus.heldout.numel(),
                                               "sha256": corpus.sha256, "root": corpus.root},
                                    "torch": torch.__version__}))
        _atomic_write(log_path, "".join(line + "\n" for line in kept))
    logf = open(log_path, "a") if rank == 0 else None

    windows = heldout_windows(corpus, count=cfg.eval_windows, seq_len=cfg.seq_len)
    tokens_per_step = cfg.batch * cfg.seq_len
    bar = None
    if rank == 0:
        from tqdm.auto import tqdm

        disable = (not sys.stderr.isatty()) if cfg.progress is None else not cfg.progress
        bar = tqdm(total=cfg.steps, initial=start, desc=name, unit="step", dynamic_ncols=True,
                   disable=disable, file=sys.stderr)

    def log(rec: dict[str, Any]) -> None:
        if logf is not None:
            logf.write(json.dumps(rec) + "\n")
            logf.flush()

    t_run = time.perf_counter()
    stop = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    try:
        for step in range(start, stop):
            t0 = time.perf_counter()
            lr = _set_lr(run, lr_multiplier(step, schedule_steps))
            xy = local_batch(corpus, step, batch=cfg.batch, seq_len=cfg.seq_len, seed=cfg.seed, rank=rank,
                             world=W).to(cfg.device)
            c = run.counter
            if c is not None:
                c.reset()
            logits = run.model(xy[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), xy[:, 1:].flatten())
            fwd = _comm(c)
            loss.backward()
            bwd = _comm(c)
            gnorm = run.clip(run.model.parameters(), 1.0)
            clip = _comm(c)
            run.opt.step()
            run.opt.zero_grad(set_to_none=True)
            opt_step = _comm(c)
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            avg_loss = float(avg) / W
            dt = time.perf_counter() - t0
            done = step + 1
            rec: dict[str, Any] = {"run": name, "step": done, "loss": avg_loss, "lr": lr,
                                   "grad_norm": _scalar(gnorm),
                                   "tokens_per_s": tokens_per_step / dt, "step_s": dt}
            if run.qk is not None:  # the step's largest logit over every layer and rank (reduced)
                rec["max_logit"] = float(torch.stack(list(run.qk.max_logits().values())).max())
            if c is not None:  # bytes this rank sent, per phase (rank 0's view)
                rec["comm_bytes"] = {"forward": fwd[0], "backward": bwd[0] - fwd[0],
                                     "clip": clip[0] - bwd[0], "optimizer_step": opt_step[0] - clip[0]}
                rec["comm_calls"] = {"forward": fwd[1], "backward": bwd[1] - fwd[1],
                                     "clip": clip[1] - bwd[1], "optimizer_step": opt_step[1] - clip[1]}
            log(rec)
            if bar is not None:
                bar.set_postfix(loss=f"{avg_loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}", refresh=False)
                bar.update(1)
            if done % cfg.eval_every == 0 or done == cfg.steps:
                h = _heldout_loss(run.model, windows, cfg.device)
                log({"run": name, "step": done, "heldout_loss": h})
                if bar is not None:
                    bar.write(f"{name} step {done}: train loss {avg_loss:.4f}, held-out loss {h:.4f}")
            if done % cfg.ckpt_every == 0 or done == cfg.steps:
                _save(cfg, run, ckpt_dir, done, corpus, schedule_steps)
    finally:
        if bar is not None:
            bar.close()
    if stop < cfg.steps:
        if logf is not None:
            logf.close()
        return None
    heldout = _heldout_loss(run.model, windows, cfg.device)
    sample = _sample(run.model, cfg)
    digest = _param_digest(run.model)
    last = [json.loads(x) for x in log_path.read_text().splitlines()] if rank == 0 else []
    train_losses = [r["loss"] for r in last if "loss" in r]
    final = {"run": name, "final": True, "step": cfg.steps, "world_size": W, "mesh": mesh_record(cfg, W),
             "train_loss_last10": sum(train_losses[-10:]) / max(1, len(train_losses[-10:])),
             "heldout_loss": heldout, "sample": sample, "param_sha256": digest,
             "wall_s_this_process": time.perf_counter() - t_run, "resumed_from": start,
             "lr_schedule_steps": schedule_steps}
    log(final)
    if logf is not None:
        logf.close()
    return final if rank == 0 else None


def _save(cfg: TrainConfig, run: _Run, ckpt_dir: Path, step: int, corpus: Corpus, schedule_steps: int) -> None:
    from .. import checkpoint as mckpt

    rank = dist.get_rank()
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    path = ckpt_dir / f"step-{step:06d}"
    mckpt.save(path, run.model, run.opt)
    if rank == 0:  # the trainer state goes last: a checkpoint counts once its .json exists
        state = {"step": step, "world_size": dist.get_world_size(),
                 "mesh": mesh_record(cfg, dist.get_world_size()), "fingerprint": cfg.fingerprint(),
                 "schedule_steps": schedule_steps,
                 "corpus_sha256": corpus.sha256, "torch_rng": bytes(torch.get_rng_state().tolist()).hex()}
        _atomic_write(path.with_name(path.name + ".json"), json.dumps(state))
        # keep the newest two
        for old in sorted(ckpt_dir.glob("step-*.json"))[:-2]:
            old.unlink()
            shutil.rmtree(old.with_suffix(""), ignore_errors=True)
    dist.barrier()


# ------------------------------------------------------------------------------------------------
# entry on every rank
# ------------------------------------------------------------------------------------------------
def run_rank(cfg: TrainConfig) -> list[dict] | None:
    """Train every run of ``cfg`` on this rank (process group initialized); rank 0 returns finals."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(max_bytes=cfg.max_corpus_bytes)
    finals = []
    builders = {f"matrixfsdp-{cfg.optimizer}": _build_matrixfsdp, "fsdp2-adamw": _build_fsdp2}
    for name in run_names(cfg):
        # the configuration is checked before a finished run is taken as done: a changed setting
        # is an error, a larger --steps trains on (see [Note: resuming with more steps])
        found = _resume_point(cfg, name)
        if cfg.resume and _finished(cfg, name):
            if dist.get_rank() == 0:
                finals.append(_final_record(cfg, name))
            continue
        finals.append(_train_run(cfg, corpus, builders[name], name, found))
        if cfg.stop_after is not None and cfg.stop_after < cfg.steps:
            return None
    if dist.get_rank() == 0:
        from .plot import plot_losses

        plot_losses(Path(cfg.out), run_names(cfg), Path(cfg.out) / "loss.png")
        return finals
    return None


def _final_record(cfg: TrainConfig, name: str) -> dict | None:
    p = Path(cfg.out) / f"{name}.jsonl"
    if not p.exists():
        return None
    for line in reversed(p.read_text().splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("final"):
            return rec
    return None


def _finished(cfg: TrainConfig, name: str) -> bool:
    """Whether run ``name`` has its final record for ``cfg.steps`` steps (more steps: not yet)."""
    if dist.get_rank() == 0:
        rec = _final_record(cfg, name)
        flag: list[Any] = [rec is not None and int(rec.get("step", -1)) == cfg.steps]
    else:
        flag = [None]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])
