"""What both front-ends' reductions share: how a gradient sum is divided, and how a rank learns
from the reduced usage flags whether another rank used a parameter it did not.

[Note: unused parameters]
A rank may not use every parameter in a step (conditional layers, MoE, a head used on some ranks
only). Each reduction carries one usage flag per parameter next to the gradients (1 where this
rank contributed a gradient, 0 where it sent zeros), summed with them. A rank that used the
parameter itself knows without looking; one that did not must learn whether *any* rank did: if
none did, the parameter gets no ``.grad`` (DDP's and FSDP2's behaviour), otherwise it gets the
reduced sum. That needs the summed flags on the host: :func:`read_flags` starts one transfer of
all of them at the end of backward, only in steps where this rank left something unused, and
:meth:`FlagRead.resolve` reads it as late as the backward allows.

[Note: usage-flag host read]
The flags are the only device value the host needs in a step; reading them is a host sync. On
the CPU it is a plain read. On an accelerator :func:`read_flags` concatenates the summed flags
on the device (one kernel) and copies them *asynchronously* into pinned host memory (one small
D2H copy per step, whatever the number of blocks or buckets), recording an event; the front-end
then enqueues what is left of its backward (reshards, frees) before :meth:`FlagRead.resolve`
waits for that event, the last point before ``backward()`` returns, which is when DDP's
semantics (``.grad`` is ``None`` where no rank used a parameter) must hold.

``set_find_unused_parameters(False)`` (both front-ends; DDP's ``find_unused_parameters`` with the
opposite default) skips the read altogether: the user promises every parameter gets a gradient
on some rank in every step, so a rank that did not use one takes the reduced sum unread (zeros
if the promise was broken: a gradient of zeros instead of ``None``, never a wrong value). Then a
step has no host sync at all, also when conditional layers or MoE experts go unused on a rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = ["divide_factors", "read_flags", "FlagRead", "check_find_unused", "host_reads"]

#: flag reads done by this process (tests count them: at most one per step)
host_reads = [0]


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


@dataclass(eq=False)
class FlagRead:
    """One started read of summed usage flags (see [Note: usage-flag host read])."""

    entries: Sequence[tuple[Any, torch.Tensor, torch.Tensor]]
    host: torch.Tensor | None = None  #: the flags on the host (pinned on an accelerator)
    event: Any = None  #: recorded after the D2H copy (accelerators)

    def resolve(self, used: Callable[[Any, torch.Tensor], None],
                unused: Callable[[Any], None] | None = None) -> None:
        """For each ``(param, reduced_grad, summed_flag)``: ``used(param, grad)`` if some rank used
        it, else ``unused(param)``; a read without flags (``find_unused=False``) calls ``used``
        for every entry."""
        if self.host is None:
            for param, grad, _ in self.entries:
                used(param, grad)
            return
        if self.event is not None:
            self.event.synchronize()  # the one host wait of the step, as late as possible
        counts = self.host.tolist()
        for (param, grad, _), n in zip(self.entries, counts):
            if n > 0:
                used(param, grad)
            elif unused is not None:
                unused(param)


def read_flags(entries: Sequence[tuple[Any, torch.Tensor, torch.Tensor]], *,
               find_unused: bool = True) -> FlagRead:
    """Start reading the summed flags of ``entries`` (none when ``entries`` is empty or
    ``find_unused`` is False); see [Note: usage-flag host read]."""
    if not entries or not find_unused:
        return FlagRead(entries)
    host_reads[0] += 1
    flags = torch.cat([f for _, _, f in entries])
    if flags.device.type == "cpu":
        return FlagRead(entries, flags)
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    event = torch.accelerator.current_stream(flags.device).record_event()
    return FlagRead(entries, host, event)


def check_find_unused(value: Any, api: str) -> bool:
    """``set_find_unused_parameters``' argument check (both front-ends)."""
    if not isinstance(value, bool):
        raise TypeError(f"{api}.set_find_unused_parameters: find_unused_parameters must be a bool, "
                        f"got {value!r}")
    return value
