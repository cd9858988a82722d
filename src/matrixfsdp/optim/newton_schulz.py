"""Newton-Schulz iterations that orthogonalize a matrix (or a stack of matrices): Muon's core.

Each approximates the polar factor ``U V^T`` of ``x = U S V^T``: the per-matrix iteration (torch's
op sequence, bitwise ``torch.optim.Muon``), the batched one over a stack (``bmm``/``baddbmm``), and
the Gram iteration on the small Gram matrix of a rectangular matrix ([Note: Gram Newton-Schulz]).
Each runs a schedule ([Note: Newton-Schulz schedules]): Muon's one quintic, Polar Express, cubic5
or an explicit per-iteration list. :func:`orthogonalize` picks one from a Muon param group's
hyperparameters.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Sequence, Union, cast

import torch
from torch import Tensor

__all__ = [
    "zeropower_via_newtonschulz",
    "batched_newtonschulz",
    "gram_newtonschulz",
    "orthogonalize",
    "resolve_schedule",
    "schedule_error",
    "Schedule",
    "SCHEDULE_NAMES",
    "QUINTIC",
    "POLAR_EXPRESS",
    "POLAR_EXPRESS_SAFETY",
    "POLAR_EXPRESS_LIMIT",
    "CUBIC5",
    "GRAM_RESTARTS",
]

Coefficients = tuple[float, float, float]
#: What ``ns_coefficients`` takes: three floats, a schedule name, or one triple per iteration.
NSCoefficients = Union[Coefficients, str, Sequence[Coefficients]]

# [Note: Newton-Schulz schedules]
# A schedule is one (a, b, c) per iteration plus the scale of the first normalization:
# X <- X / (s ||X||_F), then per iteration, with A = X X^T (X wide; a tall matrix is transposed),
# X <- a X + b A X + c A^2 X. c == 0 is a cubic iteration, X <- a X + b A X, run with two
# matrix products instead of three (addmm(X, A, X, beta=a, alpha=b)). ns_coefficients names it:
#   * (a, b, c), three floats: that quintic at every one of the ns_steps iterations (torch's
#     form; "quintic" is Muon's (3.4445, -4.775, 2.0315), op for op the iteration before
#     schedules existed, hence bitwise torch.optim.Muon). s = 1.
#   * "polar_express": the published 5-step list (POLAR_EXPRESS), s = 1.02. ns_steps < 5 runs its
#     first ns_steps (the construction is greedy: each polynomial depends only on the interval the
#     previous ones leave); ns_steps > 5 continues with POLAR_EXPRESS_LIMIT, the polynomial the
#     construction reaches as the interval shrinks to 1 (singular values converge to 1; repeating
#     the 5th tuple instead would settle them near 1.035, where that quintic has its fixed point).
#   * "cubic5": the published 5-step cubic list (CUBIC5), s = 1; only ns_steps = 5 (it is
#     designed as one 5-step map onto a band, not as a prefix of a longer one).
#   * a list/tuple of (a, b, c) triples: one per iteration, as many as ns_steps (a mismatch is an
#     error, not a truncation: the list fixes the count), s = 1.
# Param groups and state dicts carry the value as given (a string, a tuple or list of tuples);
# it is resolved by resolve_schedule at each call, which costs a few Python operations.


class Schedule(NamedTuple):
    """A resolved Newton-Schulz schedule ([Note: Newton-Schulz schedules])."""

    coefficients: tuple[Coefficients, ...]  # one (a, b, c) per iteration; c == 0: a cubic one
    norm_scale: float = 1.0  # the input is divided by norm_scale * its Frobenius norm

    @property
    def products(self) -> int:
        """Matrix products of the standard iteration: 3 per quintic, 2 per cubic iteration."""
        return sum(2 if c == 0 else 3 for _, _, c in self.coefficients)


#: Muon's quintic (Keller Jordan), torch.optim.Muon's default ``ns_coefficients``.
QUINTIC: Coefficients = (3.4445, -4.775, 2.0315)

# Polar Express: Amsel, Persson, Musco, Gower, "The Polar Express: Optimal Matrix Sign Methods and
# Their Application to the Muon Algorithm" (2025), arXiv:2505.16932, Algorithm 1. Each quintic is
# the minimax (Remez) approximation of 1 on the interval [l, u] the previous ones leave, from
# l = 1e-3, u = 1, with the interval floored at 0.02 u and the result recentred ("cushion"), and
# all but the last divided by a safety factor (a / 1.02, b / 1.02^3, c / 1.02^5). These are the
# values for 5 iterations with safety 1.02 as published in KellerJordan/modded-nanogpt
# (train_gpt.py, "num_iters=5, safety_factor=2e-2"), karpathy/nanochat and microsoft/dion
# (benchmark/polar_express.py); tests/optim/test_ns_schedules.py regenerates them from the
# construction (our own Remez code) to 1e-12. As published, the input is divided by 1.02 times
# its Frobenius norm (the paper's reference code pairs its 10-step, 1.01 list with 1.01); we floor
# that denominator at eps where the published code adds eps (no difference above eps).
POLAR_EXPRESS: tuple[Coefficients, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02
#: The Polar Express construction on an interval shrunk to [1, 1]: (15/8, -10/8, 3/8), the
#: classical quintic Newton-Schulz step (p(1) = 1, p'(1) = p''(1) = 0); the paper's reference code
#: returns it there, and its 10-step list ends with it.
POLAR_EXPRESS_LIMIT: Coefficients = (15 / 8, -10 / 8, 3 / 8)

# cubic5: Hua Huang (NVIDIA), "How Much Orthogonalization Does Muon Need?" (2026),
# arXiv:2606.00371: a relaxed cubic schedule (X <- a X + b X X^T X) for Muon's bf16 band, from an
# effective lower bound l0 = 7e-3; 10 matrix products in 5 steps against the quintic's 15, with
# validation loss within about 1e-3 of Muon's quintic at 1-4B parameters (the paper's report).
# Values as published with the paper in NVIDIA-NeMo/Emerging-Optimizers (PR #217, muon_utils.py,
# "cubic5"; rounded to float32 there), input normalized by its Frobenius norm alone. It maps
# singular values in [7e-3, 1] (relative to the norm) into [0.774, 1.300], not towards 1.
CUBIC5: tuple[Coefficients, ...] = (
    (3.3656576, -3.3420992, 0.0),
    (2.5744352, -1.4957376, 0.0),
    (2.5368962, -1.4312570, 0.0),
    (2.4418906, -1.2764040, 0.0),
    (2.2230472, -0.9630650, 0.0),
)

#: The names ``ns_coefficients`` takes.
SCHEDULE_NAMES = ("quintic", "polar_express", "cubic5")


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_triple(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and len(v) == 3 and all(map(_is_real, v))


def schedule_error(ns_coefficients: Any, ns_steps: Any) -> str | None:
    """Why ``ns_coefficients`` with ``ns_steps`` is no schedule, or ``None`` when it is one
    ([Note: Newton-Schulz schedules]). The message names both values, for an optimizer's own
    error (Muon's hyperparameter check); :func:`resolve_schedule` raises it."""
    if not isinstance(ns_steps, int) or isinstance(ns_steps, bool) or ns_steps < 0:
        return f"ns_steps must be an int >= 0, got ns_steps={ns_steps!r}"
    v = ns_coefficients
    if isinstance(v, str):
        if v not in SCHEDULE_NAMES:
            return f"ns_coefficients must be one of the schedules {SCHEDULE_NAMES}, got ns_coefficients={v!r}"
        if v == "cubic5" and ns_steps != len(CUBIC5):
            return (f"ns_coefficients='cubic5' is a fixed {len(CUBIC5)}-step schedule, got ns_steps={ns_steps}; "
                    f"set ns_steps={len(CUBIC5)}, or pass a list of (a, b, 0.0) triples, one per iteration")
        return None
    if not isinstance(v, (tuple, list)) or not v:
        return (f"ns_coefficients must be three floats (a, b, c), one of {SCHEDULE_NAMES} or a list of "
                f"(a, b, c) triples, one per iteration, got ns_coefficients={v!r}")
    if all(map(_is_real, v)):  # the bare form: one polynomial for every iteration
        if len(v) != 3:
            return f"ns_coefficients must be three floats, got ns_coefficients={v!r}"
        if not all(map(math.isfinite, v)):
            return f"ns_coefficients must be finite, got ns_coefficients={v!r}"
        return None
    bad = next((i for i, t in enumerate(v) if not _is_triple(t)), None)
    if bad is not None:
        return (f"ns_coefficients as a per-iteration list must hold (a, b, c) triples of floats, but entry "
                f"{bad} is {v[bad]!r}, in ns_coefficients={v!r}")
    if not all(math.isfinite(x) for t in v for x in t):
        return f"ns_coefficients must be finite, got ns_coefficients={v!r}"
    if len(v) != ns_steps:
        return (f"ns_coefficients lists {len(v)} iterations, but ns_steps={ns_steps}: a per-iteration list "
                f"fixes the number of iterations; set ns_steps={len(v)}")
    return None


def resolve_schedule(ns_coefficients: NSCoefficients, ns_steps: int) -> Schedule:
    """The :class:`Schedule` that ``ns_coefficients`` names for ``ns_steps`` iterations
    ([Note: Newton-Schulz schedules]); ``ValueError`` if it names none."""
    err = schedule_error(ns_coefficients, ns_steps)
    if err is not None:
        raise ValueError(f"resolve_schedule: {err}")
    v = ns_coefficients
    if v == "quintic":
        return Schedule((QUINTIC,) * ns_steps)
    if v == "polar_express":
        extra = max(0, ns_steps - len(POLAR_EXPRESS))
        return Schedule(POLAR_EXPRESS[:ns_steps] + (POLAR_EXPRESS_LIMIT,) * extra, POLAR_EXPRESS_SAFETY)
    if v == "cubic5":
        return Schedule(CUBIC5)
    if all(map(_is_real, cast(Sequence[Any], v))):  # the values as given: the same bits as before schedules
        a, b, c = cast(Coefficients, v)
        return Schedule(((a, b, c),) * ns_steps)
    return Schedule(tuple((a, b, c) for a, b, c in cast(Sequence[Coefficients], v)))


def _normalize_(y: Tensor, norm_scale: float, eps: float) -> Tensor:
    """``y / (norm_scale * ||y||_F)`` in place, the denominator floored at ``eps`` (per matrix of a
    stack): spectral norm <= Frobenius norm <= 1."""
    norm = y.norm() if y.ndim == 2 else torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True)
    if norm_scale != 1.0:  # (1.0: torch's op sequence)
        norm = norm * norm_scale
    return y.div_(norm.clamp(min=eps))


