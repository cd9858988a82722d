"""Per-head matrices: which projections hold attention heads along their rows, read from a model.

[Note: per-head matrices]
Per-head Muon (Kimi K3's "Per-Head Muon", GLM-5's "Muon Split" of the MLA up-projections) steps
each attention head's slice of a projection as its own matrix: a query projection ``[H * d, D]``
is ``H`` independent ``[d, D]`` matrices for momentum, Newton-Schulz, the shape's learning rate and
weight decay, as ``torch.optim.Muon`` would step ``H`` separate parameters. It is declared per
projection with :class:`~matrixfsdp.MatrixRule` ``(heads=((name, H), ...))``; the rule's kind of
such a matrix is ``ParamKind("matrix", splits=H)``. Everything downstream reads that one answer:

* the planner costs it as ``H`` matrices of ``[d, D]`` and records ``splits=H`` in its
  :class:`~matrixfsdp.ParamPlan` (the digest ranks compare covers it);
* placement is unchanged: the projection is owned (or hosted, or TP-hosted) whole, so each head
  matrix is whole on one rank;
* the optimizer steps it through the expert-stack path on a ``[1, H * d, D]`` view with ``H``
  matrices per slice (Newton-Schulz batched across heads), keeps its state in the parameter's
  own shape (momentum rows are per-head rows), and records the layout in its state dict
  (``"muon:heads/H"``), so loading it under another layout raises.

Only row-split projections are per-head here: queries, keys and values (one head per ``d`` rows,
``H`` query heads, ``KV`` key/value heads under GQA) and MLA's up-projections (``q_b_proj``:
``H`` heads of ``qk_nope + qk_rope`` rows; ``kv_b_proj``: ``H`` heads of ``qk_nope + v`` rows). The
output projection splits its heads along its columns and stays one matrix.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = ["head_splits"]

#: child names of an attention module -> which head count their rows hold
_QUERY = ("q_proj", "wq", "q_b_proj", "wq_b")
_KEY_VALUE = ("k_proj", "v_proj", "wk", "wv")
_MLA_KV = ("kv_b_proj", "wkv_b")
#: a fused query-key-value projection (torchtitan's ``FusedQKV``): ``H + 2 KV`` heads of ``d`` rows
_FUSED = ("wqkv",)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _counts(chain: list[nn.Module], root_config: Any) -> tuple[int, int] | None:
    """``(query heads, key/value heads)`` of the projections' module, ``chain[0]``, or of its
    nearest ancestor that says (``chain``: it and its ancestors, innermost first): torchtitan's
    attention attributes (``n_heads``/``n_kv_heads``, on the attention module above its
    ``qkv_linear``), a config (``config``/``cfg``: Hugging Face names), or the model's config."""
    for module in chain:
        heads = getattr(module, "n_heads", None)
        if _int(heads):
            kv = getattr(module, "n_kv_heads", None)
            return heads, kv if _int(kv) else heads
    for cfg in [getattr(m, a, None) for m in chain for a in ("config", "cfg")] + [root_config]:
        heads = getattr(cfg, "num_attention_heads", None)
        if _int(heads):
            kv = getattr(cfg, "num_key_value_heads", None)
            return heads, kv if _int(kv) else heads
    return None


def head_splits(model: nn.Module) -> tuple[tuple[str, int], ...]:
    """The per-head matrices of ``model`` as ``MatrixRule(heads=...)`` takes them (see [Note:
    per-head matrices]): every module with a query child named ``q_proj``, ``wq``, ``q_b_proj`` or
    ``wq_b`` (or torchtitan's fused ``wqkv``, ``H + 2 KV`` heads) gives its query, key/value and
    MLA up-projection weights their head counts, read from it or its nearest ancestor
    (torchtitan's attention attributes, a module's config) or the model's Hugging Face config. Pure, over modules and shapes (a ``meta`` model is fine).

    Names are the projections' module names (``"q_proj"``) when every layer agrees, full
    parameter names otherwise. Raises ``ValueError`` if an attention module's head counts cannot
    be read or do not divide a projection's rows.

    Example::

        rule = MatrixRule(heads=head_splits(model))     # or MatrixRule.per_head(model)
        plan = plan_owners(model, mesh, matrix_rule=rule)
        opt = Muon(model, matrix_rule=rule)             # per-head Muon, sharded or plain
    """
    root_config = getattr(model, "config", None)
    modules = dict(model.named_modules())
    found: dict[str, int] = {}
    for mod_fqn, module in modules.items():
        children = dict(module.named_children())
        if not any(name in children for name in _QUERY + _FUSED):
            continue
        parts = mod_fqn.split(".") if mod_fqn else []
        chain = [modules[".".join(parts[:i])] for i in range(len(parts), -1, -1)]
        counts = _counts(chain, root_config)
        if counts is None:
            raise ValueError(
                f"head_splits: attention module {mod_fqn!r} ({type(module).__name__}) has query projection "
                f"{next(n for n in _QUERY + _FUSED if n in children)!r} but no head count (no n_heads attribute, no "
                "config.num_attention_heads on it or on the model); declare its heads with "
                "MatrixRule(heads=((name, H), ...))"
            )
        heads, kv_heads = counts
        for name, count in ([(n, heads) for n in _QUERY + _MLA_KV] + [(n, kv_heads) for n in _KEY_VALUE]
                            + [(n, heads + 2 * kv_heads) for n in _FUSED]):
            child = children.get(name)
            weight = getattr(child, "weight", None) if child is not None else None
            if weight is None or weight.ndim != 2:
                continue
            fqn = f"{mod_fqn}.{name}.weight" if mod_fqn else f"{name}.weight"
            if weight.shape[0] % count:
                raise ValueError(f"head_splits: {fqn!r} of shape {tuple(weight.shape)} does not split into "
                                 f"{count} heads along its rows (module {type(module).__name__})")
            found[fqn] = count
    by_leaf: dict[str, set[int]] = {}
    for fqn, count in found.items():
        by_leaf.setdefault(fqn.split(".")[-2], set()).add(count)
    if all(len(counts) == 1 for counts in by_leaf.values()):
        return tuple(sorted((leaf, counts.pop()) for leaf, counts in by_leaf.items()))
    return tuple(sorted(found.items()))
