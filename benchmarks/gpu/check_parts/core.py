"""What the parts of ``benchmarks/gpu/check.py`` share: a W=1 process group, the tiny seeded
decoder sharded with ``fully_shard`` (per layer, then the root), its loss and tokens, the
comparison helpers, and :class:`Ctx`, what a part runs with (device, backend, mode, the row
writer)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def w1_group(backend: str, dev: torch.device):
    """A W=1 process group (``backend`` may be the composite ``"cpu:gloo,cuda:nccl"``)."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    kw = {"device_id": dev} if "nccl" in backend else {}
    dist.init_process_group(backend, rank=0, world_size=1, **kw)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pg_sequence(group: Any) -> int | None:
    """Collectives ``group`` issued so far (its sequence number), None where the backend has none."""
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:  # a backend without sequence numbers: reported as unknown
        return None


def delta(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


def tiny_decoder(seed: int = 0, **over: Any):
    import dataclasses

    from matrixfsdp.models.decoder import PRESETS, Decoder

    torch.manual_seed(seed)
    cfg = dataclasses.replace(PRESETS["tiny"], **over)
    return cfg, Decoder(cfg)


def shard_decoder(model, mesh, plan=None, **kw):
    import matrixfsdp
    from matrixfsdp.models.decoder import DecoderLayer

    if plan is None:
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(DecoderLayer,))
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan, **kw)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan, **kw)
    return model


def lm_loss(model, tokens):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             tokens.roll(-1, 1).reshape(-1))


def tokens_for(cfg, step: int, dev: torch.device, shape=(4, 32)) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(step)).to(dev)


def local_tensor(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def bf16_mp():
    from matrixfsdp import MixedPrecisionPolicy

    # bf16 compute also on the CPU: the owner then computes on a cast copy, so each block's
    # gather runs (without a cast the W=1 owner computes on its own storage and gathers nothing)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def device_sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@dataclass
class Ctx:
    """What a part runs with: device, backend, mode, and the row writer."""

    dev: torch.device
    backend: str
    quick: bool
    out: Path  # the results folder: rows.jsonl (the driver keeps the parts' json and logs elsewhere)
    part: str
    #: ``race_sanitizer``: the race part again, under torch's CUDA sanitizer (3 steps, no profiler)
    sanitizer: bool = False

    @property
    def cuda(self) -> bool:
        return self.dev.type == "cuda"

    def steps(self, full: int, quick: int, dry: int) -> int:
        env = os.environ.get("MATRIXFSDP_CHECK_STEPS")
        if env:
            return int(env)
        if self.sanitizer:  # every op is tracked on the host: a few steps show the accesses
            return 3
        return full if self.cuda and not self.quick else quick if self.cuda else dry

    def row(self, **row: Any) -> dict:
        """Append one row to ``rows.jsonl`` now (a part killed later keeps it)."""
        row = {"part": self.part, "at": datetime.datetime.now().isoformat(timespec="seconds"), **row}
        with open(self.out / "rows.jsonl", "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
        return row
