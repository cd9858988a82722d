"""FSDP2 + gather Muon (``fsdp2_gather_muon``): all-gather each matrix's update, Newton-Schulz on
the whole matrix on every rank, keep the own shard. :class:`GatherMuon` is also the TP
``duplicated`` baseline at dp=1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from matrixfsdp.optim import Muon
from matrixfsdp.optim._muon import adjusted_lr, zeropower_via_newtonschulz

from .core import Impl, check_routes, build_model, muon_param_groups
from .fsdp2 import fsdp2_wrap, shard_group


def all_gather_single(*args: Any, **kwargs: Any) -> Any:
    """torch 2.13's all_gather_single (all_gather_into_tensor is its deprecated alias); looked up
    at call time so the benchmark's counting wrapper sees it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


class GatherMuon(Muon):
    """``matrixfsdp.optim.Muon`` for ``Shard(d)`` DTensors (FSDP2's ``Shard(0)``, TP's
    ``Shard(0)``/``Shard(1)``): momentum on the local shard, all-gather each matrix's (Nesterov)
    update over ``group``, Newton-Schulz on the whole matrix on every rank, keep this rank's
    shard (Megatron's ``duplicated`` TP mode). AdamW-routed parameters update their shard locally.

    Gathering the momentum-updated shard instead of the raw gradient shard moves the same bytes
    and gives the same matrix (the momentum update is element-wise), while keeping momentum sharded.
    All gathers are issued asynchronously first, then waited for in order.
    """

    def __init__(self, params: Any, *, group: Any = None, **kw: Any):
        self._pg = group
        super().__init__(params, **kw)

    def _check_whole(self, p: torch.Tensor, local: torch.Tensor, index: int) -> None:
        pass  # shards are expected here

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        W = dist.get_world_size(self._pg)
        pending = []
        for _, group, p, route in self._routed():
            if p.grad is None:
                continue
            param = p._local_tensor if isinstance(p, DTensor) else p
            grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            if route == "adamw":
                if param.numel():
                    self.rule_for(p).step(param, grad, self.state[p])
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf, m = state["momentum_buffer"], group["momentum"]
            buf.lerp_(grad, 1 - m)
            upd = grad.lerp(buf, m) if group["nesterov"] else buf
            # gathered along rows: a Shard(1) matrix travels transposed (HSDP: the Shard of (Replicate, Shard))
            d = next(pl for pl in p.placements if pl.is_shard()).dim % 2
            upd = upd if d == 0 else upd.t()
            n, cols = p.shape[d], p.shape[1 - d]
            rows = -(-n // W)
            _, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            send = torch.zeros(rows, cols, dtype=upd.dtype, device=upd.device)
            send[: upd.shape[0]].copy_(upd)
            out = torch.empty(W * rows, cols, dtype=upd.dtype, device=upd.device)
            work = all_gather_single(out, send, group=self._pg, async_op=True)
            pending.append((p, param, group, out, work, int(off[d]), d))
        for p, param, group, out, work, off, d in pending:
            work.wait()
            full = out[: p.shape[d]] if d == 0 else out[: p.shape[d]].t()
            ortho = zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"],
                                               group["eps"], group["ns_dtype"])
            lr = group["lr"]
            param.mul_(1 - lr * group["weight_decay"])
            if param.numel():
                param.add_(ortho.narrow(d, off, param.shape[d]), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return None


class FSDP2GatherMuon(Impl):
    name = "fsdp2_gather_muon"

    def setup(self) -> None:
        model = fsdp2_wrap(build_model(self.cfg, self.ctx.device), self.ctx.mesh)
        self.model = model
        self.opts = [GatherMuon(muon_param_groups(model.named_parameters()),
                                group=shard_group(self.ctx.mesh), **self.cfg.muon_kwargs())]
        self.notes.append(check_routes(self.opts[0], model.named_parameters()))
        self.notes.append("stock fully_shard per DecoderLayer + root; per matrix one async "
                          "all_gather_single of the momentum-updated shard (padded to "
                          f"ceil(n/W) rows), {self.cfg.ns_short} NS on the whole matrix on every rank, "
                          "keep own rows")
