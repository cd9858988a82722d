"""The base of the update rules: what every rule class implements, and the parts they share.

[Note: update rules as classes]
Each update rule is one class: :class:`~matrixfsdp.optim.rules.MuonRule`, ``ShampooRule``,
``SOAPRule`` and ``AdamWRule`` (the element-wise fallback of every optimizer). A rule class owns
its hyperparameters (``defaults``: names and default values; ``check``: their validation, with
the errors the optimizers raise), its state layout (``init_state``) and every way it steps:

* ``step(param, grad, state)``: one whole matrix, decay included; the optimizer's per-parameter
  step, bitwise as documented on each optimizer;
* ``update(grad, state, dtype=)`` and ``decay()``: the additive update and the decay that go with
  it, what a runtime applies (the TP host step, [Note: update-rule protocol] in
  ``optim/rule.py``); ``prepare``/``finish`` split ``update`` where the state is element-wise
  ([Note: state on the shards]);
* ``step_capturable(param, grad, state, count)``: ``step`` without host reads, ``count`` giving
  the host's step number where a schedule needs it ([Note: host step counts] in
  ``optim/step_modes.py``);
* ``step_group(items, counts)``: a capturable and/or batched group's tensors together (foreach
  AdamW, batched Newton-Schulz), one at a time by default;
* ``step_stack(param, grad, state, splits)``: a stack of matrices with stacked state.

``step`` and ``update`` are one computation: :meth:`Rule.increment` advances the state and
returns the step's additive term as the kernel that adds it (:class:`Increment`); ``step`` decays
the parameter and applies it, ``update`` applies it to a zero scalar, so the update is rounded
exactly as the step adds it (and as the step on a zero matrix gave, which ``update`` was before).
The decay touches only the parameter and the increment only the state, so decaying after the
state advanced gives the bits of decaying first.

An instance is bound to one param group: hyperparameters are read from that mapping at every
call (LR schedulers drive it). A rule sees plain local tensors, keeps nothing between calls (the
caller stores ``state``), never communicates and never sees the optimizer: the optimizer
(``optim/_base.py``) routes each parameter to a rule and calls these, and ``opt.rule_for(p)``
hands a runtime the same object.

``splits``, the matrices per slice of a tensor: ``0`` is one 2-D matrix; ``k >= 1`` steps a
stack ``[n, out, in]`` (a 2-D tensor is a stack of one) as its ``n * k`` matrices
``[out / k, in]``, each with the state, update, shape-based learning rate and decay of the rule
on a matrix of its shape, the state stacked per matrix ([Note: expert optimizer state] in
``optim/_expert_step.py``). Expert stacks take ``k`` matrices per expert; a projection
``[H * d, D]`` stepped per head would be the stack of one with ``k = H``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from .._adamw import new_step_counter
from .._expert_step import init_stacked, loop_step, matrices
from .checks import check_lr, check_nonneg

__all__ = ["Rule", "Increment", "stand_in", "wide_dtype", "StepCount"]

#: ``count(state)``: the host's number of the step a capturable call performs; ``count.set(n)``
#: restarts it (see [Note: host step counts] in ``optim/step_modes.py``)
StepCount = Any


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of Shampoo/SOAP statistics: at least float32 (bf16 factors lose the spectrum)."""
    return torch.promote_types(dtype, torch.float32)


