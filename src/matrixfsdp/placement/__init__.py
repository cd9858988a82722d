"""Placement: how an owned parameter is stored (whole on its owner, empty elsewhere) and the
helpers every consumer uses to read it: the owner descriptor, ``full_tensor``, ``set_full_``
and the cross-owner gradient-norm clip."""

from .clip import clip_grad_norm_
from .experts import ExpertStack, expert_stack_of
from .owned_tensor import Owned, full_tensor, owned_of, set_full_

__all__ = ["Owned", "owned_of", "full_tensor", "set_full_", "clip_grad_norm_", "ExpertStack", "expert_stack_of"]
