"""matrixfsdp: whole-matrix optimizers (Muon, Shampoo, SOAP) under FSDP2 with owner placement."""

from ._decoder import PRESETS, Decoder, DecoderConfig, DecoderLayer
from ._plan import OwnerPlan, ParamPlan
from ._planner import plan_owners

__version__ = "0.1.0"

__all__ = [
    "plan_owners",
    "OwnerPlan",
    "ParamPlan",
    "Decoder",
    "DecoderConfig",
    "DecoderLayer",
    "PRESETS",
]
