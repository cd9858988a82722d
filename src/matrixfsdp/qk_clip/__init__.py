"""QK-clip (MuonClip, Kimi K2 Section 2.1): per-head rescaling of the query and key projections
after each optimizer step, so that no attention logit exceeds ``tau``, on any optimizer and any
placement (see [Note: QK-clip] in ``api.py`` and docs/optimizers.md, "QK-clip (MuonClip)").

    qk = matrixfsdp.qk_clip.QKClip(model, optimizer, tau=100.0)
"""

from .api import QKClip
from .capture import head_max_logits, sdpa_capture
from .layout import AttentionLayout, RowBlock, built_in_layout

__all__ = ["QKClip", "AttentionLayout", "RowBlock", "built_in_layout", "head_max_logits", "sdpa_capture"]
