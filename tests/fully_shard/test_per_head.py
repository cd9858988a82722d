"""Per-head Muon under every placement, against the plain per-head run (gloo ranks on the CPU).

``MatrixRule.per_head(model)`` goes to the plan and to ``Muon(model, matrix_rule=)``; the
reference is the same optimizer on the unsharded model (one process, the whole batch), which
tests/optim/test_per_head.py pins to Muon on each head as its own parameter. Each rank trains on
its slice; after 2 steps every rank's local storage (an owner's matrix, a host's row shard, a TP
shard) and every full value equal the reference's, and ``opt.step()`` issues no collective (the
host steps' all-to-alls excepted). Placements: owned (planned W=2 and 3, drop-in W=2),
data-parallel hosted (W=3, rows not aligned to heads), HSDP (2, 2) in both replica modes, TP-hosted
(Hugging Face Qwen2 by torch's TP at (dp 2, tp 2)) and DeepSeek-V3's MLA up-projections beside
expert stacks (W=2)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp
from _harness import get_pool
from fully_shard.test_features import collective_spy
from matrixfsdp import MatrixRule
from matrixfsdp.models.decoder import DecoderLayer

from qk_clip._reference import batch, decoder, hf_model, lm_loss
from qk_clip.test_distributed import _compare

BATCH = 12
TOL = 1e-5


def _opt(model, rule):
    return matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3, matrix_rule=rule)


def _shard(model, mesh, layer_type, rule, *, dropin=False, **plan_kw):
    plan = None if dropin else matrixfsdp.plan_owners(model, mesh, block_types=(layer_type,), matrix_rule=rule,
                                                      **plan_kw)
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan, matrix_rule=None if plan else rule)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan, matrix_rule=None if plan else rule)
    return plan


def _train(model, ref, rule, d, n_data, steps=2):
    """Train ``model`` on data-parallel slice ``d`` of ``n_data`` and ``ref`` on the whole batch."""
    opt, ref_opt = _opt(model, rule), _opt(ref, rule)
    per = BATCH // n_data
    calls = []
    for step in range(steps):
        x, y = batch(step, BATCH)
        lm_loss(model, x[d * per:(d + 1) * per], y[d * per:(d + 1) * per]).backward()
        (sum(lm_loss(ref, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]) for r in range(n_data))
         / n_data).backward()
        with collective_spy() as spy:
            opt.step()
        calls.append(spy["python"])
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    heads = sorted({g["heads"] for g in opt.param_groups if g.get("heads")})
    if hasattr(model, "sync_params"):
        model.sync_params()
    local, full = _compare(model, ref)
    return {"local": local, "full": full, "calls": calls, "heads": heads}


def _decoder_case(kind: str) -> dict:
    R, S = (2, 2) if kind.startswith("hsdp") else (1, dist.get_world_size())
    hosted = kind == "hosted"
    # hosted: 16 heads of 16 rows, q/k/v hosted at W=3 (row shards of 86/86/84: not whole heads)
    model = decoder(16, heads=16, head_dim=16) if hosted else decoder(2)
    ref = copy.deepcopy(model)
    rule = MatrixRule.per_head(model)
    mesh = (init_device_mesh("cpu", (S,), mesh_dim_names=("dp_shard",)) if R == 1 else
            init_device_mesh("cpu", (R, S), mesh_dim_names=("dp_replicate", "dp_shard")))
    kw = dict(memory_budget=1.0) if hosted else dict(replica_step=kind.removeprefix("hsdp_")) if R > 1 else {}
    plan = _shard(model, mesh, DecoderLayer, rule, dropin=kind == "dropin", **kw)
    out = _train(model, ref, rule, dist.get_rank(), R * S)
    out["case"] = kind
    if plan is not None:
        out["splits"] = sorted({p.splits for p in plan.params if p.placement in ("matrix", "hosted")})
        out["hosted"] = sorted(p.fqn.rpartition(".")[0].rpartition(".")[2] for p in plan.params
                               if p.placement == "hosted" and "layers.0." in p.fqn)
    return out


def _mla_with_experts() -> dict:
    """DeepSeek-V3 (MLA with a query LoRA) whose second layer is a mixture of experts."""
    import transformers as tf
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg = tf.DeepseekV3Config(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
                              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1,
                              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
                              max_position_embeddings=64, dtype=torch.float32)
    torch.manual_seed(0)
    model = tf.DeepseekV3ForCausalLM(cfg).train()
    ref = copy.deepcopy(model)
    rule = MatrixRule.per_head(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    plan = _shard(model, mesh, DeepseekV3DecoderLayer, rule)
    out = _train(model, ref, rule, dist.get_rank(), dist.get_world_size())
    out["case"] = "mla_experts"
    out["splits"] = sorted({(p.fqn.rpartition(".")[0].rpartition(".")[2], p.splits) for p in plan.params
                            if p.splits > 1 and p.placement != "experts"})
    out["experts"] = sum(p.placement == "experts" for p in plan.params)
    return out


def _tp() -> dict:
    """Hugging Face Qwen2 (GQA) by torch's TP on ``("dp_shard", "tp")``: q/k/v are TP-hosted."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from tp.test_hf_models import parallelize

    model = hf_model("qwen2", "sdpa")
    for p in model.parameters():
        p.requires_grad_(True)
    ref = copy.deepcopy(model)
    rule = MatrixRule.per_head(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    parallelize(model, mesh["tp"], "torch")
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(Qwen2DecoderLayer,), matrix_rule=rule)
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh["dp_shard"], plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh["dp_shard"], plan=plan)
    out = _train(model, ref, rule, mesh["dp_shard"].get_local_rank(), 2)
    out["case"] = "tp"
    out["tp_hosted"] = sum(matrixfsdp.tp.tp_host_of(p) is not None for n, p in model.named_parameters()
                           if "q_proj.weight" in n)
    return out


