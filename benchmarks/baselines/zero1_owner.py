"""ZeRO-1-style owners (``zero1_owner``): reduce each gradient to its owner, step there,
broadcast the update; owners by LPT (:func:`lpt_owners`, also the TP rows' dp=1 hosts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from matrixfsdp.optim import Muon

from .core import Impl, build_model, check_routes, imbalance, is_muon_param, muon_cost, muon_param_groups, \
    ns_flops, strip_prefix


def lpt_owners(named: list[tuple[str, torch.Tensor]], world: int) -> dict[str, int]:
    """Deterministic owners: Muon matrices by LPT on Newton-Schulz FLOPs, then AdamW tensors by
    LPT on bytes (ties by name). Same on every rank (no hashing)."""
    owners: dict[str, int] = {}
    load = [0.0] * world
    mats = sorted(((n, p) for n, p in named if is_muon_param(n, p)), key=lambda x: (-ns_flops(x[1].shape), x[0]))
    for n, p in mats:
        r = min(range(world), key=lambda i: (load[i], i))
        owners[n] = r
        load[r] += ns_flops(p.shape)
    bytes_load = [0] * world
    for n, p in named:
        if n in owners:
            bytes_load[owners[n]] += p.numel()
    rest = sorted(((n, p) for n, p in named if n not in owners), key=lambda x: (-x[1].numel(), x[0]))
    for n, p in rest:
        r = min(range(world), key=lambda i: (bytes_load[i], i))
        owners[n] = r
        bytes_load[r] += p.numel()
    return owners


class Zero1Owner(Impl):
    """ZeRO-1-style owners: full parameters and gradients on every rank; each gradient is
    ``dist.reduce``d to its owner as soon as it is accumulated (async, from a post-accumulate-grad
    hook, so it overlaps backward like DDP's buckets); in ``step`` the owner divides by W and runs
    Muon/AdamW on what it owns (optimizer state only there), then every parameter is broadcast
    from its owner (async, all issued then waited)."""

    name = "zero1_owner"

    def setup(self) -> None:
        model = build_model(self.cfg)
        self.model = model
        named = list(model.named_parameters())
        self.owner = lpt_owners(named, self.world)
        self._params = [(n, p, self.owner[n]) for n, p in named]
        self._pending: list[tuple[torch.Tensor, int, Any]] = []
        for n, p, o in self._params:
            p.register_post_accumulate_grad_hook(self._make_hook(o))
        mine = [(n, p) for n, p, o in self._params if o == self.rank]
        self.opts = [Muon(muon_param_groups(mine), **self.cfg.muon_kwargs())] if mine else []
        if self.opts:
            self.notes.append(check_routes(self.opts[0], mine) + " (rank's own)")
        load = [0.0] * self.world
        for n, p in named:
            load[self.owner[n]] += muon_cost(strip_prefix(n), p)
        self.balance = imbalance(load)
        self.notes.append("owners: LPT on Newton-Schulz FLOPs (matrices) then bytes (AdamW tensors); "
                          "per-parameter async dist.reduce in backward, async dist.broadcast after step")

    def _make_hook(self, owner: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            self._pending.append((p, owner, dist.reduce(p.grad, dst=owner, async_op=True)))
        return hook

    def step(self) -> None:
        for p, owner, work in self._pending:
            work.wait()
            if owner == self.rank:
                p.grad.div_(self.world)
            else:
                p.grad = None  # a non-destination reduce buffer holds no meaningful value
        self._pending = []
        for o in self.opts:
            o.step()
        works = [dist.broadcast(p.data, src=o, async_op=True) for _, p, o in self._params]
        for w in works:
            w.wait()
