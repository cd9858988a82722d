"""Shampoo with Adam grafting for whole 2D matrices (the Distributed-Shampoo-style default variant).

See :class:`Shampoo` for the exact update. All matrix statistics live in
:func:`~matrixfsdp.optim._base.wide_dtype` (float32 for bf16/fp16/fp32 parameters, float64 for
float64 ones); inverse roots use ``torch.linalg.eigh`` in that dtype (float64 retry on failure).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._adamw import adam_denom, adam_denom_capturable
from ._base import ADAMW_DEFAULTS, MatrixOptimizer, lr_tensor, wide_dtype
from ._linalg import inverse_root, tf32_matmuls

__all__ = ["Shampoo"]


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
    wide_state = True
    # Roots exist only from start_preconditioning_step on; checkpoints always carry the keys.
    _state_placeholders = {"L_inv_root": "L", "R_inv_root": "R"}

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        precondition_frequency: int = 10,
        start_preconditioning_step: int = 10,
        max_preconditioner_dim: int = 8192,
        grafting_beta2: float = 0.999,
        grafting_eps: float = 1e-8,
        *,
        adamw_lr: float | None = ADAMW_DEFAULTS["adamw_lr"],
        adamw_betas: tuple[float, float] = ADAMW_DEFAULTS["adamw_betas"],
        adamw_eps: float = ADAMW_DEFAULTS["adamw_eps"],
        adamw_weight_decay: float | None = ADAMW_DEFAULTS["adamw_weight_decay"],
        capturable: bool = False,
        batched: bool = False,
        allow_tf32: bool = False,
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

    def _check_rule_hparams(self, group: dict[str, Any], where: str) -> None:
        self._check_betas(group, "betas", where, allow_one=True)
        self._check_nonneg(group, "epsilon", where)
        if not group["epsilon"] > 0:
            self._fail(f"epsilon must be > 0, got epsilon={group['epsilon']!r}", where)
        self._check_int(group, "precondition_frequency", where, 1)
        self._check_int(group, "start_preconditioning_step", where, 1)
        self._check_int(group, "max_preconditioner_dim", where, 0)
        self._check_beta(group, "grafting_beta2", where)
        self._check_nonneg(group, "grafting_eps", where)
        if not isinstance(group.get("allow_tf32", False), bool):
            self._fail(f"allow_tf32 must be a bool, got allow_tf32={group['allow_tf32']!r}", where)

    def _matrix_init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        dtype = wide_dtype(param.dtype)
        max_dim = group["max_preconditioner_dim"]
        rows, cols = param.shape
        state["step"] = self._step_counter(group, param)
        state["exp_avg"] = torch.zeros(param.shape, dtype=dtype, device=param.device)
        state["grafting_exp_avg_sq"] = torch.zeros(param.shape, dtype=dtype, device=param.device)
        if rows <= max_dim:
            state["L"] = torch.zeros(rows, rows, dtype=dtype, device=param.device)
        if cols <= max_dim:
            state["R"] = torch.zeros(cols, cols, dtype=dtype, device=param.device)

    def _matrix_step(self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        dtype = wide_dtype(param.dtype)
        max_dim = group["max_preconditioner_dim"]
        rows, cols = param.shape
        if not state:
            self._matrix_init_state(param, state, group)
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        graft_beta2 = group["grafting_beta2"]
        exp_avg, graft_sq = state["exp_avg"], state["grafting_exp_avg_sq"]
        left, right = state.get("L"), state.get("R")

        g = grad.to(dtype)
        state["step"] += 1
        step = state["step"].item()
        exp_avg.lerp_(g, 1 - beta1)
        graft_sq.mul_(graft_beta2).addcmul_(g, g, value=1 - graft_beta2)
        # beta2 == 1 is a plain sum (addmm's alpha must not become 0).
        self._update_factors(g, left, right, beta2, group)

        if wd != 0:
            param.mul_(1 - lr * wd)
        step_size = lr / (1 - beta1**step)
        denom = adam_denom(graft_sq, step, graft_beta2, group["grafting_eps"])
        start = group["start_preconditioning_step"]
        if step < start or (left is None and right is None):
            param.addcdiv_(exp_avg, denom, value=-step_size)  # AdamW, bitwise
            return

        have_roots = "L_inv_root" in state or "R_inv_root" in state
        if not have_roots or (step - start) % group["precondition_frequency"] == 0:
            self._update_roots(state, step, beta2, group["epsilon"])
        direction = self._grafted_direction(state, exp_avg, denom, group, left is not None, right is not None)
        param.add_(direction, alpha=-step_size)

    @staticmethod
    def _update_factors(g: Tensor, left: Tensor | None, right: Tensor | None, beta2: float,
                        group: dict[str, Any]) -> None:
        # beta2 == 1 is a plain sum (addmm's alpha must not become 0).
        alpha = 1.0 if beta2 == 1 else 1 - beta2
        with tf32_matmuls(group.get("allow_tf32", False), g):
            if left is not None:
                left.addmm_(g, g.T, beta=beta2, alpha=alpha)
            if right is not None:
                right.addmm_(g.T, g, beta=beta2, alpha=alpha)

    @staticmethod
    def _grafted_direction(state: dict[str, Any], exp_avg: Tensor, denom: Tensor, group: dict[str, Any],
                           has_left: bool, has_right: bool) -> Tensor:
        """``P * ||A||_F / ||P||_F`` (a new tensor), ``P = L_root M R_root``, ``A = M / denom``."""
        # P = L_root M R_root (a new tensor: at least one side has a factor here).
        with tf32_matmuls(group.get("allow_tf32", False), exp_avg):
            if has_left and has_right:
                direction = state["L_inv_root"] @ exp_avg @ state["R_inv_root"]
            elif has_left:
                direction = state["L_inv_root"] @ exp_avg
            else:
                direction = exp_avg @ state["R_inv_root"]
        # Graft: rescale to the Frobenius norm of Adam's direction (the bias corrections of
        # the first moment cancel, so both use the raw moment). No host sync.
        graft_norm = torch.linalg.vector_norm(exp_avg / denom)
        scale = graft_norm / torch.linalg.vector_norm(direction).clamp(min=torch.finfo(exp_avg.dtype).tiny)
        return direction.mul_(scale)

    def _capturable_matrix_step(
        self, p: Tensor, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """``_matrix_step`` with tensor step sizes; the schedule follows the host step count."""
        dtype = wide_dtype(param.dtype)
        if not state:
            self._matrix_init_state(param, state, group)
            self._set_host_step(p, 1)  # this call is step 1
        beta1, beta2 = group["betas"]
        graft_beta2 = group["grafting_beta2"]
        exp_avg, graft_sq = state["exp_avg"], state["grafting_exp_avg_sq"]
        left, right = state.get("L"), state.get("R")

        g = grad.to(dtype)
        step = self._host_step(p, state)  # == state["step"] after the increment, read on the host
        step_t = state["step"]
        step_t += 1
        exp_avg.lerp_(g, 1 - beta1)
        graft_sq.mul_(graft_beta2).addcmul_(g, g, value=1 - graft_beta2)
        self._update_factors(g, left, right, beta2, group)

        lr = lr_tensor(group["lr"], param)
        if group["weight_decay"] != 0:
            param.mul_(1 - lr * group["weight_decay"])
        neg_step_size = torch.neg(lr) / (1 - torch.pow(beta1, step_t))
        denom = adam_denom_capturable(graft_sq, step_t, graft_beta2, group["grafting_eps"])
        start = group["start_preconditioning_step"]
        if step < start or (left is None and right is None):
            param.addcmul_(exp_avg.div(denom), neg_step_size)  # AdamW
            return
        have_roots = "L_inv_root" in state or "R_inv_root" in state
        if not have_roots or (step - start) % group["precondition_frequency"] == 0:
            self._update_roots(state, float(step), beta2, group["epsilon"])  # eigh: not capturable
        direction = self._grafted_direction(state, exp_avg, denom, group, left is not None, right is not None)
        param.addcmul_(direction, neg_step_size)

    @staticmethod
    def _update_roots(state: dict[str, Any], step: float, beta2: float, epsilon: float) -> None:
        factors = [k for k in ("L", "R") if k in state]
        root = 2 * len(factors)  # -1/4 on both sides, -1/2 one-sided: both whiten G G^T fully
        correction = 1.0 if beta2 == 1 else 1 - beta2**step
        for key in factors:
            state[f"{key}_inv_root"] = inverse_root(state[key] / correction, root, epsilon)
