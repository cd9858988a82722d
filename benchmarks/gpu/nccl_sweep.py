"""NCCL parity sweep for a machine with 2 to 8 GPUs (issue 29): flat, HSDP and TP meshes at the
launch's W against an unsharded reference, gradients and parameters compared directly.

    TORCH_NCCL_DUMP_ON_TIMEOUT=1 torchrun --nproc-per-node=8 benchmarks/gpu/nccl_sweep.py --out $OUT/nccl_sweep
    for w in 2 4 8; do TORCH_NCCL_DUMP_ON_TIMEOUT=1 torchrun --nproc-per-node=$w benchmarks/gpu/nccl_sweep.py; done
    python benchmarks/gpu/nccl_sweep.py --backend gloo --spawn 2     # the CPU smoke CI runs

``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` is required under NCCL (checked at start): a hung collective then
dumps the flight recorder's trace of every rank instead of dying silently. The process group's
timeout is ``--timeout`` seconds (120 by default).

Every rank trains the model sharded and, in the same process, an unsharded copy on the whole
batch (the patterns of ``tests/fully_shard/test_hsdp.py`` and ``test_tp.py``). After the first
backward each rank's local gradients are compared with the matching part of the reference's
(relative to the reference's largest entry), after ``--steps`` Muon steps (float32
Newton-Schulz) the local parameters and ``full_tensor()`` of every parameter. Meshes at W:

* ``flat``: ``(W,)``, owners over all ranks;
* ``hsdp-repeat`` / ``hsdp-split``: ``(2, W/2)`` ``(dp_replicate, dp_shard)`` (W even), both step modes;
* ``tp``: ``(W/2, 2)`` ``(dp_shard, tp)``, ``ColwiseParallel``/``RowwiseParallel`` MLPs (W even).

Rows go to ``--out/rows.jsonl`` (rank 0, one per mesh as it finishes); the exit status is 1 when
any mesh exceeds its tolerance on any rank.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
VOCAB, DIM, HIDDEN, BATCH_PER_RANK, SEQ = 64, 32, 80, 2, 8
#: relative to the reference's largest entry: one reduction's rounding, then a few steps of it
GRAD_TOL, PARAM_TOL = 1e-5, 1e-4


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Embedding, MLP blocks, head; ``forward`` is the loss (fully_shard's hooks run on it)."""

    def __init__(self, d: int = DIM, h: int = HIDDEN, n_blocks: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n_blocks))
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), tgt.reshape(-1))


def _batch(step: int, rows: int, dev: torch.device):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    return x.to(dev), torch.randint(0, VOCAB, (rows, SEQ), generator=g).to(dev)


def meshes(world: int) -> list[str]:
    out = ["flat"]
    if world % 2 == 0:
        out += ["hsdp-repeat", "hsdp-split", "tp"]
    return out


def _build(kind: str, world: int, dev: torch.device):
    """The sharded model, its reference, the data-parallel coordinate and the number of batch rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import matrixfsdp

    model = Net().to(dev)
    ref = copy.deepcopy(model)
    rank = dist.get_rank()
    if kind == "tp":
        mesh = init_device_mesh(dev.type, (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,))
        shard_mesh, dp, dp_rank = mesh["dp_shard"], world // 2, mesh["dp_shard"].get_local_rank()
    elif kind.startswith("hsdp"):
        mesh = init_device_mesh(dev.type, (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,), replica_step=kind.split("-")[1])
        shard_mesh, dp, dp_rank = mesh, world, rank
    else:
        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp_shard",))
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,))
        shard_mesh, dp, dp_rank = mesh, world, rank
    for b in model.blocks:
        matrixfsdp.fully_shard(b, mesh=shard_mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=shard_mesh, plan=plan)
    return model, ref, dp, dp_rank


def _expect(full: torch.Tensor, p: Any, kind: str) -> torch.Tensor | None:
    """The part of ``full`` this rank's local tensor of ``p`` holds (None: none)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from matrixfsdp.placement.owner import owner_of

    if not isinstance(p, DTensor):
        return full
    info = owner_of(p)
    if info is not None and kind != "tp":
        return full if info.holds else None
    if p._local_tensor.numel() == 0:
        return None
    shape, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(off, shape))]


def _grad_expected(p: Any) -> bool:
    """Whether this rank holds a gradient of ``p`` after backward: all but the owners of an HSDP
    ``split`` parameter on replicas that do not step it."""
    from matrixfsdp.placement.owner import owner_of

    info = owner_of(p)
    if info is None:
        return True
    return not (info.step_replica is not None and info.holds and not info.is_local)


def _diff(model: nn.Module, ref: nn.Module, what: str, kind: str) -> float:
    """Worst relative difference of this rank's local tensors against the reference's parts;
    NaN-aware, and a missing or unexpected gradient counts as infinite."""
    refp = dict(ref.named_parameters())
    worst = 0.0
    for fqn, p in model.named_parameters():
        rp = refp[fqn]
        full = rp.grad if what == "grad" else rp.detach()
        mine = p.grad if what == "grad" else p
        if what == "grad":
            if full is None or not _grad_expected(p):
                if mine is not None:
                    return math.inf
                continue
            if mine is None:
                return math.inf
        exp = _expect(full, p, kind)
        if exp is None or exp.numel() == 0:
            continue
        local = mine._local_tensor if hasattr(mine, "_local_tensor") else mine.detach()
        if local.shape != exp.shape:
            raise ValueError(f"nccl_sweep: {fqn} local shape {tuple(local.shape)} != expected {tuple(exp.shape)}")
        v = (local.float() - exp).abs().max().item() / max(full.abs().max().item(), 1e-12)
        worst = max(worst, math.inf if math.isnan(v) else v)
    return worst


