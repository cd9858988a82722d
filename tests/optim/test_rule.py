"""The public update-rule protocol ([Note: update-rule protocol], ``optim/rule.py``): every
optimizer exposes each parameter's rule (``opt.rule_for(p)``), its own step runs that rule, and
``update`` + ``decay`` (what the TP host step runs) are the same step up to rounding, advancing the
state identically."""

from __future__ import annotations

import copy

import pytest
import torch

from matrixfsdp.optim import SOAP, Muon, ShardedStateRule, Shampoo, UpdateRule

FAST = {
    Muon: {"ns_dtype": torch.float32, "weight_decay": 0.1},
    Shampoo: {"start_preconditioning_step": 2, "precondition_frequency": 2, "weight_decay": 0.1},
    SOAP: {"precondition_frequency": 2, "weight_decay": 0.1},
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(12, 8)), torch.nn.Parameter(torch.randn(8))]


def _grads(n):
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(12, 8, generator=g), torch.randn(8, generator=g)] for _ in range(n)]


@pytest.mark.parametrize("cls", [Muon, Shampoo, SOAP])
def test_rule_for_names_each_parameters_rule(cls):
    w, b = _model()
    e = torch.nn.Parameter(torch.randn(4, 4))
    opt = cls([{"params": [w, b]}, {"params": [e], "algorithm": "adamw"}], lr=0.01, **FAST[cls])
    rules = [opt.rule_for(p) for p in (w, b, e)]
    assert all(isinstance(r, UpdateRule) for r in rules)
    assert [r.name for r in rules] == [cls.rule, "adamw", "adamw"]
    assert rules[0].decay() == (0.01, 0.1) and rules[2].decay() == (0.01, 0.1)
    opt.param_groups[0]["lr"] = 0.5  # hyperparameters are read from the group at every call
    assert rules[0].decay() == (0.5, 0.1)
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.rule_for: .*not a parameter of this optimizer"):
        opt.rule_for(torch.nn.Parameter(torch.zeros(3, 3)))


@pytest.mark.parametrize("cls", [Muon, Shampoo, SOAP])
def test_the_optimizers_step_is_its_rules_step_bitwise(cls):
    """One code path: ``opt.step()`` and ``rule.step`` on copies give the same bits."""
    params = _model()
    manual = [p.detach().clone() for p in params]
    opt = cls(params, lr=0.02, **FAST[cls])
    states: list[dict] = [{}, {}]
    for grads in _grads(4):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        rules = [opt.rule_for(p) for p in params]  # before the step: lr read live
        opt.step()
        for rule, m, g, st in zip(rules, manual, grads, states):
            rule.step(m, g.clone(), st)
    for p, m, st in zip(params, manual, states):
        assert torch.equal(p.detach(), m)
        assert opt.state[p].keys() == st.keys()
        assert all(torch.equal(v, st[k]) for k, v in opt.state[p].items())


