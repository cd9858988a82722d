"""Which rule steps each parameter: the routing of the matrix optimizers (``optim/_base.py``).

Per param group:

* ``Optimizer(model)`` (an ``nn.Module``): the planner's rule, identical sharded or plain (see
  [Note: one routing rule]): block and root matrices get the matrix rule, embeddings, output
  heads and non-2D tensors AdamW;
* ``group["algorithm"] == "auto"`` (default for parameter lists): 2D parameters get the matrix
  rule, the rest AdamW; on a model sharded by ``matrixfsdp.fully_shard`` the owner plan decides
  instead (placement ``"matrix"`` gets the matrix rule; owned tails and evenly sharded tensors get
  AdamW). State dicts record each parameter's rule, and loading under other rules raises;
* ``group["algorithm"] == <rule name>``: every parameter of the group gets the matrix rule, and a
  non-2D parameter is a ``ValueError`` at construction;
* ``group["algorithm"] == "adamw"``: every parameter gets AdamW (embeddings, output heads, ...).

The functions take the optimizer as their first argument; ``MatrixOptimizer`` binds
:func:`route` and :func:`expert_splits` as its ``_route`` and ``_expert_splits`` methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..placement.stepping import expert_splits_of, planned_kind, stepping_of
from ..placement.tp_host import tp_host_of
from ._expert_step import route_name

if TYPE_CHECKING:
    from ._base import MatrixOptimizer

__all__ = ["route", "expert_splits", "stepping", "module_params", "routes"]


def route(opt: "MatrixOptimizer", group: dict[str, Any], p: Tensor) -> str:
    """``"adamw"`` or ``opt.rule``; ``p.ndim`` is the global one for a DTensor.

    ``"auto"`` follows the owner plan when the parameter was sharded by
    ``matrixfsdp.fully_shard``: the matrix rule for placement ``"matrix"``, AdamW for owned
    tails and for evenly sharded tensors (embeddings, heads: the plan's ``matrix_filter``
    decided). A plain tensor goes by its shape: 2D gets the matrix rule.
    """
    algorithm = group["algorithm"]
    if algorithm == "auto":
        planned = planned_kind(p)  # TP-hosted, owned, an expert stack or evenly sharded: the plan decided
        if planned is not None:
            return opt.rule if planned in ("matrix", "experts") else "adamw"
        return opt.rule if p.ndim == 2 or (p.ndim == 3 and group.get("experts")) else "adamw"
    return algorithm


def expert_splits(opt: "MatrixOptimizer", group: dict[str, Any], p: Tensor, route_: str | None = None) -> int:
    """Matrices per expert if ``p`` is stepped as an expert stack under ``group``'s matrix rule
    (the plan's, else the group's ``experts``), else 0 (AdamW-routed included; ``route_``:
    ``p``'s, when the caller has it)."""
    if (route_ or route(opt, group, p)) == "adamw":
        return 0
    planned = expert_splits_of(p)
    if planned:
        return planned
    if p.ndim == 3 and planned_kind(p) is None:  # a plain stack: its group says
        return group.get("experts") or 0
    return 0


def stepping(opt: "MatrixOptimizer", p: Tensor, group: dict[str, Any] | None = None, route: str | None = None) -> Any:
    """``stepping_of(p)`` as this optimizer steps ``p``: its rule says whether a hosted
    matrix's state may stay on the shards (see [Note: state on the shards] in ``optim/rule.py``)."""
    if not opt.rule_class.shards_state or tp_host_of(p) is None:
        return stepping_of(p)  # the rule cannot change the answer: no group lookup
    if route is None:
        if group is None:
            group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
        route = opt._route(group, p)
    return stepping_of(p, elementwise_state=route != "adamw")


def routes(opt: "MatrixOptimizer") -> list[list[str]]:
    """Each parameter's rule, as state dicts record it (an expert stack's with its layout)."""
    def label(g: dict[str, Any], p: Tensor) -> str:
        r = opt._route(g, p)
        splits = opt._expert_splits(g, p, r)
        if splits:
            return route_name(r, splits)
        heads = g.get("heads") or 1
        return f"{r}:heads/{heads}" if r != "adamw" and heads > 1 and p.ndim == 2 else r

    return [[label(g, p) for p in g["params"]] for g in opt.param_groups]


def module_params(opt: "MatrixOptimizer", params: Any, matrix_rule: Any) -> tuple[Any, bool]:
    """The param groups of ``Optimizer(params, matrix_rule=)``, and whether ``params`` was a model."""
    from ..planner.rules import check_rule

    name = type(opt).__name__
    rule = check_rule(matrix_rule, name)
    if isinstance(params, torch.nn.Module):
        return _module_groups(opt, params, rule), True
    if matrix_rule is not None:
        raise ValueError(f"{name}: matrix_rule routes the parameters of a model; pass the "
                         f"model itself ({name}(model, matrix_rule=...)), not parameters")
    return (params if isinstance(params, Tensor) else list(params)), False  # (torch refuses a bare tensor)


def _module_groups(opt: "MatrixOptimizer", model: torch.nn.Module, rule: Any) -> list[dict[str, Any]]:
    """``Optimizer(model)`` routes every parameter by the planner's rule (see [Note: one routing
    rule] in ``planner/rules.py``), sharded or not: 2D weights and routers get the matrix rule,
    expert stacks the matrix rule per expert matrix, embeddings, output heads and everything
    else AdamW. On a sharded model the owner plan's decision is used (the same rule unless the
    plan was built with another ``matrix_filter`` or ``matrix_rule``), so a plain reference run
    and a sharded run of the same model step every parameter alike, in the same param groups:
    matrices, per-head matrices (one group per head count, key ``"heads"``), expert stacks (one
    group per ``splits``, key ``"experts"``), AdamW.
    ``Optimizer(model.parameters())`` with ``algorithm="auto"`` cannot see modules: there a
    plain 2D tensor gets the matrix rule (embeddings and heads included)."""
    from ..planner.rules import head_rows_of, moe_structure

    head_rows, structure = head_rows_of(model), moe_structure(model)
    matrix, rest = [], []
    stacks: dict[int, list[Tensor]] = {}
    per_head: dict[int, list[Tensor]] = {}  # per-head matrices by head count ([Note: per-head Muon])
    for fqn, p in model.named_parameters():
        planned = planned_kind(p)  # owned, TP-hosted, an expert stack or evenly sharded: the plan decided
        if planned is not None:
            kind, splits = planned, expert_splits_of(p)
            if kind == "matrix" and p.ndim == 2:  # the rule's heads: plan with the same rule
                splits = rule.heads_of(fqn)
        else:
            kind, splits = rule.kind(fqn, p, model.get_submodule(fqn.rpartition(".")[0]), head_rows, structure)
        if kind == "experts":
            stacks.setdefault(splits, []).append(p)
        elif kind == "matrix" and splits > 1:
            per_head.setdefault(splits, []).append(p)
        else:
            (matrix if kind == "matrix" else rest).append(p)
    groups = [dict(params=matrix, algorithm=opt.rule)]
    groups += [dict(params=per_head[h], algorithm=opt.rule, heads=h) for h in sorted(per_head)]
    groups += [dict(params=stacks[k], algorithm=opt.rule, experts=k) for k in sorted(stacks)]
    groups.append(dict(params=rest, algorithm="adamw"))
    return [g for g in groups if g["params"]]
