"""Muon's matrix rule: bitwise torch.optim.Muon with bf16 Newton-Schulz, fp32 NS, validation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixfsdp.optim import Muon
from matrixfsdp.optim._muon import batched_newtonschulz, gram_newtonschulz, zeropower_via_newtonschulz


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices gain nothing from intra-op threads, and spinning threads on a busy 2-core box
    make this module ~15x slower; restore the setting for other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

NS = (3.4445, -4.775, 2.0315)


def _pair(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    a = torch.nn.Parameter(torch.randn(shape, generator=g, dtype=dtype))
    return a, torch.nn.Parameter(a.detach().clone())


def _run_both(shape, steps, seed=0, **kw):
    ours, ref = _pair(shape, seed)
    opt = Muon([ours], **kw)
    torch_opt = torch.optim.Muon([ref], **kw)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        grad = torch.randn(shape, generator=g)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        torch_opt.step()
    return ours, ref, opt.state[ours], torch_opt.state[ref]


@pytest.mark.parametrize("shape", [(24, 40), (48, 32), (16, 16)], ids=["wide", "tall", "square"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_bitwise_torch_muon(shape, nesterov, adjust_lr_fn):
    ours, ref, state, torch_state = _run_both(
        shape, 4, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn
    )
    assert torch.equal(ours, ref)
    assert torch.equal(state["momentum_buffer"], torch_state["momentum_buffer"])
    assert not torch.equal(ours, _pair(shape)[0])  # it moved


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 40),
    lr=st.floats(1e-4, 0.1),
    weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
    momentum=st.floats(0.0, 0.99),
    nesterov=st.booleans(),
    ns_steps=st.integers(0, 6),
    adjust_lr_fn=st.sampled_from([None, "original", "match_rms_adamw"]),
    seed=st.integers(0, 2**16),
)
def test_bitwise_torch_muon_property(rows, cols, lr, weight_decay, momentum, nesterov, ns_steps, adjust_lr_fn, seed):
    ours, ref, state, torch_state = _run_both(
        (rows, cols),
        3,
        seed=seed,
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        nesterov=nesterov,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )
    assert torch.equal(ours, ref)
    assert torch.equal(state["momentum_buffer"], torch_state["momentum_buffer"])


def _ns_reference(x: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic iteration written out in float64: X <- aX + (bA + cA^2)X, A = X X^T."""
    a, b, c = NS
    x = x.double()
    flip = x.shape[0] > x.shape[1]
    if flip:
        x = x.T
    x = x / max(x.norm().item(), 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if flip else x


@pytest.mark.parametrize("shape", [(24, 40), (48, 32)])
def test_fp32_newton_schulz_matches_float64_reference(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    out = zeropower_via_newtonschulz(x, NS, 5, 1e-7, torch.float32)
    assert out.dtype == torch.float32 and out.shape == shape
    torch.testing.assert_close(out.double(), _ns_reference(x, 5), rtol=0, atol=2e-5)
    # It orthogonalizes: singular values land near 1 (the quintic's band, roughly [0.7, 1.2]).
    s = torch.linalg.svdvals(out)
    assert 0.5 < s.min() and s.max() < 1.5


def test_fp32_step_equals_closed_form():
    p, _ = _pair((24, 40))
    start = p.detach().clone()
    opt = Muon([p], lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True, ns_dtype=torch.float32,
               adjust_lr_fn="match_rms_adamw")
    grad = torch.randn(24, 40, generator=torch.Generator().manual_seed(7))
    p.grad = grad
    opt.step()
    buf = 0.1 * grad.double()
    update = grad.double() + 0.9 * (buf - grad.double())  # nesterov: grad.lerp(buf, momentum)
    lr_adj = 0.05 * 0.2 * math.sqrt(40)
    expected = start.double() * (1 - 0.05 * 0.1) - lr_adj * _ns_reference(update, 5)
    torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_never_writes_the_momentum_buffer(ns_dtype, dtype):
    """nesterov=False hands the buffer itself to NS; it must stay the gradient EMA (torch's
    ``.bfloat16()`` aliases it for bf16 params and normalizes it in place)."""
    p = torch.nn.Parameter(torch.randn(8, 6, dtype=dtype))
    opt = Muon([p], momentum=0.5, nesterov=False, ns_dtype=ns_dtype)
    grad = torch.randn(8, 6, dtype=dtype)
    p.grad = grad
    opt.step()
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.zeros_like(grad).lerp_(grad, 0.5))


def test_ns_dtype_float32_differs_from_bf16_but_is_close():
    shape = (24, 40)
    a, b = _pair(shape)
    oa, ob = Muon([a], lr=0.02), Muon([b], lr=0.02, ns_dtype=torch.float32)
    grad = torch.randn(shape)
    a.grad, b.grad = grad.clone(), grad.clone()
    oa.step()
    ob.step()
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, b, rtol=0, atol=0.02 * 0.05)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"momentum": -0.5}, r"momentum must be a float >= 0, got momentum=-0.5"),
        ({"ns_steps": 100}, r"ns_steps must be an int in \[0, 100\), got ns_steps=100"),
        ({"ns_steps": 2.0}, r"ns_steps must be an int in \[0, 100\), got ns_steps=2.0"),
        ({"adjust_lr_fn": "sqrt"}, r"adjust_lr_fn must be one of \(None, 'original', 'match_rms_adamw'\), got adjust_lr_fn='sqrt'"),
        ({"ns_dtype": torch.float16}, r"ns_dtype must be torch.bfloat16 or torch.float32, got ns_dtype=torch.float16"),
        ({"ns_dtype": "bf16"}, r"ns_dtype must be torch.bfloat16 or torch.float32, got ns_dtype='bf16'"),
        ({"ns_coefficients": (1.0, 2.0)}, r"ns_coefficients must be three floats, got ns_coefficients=\(1.0, 2.0\)"),
        ({"nesterov": 1}, r"nesterov must be a bool, got nesterov=1"),
        ({"eps": -1.0}, r"eps must be a float >= 0, got eps=-1.0"),
        ({"ns_method": "fast"}, r"ns_method must be one of \('standard', 'gram'\), got ns_method='fast'"),
        ({"ns_method": None}, r"ns_method must be one of \('standard', 'gram'\), got ns_method=None"),
    ],
)
def test_validation(kwargs, message):
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=rf"^Muon: {message}$"):
        Muon([p], **kwargs)


