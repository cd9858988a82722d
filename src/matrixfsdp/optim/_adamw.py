"""Functional single-tensor AdamW, op for op the same as ``torch.optim.AdamW(foreach=False)``.

Every optimizer in this package routes its element-wise parameters here, and Shampoo's Adam
grafting and SOAP's rotated Adam reuse :func:`adam_denom`. The op sequence is copied from
torch 2.13's ``_single_tensor_adam`` (decoupled weight decay, non-capturable path) so that the
results are bitwise identical; do not "simplify" it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["adamw_step", "adam_denom", "new_step_counter"]


def new_step_counter() -> Tensor:
    """A step counter as torch's optimizers keep it: a 0-dim float32 CPU tensor.

    Why a tensor: ``Optimizer.load_state_dict`` special-cases the key ``"step"`` and never casts it,
    and ``step.item()`` feeds the bias corrections exactly as in torch.
    """
    return torch.zeros((), dtype=torch.float32)


def adam_denom(exp_avg_sq: Tensor, step: float, beta2: float, eps: float) -> Tensor:
    """``sqrt(exp_avg_sq / (1 - beta2**step)) + eps`` computed as torch's Adam does (a new tensor)."""
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    return (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)


def adamw_step(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step_t: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One in-place AdamW step on plain (local) tensors; increments ``step_t``."""
    step_t += 1
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = step_t.item()
    step_size = lr / (1 - beta1**step)
    param.addcdiv_(exp_avg, adam_denom(exp_avg_sq, step, beta2, eps), value=-step_size)
