"""The checks of a param group at construction and in ``add_param_group``: its hyperparameters
(the common ones here, each rule's by its class) and what its parameters may be under the rule
they are routed to. Errors are ``ValueError``s naming the optimizer, the value seen and, for a
per-group value, the group index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..placement.owned_tensor import local_tensor
from ..placement.owner import FQN_ATTR, PLACEMENT_ATTR, owner_of
from ..placement.stepping import planned_kind, stepping_of
from .rules import AdamWRule
from .rules.checks import check_bool, fail

if TYPE_CHECKING:
    from ._base import MatrixOptimizer

__all__ = ["STEP_FLAGS", "check_hparams", "check_group", "check_whole", "refuse_hosted"]

#: Per-group step options (see [Note: capturable and batched steps] in ``optim/step_modes.py``);
#: absent in state dicts saved before they existed, hence always read with ``group.get(key, False)``.
STEP_FLAGS = ("capturable", "batched")


def check_hparams(opt: "MatrixOptimizer", group: dict[str, Any], where: str) -> None:
    """The group's options, its ``lr``/``weight_decay``, then AdamW's and the matrix rule's own."""
    api, rule = type(opt).__name__, opt.rule_class
    algorithms = ("auto", rule.name, "adamw")
    if group["algorithm"] not in algorithms:
        fail(api, f"algorithm must be one of {algorithms}, got algorithm={group['algorithm']!r}", where)
    for key in STEP_FLAGS:
        check_bool(api, group, key, where)
    experts = group.get("experts")
    if experts is not None and (isinstance(experts, bool) or not isinstance(experts, int) or experts < 1):
        fail(api, "experts must be None or the number of matrices per expert (an int >= 1) of the "
             f"group's 3-D expert stacks, got experts={experts!r}", where)
    heads = group.get("heads")
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
        fail(api, "heads must be None or the number of attention heads (an int >= 1) along the rows of "
             f"the group's per-head matrices, got heads={heads!r}", where)
    if heads is not None and heads > 1 and not getattr(rule, "per_head", False):
        fail(api, f"heads={heads} asks for per-head matrices, which only Muon steps (its momentum is "
             f"element-wise; {rule.name}'s statistics are whole-matrix); drop heads, or build the "
             "optimizer with a MatrixRule without heads", where)
    rule.check_common(group, where, api)
    AdamWRule.check(group, where, api)
    rule.check(group, where, api)


def check_group(opt: "MatrixOptimizer", index: int) -> None:
    """Group ``index``: its hyperparameters, then each parameter under the rule it is routed to."""
    group = opt.param_groups[index]
    check_hparams(opt, group, f" (param group {index})")
    api = type(opt).__name__
    for p in group["params"]:
        if torch.is_complex(p):
            fail(api, f"complex parameters are not supported, got dtype={p.dtype}", f" (param group {index})")
        _refuse_elementwise(opt, group, p, index)
        route = opt._route(group, p)
        if route == "adamw":
            continue
        splits = opt._expert_splits(group, p, route)
        if splits:
            _check_stack(opt, p, splits, index, group)
            continue
        heads = group.get("heads") or 1
        if p.ndim == 2 and p.shape[0] % heads:
            fail(api, f"param group {index} steps a parameter of shape {tuple(p.shape)} as {heads} per-head "
                 f"matrices (heads={heads}), but its rows do not divide by {heads}; put it in a group with "
                 "its own head count (MatrixRule.per_head(model) reads them from the model)", "")
        if p.ndim != 2:
            fail(api, f"param group {index} asks for the {opt.rule!r} rule, which takes 2D "
                 f"matrices and expert stacks, but holds a parameter of shape {tuple(p.shape)} "
                 "that is neither; put it in a group with algorithm='adamw', or, if it is a "
                 "3-D stack of expert matrices [E, out, in], in a group with experts=1 (or the "
                 "number of matrices fused per expert); Optimizer(model) routes a model's "
                 "expert stacks itself", "")
        opt._check_whole(p, local_tensor(p), index)


def check_whole(opt: "MatrixOptimizer", p: Tensor, local: Tensor, index: int) -> None:
    """A matrix-rule parameter is whole here or empty (its owner steps it), or TP-hosted."""
    if stepping_of(p).hosted:
        return  # stepped whole on its TP host (see [Note: TP hosts])
    if local.numel() != 0 and local.shape != p.shape:
        raise ValueError(
            f"{type(opt).__name__}: the {opt.rule!r} rule needs the whole matrix on one rank "
            f"(or an empty local tensor on non-owners), but a parameter of param group {index} "
            f"has global shape {tuple(p.shape)} and local shape {tuple(local.shape)}"
        )