def stand_in(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """A tensor shaped like ``grad``, of ``dtype``, on its device, holding no memory (a broadcast
    scalar): the parameter an update is for, as a rule reads it (shape, dtype, device; its
    ``zeros_like`` is contiguous, as the zero matrix ``update`` once stepped)."""
    return grad.new_empty((), dtype=dtype).expand(grad.shape)


class Increment(NamedTuple):
    """A step's additive term ``alpha * x`` (``alpha * x / den`` given ``den``), as the kernel
    that adds it to the parameter: ``add_(x, alpha=)`` or ``addcdiv_(x, den, value=)``."""

    x: Tensor
    alpha: Any
    den: Tensor | None = None

    def apply_(self, param: Tensor) -> None:
        if self.den is None:
            param.add_(self.x, alpha=self.alpha)
        else:
            param.addcdiv_(self.x, self.den, value=self.alpha)

    def update(self, dtype: torch.dtype) -> Tensor:
        """The term as a new ``dtype`` tensor: the kernel of :meth:`apply_` on a zero scalar, in
        the dtype it computes in on a ``dtype`` parameter (the promotion of both), so the one
        rounding is the step's; a zero term is +0.0 (``0 + (-0.0)``), as on a zero matrix."""
        wide = torch.promote_types(dtype, self.x.dtype)
        if self.den is not None:
            wide = torch.promote_types(wide, self.den.dtype)
        zero = self.x.new_zeros((), dtype=wide)
        if self.den is None:
            out = torch.add(zero, self.x.to(wide), alpha=self.alpha)
        else:
            out = torch.addcdiv(zero, self.x.to(wide), self.den.to(wide), value=self.alpha)
        return out.to(dtype)


class Rule:
    """One update rule bound to one param group (see [Note: update rules as classes])."""

    #: the rule's name, as ``group["algorithm"]`` and state dicts' ``"routes"`` name it
    name: ClassVar[str]
    #: the rule's hyperparameters and their defaults (the optimizers' constructor defaults)
    defaults: ClassVar[dict[str, Any]] = {}
    #: state kept in :func:`wide_dtype` (float32 for bf16 parameters); loading keeps it there
    wide_state: ClassVar[bool] = False
    #: state is element-wise and ``prepare``/``finish`` split ``update`` ([Note: state on the shards])
    shards_state: ClassVar[bool] = False
    #: ``step_stack`` takes capturable groups
    capturable_stacks: ClassVar[bool] = False
    #: steps groups with ``heads`` (per-head matrices; Muon's momentum is element-wise)
    per_head: ClassVar[bool] = False
    #: state keys that appear later in training, ``{key: key it accompanies}``; see
    #: [Note: optimizer state in state dicts] in ``optim/state_dict.py``
    state_placeholders: ClassVar[dict[str, str]] = {}

    def __init__(self, group: Mapping[str, Any], api: str = "") -> None:
        self.group = group
        self._api = api  # the optimizer's name, for messages

    def __repr__(self) -> str:
        return f"{self._api}.rule({self.name!r})"

    # ----------------------------------------------------------------------------- hyperparameters
    @classmethod
    def check(cls, group: Mapping[str, Any], where: str, api: str) -> None:
        """Validate the rule's own hyperparameters in ``group`` (``where``: which group)."""

    @staticmethod
    def check_common(group: Mapping[str, Any], where: str, api: str) -> None:
        """The group's ``lr`` and ``weight_decay``: the matrix rule's, and AdamW's by default."""
        check_lr(api, group, "lr", where)
        check_nonneg(api, group, "weight_decay", where)

    def decay(self) -> tuple[Any, Any]:
        """``(lr, weight_decay)`` of the decoupled decay ``W <- W * (1 - lr * weight_decay)``."""
        return self.group["lr"], self.group.get("weight_decay", 0.0)

    @property
    def capturable(self) -> bool:
        return self.group.get("capturable", False)

    # ----------------------------------------------------------------------------- state
    def init_state(self, like: Tensor, *, splits: int = 0) -> dict[str, Any]:
        """The state a first step starts from, for a parameter shaped, typed and placed like
        ``like`` (only those are read; ``meta`` gives the keys and shapes alone); with
        ``splits``, the stacked state of its matrices."""
        if splits:
            return init_stacked(self.init_state, matrices(like, splits))
        return self._init_state(like)

    def _init_state(self, like: Tensor) -> dict[str, Any]:
        raise NotImplementedError

    def step_counter(self, like: Tensor) -> Tensor:
        """A new step counter: on the CPU, as torch's; on ``like``'s device in capturable groups."""
        if self.capturable and like.device.type != "meta":
            return new_step_counter(like.device)
        return new_step_counter()

    # ----------------------------------------------------------------------------- steps
    def increment(self, grad: Tensor, state: dict[str, Any], like: Tensor) -> Increment | None:
        """Advance ``state`` by one step with ``grad`` and return the step's additive term (before
        decay) for a parameter like ``like``; ``None``: this step leaves the parameter as it is
        (SOAP's first call), decay included."""
        raise NotImplementedError

    def step(self, param: Tensor, grad: Tensor, state: dict[str, Any]) -> None:
        """Step the whole plain tensor ``param`` in place (decay included) with ``grad``."""
        inc = self.increment(grad, state, param)
        if inc is None:
            return
        lr, wd = self.decay()
        if wd != 0:
            param.mul_(1 - lr * wd)
        inc.apply_(param)

    def update(self, grad: Tensor, state: dict[str, Any], *, dtype: torch.dtype | None = None,
               splits: int = 0) -> Tensor:
        """The additive update (a new tensor of ``dtype``, default ``grad``'s), before decay;
        advances ``state`` as :meth:`step` does. With ``splits``, of each matrix of the stack."""
        dtype = dtype or grad.dtype
        if splits:
            out = grad.new_empty(grad.shape, dtype=dtype)
            if not state:
                state.update(self.init_state(out, splits=splits))
            loop_step(lambda o, g, st: o.copy_(self.update(g, st, dtype=dtype)),
                      matrices(out, splits), matrices(grad, splits), state)
            return out
        inc = self.increment(grad, state, stand_in(grad, dtype))
        return inc.update(dtype) if inc is not None else grad.new_zeros(grad.shape, dtype=dtype)

    def step_capturable(self, param: Tensor, grad: Tensor, state: dict[str, Any], count: StepCount) -> None:
        """:meth:`step` without host reads of changing values (see [Note: capturable and batched
        steps] in ``optim/step_modes.py``)."""
        raise NotImplementedError

    def step_group(self, items: Sequence[tuple[Tensor, Tensor, dict[str, Any]]],
                   counts: Sequence[StepCount] | None = None) -> None:
        """The ``(param, grad, state)`` of a capturable and/or batched group (``counts``: each
        one's host step count, capturable groups); one at a time here."""
        for i, (param, grad, state) in enumerate(items):
            if self.capturable:
                self.step_capturable(param, grad, state, counts[i] if counts else None)
            else:
                self.step(param, grad, state)

    def step_stack(self, param: Tensor, grad: Tensor, state: dict[str, Any], splits: int) -> None:
        """Step the stack ``param`` (``[n, out, in]``, local) as its ``n * splits`` matrices, one
        at a time through :meth:`step` on views of the stacked state (see [Note: expert optimizer
        state] in ``optim/_expert_step.py``)."""
        if not state:
            state.update(self.init_state(param, splits=splits))
        loop_step(self.step, matrices(param, splits), matrices(grad, splits), state)

    # ----------------------------------------------------------------------------- split update
    def prepare(self, grad: Tensor, state: dict[str, Any], *, splits: int = 0) -> Tensor:
        """The element-wise half of :meth:`update` on a block (``shards_state`` rules only)."""
        self._require_split("prepare")
        raise NotImplementedError

    def finish(self, prepared: Tensor, *, dtype: torch.dtype | None = None, splits: int = 0) -> Tensor:
        """The whole-matrix half of :meth:`update` (``shards_state`` rules only); stateless."""
        self._require_split("finish")
        raise NotImplementedError

    def _require_split(self, what: str) -> None:
        if not self.shards_state:
            raise TypeError(f"{self!r}.{what}: this rule keeps whole-matrix state (shards_state is False); "
                            "step it with update() on the whole gradient")
