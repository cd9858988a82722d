"""The redundant TP step (``tp_redundant``): Megatron's ``duplicated`` mode at dp=1
(:class:`GatherMuon` over the TP group), :class:`FullGatherMuon` under FSDP2 + TP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from matrixfsdp.optim import Muon
from matrixfsdp.optim._muon import adjusted_lr, zeropower_via_newtonschulz

from .core import muon_param_groups
from .gather_muon import GatherMuon, all_gather_single
from .tp import TPImpl, local_tensor


def _chunk_sizes(n: int, k: int) -> list[int]:
    """Sizes of ``torch.chunk(range(n), k)`` padded with empty chunks to ``k`` (how DTensor's
    ``Shard`` and FSDP2 split a dimension)."""
    c = -(-n // k)
    return [max(0, min(c, n - i * c)) for i in range(k)]


class FullGatherMuon(Muon):
    """The redundant (Megatron ``duplicated`` / DistMuon-without-owners) step under FSDP2 + TP:
    momentum on the local ``(dp, tp)`` shard; per matrix one async ``all_gather_single`` of the
    momentum-updated shard over the whole ``("dp_shard", "tp")`` mesh (what ``full_tensor()`` of
    the update moves), Newton-Schulz on the whole matrix on every rank, keep this rank's shard.
    Stock FSDP2 lays the TP shard ``t`` of a matrix out as ``torch.chunk`` over dp of its rows, on
    rank ``mesh[d, t]``: the gathered pieces are pasted back in that order. AdamW-routed
    parameters update their shard locally."""

    def __init__(self, params: Any, *, mesh2: Any, **kw: Any):
        self._mesh2 = mesh2
        self._ranks = mesh2.mesh.tolist()  # [d][t] -> global rank
        self._flat = [r for row in self._ranks for r in row]
        if self._flat != list(range(dist.get_world_size())):
            raise ValueError("FullGatherMuon: the (dp_shard, tp) mesh must span the world in rank order")
        super().__init__(params, **kw)

    def _check_whole(self, p: torch.Tensor, local: torch.Tensor, index: int) -> None:
        pass  # shards are expected here

    def _layout(self, p: Any) -> tuple[int, list[int], list[list[int]]]:
        """(TP-split dim, TP-shard sizes along it, per TP rank the dp chunk sizes of its rows)."""
        from torch.distributed.tensor import Shard

        pl = p.placements[1]
        if not isinstance(pl, Shard):
            raise ValueError(f"FullGatherMuon: expected Shard over tp, got {p.placements}")
        dtp = pl.dim % 2
        dp, tp = self._mesh2.shape
        tsz = _chunk_sizes(p.shape[dtp], tp)
        rows = [_chunk_sizes(tsz[t] if dtp == 0 else p.shape[0], dp) for t in range(tp)]
        return dtp, tsz, rows

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        dp, tp = self._mesh2.shape
        me = dist.get_rank()
        d_me, t_me = divmod(me, tp)
        pending = []
        for _, group, p, route in self._routed():
            if p.grad is None:
                continue
            param = local_tensor(p)
            grad = local_tensor(p.grad)
            if route == "adamw":
                if param.numel():
                    self.rule_for(p).step(param, grad, self.state[p])
                continue
            if not (isinstance(p, DTensor) and p.device_mesh.ndim == 2):
                raise ValueError("FullGatherMuon: Muon matrices must be 2-D (dp_shard, tp) DTensors")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf, m = state["momentum_buffer"], group["momentum"]
            buf.lerp_(grad, 1 - m)
            upd = grad.lerp(buf, m) if group["nesterov"] else buf
            dtp, tsz, rows = self._layout(p)
            R = max(max(r) for r in rows)
            C = max(tsz) if dtp == 1 else p.shape[1]
            send = torch.zeros(R, C, dtype=upd.dtype, device=upd.device)
            send[: upd.shape[0], : upd.shape[1]].copy_(upd)
            out = torch.empty(dp * tp * R, C, dtype=upd.dtype, device=upd.device)
            work = all_gather_single(out, send, async_op=True)
            pending.append((p, param, group, out, work, dtp, tsz, rows, R))
        for p, param, group, out, work, dtp, tsz, rows, R in pending:
            work.wait()
            pieces = out.view(dp * tp, R, -1)
            cols = (lambda t: tsz[t]) if dtp == 1 else (lambda t: p.shape[1])
            shards = [torch.cat([pieces[self._ranks[d][t]][: rows[t][d], : cols(t)] for d in range(dp)], dim=0)
                      for t in range(tp)]
            full = torch.cat(shards, dim=dtp)
            ortho = zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"],
                                               group["eps"], group["ns_dtype"])
            mine = ortho.narrow(dtp, sum(tsz[:t_me]), tsz[t_me])
            mine = mine.narrow(0, sum(rows[t_me][:d_me]), rows[t_me][d_me])
            lr = group["lr"]
            param.mul_(1 - lr * group["weight_decay"])
            if param.numel():
                param.add_(mine, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return None


class TPRedundant(TPImpl):
    name = "tp_redundant"

    def make_opt(self, mesh: Any) -> torch.optim.Optimizer:
        if self.composed:
            self.notes.append(f"redundant baseline under FSDP2 + TP (Megatron 'duplicated' / DistMuon without owners): "
                              f"per TP-sharded matrix one async all_gather_single of the momentum-updated (dp, tp) "
                              f"shard over the whole ({'x'.join(map(str, self.ctx.mesh.shape))}) mesh (= full_tensor "
                              f"of the update), {self.cfg.ns_short} Newton-Schulz on the whole matrix on every rank, "
                              "keep own shard (FullGatherMuon)")
            return FullGatherMuon(muon_param_groups(self.model.named_parameters()), mesh2=self.ctx.mesh,
                                  **self.cfg.muon_kwargs())
        self.notes.append(f"Megatron TensorParallelMuon 'duplicated': per TP-sharded matrix one async all_gather_single "
                          f"of the momentum-updated shard over the TP group, {self.cfg.ns_short} Newton-Schulz on the "
                          "whole matrix on every TP rank, keep own shard (GatherMuon)")
        return GatherMuon(muon_param_groups(self.model.named_parameters()), group=mesh.get_group(),
                          **self.cfg.muon_kwargs())
