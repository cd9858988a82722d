"""Issue 20 item 2: ``Muon(model.parameters())`` on a ``fully_shard`` model routes the embedding and
head to AdamW (the owner plan made them element-wise), the same call on the plain model to Muon.
One warning at construction names exactly those tensors and the fix; the fix (explicit groups, or
``Muon(model)``) trains sharded like plain. W=2: TinyDecoder and a tiny HF Qwen3 built in code."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _models import Block, TinyConfig, TinyDecoder, make_batch

import matrixfsdp
from matrixfsdp.optim import Muon

KW = dict(lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3)
BATCH = 8
PREFIX = "Muon(params): on a matrixfsdp.fully_shard model, algorithm='auto' routes "


def _build(kind: str):
    if kind == "tiny":
        return TinyDecoder(TinyConfig(), seed=0), Block, lambda m: m.blocks
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager", dtype=torch.float32)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg), Qwen3DecoderLayer, lambda m: m.model.layers


def _loss(kind, model, x, y):
    if kind == "tiny":
        return model.loss(x, y)
    return model(input_ids=x, labels=x).loss


def _ours(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith(PREFIX)]


def _make(params, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = Muon(params, **KW, **kw)
    return opt, _ours(caught)


def _rules(opt, model) -> dict[str, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: opt._route(g, p) for g in opt.param_groups for p in g["params"]}


def list_routing_check(kind: str) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    model, block_cls, blocks = _build(kind)
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (W,))
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(block_cls,))
    for b in blocks(model):
        matrixfsdp.fully_shard(b, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)

    out: dict = {}
    sharded_list, out["sharded_list"] = _make(model.parameters())
    plain_list, out["plain_list"] = _make(ref.parameters())
    _, out["module"] = _make(model)
    s_rules, p_rules = _rules(sharded_list, model), _rules(plain_list, ref)
    out["differ"] = sorted(n for n in s_rules if s_rules[n] != p_rules[n])

    # the fix the warning names: the flagged tensors in an explicit AdamW group, on both runs
    def groups(m):
        named = dict(m.named_parameters())
        return [{"params": [p for n, p in named.items() if n not in out["differ"]]},
                {"params": [named[n] for n in out["differ"]], "algorithm": "adamw"}]

    opt, out["fixed"] = _make(groups(model))
    ref_opt, _ = _make(groups(ref))
    per = BATCH // W
    vocab = 64 if kind == "tiny" else 96  # 96: no MLP matrix has the vocab's row count
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, vocab, (BATCH, 8), generator=g)
        y = torch.roll(x, -1, dims=1)
        _loss(kind, model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        (sum(_loss(kind, ref, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]) for r in range(W)) / W).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    out["fixed_param_diff"] = max((p.full_tensor() - q).abs().max().item()
                                  for p, q in zip(model.parameters(), ref.parameters()))
    return out


@pytest.mark.parametrize("kind", ["tiny", "qwen3"])
def test_list_routing_warns_once_naming_the_tensors(kind):
    if kind == "qwen3":
        pytest.importorskip("transformers")
    expected = {"tiny": ["head.weight", "tok_emb.weight"],
                "qwen3": ["lm_head.weight", "model.embed_tokens.weight"]}[kind]
    for r in get_pool(2).run(list_routing_check, kind, timeout=300):
        assert r["differ"] == expected, r["differ"]  # the routing really differs, on exactly these
        assert len(r["sharded_list"]) == 1, r["sharded_list"]  # one warning, at construction
        msg = r["sharded_list"][0]
        named = re.findall(r"'([\w.]+) \(\d+, \d+\)'", msg)
        assert sorted(named) == expected, msg
        assert msg.startswith(PREFIX + f"{len(expected)} 2D parameter(s) to AdamW because the owner plan"), msg
        assert "the same call on the plain model gives them the 'muon' rule" in msg
        assert "Muon(model)" in msg and "algorithm='adamw'" in msg
        # nothing to warn about: plain lists, Muon(model), the explicit groups the warning suggests
        assert r["plain_list"] == [] and r["module"] == [] and r["fixed"] == []
        assert r["fixed_param_diff"] <= 1e-6, r