def zeropower_via_newtonschulz(
    x: Tensor, ns_coefficients: NSCoefficients, ns_steps: int, eps: float, dtype: torch.dtype
) -> Tensor:
    """Approximate ``U V^T`` of ``x = U S V^T`` with the Newton-Schulz schedule ``ns_coefficients``
    over ``ns_steps`` iterations ([Note: Newton-Schulz schedules]) in ``dtype``.

    Returns a new tensor of ``dtype``; ``x`` is never written (``copy=True``: with ``dtype`` equal
    to ``x.dtype`` a plain cast would alias ``x`` -- the momentum buffer when ``nesterov=False`` --
    and the in-place normalization below would corrupt it).
    """
    return _newtonschulz_(x.to(dtype, copy=True), ns_coefficients, ns_steps, eps)


def _newtonschulz_(y: Tensor, ns_coefficients: NSCoefficients, ns_steps: int, eps: float) -> Tensor:
    """:func:`zeropower_via_newtonschulz` on ``y``, a 2-D tensor of the iteration's dtype it may
    overwrite (torch's op sequence)."""
    return _standard_(y, resolve_schedule(ns_coefficients, ns_steps), eps)


def _standard_(y: Tensor, schedule: Schedule, eps: float) -> Tensor:
    """The standard iteration of ``schedule`` on ``y`` (2-D: ``mm``/``addmm``; a stack:
    ``bmm``/``baddbmm``, one norm per matrix), which it may overwrite."""
    mm, addmm = (torch.mm, torch.addmm) if y.ndim == 2 else (torch.bmm, torch.baddbmm)
    tall = y.size(-2) > y.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        y = y.mT
    _normalize_(y, schedule.norm_scale, eps)
    for a, b, c in schedule.coefficients:
        gram = mm(y, y.mT)
        if c == 0:  # cubic: a y + b (y y^T) y, two products
            y = addmm(y, gram, y, beta=a, alpha=b)
            continue
        gram_update = addmm(gram, gram, gram, beta=b, alpha=c)
        y = addmm(y, gram_update, y, beta=a)
    return y.mT if tall else y


