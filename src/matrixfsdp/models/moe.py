"""A mixture-of-experts decoder: the planner's MoE presets (real shapes on ``meta``) and a tiny,
trainable CPU model.

Two layouts of the expert weights, both 3-D stacks in a module named ``experts`` (what
[Note: one routing rule] in ``planner/rules.py`` recognizes):

* :class:`FusedGateUpExperts`: Hugging Face's Qwen3-MoE layout, ``gate_up_proj [E, 2F, D]`` (gate
  and up fused along the rows: two matrices per expert) and ``down_proj [E, D, F]``;
* :class:`GroupedExperts`: torchtitan's layout, ``w1 [E, F, D]``, ``w2 [E, D, F]``, ``w3 [E, F, D]``.

Routing is softmax top-k (``num_experts_per_tok``) over a router ``gate`` (:class:`TopKRouter`,
``weight [E, D]``), optionally renormalized, plus optional shared experts (a dense MLP of
``num_shared_experts * moe_intermediate_size``). The first ``first_k_dense`` layers have a dense
MLP instead (DeepSeek-V3's ``first_k_dense_replace``). Attention is grouped-query (Qwen3) or
multi-head latent attention (DeepSeek-V3's projections, :class:`LatentAttention`).

What is simplified against the released models (none of it changes a parameter's shape, so plans
are the real ones): DeepSeek-V3 routes with sigmoid scores, a bias correction and node-limited
groups, here softmax top-k; no auxiliary load-balancing loss; MLA without the KV cache.

The forward runs each expert on its tokens with plain matmuls in expert order and adds them with
``index_add``: deterministic on the CPU, no capacity limit, no token dropped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .decoder import MLP, Attention, Decoder, DecoderConfig, RMSNorm, _rope

__all__ = ["MoEConfig", "MoEDecoder", "MoEDecoderLayer", "MOE_PRESETS", "TopKRouter", "GroupedExperts",
           "FusedGateUpExperts", "SparseMoE", "LatentAttention"]

ATTENTIONS = ("gqa", "mla")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shapes of a mixture-of-experts decoder (Hugging Face field names where they exist).

    ``attention="gqa"`` uses ``num_key_value_heads`` and ``head_dim``; ``attention="mla"`` uses
    ``q_lora_rank`` (0: a plain ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim`` and ``v_head_dim``. ``fused`` selects the expert layout (see the module
    docstring); ``intermediate_size`` is the dense MLP of the ``first_k_dense`` layers.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    attention: str = "gqa"
    num_key_value_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = True
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_shared_experts: int = 0
    first_k_dense: int = 0
    intermediate_size: int = 0
    fused: bool = True
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    def __post_init__(self) -> None:
        def check(name: str, lo: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"MoEConfig: {name} must be an int >= {lo}, got {name}={v!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts",
                     "num_experts_per_tok", "moe_intermediate_size"):
            check(name, 1)
        for name in ("num_shared_experts", "first_k_dense", "intermediate_size", "q_lora_rank"):
            check(name, 0)
        if self.attention not in ATTENTIONS:
            raise ValueError(f"MoEConfig: attention must be one of {ATTENTIONS}, got attention={self.attention!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"MoEConfig: num_experts_per_tok must be <= num_experts ({self.num_experts}), got "
                             f"num_experts_per_tok={self.num_experts_per_tok}")
        if self.first_k_dense > self.num_hidden_layers:
            raise ValueError(f"MoEConfig: first_k_dense must be <= num_hidden_layers ({self.num_hidden_layers}), "
                             f"got first_k_dense={self.first_k_dense}")
        if self.first_k_dense and self.intermediate_size < 1:
            raise ValueError("MoEConfig: dense layers (first_k_dense > 0) need intermediate_size >= 1, got "
                             f"intermediate_size={self.intermediate_size}")
        if self.attention == "gqa":
            check("num_key_value_heads", 1)
            check("head_dim", 2)
            self.dense_config()  # head divisibility and even head_dim, checked once, by the dense decoder
        else:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
                check(name, 1)
            check("qk_rope_head_dim", 2)
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"MoEConfig: qk_rope_head_dim must be even (rotary), got {self.qk_rope_head_dim}")

    def dense_config(self) -> DecoderConfig:
        """The dense decoder's config for the parts the two share (GQA attention, dense MLPs)."""
        return DecoderConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size or self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads or self.num_attention_heads,
            head_dim=self.head_dim or 2, qk_norm=self.qk_norm, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, tie_word_embeddings=self.tie_word_embeddings,
        )

    @property
    def num_params(self) -> int:
        """Total parameters (every expert counted; tied embeddings once)."""
        d, h = self.hidden_size, self.num_attention_heads
        if self.attention == "gqa":
            kv, hd = self.num_key_value_heads, self.head_dim
            attn = 2 * d * h * hd + 2 * d * kv * hd + (2 * hd if self.qk_norm else 0)
        else:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk) if self.q_lora_rank else d * h * qk
            kv = (d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim))
            attn = q + kv + h * self.v_head_dim * d
        f, e = self.moe_intermediate_size, self.num_experts
        moe = e * d + e * 3 * d * f + self.num_shared_experts * 3 * d * f
        dense = 3 * d * self.intermediate_size
        layers = self.num_hidden_layers * (attn + 2 * d) + self.first_k_dense * dense
        layers += (self.num_hidden_layers - self.first_k_dense) * moe
        return layers + self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d

    @property
    def num_active_params(self) -> int:
        """Parameters a token uses: every dense weight and ``num_experts_per_tok`` experts per layer."""
        idle = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_params - (self.num_hidden_layers - self.first_k_dense) * idle


