"""The main job: train a small Qwen3-style byte-level decoder under ``matrixfsdp.fully_shard``.

    python -m matrixfsdp.train                       # 2 ranks on CPU, Muon, + stock FSDP2/AdamW
    python -m matrixfsdp.train --optimizer soap --world 4 --steps 400 --out runs/soap
    python -m matrixfsdp.train --resume              # continue runs/train from its last checkpoint
    python -m matrixfsdp.train --resume --steps 250  # train the finished 200-step runs on to step 250
    python -m matrixfsdp.train --model tiny-moe      # a mixture of experts, written to runs/train-tiny-moe
    python -m matrixfsdp.train --world 4 --replicas 2  # HSDP: a (2, 2) (dp_replicate, dp_shard) mesh
    torchrun --nproc-per-node 2 -m matrixfsdp.train  # the same, processes started by torchrun
    python -m matrixfsdp.train --device cuda --world 8  # one GPU per rank, NCCL, bf16 mixed precision

Data: the Python standard library's own source files, read at run time and byte-tokenized, every
10th file held out (nothing is downloaded). Without ``torchrun`` the command starts its own
``--world`` processes. ``--device auto`` (the default) runs on CUDA where
``torch.cuda.is_available()``: one GPU per rank (``torch.cuda.set_device(local rank)``), NCCL,
bf16 mixed precision (fp32 gradient reduction) and bf16 Newton-Schulz, the stock FSDP2 run with
the same mixed precision; else on the CPU: gloo, fp32 throughout. Rank 0 shows a progress bar
and writes, under ``--out``: ``<run>.jsonl`` (step, loss, lr, grad norm, tokens/s, bytes sent per
phase from the runtime's counters; held-out evals; a final record with the held-out loss and a
generated sample), ``ckpt/<run>/step-N`` checkpoints, and ``loss.png`` (with ``--compare``, on by
default: the same model, data and token budget under stock FSDP2 + AdamW).

Exit status: 0 done, 2 bad input (one ``error:`` line on stderr; nothing under ``--out`` is
removed or overwritten), 1 a crash (its traceback).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Sequence

from .job import (MODEL_SIZES, OPTIMIZER_LRS, TrainConfig, TrainError, choose_device, device_choice,
                  latest_checkpoint, mesh_str, run_names)

__all__ = ["main", "build_parser", "config_from_args"]

_COLLECTIVES = ("all_to_all", "p2p", "two_phase")


def _positive(name: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m matrixfsdp.train",
        description="Train a small Qwen3-style byte-level decoder on the Python standard library's "
                    "source under matrixfsdp.fully_shard (and, with --compare, under stock FSDP2 + "
                    "AdamW), with a progress bar, a JSONL log, checkpoints and a loss plot.",
        formatter_class=_DefaultsFormatter,
    )
    sizes = ", ".join(f"{k}: {v.num_params / 1e6:.2f}M params" for k, v in MODEL_SIZES.items())
    p.add_argument("--out", default=None,
                   help="output folder (logs, checkpoints, loss.png); default: runs/train for --model "
                        "small, runs/train-<model> for the others (so each model's run has its own)")
    p.add_argument("--model", default="small", choices=list(MODEL_SIZES), help=f"model size ({sizes})")
    p.add_argument("--optimizer", default="muon", choices=list(OPTIMIZER_LRS),
                   help="optimizer of the matrixfsdp run: matrices get it, the rest AdamW "
                        "(learning rates: " + ", ".join(f"{k} {a:g}" for k, (a, _) in OPTIMIZER_LRS.items()) + ")")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate of the matrices in the matrixfsdp run (default: per --optimizer, above)")
    p.add_argument("--adamw-lr", type=float, default=None,
                   help="learning rate of its AdamW parameters (embeddings, head, norms; default 3e-3, "
                        "1.5e-3 with --optimizer adamw)")
    p.add_argument("--world", type=_positive("--world"), default=None,
                   help="data-parallel ranks (processes) to start; default 2, or torchrun's WORLD_SIZE")
    p.add_argument("--replicas", type=_positive("--replicas"), default=1,
                   help="HSDP: the --world ranks form an (R, world / R) mesh (dp_replicate, dp_shard); "
                        "matrices are owned within each group of world / R ranks, identically in every "
                        "replica (1: a flat mesh)")
    p.add_argument("--replica-step", default="auto", choices=("auto", "repeat", "split"),
                   help="with --replicas > 1, how an owned matrix combines across replicas: 'repeat' "
                        "(all-reduce, every replica steps it), 'split' (one step replica steps it and "
                        "all-gathers the result), 'auto' (split for matrices, repeat for element-wise)")
    p.add_argument("--steps", type=_positive("--steps"), default=200,
                   help="optimizer steps per run; with --resume, more than the run was started with "
                        "trains on to this step (the learning-rate schedule keeps the first run's end: "
                        "the extra steps run at its final rate)")
    p.add_argument("--batch", type=_positive("--batch"), default=16,
                   help="global batch in sequences (split evenly over the ranks)")
    p.add_argument("--seq-len", type=_positive("--seq-len"), default=128, help="sequence length in bytes")
    p.add_argument("--collectives", default="all_to_all", choices=_COLLECTIVES,
                   help="matrixfsdp's materialization collectives (fully_shard(collectives=...))")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                   help="also train stock FSDP2 + AdamW on the same data and tokens, and plot both")
    p.add_argument("--resume", action="store_true",
                   help="continue the runs in --out from their last checkpoints (any --world)")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the logs, checkpoints and plot a previous run left in --out first")
    p.add_argument("--ckpt-every", type=_positive("--ckpt-every"), default=100,
                   help="save a checkpoint every N steps (and at the end; the newest two are kept)")
    p.add_argument("--eval-every", type=_positive("--eval-every"), default=50,
                   help="held-out loss every N steps (and at the end)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialization and the data order")
    p.add_argument("--threads", type=_positive("--threads"), default=None,
                   help="intra-op threads per rank; default: CPU cores / ranks (at least 1)")
    p.add_argument("--sample-bytes", type=int, default=200, help="length of the generated text sample")
    p.add_argument("--stop-after", type=_positive("--stop-after"), default=None,
                   help="stop after this step as if interrupted (to try --resume)")
    p.add_argument("--max-corpus-bytes", type=_positive("--max-corpus-bytes"), default=None,
                   help="use only this many bytes of training text (quick tests)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show the progress bar (default: when stderr is a terminal)")
    p.add_argument("--qk-clip", type=float, default=None, metavar="TAU",
                   help="QK-clip (MuonClip) in the matrixfsdp run: after each step, rescale the query/key rows of "
                        "every head whose max logit exceeded TAU (Kimi K2: 100); logs each step's max_logit. The "
                        "built-in models normalize q/k per head (QK-norm), which bounds their logits already: the "
                        "clip then only reports (docs/optimizers.md, QK-clip)")
    p.add_argument("--per-head", action="store_true",
                   help="per-head Muon in the matrixfsdp run: each attention head's rows of the q/k/v projections "
                        "orthogonalized as their own matrix (MatrixRule.per_head; docs/optimizers.md, Per-head Muon); "
                        "--optimizer muon only")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="cuda: one GPU per rank, NCCL, bf16 mixed precision and bf16 Newton-Schulz; cpu: gloo, "
                        "fp32; auto: cuda where torch.cuda.is_available(), else cpu")
    return p


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` only where the help does not already say the default, and not
    for flags whose default is None or False (their help says what happens)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if "default" in help or action.default in (None, False, argparse.SUPPRESS):
            return help
        return super()._get_help_string(action)


def default_out(model: str) -> str:
    """``--out``'s default: ``runs/train`` for the default model, ``runs/train-<model>`` otherwise."""
    return "runs/train" if model == "small" else f"runs/train-{model}"


