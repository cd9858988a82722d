"""Attention layouts: which rows of which projections carry each head's queries and keys.

[Note: QK-clip row blocks]
QK-clip scales, per head, the rows of the projections that produce that head's queries and keys
(Kimi K2, Algorithm 1). A :class:`RowBlock` names one such set of rows: in the projection
``param`` (a dotted path from the attention module), head ``h``'s rows are
``offset + h * stride + [start, start + size)``, and they are scaled by ``gamma ** e`` with ``e``
set by the block's ``part``:

* ``"q"``: ``alpha`` (a query, or MLA's non-rotary query part ``q_nope``);
* ``"q_rope"``: ``1`` (MLA's rotary query part: its key part is shared by every head, so the whole
  factor lands on the query);
* ``"k"``: ``1 - alpha`` (a key, or MLA's ``k_nope`` rows of the kv up-projection).

Query parts count query heads (``num_heads``), key parts key heads (``num_kv_heads``). Under GQA
the factor of a group is taken from the largest max logit of its query heads, and applies to all
of them and to their shared key head (``AttentionLayout.group_of``). MLA has one key head per
query head (``num_kv_heads == num_heads``); its rotary key and the values are never scaled.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

__all__ = ["RowBlock", "AttentionLayout", "built_in_layout", "PARTS"]

#: what a row block holds, and the exponent of gamma it is scaled by (see the Note)
PARTS = ("q", "q_rope", "k")


@dataclass(frozen=True)
class RowBlock:
    """Rows of one projection holding one part of every head (see [Note: QK-clip row blocks]).

    Example::

        RowBlock("q_proj.weight", "q", stride=128)   # head h: rows [128 h, 128 h + 128)
    """

    param: str
    part: str
    stride: int
    start: int = 0
    size: int | None = None  #: rows of the part per head (default ``stride - start``)
    offset: int = 0  #: the projection's row where head 0 starts (fused projections)
    optional: bool = False  #: skipped when the module has no such parameter (a bias that is None)

    def __post_init__(self) -> None:
        if self.part not in PARTS:
            raise ValueError(f"matrixfsdp.qk_clip.RowBlock: part must be one of {PARTS}, got {self.part!r}")
        n = self.rows_per_head
        if self.stride < 1 or self.start < 0 or self.offset < 0 or n < 1 or self.start + n > self.stride:
            raise ValueError(
                "matrixfsdp.qk_clip.RowBlock: need stride >= 1, offset >= 0 and 0 <= start < start + size "
                f"<= stride, got stride={self.stride}, start={self.start}, size={self.size}, offset={self.offset} "
                f"for {self.param!r}"
            )

    @property
    def rows_per_head(self) -> int:
        return self.stride - self.start if self.size is None else self.size


@dataclass(frozen=True)
class AttentionLayout:
    """How one attention module's heads sit in its projections (see [Note: QK-clip row blocks]).

    Build it with :meth:`mha` (separate q/k projections, MHA or GQA), :meth:`fused_qkv` (one
    ``[q; k; v]`` projection) or :meth:`mla` (DeepSeek-V3's multi-head latent attention), or
    directly from :class:`RowBlock` objects.

    Example::

        AttentionLayout.mha(num_heads=32, num_kv_heads=8, head_dim=128)         # q_proj / k_proj
        AttentionLayout.mla(num_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    """

    num_heads: int
    num_kv_heads: int
    blocks: tuple[RowBlock, ...]
    #: the module normalizes queries and keys per head (QK-norm): scaling their projections'
    #: rows does not change the logits (see [Note: QK-clip and QK-norm] in ``api.py``)
    qk_norm: bool = False

    def __post_init__(self) -> None:
        h, kv = self.num_heads, self.num_kv_heads
        if h < 1 or kv < 1 or h % kv:
            raise ValueError("matrixfsdp.qk_clip.AttentionLayout: num_heads must be a positive multiple of "
                             f"num_kv_heads, got num_heads={h}, num_kv_heads={kv}")
        if not self.blocks:
            raise ValueError("matrixfsdp.qk_clip.AttentionLayout: blocks must name at least one projection")
        for part in ("q", "k"):
            if not any(b.part == part and not b.optional for b in self.blocks):
                raise ValueError(f"matrixfsdp.qk_clip.AttentionLayout: no (non-optional) {part!r} block in "
                                 f"{[b.param for b in self.blocks]}")

    def heads_of(self, block: RowBlock) -> int:
        """Heads laid out in ``block``: query heads for query parts, key heads for keys."""
        return self.num_kv_heads if block.part == "k" else self.num_heads

    def rows_of(self, block: RowBlock) -> tuple[list[int], list[int]]:
        """``(rows, heads)``: the projection rows ``block`` covers and the head of each."""
        n = block.rows_per_head
        rows, heads = [], []
        for h in range(self.heads_of(block)):
            first = block.offset + h * block.stride + block.start
            rows.extend(range(first, first + n))
            heads.extend([h] * n)
        return rows, heads

    @property
    def group_size(self) -> int:
        """Query heads per key head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def mha(cls, num_heads: int, head_dim: int, num_kv_heads: int | None = None, *, q: str = "q_proj",
            k: str = "k_proj", qk_norm: bool = False) -> "AttentionLayout":
        """Separate query and key projections (``q.weight``: ``num_heads * head_dim`` rows,
        ``k.weight``: ``num_kv_heads * head_dim``), their biases scaled with them when present."""
        kv = num_heads if num_kv_heads is None else num_kv_heads
        blocks = (RowBlock(f"{q}.weight", "q", head_dim), RowBlock(f"{q}.bias", "q", head_dim, optional=True),
                  RowBlock(f"{k}.weight", "k", head_dim), RowBlock(f"{k}.bias", "k", head_dim, optional=True))
        return cls(num_heads, kv, blocks, qk_norm)

    @classmethod
    def fused_qkv(cls, num_heads: int, head_dim: int, num_kv_heads: int | None = None, *,
                  qkv: str = "qkv_proj") -> "AttentionLayout":
        """One projection whose rows are ``[q (num_heads * head_dim); k (num_kv_heads * head_dim); v]``."""
        kv = num_heads if num_kv_heads is None else num_kv_heads
        k0 = num_heads * head_dim
        blocks = (RowBlock(f"{qkv}.weight", "q", head_dim), RowBlock(f"{qkv}.bias", "q", head_dim, optional=True),
                  RowBlock(f"{qkv}.weight", "k", head_dim, offset=k0),
                  RowBlock(f"{qkv}.bias", "k", head_dim, offset=k0, optional=True))
        return cls(num_heads, kv, blocks)

    @classmethod
    def mla(cls, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, *,
            q: str = "q_b_proj", kv: str = "kv_b_proj") -> "AttentionLayout":
        """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): ``q`` rows per head are
        ``[nope; rope]``, ``kv`` (the kv up-projection) rows per head ``[k_nope; v]``. ``q_nope``
        is scaled by ``gamma ** alpha``, ``q_rope`` by ``gamma``, ``k_nope`` by
        ``gamma ** (1 - alpha)``; the shared rotary key (in the kv down-projection) and ``v`` are not."""
        qd = qk_nope_head_dim + qk_rope_head_dim
        blocks = (RowBlock(f"{q}.weight", "q", qd, 0, qk_nope_head_dim),
                  RowBlock(f"{q}.weight", "q_rope", qd, qk_nope_head_dim, qk_rope_head_dim),
                  RowBlock(f"{kv}.weight", "k", qk_nope_head_dim + v_head_dim, 0, qk_nope_head_dim))
        return cls(num_heads, num_heads, blocks)


def _config_of(module: nn.Module) -> Any:
    for name in ("config", "cfg"):
        cfg = getattr(module, name, None)
        if isinstance(getattr(cfg, "num_attention_heads", None), int):
            return cfg
    return None


def _linear(module: nn.Module, name: str) -> bool:
    sub = getattr(module, name, None)
    return isinstance(sub, nn.Module) and getattr(sub, "weight", None) is not None


def built_in_layout(module: nn.Module) -> AttentionLayout | None:
    """The layout of an attention module this package recognizes, else ``None``.

    Keyed on duck-typed attributes, not classes, so that no model library is imported: a module
    with a ``config`` (or ``cfg``) carrying Hugging Face's field names (``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``) and

    * ``kv_b_proj`` with ``qk_nope_head_dim``/``qk_rope_head_dim``/``v_head_dim`` in its config:
      MLA (Hugging Face DeepSeek-V3; the query projection is ``q_b_proj``, or ``q_proj`` without a
      query LoRA);
    * ``q_proj`` and ``k_proj``: MHA or GQA (matrixfsdp's ``models.decoder.Attention``, Hugging
      Face Llama, Qwen2/Qwen3, Mistral, ...); ``q_norm`` and ``k_norm`` mark QK-norm.
    """
    cfg = _config_of(module)
    if cfg is None:
        return None
    heads = cfg.num_attention_heads
    if _linear(module, "kv_b_proj") and all(
            isinstance(getattr(cfg, a, None), int) for a in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")):
        q = "q_b_proj" if _linear(module, "q_b_proj") else "q_proj"
        if not _linear(module, q):
            return None
        return AttentionLayout.mla(heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, q=q)
    if not (_linear(module, "q_proj") and _linear(module, "k_proj")):
        return None
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    qk_norm = isinstance(getattr(module, "q_norm", None), nn.Module) and isinstance(getattr(module, "k_norm", None),
                                                                                   nn.Module)
    return AttentionLayout.mha(heads, head_dim, kv, qk_norm=qk_norm)


def warn_qk_norm(names: list[str]) -> None:
    if names:
        warnings.warn(
            f"matrixfsdp.qk_clip.QKClip: {len(names)} attention module(s) normalize queries and keys per head "
            f"(QK-norm, e.g. {names[0]!r}): the rows QK-clip scales are normalized again before the logits, so "
            "the clip does not bound them there (the max logits are still captured and reported)",
            UserWarning, stacklevel=3)
