"""Backward tracking shared by both front-ends: when a backward starts, whether it accumulates
into ``.grad``, the final callback, and the cleanup after a backward that never finished.

[Note: backward tracking]
Each managed model has one :class:`BackwardTracker`. The front-ends wrap tensors crossing their
boundaries in :class:`BackwardHook` (an identity whose backward calls a front-end method):
``fully_shard`` wraps each block's outputs (pre-backward) and inputs (post-backward), ``replicate``
the root's outputs (backward start). Every wrapper of outputs also takes the tracker's private
*anchor* leaf, so the anchor's ``AccumulateGrad`` node is in every graph that reaches the model.
At the first hook of a backward, :meth:`BackwardTracker.start` asks the autograd engine whether
that node will run (``torch._C._will_engine_execute_node``): it does in ``backward()`` and not in
``torch.autograd.grad`` / ``backward(inputs=...)`` on other tensors. The answer depends only on
which call the program made, so every rank decides alike, and a backward that does not
accumulate issues no reduction. ``backward(create_graph=True)`` into ``.grad`` is refused on every
rank at the same point.

Some iterations never finish a backward: an exception escapes it, and autograd drops the queued
final callback. :meth:`BackwardTracker.take_aborted` tells the front-end so at the next program
point every rank passes outside backward (the root's pre-forward, a state dict), where it waits
for the collectives already issued and drops their partial results.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
import torch._dynamo  # noqa: F401  (dynamo_disable)
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["BackwardHook", "BackwardTracker", "wrap_grad_tensors", "in_backward", "dynamo_disable"]

_F = TypeVar("_F", bound=Callable[..., Any])


def dynamo_disable(fn: _F) -> _F:
    """``fn`` run outside dynamo, as FSDP2 wraps its hooks (``_fsdp_common._dynamo_disable``):
    under ``torch.compile`` of a model or of its blocks the front-ends' module forward hooks,
    backward hooks, post-accumulate-grad hooks and final callbacks (host bookkeeping,
    collectives) run eagerly instead of being traced. Disabled at definition, not at the first
    call: a wrapper frame of ours (outside torch's files, which dynamo skips) would itself be
    traced, and under ``fullgraph=True`` (torchtitan's ``block.compile``) its call of a disabled
    function is an error instead of a graph break."""
    return torch._dynamo.disable(fn, recursive=True, reason="skipping matrixfsdp hooks")  # type: ignore[return-value]


def in_backward() -> bool:
    """Whether the caller runs inside an autograd backward (e.g. a recomputation)."""
    return torch._C._current_graph_task_id() != -1


class BackwardHook(torch.autograd.Function):
    """Identity on ``tensors``; its backward calls ``hook()`` before passing the gradients on.

    Takes an optional ``anchor`` (see [Note: backward tracking]); pass ``None`` for input wrappers.
    """

    @staticmethod
    def forward(ctx: Any, hook: Callable[[], None], anchor: torch.Tensor | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.hook = hook
        ctx.set_materialize_grads(False)
        # Aliases, not the tensors themselves: a tensor a custom Function returns as-is becomes a
        # view that refuses in-place ops; a detached alias behaves as in plain torch (it shares
        # the version counter, so modifying a tensor autograd saved still raises, as without us).
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ctx.hook()
        return (None, None, *grads)


def wrap_grad_tensors(hook: Callable[[], None], anchor: torch.Tensor | None, tree: Any) -> Any:
    """``tree`` with its tensors that require grad passed through one :class:`BackwardHook`."""
    flat, spec = tree_flatten(tree)
    idx = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not idx:
        return tree
    outs = BackwardHook.apply(hook, anchor, *[flat[i] for i in idx])
    for j, i in enumerate(idx):
        flat[i] = outs[j]
    return tree_unflatten(flat, spec)


class BackwardTracker:
    """Which backward is running, whether it accumulates, and its final callback."""

    def __init__(self, device: torch.device | str, api: str):
        self.api = api
        self.anchor = torch.empty(0, device=device, requires_grad=True)
        self.anchor_node = self.anchor.view_as(self.anchor).grad_fn.next_functions[0][0]
        self.graph_task: int | None = None  # the backward being run (its first hook was seen)
        self.accumulating = True
        self.callback_queued = False

    def is_current(self) -> bool:
        """Whether the running backward was already seen by :meth:`start`."""
        return torch._C._current_graph_task_id() == self.graph_task

    def will_accumulate(self) -> bool:
        """Whether the running backward accumulates into ``.grad`` (see the Note)."""
        return bool(torch._C._will_engine_execute_node(self.anchor_node))

    def refuse_create_graph(self) -> None:
        raise RuntimeError(
            f"{self.api}: backward(create_graph=True) is not supported (higher-order "
            "gradients accumulated into .grad); compute the inner derivative with "
            "torch.autograd.grad(..., create_graph=True) and call backward() on the result"
        )

    def start(self, accumulating: bool) -> None:
        """Record the running backward and its mode."""
        self.graph_task = torch._C._current_graph_task_id()
        self.accumulating = accumulating

    def queue_final_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the running backward has finished (once per backward)."""
        if self.callback_queued:
            return
        self.callback_queued = True
        Variable._execution_engine.queue_callback(callback)

    def finished(self) -> None:
        """Called at the end of the final callback (also when it raised)."""
        self.callback_queued = False
        self.graph_task = None

    def take_aborted(self) -> bool:
        """Outside backward: whether the last backward never reached its final callback (an
        exception escaped it); resets the tracker if so."""
        if not self.callback_queued or in_backward():
            return False
        self.finished()
        return True
