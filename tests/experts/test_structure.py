"""Expert stacks and routers recognised by structure (issue 39 findings 2 and 3; see [Note:
mixture-of-experts structure] in planner/rules.py), on the layouts the rule names: Hugging Face
Qwen3-MoE and DeepSeek-V3 (tiny configs), a gpt-oss-style block with the stacks on the MoE module
itself, torchtitan's GroupedExperts beside router.gate. Pure: the rule over shapes and modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from matrixfsdp import MatrixRule
from matrixfsdp.planner.rules import moe_structure


def kinds(model, rule=None) -> dict[str, str]:
    return {f: (k.kind if k.kind != "experts" else f"experts/{k.splits}")
            for f, k in (rule or MatrixRule()).kinds(model).items()}


class GptOssMLP(nn.Module):
    """openai/gpt-oss's reference MLPBlock: gate = Linear(D, E), stacks held by the block itself."""

    def __init__(self, d=8, f=6, e=4):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.gate = nn.Linear(d, e)
        self.mlp1_weight = nn.Parameter(torch.randn(e, 2 * f, d))
        self.mlp1_bias = nn.Parameter(torch.zeros(e, 2 * f))
        self.mlp2_weight = nn.Parameter(torch.randn(e, d, f))
        self.mlp2_bias = nn.Parameter(torch.zeros(e, d))


class GroupedExperts(nn.Module):  # torchtitan's class name and layout
    def __init__(self, d, f, e):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(e, f, d))
        self.w2 = nn.Parameter(torch.randn(e, d, f))
        self.w3 = nn.Parameter(torch.randn(e, f, d))


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, d, e):
        super().__init__()
        self.gate = nn.Linear(d, e, bias=False)


class FeedForward(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)


class TitanMoE(nn.Module):
    def __init__(self, d=8, f=6, e=4, shared_f=4):
        super().__init__()
        self.experts = GroupedExperts(d, f, e)
        self.router = TokenChoiceTopKRouter(d, e)
        self.shared_experts = FeedForward(d, shared_f)  # shared_f == e: Linear(D, E)-shaped, no router


class Stack(nn.Module):
    """Stacks under names that say nothing: 'bank' on a module 'output' beside a 'head' router."""

    def __init__(self, d=8, f=6, e=3):
        super().__init__()
        self.head = nn.Linear(d, e, bias=False)
        self.output = nn.Module()
        self.output.bank = nn.Parameter(torch.randn(e, f, d))


def test_gpt_oss_style_stacks_on_the_moe_module():
    k = kinds(nn.Sequential(GptOssMLP()))
    assert k["0.mlp1_weight"] == k["0.mlp2_weight"] == "experts/1"
    assert k["0.gate.weight"] == "matrix" and k["0.mlp1_bias"] == "elementwise"
    assert kinds(nn.Sequential(GptOssMLP()), MatrixRule(routers=False))["0.gate.weight"] == "elementwise"


def test_torchtitan_grouped_experts_and_shared_experts():
    model = nn.Sequential(TitanMoE())
    st = moe_structure(model)
    assert st.stacks == {"0.experts.w1", "0.experts.w2", "0.experts.w3"}
    assert st.routers == {"0.router.gate.weight"}  # shared_experts.w1 is [E, D] but lives in an MLP
    k = kinds(model, MatrixRule(routers=False))
    assert k["0.router.gate.weight"] == "elementwise" and k["0.shared_experts.w1.weight"] == "matrix"


def test_stacks_recognised_whatever_their_names():
    k = kinds(nn.Sequential(Stack()))
    assert k["0.output.bank"] == "experts/1" and k["0.head.weight"] == "matrix"  # a router, not a head


def test_swiglu_gate_is_not_a_router():
    """Finding 3: MatrixRule(routers=False) moved every SwiGLU ``gate`` to AdamW."""
    from optim.test_routing_invariant import MLPNet

    for rule in (MatrixRule(), MatrixRule(routers=False)):
        assert kinds(MLPNet(n=1), rule)["blocks.0.gate.weight"] == "matrix"
        assert kinds(MLPNet(n=1), rule)["blocks.0.down.weight"] == "matrix"
    listed = MatrixRule(routers=False, router_names=("gate",))
    assert kinds(MLPNet(n=1), listed)["blocks.0.gate.weight"] == "elementwise"  # a name the user lists
    with pytest.raises(ValueError, match=r"MatrixRule: router_names must hold module or parameter names"):
        MatrixRule(router_names=("",))


def test_conv_kernel_is_never_an_expert_stack():
    model = nn.Module()
    model.conv = nn.Conv1d(4, 4, 3)  # weight [4, 4, 3]
    model.router = nn.Linear(4, 4)  # Linear(D, E) with E = the kernel's leading dim
    assert kinds(model)["conv.weight"] == "elementwise"
    assert kinds(model, MatrixRule(expert_stacks=("conv.weight",)))["conv.weight"] == "experts/1"


def test_3d_without_router_stays_elementwise():
    model = nn.Module()
    model.table = nn.Parameter(torch.randn(3, 5, 7))
    model.proj = nn.Linear(7, 4)  # E mismatch
    assert kinds(model)["table"] == "elementwise"


def _hf(kind):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=5,
                                                  num_experts_per_tok=2, head_dim=8, **common))
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        intermediate_size=64, moe_intermediate_size=16, n_routed_experts=6, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **common))


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_hugging_face_moe_layouts(kind):
    pytest.importorskip("transformers")
    model = _hf(kind)
    k, st = kinds(model), moe_structure(model)
    mlp = "model.layers.1.mlp"
    stacks = {f for f in k if f.startswith(f"{mlp}.experts.")}
    assert stacks and stacks <= st.stacks, (stacks, st.stacks)
    assert all(k[f].startswith("experts/") for f in stacks)
    assert f"{mlp}.gate.weight" in st.routers
    off = kinds(model, MatrixRule(routers=False))
    assert off[f"{mlp}.gate.weight"] == "elementwise"
    # dense MLPs (DeepSeek's first layer, its shared experts) keep their gate projections
    for f, v in off.items():
        if f.endswith("gate_proj.weight"):
            assert v == "matrix", f
