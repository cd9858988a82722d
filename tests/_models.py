"""Tiny models, hand-built plans and a local matrix optimizer for the runtime tests.

``TinyDecoder`` has what the runtime must handle: rectangular matrices (96x160 / 160x96), biases,
LayerNorm and RMSNorm weights, a 0-dim parameter, an untied head, an embedding, a gated projection
that is used only on some steps (and, optionally, only on some ranks), and frozen parameters (one
per block and one in the root scope). fp32, deterministic from a seed.

``make_plan`` builds an :class:`OwnerPlan` by hand (greedy byte balance), independent of the real
planner. ``LocalMatrixOpt`` is a minimal local optimizer: Muon-style Newton-Schulz (fp32) on
parameters the plan marks ``"matrix"`` (whole on their owner), AdamW on the rest; it only ever
touches local tensors and never communicates. The same class drives the single-process reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from matrixfsdp.planner.owner_plan import OwnerPlan, ParamPlan

__all__ = [
    "TinyConfig",
    "TinyDecoder",
    "Block",
    "make_plan",
    "LocalMatrixOpt",
    "make_batch",
    "local_of",
]


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 64
    dim: int = 96
    hidden: int = 160
    n_blocks: int = 3
    seq: int = 8
    heads: int = 4
    gated_block: int = 1  # the block with the sometimes-used projection
    scalar_param: bool = True  # 0-dim ``res_scale`` (torch's FSDP2 rejects 0-dim params)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig, gated: bool):
        super().__init__()
        d, h = cfg.dim, cfg.hidden
        self.heads = cfg.heads
        self.attn_norm = nn.LayerNorm(d)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)  # 288 x 96
        self.wo = nn.Linear(d, d, bias=True)
        self.mlp_norm = RMSNorm(d)
        self.up = nn.Linear(d, h, bias=True)  # 160 x 96
        self.down = nn.Linear(h, d, bias=True)  # 96 x 160
        self.res_scale = nn.Parameter(torch.tensor(1.0) if cfg.scalar_param else torch.ones(1))
        self.frozen_shift = nn.Parameter(torch.randn(d) * 0.01, requires_grad=False)
        self.extra = nn.Linear(d, d, bias=False) if gated else None

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, D))
        x = x + self.res_scale * self.down(F.gelu(self.up(self.mlp_norm(x)))) + self.frozen_shift
        if self.extra is not None and use_extra:
            x = x + 0.5 * torch.tanh(self.extra(x))
        return x


class TinyDecoder(nn.Module):
    def __init__(self, cfg: TinyConfig = TinyConfig(), seed: int = 0):
        super().__init__()
        g = torch.random.fork_rng()
        with g:
            torch.manual_seed(seed)
            self.cfg = cfg
            self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
            self.pos_emb = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02, requires_grad=False)
            self.blocks = nn.ModuleList(
                Block(cfg, gated=(i == cfg.gated_block)) for i in range(cfg.n_blocks)
            )
            self.norm = nn.LayerNorm(cfg.dim)
            self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)  # untied
        #: wrap each block call in non-reentrant activation checkpointing
        self.checkpoint_blocks = False

    def forward(self, idx: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for i, blk in enumerate(self.blocks):
            kw = {"use_extra": use_extra} if i == self.cfg.gated_block else {}
            if self.checkpoint_blocks:
                x = checkpoint(blk, x, use_reentrant=False, **kw)
            else:
                x = blk(x, **kw)
        return self.head(self.norm(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        logits = self(idx, use_extra=use_extra)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_batch(cfg: TinyConfig, step: int, batch: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + step)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


# ==================================================================================== plans
def _block_of(fqn: str, blocks: Sequence[str]) -> str:
    best = ""
    for b in blocks:
        if fqn.startswith(b + ".") and len(b) > len(best):
            best = b
    return best


def make_plan(
    model: nn.Module,
    world_size: int,
    *,
    blocks: Sequence[str] | None = None,
    root_matrices: str = "even",
    even: Iterable[str] = (),
    owner_offset: int = 0,
    dtype: str = "float32",
) -> OwnerPlan:
    """A hand-built plan: 2D params in blocks -> "matrix" (greedy by bytes), other params in
    blocks -> one "tail" role per block; root-scope 2D params -> ``root_matrices`` ("even" or
    "matrix"); other root params -> "tail"; fqns in ``even`` forced to "even"."""
    if blocks is None:
        blocks = [f"blocks.{i}" for i in range(len(model.blocks))]  # type: ignore[attr-defined]
    even = set(even)
    load = [0] * world_size
    owners: dict[str, int] = {}

    def pick(nbytes: int) -> int:
        r = min(range(world_size), key=lambda i: (load[i], (i - owner_offset) % world_size))
        load[r] += nbytes
        return r

    named = list(model.named_parameters())
    # Matrices first, largest first, then one tail role per scope.
    roles: list[tuple[str, list[tuple[str, torch.Tensor]]]] = []
    tails: dict[str, list[tuple[str, torch.Tensor]]] = {}
    placement: dict[str, str] = {}
    for fqn, p in named:
        blk = _block_of(fqn, blocks)
        if fqn in even:
            placement[fqn] = "even"
        elif p.ndim == 2 and (blk or root_matrices == "matrix"):
            placement[fqn] = "matrix"
            roles.append((fqn, [(fqn, p)]))
        elif p.ndim == 2 and root_matrices == "even":
            placement[fqn] = "even"
        else:
            placement[fqn] = "tail"
            tails.setdefault(blk, []).append((fqn, p))
    roles.sort(key=lambda r: -sum(p.numel() for _, p in r[1]))
    for key, ps in roles + [(k, v) for k, v in tails.items()]:
        r = pick(sum(p.numel() * p.element_size() for _, p in ps))
        for fqn, _ in ps:
            owners[fqn] = r
    params = []
    for fqn, p in named:
        pl = placement[fqn]
        params.append(ParamPlan(
            fqn=fqn, placement=pl, owner=None if pl == "even" else owners[fqn],
            block=_block_of(fqn, blocks), shape=tuple(p.shape), dtype=dtype,
            nbytes=p.numel() * p.element_size(), state_nbytes=p.numel() * p.element_size(),
            cost=float(p.numel()),
        ))
    return OwnerPlan(world_size=world_size, policy="test-greedy", cost_model="bytes",
                     optimizer="muon", blocks=tuple(blocks), params=tuple(params))


# ==================================================================================== optimizer
def local_of(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


class LocalMatrixOpt(torch.optim.Optimizer):
    """Muon-style update on whole local matrices, AdamW elsewhere; purely local.

    Param groups carry ``kind`` ("muon" or "adamw"). Empty local tensors are skipped.

    ``elementwise`` picks the rule for non-matrix params: ``"adamw"`` or ``"sgd"`` (momentum SGD).
    The parity tests default to ``"sgd"``: Adam's first step is ``lr * g / (|g| + eps)``, so for a
    gradient element that nearly cancels (|g| ~ 1e-8, e.g. an embedding row summed over slices)
    one ulp of reduction-order difference becomes an O(lr) change of the update (measured at W=3:
    1.46e-6 on ``tok_emb.weight`` after the first step while the gradients agreed to 2.6e-8).
    A linear rule keeps the tolerance about the runtime; an AdamW run is reported separately.
    """

    def __init__(self, groups: list[dict], lr: float = 0.02, adam_lr: float = 3e-3,
                 momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.01, elementwise: str = "adamw",
                 sgd_lr: float = 0.05):
        if elementwise not in ("adamw", "sgd"):
            raise ValueError(f"LocalMatrixOpt: elementwise must be 'adamw' or 'sgd', got {elementwise!r}")
        defaults = dict(lr=lr, adam_lr=adam_lr, momentum=momentum, betas=betas, eps=eps,
                        weight_decay=weight_decay, kind="adamw", sgd_lr=sgd_lr)
        self.elementwise = elementwise
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                x, g = local_of(p), local_of(p.grad)
                if x.numel() == 0:
                    continue
                st = self.state[p]
                if group["kind"] == "muon":
                    buf = st.get("momentum")
                    if buf is None:
                        buf = st["momentum"] = torch.zeros_like(x)
                    buf.mul_(group["momentum"]).add_(g)
                    upd = _newton_schulz(buf) * math.sqrt(max(1.0, x.shape[0] / x.shape[1]))
                    x.mul_(1 - group["lr"] * group["weight_decay"]).add_(upd, alpha=-group["lr"])
                elif self.elementwise == "sgd":
                    buf = st.get("momentum")
                    if buf is None:
                        buf = st["momentum"] = torch.zeros_like(x)
                    buf.mul_(group["momentum"]).add_(g)
                    x.mul_(1 - group["sgd_lr"] * group["weight_decay"]).add_(buf, alpha=-group["sgd_lr"])
                else:
                    if not st:
                        st["step"] = 0
                        st["m"] = torch.zeros_like(x)
                        st["v"] = torch.zeros_like(x)
                    st["step"] += 1
                    b1, b2 = group["betas"]
                    st["m"].mul_(b1).add_(g, alpha=1 - b1)
                    st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                    mh = st["m"] / (1 - b1 ** st["step"])
                    vh = st["v"] / (1 - b2 ** st["step"])
                    x.mul_(1 - group["adam_lr"] * group["weight_decay"])
                    x.addcdiv_(mh, vh.sqrt().add_(group["eps"]), value=-group["adam_lr"])
        return None


def opt_groups(model: nn.Module, plan: OwnerPlan) -> list[dict]:
    """Param groups for :class:`LocalMatrixOpt`: plan "matrix" params -> muon, others -> adamw."""
    muon, adamw = [], []
    for fqn, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (muon if plan[fqn].placement == "matrix" else adamw).append(p)
    return [dict(params=muon, kind="muon"), dict(params=adamw, kind="adamw")]
