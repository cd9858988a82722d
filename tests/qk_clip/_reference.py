"""The one-process reference of QK-clip (Kimi K2, Algorithm 1), written plainly, and tiny models.

The reference never uses ``matrixfsdp.qk_clip``: it recomputes each attention module's queries
and keys from the module's input with the model's own math, takes each head's max logit with an
explicit causal mask, and scales the projections' rows head by head in Python loops.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from matrixfsdp.models.decoder import Attention, Decoder, DecoderConfig, _rope

VOCAB, SEQ = 64, 8


def decoder(kv_heads: int = 2, seed: int = 0, layers: int = 2, heads: int = 4, head_dim: int = 8) -> Decoder:
    """A tiny fp32 decoder without QK-norm (QK-clip bounds its logits), 4 heads of 8 by default."""
    cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, qk_norm=False)
    torch.manual_seed(seed)
    model = Decoder(cfg)
    model.reset_parameters(seed=seed)
    return model


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def causal_max(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, H, T, D] x [B, H, T, D] -> per head, the max of q.k*scale over causal pairs."""
    T = q.shape[-2]
    s = torch.einsum("bhtd,bhsd->bhts", q.double(), k.double()) * scale
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    return s.masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3))


def decoder_logits(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """The max logit of each query head of matrixfsdp's decoder attention on input ``x``."""
    cfg = attn.cfg
    B, T, _ = x.shape
    q = attn.q_proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
    q, k = _rope(q, cfg.rope_theta), _rope(k, cfg.rope_theta)
    k = k.repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, dim=1)
    return causal_max(q, k, 1.0 / math.sqrt(cfg.head_dim))


class Recorder:
    """Forward pre-hooks on the reference's attention modules: each forward's logits folded into
    a per-module max (``logits_fn(module, input) -> [heads]``), in training mode."""

    def __init__(self, model: nn.Module, kind: type, logits_fn) -> None:
        self.maxes: dict[str, torch.Tensor] = {}
        self.modules = {n: m for n, m in model.named_modules() if isinstance(m, kind)}
        for name, m in self.modules.items():
            m.register_forward_pre_hook(self._hook(name, logits_fn), with_kwargs=True)

    def _hook(self, name, logits_fn):
        def hook(module, args, kwargs):
            if module.training:
                with torch.no_grad():
                    got = logits_fn(module, *args, **kwargs)
                old = self.maxes.get(name)
                self.maxes[name] = got if old is None else torch.maximum(old, got)
        return hook


def gamma_of(s: float, tau: float) -> float:
    """Algorithm 1's factor with the floor: 1 unless the max exceeds tau."""
    return tau / s if (math.isfinite(s) and s > tau) else 1.0


@torch.no_grad()
def clip_mha(rec: Recorder, tau: float, alpha: float, q="q_proj", k="k_proj") -> int:
    """Scale q/k rows head by head (GQA: a group's max, all its query heads and its key head);
    returns how many key heads were clipped."""
    clipped = 0
    for name, m in rec.modules.items():
        cfg = getattr(m, "cfg", None) or m.config
        H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
        G = H // KV
        S = rec.maxes.pop(name).tolist()
        wq, wk = getattr(m, q), getattr(m, k)
        for g in range(KV):
            gamma = gamma_of(max(S[g * G:(g + 1) * G]), tau)
            clipped += gamma < 1.0
            for h in range(g * G, (g + 1) * G):
                wq.weight[h * hd:(h + 1) * hd] *= gamma ** alpha
                if wq.bias is not None:
                    wq.bias[h * hd:(h + 1) * hd] *= gamma ** alpha
            wk.weight[g * hd:(g + 1) * hd] *= gamma ** (1 - alpha)
            if wk.bias is not None:
                wk.bias[g * hd:(g + 1) * hd] *= gamma ** (1 - alpha)
    return clipped


@torch.no_grad()
def clip_mla(rec: Recorder, tau: float, alpha: float) -> int:
    """DeepSeek-V3 MLA: q_nope x gamma^alpha, q_rope x gamma, k_nope rows of kv_b_proj x gamma^(1-alpha)."""
    clipped = 0
    for name, m in rec.modules.items():
        c = m.config
        H, nope, rope, vd = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        S = rec.maxes.pop(name).tolist()
        wq = (m.q_b_proj if m.q_b_proj is not None else m.q_proj).weight
        for h in range(H):
            gamma = gamma_of(S[h], tau)
            clipped += gamma < 1.0
            q0 = h * (nope + rope)
            wq[q0:q0 + nope] *= gamma ** alpha
            wq[q0 + nope:q0 + nope + rope] *= gamma
            k0 = h * (nope + vd)
            m.kv_b_proj.weight[k0:k0 + nope] *= gamma ** (1 - alpha)
    return clipped


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for n, t in a.items():
        d = (t.double() - b[n].double()).abs().max().item() / max(b[n].abs().max().item(), 1e-12)
        worst = max(worst, math.inf if math.isnan(d) else d)
    return worst


