"""The warning for parameter-list optimizers on a ``fully_shard`` model (issue 20).

``Optimizer(model.parameters())`` cannot see modules: with ``algorithm="auto"`` a plain 2D tensor
gets the matrix rule, but on a sharded model the owner plan decides, and the plan makes
embeddings and heads element-wise (AdamW). The routing cannot agree both ways (an evenly sharded
embedding has no whole matrix to orthogonalize), so the mismatch is reported once, here.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..placement.owner import FQN_ATTR
from ..placement.stepping import planned_kind

__all__ = ["warn_if_list_routing_differs"]

_SHOWN = 8


def _sharded_elementwise(p: Any) -> bool:
    """A 2D parameter that "auto" sends to AdamW only because fully_shard's plan said so (the
    routing's own question: a TP-hosted matrix is a DTensor that "auto" steps whole)."""
    return p.ndim == 2 and planned_kind(p) == "elementwise"


def warn_if_list_routing_differs(opt: Any) -> None:
    name, rule = type(opt).__name__, opt.rule
    hits = []
    for gi, group in enumerate(opt.param_groups):
        if group["algorithm"] != "auto":
            continue
        for pi, p in enumerate(group["params"]):
            if _sharded_elementwise(p):
                label = getattr(p, FQN_ATTR, None) or f"param group {gi} #{pi}"
                hits.append(f"{label} {tuple(p.shape)}")
    if not hits:
        return
    more = f" and {len(hits) - _SHOWN} more" if len(hits) > _SHOWN else ""
    warnings.warn(
        f"{name}(params): on a matrixfsdp.fully_shard model, algorithm='auto' routes "
        f"{len(hits)} 2D parameter(s) to AdamW because the owner plan made them element-wise: "
        f"{hits[:_SHOWN]}{more}; the same call on the plain model gives them the {rule!r} rule, so "
        f"the two runs train differently. Pass the model itself ({name}(model): one rule, sharded "
        "or plain) or put these parameters in a group with algorithm='adamw'",
        UserWarning,
        stacklevel=4,  # the user's call (helper, MatrixOptimizer.__init__, Muon.__init__)
    )
