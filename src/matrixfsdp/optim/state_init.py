"""The state-initialization call of torch's checkpoint helpers, recognized and answered with state.

[Note: state-initialization step]
torch.distributed.checkpoint.state_dict.get_state_dict() "initializes" an optimizer with no
state by setting every gradient to zeros and every group's lr to 0 and calling step(), so
that DCP has state tensors to load into. A real step on zero gradients is not harmless here:
an explicit adamw_lr still applies weight decay, step counters advance (bias corrections
shift by one), and SOAP's first call would build its eigenbases from zero statistics. So
such a call (no state yet, every lr 0, every gradient all-zero) creates exactly the state a
first real step starts from -- zeros, counters at 0, SOAP marked "statistics pending" -- and
leaves every parameter untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..placement.owned_tensor import local_tensor
from ..placement.stepping import expert_splits_of
from .state_dict import note_remote
from .step_modes import sync_host_steps

if TYPE_CHECKING:
    from ._base import MatrixOptimizer

__all__ = ["bookkeeping", "is_state_init_call", "init_states"]


def bookkeeping() -> dict[str, Any]:
    """A new optimizer's attributes besides torch's (and an unpickled one's defaults)."""
    return {
        # ids of parameters whose state another rank keeps (owned, hosted; optim/state_dict.py)
        "_remote_state": set(),
        # host-side step counts of capturable groups: a dict, from 2 (see [Note: host step counts])
        "_step_calls": {"calls": 2},
        "_host_offsets": {},
        # capturable groups' learning rates on their parameters' device (see [Note: one lr tensor
        # per group])
        "_lr_tensors": {},
    }


def is_state_init_call(opt: "MatrixOptimizer", params: list[Tensor]) -> bool:
    """Whether this ``step()`` of an optimizer without state is the state-initialization call."""
    # DCP zeroes a learning rate as a number or a CPU tensor (torch.tensor(0.0)), never as a
    # tensor on an accelerator, which is not read: that would synchronize the device
    if any(isinstance(g["lr"], Tensor) and g["lr"].device.type != "cpu" for g in opt.param_groups):
        return False
    if any(g["lr"] != 0 for g in opt.param_groups):
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


def init_states(opt: "MatrixOptimizer") -> None:
    """Create the state a first step of each parameter starts from, as its rule lays it out."""
    for _, group, p, route in opt._routed():
        st = opt._stepping(p, route=route)
        if not st.keeps_state:
            if p.grad is not None or st.reduced_elsewhere:
                note_remote(opt, p, st)
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
                opt._remote_state.add(id(p))
            continue
        splits = opt._expert_splits(group, p, route)
        opt.state[p].update(opt._rule(group, route).init_state(param, splits=splits))
    sync_host_steps(opt)
