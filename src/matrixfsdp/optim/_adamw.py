"""Functional AdamW pieces: Adam's denominator, the foreach and capturable forms, step counters.

Every optimizer in this package routes its element-wise parameters to the AdamW rule
(``rules/adamw.py``), whose single-tensor step runs the ops of ``torch.optim.AdamW(foreach=False)``
(torch 2.13's ``_single_tensor_adam``: decoupled weight decay, non-capturable path) so that the
results are bitwise identical; do not "simplify" them. Shampoo's Adam grafting and SOAP's rotated
Adam reuse :func:`adam_denom`. :func:`adamw_foreach` is the same sequence in ``torch._foreach_*``
calls (bitwise on the CPU, where foreach kernels run the single-tensor ops);
:func:`adamw_foreach_capturable` computes the bias corrections and step sizes as tensors (see
[Note: capturable and batched steps] in ``optim/step_modes.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "adamw_foreach",
    "adamw_foreach_capturable",
    "adam_denom",
    "adam_denom_capturable",
    "new_step_counter",
    "lr_tensor",
    "foreach_scale_",
]


def new_step_counter(device: torch.device | str | None = None) -> Tensor:
    """A step counter as torch's optimizers keep it: a 0-dim float32 tensor, on the CPU by default.

    Why a tensor: ``Optimizer.load_state_dict`` special-cases the key ``"step"`` and never casts it,
    and ``step.item()`` feeds the bias corrections exactly as in torch. Capturable groups keep it
    on the parameter's device (``device``), as torch's ``capturable=True`` optimizers do.
    """
    return torch.zeros((), dtype=torch.float32, device=device)


def lr_tensor(lr: float | Tensor, like: Tensor) -> Tensor:
    """A capturable step's learning rate as a 0-dim tensor on ``like``'s device.

    A tensor ``lr`` is used as it is (moved only if it lives elsewhere; keep it on the
    parameters' device for CUDA-graph capture). A Python float becomes a float64 tensor, so
    ``1 - lr * weight_decay`` is the double the default step computes. The optimizers' steps
    hand their per-matrix code a group whose rates are already device tensors, one per group
    ([Note: one lr tensor per group] in ``optim/step_modes.py``), so this moves nothing there.
    """
    if isinstance(lr, Tensor):
        return lr if lr.device == like.device else lr.to(like.device)
    return torch.tensor(lr, dtype=torch.float64, device=like.device)


def foreach_scale_(tensors: list[Tensor], factor: float | Tensor) -> None:
    """``t.mul_(factor)`` for every tensor, as fused ``_foreach_mul_`` calls where the bits allow.

    CUDA fuses ``_foreach_mul_`` by a 0-dim tensor only when that tensor has the list's dtype
    (ATen's ``FOREACH_BINARY_OP_SCALAR_TENSOR``: ``tensors[0].scalar_type() ==
    scalar.scalar_type()``), else it runs one ``mul_`` per tensor. A capturable step's factor
    comes from a float64 learning rate (:func:`lr_tensor`), so a float32 or float64 list gets it
    cast to its own dtype: the one rounding each per-tensor ``mul_`` made of it anyway (the 0-dim
    operand is cast to the common dtype), so the bits are unchanged. A reduced-precision list keeps
    the factor as it is: its ``mul_`` multiplies by the factor in float (CPU ``mul_kernel`` reads
    the operand's original value), which a bfloat16 factor would round first. A Python float is
    already fused (the ``Scalar`` overload)."""
    if not isinstance(factor, Tensor):
        torch._foreach_mul_(tensors, factor)
        return
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, ts in by_dtype.items():
        exact = dtype in (torch.float32, torch.float64) and factor.dtype in (torch.float32, torch.float64)
        torch._foreach_mul_(ts, factor.to(dtype) if exact and factor.dtype != dtype else factor)


def adam_denom(exp_avg_sq: Tensor, step: float, beta2: float, eps: float) -> Tensor:
    """``sqrt(exp_avg_sq / (1 - beta2**step)) + eps`` computed as torch's Adam does (a new tensor)."""
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    return (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)


def adam_denom_capturable(exp_avg_sq: Tensor, step_t: Tensor, beta2: float, eps: float) -> Tensor:
    """:func:`adam_denom` with the step a tensor: ``sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps``."""
    bias_correction2_sqrt = (1 - torch.pow(beta2, step_t)).sqrt()
    return (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)


def adamw_foreach(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """The AdamW rule's step on lists with ``torch._foreach_*`` kernels, in the same op order.

    Step counters are CPU tensors here (read with ``.item()``, no device sync), so each parameter
    gets the bias corrections of its own count, exactly as the single-tensor rule.
    """
    torch._foreach_add_(steps, 1)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    counts = [s.item() for s in steps]
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, [(1 - beta2**n) ** 0.5 for n in counts])
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, [-(lr / (1 - beta1**n)) for n in counts])


def adamw_foreach_capturable(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """AdamW on lists with no host read: step counters on the parameters' device, ``lr`` a float
    or a 0-dim tensor, bias corrections and step sizes computed as tensors. The same update as
    the AdamW rule's step up to the rounding of those scalars."""
    lr_t = lr_tensor(lr, params[0])
    torch._foreach_add_(steps, 1)
    if weight_decay != 0:
        foreach_scale_(params, 1 - lr_t * weight_decay)  # fused: see foreach_scale_
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    # -lr / (1 - beta1**t) and sqrt(1 - beta2**t), one 0-dim tensor per parameter
    neg_step_sizes = [torch.neg(lr_t) / (1 - torch.pow(beta1, s)) for s in steps]
    bias_correction2_sqrts = [(1 - torch.pow(beta2, s)).sqrt() for s in steps]
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, bias_correction2_sqrts)
    torch._foreach_add_(denoms, eps)
    updates = torch._foreach_div(exp_avgs, denoms)
    torch._foreach_mul_(updates, neg_step_sizes)
    torch._foreach_add_(params, updates)
