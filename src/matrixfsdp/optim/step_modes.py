"""The capturable and batched steps' bookkeeping: learning rates on the device, host step counts.

[Note: capturable and batched steps]
Two per-group options change how a group is stepped, never what it computes beyond round-off:

* ``capturable=True``: the step reads no Python number that changes between steps. Learning
  rates may be 0-dim tensors (an LR scheduler then writes them in place; keep them on the
  parameters' device, see [Note: one lr tensor per group]), step counters live on
  the parameter's device, bias corrections and step sizes are tensor arithmetic, and nothing in
  ``step()`` reads a device value (no ``.item()``). Data-independent schedules (Shampoo's root
  recomputations, SOAP's basis refreshes) follow a host-side count of each parameter's steps,
  rebuilt from the state in ``load_state_dict``. ``torch.compile(opt.step)`` with a tensor ``lr``
  then compiles once for the steady state, whatever the scheduler does; a Python-float ``lr``
  recompiles as it changes. Why this matters: with float learning rates, inductor (torch 2.13) can
  bake the value seen when a graph was traced into the kernel as ``alpha`` and silently reuse it
  (``benchmarks/repro/compile_muon_lr.py``); the capturable step never passes an lr-dependent
  Python number to a kernel.
* ``batched=True``: element-wise parameters take one ``torch._foreach_*`` AdamW (the same op
  sequence as the single-tensor rule), and Muon stacks same-shape matrices into one batched
  Newton-Schulz (see :class:`~matrixfsdp.optim.Muon`).

The default (both False) is the per-parameter step, bitwise as documented on each optimizer.
The first ``step()`` of an optimizer without state may check its gradients on the host
([Note: state-initialization step] in ``optim/state_init.py``); compile or capture from the
second step on. A capturable or batched group is stepped by its rules' ``step_group`` and
``step_stack`` (``MatrixOptimizer._group_step``; [Note: update rules as classes]), reading the
group through :func:`device_lrs`'s view, with a :class:`HostCount` per matrix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ._base import MatrixOptimizer

__all__ = ["device_lrs", "HostCount", "sync_host_steps"]


# [Note: one lr tensor per group]
# A capturable step computes with its learning rates as 0-dim tensors on the parameters'
# device. Made per matrix from a float or a CPU tensor (``torch.tensor(lr, device=...)``,
# ``lr.to(device)``), each would be a pageable host-to-device copy: on CUDA a stall per matrix,
# and CUDA-graph capture fails. So each capturable group keeps one tensor per device and rate,
# refreshed once per step with ``fill_`` (the value travels as a kernel argument: no copy, no
# sync), and the step reads the group through a view holding those tensors. A tensor ``lr``
# already on the device is used as it is: that is the one to capture a CUDA graph with (a
# filled value would be frozen into the graph). Values are the ones ``lr_tensor`` makes: a
# float as float64, a tensor in its own dtype, so results are bitwise as before.
def device_lrs(opt: "MatrixOptimizer", index: int, group: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``group`` with ``lr`` and ``adamw_lr`` as 0-dim tensors on ``device`` (see the Note); the
    tensors are kept in ``opt._lr_tensors``."""
    view = dict(group)
    for key in ("lr", "adamw_lr"):
        lr = group.get(key)
        if lr is None or (isinstance(lr, Tensor) and lr.device == device):
            continue
        dtype = lr.dtype if isinstance(lr, Tensor) else torch.float64
        cached = opt._lr_tensors.get((index, key, device, dtype))
        if cached is None:
            cached = opt._lr_tensors[(index, key, device, dtype)] = torch.empty((), dtype=dtype, device=device)
        view[key] = cached.fill_(lr)
    return view


# [Note: host step counts] Shampoo's and SOAP's schedules branch on each parameter's step
# count, which a capturable step must not read from the device. The host keeps it as
# ``opt._step_calls["calls"] - opt._host_offsets[p]``: one optimizer-wide call count, incremented at
# the start of every step() of an optimizer with a capturable group, and a per-parameter
# offset that changes only when the parameter misses a step. So during a call the count is
# the step number that call performs (the state's ``step`` after its increment), and between
# calls it is the state's ``step``. Why not one int per parameter: under torch.compile each
# changing int is a guard; this way only ``_step_calls`` changes, it is read from the first
# call on (the state-creating call included), and dynamo makes it dynamic at the second
# compile instead of recompiling per value. It starts at 2: dynamo always specializes the
# ints 0 and 1, so a count passing through them would cost a third compile (torch 2.15).
# It lives in a dict because dynamo (torch 2.13) drops assignments to int attributes of an
# Optimizer inside a compiled step (benchmarks/repro/compile_muon_lr.py shows it). A rule reads
# it through a HostCount (``count(state)``, ``count.set(n)``), never the optimizer.
class HostCount:
    """Parameter ``p``'s host step count (see [Note: host step counts]), as a rule's
    ``step_capturable`` reads it: ``count(state)`` is the step number of this call,
    ``count.set(n)`` makes it ``n``."""

    def __init__(self, opt: "MatrixOptimizer", p: Tensor) -> None:
        self._opt, self._p = opt, p

    def __call__(self, state: dict[str, Any]) -> int:
        offset = self._opt._host_offsets.get(self._p)
        if offset is None:  # state from elsewhere than this optimizer's steps and loads: read it once
            self.set(int(state["step"].item()) + 1 if "step" in state else 1)
            offset = self._opt._host_offsets[self._p]
        return self._opt._step_calls["calls"] - offset

    def set(self, n: int) -> None:
        self._opt._host_offsets[self._p] = self._opt._step_calls["calls"] - n


def sync_host_steps(opt: "MatrixOptimizer") -> None:
    """Rebuild the host step counts from the state, between calls (reads each counter once)."""
    opt._host_offsets = {}
    for group in opt.param_groups:
        if not group.get("capturable", False):
            continue
        for p in group["params"]:
            state = opt.state.get(p)
            if state and isinstance(state.get("step"), Tensor):
                HostCount(opt, p).set(int(state["step"].item()))