def parity(kind: str, steps: int, dev: torch.device) -> dict:
    import matrixfsdp

    world = dist.get_world_size()
    model, ref, dp, d = _build(kind, world, dev)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    out: dict[str, Any] = {"mesh": kind, "world": world}
    n = BATCH_PER_RANK
    for step in range(steps):
        x, y = _batch(step, n * dp, dev)
        model(x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]).backward()
        ref(x, y).backward()
        if step == 0:
            out["grad0"] = _diff(model, ref, "grad", kind)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    if hasattr(model, "sync_params"):
        model.sync_params()  # HSDP split: the step replicas' values reach the other owners
    out["param"] = _diff(model, ref, "param", kind)
    refp = dict(ref.named_parameters())
    out["full_tensor"] = max(((matrixfsdp.full_tensor(p).float() - refp[f].detach()).abs().max()
                              / refp[f].detach().abs().max().clamp_min(1e-12)).item()
                             for f, p in model.named_parameters())
    return out


def run(args: argparse.Namespace) -> int:
    """On every rank of an initialized group: each mesh's parity; rank 0 writes the rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" else torch.device("cpu")
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for kind in meshes(world):
        t0 = time.perf_counter()
        try:
            res = parity(kind, args.steps, dev)
            res["ok"] = res["grad0"] <= GRAD_TOL and res["param"] <= PARAM_TOL and res["full_tensor"] <= PARAM_TOL
        except Exception as e:  # recorded; a collective that failed may leave the group unusable
            res = {"mesh": kind, "world": world, "ok": False, "error": f"{type(e).__name__}: {e}"[:400],
                   "traceback": traceback.format_exc()[-2000:]}
        worst = [None] * world
        dist.all_gather_object(worst, res)
        row = {"mesh": kind, "world": world, "backend": args.backend, "ok": all(r["ok"] for r in worst),
               "grad0": max(r.get("grad0", math.inf) for r in worst), "param": max(r.get("param", math.inf) for r in worst),
               "full_tensor": max(r.get("full_tensor", math.inf) for r in worst),
               "tolerances": {"grad": GRAD_TOL, "param": PARAM_TOL}, "wall_s": round(time.perf_counter() - t0, 2),
               "errors": [r["error"] for r in worst if "error" in r][:2],
               "at": datetime.datetime.now().isoformat(timespec="seconds")}
        failed += not row["ok"]
        if rank == 0:
            with open(out / "rows.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
                f.flush()
            print(f"W={world} {kind:<12} {'ok' if row['ok'] else 'FAILED'}  grad0 {row['grad0']:.2e}  "
                  f"param {row['param']:.2e}  full_tensor {row['full_tensor']:.2e}  ({row['wall_s']} s)"
                  + (f"  {row['errors']}" if row["errors"] else ""), flush=True)
    return 1 if failed else 0


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, codes: Any) -> None:
    """A ``--spawn`` rank: its own process group, then :func:`run`."""
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    codes[rank] = _main_in_group(args, timedelta(seconds=args.timeout))


def _main_in_group(args: argparse.Namespace, timeout: Any) -> int:
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=timeout,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group(args.backend, timeout=timeout)
    try:
        return run(args)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from datetime import timedelta

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=120, help="process group timeout, seconds")
    ap.add_argument("--spawn", type=int, default=0, help="start this many ranks here (no torchrun)")
    ap.add_argument("--out", default=None, help="rows folder (default $OUT/nccl_sweep, else "
                                                "runs/nccl_sweep-<date>, which git ignores)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(Path(os.environ["OUT"]) / "nccl_sweep" if os.environ.get("OUT")
                       else ROOT / "runs" / f"nccl_sweep-{datetime.date.today().isoformat()}")
    if args.backend == "nccl":
        if os.environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT") != "1":
            ap.error("TORCH_NCCL_DUMP_ON_TIMEOUT=1 must be set (a hung collective then dumps every rank's "
                     f"flight recorder), got {os.environ.get('TORCH_NCCL_DUMP_ON_TIMEOUT')!r}")
        n = torch.cuda.device_count()
        world = args.spawn or int(os.environ.get("WORLD_SIZE", "1"))
        if not 2 <= world <= n:
            ap.error(f"--backend nccl needs 2 <= W <= {n} GPUs (W from torchrun or --spawn), got W={world}")
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))  # this tree's matrixfsdp
    if args.spawn:
        import torch.multiprocessing as mp

        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        codes = mp.get_context("spawn").Manager().dict()
        mp.spawn(_worker, args=(args.spawn, port, args, codes), nprocs=args.spawn, join=True)
        return max(codes.values()) if len(codes) == args.spawn else 1
    return _main_in_group(args, timedelta(seconds=args.timeout))


if __name__ == "__main__":
    sys.exit(main())