def batched_newtonschulz(
    x: Tensor, ns_coefficients: NSCoefficients, ns_steps: int, eps: float, dtype: torch.dtype
) -> Tensor:
    """:func:`zeropower_via_newtonschulz` of each matrix of a stack ``x`` (``[k, m, n]``) at once.

    The same op sequence with ``bmm``/``baddbmm`` for ``mm``/``addmm`` and one Frobenius norm per
    matrix: one product per iteration fewer for cubic iterations, three for quintic ones, for the
    whole stack instead of per matrix. Whether the bits equal the per-matrix iteration depends on
    the backend's batched GEMM (on the CPU with MKL they differ by a few ulp for most shapes; see
    docs/optimizers.md).
    """
    return _batched_newtonschulz_(x.to(dtype, copy=True), ns_coefficients, ns_steps, eps)


def _batched_newtonschulz_(y: Tensor, ns_coefficients: NSCoefficients, ns_steps: int, eps: float) -> Tensor:
    """:func:`batched_newtonschulz` on ``y``, a stack of the iteration's dtype it may overwrite."""
    return _standard_(y, resolve_schedule(ns_coefficients, ns_steps), eps)


#: Iterations before which :func:`gram_newtonschulz` restarts (recomputes ``X`` and its Gram
#: matrix from the accumulated polynomial; [Note: Gram Newton-Schulz]): one restart, before
#: iteration 3 (0-based) of Muon's 5. Measured in bfloat16 on matrices with singular values from 1
#: to 1e-3, relative distance from the standard bf16 iteration with no restart and one before
#: iteration 1, 2, 3, 4: 0.41, 0.29, 0.16, 0.053, 0.066 (512x1536; 256x1280: 0.79, 0.48, 0.19,
#: 0.059, 0.10; benchmarks/results/optim/gram_ns_restarts_cpu.md). On Gaussian matrices every
#: choice landed within 2.2-2.7% of the float64 iteration (standard bf16: 1.2%); in float32 every
#: choice is within 1e-4 of the standard iteration. (Chosen with Muon's quintic; every schedule
#: uses it.)
GRAM_RESTARTS = (3,)


