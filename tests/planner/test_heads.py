"""Per-head matrices in the planner: ``head_splits`` reads head counts from real model classes,
``MatrixRule(heads=...)`` makes them ``ParamKind("matrix", H)``, and plans cost and record them
(see [Note: per-head matrices] in ``planner/heads.py``). Meta models only: no compute."""

from __future__ import annotations

import json

import pytest
import torch

import matrixfsdp
from matrixfsdp import MatrixRule, plan_owners
from matrixfsdp.planner import head_splits
from matrixfsdp.models import Decoder, DecoderConfig
from matrixfsdp.planner import ParamKind

transformers = pytest.importorskip("transformers")


def _decoder(heads: int = 4, kv: int = 2) -> Decoder:
    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=heads, num_key_value_heads=kv, head_dim=8)
    with torch.device("meta"):
        return Decoder(cfg)


def _hf(config_cls: str, model_cls: str, **kw):
    cfg = getattr(transformers, config_cls)(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            **kw)
    with torch.device("meta"):
        return getattr(transformers, model_cls)(cfg)


def test_decoder_and_hf_gqa_models_give_query_and_key_value_heads():
    expect = (("k_proj", 2), ("q_proj", 4), ("v_proj", 2))
    assert head_splits(_decoder()) == expect
    assert head_splits(_hf("Qwen3Config", "Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8)) == expect
    assert head_splits(_hf("LlamaConfig", "LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2)) == expect
    moe = _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    assert head_splits(moe) == expect


def test_deepseek_v3_mla_up_projections_split_by_query_heads():
    model = _hf("DeepseekV3Config", "DeepseekV3ForCausalLM", moe_intermediate_size=16, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1)
    assert head_splits(model) == (("kv_b_proj", 4), ("q_b_proj", 4))
    kinds = MatrixRule(heads=head_splits(model)).kinds(model)
    # q_b_proj: 4 heads of 8 + 4 rows; kv_b_proj: 4 heads of 8 + 8 rows; the shared rotary key
    # projection (kv_a_proj_with_mqa) and o_proj stay one matrix
    assert kinds["model.layers.0.self_attn.q_b_proj.weight"] == ParamKind("matrix", 4)
    assert kinds["model.layers.0.self_attn.kv_b_proj.weight"] == ParamKind("matrix", 4)
    assert kinds["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == ParamKind("matrix", 1)
    assert kinds["model.layers.0.self_attn.o_proj.weight"] == ParamKind("matrix", 1)


def test_torchtitan_fused_qkv_splits_into_query_key_and_value_heads():
    pytest.importorskip("torchtitan.trainer")
    import sys, os
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from _titan_cpu import tiny_qwen3_config

    cfg = tiny_qwen3_config(steps=1, dump_folder="/nonexistent", world_size=1)
    with torch.device("meta"):
        model = cfg.model_spec.model.build()
    # 4 query heads + 2 key + 2 value heads of 16 rows, read from the attention module above wqkv
    assert head_splits(model) == (("wqkv", 8),)


def test_differing_layers_are_named_in_full():
    model = _decoder()
    model.model.layers[1].self_attn.q_proj = torch.nn.Linear(32, 16, bias=False, device="meta")  # now 2 heads of 8
    model.model.layers[1].self_attn.cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=2,
                                                  num_key_value_heads=2, head_dim=8)
    out = dict(head_splits(model))
    assert out["model.layers.0.self_attn.q_proj.weight"] == 4 and out["model.layers.1.self_attn.q_proj.weight"] == 2


def test_missing_head_count_and_bad_rows_raise():
    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 8)

    with pytest.raises(ValueError, match=r"head_splits: attention module 'attn' \(Attn\) .* no head count"):
        head_splits(torch.nn.ModuleDict({"attn": Attn()}))
    model = _decoder()
    with pytest.raises(ValueError, match=r"per-head matrix 'model.layers.0.self_attn.q_proj.weight' of shape \(32, 32\) "
                                         r"holds 3 heads .* do not divide by 3"):
        MatrixRule(heads={"q_proj": 3}).kinds(model)
    for bad in ((("q_proj", 0),), (("q_proj", True),), ("q_proj",), 5):
        with pytest.raises(ValueError, match="MatrixRule: heads must hold"):
            MatrixRule(heads=bad)


def test_plans_cost_and_record_head_matrices():
    model = _decoder()
    rule = MatrixRule.per_head(model)
    assert rule == MatrixRule(heads={"q_proj": 4, "k_proj": 2, "v_proj": 2})  # a dict is taken as pairs
    assert MatrixRule.per_head(model, routers=False).routers is False
    plain, heads = plan_owners(model, 2), plan_owners(model, 2, matrix_rule=rule)
    by = {p.fqn: p for p in heads.params}
    q, q0 = by["model.layers.0.self_attn.q_proj.weight"], {p.fqn: p for p in plain.params}["model.layers.0.self_attn.q_proj.weight"]
    assert (q.splits, q0.splits) == (4, 1)
    # Muon's flops cost of 4 [8, 32] matrices, far below one [32, 32] matrix's
    one = plan_owners(torch.nn.Linear(32, 8, bias=False, device="meta"), 1).params[0].cost
    assert q.cost == pytest.approx(4 * one) and q.cost < q0.cost
    assert heads.digest != plain.digest
    assert matrixfsdp.OwnerPlan.from_json(heads.to_json()).digest == heads.digest
    # a plan without per-head matrices writes no splits for them: its digest is as before
    assert all("splits" not in p for p in json.loads(plain.to_json())["params"])
    with pytest.raises(ValueError, match="splits dividing its rows 32"):
        matrixfsdp.ParamPlan(**{**q.__dict__, "splits": 3})
