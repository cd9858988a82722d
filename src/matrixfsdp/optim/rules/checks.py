"""Hyperparameter checks shared by the rule classes and the optimizers' group checks.

Every check raises ``ValueError("<Optimizer>: <key> must be ..., got <key>=<value><where>")``:
``api`` is the optimizer's class name, ``where`` names the param group (``""`` for constructor
arguments, so their errors name no group). Hyperparameters are Python numbers; ``lr`` and
``adamw_lr`` may be 0-dim tensors in capturable groups.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping, NoReturn

from torch import Tensor

__all__ = ["fail", "is_real", "check_nonneg", "check_lr", "check_betas", "check_beta", "check_int", "check_bool"]


def is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def fail(api: str, msg: str, where: str) -> NoReturn:
    raise ValueError(f"{api}: {msg}{where}")


def check_nonneg(api: str, group: Mapping[str, Any], key: str, where: str, *, optional: bool = False) -> None:
    v = group[key]
    if optional and v is None:
        return
    if not is_real(v) or not v >= 0:
        fail(api, f"{key} must be a float >= 0, got {key}={v!r}", where)


def check_lr(api: str, group: Mapping[str, Any], key: str, where: str, *, optional: bool = False) -> None:
    v = group[key]
    if not isinstance(v, Tensor) or not group.get("capturable", False):
        check_nonneg(api, group, key, where, optional=optional)  # a Tensor: "must be a float"
        return
    if v.ndim != 0 or not v.is_floating_point() or v.requires_grad:
        fail(api, f"a Tensor {key} must be a 0-dim floating tensor without grad, got {key}={v!r}", where)
    if not float(v) >= 0:  # construction only: one read of the value
        fail(api, f"{key} must be >= 0, got {key}={v!r}", where)


def check_betas(api: str, group: Mapping[str, Any], key: str, where: str, *, allow_one: bool = False) -> None:
    v = group[key]
    ok = isinstance(v, (tuple, list)) and len(v) == 2 and all(is_real(b) for b in v)
    if ok:
        ok = all(0.0 <= b < 1.0 for b in v) if not allow_one else (0.0 <= v[0] < 1.0 and 0.0 <= v[1] <= 1.0)
    if not ok:
        rng = "[0, 1) and [0, 1]" if allow_one else "[0, 1)"
        fail(api, f"{key} must be two floats in {rng}, got {key}={v!r}", where)


def check_beta(api: str, group: Mapping[str, Any], key: str, where: str, *, optional: bool = False) -> None:
    v = group[key]
    if optional and v is None:
        return
    if not is_real(v) or not 0.0 <= v < 1.0:
        fail(api, f"{key} must be a float in [0, 1), got {key}={v!r}", where)


def check_int(api: str, group: Mapping[str, Any], key: str, where: str, lo: int, hi: int | None = None) -> None:
    v = group[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v >= hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
        fail(api, f"{key} must be an int {rng}, got {key}={v!r}", where)


def check_bool(api: str, group: Mapping[str, Any], key: str, where: str) -> None:
    """A flag that groups saved before it existed may lack (read as False)."""
    v = group.get(key, False)
    if not isinstance(v, bool):
        fail(api, f"{key} must be a bool, got {key}={v!r}", where)
