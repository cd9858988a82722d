"""Muon: momentum orthogonalized by a Newton-Schulz iteration, for whole 2D matrices.

The matrix rule reproduces ``torch.optim.Muon`` (torch 2.13) op for op: with the default
``ns_dtype=torch.bfloat16`` the parameter and momentum buffer bits match torch's. The Newton-Schulz
iteration is our own copy of torch's op sequence (same casts, transposes and ``addmm`` calls), not
an import of torch's private helper.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ._adamw import foreach_scale_
from ._base import ADAMW_DEFAULTS, MatrixOptimizer, lr_tensor
from ._expert_step import matrices, ns_chunks
from .newton_schulz import (  # noqa: F401 (re-exported: their import path before newton_schulz.py)
    GRAM_RESTARTS,
    _batched_newtonschulz_,
    _gram_newtonschulz_,
    _newtonschulz_,
    _orthogonalize_,
    batched_newtonschulz,
    gram_newtonschulz,
    orthogonalize,
    schedule_error,
    zeropower_via_newtonschulz,
)

__all__ = ["Muon"]

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


class Muon(MatrixOptimizer):
    r"""Muon for 2D matrices, AdamW for everything else, in one optimizer.

    Matrix rule (per 2D parameter :math:`W` with gradient :math:`G`), identical to
    ``torch.optim.Muon`` (torch 2.13)::

        B  <- momentum * B + (1 - momentum) * G           (B = state["momentum_buffer"], B_0 = 0)
        U  <- G.lerp(B, momentum) if nesterov else B
        O  <- NewtonSchulz(U; ns_coefficients, ns_steps, eps) computed in ns_dtype
        W  <- W * (1 - lr * weight_decay)
        W  <- W - adjust(lr, shape) * O

    with ``adjust(lr) = lr * sqrt(max(1, rows/cols))`` for ``adjust_lr_fn=None``/``"original"`` and
    ``lr * 0.2 * sqrt(max(rows, cols))`` for ``"match_rms_adamw"``.

    Routing and the AdamW rule are described in :mod:`matrixfsdp.optim._base`: by default
    (``algorithm="auto"``) 2D parameters get Muon and all others AdamW; a group with
    ``algorithm="adamw"`` sends its 2D parameters (embeddings, output head) to AdamW too, and a
    group with ``algorithm="muon"`` must hold only 2D parameters. The AdamW rule is bitwise
    ``torch.optim.AdamW(foreach=False)``.

    Args:
        params: parameters or param groups; a group may set any argument below plus ``algorithm``.
        lr: Muon learning rate (default 1e-3).
        weight_decay: decoupled weight decay, ``W *= 1 - lr * weight_decay`` (default 0.1).
        momentum: momentum factor (default 0.95).
        nesterov: Nesterov-style momentum (default True).
        ns_coefficients: the Newton-Schulz schedule (default ``(3.4445, -4.775, 2.0315)``, torch's):
            three floats ``(a, b, c)``, one quintic for every iteration; ``"quintic"`` (that default,
            the same bits); ``"polar_express"`` (Polar Express, a different quintic at each of 5
            iterations, input divided by 1.02 times its norm; fewer ``ns_steps`` run its first
            ones, more continue with ``(15/8, -10/8, 3/8)``); ``"cubic5"`` (5 cubic iterations, 10
            matrix products instead of 15, ``ns_steps`` must be 5); or a list of ``(a, b, c)``
            triples, one per iteration, as many as ``ns_steps`` (``c=0``: a cubic iteration, two
            products). See "Newton-Schulz schedules" in docs/optimizers.md and
            [Note: Newton-Schulz schedules] in ``optim/newton_schulz.py``.
        eps: floor of the Frobenius norm that normalizes the input of Newton-Schulz (default 1e-7).
        ns_steps: Newton-Schulz iterations, in ``[0, 100)`` (default 5).
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"`` (default None).
        ns_dtype: dtype of the Newton-Schulz iteration, ``torch.bfloat16`` (default; bitwise
            torch; the choice on CUDA GPUs, where fp32 GEMMs without TF32 are several times
            slower) or ``torch.float32`` (more accurate). On CPUs it depends on the CPU: with AMX
            (``amx_bf16``) bf16 is the faster one (an Intel Xeon with AMX, torch 2.13: bf16 took
            0.24-0.36x the fp32 time on 1024x1024 to 2048x6144; ``benchmarks/gram_ns_bench.py``);
            without AMX or ``avx512_bf16``, bf16 matmul is much slower than fp32 (about 25x by
            earlier notes here), so choose float32 there.
        capturable: a step without host reads (``lr`` may be a 0-dim tensor; see
            [Note: capturable and batched steps] in ``optim/_base.py``), for
            ``torch.compile(opt.step)`` under an LR scheduler and CUDA graphs (default False).
            Keep a tensor ``lr`` on the parameters' device: it is then used as it is. A float or
            a CPU-tensor ``lr`` is written into one device scalar per group and step (``fill_``:
            no copy, no sync), whose value a CUDA graph would freeze.
        batched: stack same-shape matrices into batched Newton-Schulz and step the rest with
            ``torch._foreach_*`` kernels (default False: per matrix, bitwise torch). Stacks are
            cut into chunks of bounded bytes (``ns_chunks``: 64 MiB on accelerators, 1 MiB on the
            CPU), each cast to ``ns_dtype`` as it is stacked and freed before the next, so the
            step's transients are one chunk's ([Note: batched Muon]). The batched iteration is not
            bitwise the per-matrix one on every backend: on the CPU (MKL) the orthogonalized update
            differs by a few float32 ulp for most shapes with two threads.
        ns_method: ``"standard"`` (default: the iteration above, torch's) or ``"gram"``: the same
            polynomials (same ``ns_coefficients`` and ``ns_steps``, any schedule) evaluated on the small
            Gram matrix of a rectangular matrix, touching the matrix itself only at the start,
            at one restart and at the end ([Note: Gram Newton-Schulz]); square matrices take the
            standard iteration. Opt-in: it pays off for wide or tall matrices (aspect 3 and more)
            and in float32 equals the standard iteration to round-off, while in bfloat16 its
            distance from the float64 iteration is about twice the standard's. Measured on an
            Intel Xeon CPU with AMX: 0.66-0.75x the standard time in float32 at aspect 3-4
            (docs/optimizers.md). Per-matrix, batched, capturable and expert-stack steps.
        adamw_lr: AdamW learning rate; ``None`` (default) means the group's ``lr`` at each step.
        adamw_betas: AdamW betas (default ``(0.9, 0.999)``).
        adamw_eps: AdamW eps (default 1e-8).
        adamw_weight_decay: AdamW decoupled weight decay; ``None`` (default) means the group's
            ``weight_decay``.

    State (per matrix): ``momentum_buffer``, in the parameter's dtype, as torch's.

    Difference from torch 2.11-2.14: Newton-Schulz never writes its input. torch casts with
    ``.bfloat16()``, which for a bf16 parameter with ``nesterov=False`` returns the momentum buffer
    itself and normalizes it in place (the buffer ends every step at unit Frobenius norm, so the
    history weighs ``1 / ||B||`` against the new gradient, and the parameters differ from the
    second step on); here the buffer stays the plain EMA of gradients. torch 2.15 copies, as we do:
    its steps are ours bit for bit (``tests/optim/test_muon_bf16_buffer.py``).

    Example::

        >>> from matrixfsdp.optim import Muon
        >>> model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 32))
        >>> opt = Muon(
        ...     [
        ...         {"params": model[0].parameters(), "algorithm": "adamw"},  # embedding: AdamW
        ...         {"params": model[1].parameters()},  # weight: Muon, bias: AdamW
        ...     ],
        ...     lr=0.02,
        ...     adamw_lr=3e-4,
        ... )
        >>> model(torch.randint(0, 100, (4,))).sum().backward()
        >>> opt.step()

    Compiled, with a scheduler (a tensor ``lr`` on the parameters' device: one graph for every
    step after the first, no host-to-device copy of it, CUDA-graph capturable)::

        >>> device = next(model.parameters()).device  # e.g. cuda:0
        >>> opt = Muon(model.parameters(), lr=torch.tensor(0.02, device=device), capturable=True, batched=True)
        >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        >>> step = torch.compile(opt.step)
        >>> for _ in range(3):
        ...     model(torch.randint(0, 100, (4,))).sum().backward()
        ...     step(); sched.step(); opt.zero_grad()
    """

    rule = "muon"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        ns_method: str = "standard",
        adamw_lr: float | None = ADAMW_DEFAULTS["adamw_lr"],
        adamw_betas: tuple[float, float] = ADAMW_DEFAULTS["adamw_betas"],
        adamw_eps: float = ADAMW_DEFAULTS["adamw_eps"],
        adamw_weight_decay: float | None = ADAMW_DEFAULTS["adamw_weight_decay"],
        capturable: bool = False,
        batched: bool = False,
        matrix_rule: Any = None,
    ) -> None:
        defaults = {
            "capturable": capturable,
            "batched": batched,
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
            "ns_method": ns_method,
        }
        adamw = {
            "adamw_lr": adamw_lr,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        }
        super().__init__(params, defaults, adamw, matrix_rule)

    def _check_rule_hparams(self, group: dict[str, Any], where: str) -> None:
        self._check_nonneg(group, "momentum", where)
        self._check_nonneg(group, "eps", where)
        self._check_int(group, "ns_steps", where, 0, 100)
        if not isinstance(group["nesterov"], bool):
            self._fail(f"nesterov must be a bool, got nesterov={group['nesterov']!r}", where)
        ns_error = schedule_error(group["ns_coefficients"], group["ns_steps"])  # [Note: Newton-Schulz schedules]
        if ns_error is not None:
            self._fail(ns_error, where)
        if group["adjust_lr_fn"] not in _ADJUST_LR_FNS:
            self._fail(
                f"adjust_lr_fn must be one of {_ADJUST_LR_FNS}, got adjust_lr_fn={group['adjust_lr_fn']!r}", where
            )
        ns_method = group.get("ns_method", "standard")
        if not isinstance(ns_method, str) or ns_method not in _NS_METHODS:
            self._fail(f"ns_method must be one of {_NS_METHODS}, got ns_method={ns_method!r}", where)
        if group["ns_dtype"] not in _NS_DTYPES:
            self._fail(
                f"ns_dtype must be torch.bfloat16 or torch.float32, got ns_dtype={group['ns_dtype']!r}", where
            )

    def _matrix_init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _matrix_step(self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        update = self._matrix_prepare(grad, state, group)
        ortho = orthogonalize(update, group)
        # The local tensor is the whole matrix here, so its shape is the global one.
        lr = group["lr"]
        step_lr = adjusted_lr(lr, group["adjust_lr_fn"], param.shape)
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(ortho, alpha=-step_lr)

    # Momentum is element-wise: a hosted matrix keeps it on its row shards ([Note: state on the
    # shards] in optim/rule.py). prepare + finish is update() bit for bit: the same ops, the
    # element-wise ones on blocks.
    shards_matrix_state = True

    def _matrix_prepare(self, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    def _matrix_finish(self, prepared: Tensor, dtype: torch.dtype, group: dict[str, Any]) -> Tensor:
        ortho = orthogonalize(prepared, group)
        out = torch.zeros(tuple(prepared.shape), dtype=dtype, device=prepared.device)
        # as update() computes it (the step on zeros): the same rounding as a whole-state host
        return out.add_(ortho, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], prepared.shape))

    def _capturable_matrix_step(
        self, p: Tensor, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        update = self._matrix_prepare(grad, state, group)
        ortho = orthogonalize(update, group)
        lr = lr_tensor(group["lr"], param)
        param.mul_(1 - lr * group["weight_decay"])
        # addcmul, not add(alpha=): no lr-dependent Python number reaches a kernel
        param.addcmul_(ortho, lr * -lr_ratio(group["adjust_lr_fn"], param.shape))

    def _experts_step(self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any],
                      splits: int) -> None:
        """The rule on each matrix of an expert stack (see [Note: expert optimizer state] in
        ``optim/_expert_step.py``): the per-matrix op sequence with every element-wise op run once over
        the stack and Newton-Schulz batched (``bmm``/``baddbmm``) in chunks of bounded bytes. Where
        the backend's batched GEMM equals its GEMM (float32 on this CPU) it is bitwise the rule on
        each matrix alone, i.e. ``E * splits`` separate 2-D parameters."""
        mats, grads = matrices(param, splits), matrices(grad, splits)
        update = self._matrix_prepare(grads, state, group)  # element-wise: the whole stack at once
        capturable = group.get("capturable", False)
        lr = lr_tensor(group["lr"], mats) if capturable else group["lr"]
        mats.mul_(1 - lr * group["weight_decay"])
        ratio = lr_ratio(group["adjust_lr_fn"], mats.shape[1:])
        for chunk in ns_chunks(mats.shape[0], mats.shape[1], mats.shape[2], group["ns_dtype"], mats.device):
            if chunk.stop - chunk.start == 1:  # one matrix: the 2-D iteration (mm, bitwise the rule's)
                ortho = orthogonalize(update[chunk.start], group).unsqueeze(0)
            else:
                ortho = orthogonalize(update[chunk], group)
            if capturable:  # no lr-dependent Python number reaches a kernel
                mats[chunk].addcmul_(ortho, lr * -ratio)
            else:
                mats[chunk].add_(ortho, alpha=-(lr * ratio))

    def _matrix_group(self, items: list[tuple[Tensor, Tensor, Tensor]], group: dict[str, Any]) -> None:
        if not group.get("batched", False):
            super()._matrix_group(items, group)
            return
        # [Note: batched Muon] the per-matrix op sequence, each element-wise op one foreach call
        # over the group and each Newton-Schulz product one bmm/baddbmm per chunk of same-shape
        # matrices. Chunks are ns_chunks' (bounded bytes, as an expert stack's): each chunk's
        # updates are made, cast into one ns_dtype stack as it is filled, orthogonalized, applied
        # and freed before the next, so the step's transients are one chunk's, not every matrix's
        # update, stack and its cast copy at once (an owner of 1/8 of Qwen3-8B: ~8 GB before).
        states = [self.state[p] for p, _, _ in items]
        for state, (_, _, grad) in zip(states, items):
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        params = [param for _, param, _ in items]
        grads = [grad for _, _, grad in items]
        bufs = [state["momentum_buffer"] for state in states]
        momentum = group["momentum"]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        buckets: dict[tuple[Any, ...], list[int]] = {}
        for i, b in enumerate(bufs):  # (an update has its buffer's shape, dtype and device)
            buckets.setdefault((tuple(b.shape), b.dtype, b.device), []).append(i)
        capturable = group.get("capturable", False)
        lr = lr_tensor(group["lr"], params[0]) if capturable else group["lr"]
        foreach_scale_(params, 1 - lr * group["weight_decay"])  # one fused kernel per dtype
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
