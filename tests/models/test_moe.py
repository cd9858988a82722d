"""models/moe.py: the MoE presets have the released models' sizes on ``meta``, the tiny ones run a
deterministic forward and backward on the CPU, the routing rule sees stacks, fused splits and
routers, bad configs raise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from matrixfsdp.models import MOE_PRESETS, MoEConfig, MoEDecoder, MoEDecoderLayer
from matrixfsdp.planner.rules import DEFAULT_RULE, ParamKind


@pytest.mark.parametrize("name, total, active", [
    ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),   # "30.5B, 3.3B activated" (model card)
    ("deepseek-v3", 671_026_404_352, 37_552_282_624),   # "671B, 37B activated" (without the MTP module)
])
def test_real_presets_have_the_released_sizes(name, total, active):
    cfg = MOE_PRESETS[name]
    with torch.device("meta"):
        model = MoEDecoder(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params == total
    assert cfg.num_active_params == active


def test_real_preset_shapes():
    with torch.device("meta"):
        qwen = MoEDecoder(MOE_PRESETS["qwen3-30b-a3b"])
        ds = MoEDecoder(MOE_PRESETS["deepseek-v3"])
    q = dict(qwen.named_parameters())
    assert q["model.layers.0.mlp.gate.weight"].shape == (128, 2048)
    assert q["model.layers.47.mlp.experts.gate_up_proj"].shape == (128, 2 * 768, 2048)
    assert q["model.layers.47.mlp.experts.down_proj"].shape == (128, 2048, 768)
    assert q["model.layers.0.self_attn.k_proj.weight"].shape == (4 * 128, 2048)
    assert q["lm_head.weight"].shape == (151936, 2048)
    d = dict(ds.named_parameters())
    assert d["model.layers.2.mlp.gate_proj.weight"].shape == (18432, 7168)  # first 3 layers dense
    assert "model.layers.3.mlp.gate_proj.weight" not in d
    assert d["model.layers.3.mlp.gate.weight"].shape == (256, 7168)
    assert d["model.layers.60.mlp.experts.w1"].shape == (256, 2048, 7168)
    assert d["model.layers.60.mlp.experts.w2"].shape == (256, 7168, 2048)
    assert d["model.layers.3.mlp.shared_experts.down_proj.weight"].shape == (7168, 2048)
    assert d["model.layers.0.self_attn.q_a_proj.weight"].shape == (1536, 7168)
    assert d["model.layers.0.self_attn.q_b_proj.weight"].shape == (128 * 192, 1536)
    assert d["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (512 + 64, 7168)
    assert d["model.layers.0.self_attn.kv_b_proj.weight"].shape == (128 * 256, 512)
    assert d["model.layers.0.self_attn.o_proj.weight"].shape == (7168, 128 * 128)


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-moe-mla"])
def test_tiny_presets_train_deterministically_on_cpu(name):
    cfg = MOE_PRESETS[name]
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    a, b = MoEDecoder(cfg), MoEDecoder(cfg)
    a.reset_parameters(seed=3)
    b.reset_parameters(seed=3)
    logits = a(tokens)
    assert logits.shape == (2, 12, cfg.vocab_size) and torch.isfinite(logits).all()
    assert torch.equal(logits, a(tokens)) and torch.equal(logits, b(tokens))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in a.parameters())
    # the routers learn: the routing weights carry their gradient
    assert all(p.grad.abs().sum() > 0 for n, p in a.named_parameters() if n.endswith("gate.weight"))
    assert sum(p.numel() for p in a.parameters()) == cfg.num_params


def test_routing_rule_sees_stacks_fused_splits_and_routers():
    kinds = DEFAULT_RULE.kinds(MoEDecoder(MOE_PRESETS["tiny-moe"]))
    assert kinds["model.layers.0.mlp.experts.gate_up_proj"] == ParamKind("experts", 2)
    assert kinds["model.layers.0.mlp.experts.down_proj"] == ParamKind("experts", 1)
    assert kinds["model.layers.0.mlp.gate.weight"] == ParamKind("matrix")
    assert kinds["model.embed_tokens.weight"] == kinds["lm_head.weight"] == ParamKind("elementwise")
    mla = DEFAULT_RULE.kinds(MoEDecoder(MOE_PRESETS["tiny-moe-mla"]))
    assert {k.rpartition(".")[2]: v for k, v in mla.items() if ".layers.1.mlp.experts." in k} == \
        {"w1": ParamKind("experts", 1), "w2": ParamKind("experts", 1), "w3": ParamKind("experts", 1)}
    assert mla["model.layers.0.mlp.gate_proj.weight"] == ParamKind("matrix")  # the dense first layer
    assert mla["model.layers.1.self_attn.kv_a_layernorm.weight"] == ParamKind("elementwise")


def test_meta_model_plans_as_a_real_one():
    from matrixfsdp import plan_owners

    cfg = MOE_PRESETS["tiny-moe-mla"]
    with torch.device("meta"):
        meta = MoEDecoder(cfg)
    assert plan_owners(meta, 3, block_types=MoEDecoderLayer).digest == \
        plan_owners(MoEDecoder(cfg), 3, block_types=MoEDecoderLayer).digest


@pytest.mark.parametrize("change, msg", [
    (dict(num_experts=0), "MoEConfig: num_experts must be an int >= 1, got num_experts=0"),
    (dict(num_experts_per_tok=9), "MoEConfig: num_experts_per_tok must be <= num_experts (8), got num_experts_per_tok=9"),
    (dict(attention="mha"), "MoEConfig: attention must be one of ('gqa', 'mla'), got attention='mha'"),
    (dict(first_k_dense=1), "MoEConfig: dense layers (first_k_dense > 0) need intermediate_size >= 1, got "
                            "intermediate_size=0"),
    (dict(first_k_dense=5), "MoEConfig: first_k_dense must be <= num_hidden_layers (4), got first_k_dense=5"),
    (dict(num_key_value_heads=3), "DecoderConfig: num_attention_heads must be a multiple of num_key_value_heads"),
    (dict(attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=3, v_head_dim=8),
     "MoEConfig: qk_rope_head_dim must be even (rotary), got 3"),
])
def test_bad_config(change, msg):
    with pytest.raises(ValueError, match=f"^{msg.replace('(', '[(]').replace(')', '[)]')}"):
        dataclasses.replace(MOE_PRESETS["tiny-moe"], **change)
    assert isinstance(MOE_PRESETS["tiny-moe"], MoEConfig)