# ============================================================================ Hugging Face models
def hf_model(kind: str, attn: str = "sdpa", seed: int = 0) -> nn.Module:
    """Tiny fp32 Hugging Face causal LMs: ``qwen3`` (GQA, QK-norm), ``qwen2`` (GQA, q/k/v biases),
    ``deepseek_v3`` (MLA with a query LoRA, dense layers only)."""
    import transformers as tf

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, attn_implementation=attn, dtype=torch.float32)
    if kind == "qwen3":
        cfg, cls = tf.Qwen3Config(num_key_value_heads=2, head_dim=8, **kw), tf.Qwen3ForCausalLM
    elif kind == "qwen2":
        cfg, cls = tf.Qwen2Config(num_key_value_heads=2, **kw), tf.Qwen2ForCausalLM
    else:
        cfg = tf.DeepseekV3Config(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                  qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=2, n_routed_experts=2,
                                  num_experts_per_tok=1, moe_intermediate_size=16, **kw)
        cls = tf.DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # larger projections than the 0.02 init, so that a few heads clip
        for i, (n, p) in enumerate(model.named_parameters()):
            if "self_attn" in n and (p.ndim == 2 or n.endswith("bias")):
                p.normal_(0.0, 0.2 if p.ndim == 2 else 0.1, generator=torch.Generator().manual_seed(i))
            if n.endswith("k_proj.bias"):
                # a key bias adds q.b to a whole row of logits, which the softmax ignores: its
                # gradient is round-off alone, which Adam's normalization would blow up into
                # run-to-run noise; frozen, it is still scaled by the clip
                p.requires_grad_(False)
    return model.train()


def attention_class(model: nn.Module) -> type:
    return type(model.model.layers[0].self_attn)


def hf_mha_logits(m, hidden_states, position_embeddings=None, attention_mask=None, **_):
    """Qwen2/Qwen3/Llama attention (no padding: causal), from the module's own projections."""
    import sys

    rotary = sys.modules[type(m).__module__].apply_rotary_pos_emb
    B, T, _ = hidden_states.shape
    q = m.q_proj(hidden_states).view(B, T, -1, m.head_dim)
    k = m.k_proj(hidden_states).view(B, T, -1, m.head_dim)
    if hasattr(m, "q_norm"):
        q, k = m.q_norm(q), m.k_norm(k)
    q, k = rotary(q.transpose(1, 2), k.transpose(1, 2), *position_embeddings)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return causal_max(q, k, m.scaling)


def hf_mla_logits(m, hidden_states, position_embeddings=None, attention_mask=None, **_):
    """DeepSeek-V3 MLA: q = [q_nope; rope(q_rot)], k = [k_nope (kv_b_proj); rope(k_rot), shared]."""
    import sys

    mod = sys.modules[type(m).__module__]
    B, T, _ = hidden_states.shape
    nope, rope = m.qk_nope_head_dim, m.qk_rope_head_dim
    q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(hidden_states))) if m.q_lora_rank else m.q_proj(hidden_states)
    q = q.view(B, T, -1, m.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = q.split([nope, rope], dim=-1)
    kv_nope, k_rot = m.kv_a_proj_with_mqa(hidden_states).split([m.kv_lora_rank, rope], dim=-1)
    kv_nope = m.kv_a_layernorm(kv_nope)
    k_rot = k_rot.view(B, 1, T, rope)
    rotary = mod.apply_rotary_pos_emb_interleave if m.config.rope_interleave else mod.apply_rotary_pos_emb
    q_rot, k_rot = rotary(q_rot, k_rot, *position_embeddings)
    kv = m.kv_b_proj(kv_nope).view(B, T, -1, nope + m.v_head_dim).transpose(1, 2)
    H = kv.shape[1]
    k = torch.cat([kv[..., :nope], k_rot.expand(B, H, T, rope)], dim=-1)
    return causal_max(torch.cat([q_pass, q_rot], dim=-1), k, m.scaling)
