"""Shampoo with Adam grafting for whole 2D matrices (the Distributed-Shampoo-style default variant).

See :class:`Shampoo` for the exact update; the rule is ``rules/shampoo.py``. All matrix statistics
live in :func:`~matrixfsdp.optim.rules.base.wide_dtype` (float32 for bf16/fp16/fp32 parameters,
float64 for float64 ones); inverse roots use ``torch.linalg.eigh`` in that dtype (float64 retry on
failure).
"""

from __future__ import annotations

from typing import Any

from ._base import ADAMW_DEFAULTS, MatrixOptimizer
from .rules.shampoo import ShampooRule

__all__ = ["Shampoo"]

_D = ShampooRule.defaults


class Shampoo(MatrixOptimizer):
    r"""Shampoo (two-sided, Adam-grafted) for 2D matrices, AdamW for everything else.

    Matrix rule, for a parameter :math:`W` (m x n) with gradient :math:`G`, at step
    :math:`t = 1, 2, \dots` (all statistics start at zero; ``b1, b2 = betas``)::

        M  <- b1 * M + (1 - b1) * G                           first moment (state "exp_avg")
        V  <- bg * V + (1 - bg) * G**2                        grafting 2nd moment, bg = grafting_beta2
        L  <- b2 * L + (1 - b2) * G G^T                       if m <= max_preconditioner_dim
        R  <- b2 * R + (1 - b2) * G^T G                       if n <= max_preconditioner_dim
              (b2 == 1: L <- L + G G^T, a plain sum as in the original Shampoo)
        A  =  M / (sqrt(V / (1 - bg**t)) + grafting_eps)      Adam's direction (unscaled by 1 - b1**t)
        W  <- W * (1 - lr * weight_decay)                     decoupled weight decay
        if t < start_preconditioning_step (or no side has a factor):
            W <- W - lr / (1 - b1**t) * A                     exactly AdamW(betas=(b1, bg))
        else:
            every precondition_frequency steps from start_preconditioning_step:
                L_root = (L / c + epsilon I)^(-1/r),  R_root = (R / c + epsilon I)^(-1/r)
                with c = 1 - b2**t (1 if b2 == 1), eigenvalues of L / c clamped at 0 before adding
                epsilon, r = 4 when both sides have a factor and r = 2 when only one has
            P  =  L_root M R_root                              (a missing side is the identity)
            W  <- W - lr / (1 - b1**t) * (||A||_F / ||P||_F) * P

    So the first moment is filtered *before* preconditioning (as Distributed Shampoo's ``betas[0]``
    and Adam do; there is no second, heavy-ball momentum stage), and every preconditioned step
    has exactly the Frobenius norm of the AdamW step of the same moments (layer-wise grafting).
    Inverse roots are recomputed at steps ``start, start + f, start + 2f, ...`` and reused in
    between. A side longer than ``max_preconditioner_dim`` gets no factor (no memory, no
    ``eigh``); with both sides skipped the rule is AdamW.

    Defaults follow the Distributed Shampoo README's AdamW-like setup (``epsilon=1e-12``,
    Adam grafting ``beta2=0.999, eps=1e-8``) with a shorter ``precondition_frequency``.

    Routing and the AdamW rule for non-matrix parameters are as in :class:`~matrixfsdp.optim.Muon`
    (``algorithm`` = ``"auto"`` / ``"shampoo"`` / ``"adamw"`` per group).

    Args:
        params: parameters or param groups; a group may set any argument below plus ``algorithm``.
        lr: learning rate (default 1e-3).
        betas: ``(b1, b2)``: first-moment decay and factor decay in ``[0, 1]`` (default
            ``(0.9, 0.999)``; ``b2=1`` sums the factors).
        epsilon: added to the eigenvalues of the bias-corrected factors (default 1e-12).
        weight_decay: decoupled weight decay ``W *= 1 - lr * weight_decay`` (default 0.0).
        precondition_frequency: steps between inverse-root recomputations (default 10).
        start_preconditioning_step: first preconditioned step; before it the rule is AdamW, which
            lets the factors gather statistics first (default 10).
        max_preconditioner_dim: sides longer than this get no factor (default 8192).
        grafting_beta2: decay of the Adam grafting second moment (default 0.999).
        grafting_eps: Adam grafting epsilon (default 1e-8).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW rule; ``adamw_lr=None``
            and ``adamw_weight_decay=None`` (defaults) mean the group's ``lr`` / ``weight_decay``;
            betas ``(0.9, 0.999)``, eps ``1e-8``.
        capturable: a step without host reads (``lr`` may be a 0-dim tensor, step counters on
            the parameter's device; root recomputations follow a host-side step count), for
            ``torch.compile`` and CUDA graphs between recomputations (default False); keep a tensor
            ``lr`` on the parameters' device (see :class:`~matrixfsdp.optim.Muon`).
        batched: step the element-wise parameters with one foreach AdamW (default False).
        allow_tf32: let the float32 factor GEMMs (``G G^T``, ``G^T G``, ``L_root M R_root``) of
            CUDA parameters use TF32 tensor cores, about 8x the fp32 GEMM rate on an A100/H100,
            at a 10-bit mantissa per product; ``eigh`` stays float32. No effect on the CPU
            (default False).

    State (per matrix, wide dtype): ``step`` (0-dim float32 CPU tensor), ``exp_avg``,
    ``grafting_exp_avg_sq``, ``L``/``R`` and, once computed, ``L_inv_root``/``R_inv_root``.

    Example::

        >>> from matrixfsdp.optim import Shampoo
        >>> model = torch.nn.Linear(32, 16)
        >>> opt = Shampoo(model.parameters(), lr=1e-3, precondition_frequency=20)
        >>> model(torch.randn(4, 32)).sum().backward()
        >>> opt.step()  # weight: Shampoo, bias: AdamW
        >>> opt = Shampoo(model.parameters(), lr=torch.tensor(1e-3), capturable=True)  # compilable
    """

    rule = "shampoo"
    rule_class = ShampooRule

    def __init__(
        self,
        params: Any,
        lr: float = _D["lr"],
        betas: tuple[float, float] = _D["betas"],
        epsilon: float = _D["epsilon"],
        weight_decay: float = _D["weight_decay"],
        precondition_frequency: int = _D["precondition_frequency"],
        start_preconditioning_step: int = _D["start_preconditioning_step"],
        max_preconditioner_dim: int = _D["max_preconditioner_dim"],
        grafting_beta2: float = _D["grafting_beta2"],
        grafting_eps: float = _D["grafting_eps"],
        *,
        adamw_lr: float | None = ADAMW_DEFAULTS["adamw_lr"],
        adamw_betas: tuple[float, float] = ADAMW_DEFAULTS["adamw_betas"],
        adamw_eps: float = ADAMW_DEFAULTS["adamw_eps"],
        adamw_weight_decay: float | None = ADAMW_DEFAULTS["adamw_weight_decay"],
        capturable: bool = False,
        batched: bool = False,
        allow_tf32: bool = _D["allow_tf32"],
        matrix_rule: Any = None,
    ) -> None:
        defaults = {
            "capturable": capturable,
            "batched": batched,
            "allow_tf32": allow_tf32,
            "lr": lr,
            "betas": betas,
            "epsilon": epsilon,
            "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency,
            "start_preconditioning_step": start_preconditioning_step,
            "max_preconditioner_dim": max_preconditioner_dim,
            "grafting_beta2": grafting_beta2,
            "grafting_eps": grafting_eps,
        }
        adamw = {
            "adamw_lr": adamw_lr,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        }
        super().__init__(params, defaults, adamw, matrix_rule)
