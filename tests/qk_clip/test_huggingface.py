"""QK-clip on tiny Hugging Face models, captured through transformers' AttentionInterface:
Qwen3 (GQA with QK-norm), Qwen2 (GQA, q/k biases) and DeepSeek-V3 (MLA), against the plain
reference (``_reference.py``), with the forward's values unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from matrixfsdp.qk_clip import QKClip

from qk_clip._reference import (Recorder, attention_class, batch, clip_mha, clip_mla, hf_mha_logits, hf_mla_logits,
                                hf_model, lm_loss, max_rel_diff)

pytest.importorskip("transformers")

TAU = 1.0


def _parity(kind, attn, steps=2):
    model = hf_model(kind, attn)
    ref = copy.deepcopy(model)
    x, _ = batch(99, 2)
    before = lm_loss(model, x, x).detach()
    with pytest.warns(UserWarning, match="normalize queries and keys") if kind == "qwen3" else _no_warning():
        qk = QKClip(model, tau=TAU)
    assert model.config._attn_implementation == f"matrixfsdp_qk_clip_{attn}"
    assert torch.equal(lm_loss(model, x, x).detach(), before)  # the capture changes no value
    qk.reset()  # that forward's maxima are not the first step's
    mla = kind == "deepseek_v3"
    rec = Recorder(ref, attention_class(ref), hf_mla_logits if mla else hf_mha_logits)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt.register_step_post_hook(lambda *a: qk.clip())
    worst, worst_max, clipped = 0.0, 0.0, 0
    for step in range(steps):
        x, y = batch(step, 4)
        lm_loss(model, x, y).backward()
        lm_loss(ref, x, y).backward()
        maxes = {k: v.float() for k, v in rec.maxes.items()}
        opt.step()
        ref_opt.step()
        clipped += (clip_mla if mla else clip_mha)(rec, TAU, 0.5)
        opt.zero_grad()
        ref_opt.zero_grad()
        worst_max = max(worst_max, max_rel_diff(qk.max_logits(per_head=True), maxes))
        worst = max(worst, max_rel_diff(dict(model.named_parameters()), dict(ref.named_parameters())))
    assert clipped > 0
    assert worst_max < 1e-5 and worst < 1e-5, (worst_max, worst)
    qk.remove()
    assert model.config._attn_implementation == attn


class _no_warning:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error", UserWarning)

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_qwen3_gqa_matches_the_reference(attn):
    _parity("qwen3", attn)


def test_qwen2_biases_match_the_reference():
    _parity("qwen2", "sdpa")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_deepseek_v3_mla_matches_the_reference(attn):
    """MLA: q_nope x gamma^alpha, q_rope x gamma, k_nope rows of kv_b_proj x gamma^(1-alpha);
    the shared rotary key (kv_a_proj_with_mqa) and the value rows are untouched."""
    _parity("deepseek_v3", attn)


def test_unsupported_attention_implementation_is_refused():
    model = hf_model("qwen2", "sdpa")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="uses attn_implementation='flex_attention'; the capture wraps"):
        QKClip(model)
