"""A Llama/Qwen3-style decoder, the built-in model of the CLI, the benchmarks and the examples.

Real forward (RMSNorm, rotary attention with grouped-query heads and optional q/k RMSNorm, SwiGLU
MLP), parameter names as Hugging Face's Qwen3 (``model.layers.N.self_attn.q_proj.weight`` ...),
so checkpoints export with familiar names. Build it on the ``meta`` device to plan a large preset
without memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["DecoderConfig", "Decoder", "DecoderLayer", "PRESETS", "config_from_hf"]


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Shapes of a Llama/Qwen-style decoder (Hugging Face field names where they exist)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qk_norm: bool = True
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DecoderConfig: {name} must be an int >= 1, got {name}={v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "DecoderConfig: num_attention_heads must be a multiple of num_key_value_heads, got "
                f"{self.num_attention_heads=} {self.num_key_value_heads=}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig: head_dim must be even (rotary), got {self.head_dim=}")

    @property
    def num_params(self) -> int:
        d, i, h, kv, hd = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                           self.num_key_value_heads, self.head_dim)
        attn = d * h * hd * 2 + d * kv * hd * 2
        if self.attention_bias:
            attn += h * hd + 2 * kv * hd
        layer = attn + 3 * d * i + 2 * d + (2 * hd if self.qk_norm else 0)
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + d


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tied: bool) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=8, head_dim=128, tie_word_embeddings=tied,
    )


#: Qwen3 shapes from the published Hugging Face configs (Qwen/Qwen3-*/config.json).
PRESETS: dict[str, DecoderConfig] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, False),
    # small shapes for CPU examples and tests
    "tiny": DecoderConfig(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=24),
}


def config_from_hf(path: str | Path) -> DecoderConfig:
    """Read a Llama/Qwen-style Hugging Face ``config.json``."""
    try:
        cfg: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"config_from_hf: cannot read {str(path)!r}: {e}") from None
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ValueError(f"config_from_hf: {str(path)!r} lacks {missing}")
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = cfg.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            raise ValueError(
                f"config_from_hf: only dense decoders are supported (the planner's built-in Decoder "
                f"has no mixture-of-experts layers), got {key}={n} in {str(path)!r}; plan the "
                "transformers model itself with plan_owners(model, W, block_types=(DecoderLayer,))"
            )
    heads = cfg["num_attention_heads"]
    model_type = str(cfg.get("model_type", ""))
    return DecoderConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=model_type.startswith("qwen3"),
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    # x: [B, H, T, D]
    T, D = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    ang = torch.outer(torch.arange(T, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_attention_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        d, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One transformer block: the unit to wrap with ``fully_shard`` and to plan as a scope."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: Any, layer: Callable[[Any, int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """A causal LM: ``Decoder(cfg)(tokens [B, T]) -> logits [B, T, vocab]``.

    Example::

        cfg = PRESETS["tiny"]
        model = Decoder(cfg)
        logits = model(torch.randint(0, cfg.vocab_size, (2, 16)))
    """

    #: projections writing into the residual stream (their init is scaled by ``1/sqrt(2 L)``)
    _RESIDUAL: tuple[str, ...] = ("self_attn.o_proj.weight", "mlp.down_proj.weight")

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg, self._layer)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Deterministic init (normal(0, 0.02) weights, ones for norms, zeros for biases).

        Works on sharded models too (after meta-device init and ``to_empty``): every rank draws
        the same full tensors and keeps its own segment, so a sharded model gets exactly the
        values of an unsharded one with the same ``seed``, at any world size.
        """
        from ..placement.owned_tensor import set_full_

        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        scale = 1.0 / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                full = torch.ones(p.shape, dtype=p.dtype)
            elif p.ndim >= 2:  # matrices and expert stacks
                full = (torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype)
                if name.startswith("model.layers.") and name.endswith(self._RESIDUAL):
                    full.mul_(scale)  # residual projections scaled down, as GPT-2/Llama inits do
            else:
                full = torch.zeros(p.shape, dtype=p.dtype)
            set_full_(p, full)

    @staticmethod
    def _layer(cfg: Any, index: int) -> nn.Module:
        return DecoderLayer(cfg)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            h = layer(h)
        return self.lm_head(self.model.norm(h))