@pytest.mark.parametrize("cls", [Muon, Shampoo, SOAP])
def test_update_and_decay_are_the_step(cls):
    """``W * (1 - lr * wd) + update(G)`` is ``step(W, G)`` up to rounding, and ``update`` leaves
    the state bitwise where ``step`` does (the TP host step relies on both)."""
    params = _model()
    opt = cls(params, lr=0.02, **FAST[cls])
    for i, p in enumerate(params):  # the matrix rule, then AdamW
        rule = opt.rule_for(p)
        ref = p.detach().clone()
        by_update = ref.clone()
        st_step: dict = {}
        st_update: dict = {}
        for n, grads in enumerate(_grads(5)):
            g = grads[i]
            rule.step(ref, g, st_step)
            u = rule.update(g, st_update, dtype=by_update.dtype)
            assert u.shape == by_update.shape and u.dtype == by_update.dtype
            lr, wd = rule.decay()
            assert wd == 0.1
            if cls is SOAP and rule.name == "soap" and n == 0:
                # SOAP's first call only gathers statistics and its own step does not decay;
                # update() is zero, and decay() cannot know it (a known difference of the TP host
                # step, docs/tp.md): compare from the second call on
                assert not u.any()
                by_update.copy_(ref)
            else:
                by_update.mul_(1 - lr * wd).add_(u)
            assert st_step.keys() == st_update.keys()
            assert all(torch.equal(v, st_update[k]) for k, v in st_step.items()), rule.name
            torch.testing.assert_close(by_update, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cls", [Muon, Shampoo, SOAP])
def test_init_state_is_the_state_a_first_step_starts_from(cls):
    w, b = _model()
    opt = cls([w, b], lr=0.02, **FAST[cls])
    for p in (w, b):
        st = opt.rule_for(p).init_state(torch.empty(p.shape, device="meta"))
        opt_state = copy.deepcopy(opt.rule_for(p).init_state(p.detach()))
        assert st.keys() == opt_state.keys() and st
        assert all(v.shape == opt_state[k].shape for k, v in st.items())


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dim", [0, 1])
def test_prepare_on_blocks_then_finish_is_update_bitwise(nesterov, dim):
    """[Note: state on the shards]: Muon's state is element-wise, so ``prepare`` on uneven
    blocks (an empty one included) with block-shaped state, then ``finish`` on
    the assembled matrix, is ``update`` on the whole gradient: the same update and momentum bits."""
    w, _ = _model()
    opt = Muon([w], lr=0.02, nesterov=nesterov, **FAST[Muon])
    rule = opt.rule_for(w)
    assert rule.shards_state and isinstance(rule, ShardedStateRule)
    whole: dict = {}
    blocks: list[dict] = [{} for _ in range(4)]
    for (g, _) in _grads(3):
        want = rule.update(g.clone(), whole, dtype=torch.float32)
        parts = torch.tensor_split(g.clone(), [5, 5, 9 - dim], dim=dim)  # uneven, an empty one
        prepared = [rule.prepare(p, st) for p, st in zip(parts, blocks)]
        got = rule.finish(torch.cat(prepared, dim=dim), dtype=torch.float32)
        assert torch.equal(got, want)
        assert torch.equal(torch.cat([st["momentum_buffer"] for st in blocks], dim=dim), whole["momentum_buffer"])


@pytest.mark.parametrize("cls", [Shampoo, SOAP])
def test_rules_with_whole_matrix_state_do_not_split(cls):
    w, b = _model()
    opt = cls([w, b], lr=0.02, **FAST[cls])
    assert not opt.rule_for(w).shards_state and not opt.rule_for(b).shards_state
    with pytest.raises(TypeError, match=r"prepare: this rule keeps whole-matrix state .*update\(\)"):
        opt.rule_for(w).prepare(torch.zeros(12, 8), {})
    assert not Muon([w, b]).rule_for(b).shards_state  # AdamW keeps its moments with the host's step

    class OldRule:  # a rule written against UpdateRule alone is still one
        name = "muon"

        def init_state(self, like): return {}
        def step(self, param, grad, state): pass
        def update(self, grad, state, *, dtype=None): return grad
        def decay(self): return 0.1, 0.0

    assert isinstance(OldRule(), UpdateRule) and not isinstance(OldRule(), ShardedStateRule)


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [Muon, Shampoo, SOAP])
def test_update_is_the_old_step_on_zeros_bitwise(cls, dtype):
    """``update`` computes the additive update directly ([Note: update rules as classes]); it is
    bit for bit, the sign of zero included, what it was before: the rule's step on a zero matrix
    without decay (``0 + alpha * x``, one rounding in the promotion of the parameter's dtype and
    the term's). Muon at its default bf16 Newton-Schulz (a bf16 term added to float32 zeros),
    Shampoo through its AdamW and preconditioned steps, SOAP from its statistics-only first call,
    AdamW; gradients with zero rows and columns give zero terms (``-lr * 0.0``: +0.0 on zeros)."""
    torch.manual_seed(0)
    w, e = torch.nn.Parameter(torch.randn(12, 8, dtype=dtype)), torch.nn.Parameter(torch.randn(12, 8, dtype=dtype))
    kw = {k: v for k, v in FAST[cls].items() if k != "ns_dtype"}
    opt = cls([{"params": [w]}, {"params": [e], "algorithm": "adamw"}], lr=0.02, **kw)
    for group in opt.param_groups:  # the old update stepped without decay
        group["weight_decay"] = 0.0
    zeros_seen = 0
    for p in (w, e):
        rule = opt.rule_for(p)
        st_step: dict = {}
        st_update: dict = {}
        for n, (g, _) in enumerate(_grads(5)):
            g = g.to(dtype)
            g[3], g[:, 5] = 0, 0
            old = torch.zeros(g.shape, dtype=dtype)
            rule.step(old, g, st_step)
            new = rule.update(g, st_update, dtype=dtype)
            assert new.dtype == dtype and torch.equal(_bits(new), _bits(old)), (rule.name, n)
            assert all(torch.equal(v, st_update[k]) for k, v in st_step.items()), rule.name
            zeros_seen += int((old == 0).sum())
    assert zeros_seen  # the sign of zero was checked


@pytest.mark.parametrize("cls", [Muon, Shampoo, SOAP])
def test_update_with_splits_is_each_matrix_update(cls, monkeypatch):
    """``update(splits=k)`` steps a stack ``[n, out, in]`` (a 2-D tensor: a stack of one, as a
    projection stepped per head) as its ``n * k`` matrices, with state stacked per matrix: each
    matrix's update and state bitwise the rule's on that matrix alone (Muon's Newton-Schulz in
    chunks of one matrix: batched, it differs by round-off on the CPU)."""
    import matrixfsdp.optim._expert_step as expert_step

    monkeypatch.setattr(expert_step, "NS_CHUNK_BYTES_CPU", 1)
    w, _ = _model()
    opt = cls([w], lr=0.02, **FAST[cls])
    rule = opt.rule_for(w)
    for shape, splits in (((2, 12, 8), 2), ((12, 8), 3)):
        stacked: dict = {}
        each: list[dict] = [{} for _ in range((shape[0] if len(shape) == 3 else 1) * splits)]
        g = torch.Generator().manual_seed(2)
        for _ in range(4):
            grad = torch.randn(shape, generator=g)
            got = rule.update(grad, stacked, splits=splits)
            mats = grad.reshape(len(each), -1, grad.shape[-1])
            want = torch.stack([rule.update(m, st) for m, st in zip(mats, each)]).view(shape)
            assert got.shape == grad.shape and torch.equal(got, want), (shape, splits)
            for k, v in stacked.items():
                assert torch.equal(v, torch.stack([st[k] for st in each])), k
