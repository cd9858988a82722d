"""Hugging Face Trainer: fine-tune a transformers Qwen3ForCausalLM under matrixfsdp with transformers.Trainer.

    python recipes/hf_trainer.py                                  # tiny Qwen3 built in code, 2 CPU ranks
    torchrun --nproc-per-node 2 recipes/hf_trainer.py             # the same, ranks started by torchrun
    python recipes/hf_trainer.py --steps 150 --resume             # continue a finished run to step 150
    torchrun --nproc-per-node 8 recipes/hf_trainer.py --pretrained ~/models/Qwen3-8B --device cuda --bf16

The model, the text and the optimizer are those of hf_finetune.py (its custom loop); here
transformers' Trainer runs the loop, through matrixfsdp.hf_trainer.MatrixFSDPTrainer: gradient
accumulation (--grad-accum), clipping to 1.0 with the norm over all ranks, Trainer's logging every
10 steps, evaluation on the held-out batch and a DCP checkpoint every --save-steps, optional bf16
autocast (--bf16), and at the end save_model, a folder AutoModelForCausalLM.from_pretrained loads.
The training rows are hf_finetune.py's global batches in order (sequential sampling), so each
optimizer step sees the same rows as that recipe's step.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(args: argparse.Namespace) -> None:
    # imported here, on the ranks only: the launching process then skips transformers' import
    from hf_finetune import batches, build, stdlib_text  # the same model and data
    from transformers import TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from matrixfsdp.hf_trainer import MatrixFSDPTrainer

    world = dist.get_world_size()
    per_device, rest = divmod(args.batch, world * args.grad_accum)
    if rest or not per_device:
        raise ValueError(f"--batch {args.batch} must be a positive multiple of world size x --grad-accum "
                         f"= {world} x {args.grad_accum}")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    model, encode = build(args)
    model.to(device)
    train_text, held_text = stdlib_text()
    train_tokens, held_tokens = encode(train_text), encode(held_text)
    # hf_finetune.py's global batches, one after the other; its held-out batch (seed 1)
    data = batches(train_tokens, args.batch, args.seq_len, seed=0)
    train = [{"input_ids": x, "labels": x} for _ in range(args.steps) for x in next(data)]
    held = [{"input_ids": x, "labels": x} for x in next(batches(held_tokens, args.batch, args.seq_len, seed=1))]

    # Shard as hf_finetune.py does: every decoder layer is a block, the root holds the rest.
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("dp_shard",))
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(type(model.model.layers[0]),))
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    # Muon on the owned matrices, AdamW on embeddings, head and norms; adamw_lr=None makes the AdamW
    # group use its own "lr", so Trainer's scheduler (which edits "lr") drives both groups.
    opt = matrixfsdp.optim.Muon(model, lr=args.lr, weight_decay=0.0, ns_dtype=torch.float32)
    for group in opt.param_groups:
        if group["algorithm"] == "adamw":
            group["lr"] = args.adamw_lr

    targs = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=per_device,
        per_device_eval_batch_size=max(1, args.batch // world), gradient_accumulation_steps=args.grad_accum,
        train_sampling_strategy="sequential", lr_scheduler_type=args.scheduler, max_grad_norm=1.0,
        logging_steps=10, eval_strategy="steps", eval_steps=args.save_steps, save_strategy="steps",
        save_steps=args.save_steps, save_total_limit=2, prediction_loss_only=True, bf16=args.bf16,
        use_cpu=args.device == "cpu", report_to="none", disable_tqdm=True, seed=0)
    trainer = MatrixFSDPTrainer(model=model, args=targs, train_dataset=train, eval_dataset=held,
                                optimizers=(opt, None))
    resume = get_last_checkpoint(args.out) if args.resume else None
    if args.resume and resume is None:
        raise FileNotFoundError(f"--resume: no checkpoint-<step> folder in {args.out}")
    before = trainer.evaluate()["eval_loss"]
    if resume and dist.get_rank() == 0:
        print(f"resuming from {resume}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    after = trainer.evaluate()["eval_loss"]
    final = os.path.join(args.out, "final")
    trainer.save_model(final)  # every rank: gathered from the owners, written by rank 0
    if dist.get_rank() == 0:
        print(f"held-out loss after: {after:.4f} (initial model {before:.4f}); checkpoints in {args.out}/checkpoint-*/dcp; "
              f"model in {final} (AutoModelForCausalLM.from_pretrained({final!r}))", flush=True)


def exit_now() -> None:
    # as hf_finetune.py: skip the interpreter shutdown, which gloo's worker threads can abort (SIGABRT)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def _store(args: argparse.Namespace) -> str:
    # absolute: "file://runs/x.store" would name /x.store (host "runs"), "file://x.store" nothing
    return os.path.abspath(args.out) + ".store"


def _spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # what torchrun would set: accelerate (inside TrainingArguments) reads these
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{_store(args)}")
    try:
        main(args)
    finally:
        dist.destroy_process_group()
    exit_now()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrained", default=None, help="a local Hugging Face model folder (default: tiny Qwen3 in code)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="global batch per optimizer step (sequences)")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length (tokens)")
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate (use ~0.002 for --pretrained)")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW learning rate (use ~3e-5 for --pretrained)")
    p.add_argument("--scheduler", default="constant", help="Trainer's lr_scheduler_type (constant: as hf_finetune.py)")
    p.add_argument("--save-steps", type=int, default=50, help="evaluate and write a checkpoint every N steps")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (Trainer's bf16=True)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --out")
    p.add_argument("--world", type=int, default=2, help="ranks to start when not under torchrun")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: nccl, under torchrun")
    p.add_argument("--out", default="runs/hf_trainer", help="output folder")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    os.makedirs(args.out, exist_ok=True)
    if "RANK" in os.environ:  # torchrun
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        try:
            main(args)
        finally:
            dist.destroy_process_group()
        exit_now()
    else:
        try:
            torch.multiprocessing.spawn(_spawned, args=(args.world, args), nprocs=args.world)
        finally:
            if os.path.exists(_store(args)):
                os.remove(_store(args))
