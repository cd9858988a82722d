"""Shampoo's matrix rule against closed forms and an independent float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from matrixfsdp.optim import Shampoo
from matrixfsdp.optim._linalg import inverse_root


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices gain nothing from intra-op threads, and spinning threads on a busy 2-core box
    make this module ~15x slower; restore the setting for other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _grads(shape, n, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for _ in range(n)]


def _param(shape, dtype=torch.float64, seed=0):
    return torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype))


def _root(a: torch.Tensor, r: int, eps: float) -> torch.Tensor:
    """(a + eps I)^(-1/r) of a PSD matrix by SVD (independent of the eigh path under test)."""
    u, s, _ = torch.linalg.svd(a + eps * torch.eye(a.shape[0], dtype=a.dtype))
    return (u * s.pow(-1.0 / r)) @ u.T


def _reference(w0, grads, *, lr, betas, epsilon, weight_decay, freq, start, graft_beta2, graft_eps, max_dim=10**9):
    """The documented Shampoo variant, written out in float64 with bias-corrected moments."""
    b1, b2 = betas
    w = w0.detach().double().clone()
    m_, n_ = w.shape
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    left = torch.zeros(m_, m_, dtype=w.dtype) if m_ <= max_dim else None
    right = torch.zeros(n_, n_, dtype=w.dtype) if n_ <= max_dim else None
    sides = (left is not None) + (right is not None)
    for t, g in enumerate(grads, 1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = graft_beta2 * v + (1 - graft_beta2) * g * g
        keep, new = (1.0, 1.0) if b2 == 1 else (b2, 1 - b2)
        left = keep * left + new * g @ g.T if left is not None else None
        right = keep * right + new * g.T @ g if right is not None else None
        m_hat = m / (1 - b1**t)
        adam = m_hat / ((v / (1 - graft_beta2**t)).sqrt() + graft_eps)
        w = w * (1 - lr * weight_decay)
        if t < start or sides == 0:
            w = w - lr * adam
            continue
        if (t - start) % freq == 0:
            c = 1.0 if b2 == 1 else 1 - b2**t
            l_root = _root(left / c, 2 * sides, epsilon) if left is not None else torch.eye(m_, dtype=w.dtype)
            r_root = _root(right / c, 2 * sides, epsilon) if right is not None else torch.eye(n_, dtype=w.dtype)
        p = l_root @ m_hat @ r_root
        w = w - lr * p * (adam.norm() / p.norm())
    return w


HP = {
    "lr": 0.01,
    "betas": (0.9, 0.99),
    "epsilon": 1e-6,
    "weight_decay": 0.1,
    "precondition_frequency": 2,
    "start_preconditioning_step": 2,
    "grafting_beta2": 0.995,
    "grafting_eps": 1e-8,
}


def _ref_kwargs(hp):
    return {
        "lr": hp["lr"],
        "betas": hp["betas"],
        "epsilon": hp["epsilon"],
        "weight_decay": hp["weight_decay"],
        "freq": hp["precondition_frequency"],
        "start": hp["start_preconditioning_step"],
        "graft_beta2": hp["grafting_beta2"],
        "graft_eps": hp["grafting_eps"],
        "max_dim": hp.get("max_preconditioner_dim", 10**9),
    }


def _run(p, grads, **hp):
    opt = Shampoo([p], **hp)
    for g in grads:
        p.grad = g.to(p.dtype).clone()
        opt.step()
    return opt


def test_one_step_closed_form():
    """Step 1 from zero statistics: L/c = G G^T, R/c = G^T G, M/(1-b1) = G, Adam direction
    G / (|G| + eps), so W1 = W0 (1 - lr wd) - lr ||G/(|G|+eps)|| P / ||P||,
    P = (G G^T + e I)^(-1/4) G (G^T G + e I)^(-1/4)."""
    shape, lr, wd, e, geps = (24, 40), 0.03, 0.2, 1e-4, 1e-8
    p = _param(shape, torch.float32)
    w0 = p.detach().double().clone()
    (g,) = _grads(shape, 1, dtype=torch.float32)
    _run(p, [g], lr=lr, weight_decay=wd, epsilon=e, grafting_eps=geps, start_preconditioning_step=1)
    gd = g.double()
    pre = _root(gd @ gd.T, 4, e) @ gd @ _root(gd.T @ gd, 4, e)
    graft = (gd / (gd.abs() + geps)).norm()
    expected = w0 * (1 - lr * wd) - lr * graft * pre / pre.norm()
    torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=2e-6)


@pytest.mark.parametrize("shape", [(24, 40), (48, 32)])
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.0, 1.0)], ids=["ema", "sum"])
def test_matches_float64_reference_over_steps(shape, betas):
    hp = {**HP, "betas": betas}
    p = _param(shape)
    w0 = p.detach().clone()
    grads = _grads(shape, 7)
    _run(p, grads, **hp)
    expected = _reference(w0, grads, **_ref_kwargs(hp))
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-10)


def test_float32_close_to_float64_reference():
    shape = (48, 32)
    p = _param(shape, torch.float32)
    w0 = p.detach().clone()
    grads = _grads(shape, 6, dtype=torch.float32)
    _run(p, grads, **HP)
    torch.testing.assert_close(p.detach().double(), _reference(w0, grads, **_ref_kwargs(HP)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rank", [24, 10])
def test_inverse_root(dtype, rank):
    """X = (A + eps I)^(-1/4): X^4 (A + eps I) = I, also for rank-deficient A."""
    g = torch.randn(24, rank, generator=torch.Generator().manual_seed(0), dtype=dtype)
    a, eps = g @ g.T / rank, 1e-2
    x = inverse_root(a, 4, eps)
    eye = torch.eye(24, dtype=dtype)
    tol = 1e-3 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(torch.linalg.matrix_power(x, 4) @ (a + eps * eye), eye, rtol=0, atol=tol)
    torch.testing.assert_close(x, x.T, rtol=0, atol=tol)
    torch.testing.assert_close(inverse_root(a, 2, eps) @ inverse_root(a, 2, eps) @ (a + eps * eye), eye, rtol=0, atol=tol)


def test_inverse_root_clamps_negative_eigenvalues():
    a = torch.diag(torch.tensor([4.0, -1e-3, 0.0], dtype=torch.float64))
    x = inverse_root(a, 4, 1e-4)
    torch.testing.assert_close(torch.diagonal(x), torch.tensor([4.0001, 1e-4, 1e-4], dtype=torch.float64) ** -0.25)


def test_graft_norm_equals_adam_step_norm():
    """Every preconditioned step has exactly the norm of the Adam step of the same moments."""
    shape, lr = (24, 40), 0.01
    p = _param(shape, torch.float32)
    q = torch.nn.Parameter(p.detach().clone())
    opt = Shampoo([p], lr=lr, betas=(0.9, 0.99), grafting_beta2=0.995, start_preconditioning_step=1, precondition_frequency=3)
    adam = torch.optim.Adam([q], lr=lr, betas=(0.9, 0.995), eps=1e-8, foreach=False)
    for g in _grads(shape, 6, dtype=torch.float32):
        before_p, before_q = p.detach().clone(), q.detach().clone()
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        adam.step()
        dp, dq = (p - before_p).norm(), (q - before_q).norm()
        torch.testing.assert_close(dp, dq, rtol=1e-5, atol=0)
        assert not torch.allclose(p - before_p, q - before_q, atol=1e-4)  # but another direction


def test_adamw_before_start_bitwise():
    shape = (48, 32)
    p = _param(shape, torch.float32)
    q = torch.nn.Parameter(p.detach().clone())
    opt = Shampoo([p], lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, grafting_beta2=0.99, grafting_eps=1e-6, start_preconditioning_step=5)
    adamw = torch.optim.AdamW([q], lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, foreach=False)
    grads = _grads(shape, 5, dtype=torch.float32)
    for i, g in enumerate(grads):
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
        assert torch.equal(p, q) == (i < 4), i
    assert "L_inv_root" in opt.state[p]


def test_factor_statistics():
    shape = (24, 40)
    grads = _grads(shape, 3, dtype=torch.float64)
    p = _param(shape)
    opt = _run(p, grads, betas=(0.9, 1.0))  # plain sums
    torch.testing.assert_close(opt.state[p]["L"], sum(g @ g.T for g in grads))
    torch.testing.assert_close(opt.state[p]["R"], sum(g.T @ g for g in grads))
    p = _param(shape)
    opt = _run(p, grads, betas=(0.9, 0.5))
    expected = 0.25 * 0.5 * grads[0] @ grads[0].T + 0.5 * 0.5 * grads[1] @ grads[1].T + 0.5 * grads[2] @ grads[2].T
    torch.testing.assert_close(opt.state[p]["L"], expected)
    assert opt.state[p]["step"].item() == 3.0


def test_roots_recomputed_every_precondition_frequency_steps():
    shape = (24, 40)
    p = _param(shape, torch.float32)
    opt = Shampoo([p], start_preconditioning_step=2, precondition_frequency=3)
    roots = []
    for g in _grads(shape, 8, dtype=torch.float32):
        p.grad = g
        opt.step()
        roots.append(opt.state[p].get("L_inv_root"))
    assert roots[0] is None  # step 1 < start: no root yet
    fresh = [i + 1 for i in range(1, 8) if roots[i] is not roots[i - 1]]
    assert fresh == [2, 5, 8]


def test_one_sided_when_a_side_exceeds_max_dim():
    """A side above max_preconditioner_dim has no factor; the other side uses the -1/2 root."""
    shape = (24, 40)
    hp = {**HP, "max_preconditioner_dim": 30}
    p = _param(shape)
    w0 = p.detach().clone()
    grads = _grads(shape, 5)
    opt = _run(p, grads, **hp)
    assert "L" in opt.state[p] and "R" not in opt.state[p] and "R_inv_root" not in opt.state[p]
    torch.testing.assert_close(p.detach(), _reference(w0, grads, **_ref_kwargs(hp)), rtol=0, atol=1e-10)


def test_no_side_preconditioned_is_adamw_bitwise():
    shape = (24, 40)
    p = _param(shape, torch.float32)
    q = torch.nn.Parameter(p.detach().clone())
    opt = Shampoo([p], lr=0.01, weight_decay=0.1, max_preconditioner_dim=0, start_preconditioning_step=1)
    adamw = torch.optim.AdamW([q], lr=0.01, weight_decay=0.1, foreach=False)
    for g in _grads(shape, 4, dtype=torch.float32):
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        adamw.step()
    assert torch.equal(p, q)
    assert set(opt.state[p]) == {"step", "exp_avg", "grafting_exp_avg_sq"}


def test_zero_gradient_gives_no_nan():
    p = _param((8, 6), torch.float32)
    w0 = p.detach().clone()
    _run(p, [torch.zeros(8, 6)] * 3, start_preconditioning_step=1)
    assert torch.equal(p, w0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"betas": (1.0, 0.9)}, r"betas must be two floats in \[0, 1\) and \[0, 1\], got betas=\(1.0, 0.9\)"),
        ({"betas": (0.9, 1.5)}, r"betas must be two floats in \[0, 1\) and \[0, 1\], got betas=\(0.9, 1.5\)"),
        ({"epsilon": 0.0}, r"epsilon must be > 0, got epsilon=0.0"),
        ({"precondition_frequency": 0}, r"precondition_frequency must be an int >= 1, got precondition_frequency=0"),
        ({"start_preconditioning_step": 0}, r"start_preconditioning_step must be an int >= 1, got start_preconditioning_step=0"),
        ({"max_preconditioner_dim": -1}, r"max_preconditioner_dim must be an int >= 0, got max_preconditioner_dim=-1"),
        ({"grafting_beta2": 1.0}, r"grafting_beta2 must be a float in \[0, 1\), got grafting_beta2=1.0"),
        ({"grafting_eps": -1.0}, r"grafting_eps must be a float >= 0, got grafting_eps=-1.0"),
    ],
)
def test_validation(kwargs, message):
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=rf"^Shampoo: {message}$"):
        Shampoo([p], **kwargs)


def test_beta2_one_accepted():
    Shampoo([torch.nn.Parameter(torch.zeros(4, 4))], betas=(0.9, 1.0))
    assert math.isclose(Shampoo([torch.nn.Parameter(torch.zeros(2, 2))]).defaults["epsilon"], 1e-12)
