"""Shampoo's rule: two-sided Shampoo with Adam grafting (see :class:`~matrixfsdp.optim.Shampoo`).

All matrix statistics live in :func:`~matrixfsdp.optim.rules.base.wide_dtype` (float32 for
bf16/fp16/fp32 parameters, float64 for float64 ones); inverse roots use ``torch.linalg.eigh`` in
that dtype (float64 retry on failure). Whole-matrix state: a hosted matrix keeps it on its host.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from .._adamw import adam_denom, adam_denom_capturable, lr_tensor
from .._linalg import inverse_root, tf32_matmuls
from .base import Increment, Rule, StepCount, wide_dtype
from .checks import check_beta, check_betas, check_bool, check_int, check_nonneg, fail

__all__ = ["ShampooRule"]


class ShampooRule(Rule):
    """Shampoo on whole 2D matrices (state: ``step``, ``exp_avg``, ``grafting_exp_avg_sq``,
    ``L``/``R`` and, once computed, ``L_inv_root``/``R_inv_root``)."""

    name = "shampoo"
    defaults = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "epsilon": 1e-12,
        "weight_decay": 0.0,
        "precondition_frequency": 10,
        "start_preconditioning_step": 10,
        "max_preconditioner_dim": 8192,
        "grafting_beta2": 0.999,
        "grafting_eps": 1e-8,
        "allow_tf32": False,
    }
    wide_state = True
    # Roots exist only from start_preconditioning_step on; checkpoints always carry the keys.
    state_placeholders = {"L_inv_root": "L", "R_inv_root": "R"}

    @classmethod
    def check(cls, group: Mapping[str, Any], where: str, api: str) -> None:
        check_betas(api, group, "betas", where, allow_one=True)
        check_nonneg(api, group, "epsilon", where)
        if not group["epsilon"] > 0:
            fail(api, f"epsilon must be > 0, got epsilon={group['epsilon']!r}", where)
        check_int(api, group, "precondition_frequency", where, 1)
        check_int(api, group, "start_preconditioning_step", where, 1)
        check_int(api, group, "max_preconditioner_dim", where, 0)
        check_beta(api, group, "grafting_beta2", where)
        check_nonneg(api, group, "grafting_eps", where)
        check_bool(api, group, "allow_tf32", where)

    def _init_state(self, like: Tensor) -> dict[str, Any]:
        dtype = wide_dtype(like.dtype)
        max_dim = self.group["max_preconditioner_dim"]
        rows, cols = like.shape
        state = {
            "step": self.step_counter(like),
            "exp_avg": torch.zeros(like.shape, dtype=dtype, device=like.device),
            "grafting_exp_avg_sq": torch.zeros(like.shape, dtype=dtype, device=like.device),
        }
        if rows <= max_dim:
            state["L"] = torch.zeros(rows, rows, dtype=dtype, device=like.device)
        if cols <= max_dim:
            state["R"] = torch.zeros(cols, cols, dtype=dtype, device=like.device)
        return state

    def _moments(self, g: Tensor, state: dict[str, Any]) -> None:
        """First moment, grafting second moment and the factors, from the wide gradient ``g``."""
        beta1, beta2 = self.group["betas"]
        graft_beta2 = self.group["grafting_beta2"]
        state["exp_avg"].lerp_(g, 1 - beta1)
        state["grafting_exp_avg_sq"].mul_(graft_beta2).addcmul_(g, g, value=1 - graft_beta2)
        # beta2 == 1 is a plain sum (addmm's alpha must not become 0).
        alpha = 1.0 if beta2 == 1 else 1 - beta2
        left, right = state.get("L"), state.get("R")
        with tf32_matmuls(self.group.get("allow_tf32", False), g):
            if left is not None:
                left.addmm_(g, g.T, beta=beta2, alpha=alpha)
            if right is not None:
                right.addmm_(g.T, g, beta=beta2, alpha=alpha)

    def _direction(self, state: dict[str, Any], step: float, denom: Tensor) -> Tensor | None:
        """``P * ||A||_F / ||P||_F`` (a new tensor), ``P = L_root M R_root``, ``A = M / denom``, at
        ``step`` (roots recomputed on schedule); ``None`` while the rule is AdamW (before
        ``start_preconditioning_step``, or no side has a factor)."""
        start = self.group["start_preconditioning_step"]
        has_left, has_right = "L" in state, "R" in state
        if step < start or not (has_left or has_right):
            return None
        have_roots = "L_inv_root" in state or "R_inv_root" in state
        if not have_roots or (step - start) % self.group["precondition_frequency"] == 0:
            self._update_roots(state, float(step))  # eigh: not capturable
        exp_avg = state["exp_avg"]
        # P = L_root M R_root (a new tensor: at least one side has a factor here).
        with tf32_matmuls(self.group.get("allow_tf32", False), exp_avg):
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

    def _update_roots(self, state: dict[str, Any], step: float) -> None:
        beta2 = self.group["betas"][1]
        factors = [k for k in ("L", "R") if k in state]
        root = 2 * len(factors)  # -1/4 on both sides, -1/2 one-sided: both whiten G G^T fully
        correction = 1.0 if beta2 == 1 else 1 - beta2**step
        for key in factors:
            state[f"{key}_inv_root"] = inverse_root(state[key] / correction, root, self.group["epsilon"])

    def increment(self, grad: Tensor, state: dict[str, Any], like: Tensor) -> Increment:
        if not state:
            state.update(self.init_state(like))
        g = grad.to(wide_dtype(like.dtype))
        state["step"] += 1
        step = state["step"].item()
        self._moments(g, state)
        graft_beta2 = self.group["grafting_beta2"]
        step_size = self.group["lr"] / (1 - self.group["betas"][0] ** step)
        denom = adam_denom(state["grafting_exp_avg_sq"], step, graft_beta2, self.group["grafting_eps"])
        direction = self._direction(state, step, denom)
        if direction is None:
            return Increment(state["exp_avg"], -step_size, denom)  # AdamW, bitwise
        return Increment(direction, -step_size)

    def step_capturable(self, param: Tensor, grad: Tensor, state: dict[str, Any], count: StepCount) -> None:
        """:meth:`step` with tensor step sizes; the schedule follows the host step count."""
        if not state:
            state.update(self.init_state(param))
            count.set(1)  # this call is step 1
        g = grad.to(wide_dtype(param.dtype))
        step = count(state)  # == state["step"] after the increment, read on the host
        step_t = state["step"]
        step_t += 1
        self._moments(g, state)
        lr = lr_tensor(self.group["lr"], param)
        if self.group["weight_decay"] != 0:
            param.mul_(1 - lr * self.group["weight_decay"])
        neg_step_size = torch.neg(lr) / (1 - torch.pow(self.group["betas"][0], step_t))
        denom = adam_denom_capturable(state["grafting_exp_avg_sq"], step_t, self.group["grafting_beta2"],
                                      self.group["grafting_eps"])
        direction = self._direction(state, step, denom)
        if direction is None:
            param.addcmul_(state["exp_avg"].div(denom), neg_step_size)  # AdamW
        else:
            param.addcmul_(direction, neg_step_size)