def gram_newtonschulz(
    x: Tensor, ns_coefficients: NSCoefficients, ns_steps: int, eps: float, dtype: torch.dtype,
    restarts: tuple[int, ...] = GRAM_RESTARTS,
) -> Tensor:
    """:func:`zeropower_via_newtonschulz` (``x`` 2-D) or :func:`batched_newtonschulz` (``x`` a
    3-D stack) computed on the small Gram matrix (see [Note: Gram Newton-Schulz]); a square matrix
    takes the standard iteration, op for op. Returns a new tensor of ``dtype``."""
    return _gram_newtonschulz_(x.to(dtype, copy=True), ns_coefficients, ns_steps, eps, restarts)


# [Note: Gram Newton-Schulz]
# A Newton-Schulz step on X (m x n, m <= n; a tall matrix is transposed) is X <- P_k(R) X with
# R = X X^T (m x m) and P_k(R) = a_k I + b_k R + c_k R^2, the coefficients of iteration k
# ([Note: Newton-Schulz schedules]; c_k = 0 for a cubic one). Every P_k is a polynomial in the
# first Gram matrix R_0 -- whatever the coefficients of each iteration -- so after k steps
# X_k = Q_k X_0 with Q_k = P_{k-1} ... P_0 (all polynomials in R_0: they commute and are
# symmetric), and the next Gram matrix is R_{k+1} = P_k R_k P_k. The Gram iteration runs those
# m x m recurrences (R^2 -- none for a cubic step --, Q P, R P, P (R P): up to four m^3 products,
# two in the last step) and touches X (m x n) only to form R_0 and, at the end, Q X_0:
# 2 m^2 n + O(m^3) instead of the standard (2 m^2 n + m^3) per quintic step. So it pays for wide
# matrices (aspect n/m of 3 and more) and not for square ones, which take the standard
# iteration. It is the same polynomial in exact arithmetic; in floating point R_k drifts from
# Q_k R_0 Q_k (in bfloat16 it can grow negative eigenvalues, which the polynomial amplifies), so it
# restarts at GRAM_RESTARTS: X <- Q X and R <- X X^T, recomputed from the matrix. From the
# published description (Gram Newton-Schulz, Dao AI Lab, as adopted by VeOmni and DeepSpeed);
# our own code and restart choice.
def _gram_newtonschulz_(y: Tensor, ns_coefficients: NSCoefficients, ns_steps: int, eps: float,
                        restarts: tuple[int, ...] = GRAM_RESTARTS) -> Tensor:
    """:func:`gram_newtonschulz` on ``y`` (2-D or a stack, of the iteration's dtype), which it may
    overwrite."""
    return _gram_(y, resolve_schedule(ns_coefficients, ns_steps), eps, restarts)


