"""SOAP's rule: Adam in the eigenbasis of Shampoo's preconditioner (see :class:`~matrixfsdp.optim.SOAP`).

Follows the paper's reference implementation (github.com/nikhilvyas/SOAP, ``soap.py``) for 2D
matrices, with the deviations documented on the optimizer. All matrix state lives in
:func:`~matrixfsdp.optim.rules.base.wide_dtype` (float32 for bf16/fp16/fp32 parameters).
Whole-matrix state: a hosted matrix keeps it on its host.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from .._adamw import adam_denom, adam_denom_capturable, lr_tensor
from .._linalg import eigh, tf32_matmuls
from .base import Increment, Rule, StepCount, wide_dtype
from .checks import check_beta, check_betas, check_bool, check_int, check_nonneg

__all__ = ["SOAPRule", "initial_eigenbasis", "refreshed_eigenbasis"]


def initial_eigenbasis(factor: Tensor) -> Tensor:
    """Eigenvectors of ``factor`` in descending eigenvalue order (the reference's ``flip``)."""
    return eigh(factor)[1].flip(1)


def refreshed_eigenbasis(factor: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """One power-iteration + QR step from ``basis``; returns ``(new_basis, order)``.

    ``order`` sorts the columns of ``basis`` by their Rayleigh quotients, descending; the
    caller permutes the second moment the same way so each coordinate keeps its statistics.
    """
    estimated = torch.diagonal(basis.T @ factor @ basis)
    order = torch.argsort(estimated, descending=True)
    new_basis, _ = torch.linalg.qr(factor @ basis[:, order])
    return new_basis, order


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


class SOAPRule(Rule):
    """SOAP on whole 2D matrices (state: ``step`` (Adam steps), ``exp_avg`` and ``exp_avg_sq`` in
    the eigenbasis, ``L``/``R``, ``QL``/``QR``). ``initial_eigenbasis``/``refreshed_eigenbasis``:
    the eigenbasis functions (the optimizer passes its hooks, which tests replace)."""

    name = "soap"
    defaults = {
        "lr": 3e-3,
        "betas": (0.95, 0.95),
        "shampoo_beta": None,
        "eps": 1e-8,
        "weight_decay": 0.01,
        "precondition_frequency": 10,
        "max_preconditioner_dim": 10000,
        "allow_tf32": False,
    }
    wide_state = True

    def __init__(self, group: Mapping[str, Any], api: str = "", *,
                 initial_eigenbasis: Callable[[Tensor], Tensor] = initial_eigenbasis,
                 refreshed_eigenbasis: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] = refreshed_eigenbasis,
                 ) -> None:
        super().__init__(group, api)
        self._initial_eigenbasis, self._refreshed_eigenbasis = initial_eigenbasis, refreshed_eigenbasis

    @classmethod
    def check(cls, group: Mapping[str, Any], where: str, api: str) -> None:
        check_betas(api, group, "betas", where)
        check_beta(api, group, "shampoo_beta", where, optional=True)
        check_nonneg(api, group, "eps", where)
        check_int(api, group, "precondition_frequency", where, 1)
        check_int(api, group, "max_preconditioner_dim", where, 0)
        check_bool(api, group, "allow_tf32", where)

    def _shampoo_beta(self) -> float:
        beta = self.group["shampoo_beta"]
        return beta if beta is not None else self.group["betas"][1]

    def _init_state(self, like: Tensor) -> dict[str, Any]:
        """Zero templates of every state tensor, ``step = -1``: statistics still to be gathered by
        the next (first real) call, which then runs the reference's statistics-only first step."""
        state: dict[str, Any] = {}
        self._gather(like, torch.zeros(like.shape, dtype=wide_dtype(like.dtype), device=like.device), state, 0.0)
        for key in ("QL", "QR"):
            if key in state:
                state[key].zero_()
        state["step"] -= 1
        return state

    def _gather(self, like: Tensor, g: Tensor, state: dict[str, Any], shampoo_beta: float) -> None:
        """The reference's first call: state from the statistics of ``g`` alone (``like``: the parameter)."""
        rows, cols = like.shape
        state["step"] = self.step_counter(like)
        state["exp_avg"] = torch.zeros(like.shape, dtype=g.dtype, device=like.device)
        state["exp_avg_sq"] = torch.zeros(like.shape, dtype=g.dtype, device=like.device)
        max_dim = self.group["max_preconditioner_dim"]
        for key, dim, outer in (("L", rows, lambda: g @ g.T), ("R", cols, lambda: g.T @ g)):
            if dim <= max_dim:
                factor = torch.zeros(dim, dim, dtype=g.dtype, device=like.device).lerp_(outer(), 1 - shampoo_beta)
                state[key] = factor
                state[f"Q{key}"] = self._initial_eigenbasis(factor)

    def _adam(self, g: Tensor, state: dict[str, Any]) -> tuple[Tensor | None, Tensor | None]:
        """Adam's moments of ``g`` projected into the eigenbasis; returns the basis ``(QL, QR)``."""
        beta1, beta2 = self.group["betas"]
        left, right = state.get("QL"), state.get("QR")
        with tf32_matmuls(self.group.get("allow_tf32", False), g):
            g_rot = _project(g, left, right)
        state["exp_avg"].lerp_(g_rot, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g_rot, g_rot, value=1 - beta2)
        return left, right

    def _after(self, g: Tensor, state: dict[str, Any], left: Tensor | None, right: Tensor | None,
               *, refresh: bool) -> None:
        """Update the factors and, on schedule, the basis (after the step: a gradient never shapes
        its own projection)."""
        shampoo_beta = self._shampoo_beta()
        with tf32_matmuls(self.group.get("allow_tf32", False), g):
            if "L" in state:
                state["L"].lerp_(g @ g.T, 1 - shampoo_beta)
            if "R" in state:
                state["R"].lerp_(g.T @ g, 1 - shampoo_beta)
            if refresh and (left is not None or right is not None):
                exp_avg = _project_back(state["exp_avg"], left, right)  # to the parameter's basis
                for dim, key in ((0, "L"), (1, "R")):
                    if key in state:
                        basis, order = self._refreshed_eigenbasis(state[key], state[f"Q{key}"])
                        state[f"Q{key}"] = basis
                        state["exp_avg_sq"] = state["exp_avg_sq"].index_select(dim, order)
                state["exp_avg"] = _project(exp_avg, state.get("QL"), state.get("QR"))

    def increment(self, grad: Tensor, state: dict[str, Any], like: Tensor) -> Increment | None:
        g = grad.to(wide_dtype(like.dtype))
        if not state or state["step"].item() < 0:
            with tf32_matmuls(self.group.get("allow_tf32", False), g):
                self._gather(like, g, state, self._shampoo_beta())
            return None  # the reference's first call: statistics only
        state["step"] += 1
        step = state["step"].item()
        left, right = self._adam(g, state)
        beta1, beta2 = self.group["betas"]
        # (-step_size * M) / denom is addcdiv's own rounding: with QL = QR = I this is AdamW, bitwise.
        step_size = self.group["lr"] / (1 - beta1**step)
        update = state["exp_avg"].mul(-step_size).div_(adam_denom(state["exp_avg_sq"], step, beta2, self.group["eps"]))
        with tf32_matmuls(self.group.get("allow_tf32", False), g):
            update = _project_back(update, left, right)
        self._after(g, state, left, right, refresh=step % self.group["precondition_frequency"] == 0)
        return Increment(update, 1)

    def step_capturable(self, param: Tensor, grad: Tensor, state: dict[str, Any], count: StepCount) -> None:
        """:meth:`step` with tensor step sizes; the first call and the refreshes follow the host
        step count (the first call's ``eigh`` is not capturable; refreshes are)."""
        g = grad.to(wide_dtype(param.dtype))
        if not state or count(state) <= 0:  # 0: this call gathers the first statistics
            with tf32_matmuls(self.group.get("allow_tf32", False), g):
                self._gather(param, g, state, self._shampoo_beta())
            count.set(0)
            return  # the reference's first call: statistics only
        step = count(state)  # == state["step"] after the increment, read on the host
        step_t = state["step"]
        step_t += 1
        left, right = self._adam(g, state)
        beta1, beta2 = self.group["betas"]
        lr = lr_tensor(self.group["lr"], param)
        if self.group["weight_decay"] != 0:
            param.mul_(1 - lr * self.group["weight_decay"])
        neg_step_size = torch.neg(lr) / (1 - torch.pow(beta1, step_t))
        update = state["exp_avg"].mul(neg_step_size).div_(
            adam_denom_capturable(state["exp_avg_sq"], step_t, beta2, self.group["eps"]))
        with tf32_matmuls(self.group.get("allow_tf32", False), g):
            param.add_(_project_back(update, left, right))
        self._after(g, state, left, right, refresh=step % self.group["precondition_frequency"] == 0)
