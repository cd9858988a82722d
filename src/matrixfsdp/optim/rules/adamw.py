"""AdamW, the element-wise rule: every optimizer's fallback for what its matrix rule does not take.

Its hyperparameters are ``adamw_lr``, ``adamw_betas``, ``adamw_eps`` and ``adamw_weight_decay``,
read from the same param group as the matrix rule's; ``adamw_lr=None`` and
``adamw_weight_decay=None`` (the defaults) mean the group's ``lr`` / ``weight_decay``, read at
every step, so LR schedulers that edit ``group["lr"]`` drive both rules. The per-parameter step
is bitwise ``torch.optim.AdamW(foreach=False)``: torch 2.13's ``_single_tensor_adam`` ops (the
decoupled decay, which torch runs before the moments, runs after them in :meth:`Rule.step`: it
touches only the parameter, so the bits are the same); batched and capturable groups take the
foreach forms of ``optim/_adamw.py``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from .._adamw import adam_denom, adamw_foreach, adamw_foreach_capturable, new_step_counter
from .base import Increment, Rule, StepCount
from .checks import check_betas, check_lr, check_nonneg

__all__ = ["AdamWRule"]


class AdamWRule(Rule):
    """AdamW on any tensor (element-wise state: ``step``, ``exp_avg``, ``exp_avg_sq``)."""

    name = "adamw"
    defaults = {
        "adamw_lr": None,
        "adamw_betas": (0.9, 0.999),
        "adamw_eps": 1e-8,
        "adamw_weight_decay": None,
    }

    @classmethod
    def check(cls, group: Mapping[str, Any], where: str, api: str) -> None:
        check_lr(api, group, "adamw_lr", where, optional=True)
        check_betas(api, group, "adamw_betas", where)
        check_nonneg(api, group, "adamw_eps", where)
        check_nonneg(api, group, "adamw_weight_decay", where, optional=True)

    def decay(self) -> tuple[Any, Any]:
        """``(lr, weight_decay)``: ``adamw_lr`` and ``adamw_weight_decay``, ``None`` meaning the group's own."""
        group = self.group
        lr = group["adamw_lr"] if group.get("adamw_lr") is not None else group["lr"]
        wd = group.get("adamw_weight_decay")
        return lr, wd if wd is not None else group.get("weight_decay", 0.0)

    def _init_state(self, like: Tensor, counter: Tensor | None = None) -> dict[str, Any]:
        return {
            "step": counter if counter is not None else self.step_counter(like),
            "exp_avg": torch.zeros_like(like, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(like, memory_format=torch.preserve_format),
        }

    def increment(self, grad: Tensor, state: dict[str, Any], like: Tensor) -> Increment:
        if not state:  # (the per-parameter step's counter is on the CPU, capturable group or not)
            state.update(self._init_state(like, new_step_counter()))
        lr, _ = self.decay()
        beta1, beta2 = self.group["adamw_betas"]
        exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
        step_t += 1
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = step_t.item()
        step_size = lr / (1 - beta1**step)
        return Increment(exp_avg, -step_size, adam_denom(exp_avg_sq, step, beta2, self.group["adamw_eps"]))

    def step_group(self, items: Sequence[tuple[Tensor, Tensor, dict[str, Any]]],
                   counts: Sequence[StepCount] | None = None) -> None:
        """One foreach AdamW over the group (the same op sequence; capturable: tensor scalars)."""
        for param, _, state in items:
            if not state:
                state.update(self.init_state(param))
        lr, wd = self.decay()
        beta1, beta2 = self.group["adamw_betas"]
        states = [state for _, _, state in items]
        (adamw_foreach_capturable if self.capturable else adamw_foreach)(
            [param for param, _, _ in items],
            [grad for _, grad, _ in items],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=self.group["adamw_eps"],
            weight_decay=wd,
        )
