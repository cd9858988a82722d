"""Newton-Schulz iterations that orthogonalize a matrix (or a stack of matrices): Muon's core.

Each approximates the polar factor ``U V^T`` of ``x = U S V^T``: the per-matrix iteration (torch's
op sequence, bitwise ``torch.optim.Muon``), the batched one over a stack (``bmm``/``baddbmm``), and
the Gram iteration on the small Gram matrix of a rectangular matrix ([Note: Gram Newton-Schulz]).
:func:`orthogonalize` picks one from a Muon param group's hyperparameters.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

__all__ = [
    "zeropower_via_newtonschulz",
    "batched_newtonschulz",
    "gram_newtonschulz",
    "orthogonalize",
    "GRAM_RESTARTS",
]


def zeropower_via_newtonschulz(
    x: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float, dtype: torch.dtype
) -> Tensor:
    """Approximate ``U V^T`` of ``x = U S V^T`` with ``ns_steps`` quintic Newton-Schulz steps in ``dtype``.

    Returns a new tensor of ``dtype``; ``x`` is never written (``copy=True``: with ``dtype`` equal
    to ``x.dtype`` a plain cast would alias ``x`` -- the momentum buffer when ``nesterov=False`` --
    and the in-place normalization below would corrupt it).
    """
    return _newtonschulz_(x.to(dtype, copy=True), ns_coefficients, ns_steps, eps)


def _newtonschulz_(y: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float) -> Tensor:
    """:func:`zeropower_via_newtonschulz` on ``y``, a 2-D tensor of the iteration's dtype it may
    overwrite (torch's op sequence)."""
    a, b, c = ns_coefficients
    tall = y.size(0) > y.size(1)
    if tall:  # iterate on the smaller Gram matrix
        y = y.T
    y.div_(y.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(ns_steps):
        gram = y @ y.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.addmm(y, gram_update, y, beta=a)
    return y.T if tall else y


def batched_newtonschulz(
    x: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float, dtype: torch.dtype
) -> Tensor:
    """:func:`zeropower_via_newtonschulz` of each matrix of a stack ``x`` (``[k, m, n]``) at once.

    The same op sequence with ``bmm``/``baddbmm`` for ``mm``/``addmm`` and one Frobenius norm per
    matrix: ``3 * ns_steps`` matrix products for the whole stack instead of per matrix. Whether
    the bits equal the per-matrix iteration depends on the backend's batched GEMM (on the CPU
    with MKL they differ by a few ulp for most shapes; see docs/optimizers.md).
    """
    return _batched_newtonschulz_(x.to(dtype, copy=True), ns_coefficients, ns_steps, eps)


def _batched_newtonschulz_(y: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                           eps: float) -> Tensor:
    """:func:`batched_newtonschulz` on ``y``, a stack of the iteration's dtype it may overwrite."""
    a, b, c = ns_coefficients
    tall = y.size(-2) > y.size(-1)
    if tall:
        y = y.mT
    y.div_(torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True).clamp(min=eps))
    for _ in range(ns_steps):
        gram = torch.bmm(y, y.mT)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.baddbmm(y, gram_update, y, beta=a)
    return y.mT if tall else y


#: Iterations before which :func:`gram_newtonschulz` restarts (recomputes ``X`` and its Gram
#: matrix from the accumulated polynomial; [Note: Gram Newton-Schulz]): one restart, before
#: iteration 3 (0-based) of Muon's 5. Measured in bfloat16 on matrices with singular values from 1
#: to 1e-3, relative distance from the standard bf16 iteration with no restart and one before
#: iteration 1, 2, 3, 4: 0.41, 0.29, 0.16, 0.053, 0.066 (512x1536; 256x1280: 0.79, 0.48, 0.19,
#: 0.059, 0.10; benchmarks/results/optim/gram_ns_restarts_cpu.md). On Gaussian matrices every
#: choice landed within 2.2-2.7% of the float64 iteration (standard bf16: 1.2%); in float32 every
#: choice is within 1e-4 of the standard iteration.
GRAM_RESTARTS = (3,)


def gram_newtonschulz(
    x: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float, dtype: torch.dtype,
    restarts: tuple[int, ...] = GRAM_RESTARTS,
) -> Tensor:
    """:func:`zeropower_via_newtonschulz` (``x`` 2-D) or :func:`batched_newtonschulz` (``x`` a
    3-D stack) computed on the small Gram matrix (see [Note: Gram Newton-Schulz]); a square matrix
    takes the standard iteration, op for op. Returns a new tensor of ``dtype``."""
    return _gram_newtonschulz_(x.to(dtype, copy=True), ns_coefficients, ns_steps, eps, restarts)


# [Note: Gram Newton-Schulz]
# Muon's quintic step on X (m x n, m <= n; a tall matrix is transposed) is X <- P(R) X with
# R = X X^T (m x m) and P(R) = a I + b R + c R^2. Every P is a polynomial in the first Gram matrix
# R_0, so after k steps X_k = Q_k X_0 with Q_k = P_{k-1} ... P_0, and the next Gram matrix is
# R_{k+1} = P_k R_k P_k. The Gram iteration runs those m x m recurrences (R^2, Q P, R P, P (R P):
# four m^3 products, two in the last step) and touches X (m x n) only to form R_0 and, at the end,
# Q X_0: 2 m^2 n + O(m^3) instead of the standard (2 m^2 n + m^3) per step. So it pays for wide
# matrices (aspect n/m of 3 and more) and not for square ones, which take the standard
# iteration. It is the same polynomial in exact arithmetic; in floating point R_k drifts from
# Q_k R_0 Q_k (in bfloat16 it can grow negative eigenvalues, which the polynomial amplifies), so it
# restarts at GRAM_RESTARTS: X <- Q X and R <- X X^T, recomputed from the matrix. From the
# published description (Gram Newton-Schulz, Dao AI Lab, as adopted by VeOmni and DeepSpeed);
# our own code and restart choice.
def _gram_newtonschulz_(y: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float,
                        restarts: tuple[int, ...] = GRAM_RESTARTS) -> Tensor:
    """:func:`gram_newtonschulz` on ``y`` (2-D or a stack, of the iteration's dtype), which it may
    overwrite."""
    if y.size(-2) == y.size(-1) or ns_steps == 0:
        if y.ndim == 2:
            return _newtonschulz_(y, ns_coefficients, ns_steps, eps)
        return _batched_newtonschulz_(y, ns_coefficients, ns_steps, eps)
    a, b, c = ns_coefficients
    mm, addmm = (torch.mm, torch.addmm) if y.ndim == 2 else (torch.bmm, torch.baddbmm)
    tall = y.size(-2) > y.size(-1)
    if tall:
        y = y.mT
    norm = y.norm() if y.ndim == 2 else torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True)
    y.div_(norm.clamp(min=eps))  # as the standard iteration
    r = mm(y, y.mT)
    q: Tensor | None = None
    for k in range(ns_steps):
        if q is not None and k in restarts:
            y = mm(q, y)
            r = mm(y, y.mT)
            q = None
        p = addmm(r, r, r, beta=b, alpha=c)  # b R + c R^2
        p.diagonal(dim1=-2, dim2=-1).add_(a)  # + a I
        q = p if q is None else mm(q, p)
        if k + 1 < ns_steps and k + 1 not in restarts:
            r = mm(p, mm(r, p))
    y = mm(cast(Tensor, q), y)  # (set: ns_steps > 0)
    return y.mT if tall else y


def orthogonalize(x: Tensor, group: dict[str, Any]) -> Tensor:
    """Muon's Newton-Schulz of ``x`` (a matrix, or a stack of same-shape matrices) with ``group``'s
    hyperparameters; a new tensor of ``group["ns_dtype"]``, ``x`` untouched."""
    return _orthogonalize_(x.to(group["ns_dtype"], copy=True), group)


def _orthogonalize_(y: Tensor, group: dict[str, Any]) -> Tensor:
    """:func:`orthogonalize` of ``y``, already of the iteration's dtype, which it may overwrite."""
    args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    if group.get("ns_method", "standard") == "gram":  # absent in groups saved before it existed
        return _gram_newtonschulz_(y, *args)
    return _newtonschulz_(y, *args) if y.ndim == 2 else _batched_newtonschulz_(y, *args)