def test_defaults_match_torch():
    import inspect

    ours = inspect.signature(Muon).parameters
    theirs = inspect.signature(torch.optim.Muon).parameters
    for name, param in theirs.items():
        assert ours[name].default == param.default, name
    assert list(ours)[: len(theirs)] == list(theirs)
    assert ours["ns_dtype"].default is torch.bfloat16


# ---------------------------------------------------------------------------------- Gram Newton-Schulz
# Measured on 3 seeds each of 32x96, 96x32, 16x80, 64x256 (5 steps): float32 Gram and standard are
# both within 9.8e-7 of the float64 iteration and within 7.8e-7 of each other (entries up to 0.46,
# where 1 ulp is 3e-8: the same polynomial, evaluated in another order); bfloat16 Gram within
# 2.0e-2 of float64 (standard bf16: 1.7e-2; one bf16 ulp at 0.3 is 2e-3).
GRAM_SHAPES = [(32, 96), (96, 32), (48, 48), (16, 80)]


@pytest.mark.parametrize("shape", GRAM_SHAPES, ids=["wide", "tall", "square", "wide5"])
def test_gram_newton_schulz_is_the_standard_iteration(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    gram = gram_newtonschulz(x, NS, 5, 1e-7, torch.float32)
    standard = zeropower_via_newtonschulz(x, NS, 5, 1e-7, torch.float32)
    assert gram.dtype == torch.float32 and gram.shape == shape
    if shape[0] == shape[1]:  # no smaller Gram matrix: the standard iteration, op for op
        assert torch.equal(gram, standard)
    torch.testing.assert_close(gram, standard, rtol=0, atol=4e-6)
    torch.testing.assert_close(gram.double(), _ns_reference(x, 5), rtol=0, atol=2e-5)
    bf16 = gram_newtonschulz(x, NS, 5, 1e-7, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.double(), _ns_reference(x, 5), rtol=0, atol=5e-2)
    assert torch.equal(x, torch.randn(shape, generator=torch.Generator().manual_seed(4)))  # input untouched


def test_gram_newton_schulz_on_a_stack_is_per_matrix():
    """A 3-D stack (the batched and expert paths) runs bmm/baddbmm; each matrix as alone."""
    x = torch.randn(3, 24, 72, generator=torch.Generator().manual_seed(5))
    stack = gram_newtonschulz(x, NS, 5, 1e-7, torch.float32)
    for i in range(3):
        torch.testing.assert_close(stack[i], gram_newtonschulz(x[i], NS, 5, 1e-7, torch.float32), rtol=0, atol=1e-6)
    torch.testing.assert_close(stack, batched_newtonschulz(x, NS, 5, 1e-7, torch.float32), rtol=0, atol=4e-6)


def test_ns_method_default_is_the_standard_step():
    """Default and explicit ``ns_method="standard"`` are one step, bit for bit (and bitwise torch,
    tests above); ``"gram"`` moves the parameters by round-off only."""
    shapes = [(32, 96), (96, 32), (40, 40)]

    def run(**kw):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        opt = Muon(ps, lr=0.02, ns_dtype=torch.float32, **kw)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return opt, [p.detach() for p in ps]

    opt, default = run()
    assert opt.param_groups[0]["ns_method"] == "standard"
    _, standard = run(ns_method="standard")
    assert all(torch.equal(a, b) for a, b in zip(default, standard))
    _, gram = run(ns_method="gram")
    assert not all(torch.equal(a, b) for a, b in zip(default, gram))  # the wide and tall ones differ
    for a, b in zip(default, gram):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["batched", "capturable", "experts"])
def test_ns_method_gram_in_every_step(mode):
    """Batched (one bmm stack), capturable and expert-stack (3-D) steps with Gram Newton-Schulz
    stay within round-off of the same step with the standard iteration."""
    shape = (4, 24, 72) if mode == "experts" else (24, 72)

    def run(method):
        g = torch.Generator().manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(shape, generator=g)) for _ in range(3)]
        kw = {"experts": 1} if mode == "experts" else {mode: True}
        opt = Muon([{"params": ps, **kw}], lr=0.02, ns_dtype=torch.float32, ns_method=method)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return [p.detach() for p in ps]

    standard, gram = run("standard"), run("gram")
    assert not all(torch.equal(a, b) for a, b in zip(standard, gram))
    for a, b in zip(standard, gram):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_state_dict_without_ns_method_loads():
    """A state dict saved before ``ns_method`` existed (no key in its groups) loads and steps with
    the standard iteration; a new one round-trips the key."""
    p = torch.nn.Parameter(torch.randn(16, 48))
    opt = Muon([p], lr=0.02, ns_method="gram")
    p.grad = torch.randn(16, 48)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["ns_method"] == "gram"
    fresh = Muon([p], lr=0.02, ns_method="gram")
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["ns_method"] == "gram"
    old = {**sd, "param_groups": [{k: v for k, v in g.items() if k != "ns_method"} for g in sd["param_groups"]]}
    fresh = Muon([p], lr=0.02)
    fresh.load_state_dict(old)
    fresh.step()  # reads group.get("ns_method", "standard")
