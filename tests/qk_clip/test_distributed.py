"""QK-clip on every placement, against the one-process reference (gloo ranks on the CPU).

Each rank trains the sharded model on its slice of the batch and, in the same process, the plain
reference on the whole batch (the sum of the slices' losses over W, each slice a separate forward,
so the reference's max logit of a step is the max over every rank's forwards). After each step:
the reported max logits (reduced: the same on every rank) are the reference's; ``opt.step()``
(with the clip as its post-hook) makes exactly one collective, QK-clip's MAX all-reduce, counted
as ``"all_reduce_max"``; at the end every rank's *local storage* (an owner's whole matrix, a
rank's rows, a TP shard, a replica's copy) and every parameter's full value equal the reference's.
``tau`` is small enough that heads clip at every step (asserted through the reference's count).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import matrixfsdp
from _harness import get_pool
from fully_shard.test_features import collective_spy
from matrixfsdp.models.decoder import Attention, DecoderLayer
from matrixfsdp.placement.owned_tensor import local_tensor
from matrixfsdp.placement.rows import local_slices
from matrixfsdp.qk_clip import QKClip

from qk_clip._reference import (Recorder, attention_class, batch, clip_mha, clip_mla, decoder, decoder_logits,
                                hf_mha_logits, hf_mla_logits, hf_model, lm_loss, max_rel_diff)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TAU, BATCH = 0.03, 12  # BATCH divisible by 2, 3 and 4


def _mesh(R, S):
    if R == 1:
        return init_device_mesh("cpu", (S,), mesh_dim_names=("dp_shard",))
    return init_device_mesh("cpu", (R, S), mesh_dim_names=("dp_replicate", "dp_shard"))


def _compare(model, ref) -> tuple[float, float]:
    """(this rank's local storage vs the reference's matching block, full values vs the reference)."""
    refp = dict(ref.named_parameters())
    local, full = 0.0, 0.0
    for n, p in model.named_parameters():
        r = refp[n].detach()
        scale = max(r.abs().max().item(), 1e-12)
        mine = local_tensor(p).detach()
        if mine.numel():
            exp = r[local_slices(p)]
            assert mine.shape == exp.shape, (n, mine.shape, exp.shape)
            local = max(local, (mine - exp).abs().max().item() / scale)
        f = (matrixfsdp.full_tensor(p).detach() - r).abs().max().item() / scale
        full = max(full, math.inf if math.isnan(f) else f)
    return local, full


def _loop(model, ref, opt, ref_opt, qk, rec, slices, steps, micro=1, x_of=None, tau=TAU, clip=clip_mha):
    """Train both; returns per-step (python collectives in step(), max-logit diff, clipped heads)."""
    out = {"step_calls": [], "max": 0.0, "clipped": 0, "qk_calls": []}
    W = len(slices)
    me = slices[dist.get_rank() % W] if x_of is None else x_of
    for step in range(steps):
        for m in range(micro):
            x, y = batch(step * micro + m, BATCH)
            (lm_loss(model, x[me], y[me]) / micro).backward()
            (sum(lm_loss(ref, x[s], y[s]) for s in slices) / (W * micro)).backward()
        maxes = {k: v.float() for k, v in rec.maxes.items()}
        before = qk.counter.calls.get("all_reduce_max", 0)
        with collective_spy() as spy:
            opt.step()
        out["step_calls"].append(spy["python"])
        out["qk_calls"].append(qk.counter.calls.get("all_reduce_max", 0) - before)
        ref_opt.step()
        out["clipped"] += clip(rec, tau, 0.5)
        opt.zero_grad()
        ref_opt.zero_grad()
        out["max"] = max(out["max"], max_rel_diff(qk.max_logits(per_head=True), maxes))
    return out


def fully_shard_parity(R, S, mode="repeat", kv=2, micro=1, checkpoint=False, reshard=None, steps=2, hosted=False):
    W = R * S
    # hosted: 16 heads of 16 rows, whose q/k projections the planner hosts at W=3 with
    # memory_budget=1.0: row shards of 86, 86 and 84 rows, not aligned to heads
    model = decoder(16, heads=16, head_dim=16) if hosted else decoder(kv)
    ref = copy.deepcopy(model)
    if checkpoint:
        from torch.utils.checkpoint import checkpoint as ckpt

        for layer in model.model.layers:
            layer.forward = (lambda f: lambda x: ckpt(f, x, use_reentrant=False))(layer.forward)
    mesh = _mesh(R, S)
    kw = dict(memory_budget=1.0) if hosted else {}
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(DecoderLayer,), replica_step=mode, **kw)
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan, reshard_after_forward=reshard)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    qk = QKClip(model, opt, tau=TAU)
    rec = Recorder(ref, Attention, decoder_logits)
    per = BATCH // W
    slices = [slice(r * per, (r + 1) * per) for r in range(W)]
    out = _loop(model, ref, opt, ref_opt, qk, rec, slices, steps, micro)
    model.sync_params()
    out["local"], out["full"] = _compare(model, ref)
    out["placements"] = sorted({p.placement for p in plan.params})
    out["hosted"] = sorted(p.fqn for p in plan.params if p.placement == "hosted" and "self_attn.q_proj" in p.fqn)
    out["records"] = qk.records
    return out


def _check(res, steps=2, extra=(), counted_from=0):
    for r in res:
        print({k: r[k] for k in ("max", "local", "full", "clipped")}, r.get("placements"))
        assert r["clipped"] > 0, r  # the reference clipped heads
        assert r["max"] < 1e-5 and r["local"] < 1e-5 and r["full"] < 1e-5, r
        assert r["qk_calls"][counted_from:] == [1] * (steps - counted_from), r["qk_calls"]
        # step() (with the clip) issues exactly one collective: QK-clip's all-reduce
        assert all([c for c in calls if c not in extra] == ["torch.distributed.all_reduce"]
                   for calls in r["step_calls"]), r["step_calls"]


@pytest.mark.parametrize("kv", [4, 2], ids=["mha", "gqa"])
def test_flat_w2(kv):
    _check(get_pool(2).run(fully_shard_parity, 1, 2, kv=kv))


def test_flat_w2_accumulation_checkpointing_and_unsharded_after_forward():
    """Two microbatches per step, activation checkpointing (recomputation recorded again) and
    blocks kept unsharded after forward (``reshard_after_forward=False``)."""
    res = get_pool(2).run(fully_shard_parity, 1, 2, micro=2, checkpoint=True, reshard=False)
    _check(res)
    assert all(r["records"] == 2 * 2 * 2 * 2 for r in res)  # steps x microbatches x layers x (forward + recompute)


def test_flat_w3_gqa():
    _check(get_pool(3).run(fully_shard_parity, 1, 3))


def test_hosted_w3_rows_not_aligned_to_heads():
    """Data-parallel hosted q/k projections (``plan_owners(..., memory_budget=1.0)``): each rank
    holds 86, 86 or 84 rows of 16-row heads and scales the rows it holds, heads split across ranks
    included."""
    res = get_pool(3).run(fully_shard_parity, 1, 3, hosted=True, steps=2)
    _check(res, steps=2, extra=("torch.distributed.all_to_all_single",))  # the host step's own
    assert res[0]["hosted"] == ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"]


@pytest.mark.parametrize("mode", ["repeat", "split"])
def test_hsdp_2x2(mode):
    """Both replica modes: under ``split`` only the step replica's owners step, the other
    replicas' owners receive the scaled values by the exchange (their own scaled stale copies
    are overwritten with the same result)."""
    _check(get_pool(4).run(fully_shard_parity, 2, 2, mode=mode))


def mla_parity(R, S, mode="repeat", steps=2):
    """DeepSeek-V3's MLA (query LoRA, shared rotary key) under ``fully_shard``: q_nope rows by
    gamma ** alpha, q_rope rows by gamma, kv_b_proj's k_nope rows by gamma ** (1 - alpha), V and
    the rotary key untouched, as the reference's ``clip_mla``."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    W = R * S
    model = hf_model("deepseek_v3", "sdpa")
    ref = copy.deepcopy(model)
    mesh = _mesh(R, S)
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(DeepseekV3DecoderLayer,), replica_step=mode)
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    qk = QKClip(model, opt, tau=1.0)
    rec = Recorder(ref, attention_class(ref), hf_mla_logits)
    per = BATCH // W
    slices = [slice(r * per, (r + 1) * per) for r in range(W)]
    out = _loop(model, ref, opt, ref_opt, qk, rec, slices, steps, tau=1.0, clip=clip_mla)
    model.sync_params()
    out["local"], out["full"] = _compare(model, ref)
    return out


