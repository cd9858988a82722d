"""What both front-ends' reductions share: how a gradient sum is divided, and how a rank learns
from the reduced usage flags whether another rank used a parameter it did not.

[Note: unused parameters]
A rank may not use every parameter in a step (conditional layers, MoE, a head used on some ranks
only). Each reduction carries one usage flag per parameter next to the gradients (1 where this
rank contributed a gradient, 0 where it sent zeros), summed with them. A rank that used the
parameter itself knows without looking; one that did not must learn whether *any* rank did: if
none did, the parameter gets no ``.grad`` (DDP's and FSDP2's behaviour), otherwise it gets the
reduced sum. That needs the summed flags on the host: :func:`resolve_unused` reads them all in one
transfer at the end of backward, and only in steps where this rank left something unused.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["divide_factors", "resolve_unused"]


def divide_factors(world_size: int, factor: float | None, dtype: torch.dtype, *,
                   predivide: bool = False) -> tuple[float, float]:
    """``(pre, post)``: a reduced gradient is ``sum(g / pre) / post`` with ``pre * post = factor``
    (default ``world_size``: the average).

    ``fully_shard`` sums first where the dtype has the range (fp32, fp64, bf16: ``pre = 1``, as
    FSDP2); narrower types (fp16) pre-divide by a power of two near ``sqrt(factor)`` so the sum
    cannot overflow at large ``W``. ``predivide=True`` is DDP's rule, which ``replicate`` follows for
    bitwise DDP parity: every contribution is multiplied by ``1 / factor`` before the sum
    (``post = 1``).
    """
    f = float(factor) if factor is not None else float(world_size)
    if predivide:
        return f, 1.0
    if dtype in (torch.float32, torch.float64, torch.bfloat16) or f != int(f):
        return 1.0, f
    pre = 1
    while f % (pre * 2) == 0 and f / (pre * 2) >= pre * 2:
        pre *= 2
    return float(pre), f / pre


def resolve_unused(entries: Sequence[tuple[Any, torch.Tensor, torch.Tensor]],
                   used: Callable[[Any, torch.Tensor], None],
                   unused: Callable[[Any], None] | None = None) -> None:
    """For each ``(param, reduced_grad, summed_flag)`` of a parameter this rank did not use, call
    ``used(param, grad)`` if some rank used it, else ``unused(param)``: one host read of all the
    flags (see the Note), none when ``entries`` is empty."""
    if not entries:
        return
    counts = torch.cat([f for _, _, f in entries]).tolist()
    for (param, grad, _), n in zip(entries, counts):
        if n > 0:
            used(param, grad)
        elif unused is not None:
            unused(param)
