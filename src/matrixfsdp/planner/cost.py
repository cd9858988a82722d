"""Cost models for the planner: optimizer-state bytes and optimizer FLOPs, per parameter.

All functions are pure over shapes. FLOP formulas count multiply-adds as 2 FLOPs.

* Newton-Schulz (Muon), as the MatrixFSDP/Canzona papers count it: ``5 * (4 m^2 n + 2 m^3)`` for an
  ``m x n`` matrix with ``m <= n`` (5 iterations of a Gram product, a Gram square and the update).
* Shampoo: per step the factor updates ``G G^T``, ``G^T G`` (``2 m^2 n + 2 m n^2``) and the
  preconditioned direction ``L^-1/4 G R^-1/4`` (``2 m^2 n + 2 m n^2``); every
  ``precondition_frequency`` steps two symmetric eigendecompositions, ``~10 d^3`` each (a
  tridiagonalization plus QR iterations, the usual dense estimate), amortized over the frequency.
* SOAP: the factor updates, the projection of the gradient into the eigenbasis and of the update
  back (``3 * (2 m^2 n + 2 m n^2)``), plus the amortized eigendecompositions.
* AdamW: ``~12`` FLOPs per element (two moment updates, bias corrections, sqrt, divide, decay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

__all__ = ["ParamInfo", "OPTIMIZERS", "COST_MODELS", "ELEMENTWISE_STATE", "state_nbytes", "param_cost",
           "resolve_cost"]

#: Optimizers whose state the planner can size; the element-wise rule is always AdamW.
OPTIMIZERS = ("muon", "shampoo", "soap", "adamw")
#: Matrix rules whose state is element-wise (Muon's momentum): a hosted matrix keeps it on its
#: row shards, not on its host (see [Note: state on the shards] in ``optim/rule.py``); Shampoo's
#: and SOAP's factors are whole-matrix state, kept on the host
ELEMENTWISE_STATE = frozenset({"muon"})
#: Built-in cost models; a callable ``f(ParamInfo) -> float`` is accepted too.
COST_MODELS = ("flops", "bytes", "numel")

_WIDE_ELEM = 4  # Shampoo's and SOAP's state: at least float32 (optim/rules/base.py wide_dtype)
_ADAMW_FLOPS_PER_ELEM = 12
_EIGH_FLOPS = 10


@dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """What a cost callable sees of one parameter."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    is_matrix: bool
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def _mn(shape: tuple[int, ...]) -> tuple[int, int]:
    a, b = shape
    return (a, b) if a <= b else (b, a)


def newton_schulz_flops(shape: tuple[int, ...], ns_steps: int = 5) -> float:
    m, n = _mn(shape)
    return ns_steps * (4 * m * m * n + 2 * m**3)


def shampoo_flops(shape: tuple[int, ...], precondition_frequency: int) -> float:
    m, n = _mn(shape)
    per_step = 2 * (2 * m * m * n + 2 * m * n * n)
    return per_step + _EIGH_FLOPS * (m**3 + n**3) / precondition_frequency


def soap_flops(shape: tuple[int, ...], precondition_frequency: int) -> float:
    m, n = _mn(shape)
    per_step = 3 * (2 * m * m * n + 2 * m * n * n)
    return per_step + _EIGH_FLOPS * (m**3 + n**3) / precondition_frequency


def state_nbytes(info: ParamInfo, optimizer: str) -> int:
    """Bytes of optimizer state kept for ``info`` (0 for frozen parameters), as matrixfsdp's
    optimizers keep it: Muon's momentum and AdamW's two moments in the parameter's dtype (as
    torch's ``Muon`` and ``AdamW``), Shampoo's and SOAP's state in at least float32."""
    if not info.requires_grad:
        return 0
    numel = info.numel
    if not info.is_matrix or optimizer == "adamw":
        return 2 * numel * info.itemsize  # exp_avg, exp_avg_sq
    m, n = info.shape
    if optimizer == "muon":
        return numel * info.itemsize  # momentum
    wide = max(_WIDE_ELEM, info.itemsize)
    if optimizer == "shampoo":
        # L, R, their inverse roots, plus Adam grafting (exp_avg_sq) and momentum.
        return (2 * (m * m + n * n) + 2 * numel) * wide
    if optimizer == "soap":
        # L, R, eigenbases QL, QR, plus Adam's two moments.
        return (2 * (m * m + n * n) + 2 * numel) * wide
    raise ValueError(f"plan_owners: optimizer must be one of {OPTIMIZERS}, got {optimizer=!r}")


def param_cost(
    info: ParamInfo, cost: str, optimizer: str, precondition_frequency: int
) -> float:
    """Cost of updating ``info`` once, in the built-in model ``cost``."""
    if cost == "numel":
        return float(info.numel)
    if cost == "bytes":
        return float(info.nbytes + state_nbytes(info, optimizer))
    # "flops"
    if not info.requires_grad:
        return 0.0
    if not info.is_matrix or optimizer == "adamw":
        return float(_ADAMW_FLOPS_PER_ELEM * info.numel)
    if optimizer == "muon":
        return float(newton_schulz_flops(info.shape))
    if optimizer == "shampoo":
        return float(shampoo_flops(info.shape, precondition_frequency))
    return float(soap_flops(info.shape, precondition_frequency))


def resolve_cost(
    cost: str | Callable[[ParamInfo], float], optimizer: str, precondition_frequency: int
) -> tuple[str, Callable[[ParamInfo], float]]:
    """Validate ``cost`` and return ``(name, fn)``; ``name`` goes into the plan."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"plan_owners: optimizer must be one of {OPTIMIZERS}, got {optimizer=!r}")
    if isinstance(precondition_frequency, bool) or not isinstance(precondition_frequency, int) or (
        precondition_frequency < 1
    ):
        raise ValueError(
            f"plan_owners: precondition_frequency must be an int >= 1, got {precondition_frequency=!r}"
        )
    if callable(cost):
        name = getattr(cost, "__qualname__", None) or type(cost).__name__

        def fn(info: ParamInfo) -> float:
            v = cost(info)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(
                    f"plan_owners: cost callable {name!r} must return a finite number >= 0, "
                    f"got {v!r} for {info.fqn!r}"
                )
            return float(v)

        return f"callable:{name}", fn
    if cost not in COST_MODELS:
        raise ValueError(
            f"plan_owners: cost must be one of {COST_MODELS} or a callable, got {cost=!r}"
        )
    return cost, lambda info: param_cost(info, cost, optimizer, precondition_frequency)
