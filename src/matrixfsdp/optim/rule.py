"""The update-rule protocol: one parameter's optimizer rule, as a runtime may run it.

[Note: update-rule protocol]
Every ``matrixfsdp.optim`` optimizer steps each parameter with one *rule*: its matrix rule (Muon,
Shampoo, SOAP) or the AdamW fallback (see the routing in ``optim/routing.py``; the rules are
classes, [Note: update rules as classes] in ``optim/rules/base.py``).
``opt.rule_for(p)`` returns it as an object that implements :class:`UpdateRule`, bound to ``p``'s
param group: hyperparameters (``lr``, ``weight_decay``, betas, ...) are read from the group at
every call, so LR schedulers drive it. The optimizer's own per-parameter step
(``capturable=False, batched=False``) runs ``rule.step``; a runtime that steps a matrix elsewhere
(the TP host step, ``matrixfsdp/tp/host_step.py``) runs ``rule.update`` and ``rule.decay``. That
is the whole contract between optimizers and runtimes:

* a rule sees plain (local) tensors and never communicates; the caller brings the whole matrix
  and the whole gradient;
* the state is a plain ``dict`` the caller stores (the optimizer's ``state[p]``) and passes back
  at every call; an empty dict is a first step (the rule fills it in). A rule keeps nothing
  between calls;
* ``update`` advances the state exactly as ``step`` does; ``step(W)`` equals
  ``W * (1 - lr * wd) + update(G)`` with ``(lr, wd) = decay()`` in exact arithmetic (the rounding
  differs: ``step`` is op for op the documented rule, e.g. bitwise ``torch.optim.Muon``).

[Note: state on the shards]
A rule may declare ``shards_state = True`` (:class:`ShardedStateRule`): its state is *element-wise* in the gradient (Muon's
momentum), and its update is a stateless whole-matrix map of one element-wise quantity. Then
``update(G)`` equals ``finish(cat(prepare(G_i, state_i)))`` for any split of ``G`` into row (or
column) blocks ``G_i`` with state ``state_i`` of the same shape, bitwise: ``prepare`` advances a
block's state and returns that block of the quantity (Muon: the Nesterov blend of gradient and
momentum), ``finish`` maps the assembled whole quantity to the update (Muon: Newton-Schulz and
the shape's learning rate). A host step may then keep the state on the shards, like an evenly
sharded parameter's, and move the prepared blocks instead of the gradient's: the host holds no
state at all (``matrixfsdp/tp/host_step.py``). Rules without it (Shampoo, SOAP: factors of the
whole matrix; AdamW) keep their state whole on the host.

One known gap: SOAP's first call only gathers statistics and its own step does not decay;
``update`` is zero then, but ``decay()`` (which ranks without the state must be able to call)
returns the group's decay, so the TP host step decays that first step once (relative
``lr * weight_decay``; docs/tp.md).

Runtimes depend on this module alone (``.importlinter``): nothing of an optimizer's internals.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["UpdateRule", "ShardedStateRule"]


@runtime_checkable
class UpdateRule(Protocol):
    """One parameter's update rule (see [Note: update-rule protocol]).

    Example (what the TP host step does with a hosted matrix ``p`` of ``opt``)::

        rule = opt.rule_for(p)                        # Muon's rule in p's param group
        state = opt.state[p]                          # {} before the first step
        u = rule.update(whole_grad, state, dtype=p.dtype)
        lr, wd = rule.decay()
        w.mul_(1 - lr * wd).add_(u)                   # on every shard of p alike
    """

    #: ``"muon"``, ``"shampoo"``, ``"soap"`` or ``"adamw"`` (the names of ``group["algorithm"]``)
    name: str

    def init_state(self, like: Tensor) -> dict[str, Any]:
        """The state a first step starts from, for a matrix shaped, typed and placed like
        ``like`` (only those are read; a ``meta`` tensor gives the keys and shapes alone)."""
        ...

    def step(self, param: Tensor, grad: Tensor, state: dict[str, Any]) -> None:
        """Step the whole plain tensor ``param`` in place (decay included) with ``grad``."""
        ...

    def update(self, grad: Tensor, state: dict[str, Any], *, dtype: torch.dtype | None = None) -> Tensor:
        """The additive update of a whole matrix with gradient ``grad`` (a new tensor of
        ``dtype``, default ``grad``'s), before decay; advances ``state`` as :meth:`step` does.
        (matrixfsdp's own rules also take ``splits=k``: a stack of matrices, each with its own
        update and state; [Note: update rules as classes] in ``optim/rules/base.py``.)"""
        ...

    def decay(self) -> tuple[Any, Any]:
        """``(lr, weight_decay)`` of the decoupled decay ``W <- W * (1 - lr * weight_decay)``
        that goes with :meth:`update` (``lr`` may be a 0-dim tensor in capturable groups)."""
        ...


@runtime_checkable
class ShardedStateRule(UpdateRule, Protocol):
    """An :class:`UpdateRule` that may split its update (see [Note: state on the shards]); a
    runtime asks ``getattr(rule, "shards_state", False)`` before calling :meth:`prepare` or
    :meth:`finish`, so rules implementing :class:`UpdateRule` alone keep working.

    Example (what the host step does with a hosted matrix stored in row shards)::

        u_rows = rule.prepare(grad_rows, state)        # on every rank: its rows' state advances
        u = torch.cat(all_ranks_u_rows)                # on the host
        update = rule.finish(u, dtype=p.dtype)         # stateless; its rows go back to each rank
    """

    #: the state is element-wise: :meth:`prepare` and :meth:`finish` split :meth:`update`
    shards_state: bool

    def prepare(self, grad: Tensor, state: dict[str, Any]) -> Tensor:
        """The element-wise half of :meth:`update` on a block of the matrix: advances the block's
        ``state`` (shaped like ``grad``; empty on a first step) and returns the block of what
        :meth:`finish` takes (valid until the next call with this state)."""
        ...

    def finish(self, prepared: Tensor, *, dtype: torch.dtype | None = None) -> Tensor:
        """The whole-matrix half of :meth:`update`: the additive update (a new tensor of ``dtype``,
        default ``prepared``'s) from the assembled output of :meth:`prepare`; stateless."""
        ...
