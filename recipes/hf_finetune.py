"""Hugging Face: fine-tune a transformers causal LM (Qwen3ForCausalLM) under matrixfsdp with Muon.

    python recipes/hf_finetune.py                                  # tiny Qwen3 built in code, 2 CPU ranks
    python recipes/hf_finetune.py --pretrained ~/models/Qwen3-0.6B --steps 50 --seq-len 256
    torchrun --nproc-per-node 8 recipes/hf_finetune.py --pretrained ~/models/Qwen3-8B --device cuda
    python recipes/hf_finetune.py --qk-clip 100                    # with QK-clip (MuonClip)

Without --pretrained the model is a tiny Qwen3 config (byte vocabulary) built in code, so it runs
on a laptop with nothing downloaded; with --pretrained it loads a local Hugging Face folder
(config, safetensors, tokenizer). The text is the Python standard library's own source. Prints
the loss every 10 steps and the held-out loss before and after, and writes the fine-tuned model
with save_pretrained (gathered on rank 0 from the matrixfsdp checkpoint) to --out.
"""

import argparse
import os
import pathlib
import sys
import sysconfig

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

import matrixfsdp


def stdlib_text() -> tuple[str, str]:
    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    read = lambda f: f.read_text(encoding="utf-8", errors="replace")  # noqa: E731
    return ("".join(read(f) for i, f in enumerate(files) if i % 10 != 9),
            "".join(read(f) for i, f in enumerate(files) if i % 10 == 9))


def build(args: argparse.Namespace):
    """(model, encode) identical on every rank."""
    if args.pretrained:
        tok = AutoTokenizer.from_pretrained(args.pretrained)
        model = AutoModelForCausalLM.from_pretrained(args.pretrained, dtype=torch.float32)
        return model, lambda text: tok(text[: 4_000_000], return_tensors="pt").input_ids[0]
    torch.manual_seed(0)  # the same random init on every rank
    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg), lambda text: torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def batches(tokens: torch.Tensor, rows: int, seq_len: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - seq_len, (rows,), generator=gen)
        yield tokens[starts[:, None] + torch.arange(seq_len)]


def heldout_loss(model, tokens: torch.Tensor, args: argparse.Namespace, device) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    x = next(batches(tokens, args.batch, args.seq_len, seed=1))[rank::world].to(device)
    with torch.no_grad():
        loss = model(input_ids=x, labels=x).loss.detach()
    dist.all_reduce(loss)
    return loss.item() / world


def main(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    model, encode = build(args)
    model.to(device)
    train_text, held_text = stdlib_text()
    train_tokens, held_tokens = encode(train_text), encode(held_text)

    # Shard: every decoder layer is a block (one collective each), the root holds the rest.
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("dp_shard",))
    layer_cls = type(model.model.layers[0])
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(layer_cls,))
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)

    # Muon on the owned matrices, AdamW (adamw_lr) on embeddings, head and norms: the model itself,
    # so the optimizer routes by the plan's rule (a parameter list cannot see embeddings).
    opt = matrixfsdp.optim.Muon(model, lr=args.lr, adamw_lr=args.adamw_lr, weight_decay=0.0,
                                ns_dtype=torch.float32)
    # QK-clip (MuonClip), optional: after each opt.step(), heads whose max logit exceeded tau get
    # their q/k rows rescaled (Qwen3's QK-norm already bounds its logits: then it only reports them)
    qk = matrixfsdp.qk_clip.QKClip(model, opt, tau=args.qk_clip) if args.qk_clip else None
    before = heldout_loss(model, held_tokens, args, device)
    if rank == 0:
        print(f"held-out loss before: {before:.4f}", flush=True)
    data = batches(train_tokens, args.batch, args.seq_len, seed=0)
    for step in range(1, args.steps + 1):
        x = next(data)[rank::world].to(device)           # this rank's rows of the global batch
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        matrixfsdp.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == args.steps:
            dist.all_reduce(avg := loss.detach().clone())
            if rank == 0:
                logit = f"  max logit {max(v.item() for v in qk.max_logits().values()):.2f}" if qk else ""
                print(f"step {step:4d}  loss {avg.item() / world:.4f}{logit}", flush=True)
    after = heldout_loss(model, held_tokens, args, device)

    # Save: a DCP checkpoint (every rank writes what it owns), then safetensors for transformers.
    ckpt = os.path.join(args.out, "dcp")
    matrixfsdp.checkpoint.save(ckpt, model, opt)
    if rank == 0:
        matrixfsdp.checkpoint.export_safetensors(ckpt, os.path.join(args.out, "model.safetensors"))
        model.config.save_pretrained(args.out)
        print(f"held-out loss after: {after:.4f} (before {before:.4f}); model in {args.out} "
              f"(AutoModelForCausalLM.from_pretrained({args.out!r}))")


def _spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{args.out}.store")
    try:
        main(args)
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
    p.add_argument("--pretrained", default=None, help="a local Hugging Face model folder (default: tiny Qwen3 in code)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences, split over the ranks)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length (tokens)")
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate (use ~0.002 for --pretrained)")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW learning rate (use ~3e-5 for --pretrained)")
    p.add_argument("--qk-clip", type=float, default=None, metavar="TAU",
                   help="QK-clip (MuonClip) threshold, e.g. 100 (default: off); logs each step's max logit")
    p.add_argument("--world", type=int, default=2, help="ranks to start when not under torchrun")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: nccl, under torchrun")
    p.add_argument("--out", default="runs/hf_finetune", help="output folder")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        try:
            main(args)
        finally:
            dist.destroy_process_group()
        exit_now()
    else:
        try:
            torch.multiprocessing.spawn(_spawned, args=(args.world, args), nprocs=args.world)
        finally:
            if os.path.exists(f"{args.out}.store"):
                os.remove(f"{args.out}.store")
