"""Models shipped with matrixfsdp: the small Qwen3-style decoder of the main job, a mixture-of-experts
decoder, and the planner's presets of both."""

from .decoder import PRESETS, Decoder, DecoderConfig, DecoderLayer
from .moe import MOE_PRESETS, MoEConfig, MoEDecoder, MoEDecoderLayer

__all__ = ["Decoder", "DecoderConfig", "DecoderLayer", "PRESETS", "MoEDecoder", "MoEConfig", "MoEDecoderLayer",
           "MOE_PRESETS"]
