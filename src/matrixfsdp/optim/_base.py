"""Shared machinery of the matrix optimizers: routing, the AdamW rule, local tensors, state dicts.

Every optimizer here is one ``torch.optim.Optimizer`` that holds *all* of a model's parameters and
routes each one, per param group, either to its matrix rule (Muon, Shampoo, SOAP) or to AdamW:

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

The AdamW rule reads ``adamw_lr`` / ``adamw_betas`` / ``adamw_eps`` / ``adamw_weight_decay`` from
the same group; ``adamw_lr=None`` and ``adamw_weight_decay=None`` (the defaults) mean "the group's
``lr`` / ``weight_decay``", read at every step, so LR schedulers that edit ``group["lr"]`` drive
both rules. Hyperparameters are Python numbers, validated at construction and in
``add_param_group``; errors name the optimizer, the value seen and, for a per-group value, the
group index. ``lr`` and ``adamw_lr`` may be 0-dim tensors in groups with ``capturable=True``.

[Note: capturable and batched steps]
Two per-group options change how a group is stepped, never what it computes beyond round-off:

* ``capturable=True``: the step reads no Python number that changes between steps. Learning
  rates may be 0-dim tensors (an LR scheduler then writes them in place; keep them on the
  parameters' device, see [Note: one lr tensor per group]), step counters live on
  the parameter's device, bias corrections and step sizes are tensor arithmetic, and nothing in
  ``step()`` reads a device value (no ``.item()``). Data-independent schedules (Shampoo's root
  recomputations, SOAP's basis refreshes) follow a host-side count of each parameter's steps,
  rebuilt from the state in ``load_state_dict``. ``torch.compile(opt.step)`` with a tensor ``lr``
  then compiles once for the steady state, whatever the scheduler does; a Python-float ``lr``
  recompiles as it changes. Why this matters: with float learning rates, inductor (torch 2.13) can
  bake the value seen when a graph was traced into the kernel as ``alpha`` and silently reuse it
  (``benchmarks/repro/compile_muon_lr.py``); the capturable step never passes an lr-dependent
  Python number to a kernel.
* ``batched=True``: element-wise parameters take one ``torch._foreach_*`` AdamW (the same op
  sequence as the single-tensor rule), and Muon stacks same-shape matrices into one batched
  Newton-Schulz (see :class:`~matrixfsdp.optim.Muon`).

The default (both False) is the per-parameter step, bitwise as documented on each optimizer.
The first ``step()`` of an optimizer without state may check its gradients on the host
([Note: state-initialization step]); compile or capture from the second step on.

State dicts are torch's. Step counters are 0-dim float32 CPU tensors, as in ``torch.optim.AdamW``
(on the parameter's device in capturable groups, as torch's ``capturable=True``);
:meth:`MatrixOptimizer.load_state_dict` keeps Shampoo/SOAP statistics in their saved float32
instead of casting them to a bf16 parameter's dtype. For DTensor parameters ``state_dict()``
presents the (local) state as DTensors with the parameter's layout, so ``torch.distributed.checkpoint``
saves and reshards it like FSDP2's; see [Note: optimizer state in state dicts] in
``optim/state_dict.py``.

[Note: local tensors]
Under matrixfsdp a parameter may be a ``DTensor``. Routing looks at its *global* shape
(``p.ndim``/``p.shape``); the update runs in place on the local tensor (``to_local()`` under
``no_grad`` aliases the local shard). A 2D matrix is owned whole by one rank: its local tensor is
either the full matrix (owner) or empty ``[0, n]`` (everyone else). Empty local tensors are
skipped before any state is created, so non-owners pay nothing. A matrix rule seeing any other
local shape raises. ``step()`` only touches plain local tensors, so it never communicates,
except that TP-hosted matrices go to their TP host step (two all-to-alls per micro-group within
a TP row; see :meth:`MatrixOptimizer.step` and [Note: update-rule protocol] in ``optim/rule.py``).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from itertools import chain
from typing import Any, Callable, ClassVar, NoReturn

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..placement.owned_tensor import local_tensor  # one local-tensor helper for the package
from ..placement.owner import FQN_ATTR, PLACEMENT_ATTR, owner_of
from ..placement.stepping import check_planned, expert_splits_of, planned_kind, stepping_of  # the one descriptor optimizers ask
from ..placement.tp_host import tp_host_of
from ._adamw import adamw_foreach, adamw_foreach_capturable, adamw_step, lr_tensor, new_step_counter
from ._expert_step import init_stacked, loop_step, matrices, route_name
from .rule import UpdateRule

__all__ = ["MatrixOptimizer", "local_tensor", "wide_dtype", "is_real", "lr_tensor", "ADAMW_DEFAULTS", "STEP_FLAGS"]

#: Default AdamW hyperparameters of the element-wise rule (documented on each optimizer).
ADAMW_DEFAULTS: dict[str, Any] = {
    "adamw_lr": None,
    "adamw_betas": (0.9, 0.999),
    "adamw_eps": 1e-8,
    "adamw_weight_decay": None,
}



def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of Shampoo/SOAP statistics: at least float32 (bf16 factors lose the spectrum)."""
    return torch.promote_types(dtype, torch.float32)


def is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


#: Per-group step options (see [Note: capturable and batched steps]); absent in state dicts saved
#: before they existed, hence always read with ``group.get(key, False)``.
STEP_FLAGS = ("capturable", "batched")


