"""Muon: momentum orthogonalized by a Newton-Schulz iteration, for whole 2D matrices.

The matrix rule (``rules/muon.py``) reproduces ``torch.optim.Muon`` (torch 2.13) op for op: with
the default ``ns_dtype=torch.bfloat16`` the parameter and momentum buffer bits match torch's. The
Newton-Schulz iteration (``newton_schulz.py``) is our own copy of torch's op sequence (same casts,
transposes and ``addmm`` calls), not an import of torch's private helper.
"""

from __future__ import annotations

from typing import Any

import torch

from ._adamw import foreach_scale_  # noqa: F401 (its import path before rules/muon.py)
from ._base import ADAMW_DEFAULTS, MatrixOptimizer
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
from .rules.muon import MuonRule, adjusted_lr, lr_ratio  # noqa: F401 (lr helpers re-exported)

__all__ = ["Muon"]

_D = MuonRule.defaults


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
            [Note: capturable and batched steps] in ``optim/step_modes.py``), for
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
    rule_class = MuonRule

    def __init__(
        self,
        params: Any,
        lr: float = _D["lr"],
        weight_decay: float = _D["weight_decay"],
        momentum: float = _D["momentum"],
        nesterov: bool = _D["nesterov"],
        ns_coefficients: tuple[float, float, float] = _D["ns_coefficients"],
        eps: float = _D["eps"],
        ns_steps: int = _D["ns_steps"],
        adjust_lr_fn: str | None = _D["adjust_lr_fn"],
        *,
        ns_dtype: torch.dtype = _D["ns_dtype"],
        ns_method: str = _D["ns_method"],
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
