"""Hugging Face ``transformers`` models (Qwen3, Llama; tiny configs built in code) under matrixfsdp.

Each model is planned with ``plan_owners(block_types=(DecoderLayer,))``, every decoder layer is
sharded, then the root (tied embeddings live in the root). Against a single-process copy of the
same model on the same global batch (DDP-average semantics: the reference loss is the mean of the
ranks' slice losses):

* training, with and without ``gradient_checkpointing_enable()`` (transformers recomputes each
  layer inside the module call; the recomputation is counted), tied and untied embeddings:
  each rank's local rows of every reduced gradient equal the reference rows (<= 1e-6), over two
  SGD steps (the second step runs on updated, re-materialized weights);
* ``generate`` (greedy) gives the reference tokens;
* ``matrixfsdp.checkpoint.save_pretrained`` writes a folder that ``from_pretrained`` loads into a
  model with the reference logits; tied weights are written once, as transformers does;
* meta-device init: build on ``meta``, plan, shard, ``to_empty``, ``set_full_`` from a reference
  state dict and recompute the non-persistent rotary buffers (the docs/huggingface.md recipe): reference logits.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from fully_shard.test_parity import compare_to_ref

import matrixfsdp

transformers = pytest.importorskip("transformers")

TOL = 1e-6
BATCH = 6  # divisible by 2 and 3
SEQ = 12
VOCAB = 128


def _config(kind: str, tied: bool):
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
              tie_word_embeddings=tied, attn_implementation="eager", dtype=torch.float32)
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

        return Qwen3Config(head_dim=16, **kw), Qwen3ForCausalLM, Qwen3DecoderLayer
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaConfig(**kw), LlamaForCausalLM, LlamaDecoderLayer


def build(kind: str, tied: bool):
    cfg, cls, layer_cls = _config(kind, tied)
    torch.manual_seed(0)
    return cls(cfg), layer_cls


def shard(model, layer_cls, W):
    mesh = init_device_mesh("cpu", (W,))
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(layer_cls,))
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    return plan


def tokens(seed: int, rows: int = BATCH, cols: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, cols), generator=torch.Generator().manual_seed(seed))


# ================================================================================ training
def train_check(kind: str, tied: bool, checkpointing: bool) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    model, layer_cls = build(kind, tied)
    ref = copy.deepcopy(model)
    plan = shard(model, layer_cls, W)
    calls = [0]
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_enable in v6
            model.gradient_checkpointing_enable()
            ref.gradient_checkpointing_enable()
    model.train()
    ref.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, foreach=False)
    per = BATCH // W
    out = {"grad_diff": 0.0, "loss_diff": 0.0, "tied": model.lm_head.weight is model.model.embed_tokens.weight}
    for step in range(2):
        ids = tokens(step)
        mine = ids[rank * per:(rank + 1) * per]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        ref_loss = sum(ref(input_ids=ids[r * per:(r + 1) * per], labels=ids[r * per:(r + 1) * per]).loss
                       for r in range(W)) / W
        ref_loss.backward()
        g = loss.detach().clone()
        dist.all_reduce(g)
        out["loss_diff"] = max(out["loss_diff"], abs(g.item() / W - ref_loss.item()))
        out["grad_diff"] = max(out["grad_diff"], compare_to_ref(model, ref, plan, rank, W, "grad"))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["q_proj0_calls"] = calls[0]
    return out


@pytest.mark.parametrize("W,kind,tied,checkpointing", [
    (2, "qwen3", False, False),
    (2, "qwen3", True, True),
    (3, "qwen3", True, False),
    (3, "qwen3", False, True),
    (2, "llama", True, False),
    (3, "llama", False, True),
])
def test_hf_training_parity(W, kind, tied, checkpointing):
    res = get_pool(W).run(train_check, kind, tied, checkpointing)
    print(f"{kind} W={W} tied={tied} ckpt={checkpointing}: "
          f"grad {max(r['grad_diff'] for r in res):.2e} loss {max(r['loss_diff'] for r in res):.2e}")
    for r in res:
        assert r["tied"] == tied
        assert r["grad_diff"] <= TOL and r["loss_diff"] <= TOL, r
        # two steps, one forward each; gradient checkpointing recomputes it in backward (q_proj, not
        # the mlp: non-reentrant checkpointing stops recomputing once the saved tensors are back)
        assert r["q_proj0_calls"] == (4 if checkpointing else 2), r


# ================================================================================ generate
def generate_check(kind: str, tied: bool) -> dict:
    W = dist.get_world_size()
    model, layer_cls = build(kind, tied)
    ref = copy.deepcopy(model)
    shard(model, layer_cls, W)
    model.eval()
    ref.eval()
    ids = tokens(7, rows=2, cols=5)
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=4, do_sample=False)
        b = ref.generate(ids, max_new_tokens=4, do_sample=False)
    return {"equal": torch.equal(a, b), "new": a.shape[1] - ids.shape[1]}


@pytest.mark.parametrize("W,kind,tied", [(2, "qwen3", True), (3, "llama", False)])
def test_hf_generate(W, kind, tied):
    res = get_pool(W).run(generate_check, kind, tied)
    assert all(r["equal"] and r["new"] == 4 for r in res), res


# ================================================================================ save_pretrained
def save_check(kind: str, tied: bool, path: str) -> dict:
    W, rank = dist.get_world_size(), dist.get_rank()
    model, layer_cls = build(kind, tied)
    ref = copy.deepcopy(model)
    shard(model, layer_cls, W)
    out = {}
    # transformers' own save_pretrained on the sharded model, called on every rank as with FSDP2,
    # once asked for (an explicit call: no import registers it)
    matrixfsdp.checkpoint.enable_save_pretrained()
    model.save_pretrained(os.path.join(path, "direct"))
    direct = type(ref).from_pretrained(os.path.join(path, "direct"))
    out["direct_equal"] = all(torch.equal(v, ref.state_dict()[k]) for k, v in direct.state_dict().items())
    ret = matrixfsdp.checkpoint.save_pretrained(model, os.path.join(path, "hf"))
    out["ret"] = ret == os.path.join(path, "hf")
    loaded = type(ref).from_pretrained(os.path.join(path, "hf"))
    ids = tokens(3)
    with torch.no_grad():
        out["logit_diff"] = (loaded(ids).logits - ref(ids).logits).abs().max().item()
    refsd = ref.state_dict()
    out["weights_equal"] = all(torch.equal(v, refsd[k]) for k, v in loaded.state_dict().items())
    from safetensors import safe_open

    with safe_open(os.path.join(path, "hf", "model.safetensors"), "pt") as f:
        out["keys"] = sorted(f.keys())
    out["loaded_tied"] = loaded.lm_head.weight is loaded.model.embed_tokens.weight
    import json

    out["architectures"] = json.load(open(os.path.join(path, "hf", "config.json")))["architectures"]
    out["class"] = type(ref).__name__
    return out


@pytest.mark.parametrize("W,kind,tied", [(2, "qwen3", True), (3, "llama", False)])
def test_hf_save_pretrained_roundtrip(W, kind, tied, tmp_path):
    res = get_pool(W).run(save_check, kind, tied, str(tmp_path))
    for r in res:
        # weights bitwise; logits within TOL (from_pretrained picks its own attention kernel)
        assert r["ret"] and r["weights_equal"] and r["logit_diff"] <= TOL, r
        assert r["loaded_tied"] == tied
        assert r["architectures"] == [r["class"]], r["architectures"]  # not MatrixFSDP<class>
        assert ("lm_head.weight" in r["keys"]) == (not tied), r["keys"]
        assert "model.embed_tokens.weight" in r["keys"]
        assert len(r["keys"]) == 2 + 2 * (11 if kind == "qwen3" else 9) + (not tied), r["keys"]
    assert all(r["direct_equal"] for r in res), res


def test_hf_save_pretrained_refuses_non_hf_model(tmp_path):
    with pytest.raises(TypeError, match=r"^matrixfsdp\.checkpoint\.save_pretrained: model must be a "
                                        r"transformers PreTrainedModel \(with save_pretrained and config\), got Linear$"):
        matrixfsdp.checkpoint.save_pretrained(torch.nn.Linear(2, 2), tmp_path)
    model, _ = build("qwen3", True)
    with pytest.raises(ValueError, match=r"^matrixfsdp\.checkpoint\.save_pretrained: state_dict= is chosen by "
                                         r"matrixfsdp\.checkpoint\.save_pretrained itself, got state_dict= in kwargs$"):
        matrixfsdp.checkpoint.save_pretrained(model, tmp_path, state_dict={})


# ================================================================================ meta init
def reset_rope_buffers_(model) -> None:
    """The docs/huggingface.md recipe: recompute every rotary module's non-persistent ``inv_freq`` from the
    config after ``to_empty`` (transformers computes it in ``__init__``, which ran on ``meta``)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for m in model.modules():
        if hasattr(m, "inv_freq") and hasattr(m, "rope_type"):
            fn = m.compute_default_rope_parameters if m.rope_type == "default" else ROPE_INIT_FUNCTIONS[m.rope_type]
            inv_freq, m.attention_scaling = fn(m.config, device=m.inv_freq.device)
            with torch.no_grad():
                m.inv_freq.copy_(inv_freq)
                m.original_inv_freq.copy_(inv_freq)


def meta_check(kind: str, tied: bool) -> dict:
    W = dist.get_world_size()
    ref, layer_cls = build(kind, tied)
    cfg = ref.config
    with torch.device("meta"):
        model = type(ref)(cfg)
    shard(model, layer_cls, W)
    model.to_empty(device="cpu")
    full = ref.state_dict()
    for name, p in model.named_parameters():
        matrixfsdp.set_full_(p, full[name])
    stale = model.model.rotary_emb.inv_freq.clone()
    reset_rope_buffers_(model)
    out = {"tied": model.lm_head.weight is model.model.embed_tokens.weight,
           "rope_was_stale": not torch.equal(stale, ref.model.rotary_emb.inv_freq)}
    ids = tokens(5)
    with torch.no_grad():
        out["logit_diff"] = (model(ids).logits - ref(ids).logits).abs().max().item()
    return out


@pytest.mark.parametrize("W,kind,tied", [(2, "qwen3", True), (3, "llama", False)])
def test_hf_meta_init(W, kind, tied):
    res = get_pool(W).run(meta_check, kind, tied)
    for r in res:
        assert r["tied"] == tied and r["logit_diff"] <= TOL, r
