"""Capturing each head's largest pre-softmax logit, without changing the forward's values.

[Note: QK-clip capture]
The attention kernel never hands out its logits, so the capture recomputes them, under
``torch.no_grad`` on detached inputs, in float32, from exactly the arguments the kernel gets:
``S = q k^T * scale`` (``scale`` defaults to ``1/sqrt(head_dim)``, as SDPA's), masked as the
kernel masks it (``is_causal``: keys after the query, top-left aligned as SDPA; a boolean
``attn_mask``: where it is False; a float mask is added, as the softmax sees it), and takes the
maximum over batch, query and key positions per query head. The forward's own call is then made
with the arguments untouched, so its values are bitwise those of a run without capture.
Query rows are processed in chunks of at most ``_CHUNK`` logits, so the extra memory stays
bounded whatever the sequence length (the capture costs one extra ``q k^T`` in FLOPs).

Where it hooks in:

* ``F.scaled_dot_product_attention`` called inside an attention module's ``forward``:
  :func:`sdpa_capture`, a ``TorchFunctionMode`` that the module's own forward hooks enter and
  leave (scoped to that module's forward on the thread running it; no global patch). This is
  matrixfsdp's decoder, torchtitan's SDPA attention and Hugging Face's ``"sdpa"``;
* Hugging Face's attention-function registry: ``qk_clip/_hf.py``;
* any other kernel: :meth:`matrixfsdp.qk_clip.QKClip.observe`, e.g. with FlexAttention's
  ``max_scores`` auxiliary output (``return_aux=AuxRequest(max_scores=True)``), which is the
  kernel's own row maximum and costs nothing extra.

[Note: QK-clip and recomputation]
Each capture folds its per-head maximum into the step's running maximum (``torch.maximum``), so
what a step records is the maximum over every forward since the last clip: all microbatches of a
gradient accumulation. Activation checkpointing recomputes a block's forward in the backward: the
same weights, inputs and restored RNG state give the same ``q`` and ``k``, so the recomputed
logits are recorded again and, a maximum being idempotent, change nothing. Nothing tries to
tell a recomputation apart (reentrant checkpointing runs the first forward under ``no_grad``,
non-reentrant recomputes with grad enabled: both are counted alike). Forwards of a module in
``eval()`` mode are not recorded (an evaluation between steps must not clip the next step).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["head_max_logits", "sdpa_capture", "SDPA"]

#: logits per chunk of query rows (float32: 64 MiB)
_CHUNK = 1 << 24

#: the function the capture intercepts (torch's own object: ``torch._C._nn.scaled_dot_product_attention``)
SDPA = F.scaled_dot_product_attention


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor activation (TP with ``use_local_output=False``)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def head_max_logits(query: torch.Tensor, key: torch.Tensor, *, scale: float | None = None,
                    attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """Per query head, the largest pre-softmax logit ``q . k * scale`` that attention with these
    arguments computes (see [Note: QK-clip capture]): a float32 tensor ``[heads]`` on the query's
    device, ``-inf`` for a head whose every logit is masked. ``query``: ``[..., heads, L, E]``,
    ``key``: ``[..., kv_heads, S, E]`` (``heads`` a multiple of ``kv_heads``: grouped-query
    attention, each key head serving ``heads / kv_heads`` consecutive query heads, as
    ``enable_gqa`` and ``repeat_kv`` do). Masks as ``F.scaled_dot_product_attention`` takes them.

    Example::

        m = head_max_logits(q, k, is_causal=True)     # [heads]
    """
    q, k = _local(query).detach(), _local(key).detach()
    if q.ndim < 3 or k.ndim != q.ndim:
        raise ValueError(f"matrixfsdp.qk_clip.head_max_logits: query and key must be [..., heads, L, E] "
                         f"alike, got {tuple(q.shape)} and {tuple(k.shape)}")
    H, L, E = q.shape[-3:]
    Hk, S = k.shape[-3], k.shape[-2]
    if H % Hk:
        raise ValueError(f"matrixfsdp.qk_clip.head_max_logits: query heads ({H}) must be a multiple of key heads "
                         f"({Hk})")
    G = H // Hk  # query heads per key head: grouped as [..., Hk, G, ...], keys broadcast (never repeated)
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    mask = None if attn_mask is None else _local(attn_mask).detach()
    if mask is not None and mask.ndim >= 3:
        mask = mask.unflatten(-3, (Hk, G)) if mask.shape[-3] == H and G > 1 else mask.unsqueeze(-3)
    qg = q.unflatten(-3, (Hk, G))
    kt = k.float().transpose(-2, -1).unsqueeze(-3)  # [..., Hk, 1, E, S]
    lead = max(1, q[..., 0, 0, 0].numel())
    step = max(1, _CHUNK // max(1, lead * H * S))
    out = torch.full((H,), -math.inf, dtype=torch.float32, device=q.device)
    for i in range(0, L, step):
        j = min(L, i + step)
        s = torch.matmul(qg[..., i:j, :].float(), kt) * scale  # [..., Hk, G, l, S]
        if is_causal:
            rows = torch.arange(i, j, device=s.device)[:, None]
            s = s.masked_fill(torch.arange(S, device=s.device)[None, :] > rows, -math.inf)
        if mask is not None:
            m = mask[..., i:j, :] if mask.shape[-2] != 1 else mask
            s = s.masked_fill(~m, -math.inf) if m.dtype == torch.bool else s + m.float()
        out = torch.maximum(out, s.amax(dim=(-1, -2)).reshape(-1, H).amax(0))
    return out


def _sdpa_args(args: tuple, kwargs: dict) -> dict[str, Any]:
    """``F.scaled_dot_product_attention``'s query, key, attn_mask, is_causal, scale by name."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    got = dict(zip(names, args))
    got.update(kwargs)
    return got


class _SDPACapture(TorchFunctionMode):
    """Records the head max logits of every ``F.scaled_dot_product_attention`` call made while it
    is active, then makes the call itself with the same arguments."""

    def __init__(self, record: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self._record = record

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is SDPA:
            a = _sdpa_args(args, kwargs)
            self._record(head_max_logits(a["query"], a["key"], scale=a.get("scale"), attn_mask=a.get("attn_mask"),
                                         is_causal=bool(a.get("is_causal", False))))
        return func(*args, **kwargs)


def sdpa_capture(record: Callable[[torch.Tensor], None]) -> _SDPACapture:
    """A context manager under which every ``F.scaled_dot_product_attention`` call hands its head
    max logits (:func:`head_max_logits`) to ``record`` before running unchanged. Thread-local
    (a ``TorchFunctionMode``): only code run by this thread inside the block is seen.

    Example::

        with sdpa_capture(lambda m: print(m)):
            attn(x)
    """
    return _SDPACapture(record)