def refuse_hosted(opt: "MatrixOptimizer", index: int, group: dict[str, Any]) -> None:
    """At a capturable or batched group's step: no hosted matrices (their steps are collectives)."""
    if any(stepping_of(p).hosted for p in group["params"]):
        raise ValueError(
            f"{type(opt).__name__}: param group {index} holds hosted matrices (TP-hosted, "
            "matrixfsdp.tp; or hosted over data parallelism by plan_owners(placement='auto')), "
            "which the capturable and batched steps do not support yet; use capturable=False, "
            "batched=False for that group, or plan with placement='owned'"
        )


def _refuse_elementwise(opt: "MatrixOptimizer", group: dict[str, Any], p: Tensor, index: int) -> None:
    """An explicit request for the matrix rule is honoured or refused, never rerouted (see
    [Note: routing invariant] in ``planner/rules.py``): a group naming the matrix rule, or an
    ``"auto"`` group the user wrote whose 2-D parameter (the plain model's shape rule) or 3-D
    parameter with ``experts`` set (the expert rule) would get it, holding a parameter the
    owner plan made element-wise. Same plan, same answer on every rank."""
    if planned_kind(p) != "elementwise" or p.ndim not in (2, 3):
        return
    if getattr(p, PLACEMENT_ATTR, None) is None and owner_of(p) is None:
        return  # a stock FSDP2/TP DTensor: no matrixfsdp plan to contradict (check_whole speaks)
    algorithm, api = group["algorithm"], type(opt).__name__
    if algorithm == "auto":
        if not opt._explicit_groups or not (p.ndim == 2 or group.get("experts")):
            return  # Optimizer(params) with a bare list: the warning of _list_routing.py
        how = "(algorithm='auto' on an explicit parameter list, where the plain model gives it that rule)"
    elif algorithm == opt.rule:
        if owner_of(p) is not None and p.ndim == 2:
            return  # an owned tail: its owner holds the whole matrix and honours the request
        how = f"(algorithm={algorithm!r})"
    else:
        return
    name = getattr(p, FQN_ATTR, None) or f"#{next(i for i, q in enumerate(group['params']) if q is p)}"
    if p.ndim == 3:
        reason = ("its plan did not take it for an expert stack (no router of its module scores its "
                  "experts, or MatrixRule(experts=False))")
        fix = (f"plan it as one: matrix_rule=MatrixRule(expert_stacks=({name.rpartition('.')[2]!r},)) to "
               "plan_owners and the optimizer (or to fully_shard without a plan)")
    else:
        reason = ("its plan made it element-wise (an embedding, an output head, a router under "
                  "MatrixRule(routers=False), or a plan's matrix_filter)")
        fix = "plan it as a matrix (plan_owners' matrix_filter or matrix_rule)"
    raise ValueError(
        f"{api}: param group {index} asks for the {opt.rule!r} rule for {name!r} of shape "
        f"{tuple(p.shape)} {how}, but {reason}: it is stored element-wise (evenly sharded or an owned "
        f"tail) and would be stepped by AdamW; {fix}, or put it in a group with algorithm='adamw'; "
        f"{api}(model) routes every parameter as the plan does"
    )


def _check_stack(opt: "MatrixOptimizer", p: Tensor, splits: int, index: int, group: dict[str, Any]) -> None:
    """An expert stack under the matrix rule: 3-D, rows dividing by ``splits``, whole experts
    here (see [Note: expert optimizer state] in ``optim/_expert_step.py``)."""
    api = type(opt).__name__
    if p.ndim != 3 or p.shape[1] % splits:
        fail(api, f"param group {index} steps a parameter of shape {tuple(p.shape)} as an expert stack "
             f"with {splits} matrices per expert, which needs a 3-D [E, out, in] stack whose out "
             f"divides by {splits}; fix the group's experts= value", "")
    local = local_tensor(p)
    if local.numel() != 0 and tuple(local.shape[1:]) != tuple(p.shape[1:]):
        fail(api, f"param group {index} holds an expert stack of global shape {tuple(p.shape)} whose "
             f"local tensor {tuple(local.shape)} splits its experts; shard it with "
             "matrixfsdp.fully_shard (whole experts per rank) or keep it unsharded", "")
    if group.get("capturable", False) and not opt.rule_class.capturable_stacks:
        fail(api, f"param group {index} is capturable and holds an expert stack, which "
             f"{api}'s capturable step does not take yet; use capturable=False "
             "for the group of expert stacks", "")
