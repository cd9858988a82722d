"""QK-clip on one process against the plain reference of Algorithm 1 (``_reference.py``).

Every parity test uses a small ``tau`` so that clipping happens (asserted through the reference's
count of clipped heads), compares the parameters after each step, and the reported max logits.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import matrixfsdp
from matrixfsdp.models.decoder import Attention
from matrixfsdp.qk_clip import AttentionLayout, QKClip, RowBlock, head_max_logits

from qk_clip._reference import (Recorder, batch, clip_mha, decoder, decoder_logits, lm_loss,
                                max_rel_diff)

TAU, ALPHA = 0.03, 0.5


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(model, ref, opt, ref_opt, qk, rec, clip_ref, *, steps=3, micro=1, n=4, tau=TAU, alpha=ALPHA):
    """``steps`` steps of ``micro`` microbatches on both; returns (worst param diff, worst max-logit
    diff, heads clipped by the reference)."""
    worst, worst_max, clipped = 0.0, 0.0, 0
    for step in range(steps):
        for m in range(micro):
            x, y = batch(step * micro + m, n)
            (lm_loss(model, x, y) / micro).backward()
            (lm_loss(ref, x, y) / micro).backward()
        maxes = {k: v.clone() for k, v in rec.maxes.items()}
        opt.step()
        ref_opt.step()
        clipped += clip_ref(rec, tau, alpha)
        opt.zero_grad()
        ref_opt.zero_grad()
        got = qk.max_logits(per_head=True)
        worst_max = max(worst_max, max_rel_diff(got, {k: v.float() for k, v in maxes.items()}))
        worst = max(worst, max_rel_diff(_params(model), _params(ref)))
    return worst, worst_max, clipped


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("optimizer", ["muon", "torch_adamw"])
def test_decoder_matches_the_reference(kv_heads, optimizer):
    """matrixfsdp's decoder (built-in layout), MHA and GQA, with matrixfsdp's Muon and torch's
    AdamW: parameters after each clipped step and the reported max logits as the reference's."""
    model = decoder(kv_heads)
    ref = copy.deepcopy(model)
    if optimizer == "muon":
        opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32)
        ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02, ns_dtype=torch.float32)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    qk = QKClip(model, opt, tau=TAU, alpha=ALPHA)
    assert sorted(qk.layers) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    rec = Recorder(ref, Attention, decoder_logits)
    worst, worst_max, clipped = _train(model, ref, opt, ref_opt, qk, rec, clip_mha)
    assert clipped > 0
    assert worst_max < 1e-5, worst_max
    assert worst < 1e-5, worst
    assert qk.steps == 3 and qk.counter.total_calls == 0  # one process: no reduction


def test_momentum_is_untouched():
    """Muon's momentum after a clipped step is bitwise the reference's, which never touches it
    (after the first step it is the first gradient, computed before any clip), and after a second
    step within round-off (a rescaled momentum would be off by gamma ** alpha, > 3%)."""
    model, ref = decoder(2), decoder(2)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32)
    ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02, ns_dtype=torch.float32)
    qk = QKClip(model, opt, tau=TAU)
    rec = Recorder(ref, Attention, decoder_logits)
    names = ("q_proj", "k_proj")
    for step in range(2):
        _, _, clipped = _train(model, ref, opt, ref_opt, qk, rec, clip_mha, steps=1)
        assert clipped > 0
        for layer, rlayer in zip(model.model.layers, ref.model.layers):
            for n in names:
                m = opt.state[getattr(layer.self_attn, n).weight]["momentum_buffer"]
                r = ref_opt.state[getattr(rlayer.self_attn, n).weight]["momentum_buffer"]
                if step == 0:
                    assert torch.equal(m, r), n
                assert max_rel_diff({n: m}, {n: r}) < 1e-4, n


@pytest.mark.parametrize("how", ["accumulation", "checkpoint"])
def test_microbatches_and_recomputation_count_as_the_reference(how):
    """Two microbatches per step: the max over both forwards. Under activation checkpointing the
    recomputed forward is recorded again (twice the records) with the same maxima (a max is
    idempotent), so the clip is the reference's, which has no checkpointing."""
    from torch.utils.checkpoint import checkpoint

    model, ref = decoder(2), decoder(2)
    if how == "checkpoint":
        for layer in model.model.layers:
            layer.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(layer.forward)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    qk = QKClip(model, opt, tau=TAU)
    rec = Recorder(ref, Attention, decoder_logits)
    worst, worst_max, clipped = _train(model, ref, opt, ref_opt, qk, rec, clip_mha, steps=2, micro=2)
    assert clipped > 0 and worst < 1e-5 and worst_max < 1e-5, (worst, worst_max)
    # 2 layers x 2 microbatches x 2 steps, once more per recomputation
    assert qk.records == (16 if how == "checkpoint" else 8)


