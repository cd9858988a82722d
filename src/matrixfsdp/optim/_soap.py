"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al. 2024, arXiv:2409.11321).

Follows the paper's reference implementation (github.com/nikhilvyas/SOAP, ``soap.py``) for 2D
matrices; see :class:`SOAP` for the exact update and the few documented deviations. All matrix
state lives in :func:`~matrixfsdp.optim._base.wide_dtype` (float32 for bf16/fp16/fp32 parameters).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._adamw import adam_denom, adam_denom_capturable
from ._base import ADAMW_DEFAULTS, MatrixOptimizer, lr_tensor, wide_dtype
from ._linalg import eigh, tf32_matmuls

__all__ = ["SOAP"]


def _project(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    """``QL^T x QR`` (into the eigenbasis); a missing side is the identity."""
    if left is not None:
        x = left.T @ x
    if right is not None:
        x = x @ right
    return x


def _project_back(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    """``QL x QR^T`` (back to the parameter's basis); a missing side is the identity."""
    if left is not None:
        x = left @ x
    if right is not None:
        x = x @ right.T
    return x


class SOAP(MatrixOptimizer):
    r"""SOAP (ShampoO with Adam in the Preconditioner's eigenbasis) for 2D matrices, AdamW elsewhere.

    Matrix rule for a parameter :math:`W` (m x n) with gradient :math:`G` (``b1, b2 = betas``,
    ``sb = shampoo_beta``, which defaults to ``b2``)::

        first call (statistics only, W is not touched, not even by weight decay):
            L <- (1 - sb) G G^T,  R <- (1 - sb) G^T G
            QL, QR <- eigenvectors of L, R by eigh, in descending eigenvalue order
            M, V <- 0 (shape m x n, kept in the eigenbasis);  t <- 0
        every later call:
            t  <- t + 1
            G' =  QL^T G QR
            M  <- b1 * M + (1 - b1) * G'                 (lerp)
            V  <- b2 * V + (1 - b2) * G'**2
            W  <- W * (1 - lr * weight_decay)           (decoupled weight decay)
            W  <- W - lr / (1 - b1**t) * QL (M / (sqrt(V / (1 - b2**t)) + eps)) QR^T
            L  <- L.lerp(G G^T, 1 - sb),  R <- R.lerp(G^T G, 1 - sb)       (after the update)
            if t % precondition_frequency == 0:                            (per side)
                order = argsort(diag(Q^T L Q), descending);  Q <- Q[:, order]
                V     <- V with that side's index permuted by order
                Q     <- orthonormal factor of QR(L Q)      (one power-iteration step)
                M     <- QL_new^T (QL_old M QR_old^T) QR_new   (M re-expressed in the new basis)

    A side longer than ``max_preconditioner_dim`` has no factor and its Q is the identity (both
    sides skipped: Adam with the first step skipped). With ``QL = QR = I`` the rule is AdamW
    (``betas``, ``eps``, ``weight_decay``) on the gradients from the second call on.

    Same as the reference: the first call only gathers statistics (so the current gradient is
    never used in its own projection); factors are updated after the step; eigenbases come from
    ``eigh`` once and then one power-iteration + QR step every ``precondition_frequency`` Adam
    steps; the second moment is permuted, not rotated, when the basis changes; ``eigh`` retries
    in float64 on failure. Deviations, none changing the algorithm's math beyond round-off except
    the last two (both O(eps) or O(lr^2 wd)):

    * the first moment stays in the eigenbasis and is rotated only when the basis changes (the
      reference projects it back and forth on every step, which is the same in exact arithmetic);
    * Adam's bias correction is torch's (``eps`` added after dividing ``sqrt(V)`` by
      ``sqrt(1 - b2**t)``; the reference adds ``eps`` before), which makes the identity-basis case
      exactly torch's AdamW;
    * weight decay is applied before the update, as AdamW (the reference applies it after);
    * no ``merge_dims``, ``precondition_1d``, ``normalize_grads``, ``correct_bias`` options
      (2D only; non-matrix parameters go to the AdamW rule).

    Routing and the AdamW rule for non-matrix parameters are as in :class:`~matrixfsdp.optim.Muon`
    (``algorithm`` = ``"auto"`` / ``"soap"`` / ``"adamw"`` per group).

    Args:
        params: parameters or param groups; a group may set any argument below plus ``algorithm``.
        lr: learning rate (default 3e-3, the paper's).
        betas: Adam ``(b1, b2)`` in the eigenbasis (default ``(0.95, 0.95)``).
        shampoo_beta: factor EMA decay; ``None`` (default) means ``betas[1]``.
        eps: Adam epsilon (default 1e-8).
        weight_decay: decoupled weight decay (default 0.01).
        precondition_frequency: Adam steps between eigenbasis refreshes (default 10).
        max_preconditioner_dim: sides longer than this get no factor (default 10000, the
            reference's ``max_precond_dim``).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW rule; ``adamw_lr=None``
            and ``adamw_weight_decay=None`` (defaults) mean the group's ``lr`` / ``weight_decay``;
            betas ``(0.9, 0.999)``, eps ``1e-8``.
        capturable: a step without host reads (``lr`` may be a 0-dim tensor, step counters on
            the parameter's device; basis refreshes follow a host-side step count), for
            ``torch.compile`` and CUDA graphs after the first call (default False); keep a tensor
            ``lr`` on the parameters' device (see :class:`~matrixfsdp.optim.Muon`).
        batched: step the element-wise parameters with one foreach AdamW (default False).
        allow_tf32: let the float32 GEMMs of CUDA parameters (projections into and out of the
            eigenbasis, ``G G^T``, ``G^T G``, the refresh's power step) use TF32 tensor cores;
            ``eigh`` and ``qr`` stay float32. No effect on the CPU (default False).

    State (per matrix, wide dtype): ``step`` (Adam steps, 0-dim float32 CPU tensor),
    ``exp_avg`` and ``exp_avg_sq`` (in the eigenbasis), ``L``/``R``, ``QL``/``QR``.

    Example::

        >>> from matrixfsdp.optim import SOAP
        >>> model = torch.nn.Linear(32, 16)
        >>> opt = SOAP(model.parameters(), lr=3e-3)
        >>> model(torch.randn(4, 32)).sum().backward()
        >>> opt.step()  # weight: SOAP (first call gathers statistics), bias: AdamW
        >>> opt = SOAP(model.parameters(), lr=torch.tensor(3e-3), capturable=True)  # compilable
    """

    rule = "soap"
    wide_state = True

    def __init__(
        self,
        params: Any,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_preconditioner_dim: int = 10000,
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
            "shampoo_beta": shampoo_beta,
            "eps": eps,
            "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency,
            "max_preconditioner_dim": max_preconditioner_dim,
        }
        adamw = {
            "adamw_lr": adamw_lr,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        }
        super().__init__(params, defaults, adamw, matrix_rule)

    def _check_rule_hparams(self, group: dict[str, Any], where: str) -> None:
        self._check_betas(group, "betas", where)
        self._check_beta(group, "shampoo_beta", where, optional=True)
        self._check_nonneg(group, "eps", where)
        self._check_int(group, "precondition_frequency", where, 1)
        self._check_int(group, "max_preconditioner_dim", where, 0)
        if not isinstance(group.get("allow_tf32", False), bool):
            self._fail(f"allow_tf32 must be a bool, got allow_tf32={group['allow_tf32']!r}", where)

    # Eigenbasis hooks (tests replace them to pin the basis).
    def _initial_eigenbasis(self, factor: Tensor) -> Tensor:
        """Eigenvectors of ``factor`` in descending eigenvalue order (the reference's ``flip``)."""
        return eigh(factor)[1].flip(1)

    def _refreshed_eigenbasis(self, factor: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
        """One power-iteration + QR step from ``basis``; returns ``(new_basis, order)``.

        ``order`` sorts the columns of ``basis`` by their Rayleigh quotients, descending; the
        caller permutes the second moment the same way so each coordinate keeps its statistics.
        """
        estimated = torch.diagonal(basis.T @ factor @ basis)
        order = torch.argsort(estimated, descending=True)
        new_basis, _ = torch.linalg.qr(factor @ basis[:, order])
        return new_basis, order

    def _matrix_step(self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        dtype = wide_dtype(param.dtype)
        beta1, beta2 = group["betas"]
        shampoo_beta = group["shampoo_beta"] if group["shampoo_beta"] is not None else beta2
        g = grad.to(dtype)
        tf32 = group.get("allow_tf32", False)
        if not state or state["step"].item() < 0:
            with tf32_matmuls(tf32, g):
                self._init_state(param, g, state, group["max_preconditioner_dim"], shampoo_beta, group)
            return  # the reference's first call: statistics only
        left, right = state.get("QL"), state.get("QR")

        state["step"] += 1
        step = state["step"].item()
        with tf32_matmuls(tf32, g):
            g_rot = _project(g, left, right)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(g_rot, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g_rot, g_rot, value=1 - beta2)
        lr, wd = group["lr"], group["weight_decay"]
        if wd != 0:
            param.mul_(1 - lr * wd)
        # (-step_size * M) / denom is addcdiv's own rounding: with QL = QR = I this is AdamW, bitwise.
        step_size = lr / (1 - beta1**step)
        update = exp_avg.mul(-step_size).div_(adam_denom(exp_avg_sq, step, beta2, group["eps"]))
        self._finish_step(param, update, g, state, left, right, shampoo_beta, group,
                          refresh=step % group["precondition_frequency"] == 0)

    def _finish_step(self, param: Tensor, update: Tensor, g: Tensor, state: dict[str, Any],
                     left: Tensor | None, right: Tensor | None, shampoo_beta: float, group: dict[str, Any],
                     *, refresh: bool) -> None:
        """Apply ``update`` (in the eigenbasis), then update the factors and maybe the basis."""
        with tf32_matmuls(group.get("allow_tf32", False), g):
            param.add_(_project_back(update, left, right))
            # Statistics after the step, so a gradient never shapes its own projection.
            if "L" in state:
                state["L"].lerp_(g @ g.T, 1 - shampoo_beta)
            if "R" in state:
                state["R"].lerp_(g.T @ g, 1 - shampoo_beta)
            if refresh and (left is not None or right is not None):
                self._refresh(state, left, right)

    def _capturable_matrix_step(
        self, p: Tensor, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """``_matrix_step`` with tensor step sizes; the first call and the refreshes follow the
        host step count (the first call's ``eigh`` is not capturable; refreshes are)."""
        dtype = wide_dtype(param.dtype)
        beta1, beta2 = group["betas"]
        shampoo_beta = group["shampoo_beta"] if group["shampoo_beta"] is not None else beta2
        g = grad.to(dtype)
        tf32 = group.get("allow_tf32", False)
        if not state or self._host_step(p, state) <= 0:  # 0: this call gathers the first statistics
            with tf32_matmuls(tf32, g):
                self._init_state(param, g, state, group["max_preconditioner_dim"], shampoo_beta, group)
            self._set_host_step(p, 0)
            return  # the reference's first call: statistics only
        left, right = state.get("QL"), state.get("QR")

        step = self._host_step(p, state)  # == state["step"] after the increment, read on the host
        step_t = state["step"]
        step_t += 1
        with tf32_matmuls(tf32, g):
            g_rot = _project(g, left, right)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(g_rot, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g_rot, g_rot, value=1 - beta2)
        lr = lr_tensor(group["lr"], param)
        if group["weight_decay"] != 0:
            param.mul_(1 - lr * group["weight_decay"])
        neg_step_size = torch.neg(lr) / (1 - torch.pow(beta1, step_t))
        update = exp_avg.mul(neg_step_size).div_(adam_denom_capturable(exp_avg_sq, step_t, beta2, group["eps"]))
        self._finish_step(param, update, g, state, left, right, shampoo_beta, group,
                          refresh=step % group["precondition_frequency"] == 0)

    def _matrix_init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Zero templates of every state tensor, ``step = -1``: statistics still to be gathered by
        the next (first real) call, which then runs the reference's statistics-only first step."""
        self._init_state(param, torch.zeros(param.shape, dtype=wide_dtype(param.dtype), device=param.device),
                         state, group["max_preconditioner_dim"], 0.0, group)
        for key in ("QL", "QR"):
            if key in state:
                state[key].zero_()
        state["step"] -= 1

    def _init_state(self, param: Tensor, g: Tensor, state: dict[str, Any], max_dim: int, shampoo_beta: float,
                    group: dict[str, Any] | None = None) -> None:
        rows, cols = param.shape
        state["step"] = self._step_counter(group, param)
        state["exp_avg"] = torch.zeros(param.shape, dtype=g.dtype, device=param.device)
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=g.dtype, device=param.device)
        for key, dim, outer in (("L", rows, lambda: g @ g.T), ("R", cols, lambda: g.T @ g)):
            if dim <= max_dim:
                factor = torch.zeros(dim, dim, dtype=g.dtype, device=param.device).lerp_(outer(), 1 - shampoo_beta)
                state[key] = factor
                state[f"Q{key}"] = self._initial_eigenbasis(factor)

    def _refresh(self, state: dict[str, Any], left: Tensor | None, right: Tensor | None) -> None:
        exp_avg = _project_back(state["exp_avg"], left, right)  # to the parameter's basis
        for dim, key in ((0, "L"), (1, "R")):
            if key in state:
                basis, order = self._refreshed_eigenbasis(state[key], state[f"Q{key}"])
                state[f"Q{key}"] = basis
                state["exp_avg_sq"] = state["exp_avg_sq"].index_select(dim, order)
        state["exp_avg"] = _project(exp_avg, state.get("QL"), state.get("QR"))
