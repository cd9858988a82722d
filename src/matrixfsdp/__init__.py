"""matrixfsdp: whole-matrix optimizers (Muon, Shampoo, SOAP) under FSDP2 with owner placement.

Each 2D weight is owned whole by one data-parallel rank (the others hold empty shards), so the
backward reduction lands the full averaged gradient on its owner and the optimizer step runs
locally with zero communication.

    plan = matrixfsdp.plan_owners(model, mesh, block_types=(Block,))
    for block in model.blocks:
        matrixfsdp.fully_shard(block, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    opt = matrixfsdp.optim.Muon(model, lr=0.02)
"""

from . import checkpoint, optim
from ._fully_shard import MatrixFSDPModule, fully_shard
from ._replicate import MatrixReplicateModule, replicate
from .placement import Owned, clip_grad_norm_, full_tensor, owned_of, set_full_
from .planner import MatrixRule, OwnerPlan, ParamPlan, plan_owners

__version__ = "0.1.0"

#: Submodules loaded on first attribute access (``matrixfsdp.titan`` imports torchtitan, ``train``
#: tqdm and matplotlib, ``hf_trainer`` transformers; ``import matrixfsdp`` stays light and works without them).
_LAZY_SUBMODULES = ("titan", "train", "plan", "hf_trainer", "tp", "qk_clip")

#: Names kept at the top level for code written against earlier versions: the demo decoder (now
#: ``matrixfsdp.models``) and torch's ``MixedPrecisionPolicy`` (import it from torch).
_ALIASES = {"Decoder": "matrixfsdp.models", "DecoderConfig": "matrixfsdp.models",
            "DecoderLayer": "matrixfsdp.models", "PRESETS": "matrixfsdp.models",
            "MixedPrecisionPolicy": "torch.distributed.fsdp"}


def __getattr__(name: str):
    import importlib

    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _ALIASES:
        return getattr(importlib.import_module(_ALIASES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES) | set(_ALIASES))

__all__ = [
    "plan_owners",
    "OwnerPlan",
    "ParamPlan",
    "MatrixRule",
    "fully_shard",
    "MatrixFSDPModule",
    "replicate",
    "MatrixReplicateModule",
    "clip_grad_norm_",
    "Owned",
    "owned_of",
    "set_full_",
    "full_tensor",
    "optim",
    "checkpoint",
]