class _GroupRule:
    """One rule of one param group of an optimizer, as an :class:`~matrixfsdp.optim.UpdateRule`
    (see [Note: update-rule protocol] in ``optim/rule.py``): the optimizer's own per-parameter step
    and a runtime's (TP host) step run the same code. Hyperparameters are read from the group at
    every call."""

    __slots__ = ("_opt", "_group", "name")

    def __init__(self, opt: "MatrixOptimizer", group: dict[str, Any], name: str) -> None:
        self._opt, self._group, self.name = opt, group, name

    def __repr__(self) -> str:
        return f"{type(self._opt).__name__}.rule({self.name!r})"

    def init_state(self, like: Tensor) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.name == "adamw":
            self._opt._adamw_init_state(like, state, self._group)
        else:
            self._opt._matrix_init_state(like, state, self._group)
        return state

    def step(self, param: Tensor, grad: Tensor, state: dict[str, Any]) -> None:
        self._step(param, grad, state, self._group)

    def _step(self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        if self.name == "adamw":
            self._opt._adamw_step(param, grad, state, group)
        else:
            self._opt._matrix_step(param, grad, state, group)

    def update(self, grad: Tensor, state: dict[str, Any], *, dtype: torch.dtype | None = None) -> Tensor:
        # the step on a zero matrix without decay: what it becomes is the additive update (every
        # rule here is W <- W * (1 - lr * wd) + update)
        out = torch.zeros(tuple(grad.shape), dtype=dtype or grad.dtype, device=grad.device)
        self._step(out, grad, state, {**self._group, "weight_decay": 0.0, "adamw_weight_decay": 0.0})
        return out

    def decay(self) -> tuple[Any, Any]:
        if self.name == "adamw":
            return self._opt._adamw_lr_wd(self._group)
        return self._group["lr"], self._group.get("weight_decay", 0.0)

    @property
    def shards_state(self) -> bool:
        return self.name != "adamw" and self._opt.shards_matrix_state

    def prepare(self, grad: Tensor, state: dict[str, Any]) -> Tensor:
        self._require_split("prepare")
        return self._opt._matrix_prepare(grad, state, self._group)

    def finish(self, prepared: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
        self._require_split("finish")
        return self._opt._matrix_finish(prepared, dtype or prepared.dtype, self._group)

    def _require_split(self, what: str) -> None:
        if not self.shards_state:
            raise TypeError(f"{self!r}.{what}: this rule keeps whole-matrix state (shards_state is False); "
                            "step it with update() on the whole gradient")


class MatrixOptimizer(Optimizer):
    """Base class: routes each parameter to ``_matrix_step`` or to AdamW (see module docstring).

    Subclasses set ``rule`` (the name accepted in ``group["algorithm"]``), implement
    ``_matrix_step`` and ``_check_rule_hparams``, and set ``wide_state`` when their matrix state is
    kept in :func:`wide_dtype` rather than the parameter's dtype.
    """

    rule: ClassVar[str]
    wide_state: ClassVar[bool] = False
    #: the matrix rule's state is element-wise and ``_matrix_prepare``/``_matrix_finish`` split
    #: its update (see [Note: state on the shards] in ``optim/rule.py``)
    shards_matrix_state: ClassVar[bool] = False
    #: State keys that appear later in training, ``{key: key it accompanies}``; see
    #: [Note: optimizer state in state dicts].
    _state_placeholders: ClassVar[dict[str, str]] = {}

    def __init__(self, params: Any, defaults: dict[str, Any], adamw: dict[str, Any],
                 matrix_rule: Any = None) -> None:
        from ..planner.rules import check_rule

        defaults = {**defaults, "algorithm": "auto", "experts": None, **adamw}
        # Constructor arguments first, so their errors name no group.
        self._check_hparams(defaults, "")
        rule = check_rule(matrix_rule, type(self).__name__)
        from_module = isinstance(params, torch.nn.Module)
        if from_module:
            params = self._module_groups(params, rule)
        elif matrix_rule is not None:
            raise ValueError(f"{type(self).__name__}: matrix_rule routes the parameters of a model; pass the "
                             f"model itself ({type(self).__name__}(model, matrix_rule=...)), not parameters")
        elif not isinstance(params, Tensor):  # (torch's own check refuses a bare tensor)
            params = list(params)
        #: the groups being added were written by the user as dicts (see _refuse_elementwise)
        self._explicit_groups = (not from_module and isinstance(params, list) and bool(params)
                                 and isinstance(params[0], dict))
        #: ids of owned parameters whose owner (another rank) has state (see present_state)
        self._remote_state: set[int] = set()
        #: host-side step counts of capturable groups (see [Note: host step counts])
        self._step_calls: dict[str, int] = {"calls": 2}  # a dict, from 2: see [Note: host step counts]
        self._host_offsets: dict[Tensor, int] = {}
        #: capturable groups' learning rates on their parameters' device (see [Note: one lr
        #: tensor per group])
        self._lr_tensors: dict[tuple[int, str, torch.device, torch.dtype], Tensor] = {}
        super().__init__(params, defaults)
        self._explicit_groups = True  # later add_param_group calls
        for group in self.param_groups:  # the routing invariant (see [Note: routing invariant])
            for p in group["params"]:
                check_planned(p, f"{type(self).__name__} construction")
        if not from_module:
            from ._list_routing import warn_if_list_routing_differs

            warn_if_list_routing_differs(self)

    def _module_groups(self, model: torch.nn.Module, rule: Any) -> list[dict[str, Any]]:
        """``Optimizer(model)`` routes every parameter by the planner's rule (see [Note: one routing
        rule] in ``planner/rules.py``), sharded or not: 2D weights and routers get the matrix rule,
        expert stacks the matrix rule per expert matrix, embeddings, output heads and everything
        else AdamW. On a sharded model the owner plan's decision is used (the same rule unless the
        plan was built with another ``matrix_filter`` or ``matrix_rule``), so a plain reference run
        and a sharded run of the same model step every parameter alike, in the same param groups:
        matrices, expert stacks (one group per ``splits``, key ``"experts"``), AdamW.
        ``Optimizer(model.parameters())`` with ``algorithm="auto"`` cannot see modules: there a
        plain 2D tensor gets the matrix rule (embeddings and heads included)."""
        from ..planner.rules import head_rows_of, moe_structure

        head_rows, structure = head_rows_of(model), moe_structure(model)
        matrix, rest = [], []
        stacks: dict[int, list[Tensor]] = {}
        for fqn, p in model.named_parameters():
            planned = planned_kind(p)  # owned, TP-hosted, an expert stack or evenly sharded: the plan decided
            if planned is not None:
                kind, splits = planned, expert_splits_of(p)
            else:
                kind, splits = rule.kind(fqn, p, model.get_submodule(fqn.rpartition(".")[0]), head_rows, structure)
            if kind == "experts":
                stacks.setdefault(splits, []).append(p)
            else:
                (matrix if kind == "matrix" else rest).append(p)
        groups = [dict(params=matrix, algorithm=self.rule)]
        groups += [dict(params=stacks[k], algorithm=self.rule, experts=k) for k in sorted(stacks)]
        groups.append(dict(params=rest, algorithm="adamw"))
        return [g for g in groups if g["params"]]

    # ----------------------------------------------------------------------------- validation
    def _fail(self, msg: str, where: str) -> NoReturn:
        raise ValueError(f"{type(self).__name__}: {msg}{where}")

    def _check_nonneg(self, group: dict[str, Any], key: str, where: str, *, optional: bool = False) -> None:
        v = group[key]
        if optional and v is None:
            return
        if not is_real(v) or not v >= 0:
            self._fail(f"{key} must be a float >= 0, got {key}={v!r}", where)

    def _check_lr(self, group: dict[str, Any], key: str, where: str, *, optional: bool = False) -> None:
        v = group[key]
        if not isinstance(v, Tensor) or not group.get("capturable", False):
            self._check_nonneg(group, key, where, optional=optional)  # a Tensor: "must be a float"
            return
        if v.ndim != 0 or not v.is_floating_point() or v.requires_grad:
            self._fail(f"a Tensor {key} must be a 0-dim floating tensor without grad, got {key}={v!r}", where)
        if not float(v) >= 0:  # construction only: one read of the value
            self._fail(f"{key} must be >= 0, got {key}={v!r}", where)

    def _check_betas(self, group: dict[str, Any], key: str, where: str, *, allow_one: bool = False) -> None:
        v = group[key]
        ok = isinstance(v, (tuple, list)) and len(v) == 2 and all(is_real(b) for b in v)
        if ok:
            ok = all(0.0 <= b < 1.0 for b in v) if not allow_one else (0.0 <= v[0] < 1.0 and 0.0 <= v[1] <= 1.0)
        if not ok:
            rng = "[0, 1) and [0, 1]" if allow_one else "[0, 1)"
            self._fail(f"{key} must be two floats in {rng}, got {key}={v!r}", where)

    def _check_beta(self, group: dict[str, Any], key: str, where: str, *, optional: bool = False) -> None:
        v = group[key]
        if optional and v is None:
            return
        if not is_real(v) or not 0.0 <= v < 1.0:
            self._fail(f"{key} must be a float in [0, 1), got {key}={v!r}", where)

    def _check_int(self, group: dict[str, Any], key: str, where: str, lo: int, hi: int | None = None) -> None:
        v = group[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v >= hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
            self._fail(f"{key} must be an int {rng}, got {key}={v!r}", where)

    def _check_hparams(self, group: dict[str, Any], where: str) -> None:
        algorithms = ("auto", self.rule, "adamw")
        if group["algorithm"] not in algorithms:
            self._fail(f"algorithm must be one of {algorithms}, got algorithm={group['algorithm']!r}", where)
        for key in STEP_FLAGS:
            if not isinstance(group.get(key, False), bool):
                self._fail(f"{key} must be a bool, got {key}={group[key]!r}", where)
        experts = group.get("experts")
        if experts is not None and (isinstance(experts, bool) or not isinstance(experts, int) or experts < 1):
            self._fail("experts must be None or the number of matrices per expert (an int >= 1) of the "
                       f"group's 3-D expert stacks, got experts={experts!r}", where)
        self._check_lr(group, "lr", where)
        self._check_nonneg(group, "weight_decay", where)
        self._check_lr(group, "adamw_lr", where, optional=True)
        self._check_betas(group, "adamw_betas", where)
        self._check_nonneg(group, "adamw_eps", where)
        self._check_nonneg(group, "adamw_weight_decay", where, optional=True)
        self._check_rule_hparams(group, where)

    def _check_rule_hparams(self, group: dict[str, Any], where: str) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # fills in the defaults
        try:
            self._check_group(len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    def _check_group(self, index: int) -> None:
        group = self.param_groups[index]
        where = f" (param group {index})"
        self._check_hparams(group, where)
        for p in group["params"]:
            if torch.is_complex(p):
                self._fail(f"complex parameters are not supported, got dtype={p.dtype}", where)
            self._refuse_elementwise(group, p, index)
            route = self._route(group, p)
            if route != "adamw":
                splits = self._expert_splits(group, p, route)
                if splits:
                    self._check_stack(p, splits, index, group)
                    continue
                if p.ndim != 2:
                    self._fail(
                        f"param group {index} asks for the {self.rule!r} rule, which takes 2D "
                        f"matrices and expert stacks, but holds a parameter of shape {tuple(p.shape)} "
                        "that is neither; put it in a group with algorithm='adamw', or, if it is a "
                        "3-D stack of expert matrices [E, out, in], in a group with experts=1 (or the "
                        "number of matrices fused per expert); Optimizer(model) routes a model's "
                        "expert stacks itself",
                        "",
                    )
                self._check_whole(p, local_tensor(p), index)

    def _refuse_elementwise(self, group: dict[str, Any], p: Tensor, index: int) -> None:
        """An explicit request for the matrix rule is honoured or refused, never rerouted (see
        [Note: routing invariant] in ``planner/rules.py``): a group naming the matrix rule, or an
        ``"auto"`` group the user wrote whose 2-D parameter (the plain model's shape rule) or 3-D
        parameter with ``experts`` set (the expert rule) would get it, holding a parameter the
        owner plan made element-wise. Same plan, same answer on every rank."""
        if planned_kind(p) != "elementwise" or p.ndim not in (2, 3):
            return
        if getattr(p, PLACEMENT_ATTR, None) is None and owner_of(p) is None:
            return  # a stock FSDP2/TP DTensor: no matrixfsdp plan to contradict (_check_whole speaks)
        algorithm = group["algorithm"]
        if algorithm == "auto":
            if not self._explicit_groups or not (p.ndim == 2 or group.get("experts")):
                return  # Optimizer(params) with a bare list: the warning of _list_routing.py
            how = "(algorithm='auto' on an explicit parameter list, where the plain model gives it that rule)"
        elif algorithm == self.rule:
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
            f"{type(self).__name__}: param group {index} asks for the {self.rule!r} rule for {name!r} of shape "
            f"{tuple(p.shape)} {how}, but {reason}: it is stored element-wise (evenly sharded or an owned "
            f"tail) and would be stepped by AdamW; {fix}, or put it in a group with algorithm='adamw'; "
            f"{type(self).__name__}(model) routes every parameter as the plan does"
        )

    def _check_stack(self, p: Tensor, splits: int, index: int, group: dict[str, Any]) -> None:
        """An expert stack under the matrix rule: 3-D, rows dividing by ``splits``, whole experts
        here (see [Note: expert optimizer state] in ``optim/_expert_step.py``)."""
        if p.ndim != 3 or p.shape[1] % splits:
            self._fail(f"param group {index} steps a parameter of shape {tuple(p.shape)} as an expert stack "
                       f"with {splits} matrices per expert, which needs a 3-D [E, out, in] stack whose out "
                       f"divides by {splits}; fix the group's experts= value", "")
        local = local_tensor(p)
        if local.numel() != 0 and tuple(local.shape[1:]) != tuple(p.shape[1:]):
            self._fail(f"param group {index} holds an expert stack of global shape {tuple(p.shape)} whose "
                       f"local tensor {tuple(local.shape)} splits its experts; shard it with "
                       "matrixfsdp.fully_shard (whole experts per rank) or keep it unsharded", "")
        if group.get("capturable", False) and type(self)._experts_step is MatrixOptimizer._experts_step:
            self._fail(f"param group {index} is capturable and holds an expert stack, which "
                       f"{type(self).__name__}'s capturable step does not take yet; use capturable=False "
                       "for the group of expert stacks", "")

    def _expert_splits(self, group: dict[str, Any], p: Tensor, route: str | None = None) -> int:
        """Matrices per expert if ``p`` is stepped as an expert stack under ``group``'s matrix rule
        (the plan's, else the group's ``experts``), else 0 (AdamW-routed included; ``route``:
        ``p``'s, when the caller has it)."""
        if (route or self._route(group, p)) == "adamw":
            return 0
        planned = expert_splits_of(p)
        if planned:
            return planned
        if p.ndim == 3 and planned_kind(p) is None:  # a plain stack: its group says
            return group.get("experts") or 0
        return 0

    # ----------------------------------------------------------------------------- routing
    def _route(self, group: dict[str, Any], p: Tensor) -> str:
        """``"adamw"`` or ``self.rule``; ``p.ndim`` is the global one for a DTensor.

        ``"auto"`` follows the owner plan when the parameter was sharded by
        ``matrixfsdp.fully_shard``: the matrix rule for placement ``"matrix"``, AdamW for owned
        tails and for evenly sharded tensors (embeddings, heads: the plan's ``matrix_filter``
        decided). A plain tensor goes by its shape: 2D gets the matrix rule.
        """
        algorithm = group["algorithm"]
        if algorithm == "auto":
            planned = planned_kind(p)  # TP-hosted, owned, an expert stack or evenly sharded: the plan decided
            if planned is not None:
                return self.rule if planned in ("matrix", "experts") else "adamw"
            return self.rule if p.ndim == 2 or (p.ndim == 3 and group.get("experts")) else "adamw"
        return algorithm

    def _check_whole(self, p: Tensor, local: Tensor, index: int) -> None:
        if stepping_of(p).hosted:
            return  # stepped whole on its TP host (see [Note: TP hosts])
        if local.numel() != 0 and local.shape != p.shape:
            raise ValueError(
                f"{type(self).__name__}: the {self.rule!r} rule needs the whole matrix on one rank "
                f"(or an empty local tensor on non-owners), but a parameter of param group {index} "
                f"has global shape {tuple(p.shape)} and local shape {tuple(local.shape)}"
            )

    def _routed(self) -> Iterator[tuple[int, dict[str, Any], Tensor, str]]:
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                yield index, group, p, self._route(group, p)

    def _rule(self, group: dict[str, Any], route: str) -> _GroupRule:
        return _GroupRule(self, group, route)

    def _stepping(self, p: Tensor, group: dict[str, Any] | None = None, route: str | None = None) -> Any:
        """``stepping_of(p)`` as this optimizer steps ``p``: its rule says whether a hosted
        matrix's state may stay on the shards (see [Note: state on the shards] in ``optim/rule.py``)."""
        if not self.shards_matrix_state or tp_host_of(p) is None:
            return stepping_of(p)  # the rule cannot change the answer: no group lookup
        if route is None:
            if group is None:
                group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
            route = self._route(group, p)
        return stepping_of(p, elementwise_state=route != "adamw")

    def state_on_shards(self, param: Tensor) -> bool:
        """Whether ``param`` is a hosted matrix whose state this optimizer keeps on every rank's
        shard, like an evenly sharded parameter's (Muon's momentum under ``fully_shard``'s
        adaptive placement), rather than whole on its host (see [Note: state on the shards] in
        ``optim/rule.py``). Checkpoint loaders shape their buffers by it."""
        return self._stepping(param).state_on_shards

    def rule_for(self, param: Tensor) -> "UpdateRule":
        """The update rule that steps ``param`` (its param group's matrix rule or AdamW, as
        routed), as an :class:`~matrixfsdp.optim.UpdateRule`; see [Note: update-rule protocol].

        Example::

            rule = opt.rule_for(model.blocks[0].mlp.up.weight)   # rule.name == "muon"
        """
        for group in self.param_groups:
            if any(q is param for q in group["params"]):
                return self._rule(group, self._route(group, param))
        raise ValueError(f"{type(self).__name__}.rule_for: the tensor (shape {tuple(param.shape)}) is not a "
                         "parameter of this optimizer")

    # ----------------------------------------------------------------------------- step
    # [Note: compiled steps and sources]
    # Under ``torch.compile(opt.step)`` dynamo names each object by the first path the trace
    # reached it through (its source) and keeps that name. A parameter first met as a key of
    # ``self.state`` (a dict keyed by tensors) has a dict-key source, and dynamo (torch 2.13,
    # ``match_on_id_for_tensor`` in ``_dynamo/guards.py``) guards every tensor reached from it by
    # identity, ``p.grad`` included. ``zero_grad()`` and each backward of ``fully_shard`` or
    # ``replicate`` give new gradient tensors, so every step found its graph invalidated ("Cache
    # line invalidated because ...grad got deallocated") and recompiled, up to the recompile
    # limit. So ``step()`` reads ``param_groups`` before ``self.state`` (dynamo builds every
    # parameter of an Optimizer's groups, with param_groups sources, at the first read of that
    # attribute; torch's own optimizers get this order from dynamo's ``_init_group`` special
    # case), and so does the step pre-hook ``replicate.register_optimizer`` adds, traced first.
    # ``benchmarks/repro/compile_sharded_step.py`` shows it: 5 compiles in 5 calls, or 1.
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs a single optimization step.

        Collectives: none, except for TP-hosted matrices (``matrixfsdp.tp``, fully_shard + TP),
        which go to their TP host step: two ``all_to_all_single`` per micro-group within this
        rank's TP row (its owner's row under fully_shard; counted by comm/'s collectives,
        ``matrixfsdp.tp.comm_counter(model)``), and nothing across data parallelism. Every
        other parameter is stepped on its local tensor."""
        if any(stepping_of(p).hosted for group in self.param_groups for p in group["params"]):
            return self._eager_step(closure)  # see _eager_step
        return self._step_all(closure)

    def _step_all(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]  # before self.state,
        if any(g.get("capturable", False) for g in self.param_groups):
            self._step_calls["calls"] += 1  # see [Note: host step counts]
        if not self.state and self._is_state_init_call(params):  # see [Note: compiled steps and sources]
            self._init_states()
            return loss
        for index, group in enumerate(self.param_groups):
            if group.get("capturable", False) or group.get("batched", False):
                self._group_step(index, group)
                continue
            self._loop_step(index, group)
        return loss

    # An optimizer holding hosted matrices steps eagerly under torch.compile(opt.step): their host
    # step is a collective between ranks, and a traced step around it (graph breaks inside the
    # loops) stepped other parameters wrongly (1e-3 off the eager step after 3 steps with an LR
    # scheduler, 4e-4 without; tests/fully_shard/test_hosted.py). Eager, it is the eager step.
    _eager_step = torch._dynamo.disable(_step_all, recursive=True,
                                        reason="matrixfsdp: an optimizer with hosted matrices steps eagerly")

    def _loop_step(self, index: int, group: dict[str, Any]) -> None:
        """The default step of one group: one parameter at a time; TP-hosted matrices go to
        their executor (see [Note: TP hosts])."""
        hosted: dict[int, tuple[Any, list[tuple[Tensor, _GroupRule]]]] = {}
        rules = {name: self._rule(group, name) for name in ("adamw", self.rule)}
        for p in group["params"]:
            route = self._route(group, p)
            st = self._stepping(p, route=route)
            if st.executor is not None:
                # either rule: the host steps the whole matrix and keeps its whole state (an
                # "adamw" group's TP matrices too: stepped shard by shard here, only the host's
                # shard would move, the host keeping the only, shard-shaped, state); Muon under
                # fully_shard's hosting keeps its momentum on every rank's rows instead
                # (st.state_on_shards; [Note: state on the shards] in optim/rule.py)
                hosted.setdefault(id(st.executor), (st.executor, []))[1].append((p, rules[route]))
            if st.hosted or not st.keeps_state:  # stepped by its TP host, or by its owner
                # reduced_elsewhere: under HSDP split this rank holds it but got no gradient
                if (p.grad is not None or st.reduced_elsewhere) and not st.keeps_state:
                    self._note_remote(p, st)
                continue
            param = local_tensor(p)
            if p.grad is None or param.numel() == 0:
                if p.grad is not None and expert_splits_of(p):
                    self._remote_state.add(id(p))  # an expert stack with no expert here
                continue  # no gradient, or an empty even shard
            grad = local_tensor(p.grad)
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            splits = self._expert_splits(group, p, route)
            if splits:
                self._experts_step(param, grad, self.state[p], group, splits)
                continue
            if route != "adamw":
                self._check_whole(p, param, index)
            rules[route].step(param, grad, self.state[p])
        for executor, items in hosted.values():  # a collective within each TP row, in group order
            executor.step(items, self.state)

    def _group_step(self, index: int, group: dict[str, Any]) -> None:
        """A capturable and/or batched group (see [Note: capturable and batched steps])."""
        adamw: list[tuple[Tensor, Tensor, Tensor]] = []
        matrix: list[tuple[Tensor, Tensor, Tensor]] = []
        if any(stepping_of(p).hosted for p in group["params"]):
            raise ValueError(
                f"{type(self).__name__}: param group {index} holds hosted matrices (TP-hosted, "
                "matrixfsdp.tp; or hosted over data parallelism by plan_owners(placement='auto')), "
                "which the capturable and batched steps do not support yet; use capturable=False, "
                "batched=False for that group, or plan with placement='owned'"
            )
        stacks: list[tuple[Tensor, Tensor, int]] = []
        for p in group["params"]:
            st = stepping_of(p)
            if p.grad is None or not st.keeps_state:
                if p.grad is not None or st.reduced_elsewhere:  # another rank owns it: no state, no compute here
                    self._note_remote(p, st)
                elif p in self._host_offsets:
                    self._host_offsets[p] += 1  # no step: its count stays
                continue
            param = local_tensor(p)
            if param.numel() == 0:
                if expert_splits_of(p):
                    self._remote_state.add(id(p))  # an expert stack with no expert here
                continue  # an empty even shard
            splits = self._expert_splits(group, p)
            if splits:
                stacks.append((p, param, splits))
                continue
            grad = local_tensor(p.grad)
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if self._route(group, p) == "adamw":
                adamw.append((p, param, grad))
            else:
                self._check_whole(p, param, index)
                matrix.append((p, param, grad))
        if not group.get("capturable", False):
            self._group_step_on(group, adamw, matrix, stacks)
            return
        devices: list[torch.device] = []
        for _, param, _ in chain(adamw, matrix, stacks):
            if param.device not in devices:
                devices.append(param.device)
        if len(devices) == 1:  # the usual case
            self._group_step_on(self._device_lrs(index, group, devices[0]), adamw, matrix, stacks)
            return
        for device in devices:
            self._group_step_on(self._device_lrs(index, group, device), *(
                [it for it in items if it[1].device == device] for items in (adamw, matrix, stacks)))

    def _group_step_on(self, group: dict[str, Any], adamw: list[tuple[Tensor, Tensor, Tensor]],
                       matrix: list[tuple[Tensor, Tensor, Tensor]], stacks: list[tuple[Tensor, Tensor, int]]) -> None:
        if adamw:
            self._adamw_group(adamw, group)
        if matrix:
            self._matrix_group(matrix, group)
        for p, param, splits in stacks:
            self._experts_step(param, local_tensor(p.grad), self.state[p], group, splits)

    # [Note: one lr tensor per group]
    # A capturable step computes with its learning rates as 0-dim tensors on the parameters'
    # device. Made per matrix from a float or a CPU tensor (``torch.tensor(lr, device=...)``,
    # ``lr.to(device)``), each would be a pageable host-to-device copy: on CUDA a stall per matrix,
    # and CUDA-graph capture fails. So each capturable group keeps one tensor per device and rate,
    # refreshed once per step with ``fill_`` (the value travels as a kernel argument: no copy, no
    # sync), and the step reads the group through a view holding those tensors. A tensor ``lr``
    # already on the device is used as it is: that is the one to capture a CUDA graph with (a
    # filled value would be frozen into the graph). Values are the ones ``lr_tensor`` makes: a
    # float as float64, a tensor in its own dtype, so results are bitwise as before.
    def _device_lrs(self, index: int, group: dict[str, Any], device: torch.device) -> dict[str, Any]:
        """``group`` with ``lr`` and ``adamw_lr`` as 0-dim tensors on ``device`` (see the Note)."""
        view = dict(group)
        for key in ("lr", "adamw_lr"):
            lr = group.get(key)
            if lr is None or (isinstance(lr, Tensor) and lr.device == device):
                continue
            dtype = lr.dtype if isinstance(lr, Tensor) else torch.float64
            cached = self._lr_tensors.get((index, key, device, dtype))
            if cached is None:
                cached = self._lr_tensors[(index, key, device, dtype)] = torch.empty((), dtype=dtype, device=device)
            view[key] = cached.fill_(lr)
        return view

    def _adamw_group(self, items: list[tuple[Tensor, Tensor, Tensor]], group: dict[str, Any]) -> None:
        """AdamW on a group's element-wise parameters: foreach when batched or capturable."""
        capturable = group.get("capturable", False)
        for p, param, _ in items:
            if not self.state[p]:
                self._adamw_init_state(param, self.state[p], group)
        states = [self.state[p] for p, _, _ in items]
        lr, wd = self._adamw_lr_wd(group)
        beta1, beta2 = group["adamw_betas"]
        (adamw_foreach_capturable if capturable else adamw_foreach)(
            [param for _, param, _ in items],
            [grad for _, _, grad in items],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=group["adamw_eps"],
            weight_decay=wd,
        )

    def _matrix_group(self, items: list[tuple[Tensor, Tensor, Tensor]], group: dict[str, Any]) -> None:
        """The matrix rule on a capturable and/or batched group; Muon batches, others loop."""
        capturable = group.get("capturable", False)
        for p, param, grad in items:
            if capturable:
                self._capturable_matrix_step(p, param, grad, self.state[p], group)
            else:
                self._matrix_step(param, grad, self.state[p], group)

    def _capturable_matrix_step(
        self, p: Tensor, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """``_matrix_step`` without host reads of changing values (``p`` keys the host step count)."""
        raise NotImplementedError

    def _experts_step(self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any],
                      splits: int) -> None:
        """Step the expert stack ``param`` (``[n, out, in]``, local) as its ``n * splits`` matrices
        (see [Note: expert optimizer state] in ``optim/_expert_step.py``): one at a time through
        ``_matrix_step`` on views of the stacked state; Muon overrides it with a batched step."""
        mats = matrices(param, splits)
        if not state:
            state.update(self._expert_init_state(mats, group))
        loop_step(lambda w, g, st: self._matrix_step(w, g, st, group), mats, matrices(grad, splits), state)

    def _expert_init_state(self, mats: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        """The stacked state a first step of the matrices ``mats`` (``[m, rows, cols]``) starts from."""
        def one(like: Tensor) -> dict[str, Any]:
            st: dict[str, Any] = {}
            self._matrix_init_state(like, st, group)
            return st

        return init_stacked(one, mats)

    # [Note: host step counts] Shampoo's and SOAP's schedules branch on each parameter's step
    # count, which a capturable step must not read from the device. The host keeps it as
    # ``self._step_calls["calls"] - self._host_offsets[p]``: one optimizer-wide call count, incremented at
    # the start of every step() of an optimizer with a capturable group, and a per-parameter
    # offset that changes only when the parameter misses a step. So during a call the count is
    # the step number that call performs (the state's ``step`` after its increment), and between
    # calls it is the state's ``step``. Why not one int per parameter: under torch.compile each
    # changing int is a guard; this way only ``_step_calls`` changes, it is read from the first
    # call on (the state-creating call included), and dynamo makes it dynamic at the second
    # compile instead of recompiling per value. It starts at 2: dynamo always specializes the
    # ints 0 and 1, so a count passing through them would cost a third compile (torch 2.15).
    # It lives in a dict because dynamo (torch 2.13) drops assignments to int attributes of an
    # Optimizer inside a compiled step (benchmarks/repro/compile_muon_lr.py shows it).
    def _host_step(self, p: Tensor, state: dict[str, Any]) -> int:
        """``p``'s step number in this call (see [Note: host step counts])."""
        offset = self._host_offsets.get(p)
        if offset is None:  # state from elsewhere than this optimizer's steps and loads: read it once
            self._set_host_step(p, int(state["step"].item()) + 1 if "step" in state else 1)
            offset = self._host_offsets[p]
        return self._step_calls["calls"] - offset

    def _set_host_step(self, p: Tensor, n: int) -> None:
        self._host_offsets[p] = self._step_calls["calls"] - n

    def _sync_host_steps(self) -> None:
        """Rebuild the host step counts from the state, between calls (reads each counter once)."""
        self._host_offsets = {}
        for group in self.param_groups:
            if not group.get("capturable", False):
                continue
            for p in group["params"]:
                state = self.state.get(p)
                if state and isinstance(state.get("step"), Tensor):
                    self._set_host_step(p, int(state["step"].item()))

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_step_calls", {"calls": 2})
        self.__dict__.setdefault("_host_offsets", {})
        self.__dict__.setdefault("_remote_state", set())
        self.__dict__.setdefault("_lr_tensors", {})
        for group in self.param_groups:
            for key in STEP_FLAGS:
                group.setdefault(key, False)
            group.setdefault("experts", None)

    # [Note: state-initialization step]
    # torch.distributed.checkpoint.state_dict.get_state_dict() "initializes" an optimizer with no
    # state by setting every gradient to zeros and every group's lr to 0 and calling step(), so
    # that DCP has state tensors to load into. A real step on zero gradients is not harmless here:
    # an explicit adamw_lr still applies weight decay, step counters advance (bias corrections
    # shift by one), and SOAP's first call would build its eigenbases from zero statistics. So
    # such a call (no state yet, every lr 0, every gradient all-zero) creates exactly the state a
    # first real step starts from -- zeros, counters at 0, SOAP marked "statistics pending" -- and
    # leaves every parameter untouched.
    def _is_state_init_call(self, params: list[Tensor]) -> bool:
        # DCP zeroes a learning rate as a number or a CPU tensor (torch.tensor(0.0)), never as a
        # tensor on an accelerator, which is not read: that would synchronize the device
        if any(isinstance(g["lr"], Tensor) and g["lr"].device.type != "cpu" for g in self.param_groups):
            return False
        if any(g["lr"] != 0 for g in self.param_groups):
            return False
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        # one host read per device for all the gradients, not one per gradient: on an
        # accelerator each read is a device sync, and a warm-up from lr 0 whose first gradients
        # are zeros (unused or frozen parameters) read them one by one
        by_device: dict[torch.device, list[Tensor]] = {}
        for g in grads:
            if g.numel():  # (empty shards: all zeros; and the inf-norm of an empty tensor raises)
                by_device.setdefault(g.device, []).append(g)
        for gs in by_device.values():
            # max |g| per gradient in one foreach call: nonzero iff g.any() (NaN included)
            if torch.stack(torch._foreach_norm(gs, float("inf"))).ne(0).any():
                return False
        return bool(grads)

    def _init_states(self) -> None:
        for _, group, p, route in self._routed():
            st = self._stepping(p, route=route)
            if not st.keeps_state:
                if p.grad is not None or st.reduced_elsewhere:
                    self._note_remote(p, st)
                continue
            param = local_tensor(p)
            if st.hosted and not st.state_on_shards:
                # a TP-hosted matrix, either rule: its host keeps whole-matrix state, not its
                # shard's (the initializers read only shape, dtype and device)
                param = param.new_empty(tuple(p.shape))
            if p.grad is None or (param.numel() == 0 and not st.state_on_shards):
                # (state on the shards: an empty row shard keeps empty state, as its step does)
                if p.grad is not None and expert_splits_of(p):
                    # as a step would: its state is on the ranks holding its experts, whose keys
                    # this rank presents (optim/state_dict.py) so DCP templates match across ranks
                    self._remote_state.add(id(p))
                continue
            splits = self._expert_splits(group, p, route)
            if splits:
                self.state[p].update(self._expert_init_state(matrices(param, splits), group))
                continue
            self.state[p].update(self._rule(group, route).init_state(param))
        self._sync_host_steps()

    def _note_remote(self, p: Tensor, st: Any = None) -> None:
        """An owned parameter stepped on its owner, a TP-hosted one on its host (every rank sees
        the same gradients, or under HSDP split its step replica's receipt): its state exists
        there."""
        if (st if st is not None else stepping_of(p)).single_keeper:
            self._remote_state.add(id(p))

    def _state_schema(self, p: Tensor, group: dict[str, Any], *, like: Tensor | None = None) -> dict[str, Any]:
        """The state keys (and global shapes, on ``meta``) the owner of ``p`` holds, with the
        placeholders its state dict adds; given ``like`` (``p``'s whole tensor), the state a first
        step starts from, allocated like it."""
        base = like if like is not None else torch.empty(tuple(p.shape), dtype=p.dtype, device="meta")
        route = self._route(group, p)
        splits = self._expert_splits(group, p, route)
        if splits:
            schema = self._expert_init_state(matrices(base, splits), group)
        else:
            schema = self._rule(group, route).init_state(base)
        for key, dep in self._state_placeholders.items():
            if key not in schema and isinstance(schema.get(dep), Tensor):
                schema[key] = torch.zeros_like(schema[dep])
        return schema

    def _step_counter(self, group: dict[str, Any] | None, like: Tensor) -> Tensor:
        """A new step counter: on the CPU, as torch's; on ``like``'s device in capturable groups."""
        if group is not None and group.get("capturable", False) and like.device.type != "meta":
            return new_step_counter(like.device)
        return new_step_counter()

    def _adamw_init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any] | None = None) -> None:
        state["step"] = self._step_counter(group, param)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _matrix_init_state(self, param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Create the state a first ``_matrix_step`` would start from (see the Note above)."""
        raise NotImplementedError

    def _matrix_prepare(self, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> Tensor:
        """The element-wise half of the matrix rule (``shards_matrix_state`` rules only)."""
        raise NotImplementedError

    def _matrix_finish(self, prepared: Tensor, dtype: torch.dtype, group: dict[str, Any]) -> Tensor:
        """The whole-matrix half of the matrix rule, without decay (``shards_matrix_state`` rules only)."""
        raise NotImplementedError

    @staticmethod
    def _adamw_lr_wd(group: dict[str, Any]) -> tuple[Any, Any]:
        """The AdamW rule's ``(lr, weight_decay)`` in ``group`` (``None`` means the group's own)."""
        lr = group["adamw_lr"] if group.get("adamw_lr") is not None else group["lr"]
        wd = group.get("adamw_weight_decay")
        return lr, wd if wd is not None else group.get("weight_decay", 0.0)

    def _adamw_step(self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        if not state:
            self._adamw_init_state(param, state)
        lr, wd = self._adamw_lr_wd(group)
        beta1, beta2 = group["adamw_betas"]
        adamw_step(
            param,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["step"],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=group["adamw_eps"],
            weight_decay=wd,
        )

    def _matrix_step(self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Update one whole, non-empty matrix ``param`` (a plain tensor) in place."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------- state dict
    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict; state of DTensor parameters is presented as DTensors (aliasing
        the local state) with the parameter's layout, so DCP can save and reshard it. Each param
        group records the rule of each of its parameters (``"routes"``), which
        :meth:`load_state_dict` checks."""
        from .state_dict import present_state

        sd = present_state(self, super().state_dict())
        routes = self._routes()
        # dtypes (Muon's ns_dtype) as strings: DCP's full state dicts only carry plain values
        sd["param_groups"] = [{**{k: str(v) if isinstance(v, torch.dtype) else v for k, v in g.items()},
                               "routes": r} for g, r in zip(sd["param_groups"], routes)]
        return sd

    def _routes(self) -> list[list[str]]:
        """Each parameter's rule, as state dicts record it (an expert stack's with its layout)."""
        def label(g: dict[str, Any], p: Tensor) -> str:
            route = self._route(g, p)
            splits = self._expert_splits(g, p, route)
            return route_name(route, splits) if splits else route

        return [[label(g, p) for p in g["params"]] for g in self.param_groups]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Torch's loader, except that wide (float32) matrix statistics keep their dtype.

        ``Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype,
        which would round Shampoo/SOAP float32 factors of a bf16 parameter to bf16. DTensor state
        (from :meth:`state_dict` or DCP) is reduced to its local tensor first.
        """
        from .state_dict import accept_state

        mine = self._routes()
        for i, saved in enumerate(state_dict["param_groups"]):
            got = saved.get("routes")
            if got is not None and i < len(mine) and list(got) != mine[i]:
                diff = [k for k, (a, b) in enumerate(zip(got, mine[i])) if a != b]
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: param group {i} was saved with other "
                    f"update rules than this optimizer applies (parameter {diff[0] if diff else len(got)}: "
                    f"saved {got[diff[0]] if diff else len(got)!r}, now "
                    f"{mine[i][diff[0]] if diff else len(mine[i])!r}); build both optimizers the same way, "
                    "e.g. Optimizer(model), which routes a sharded and a plain model alike"
                )
        def restore(k: str, v: Any) -> Any:  # "torch.float32" -> torch.float32 (see state_dict)
            if isinstance(v, str) and v.startswith("torch.") and any(
                    isinstance(g.get(k), torch.dtype) for g in self.param_groups):
                dt = getattr(torch, v.removeprefix("torch."), None)
                return dt if isinstance(dt, torch.dtype) else v
            return v

        state_dict = {**state_dict, "param_groups": [{k: restore(k, v) for k, v in g.items() if k != "routes"}
                                                     for g in state_dict["param_groups"]]}
        state_dict = accept_state(self, state_dict)
        super().load_state_dict(state_dict)
        self._sync_host_steps()
        if not self.wide_state:
            return
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in state_dict["param_groups"]),
                chain.from_iterable(g["params"] for g in self.param_groups),
            )
        )
        routes = {id(p): route for _, _, p, route in self._routed()}
        for key, saved in state_dict["state"].items():
            p = id_map.get(key)
            if p is None or routes[id(p)] == "adamw":
                continue
            device = local_tensor(p).device
            for name, value in saved.items():
                if name != "step" and isinstance(value, Tensor) and value.is_floating_point():
                    self.state[p][name] = value.to(device=device, dtype=wide_dtype(p.dtype), copy=True)
