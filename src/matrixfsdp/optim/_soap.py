"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al. 2024, arXiv:2409.11321).

Follows the paper's reference implementation (github.com/nikhilvyas/SOAP, ``soap.py``) for 2D
matrices; see :class:`SOAP` for the exact update and the few documented deviations (the rule is
``rules/soap.py``). All matrix state lives in :func:`~matrixfsdp.optim.rules.base.wide_dtype`
(float32 for bf16/fp16/fp32 parameters).
"""

from __future__ import annotations

from typing import Any

from ._base import ADAMW_DEFAULTS, MatrixOptimizer
from .rules.soap import SOAPRule, initial_eigenbasis, refreshed_eigenbasis

__all__ = ["SOAP"]

_D = SOAPRule.defaults


class SOAP(MatrixOptimizer):
    r"""SOAP (ShampoO with Adam in the Preconditioner's eigenbasis) for 2D matrices, AdamW elsewhere.

    Matrix rule for a parameter :math:`W` (m x n) with gradient :math:`G` (``b1, b2 = betas``,
    ``sb = shampoo_beta``, which defaults to ``b2``)::

        first call (statistics only, W is not touched, not even by weight decay):
            L <- (1 - sb) G G^T,  R <- (1 - sb) G^T G
            QL, QR <- eigenvectors of L, R by eigh, in descending eigenvalue order
            M, V <- 0 (shape m x n, kept in the eigenbasis);  t <- 0
        every later call:
            t  <- t + 1
            G' =  QL^T G QR
            M  <- b1 * M + (1 - b1) * G'                 (lerp)
            V  <- b2 * V + (1 - b2) * G'**2
            W  <- W * (1 - lr * weight_decay)           (decoupled weight decay)
            W  <- W - lr / (1 - b1**t) * QL (M / (sqrt(V / (1 - b2**t)) + eps)) QR^T
            L  <- L.lerp(G G^T, 1 - sb),  R <- R.lerp(G^T G, 1 - sb)       (after the update)
            if t % precondition_frequency == 0:                            (per side)
                order = argsort(diag(Q^T L Q), descending);  Q <- Q[:, order]
                V     <- V with that side's index permuted by order
                Q     <- orthonormal factor of QR(L Q)      (one power-iteration step)
                M     <- QL_new^T (QL_old M QR_old^T) QR_new   (M re-expressed in the new basis)

    A side longer than ``max_preconditioner_dim`` has no factor and its Q is the identity (both
    sides skipped: Adam with the first step skipped). With ``QL = QR = I`` the rule is AdamW
    (``betas``, ``eps``, ``weight_decay``) on the gradients from the second call on.

    Same as the reference: the first call only gathers statistics (so the current gradient is
    never used in its own projection); factors are updated after the step; eigenbases come from
    ``eigh`` once and then one power-iteration + QR step every ``precondition_frequency`` Adam
    steps; the second moment is permuted, not rotated, when the basis changes; ``eigh`` retries
    in float64 on failure. Deviations, none changing the algorithm's math beyond round-off except
    the last two (both O(eps) or O(lr^2 wd)):

    * the first moment stays in the eigenbasis and is rotated only when the basis changes (the
      reference projects it back and forth on every step, which is the same in exact arithmetic);
    * Adam's bias correction is torch's (``eps`` added after dividing ``sqrt(V)`` by
      ``sqrt(1 - b2**t)``; the reference adds ``eps`` before), which makes the identity-basis case
      exactly torch's AdamW;
    * weight decay is applied before the update, as AdamW (the reference applies it after);
    * no ``merge_dims``, ``precondition_1d``, ``normalize_grads``, ``correct_bias`` options
      (2D only; non-matrix parameters go to the AdamW rule).

    Routing and the AdamW rule for non-matrix parameters are as in :class:`~matrixfsdp.optim.Muon`
    (``algorithm`` = ``"auto"`` / ``"soap"`` / ``"adamw"`` per group).

    Args:
        params: parameters or param groups; a group may set any argument below plus ``algorithm``.
        lr: learning rate (default 3e-3, the paper's).
        betas: Adam ``(b1, b2)`` in the eigenbasis (default ``(0.95, 0.95)``).
        shampoo_beta: factor EMA decay; ``None`` (default) means ``betas[1]``.
        eps: Adam epsilon (default 1e-8).
        weight_decay: decoupled weight decay (default 0.01).
        precondition_frequency: Adam steps between eigenbasis refreshes (default 10).
        max_preconditioner_dim: sides longer than this get no factor (default 10000, the
            reference's ``max_precond_dim``).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW rule; ``adamw_lr=None``
            and ``adamw_weight_decay=None`` (defaults) mean the group's ``lr`` / ``weight_decay``;
            betas ``(0.9, 0.999)``, eps ``1e-8``.
        capturable: a step without host reads (``lr`` may be a 0-dim tensor, step counters on
            the parameter's device; basis refreshes follow a host-side step count), for
            ``torch.compile`` and CUDA graphs after the first call (default False); keep a tensor
            ``lr`` on the parameters' device (see :class:`~matrixfsdp.optim.Muon`).
        batched: step the element-wise parameters with one foreach AdamW (default False).
        allow_tf32: let the float32 GEMMs of CUDA parameters (projections into and out of the
            eigenbasis, ``G G^T``, ``G^T G``, the refresh's power step) use TF32 tensor cores;
            ``eigh`` and ``qr`` stay float32. No effect on the CPU (default False).

    State (per matrix, wide dtype): ``step`` (Adam steps, 0-dim float32 CPU tensor),
    ``exp_avg`` and ``exp_avg_sq`` (in the eigenbasis), ``L``/``R``, ``QL``/``QR``.

    Example::

        >>> from matrixfsdp.optim import SOAP
        >>> model = torch.nn.Linear(32, 16)
        >>> opt = SOAP(model.parameters(), lr=3e-3)
        >>> model(torch.randn(4, 32)).sum().backward()
        >>> opt.step()  # weight: SOAP (first call gathers statistics), bias: AdamW
        >>> opt = SOAP(model.parameters(), lr=torch.tensor(3e-3), capturable=True)  # compilable
    """

    rule = "soap"
    rule_class = SOAPRule
    # Eigenbasis hooks, which the rule calls (tests replace them on an instance to pin the basis).
    _initial_eigenbasis = staticmethod(initial_eigenbasis)
    _refreshed_eigenbasis = staticmethod(refreshed_eigenbasis)

    def __init__(
        self,
        params: Any,
        lr: float = _D["lr"],
        betas: tuple[float, float] = _D["betas"],
        shampoo_beta: float | None = _D["shampoo_beta"],
        eps: float = _D["eps"],
        weight_decay: float = _D["weight_decay"],
        precondition_frequency: int = _D["precondition_frequency"],
        max_preconditioner_dim: int = _D["max_preconditioner_dim"],
        *,
        adamw_lr: float | None = ADAMW_DEFAULTS["adamw_lr"],
        adamw_betas: tuple[float, float] = ADAMW_DEFAULTS["adamw_betas"],
        adamw_eps: float = ADAMW_DEFAULTS["adamw_eps"],
        adamw_weight_decay: float | None = ADAMW_DEFAULTS["adamw_weight_decay"],
        capturable: bool = False,
        batched: bool = False,
        allow_tf32: bool = _D["allow_tf32"],
        matrix_rule: Any = None,
    ) -> None:
        defaults = {
            "capturable": capturable,
            "batched": batched,
            "allow_tf32": allow_tf32,
            "lr": lr,
            "betas": betas,
            "shampoo_beta": shampoo_beta,
            "eps": eps,
            "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency,
            "max_preconditioner_dim": max_preconditioner_dim,
        }
        adamw = {
            "adamw_lr": adamw_lr,
            "adamw_betas": adamw_betas,
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": adamw_weight_decay,
        }
        super().__init__(params, defaults, adamw, matrix_rule)

    def _rule(self, group: dict[str, Any], route: str) -> Any:
        if route == "adamw":
            return super()._rule(group, route)
        return SOAPRule(group, type(self).__name__, initial_eigenbasis=self._initial_eigenbasis,
                        refreshed_eigenbasis=self._refreshed_eigenbasis)
