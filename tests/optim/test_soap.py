"""SOAP's matrix rule: Adam in Shampoo's eigenbasis, against AdamW and a reference transcription."""

from __future__ import annotations

import pytest
import torch

from matrixfsdp.optim import SOAP


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices gain nothing from intra-op threads, and spinning threads on a busy 2-core box
    make this module ~15x slower; restore the setting for other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _grads(shape, n, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(n)]


def _param(shape, dtype=torch.float32, seed=0):
    return torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype))


def _run(opt, p, grads):
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return opt


def _pin_identity_basis(opt):
    opt._initial_eigenbasis = lambda f: torch.eye(f.shape[0], dtype=f.dtype)
    opt._refreshed_eigenbasis = lambda f, q: (torch.eye(f.shape[0], dtype=f.dtype), torch.arange(f.shape[0]))


def _reference(w0, grads, *, lr, betas, shampoo_beta, eps, weight_decay, freq):
    """A transcription of the reference soap.py's 2D path (github.com/nikhilvyas/SOAP), in float64,
    with the two documented deviations (torch's eps placement; weight decay before the update).
    Like the reference, it projects exp_avg back and forth on every step."""
    b1, b2 = betas
    w = w0.detach().double().clone()
    gg = [torch.zeros(w.shape[0], w.shape[0], dtype=w.dtype), torch.zeros(w.shape[1], w.shape[1], dtype=w.dtype)]
    q = None
    exp_avg, exp_avg_sq = torch.zeros_like(w), torch.zeros_like(w)
    step = 0

    def project(x):
        for mat in q:
            x = torch.tensordot(x, mat, dims=[[0], [0]])
        return x

    def project_back(x):
        for mat in q:
            x = torch.tensordot(x, mat, dims=[[0], [1]])
        return x

    def update_preconditioner(g):
        nonlocal q, exp_avg, exp_avg_sq
        if q is not None:
            exp_avg = project_back(exp_avg)
        gg[0].lerp_(torch.tensordot(g, g, dims=[[1], [1]]), 1 - shampoo_beta)
        gg[1].lerp_(torch.tensordot(g, g, dims=[[0], [0]]), 1 - shampoo_beta)
        if q is None:
            q = [torch.flip(torch.linalg.eigh(m)[1], [1]) for m in gg]
        if step > 0 and step % freq == 0:
            new_q = []
            for ind, (m, o) in enumerate(zip(gg, q)):
                est_eig = torch.diag(o.T @ m @ o)
                sort_idx = torch.argsort(est_eig, descending=True)
                exp_avg_sq = exp_avg_sq.index_select(ind, sort_idx)
                new_q.append(torch.linalg.qr(m @ o[:, sort_idx])[0])
            q = new_q
        if step > 0:
            exp_avg = project(exp_avg)

    for g in grads:
        g = g.double()
        if q is None:
            update_preconditioner(g)
            continue
        grad_projected = project(g)
        step += 1
        exp_avg.mul_(b1).add_(grad_projected, alpha=1 - b1)
        exp_avg_sq.mul_(b2).add_(grad_projected.square(), alpha=1 - b2)
        denom = (exp_avg_sq / (1 - b2**step)).sqrt() + eps
        w = w * (1 - lr * weight_decay)
        w = w - lr / (1 - b1**step) * project_back(exp_avg / denom)
        update_preconditioner(g)
    return w


HP = {"lr": 0.01, "betas": (0.9, 0.95), "shampoo_beta": 0.9, "eps": 1e-8, "weight_decay": 0.1}


@pytest.mark.parametrize("shape", [(24, 40), (48, 32)])
def test_matches_reference_transcription(shape):
    p = _param(shape, torch.float64)
    w0 = p.detach().clone()
    grads = _grads(shape, 8, dtype=torch.float64)
    _run(SOAP([p], precondition_frequency=3, **HP), p, grads)
    expected = _reference(w0, grads, freq=3, **HP)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-10)


def test_float32_close_to_reference():
    # Square: for a rectangular G one factor is rank-deficient at first, its null-space basis is
    # arbitrary (float32 and float64 eigh pick different ones) and Adam is not rotation invariant.
    shape = (32, 32)
    p = _param(shape)
    w0 = p.detach().clone()
    grads = _grads(shape, 6)
    _run(SOAP([p], precondition_frequency=2, **HP), p, grads)
    torch.testing.assert_close(p.detach().double(), _reference(w0, grads, freq=2, **HP), rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(24, 40), (48, 32)])
