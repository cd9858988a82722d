"""The outside-user cases of the flat mesh, on a (2, 2) HSDP mesh with ``split`` (and ``repeat``):
``torch.autograd.grad``, post-accumulate-grad hooks, an exception in forward, gradient
accumulation without sync, a Hugging Face Qwen3 model with gradient checkpointing."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

import matrixfsdp
from _harness import get_pool
from _models import Block, TinyConfig, TinyDecoder, make_batch
from matrixfsdp._fully_shard import comm_counter
from matrixfsdp.placement.owner import owner_of
from fully_shard.test_hsdp import BATCH, _diff, _mesh, _opt, _shard

R, S = 2, 2


def _setup(mode):
    cfg = TinyConfig()
    model = TinyDecoder(cfg, seed=0)
    ref = copy.deepcopy(model)
    mesh = _mesh(R, S)
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,), replica_step=mode)
    _shard(model, mesh, plan)
    return cfg, model, ref


def _slice(x, y):
    per = BATCH // (R * S)
    r = dist.get_rank()
    return x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]


def _ref_loss(ref, x, y):
    W, per = R * S, BATCH // (R * S)
    return sum(ref.loss(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]) for r in range(W)) / W


def outsider(mode):
    cfg, model, ref = _setup(mode)
    out = {}
    x, y = make_batch(cfg, 0, BATCH)
    xs, ys = _slice(x, y)
    counters = (comm_counter(model), comm_counter(model, "replicate"))

    # torch.autograd.grad: .grad untouched, no reduction
    for c in counters:
        c.reset()
    loss = model.loss(xs, ys)
    grads = torch.autograd.grad(loss, [model.head.weight])
    out["autograd_grad_untouched"] = all(p.grad is None for p in model.parameters())
    out["autograd_grad_reductions"] = sum(c.calls.get("reduce_scatter", 0) + c.calls.get("all_reduce", 0) for c in counters)
    out["autograd_grad_shape"] = tuple(grads[0].shape)

    # post-accumulate-grad hooks: once per parameter, exactly where a gradient lands
    fired: dict[str, int] = {}
    names = {id(p): f for f, p in model.named_parameters()}
    handles = [p.register_post_accumulate_grad_hook(lambda t: fired.__setitem__(names[id(t)], fired.get(names[id(t)], 0) + 1))
               for p in model.parameters() if p.requires_grad]
    model.loss(xs, ys).backward()
    _ref_loss(ref, x, y).backward()
    out["hooks_match_grads"] = all(fired.get(f, 0) == (p.grad is not None) for f, p in model.named_parameters()
                                   if p.requires_grad)
    out["hooks_fired"] = sum(fired.values())
    out["grad_diff"] = _diff(model, ref, S, "grad")
    for h in handles:
        h.remove()
    opt, ref_opt = _opt("muon", model), _opt("muon", ref)
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()

    # an exception in forward, then training goes on (the failed step never happened)
    blk = model.blocks[1]
    orig = type(blk).forward

    def boom(self, *a, **k):
        raise RuntimeError("boom")

    type(blk).forward = boom
    try:
        model.loss(xs, ys)
    except RuntimeError as e:
        out["raised"] = str(e)
    finally:
        type(blk).forward = orig

    # gradient accumulation without sync: two micro-batches, one reduction
    x, y = make_batch(cfg, 1, BATCH)
    xs, ys = _slice(x, y)
    half = xs.shape[0] // 2 or 1
    for c in counters:
        c.reset()
    model.set_requires_gradient_sync(False)
    (model.loss(xs[:half], ys[:half]) * half / xs.shape[0]).backward()
    out["no_sync_reductions"] = sum(c.total_calls for c in counters if c is counters[1])
    model.set_requires_gradient_sync(True)
    (model.loss(xs[half:], ys[half:]) * (xs.shape[0] - half) / xs.shape[0]).backward()
    _ref_loss(ref, x, y).backward()
    out["accum_grad_diff"] = _diff(model, ref, S, "grad")
    opt.step()
    ref_opt.step()
    model.sync_params()
    out["param_diff"] = _diff(model, ref, S, "param")
    return out


@pytest.mark.parametrize("mode", ["split", "repeat"])
def test_hsdp_outsider_cases(mode):
    for r in get_pool(R * S).run(outsider, mode):
        assert r["autograd_grad_untouched"] and r["autograd_grad_reductions"] == 0, r
        assert r["autograd_grad_shape"] == (TinyConfig().vocab, TinyConfig().dim)
        assert r["hooks_match_grads"] and r["hooks_fired"] > 0, r
        assert r["grad_diff"] < 1e-6, r
        assert r["raised"] == "boom"
        assert r["no_sync_reductions"] == 0, r
        assert r["accum_grad_diff"] < 1e-5, r
        assert r["param_diff"] < 1e-5, r


def hf_qwen3(mode, R=R, S=S):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager", dtype=torch.float32)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    ref = copy.deepcopy(model)
    mesh = _mesh(R, S)
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(Qwen3DecoderLayer,), replica_step=mode)
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ref.train()
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32)
    ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02, ns_dtype=torch.float32)
    W, rank, per = R * S, dist.get_rank(), 2
    out = {"loss": 0.0, "grad": 0.0}
    for step in range(3):
        ids = torch.randint(0, 96, (W * per, 16), generator=torch.Generator().manual_seed(step))
        mine = ids[rank * per:(rank + 1) * per]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        ref_loss = sum(ref(input_ids=ids[r * per:(r + 1) * per], labels=ids[r * per:(r + 1) * per]).loss
                       for r in range(W)) / W
        ref_loss.backward()
        g = loss.detach().clone()
        dist.all_reduce(g)
        out["loss"] = max(out["loss"], abs(g.item() / W - ref_loss.item()))
        if step == 0:
            out["grad"] = _diff(model, ref, S, "grad")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    model.sync_params()
    out["param"] = _diff(model, ref, S, "param")
    # the layers' matrices (Muon); the embedding and head take AdamW, whose m / sqrt(v) turns
    # the reduction order's last bits in near-zero gradient entries into ~1e-5 relative steps
    # (measured on the flat 4-rank run of this harness too: 1.2e-5 on lm_head; with them, 1.37e-4
    # on an AVX-512 AMD EPYC, identical at 25ffc19, against < 1e-4 on the first CPU)
    for name in ("embed_tokens", "lm_head"):
        for m in (model, ref):
            m.get_submodule("model.embed_tokens" if name == "embed_tokens" else "lm_head").weight.requires_grad_(False)
    keep = {f for f, p in model.named_parameters() if p.requires_grad}
    out["param_matrices"] = _diff(_Only(model, keep), _Only(ref, keep), S, "param")
    return out


class _Only:
    """A view of a model's named parameters restricted to ``keep`` (for ``_diff``)."""

    def __init__(self, model, keep):
        self.model, self.keep = model, keep

    def named_parameters(self):
        return [(f, p) for f, p in self.model.named_parameters() if f in self.keep]


