"""Models shipped with matrixfsdp: the small Qwen3-style decoder of the main job and the planner's
presets."""

from .decoder import PRESETS, Decoder, DecoderConfig, DecoderLayer

__all__ = ["Decoder", "DecoderConfig", "DecoderLayer", "PRESETS"]
