"""The owner-placement runtime behind ``matrixfsdp.fully_shard``, split along FSDP2's lines.

* ``api.py``: ``fully_shard``, ``MatrixFSDPModule`` (FSDP2's controls), hook installation;
* ``init.py``: registration, resolution against the plan, argument and plan checks;
* ``state.py``: hooks and ordering (forward, backward, final callback, stale state);
* ``param_group.py``: a block's buffers, collectives and streams;
* ``param.py``: one parameter's sharded DTensor and unsharded leaf.
"""

from torch.distributed.fsdp import MixedPrecisionPolicy

from .api import (MatrixFSDPModule, UnshardHandle, check_layout, comm_counter, drop_stale_state,
                   fully_shard, get_state, materialized_modules)
from .state import BlockState, RootContext, ShardConfig, TrainingState

__all__ = [
    "fully_shard",
    "MatrixFSDPModule",
    "UnshardHandle",
    "comm_counter",
    "get_state",
    "drop_stale_state",
    "materialized_modules",
    "check_layout",
    "MixedPrecisionPolicy",
    "BlockState",
    "RootContext",
    "ShardConfig",
    "TrainingState",
]