def test_hsdp_hf_qwen3_gradient_checkpointing():
    for r in get_pool(R * S).run(hf_qwen3, "split"):
        assert r["grad"] < 1e-6 and r["loss"] < 1e-5, r
        assert r["param_matrices"] < 1e-6 and r["param"] < 5e-4, r


def hsdp_init_paths():
    """Drop-in (plan-less) fully_shard, meta-device init with set_full_, and DCP full state dicts
    on a (2, 2) split mesh: each trains (or reads) like the plain model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from matrixfsdp.placement.owned_tensor import set_full_

    cfg = TinyConfig()
    out = {}
    x, y = make_batch(cfg, 0, BATCH)
    xs, ys = _slice(x, y)
    mesh = _mesh(R, S)

    # drop-in: no plan, each call plans its own parameters (auto: matrices split)
    model, ref = TinyDecoder(cfg, seed=0), TinyDecoder(cfg, seed=0)
    for b in model.blocks:
        matrixfsdp.fully_shard(b, mesh=mesh)
    matrixfsdp.fully_shard(model, mesh=mesh)
    out["dropin_split"] = sum(o.step_replica is not None for p in model.parameters() if (o := owner_of(p)))
    model.loss(xs, ys).backward()
    _ref_loss(ref, x, y).backward()
    out["dropin_grad"] = _diff(model, ref, S, "grad")

    # meta-device init, to_empty, set_full_ from the plain model's tensors
    with torch.device("meta"):
        meta = TinyDecoder(cfg, seed=0)
    plan = matrixfsdp.plan_owners(meta, mesh, block_types=(Block,), replica_step="split")
    _shard(meta, mesh, plan)
    meta.to_empty(device="cpu")
    full = dict(ref.named_parameters())
    for f, p in meta.named_parameters():
        set_full_(p, full[f].detach())
    ref.zero_grad()
    meta.loss(xs, ys).backward()
    _ref_loss(ref, x, y).backward()
    out["meta_grad"] = _diff(meta, ref, S, "grad")
    opt, ref_opt = _opt("muon", meta), _opt("muon", ref)
    opt.step()
    ref_opt.step()

    # full state dict after step() (before any forward): every replica's value, on every rank
    sd = get_model_state_dict(meta, options=StateDictOptions(full_state_dict=True))
    out["full_sd_diff"] = max((sd[f] - p.detach()).abs().max().item() for f, p in ref.named_parameters())
    plain = TinyDecoder(cfg, seed=3)
    plain.load_state_dict(sd)  # before torch's loader below replaces rank 0's values in place
    # and loaded back (broadcast_from_rank0) into a fresh split model
    fresh = TinyDecoder(cfg, seed=3)
    _shard(fresh, mesh, plan)
    set_model_state_dict(fresh, sd if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    out["full_load_diff"] = _diff(fresh, plain, S, "param")
    return out


def test_hsdp_dropin_meta_init_and_full_state_dicts():
    for r in get_pool(R * S).run(hsdp_init_paths):
        assert r["dropin_split"] > 0 and r["dropin_grad"] < 1e-6, r
        assert r["meta_grad"] < 1e-6, r
        # a stale replica would be a whole optimizer step (~1e-2) off; reduction order: ~1e-7
        assert r["full_sd_diff"] < 1e-6 and r["full_load_diff"] == 0.0, r


def hsdp_clip(mode):
    cfg, model, ref = _setup(mode)
    x, y = make_batch(cfg, 0, BATCH)
    xs, ys = _slice(x, y)
    model.loss(xs, ys).backward()
    _ref_loss(ref, x, y).backward()
    out = {}
    for norm_type in (2.0, float("inf")):
        total = matrixfsdp.clip_grad_norm_(model.parameters(), 1e9, norm_type=norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=norm_type)
        out[norm_type] = abs(total.item() - ref_total.item()) / ref_total.item()
    return out


@pytest.mark.parametrize("mode", ["split", "repeat"])
def test_hsdp_clip_grad_norm_counts_every_gradient_once(mode):
    """Each split gradient counts on its step replica, every other sharded one on replica 0: the
    total norm is the plain model's (an R-fold count would be off by sqrt(R))."""
    for r in get_pool(R * S).run(hsdp_clip, mode):
        assert r[2.0] < 1e-6 and r[float("inf")] < 1e-6, r


