"""A tiny mixture-of-experts decoder for the expert tests, written as torchtitan and Hugging Face
write theirs: expert weights are 3-D stacks in a module named ``experts`` (torchtitan's
``w1/w2/w3 [E, F, D] / [E, D, F]``, or Hugging Face's fused ``gate_up_proj [E, 2F, D]`` and
``down_proj [E, D, F]``), a router ``gate`` (``[E, D]``), optional shared experts (a dense MLP).

Tokens are routed top-k; each expert runs on its tokens with plain matmuls, deterministic on the
CPU. ``per_expert_reference`` builds the reference a user would write with 2-D parameters: every
expert matrix its own ``nn.Parameter`` (the unfused gate and up for a fused stack).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MoEConfig:
    vocab: int = 64
    dim: int = 32
    ffn: int = 24  # expert (and shared expert) hidden size
    layers: int = 2
    heads: int = 4
    experts: int = 5
    top_k: int = 2
    shared: bool = True
    fused: bool = False  # Hugging Face's gate_up_proj [E, 2F, D] instead of w1/w3


def Experts(cfg: MoEConfig) -> nn.Module:
    """The expert stacks of ``cfg``'s layout (the shipped model's classes), initialized as a test
    model: normal, scaled by the fan-in."""
    from matrixfsdp.models.moe import FusedGateUpExperts, GroupedExperts

    cls = FusedGateUpExperts if cfg.fused else GroupedExperts
    experts = cls(cfg.experts, cfg.dim, cfg.ffn)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    return experts


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.dim, cfg.experts, bias=False)  # the router
        self.experts = Experts(cfg)
        self.shared = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn, bias=False), nn.SiLU(),
                                    nn.Linear(cfg.ffn, cfg.dim, bias=False)) if cfg.shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        probs = self.gate(flat).softmax(-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        out = self.experts(flat, idx, weights / weights.sum(-1, keepdim=True))
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(b, t, d)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.o = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.mlp = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class MoEModel(nn.Module):
    def __init__(self, cfg: MoEConfig, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(tokens).flatten(0, 1).float(), targets.flatten())


def moe_batch(cfg: MoEConfig, step: int, batch: int, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def expert_matrices(name: str, stack: torch.Tensor, splits: int) -> dict[str, torch.Tensor]:
    """``{f"{name}[e].{k}": matrix}``: the stack's matrices, in expert order, rows split ``splits`` ways."""
    E, rows, _ = stack.shape
    r = rows // splits
    return {f"{name}[{e}].{k}": stack[e, k * r:(k + 1) * r] for e in range(E) for k in range(splits)}


def shard(model: MoEModel, mesh, **plan_kw):
    """Plan ``model`` on ``mesh`` (its blocks as blocks) and shard it with matrixfsdp.fully_shard,
    blocks first, then the root; returns the plan."""
    from matrixfsdp import fully_shard, plan_owners

    plan = plan_owners(model, mesh, block_types=type(model.blocks[0]), **plan_kw)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, plan=plan)
    fully_shard(model, mesh=mesh, plan=plan)
    return plan
