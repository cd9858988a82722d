"""Plain PyTorch: the main job's training loop, short enough to read in one sitting.

    python recipes/plain_pytorch.py                      # 2 CPU ranks (it starts them), 200 steps
    torchrun --nproc-per-node 2 recipes/plain_pytorch.py # the same, ranks started by torchrun
    torchrun --nproc-per-node 8 recipes/plain_pytorch.py --device cuda --hidden 1024 --layers 12

Trains a byte-level Qwen3-style decoder (matrixfsdp.Decoder) on the Python standard library's
source with Muon under matrixfsdp.fully_shard. Prints the loss every 10 steps and the held-out
loss at the end, and saves a checkpoint to --out. `python -m matrixfsdp.train` is the same loop
with a progress bar, logs, resume and a comparison run.
"""

import argparse
import math
import os
import pathlib
import sys
import sysconfig

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp


def stdlib_bytes() -> tuple[torch.Tensor, torch.Tensor]:
    """Train / held-out text: the stdlib's top-level *.py files, every 10th file held out."""
    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    train = b"".join(f.read_bytes() for i, f in enumerate(files) if i % 10 != 9)
    held = b"".join(f.read_bytes() for i, f in enumerate(files) if i % 10 == 9)
    return tuple(torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in (train, held))


def get_batch(data: torch.Tensor, rows: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq_len - 1, (rows,), generator=gen)
    return data[starts[:, None] + torch.arange(seq_len + 1)].long()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)) if args.device == "cuda" else None)
    train_data, held_data = stdlib_bytes()

    # 1. The model, identical on every rank (same seed), then sharded by the owner plan.
    cfg = matrixfsdp.DecoderConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=args.hidden // 4)
    model = matrixfsdp.Decoder(cfg).to(device)
    model.reset_parameters(seed=0)
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("dp_shard",))
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(matrixfsdp.DecoderLayer,))
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)  # blocks first, root last

    # 2. Muon for the hidden matrices, AdamW (lower lr) for embeddings, head and norms.
    matrices, others = [], []
    for name, p in model.named_parameters():
        (matrices if p.ndim == 2 and "embed" not in name and "lm_head" not in name else others).append(p)
    opt = matrixfsdp.optim.Muon([{"params": matrices, "lr": 0.02},
                                 {"params": others, "lr": 3e-3, "algorithm": "adamw"}],
                                weight_decay=0.0, ns_dtype=torch.float32)
    warmup = 20
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / max(1, args.steps - warmup))))))

    # 3. The loop: every rank takes its slice of the same global batch.
    gen = torch.Generator().manual_seed(0)
    local = args.batch // world
    for step in range(1, args.steps + 1):
        xy = get_batch(train_data, args.batch, args.seq_len, gen)[rank * local:(rank + 1) * local].to(device)
        loss = F.cross_entropy(model(xy[:, :-1]).flatten(0, 1).float(), xy[:, 1:].flatten())
        loss.backward()                                      # owners receive whole averaged gradients
        matrixfsdp.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()                                           # local: no communication
        opt.zero_grad()
        sched.step()
        if step % 10 == 0 or step == args.steps:
            dist.all_reduce(avg := loss.detach().clone())
            if rank == 0:
                print(f"step {step:4d}  loss {avg.item() / world:.4f}  lr {sched.get_last_lr()[0]:.4f}", flush=True)

    # 4. Held-out loss and a checkpoint (DCP; loadable at any world size, or in one process).
    with torch.no_grad():
        xy = get_batch(held_data, args.batch, args.seq_len, torch.Generator().manual_seed(1))
        xy = xy[rank * local:(rank + 1) * local].to(device)
        held = F.cross_entropy(model(xy[:, :-1]).flatten(0, 1).float(), xy[:, 1:].flatten())
    dist.all_reduce(held)
    matrixfsdp.checkpoint.save(args.out, model, opt)
    if rank == 0:
        print(f"held-out loss {held.item() / world:.4f}; checkpoint in {args.out}")


def _spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{args.out}.store")
    try:
        train(args)
    finally:
        dist.destroy_process_group()
    exit_now()


def exit_now() -> None:
    # torch 2.13 + gloo: a worker thread may still be releasing the last collective's tensors when
    # the interpreter shuts down, which aborts the process (SIGABRT); skip the shutdown.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length (bytes)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (4 heads, MLP 3x)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--world", type=int, default=2, help="ranks to start when not under torchrun")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: use nccl (under torchrun)")
    p.add_argument("--out", default="runs/plain_pytorch/ckpt", help="checkpoint directory")
    args = p.parse_args()
    if "RANK" in os.environ:  # torchrun
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        exit_now()
    else:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        if os.path.exists(f"{args.out}.store"):
            os.remove(f"{args.out}.store")
        try:
            torch.multiprocessing.spawn(_spawned, args=(args.world, args), nprocs=args.world)
        finally:
            if os.path.exists(f"{args.out}.store"):
                os.remove(f"{args.out}.store")