def _holder_sums(model):
    """Per owned parameter this rank holds whole: a position-weighted checksum."""
    from fully_shard.test_hsdp import _owned_checksums

    return {f: cs for f, whole, cs in _owned_checksums(model) if whole}


def _replicas_agree(model):
    """Every rank holding an owned tensor whole holds the same value (gathered over all ranks)."""
    mine = _holder_sums(model)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by = {}
    for d in everyone:
        for f, cs in d.items():
            by.setdefault(f, set()).add(cs)
    return sorted(f for f, v in by.items() if len(v) > 1)


def hsdp_review_regressions():
    """What an outside review broke (fixed): a split parameter frozen between step() and the
    next forward; a hand-written update after a state_dict(); a plan that differs on one rank."""
    cfg, model, ref = _setup("split")
    opt = _opt("muon", model)
    out = {}
    for step in range(2):
        model.loss(*_slice(*make_batch(cfg, step, BATCH))).backward()
        opt.step()
        opt.zero_grad()
    model.blocks[0].wqkv.weight.requires_grad_(False)  # frozen after its last step
    with torch.no_grad():
        model(make_batch(cfg, 0, BATCH)[0][:1])
    out["frozen_after_step"] = _replicas_agree(model)
    model.blocks[0].wqkv.weight.requires_grad_(True)

    model.loss(*_slice(*make_batch(cfg, 3, BATCH))).backward()
    model.state_dict()  # settles the exchange
    with torch.no_grad():  # a hand-written update, no optimizer
        for p in model.parameters():
            if p.grad is not None:
                p._local_tensor.add_(p.grad._local_tensor, alpha=-0.1)
    with torch.no_grad():
        model(make_batch(cfg, 0, BATCH)[0][:1])
    out["manual_after_settle"] = _replicas_agree(model)

    odd = "split" if dist.get_rank() == 3 else "repeat"  # only global rank 3 differs
    m2 = TinyDecoder(cfg, seed=0)
    plan = matrixfsdp.plan_owners(m2, _mesh(R, S), block_types=(Block,), replica_step=odd)
    try:
        matrixfsdp.fully_shard(m2.blocks[0], mesh=_mesh(R, S), plan=plan)
        out["plan_error"] = None
    except RuntimeError as e:
        out["plan_error"] = str(e)

    from torch.distributed.device_mesh import init_device_mesh

    try:
        matrixfsdp.fully_shard(TinyDecoder(cfg, seed=0), mesh=init_device_mesh(
            "cpu", (R, S), mesh_dim_names=("dp_shard", "dp_replicate")))
        out["swapped"] = None
    except ValueError as e:
        out["swapped"] = str(e)
    return out


def test_hsdp_review_regressions():
    res = get_pool(R * S).run(hsdp_review_regressions)
    for r in res:
        assert r["frozen_after_step"] == [] and r["manual_after_settle"] == [], r
        assert r["plan_error"] is not None and "the plan differs across ranks" in r["plan_error"], r
        assert "rank 3: " in r["plan_error"], r["plan_error"]  # labels are data-parallel ranks
        assert "dimension 0 of a 2-D mesh replicates and dimension 1 shards" in r["swapped"], r
    assert len({r["plan_error"] for r in res}) == 1  # one message, every rank
