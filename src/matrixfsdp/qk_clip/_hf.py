"""QK-clip capture for Hugging Face models, through transformers' attention-function registry.

[Note: QK-clip and transformers' AttentionInterface]
A transformers attention module calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with itself as first argument and the kernel's inputs (``query [B, heads, L, E]``, ``key [B,
kv_heads, S, E]``, the prepared ``attention_mask``, ``scaling``). The documented way to change
what runs there is to register a function under a new name (``AttentionInterface.register``) and
the matching mask builder (``AttentionMaskInterface.register``: transformers builds no mask for an
unknown name), then point the model's config at that name. :func:`attach` does that with one name
per wrapped implementation (``"matrixfsdp_qk_clip_sdpa"``, ``"matrixfsdp_qk_clip_eager"``); the
function looks up the capture on the module it is called with, so modules without one (another
model that happens to share the name) run the base implementation unchanged. Only the configs of
the attached model change (and :func:`detach` restores them); the registry entries are additions
and alter no other name. ``"sdpa"`` runs under the capture's ``TorchFunctionMode`` (its logits are
recorded from the exact arguments transformers hands to SDPA, its mask and GQA handling included);
``"eager"`` records from the registry call's own arguments, which it computes with
(``q k^T * scaling + attention_mask``). Other implementations (flash, flex) are refused: their
inputs are packed or carry mask functions the capture does not evaluate.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch.nn as nn

from .capture import head_max_logits, sdpa_capture

__all__ = ["is_hf_attention", "attach", "detach", "SUPPORTED", "PREFIX"]

#: base implementations the capture wraps
SUPPORTED = ("sdpa", "eager")
PREFIX = "matrixfsdp_qk_clip_"
#: the capture's record function, on each attached attention module
RECORD_ATTR = "_matrixfsdp_qk_clip_record"


def is_hf_attention(module: nn.Module) -> bool:
    """A module that dispatches through transformers' registry (duck-typed: its ``config`` has
    ``_attn_implementation``)."""
    return hasattr(getattr(module, "config", None), "_attn_implementation")


def _base_function(base: str, module: nn.Module) -> Callable[..., Any]:
    if base == "eager":  # every modeling file defines its own, at module level
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"matrixfsdp.qk_clip: {type(module).__name__}'s module defines no eager_attention_forward; "
                             "use attn_implementation='sdpa'")
        return fn
    from transformers import AttentionInterface

    return AttentionInterface._global_mapping[base]


def _wrapper(base: str) -> Callable[..., Any]:
    def attention(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any,
                  **kwargs: Any) -> Any:
        fn = _base_function(base, module)
        record = getattr(module, RECORD_ATTR, None)
        if record is None or not module.training:
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        if base == "sdpa":
            with sdpa_capture(record):
                return fn(module, query, key, value, attention_mask, *args, **kwargs)
        mask = attention_mask
        if mask is not None and mask.shape[-1] != key.shape[-2]:
            mask = mask[..., : key.shape[-2]]  # eager's own slice of a cache-length mask
        record(head_max_logits(query, key, scale=kwargs.get("scaling"), attn_mask=mask))
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    attention.__name__ = f"{PREFIX}{base}"
    return attention


def _register(base: str) -> str:
    from transformers import AttentionInterface, AttentionMaskInterface

    name = f"{PREFIX}{base}"
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _wrapper(base))
    if name not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[base])
    return name


def attach(module: nn.Module, record: Callable[[Any], None], configs: dict[int, tuple[Any, str]]) -> None:
    """Route ``module``'s attention through the capturing function of its implementation (see
    [Note: QK-clip and transformers' AttentionInterface]); ``configs`` collects each changed config
    with its previous implementation, for :func:`detach`."""
    cfg = module.config
    impl = cfg._attn_implementation
    if id(cfg) in configs:
        impl = configs[id(cfg)][1]
    base = impl if impl in SUPPORTED else None
    if base is None:
        raise ValueError(
            f"matrixfsdp.qk_clip.QKClip: {type(module).__name__} uses attn_implementation={impl!r}; the capture "
            f"wraps {list(SUPPORTED)} (load the model with attn_implementation='sdpa', or record the kernel's "
            "max scores yourself with QKClip.observe)"
        )
    if id(cfg) not in configs:
        configs[id(cfg)] = (cfg, impl)
        cfg._attn_implementation = _register(base)
    setattr(module, RECORD_ATTR, record)


def detach(module: nn.Module, configs: dict[int, tuple[Any, str]]) -> None:
    """Undo :func:`attach` for ``module`` (and restore the configs once, when given)."""
    if hasattr(module, RECORD_ATTR):
        delattr(module, RECORD_ATTR)
    for cfg, impl in configs.values():
        cfg._attn_implementation = impl
    configs.clear()
