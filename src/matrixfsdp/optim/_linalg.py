"""Symmetric-matrix helpers shared by Shampoo and SOAP: eigendecomposition and inverse roots."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

__all__ = ["eigh", "inverse_root", "tf32_matmuls"]


class _AllowTF32:
    """Sets ``torch.backends.cuda.matmul.allow_tf32`` for a block and restores it."""

    def __enter__(self) -> None:
        self._saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc: Any) -> None:
        torch.backends.cuda.matmul.allow_tf32 = self._saved


def tf32_matmuls(enabled: bool, t: Tensor) -> contextlib.AbstractContextManager[Any]:
    """A block whose float32 CUDA matmuls may use TF32 tensor cores, if ``enabled`` and ``t`` is
    on CUDA; otherwise (and on every CPU) nothing changes. The global flag is restored after."""
    return _AllowTF32() if enabled and t.is_cuda else contextlib.nullcontext()


def eigh(a: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` (ascending eigenvalues) in ``a``'s dtype, retried in float64 on failure.

    Why the retry: float32 ``eigh`` occasionally fails to converge on ill-conditioned factors
    (mostly on GPU); float64 almost never does. The result is cast back to ``a.dtype``.
    """
    try:
        return torch.linalg.eigh(a)
    except torch.linalg.LinAlgError:
        if a.dtype == torch.float64:
            raise
        evals, evecs = torch.linalg.eigh(a.to(torch.float64))
        return evals.to(a.dtype), evecs.to(a.dtype)


def inverse_root(a: Tensor, root: int, epsilon: float) -> Tensor:
    """``(a + epsilon I)^(-1/root)`` of a symmetric PSD ``a``, by eigendecomposition.

    Eigenvalues are clamped at 0 first (round-off makes tiny ones negative), so this is
    ``Q diag((max(lambda, 0) + epsilon)^(-1/root)) Q^T``. Only the lower triangle of ``a`` is read.
    """
    evals, evecs = eigh(a)
    scale = evals.clamp(min=0).add(epsilon).pow(-1.0 / root)
    return (evecs * scale) @ evecs.T