def _torchrun_world() -> int | None:
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                and "MASTER_ADDR" in os.environ):
        return int(os.environ["WORLD_SIZE"])
    return None


def config_from_args(args: argparse.Namespace, world: int) -> TrainConfig:
    """Check the arguments against each other and the output folder; raises :class:`TrainError`."""
    if args.batch % world:
        raise TrainError(f"--world {world} must divide --batch {args.batch} (every rank takes "
                         f"batch / world sequences); try --batch {max(world, args.batch // world * world)}")
    if args.resume and args.overwrite:
        raise TrainError("--resume and --overwrite exclude each other")
    if args.stop_after is not None and args.stop_after >= args.steps:
        raise TrainError(f"--stop-after {args.stop_after} must be below --steps {args.steps}")
    for name in ("lr", "adamw_lr"):
        v = getattr(args, name)
        if v is not None and not (v > 0 and v < float("inf")):
            raise TrainError(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    if args.qk_clip is not None and not (0 < args.qk_clip < float("inf")):
        raise TrainError(f"--qk-clip must be a positive number, got {args.qk_clip}")
    if args.per_head and args.optimizer != "muon":
        raise TrainError(f"--per-head is per-head Muon: it needs --optimizer muon, got --optimizer {args.optimizer}")
    if args.sample_bytes < 0:
        raise TrainError(f"--sample-bytes must be >= 0, got {args.sample_bytes}")
    choice = choose_device(getattr(args, "device", "auto"))
    if choice.device == "cuda" and _torchrun_world() is None and world > _cuda_count():
        raise TrainError(f"--world {world} needs one GPU per rank, found {_cuda_count()}; pass --world "
                         f"{_cuda_count()}, start the ranks with torchrun across nodes, or --device cpu")
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    if args.out is None:
        args.out = default_out(args.model)
    cfg = TrainConfig(out=args.out, model=args.model, optimizer=args.optimizer, steps=args.steps,
                      batch=args.batch, seq_len=args.seq_len, seed=args.seed, collectives=args.collectives,
                      replicas=args.replicas, replica_step=args.replica_step,
                      lr=args.lr, adamw_lr=args.adamw_lr, compare=args.compare, ckpt_every=args.ckpt_every, eval_every=args.eval_every,
                      sample_bytes=args.sample_bytes, resume=args.resume, stop_after=args.stop_after,
                      threads=threads, max_corpus_bytes=args.max_corpus_bytes, progress=args.progress,
                      device=choice.device, qk_clip=args.qk_clip, per_head=args.per_head)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {args.out!r} is a file, not a folder")
    leftovers = [p for p in [*(out / f"{n}.jsonl" for n in _all_run_names(cfg)), out / "ckpt", out / "loss.png"]
                 if p.exists()]
    if args.resume:
        have = [n for n in run_names(cfg) if latest_checkpoint(out, n) is not None or (out / f"{n}.jsonl").exists()]
        if latest_checkpoint(out, run_names(cfg)[0]) is None and not _has_final(out, run_names(cfg)[0]):
            raise TrainError(f"--resume: no checkpoint of run {run_names(cfg)[0]!r} under "
                             f"{str(out / 'ckpt' / run_names(cfg)[0])!r} (run without --resume to start, "
                             f"or pass the --out and --optimizer of the run to continue)"
                             + (f"; found runs {have}" if have else ""))
    elif leftovers and not args.overwrite:
        raise TrainError(f"--out {args.out!r} already holds a run ({', '.join(str(p) for p in leftovers[:3])}); "
                         "pass --resume to continue it, --overwrite to replace it, or another --out")
    return cfg


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def _init_rank(cfg: TrainConfig, local_rank: int, **init: object) -> None:
    """This process's device and process group: NCCL on its own GPU, or gloo."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads)
    choice = device_choice(cfg.device)
    if choice.device == "cuda":
        torch.cuda.set_device(local_rank)  # before any collective: NCCL binds each rank to its GPU
    dist.init_process_group(choice.backend, timeout=timedelta(minutes=10), **init)  # type: ignore[arg-type]


def _all_run_names(cfg: TrainConfig) -> list[str]:
    return [f"matrixfsdp-{o}" for o in OPTIMIZER_LRS] + ["fsdp2-adamw"]


def _has_final(out: Path, name: str) -> bool:
    p = out / f"{name}.jsonl"
    return p.exists() and '"final": true' in p.read_text()


def _overwrite(cfg: TrainConfig) -> None:
    out = Path(cfg.out)
    for n in _all_run_names(cfg):
        (out / f"{n}.jsonl").unlink(missing_ok=True)
    (out / "loss.png").unlink(missing_ok=True)
    shutil.rmtree(out / "ckpt", ignore_errors=True)


def _print_summary(cfg: TrainConfig, finals: list[dict | None]) -> None:
    out = Path(cfg.out)
    for f in finals:
        if f is None:
            continue
        mesh = f.get("mesh")
        where = f" on mesh {mesh_str(mesh)}" if mesh else ""
        print(f"{f['run']}: {f['step']} steps at W={f['world_size']}{where}: train loss (mean of last 10 steps) "
              f"{f['train_loss_last10']:.4f}, held-out loss {f['heldout_loss']:.4f}")
    for f in finals:
        if f is not None and f["sample"]:
            print(f"--- sample from {f['run']} (prompt 'def ') ---\n{f['sample']}\n---")
    print(f"log: {', '.join(str(out / (n + '.jsonl')) for n in run_names(cfg))}")
    print(f"plot: {out / 'loss.png'}   checkpoints: {out / 'ckpt'}")


def _rank_main(cfg: TrainConfig) -> int:
    """Body of every rank once the process group is up; returns the exit status."""
    import torch.distributed as dist

    from .job import run_rank

    status = 0
    try:
        finals = run_rank(cfg)
        if dist.get_rank() == 0:
            if finals is None:
                print(f"stopped after step {cfg.stop_after} (--stop-after); continue with --resume")
            else:
                _print_summary(cfg, finals)
    except TrainError as e:
        if dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        status = 2
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        dist.destroy_process_group()
    return status


def _exit_now(status: int) -> None:
    """End this rank's process without interpreter finalization.

    torch 2.13 + gloo: a collective's worker thread drops its references to the collective's
    tensors only after signalling completion; if that happens while the main thread finalizes
    the interpreter, taking the GIL aborts the process (``terminate called without an active
    exception``; see [Note: collectives right before exit] in ``comm/agree.py``). Everything
    is written and the process group destroyed by now, so nothing is lost by skipping it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _spawned(rank: int, cfg: TrainConfig, world: int, store_path: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    _init_rank(cfg, rank, store=store, rank=rank, world_size=world)  # one node: the rank is the local rank
    _exit_now(_rank_main(cfg))


def _start_method(device: str = "cpu") -> str:
    # fork: the children share the parent's imported torch (no 3 s re-import each); the parent
    # has run no torch op (no thread pools, no CUDA), which is what makes forking safe. CUDA:
    # spawn, since asking torch.cuda.is_available() / device_count() initialized the driver here.
    import multiprocessing

    if device == "cuda":
        return "spawn"
    return "fork" if "fork" in multiprocessing.get_all_start_methods() and sys.platform == "linux" else "spawn"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the main job; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    tr_world = _torchrun_world()
    try:
        if tr_world is not None and args.world is not None and args.world != tr_world:
            raise TrainError(f"--world {args.world} differs from torchrun's WORLD_SIZE {tr_world}; "
                             "leave --world out under torchrun")
        world = tr_world or args.world or 2
        if world % args.replicas:
            msg = (f"--replicas {args.replicas} must divide --world {world} (the mesh is "
                   f"(replicas, world / replicas))")
            if os.environ.get("RANK", "0") != "0":
                return 2  # under torchrun rank 0 reports
            parser.error(msg)  # exits with status 2
        cfg = config_from_args(args, world)
    except TrainError as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank checks; one reports
            print(f"error: {e}", file=sys.stderr)
        return 2

    missing = [m for m in ("tqdm", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: matrixfsdp.train needs {' and '.join(missing)}: pip install -c constraints.txt -e \".[train]\"",
              file=sys.stderr)
        return 2

    if tr_world is not None:  # torchrun started us: one rank per process
        import torch.distributed as dist

        _init_rank(cfg, int(os.environ.get("LOCAL_RANK", "0")))
        if args.overwrite and dist.get_rank() == 0:
            _overwrite(cfg)
        dist.barrier()
        _exit_now(_rank_main(cfg))

    import torch.multiprocessing as mp

    if args.overwrite:
        _overwrite(cfg)
    with tempfile.TemporaryDirectory(prefix="matrixfsdp-train-") as tmp:
        try:
            mp.start_processes(_spawned, args=(cfg, world, os.path.join(tmp, "store")), nprocs=world,
                               join=True, start_method=_start_method(cfg.device))
        except mp.ProcessExitedException as e:
            if e.exit_code == 2:
                return 2  # a TrainError: rank 0 printed it
            print(f"error: rank {e.error_index} exited with status {e.exit_code}"
                  + (f" (signal {e.signal_name})" if getattr(e, "signal_name", None) else ""), file=sys.stderr)
            return 1
        except mp.ProcessRaisedException as e:
            print(f"error: rank {e.error_index} crashed:\n{e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
