"""Per-head Muon, one process ([Note: per-head Muon] in ``optim/rules/muon.py``): a matrix
``[H * d, D]`` in a group with ``heads=H`` is stepped as ``H`` independent ``[d, D]`` matrices.

The reference is what a user writes without the option: every head's slice its own 2-D
``nn.Parameter``, stepped by ``matrixfsdp.optim.Muon`` (bitwise ``torch.optim.Muon`` with bf16
Newton-Schulz, tests/optim/test_muon.py) and by ``torch.optim.Muon`` itself."""

from __future__ import annotations

import pytest
import torch

from matrixfsdp import MatrixRule
from matrixfsdp.models import Decoder, DecoderConfig
from matrixfsdp.optim import Muon, Shampoo

H, D_HEAD, D = 4, 8, 16


def _weight_and_heads(seed: int = 0, heads: int = H):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(heads * D_HEAD, D, generator=g))
    return w, [torch.nn.Parameter(s.detach().clone()) for s in w.detach().split(D_HEAD)]


def _grads(w, parts, step):
    w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(100 + step))
    for p, g in zip(parts, w.grad.split(D_HEAD)):
        p.grad = g.clone()


def _diff(w, parts) -> float:
    return (w.detach() - torch.cat([p.detach() for p in parts])).abs().max().item()


KW = {
    "fp32": dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32),
    "match_rms_no_nesterov": dict(lr=0.02, ns_dtype=torch.float32, adjust_lr_fn="match_rms_adamw", nesterov=False),
    "polar_express": dict(lr=0.02, ns_dtype=torch.float32, ns_coefficients="polar_express"),
    "capturable": dict(lr=torch.tensor(0.02), ns_dtype=torch.float32, capturable=True),
    "batched": dict(lr=0.02, ns_dtype=torch.float32, batched=True),
}


@pytest.mark.parametrize("name", list(KW))
def test_per_head_is_bitwise_per_head_parameters(name):
    w, parts = _weight_and_heads()
    opt = Muon([dict(params=[w], heads=H)], **KW[name])
    ref = Muon(parts, **{**KW[name], "capturable": False, "batched": False, "lr": 0.02})
    for step in range(3):
        _grads(w, parts, step)
        opt.step()
        ref.step()
        assert _diff(w, parts) == 0.0, (name, step)
    # per-head state in the parameter's shape: each head's rows are that head's momentum
    buf = opt.state[w]["momentum_buffer"]
    assert buf.shape == w.shape
    assert torch.equal(buf, torch.cat([ref.state[p]["momentum_buffer"] for p in parts]))


def test_against_torch_muon_bf16():
    w, parts = _weight_and_heads(1)
    opt = Muon([dict(params=[w], heads=H)], lr=0.02, weight_decay=0.1)
    ref = torch.optim.Muon(parts, lr=0.02, weight_decay=0.1)
    for step in range(3):
        _grads(w, parts, step)
        opt.step()
        ref.step()
    assert _diff(w, parts) <= 2e-3


def test_update_and_host_halves_equal_the_step():
    """What a host runs (``rule_for(p).update`` / ``prepare`` + ``finish``) is the step's update."""
    w, _ = _weight_and_heads(2)
    opt = Muon([dict(params=[w], heads=H)], lr=0.02, weight_decay=0.0, ns_dtype=torch.float32)
    rule = opt.rule_for(w)
    w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(3))
    before = w.detach().clone()
    u = rule.update(w.grad, {}, dtype=w.dtype)
    rows = [rule.prepare(g, st) for g, st in zip(w.grad.split(8), ({}, {}, {}, {}))]
    halves = rule.finish(torch.cat(rows), dtype=w.dtype)
    opt.step()
    # (the step adds in one kernel, so it equals before + u to rounding; see optim/rule.py)
    assert torch.equal(u, halves) and (w.detach() - before - u).abs().max() <= 2.5e-7


def _decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8))


def test_model_routing_groups_and_state_dict_layout():
    model = _decoder()
    opt = Muon(model, lr=0.02, ns_dtype=torch.float32, matrix_rule=MatrixRule.per_head(model))
    heads = {g.get("heads"): [p.shape for p in g["params"]] for g in opt.param_groups if g["algorithm"] == "muon"}
    assert heads == {None: [torch.Size([32, 32])] + [torch.Size([48, 32])] * 2 + [torch.Size([32, 48])],
                     2: [torch.Size([16, 32])] * 2, 4: [torch.Size([32, 32])]}
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    opt.step()
    sd = opt.state_dict()
    routes = [r for g in sd["param_groups"] for r in g["routes"]]
    assert routes.count("muon:heads/4") == 1 and routes.count("muon:heads/2") == 2
    again = Muon(model, lr=0.02, ns_dtype=torch.float32, matrix_rule=MatrixRule.per_head(model))
    again.load_state_dict(sd)
    plain = Muon(model, lr=0.02, ns_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"was saved with other update rules"):
        plain.load_state_dict(sd)


def test_errors_name_the_option():
    w, _ = _weight_and_heads()
    with pytest.raises(ValueError, match=r"Muon: heads must be None or the number of attention heads .* got heads=0"):
        Muon([dict(params=[w], heads=0)])
    with pytest.raises(ValueError, match=r"shape \(32, 16\) as 3 per-head matrices \(heads=3\), but its rows do not "
                                         r"divide by 3"):
        Muon([dict(params=[w], heads=3)])
    with pytest.raises(ValueError, match=r"Shampoo: heads=4 asks for per-head matrices, which only Muon steps"):
        Shampoo([dict(params=[w], heads=4)])
    model = _decoder()
    with pytest.raises(ValueError, match=r"which only Muon steps"):
        Shampoo(model, matrix_rule=MatrixRule.per_head(model))


def test_docs_example_runs(capsys):
    """The example of docs/optimizers.md's "Per-head Muon" section runs as printed."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "optimizers.md").read_text()
    section = text.split("## Per-head Muon", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.+?)\n```", section, flags=re.S)
    assert code is not None
    exec(compile(code.group(1), "docs/optimizers.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "['muon:heads/4', 'muon:heads/4']"