def test_capture_leaves_the_forward_bitwise_unchanged():
    model = decoder(2)
    x, _ = batch(0, 2)
    before = model(x)
    qk = QKClip(model, tau=TAU)
    assert torch.equal(model(x), before)
    assert qk.records == 2
    model.eval()
    model(x)
    assert qk.records == 2  # eval forwards are not recorded
    qk.remove()
    model.train()
    model(x)
    assert qk.records == 2


class _NoRope(nn.Module):
    """Plain MHA, no positions: head 0's logits are made all negative through its biases."""

    def __init__(self, heads=2, hd=4, d=8):
        super().__init__()
        self.heads, self.hd = heads, hd
        self.q = nn.Linear(d, heads * hd)
        self.k = nn.Linear(d, heads * hd)
        self.v = nn.Linear(d, heads * hd)
        with torch.no_grad():
            for lin, sign in ((self.q, 1.0), (self.k, -1.0)):
                lin.weight[:hd] = 0.0
                lin.bias[:hd] = sign * torch.tensor([1.0, 2.0, 0.5, 1.5])

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, self.heads, self.hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_floor_head_with_non_positive_max_is_unchanged():
    """A head whose every logit is negative (and a layer never run, max -inf) keeps its rows
    exactly, no NaN anywhere; the other head is clipped. A custom layout (q/k names, biases)."""
    torch.manual_seed(0)
    net = nn.ModuleDict({"a": _NoRope(), "b": _NoRope()})
    layout = AttentionLayout.mha(num_heads=2, head_dim=4, q="q", k="k")
    qk = QKClip(net, tau=1e-3, layouts={"a": layout, "b": layout})
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    net["a"](torch.randn(2, 5, 8))
    qk.clip()
    s = qk.max_logits(per_head=True)
    assert s["a"][0] < 0 < s["a"][1] and torch.isinf(s["b"]).all(), s
    after = dict(net.named_parameters())
    for n in ("a.q.weight", "a.q.bias", "a.k.weight", "a.k.bias"):
        assert torch.isfinite(after[n]).all(), n
        assert torch.equal(after[n][:4], before[n][:4]), n  # head 0: gamma = 1
        assert not torch.equal(after[n][4:], before[n][4:]), n  # head 1: clipped
    for n in ("b.q.weight", "b.k.weight", "a.v.weight"):
        assert torch.equal(after[n], before[n]), n


def test_head_max_logits_matches_explicit_attention_logits():
    """GQA key heads, a boolean mask, a float mask, causal, a custom scale: as an explicit softmax
    input; one chunk or many."""
    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
    kk = k.repeat_interleave(2, dim=1)
    s = q @ kk.transpose(-1, -2) * 0.3
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    bmask = torch.rand(2, 1, 6, 6) > 0.3
    fmask = torch.randn(1, 4, 6, 6)
    cases = [(dict(is_causal=True), s.masked_fill(~causal, -math.inf)),
             (dict(attn_mask=bmask), s.masked_fill(~bmask, -math.inf)),
             (dict(attn_mask=fmask), s + fmask)]
    import matrixfsdp.qk_clip.capture as cap

    for kwargs, expect in cases:
        want = expect.amax(dim=(0, 2, 3))
        got = head_max_logits(q, k, scale=0.3, **kwargs)
        old, cap._CHUNK = cap._CHUNK, 40  # one query row per chunk
        try:
            chunked = head_max_logits(q, k, scale=0.3, **kwargs)
        finally:
            cap._CHUNK = old
        assert torch.allclose(got, want, atol=1e-5) and torch.equal(got, chunked), kwargs


def test_observe_kernel_max_scores():
    """A kernel's own row maxima (FlexAttention's ``AuxOutput.max_scores``, ``[B, heads, L]``;
    torch 2.13 computes them on CUDA only, so here the same tensor is built explicitly) fold in
    per head, as the capture's; ``[heads]`` too."""
    torch.manual_seed(2)
    net = nn.ModuleDict({"a": _NoRope()})
    qk = QKClip(net, tau=1e-3, layouts={"a": AttentionLayout.mha(num_heads=2, head_dim=4, q="q", k="k")})
    q, k = torch.randn(2, 3, 2, 5, 4).unbind(0)
    max_scores = (q @ k.transpose(-1, -2) / 2.0).amax(-1)  # [B, H, L], scale 1/sqrt(4)
    qk.observe(net["a"], max_scores)
    qk.observe(net["a"], torch.tensor([-5.0, 100.0]))
    qk.clip()
    want = torch.maximum(head_max_logits(q, k), torch.tensor([-5.0, 100.0]))
    assert torch.allclose(qk.max_logits(per_head=True)["a"], want, atol=1e-5)


