"""One routing rule (see [Note: one routing rule] in planner/rules.py), tried as users would: the
same model plain (``Muon(model)``), planned (``plan_owners`` + ``fully_shard(plan=)``) and drop-in
(``fully_shard`` without a plan) routes every parameter alike, by name and module type, on our
MoE decoder and on Hugging Face models (dense Qwen3 and Qwen3-MoE built from tiny configs).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _moe import MoEConfig, MoEModel


def hf_model(kind: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(intermediate_size=64, **common))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=5,
                                              num_experts_per_tok=2, **common))


def build(kind: str):
    if kind == "moe":
        model = MoEModel(MoEConfig(experts=5))
        return model, list(model.blocks)
    if kind == "moe_fused":
        model = MoEModel(MoEConfig(experts=5, fused=True))
        return model, list(model.blocks)
    model = hf_model(kind)
    return model, list(model.model.layers)


def route_map(opt, model) -> dict[str, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    sd = opt.state_dict()
    return {names[id(p)]: r for g, sg in zip(opt.param_groups, sd["param_groups"]) for p, r in zip(g["params"], sg["routes"])}


def routes_three_ways(kind: str, routers: bool = True) -> dict:
    from matrixfsdp import MatrixRule, fully_shard, plan_owners
    from matrixfsdp.optim import Muon

    W = dist.get_world_size()
    rule = MatrixRule(routers=routers)
    out = {}
    model, _ = build(kind)
    out["plain"] = route_map(Muon(model, matrix_rule=rule), model)
    for how in ("planned", "dropin"):
        model, blocks = build(kind)
        mesh = init_device_mesh("cpu", (W,))
        plan = plan_owners(model, mesh, blocks=blocks, matrix_rule=rule) if how == "planned" else None
        kw = dict(plan=plan) if plan is not None else dict(matrix_rule=rule)
        for b in blocks:
            fully_shard(b, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = Muon(model, matrix_rule=rule)
        out[how] = route_map(opt, model)
        out[how + "_warnings"] = [str(w.message) for w in caught]
        if how == "dropin":  # it trains: one step on this rank's batch
            x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
            logits = model(x) if kind.startswith("moe") else model(input_ids=x).logits
            logits.float().mean().backward()
            opt.step()
    return out


EXPECT = {
    "moe": {"embed.weight": "adamw", "lm_head.weight": "adamw", "blocks.0.qkv.weight": "muon",
            "blocks.0.mlp.gate.weight": "muon", "blocks.0.mlp.experts.w1": "muon:experts/1",
            "blocks.0.mlp.experts.w2": "muon:experts/1", "blocks.0.mlp.shared.0.weight": "muon",
            "blocks.0.norm1.weight": "adamw"},
    "moe_fused": {"blocks.1.mlp.experts.gate_up_proj": "muon:experts/2",
                  "blocks.1.mlp.experts.down_proj": "muon:experts/1"},
    "qwen3": {"model.embed_tokens.weight": "adamw", "lm_head.weight": "adamw",
              "model.layers.0.mlp.gate_proj.weight": "muon", "model.layers.0.self_attn.q_norm.weight": "adamw"},
    "qwen3_moe": {"model.embed_tokens.weight": "adamw", "lm_head.weight": "adamw",
                  "model.layers.0.mlp.experts.gate_up_proj": "muon:experts/2",
                  "model.layers.0.mlp.experts.down_proj": "muon:experts/1",
                  "model.layers.0.mlp.gate.weight": "muon", "model.layers.1.self_attn.o_proj.weight": "muon"},
}


@pytest.mark.parametrize("kind", list(EXPECT))
def test_one_rule_plain_planned_dropin(kind):
    res = get_pool(2).run(routes_three_ways, kind, timeout=300)
    for r in res:
        assert r["plain"] == r["planned"] == r["dropin"], {k: (r["plain"][k], r["planned"][k], r["dropin"][k])
                                                          for k in r["plain"] if not r["plain"][k] == r["planned"][k] == r["dropin"][k]}
        for fqn, route in EXPECT[kind].items():
            assert r["plain"][fqn] == route, (fqn, r["plain"][fqn])
        assert not r["planned_warnings"] and not r["dropin_warnings"], (r["planned_warnings"], r["dropin_warnings"])


def test_routers_switch():
    res = get_pool(2).run(routes_three_ways, "qwen3_moe", routers=False, timeout=300)
    for r in res:
        assert r["plain"] == r["planned"] == r["dropin"]
        assert r["plain"]["model.layers.0.mlp.gate.weight"] == "adamw"
        assert r["plain"]["model.layers.0.mlp.experts.gate_up_proj"] == "muon:experts/2"


def test_rule_by_name_and_module_type():
    from matrixfsdp import MatrixRule
    from matrixfsdp.planner.rules import ParamKind

    rule, conv = MatrixRule(), torch.nn.Conv1d(4, 4, 3)
    head = frozenset()
    assert rule.kind("conv.weight", conv.weight, conv, head) == ParamKind("elementwise")  # 3-D, not experts
    assert MatrixRule(expert_stacks=("conv.weight",)).kind("conv.weight", conv.weight, conv, head) == ParamKind("experts")
    stack = torch.nn.Parameter(torch.zeros(4, 6, 3))
    assert rule.kind("m.experts.gate_up_proj", stack, torch.nn.Module(), head) == ParamKind("experts", 2)
    assert MatrixRule(fused=()).kind("m.experts.gate_up_proj", stack, torch.nn.Module(), head) == ParamKind("experts", 1)
    assert MatrixRule(experts=False).kind("m.experts.w1", stack, torch.nn.Module(), head) == ParamKind("elementwise")
    with pytest.raises(ValueError, match=r"fused from 4 matrices per expert .* rows \(6\) do not divide by 4; "
                                         r"pass MatrixRule\(fused=\(\)\)"):
        MatrixRule(fused=(("gate_up_proj", 4),)).kind("m.experts.gate_up_proj", stack, torch.nn.Module(), head)
    with pytest.raises(TypeError, match=r"MatrixRule: routers must be a bool, got routers='no'"):
        MatrixRule(routers="no")


def test_plain_model_conv_kernel_needs_opt_in():
    """A 3-D tensor that is not an expert stack goes to AdamW with Optimizer(model); asked for the
    matrix rule in a parameter list it is refused with the fix."""
    from matrixfsdp.optim import Muon

    conv = torch.nn.Conv1d(4, 4, 3)
    opt = Muon(torch.nn.Sequential(conv))
    assert [g["algorithm"] for g in opt.param_groups] == ["adamw"]
    with pytest.raises(ValueError, match=r"holds a parameter of shape \(4, 4, 3\) that is neither; .* in a "
                                         r"group with experts=1"):
        Muon([dict(params=[conv.weight], algorithm="muon")])
    Muon([dict(params=[conv.weight], algorithm="muon", experts=1)])  # the explicit opt-in
    with pytest.raises(ValueError, match=r"experts must be None or the number of matrices per expert .* got experts=0"):
        Muon([dict(params=[conv.weight], experts=0)])
