"""Muon's rule: momentum orthogonalized by a Newton-Schulz iteration (``optim/newton_schulz.py``).

The per-matrix step is ``torch.optim.Muon`` (torch 2.13) op for op (see
:class:`~matrixfsdp.optim.Muon` for the update). Momentum is element-wise, so a hosted matrix may
keep it on its row shards (``shards_state``: ``prepare`` is the momentum, ``finish`` the
Newton-Schulz and the shape's learning rate; [Note: state on the shards] in ``optim/rule.py``).
Stacks of matrices (expert stacks, ``splits`` per slice) and batched groups run every
element-wise op once and Newton-Schulz batched, in chunks of bounded bytes.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import Tensor

from .. import _adamw  # (its foreach_scale_, looked up at each call)
from .._adamw import lr_tensor
from .._expert_step import matrices, ns_chunks
from ..newton_schulz import _orthogonalize_, orthogonalize, schedule_error
from .base import Increment, Rule, StepCount
from .checks import check_bool, check_int, check_nonneg, fail

__all__ = ["MuonRule", "lr_ratio", "adjusted_lr"]

_NS_DTYPES = (torch.bfloat16, torch.float32)
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
_NS_METHODS = ("standard", "gram")


def lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's per-shape factor of the learning rate (a Python float: shapes never change)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))  # Keller Jordan's scaling
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))  # Moonshot: update RMS ~ AdamW's
    return 1.0


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's per-shape learning rate, as torch's ``_adjust_lr``; ``shape`` is the global one."""
    return lr * lr_ratio(adjust_lr_fn, shape)