@pytest.mark.parametrize("R, S, mode", [(1, 2, "repeat"), (1, 3, "repeat"), (2, 2, "split")],
                         ids=["w2", "w3", "hsdp2x2_split"])
def test_mla(R, S, mode):
    _check(get_pool(R * S).run(mla_parity, R, S, mode))


def replicate_parity(steps=2):
    W = dist.get_world_size()
    model = decoder(2)
    ref = copy.deepcopy(model)
    matrixfsdp.replicate(model, mesh=init_device_mesh("cpu", (W,)))
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    qk = QKClip(model, opt, tau=TAU)
    rec = Recorder(ref, Attention, decoder_logits)
    per = BATCH // W
    out = _loop(model, ref, opt, ref_opt, qk, rec, [slice(r * per, (r + 1) * per) for r in range(W)], steps)
    model.sync_params()
    out["local"], out["full"] = _compare(model, ref)
    return out


def test_replicate_w2():
    """``replicate`` (ZeRO-2): owners step and scale, every replica ends with the scaled values."""
    _check(get_pool(2).run(replicate_parity))


def tp_parity(dp, tp, steps=2):
    """Hugging Face Qwen2 (GQA, q/k biases) with torch's ``parallelize_module`` on a ``"tp"`` mesh:
    ``matrixfsdp.tp.host_matrices`` at dp=1, or ``fully_shard`` + TP on ``("dp_shard", "tp")``.
    Each TP rank computes its own heads; the max all-reduce spans TP (and dp)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from tp.test_hf_models import parallelize

    model = hf_model("qwen2", "sdpa")
    ref = copy.deepcopy(model)
    if dp == 1:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        parallelize(model, mesh, "torch")
        matrixfsdp.tp.host_matrices(model, mesh)
        d = 0
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
        parallelize(model, mesh["tp"], "torch")
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(Qwen2DecoderLayer,))
        for layer in model.model.layers:
            matrixfsdp.fully_shard(layer, mesh=mesh["dp_shard"], plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh["dp_shard"], plan=plan)
        d = mesh["dp_shard"].get_local_rank()
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    qk = QKClip(model, opt, tau=1.0)
    rec = Recorder(ref, attention_class(ref), hf_mha_logits)
    per = BATCH // dp
    slices = [slice(r * per, (r + 1) * per) for r in range(dp)]
    out = _loop(model, ref, opt, ref_opt, qk, rec, slices, steps, x_of=slices[d], tau=1.0)
    out["local"], out["full"] = _compare(model, ref)
    out["group_size"] = dist.get_world_size(qk._coll.group)
    return out


@pytest.mark.parametrize("dp, tp", [(1, 2), (2, 2)], ids=["tp2", "dp2xtp2"])
def test_tensor_parallel(dp, tp):
    """The TP host step's own all-to-alls, and exactly one more collective: the clip's."""
    res = get_pool(dp * tp).run(tp_parity, dp, tp)
    _check(res, extra=("torch.distributed.all_to_all_single",))
    assert all(r["group_size"] == dp * tp for r in res)


def built_before_sharding():
    """A QKClip made on the plain model, then the model sharded: the first clip still finds the
    data-parallel group from the (now sharded) parameters and clips like one made after."""
    W = dist.get_world_size()
    model = decoder(2)
    ref = copy.deepcopy(model)
    qk = QKClip(model, tau=TAU)
    mesh = _mesh(1, W)
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(DecoderLayer,))
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.register_step_post_hook(lambda *a: qk.clip())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    rec = Recorder(ref, Attention, decoder_logits)
    per = BATCH // W
    out = _loop(model, ref, opt, ref_opt, qk, rec, [slice(r * per, (r + 1) * per) for r in range(W)], 2)
    out["local"], out["full"] = _compare(model, ref)
    return out


def test_built_before_sharding_w2():
    # its first step finds the group (and its counter, shared per group in the process): counted from step 1
    _check(get_pool(2).run(built_before_sharding), steps=2, counted_from=1)


def stock_fsdp2_parity(steps=2):
    """torch's own ``fully_shard`` (``Shard(0)`` DTensors) with torch's AdamW: the same rescale
    through DTensor's row layout."""
    from torch.distributed.fsdp import fully_shard

    W = dist.get_world_size()
    model = decoder(2)
    ref = copy.deepcopy(model)
    mesh = _mesh(1, W)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    qk = QKClip(model, opt, tau=TAU)
    rec = Recorder(ref, Attention, decoder_logits)
    per = BATCH // W
    out = _loop(model, ref, opt, ref_opt, qk, rec, [slice(r * per, (r + 1) * per) for r in range(W)], steps)
    out["local"], out["full"] = _compare(model, ref)
    return out


def test_stock_fsdp2_w2():
    _check(get_pool(2).run(stock_fsdp2_parity))