#: Real shapes of released models (their Hugging Face config.json), and tiny CPU models.
MOE_PRESETS: dict[str, MoEConfig] = {
    # Qwen/Qwen3-30B-A3B: every layer sparse, HF's fused gate_up_proj layout
    "qwen3-30b-a3b": MoEConfig(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, fused=True, rope_theta=1_000_000.0,
    ),
    # deepseek-ai/DeepSeek-V3: MLA, 3 dense layers then 256 routed + 1 shared expert,
    # torchtitan's w1/w2/w3 layout
    "deepseek-v3": MoEConfig(
        vocab_size=129280, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
        attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, qk_norm=False, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
        num_shared_experts=1, first_k_dense=3, intermediate_size=18432, fused=False, rope_theta=10000.0,
    ),
    # small shapes for CPU training and tests: Qwen3-MoE style (fused, GQA) ...
    "tiny-moe": MoEConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, fused=True,
    ),
    # ... and DeepSeek-V3 style (MLA, a dense first layer, a shared expert, w1/w2/w3)
    "tiny-moe-mla": MoEConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, attention="mla",
        q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, qk_norm=False,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1, first_k_dense=1,
        intermediate_size=96, fused=False, rope_theta=10000.0,
    ),
}


class TopKRouter(nn.Module):
    """The router: ``weight [E, D]`` scores each token; softmax, top-k, optionally renormalized."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, D]`` -> ``(weights [N, k], experts [N, k])``."""
        # scores in float32 so the routing of a bf16 model does not flip on rounding ties
        probs = F.linear(x, self.weight).float().softmax(-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), idx


class _Experts(nn.Module):
    """Shared forward of the two layouts: each expert on its tokens, in expert order."""

    num_experts: int

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, self.expert(e, x[rows]) * weights[rows, slot, None])
        return out


class GroupedExperts(_Experts):
    """torchtitan's layout: ``w1 [E, F, D]`` (gate), ``w2 [E, D, F]`` (down), ``w3 [E, F, D]`` (up)."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])


class FusedGateUpExperts(_Experts):
    """Hugging Face's Qwen3-MoE layout: ``gate_up_proj [E, 2F, D]`` (gate rows, then up rows) and
    ``down_proj [E, D, F]``."""

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])


class SparseMoE(nn.Module):
    """Router ``gate``, routed ``experts`` and optional ``shared_experts`` (a dense MLP)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(cfg)
        layout = FusedGateUpExperts if cfg.fused else GroupedExperts
        self.experts = layout(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.num_shared_experts:
            shared = dataclasses.replace(cfg.dense_config(),
                                         intermediate_size=cfg.num_shared_experts * cfg.moe_intermediate_size)
            self.shared_experts = MLP(shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        weights, idx = self.gate(flat)
        out = self.experts(flat, idx, weights)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat)
        return out.reshape(b, t, d)


class LatentAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention (Hugging Face names): queries through a low-rank
    ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or one ``q_proj`` when ``q_lora_rank == 0``),
    keys and values through the compressed ``kv_a_proj_with_mqa`` (``kv_lora_rank`` latent plus
    one shared ``qk_rope_head_dim`` rotary key), ``kv_a_layernorm`` and ``kv_b_proj``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.num_attention_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        else:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        h, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank else self.q_proj(x)
        q = q.view(B, T, h, nope + rope).transpose(1, 2)
        q_nope, q_pe = q.split((nope, rope), dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split((cfg.kv_lora_rank, rope), dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, h, nope + cfg.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split((nope, cfg.v_head_dim), dim=-1)
        k_pe = _rope(k_pe.unsqueeze(1), cfg.rope_theta).expand(B, h, T, rope)  # one rotary key for every head
        q = torch.cat((q_nope, _rope(q_pe, cfg.rope_theta)), dim=-1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, h * cfg.v_head_dim))


class MoEDecoderLayer(nn.Module):
    """One transformer block (dense MLP for the first ``first_k_dense`` layers, else
    :class:`SparseMoE`): the unit to wrap with ``fully_shard`` and to plan as a scope."""

    def __init__(self, cfg: MoEConfig, layer: int) -> None:
        super().__init__()
        dense = cfg.dense_config()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(dense) if cfg.attention == "gqa" else LatentAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(dense) if layer < cfg.first_k_dense else SparseMoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class MoEDecoder(Decoder):
    """A causal mixture-of-experts LM: ``MoEDecoder(cfg)(tokens [B, T]) -> logits [B, T, vocab]``.

    Parameter names as Hugging Face's (``model.layers.N.mlp.experts.gate_up_proj`` ...). Build it
    on the ``meta`` device to plan a large preset without memory.

    Example::

        model = MoEDecoder(MOE_PRESETS["tiny-moe"])
        logits = model(torch.randint(0, 512, (2, 16)))
        with torch.device("meta"):
            big = MoEDecoder(MOE_PRESETS["qwen3-30b-a3b"])
        plan = plan_owners(big, 64, block_types=(MoEDecoderLayer,))
    """

    _RESIDUAL = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "mlp.experts.down_proj", "mlp.experts.w2",
                 "mlp.shared_experts.down_proj.weight")

    def __init__(self, cfg: MoEConfig) -> None:  # type: ignore[override]
        super().__init__(cfg)  # type: ignore[arg-type]

    @staticmethod
    def _layer(cfg: Any, index: int) -> nn.Module:
        return MoEDecoderLayer(cfg, index)