def run_w2() -> list[dict]:
    return [_decoder_case("planned"), _decoder_case("dropin"), _mla_with_experts()]


def run_w3() -> list[dict]:
    return [_decoder_case("planned"), _decoder_case("hosted")]


def run_w4() -> list[dict]:
    return [_decoder_case("hsdp_repeat"), _decoder_case("hsdp_split"), _tp()]


def _check(results: list[list[dict]]) -> dict[str, dict]:
    by_case = {}
    for rank_results in results:
        for r in rank_results:
            assert r["local"] < TOL and r["full"] < TOL, r
            # (hosts step their matrices in all-to-alls within the TP row or the shard group)
            extra = ("torch.distributed.all_to_all_single",) if r["case"] in ("tp", "hosted") else ()
            assert all(not [c for c in calls if c not in extra] for calls in r["calls"]), r["calls"]
            by_case[r["case"]] = r
    return by_case


def test_per_head_owned_dropin_and_mla_beside_experts_w2():
    cases = _check(get_pool(2).run(run_w2))
    assert cases["planned"]["heads"] == [2, 4] and cases["planned"]["splits"] == [1, 2, 4]
    assert cases["dropin"]["heads"] == [2, 4]
    # q_b_proj and kv_b_proj per head (4 heads each); the rotary key projection one matrix
    assert cases["mla_experts"]["splits"] == [("kv_b_proj", 4), ("q_b_proj", 4)]
    assert cases["mla_experts"]["experts"] == 2  # gate_up_proj and down_proj of layer 1


def test_per_head_owned_and_hosted_w3():
    cases = _check(get_pool(3).run(run_w3))
    assert {"q_proj", "k_proj", "v_proj"} <= set(cases["hosted"]["hosted"])  # hosted, per head


def test_per_head_hsdp_both_replica_modes_and_tp():
    cases = _check(get_pool(4).run(run_w4))
    assert cases["tp"]["tp_hosted"] == 2 and cases["tp"]["heads"] == [2, 4]