def _gram_(y: Tensor, schedule: Schedule, eps: float, restarts: tuple[int, ...] = GRAM_RESTARTS) -> Tensor:
    """The Gram iteration of ``schedule`` on ``y``, which it may overwrite."""
    steps = schedule.coefficients
    if y.size(-2) == y.size(-1) or not steps:
        return _standard_(y, schedule, eps)
    mm, addmm = (torch.mm, torch.addmm) if y.ndim == 2 else (torch.bmm, torch.baddbmm)
    tall = y.size(-2) > y.size(-1)
    if tall:
        y = y.mT
    _normalize_(y, schedule.norm_scale, eps)  # as the standard iteration
    r = mm(y, y.mT)
    q: Tensor | None = None
    for k, (a, b, c) in enumerate(steps):
        if q is not None and k in restarts:
            y = mm(q, y)
            r = mm(y, y.mT)
            q = None
        p = r * b if c == 0 else addmm(r, r, r, beta=b, alpha=c)  # b R (+ c R^2)
        p.diagonal(dim1=-2, dim2=-1).add_(a)  # + a I
        q = p if q is None else mm(q, p)
        if k + 1 < len(steps) and k + 1 not in restarts:
            r = mm(p, mm(r, p))
    y = mm(cast(Tensor, q), y)  # (set: steps is not empty)
    return y.mT if tall else y


def orthogonalize(x: Tensor, group: dict[str, Any]) -> Tensor:
    """Muon's Newton-Schulz of ``x`` (a matrix, or a stack of same-shape matrices) with ``group``'s
    hyperparameters; a new tensor of ``group["ns_dtype"]``, ``x`` untouched."""
    return _orthogonalize_(x.to(group["ns_dtype"], copy=True), group)


def _orthogonalize_(y: Tensor, group: dict[str, Any]) -> Tensor:
    """:func:`orthogonalize` of ``y``, already of the iteration's dtype, which it may overwrite."""
    schedule = resolve_schedule(group["ns_coefficients"], group["ns_steps"])
    if group.get("ns_method", "standard") == "gram":  # absent in groups saved before it existed
        return _gram_(y, schedule, group["eps"])
    return _standard_(y, schedule, group["eps"])
