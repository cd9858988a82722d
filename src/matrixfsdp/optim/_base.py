"""The matrix optimizers' router: each parameter to its update rule, and the steps that call them.

Every optimizer here is one ``torch.optim.Optimizer`` that holds *all* of a model's parameters and
routes each one, per param group, either to its matrix rule (Muon, Shampoo, SOAP) or to AdamW
(``group["algorithm"]``: ``"auto"``, the rule's name or ``"adamw"``; ``Optimizer(model)`` routes
by the planner's rule; see ``optim/routing.py``). The rules are classes (``optim/rules/``,
[Note: update rules as classes]) that own their hyperparameters, state layout and steps; AdamW reads
``adamw_lr`` / ``adamw_betas`` / ``adamw_eps`` / ``adamw_weight_decay`` from the same group
(``None``: the group's ``lr`` / ``weight_decay``, read at every step, so LR schedulers drive both
rules). This module dispatches each parameter's step to its rule, per parameter or per group
([Note: capturable and batched steps] in ``optim/step_modes.py``). Hyperparameters are validated
at construction and in ``add_param_group`` (``optim/group_checks.py``); state dicts record each
parameter's rule (``optim/state_dict.py``).

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

from collections.abc import Iterator
from itertools import chain
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from ..placement.owned_tensor import local_tensor  # one local-tensor helper for the package
from ..placement.stepping import check_planned, expert_splits_of, stepping_of  # the one descriptor optimizers ask
from ._adamw import lr_tensor
from .group_checks import STEP_FLAGS, check_group, check_hparams, check_whole, refuse_hosted
from .routing import expert_splits, module_params, route, stepping
from .rule import UpdateRule
from .rules import AdamWRule, Rule
from .rules.base import wide_dtype
from .rules.checks import is_real
from .state_dict import load_optimizer_state_dict, note_remote, optimizer_state_dict, state_schema
from .state_init import bookkeeping, init_states, is_state_init_call
from .step_modes import HostCount, device_lrs

__all__ = ["MatrixOptimizer", "local_tensor", "wide_dtype", "is_real", "lr_tensor", "ADAMW_DEFAULTS", "STEP_FLAGS"]

#: Default AdamW hyperparameters of the element-wise rule (documented on each optimizer).
ADAMW_DEFAULTS: dict[str, Any] = AdamWRule.defaults


class MatrixOptimizer(Optimizer):
    """Base class: routes each parameter to ``rule_class`` or to AdamW (see module docstring).

    Subclasses set ``rule_class`` (a :class:`~matrixfsdp.optim.rules.Rule`) and ``rule``, its name
    (the one accepted in ``group["algorithm"]``).
    """

    rule: ClassVar[str]
    rule_class: ClassVar[type[Rule]]

    def __init__(self, params: Any, defaults: dict[str, Any], adamw: dict[str, Any],
                 matrix_rule: Any = None) -> None:
        defaults = {**defaults, "algorithm": "auto", "experts": None, "heads": None, **adamw}
        check_hparams(self, defaults, "")  # constructor arguments first: their errors name no group
        params, from_module = module_params(self, params, matrix_rule)
        #: the groups being added were written by the user as dicts (see group_checks.py)
        self._explicit_groups = (not from_module and isinstance(params, list) and bool(params)
                                 and isinstance(params[0], dict))
        self.__dict__.update(bookkeeping())  # _remote_state, _step_calls, _host_offsets, _lr_tensors
        super().__init__(params, defaults)
        self._explicit_groups = True  # later add_param_group calls
        for group in self.param_groups:  # the routing invariant (see [Note: routing invariant])
            for p in group["params"]:
                check_planned(p, f"{type(self).__name__} construction")
        if not from_module:
            from ._list_routing import warn_if_list_routing_differs

            warn_if_list_routing_differs(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # fills in the defaults
        try:
            check_group(self, len(self.param_groups) - 1)
        except Exception:
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    # routing (optim/routing.py) and the helpers other modules reach through the optimizer
    _route = route  # "adamw" or self.rule (optim/routing.py)
    _expert_splits = expert_splits  # matrices per expert of an expert stack, else 0
    _check_whole = check_whole  # a matrix is whole or empty here (baselines that step shards relax it)
    _state_schema = state_schema  # the state keys and shapes p's owner holds (optim/state_dict.py)
    _is_state_init_call = is_state_init_call  # [Note: state-initialization step]
    _stepping = stepping  # stepping_of(p) as this optimizer steps p (its rule may keep state on shards)
    _state_placeholders = property(lambda self: self.rule_class.state_placeholders)  # (optim/state_dict.py)

    def _routed(self) -> Iterator[tuple[int, dict[str, Any], Tensor, str]]:
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                yield index, group, p, self._route(group, p)

    def _rule(self, group: dict[str, Any], route: str) -> Rule:
        """The rule named ``route`` (``"adamw"`` or ``self.rule``), bound to ``group``."""
        return (AdamWRule if route == "adamw" else self.rule_class)(group, type(self).__name__)

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
            init_states(self)
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
    _eager_step = torch._dynamo.disable(_step_all, recursive=True, reason="matrixfsdp: hosted matrices step eagerly")

    def _loop_step(self, index: int, group: dict[str, Any]) -> None:
        """The default step of one group: each parameter by its rule's ``step`` (``step_stack``: an expert
        stack); TP-hosted matrices by their executor (see [Note: TP hosts]), with the same rules."""
        hosted: dict[int, tuple[Any, list[tuple[Tensor, Rule]]]] = {}
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
                    note_remote(self, p, st)
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
                rules[route].step_stack(param, grad, self.state[p], splits)
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
        refuse_hosted(self, index, group)
        stacks: list[tuple[Tensor, Tensor, int]] = []
        for p in group["params"]:
            st = stepping_of(p)
            if p.grad is None or not st.keeps_state:
                if p.grad is not None or st.reduced_elsewhere:  # another rank owns it: no state, no compute here
                    note_remote(self, p, st)
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
        if len(devices) == 1:  # the usual case; lrs on the device: [Note: one lr tensor per group]
            self._group_step_on(device_lrs(self, index, group, devices[0]), adamw, matrix, stacks)
            return
        for device in devices:
            self._group_step_on(device_lrs(self, index, group, device), *(
                [it for it in items if it[1].device == device] for items in (adamw, matrix, stacks)))

    def _group_step_on(self, group: dict[str, Any], adamw: list[tuple[Tensor, Tensor, Tensor]],
                       matrix: list[tuple[Tensor, Tensor, Tensor]], stacks: list[tuple[Tensor, Tensor, int]]) -> None:
        if adamw:
            self._rule(group, "adamw").step_group([(param, grad, self.state[p]) for p, param, grad in adamw])
        rule = self._rule(group, self.rule)
        if matrix:
            counts = [HostCount(self, p) for p, _, _ in matrix] if rule.capturable else None
            rule.step_group([(param, grad, self.state[p]) for p, param, grad in matrix], counts)
        for p, param, splits in stacks:
            rule.step_stack(param, local_tensor(p.grad), self.state[p], splits)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for key, value in bookkeeping().items():
            self.__dict__.setdefault(key, value)
        for group in self.param_groups:
            for key in STEP_FLAGS:
                group.setdefault(key, False)
            group.setdefault("experts", None)
            group.setdefault("heads", None)

    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict; state of DTensor parameters is presented as DTensors (aliasing
        the local state) with the parameter's layout, so DCP can save and reshard it. Each param
        group records the rule of each of its parameters (``"routes"``), which
        :meth:`load_state_dict` checks."""
        return optimizer_state_dict(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Torch's loader, except that wide (float32) matrix statistics keep their dtype.

        ``Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype,
        which would round Shampoo/SOAP float32 factors of a bf16 parameter to bf16. DTensor state
        (from :meth:`state_dict` or DCP) is reduced to its local tensor first.
        """
        load_optimizer_state_dict(self, state_dict, super().load_state_dict)