def test_identity_eigenbasis_is_adamw_bitwise(shape):
    """With QL = QR = I, SOAP from its second call on is AdamW, bitwise, across basis refreshes."""
    p = _param(shape)
    q = torch.nn.Parameter(p.detach().clone())
    opt = SOAP([p], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, precondition_frequency=2)
    _pin_identity_basis(opt)
    adamw = torch.optim.AdamW([q], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    grads = _grads(shape, 7)
    _run(opt, p, grads[:1])
    for g in grads[1:]:
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
        assert torch.equal(p, q)
    assert torch.equal(opt.state[p]["exp_avg_sq"], adamw.state[q]["exp_avg_sq"])


def test_generic_gradients_rotate():
    shape = (24, 40)
    p = _param(shape)
    q = torch.nn.Parameter(p.detach().clone())
    opt = SOAP([p], lr=0.01, weight_decay=0.0)
    adamw = torch.optim.AdamW([q], lr=0.01, betas=(0.95, 0.95), weight_decay=0.0, foreach=False)
    grads = _grads(shape, 3)
    _run(opt, p, grads[:1])
    for g in grads[1:]:
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
    assert not torch.allclose(p, q, atol=1e-3)


def test_first_call_only_gathers_statistics():
    shape = (24, 40)
    p = _param(shape)
    w0 = p.detach().clone()
    (g,) = _grads(shape, 1)
    opt = _run(SOAP([p], betas=(0.9, 0.8), weight_decay=0.5), p, [g])
    assert torch.equal(p, w0)  # not even weight decay
    state = opt.state[p]
    assert state["step"].item() == 0
    torch.testing.assert_close(state["L"], 0.2 * g @ g.T)  # shampoo_beta defaults to betas[1]
    torch.testing.assert_close(state["R"], 0.2 * g.T @ g)
    for key, factor in (("QL", state["L"]), ("QR", state["R"])):
        basis = state[key]
        eye = torch.eye(basis.shape[0])
        torch.testing.assert_close(basis.T @ basis, eye, rtol=0, atol=1e-5)
        rayleigh = torch.diagonal(basis.T @ factor @ basis)
        assert torch.all(rayleigh[:-1] >= rayleigh[1:] - 1e-4)  # descending
        torch.testing.assert_close(rayleigh, torch.linalg.eigvalsh(factor).flip(0), rtol=1e-4, atol=1e-4)


def test_eigenbasis_refresh_schedule_and_orthonormality():
    shape = (48, 32)
    p = _param(shape)
    opt = SOAP([p], precondition_frequency=3)
    bases = []
    for g in _grads(shape, 8):
        p.grad = g
        opt.step()
        bases.append(opt.state[p]["QL"])
    # Calls 2..8 are Adam steps 1..7; refreshes after Adam steps 3 and 6 (calls 4 and 7).
    changed = [i + 1 for i in range(1, 8) if bases[i] is not bases[i - 1]]
    assert changed == [4, 7]
    torch.testing.assert_close(bases[-1].T @ bases[-1], torch.eye(48), rtol=0, atol=1e-5)


def test_side_above_max_dim_is_identity():
    shape = (24, 40)
    p = _param(shape)
    opt = _run(SOAP([p], max_preconditioner_dim=30, precondition_frequency=2), p, _grads(shape, 5))
    assert {"L", "QL"} <= set(opt.state[p]) and not {"R", "QR"} & set(opt.state[p])


def test_no_side_preconditioned_is_adamw_bitwise():
    shape = (24, 40)
    p = _param(shape)
    q = torch.nn.Parameter(p.detach().clone())
    opt = SOAP([p], lr=0.01, weight_decay=0.1, max_preconditioner_dim=0, precondition_frequency=1)
    adamw = torch.optim.AdamW([q], lr=0.01, betas=(0.95, 0.95), weight_decay=0.1, foreach=False)
    grads = _grads(shape, 5)
    _run(opt, p, grads[:1])
    for g in grads[1:]:
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
    assert torch.equal(p, q)
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"betas": (0.9, 1.0)}, r"betas must be two floats in \[0, 1\), got betas=\(0.9, 1.0\)"),
        ({"shampoo_beta": 1.0}, r"shampoo_beta must be a float in \[0, 1\), got shampoo_beta=1.0"),
        ({"eps": -1.0}, r"eps must be a float >= 0, got eps=-1.0"),
        ({"precondition_frequency": 0}, r"precondition_frequency must be an int >= 1, got precondition_frequency=0"),
        ({"max_preconditioner_dim": 1.5}, r"max_preconditioner_dim must be an int >= 0, got max_preconditioner_dim=1.5"),
    ],
)
def test_validation(kwargs, message):
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=rf"^SOAP: {message}$"):
        SOAP([p], **kwargs)