class MuonRule(Rule):
    """Muon on whole 2D matrices (state: ``momentum_buffer``, in the parameter's dtype)."""

    name = "muon"
    defaults = {
        "lr": 1e-3,
        "weight_decay": 0.1,
        "momentum": 0.95,
        "nesterov": True,
        "ns_coefficients": (3.4445, -4.775, 2.0315),
        "eps": 1e-7,
        "ns_steps": 5,
        "adjust_lr_fn": None,
        "ns_dtype": torch.bfloat16,
        "ns_method": "standard",
    }
    # Momentum is element-wise: prepare + finish is update() bit for bit (the same ops, the
    # element-wise ones on blocks)
    shards_state = True
    capturable_stacks = True
    per_head = True  # [Note: per-head Muon]

    @classmethod
    def check(cls, group: Mapping[str, Any], where: str, api: str) -> None:
        check_nonneg(api, group, "momentum", where)
        check_nonneg(api, group, "eps", where)
        check_int(api, group, "ns_steps", where, 0, 100)
        check_bool(api, group, "nesterov", where)
        ns_error = schedule_error(group["ns_coefficients"], group["ns_steps"])  # [Note: Newton-Schulz schedules]
        if ns_error is not None:
            fail(api, ns_error, where)
        if group["adjust_lr_fn"] not in _ADJUST_LR_FNS:
            fail(api, f"adjust_lr_fn must be one of {_ADJUST_LR_FNS}, got adjust_lr_fn={group['adjust_lr_fn']!r}",
                 where)
        ns_method = group.get("ns_method", "standard")
        if not isinstance(ns_method, str) or ns_method not in _NS_METHODS:
            fail(api, f"ns_method must be one of {_NS_METHODS}, got ns_method={ns_method!r}", where)
        if group["ns_dtype"] not in _NS_DTYPES:
            fail(api, f"ns_dtype must be torch.bfloat16 or torch.float32, got ns_dtype={group['ns_dtype']!r}", where)

    def _init_state(self, like: Tensor) -> dict[str, Any]:
        return {"momentum_buffer": torch.zeros_like(like, memory_format=torch.preserve_format)}

    # ----------------------------------------------------------------------------- one matrix
    def _momentum(self, grad: Tensor, state: dict[str, Any]) -> Tensor:
        """Advance the momentum (element-wise, any shape) and return what Newton-Schulz takes."""
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        momentum = self.group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if self.group["nesterov"] else buf

    # [Note: per-head Muon] A group with ``heads=H`` (``MatrixRule(heads=...)``, [Note: per-head
    # matrices] in ``planner/heads.py``) steps each 2-D matrix ``[H * d, D]`` as ``H`` matrices
    # ``[d, D]``. Momentum and decay are element-wise, so they run on the whole matrix and its
    # state keeps the parameter's shape (a state dict presents and reshards it as any matrix's);
    # Newton-Schulz runs per head, batched (``_orthos``), and the learning rate is the head
    # shape's. That is ``torch.optim.Muon`` on ``H`` separate parameters, bitwise where the
    # backend's batched GEMM is its GEMM (float32 on this CPU). Every path below goes through
    # ``_orthogonalized``: per matrix, capturable, ``finish`` (hosts) and so ``update``.
    def heads_of(self, t: Tensor) -> int:
        """Heads of the per-head matrix ``t`` under this group (``0``: one matrix)."""
        h = self.group.get("heads")
        return h if h and h > 1 and t.ndim == 2 else 0

    def _orthogonalized(self, u: Tensor, heads: int) -> tuple[Tensor, torch.Size]:
        """Newton-Schulz of ``u``, per head with ``heads``, and the shape its lr ratio is of."""
        if not heads:
            return orthogonalize(u, self.group), u.shape
        rows, cols = u.shape
        mats = u.reshape(heads, rows // heads, cols)
        out = torch.empty(mats.shape, dtype=self.group["ns_dtype"], device=u.device)
        for chunk, ortho in self._orthos(mats):
            out[chunk] = ortho
        return out.view(rows, cols), mats.shape[1:]

    def increment(self, grad: Tensor, state: dict[str, Any], like: Tensor) -> Increment:
        # The local tensor is the whole matrix here, so its shape is the global one.
        ortho, shape = self._orthogonalized(self._momentum(grad, state), self.heads_of(like))
        return Increment(ortho, -adjusted_lr(self.group["lr"], self.group["adjust_lr_fn"], shape))

    def step_capturable(self, param: Tensor, grad: Tensor, state: dict[str, Any], count: StepCount = None) -> None:
        ortho, shape = self._orthogonalized(self._momentum(grad, state), self.heads_of(param))
        lr = lr_tensor(self.group["lr"], param)
        param.mul_(1 - lr * self.group["weight_decay"])
        # addcmul, not add(alpha=): no lr-dependent Python number reaches a kernel
        param.addcmul_(ortho, lr * -lr_ratio(self.group["adjust_lr_fn"], shape))

    # ----------------------------------------------------------------------------- split update
    def prepare(self, grad: Tensor, state: dict[str, Any], *, splits: int = 0) -> Tensor:
        if not splits:
            return self._momentum(grad, state)
        return self._momentum(matrices(grad, splits), state).view(grad.shape)

    def finish(self, prepared: Tensor, *, dtype: torch.dtype | None = None, splits: int = 0) -> Tensor:
        dtype = dtype or prepared.dtype
        lr, fn = self.group["lr"], self.group["adjust_lr_fn"]
        splits = splits or self.heads_of(prepared)  # a per-head matrix: a stack of one, H per slice
        if not splits:
            # as update() computes it: the same rounding as a whole-state host
            return Increment(orthogonalize(prepared, self.group), -adjusted_lr(lr, fn, prepared.shape)).update(dtype)
        mats = matrices(prepared, splits)
        out = torch.empty(mats.shape, dtype=dtype, device=prepared.device)
        alpha = -(lr * lr_ratio(fn, mats.shape[1:]))
        for chunk, ortho in self._orthos(mats):
            out[chunk] = Increment(ortho, alpha).update(dtype)
        return out.view(prepared.shape)

    def update(self, grad: Tensor, state: dict[str, Any], *, dtype: torch.dtype | None = None,
               splits: int = 0) -> Tensor:
        return self.finish(self.prepare(grad, state, splits=splits), dtype=dtype or grad.dtype, splits=splits)

    # ----------------------------------------------------------------------------- stacks, groups
    def _orthos(self, mats: Tensor) -> Iterator[tuple[slice, Tensor]]:
        """Newton-Schulz of each matrix of ``mats`` (``[m, rows, cols]``), batched in chunks of
        bounded bytes (``ns_chunks``), one chunk at a time: ``(chunk, its orthogonalized)``."""
        m, rows, cols = mats.shape
        for chunk in ns_chunks(m, rows, cols, self.group["ns_dtype"], mats.device):
            if chunk.stop - chunk.start == 1:  # one matrix: the 2-D iteration (mm, bitwise the rule's)
                yield chunk, orthogonalize(mats[chunk.start], self.group).unsqueeze(0)
            else:
                yield chunk, orthogonalize(mats[chunk], self.group)

    def step_stack(self, param: Tensor, grad: Tensor, state: dict[str, Any], splits: int) -> None:
        """The rule on each matrix of a stack (see [Note: expert optimizer state] in
        ``optim/_expert_step.py``): the per-matrix op sequence with every element-wise op run once over
        the stack and Newton-Schulz batched (``bmm``/``baddbmm``) in chunks of bounded bytes. Where
        the backend's batched GEMM equals its GEMM (float32 on this CPU) it is bitwise the rule on
        each matrix alone, i.e. ``n * splits`` separate 2-D parameters."""
        mats, grads = matrices(param, splits), matrices(grad, splits)
        update = self._momentum(grads, state)  # element-wise: the whole stack at once
        group, capturable = self.group, self.capturable
        lr = lr_tensor(group["lr"], mats) if capturable else group["lr"]
        mats.mul_(1 - lr * group["weight_decay"])
        ratio = lr_ratio(group["adjust_lr_fn"], mats.shape[1:])
        for chunk, ortho in self._orthos(update):
            if capturable:  # no lr-dependent Python number reaches a kernel
                mats[chunk].addcmul_(ortho, lr * -ratio)
            else:
                mats[chunk].add_(ortho, alpha=-(lr * ratio))

    def step_group(self, items: Sequence[tuple[Tensor, Tensor, dict[str, Any]]],
                   counts: Sequence[StepCount] | None = None) -> None:
        if not self.group.get("batched", False) or self.group.get("heads"):
            # (per-head matrices: Newton-Schulz batched across each matrix's heads instead)
            super().step_group(items, counts)
            return
        # [Note: batched Muon] the per-matrix op sequence, each element-wise op one foreach call
        # over the group and each Newton-Schulz product one bmm/baddbmm per chunk of same-shape
        # matrices. Chunks are ns_chunks' (bounded bytes, as an expert stack's): each chunk's
        # updates are made, cast into one ns_dtype stack as it is filled, orthogonalized, applied
        # and freed before the next, so the step's transients are one chunk's, not every matrix's
        # update, stack and its cast copy at once (an owner of 1/8 of Qwen3-8B: ~8 GB before).
        group = self.group
        states = [state for _, _, state in items]
        for state, (_, grad, _) in zip(states, items):
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        params = [param for param, _, _ in items]
        grads = [grad for _, grad, _ in items]
        bufs = [state["momentum_buffer"] for state in states]
        momentum = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        buckets: dict[tuple[Any, ...], list[int]] = {}
        for i, b in enumerate(bufs):  # (an update has its buffer's shape, dtype and device)
            buckets.setdefault((tuple(b.shape), b.dtype, b.device), []).append(i)
        capturable = self.capturable
        lr = lr_tensor(group["lr"], params[0]) if capturable else group["lr"]
        _adamw.foreach_scale_(params, 1 - lr * group["weight_decay"])  # one fused kernel per dtype
        ns_dtype = group["ns_dtype"]
        for (shape, _, device), index in buckets.items():
            ratio = lr_ratio(group["adjust_lr_fn"], torch.Size(shape))
            chunks = ns_chunks(len(index), shape[0], shape[1], ns_dtype, device) if len(index) > 1 else [slice(0, 1)]
            for chunk in chunks:
                part = index[chunk]
                updates = [bufs[i] for i in part]
                if group["nesterov"]:
                    updates = torch._foreach_lerp([grads[i] for i in part], updates, momentum)
                if len(index) == 1:  # nothing to batch: the per-matrix iteration, bitwise
                    orthos = [orthogonalize(updates[0], group)]
                else:  # (a one-matrix chunk too: the batched bits of the others)
                    stack = torch.empty((len(part), *shape), dtype=ns_dtype, device=device)
                    torch._foreach_copy_(list(stack.unbind(0)), updates)  # cast as we stack
                    del updates
                    orthos = list(_orthogonalize_(stack, group).unbind(0))
                targets = [params[i] for i in part]
                if capturable:
                    torch._foreach_addcmul_(targets, orthos, [lr * -ratio] * len(targets))
                else:
                    torch._foreach_add_(targets, orthos, alpha=-(lr * ratio))
                del orthos