def test_errors():
    model = decoder(2)
    with pytest.raises(ValueError, match="tau must be a finite number > 0, got tau=0"):
        QKClip(model, tau=0)
    with pytest.raises(ValueError, match=r"alpha must be a number in \[0, 1\], got alpha=1.5"):
        QKClip(model, alpha=1.5)
    with pytest.raises(ValueError, match="found no attention module in Linear"):
        QKClip(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"layouts name module\(s\) the model does not have: \['nope'\]"):
        QKClip(model, layouts={"nope": AttentionLayout.mha(4, 8)})
    with pytest.raises(ValueError, match=r"needs >= 64 rows"):
        QKClip(model, layouts={"model.layers.0.self_attn": AttentionLayout.mha(8, 8)})
    with pytest.raises(ValueError, match="has no parameter 'wq.weight'"):
        QKClip(model, layouts={"model.layers.0.self_attn": AttentionLayout.mha(4, 8, q="wq")})
    with pytest.raises(ValueError, match="num_heads must be a positive multiple of num_kv_heads"):
        AttentionLayout.mha(4, 8, 3)
    with pytest.raises(ValueError, match="part must be one of"):
        RowBlock("q.weight", "v", 8)
    QKClip(model)
    with pytest.raises(ValueError, match="already has a QKClip attached"):
        QKClip(model)


def test_qk_norm_modules_warn():
    from matrixfsdp.models.decoder import PRESETS, Decoder

    with pytest.warns(UserWarning, match="normalize queries and keys per head"):
        QKClip(Decoder(PRESETS["tiny"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        QKClip(decoder(2))


def test_the_docs_example_runs():
    """docs/optimizers.md, "QK-clip (MuonClip)": its example runs as printed, and clips."""
    import contextlib
    import io
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "optimizers.md").read_text()
    section = text[text.index("## QK-clip (MuonClip)"):]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    out = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/optimizers.md", "exec"), scope)
    assert out.getvalue().count("model.layers.1.self_attn") == 3
    assert scope["qk"].steps == 3
    assert max(float(v) for v in re.findall(r": ([0-9.]+)", out.getvalue())) > scope["qk"].tau  # it clipped


class _PerHead(nn.Module):
    """Per-head matrices: ``wq``/``wk`` stored ``[heads, head_dim, dim]`` (dimension 0 = heads)."""

    def __init__(self, heads=3, hd=4, d=8):
        super().__init__()
        self.wq = nn.Parameter(torch.randn(heads, hd, d))
        self.wk = nn.Parameter(torch.randn(heads, hd, d))

    def forward(self, x):
        q = torch.einsum("btd,hed->bhte", x, self.wq)
        k = torch.einsum("btd,hed->bhte", x, self.wk)
        return F.scaled_dot_product_attention(q, k, k, is_causal=True).sum()


def test_per_head_matrices():
    """A layout of one row per head (``stride=1``) scales each head's whole ``[head_dim, dim]``
    matrix of a 3-D per-head parameter, as Algorithm 1 on its rows."""
    torch.manual_seed(3)
    net = _PerHead()
    layout = AttentionLayout(3, 3, (RowBlock("wq", "q", 1), RowBlock("wk", "k", 1)))
    qk = QKClip(net, tau=1.0, layouts={"": layout})
    wq, wk = net.wq.detach().clone(), net.wk.detach().clone()
    x = torch.randn(2, 5, 8)
    net(x)
    S = head_max_logits(torch.einsum("btd,hed->bhte", x, wq), torch.einsum("btd,hed->bhte", x, wk), is_causal=True)
    qk.clip()
    assert (S > 1.0).any()
    for h in range(3):
        gamma = 1.0 / S[h].item() if S[h] > 1.0 else 1.0
        assert torch.allclose(net.wq[h], wq[h] * gamma ** 0.5, rtol=1e-6)
        assert torch.allclose(net.wk[h], wk[h] * gamma ** 0.5, rtol=1e-6)
