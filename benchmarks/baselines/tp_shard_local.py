"""Newton-Schulz on each rank's local TP shard (``tp_shard_local``; Megatron's ``blockwise``,
MuonBP): inexact, timing only.
"""

from __future__ import annotations

from typing import Any

import torch

from matrixfsdp.optim import Muon

from .core import muon_param_groups
from .tp import TPImpl


class ShardLocalMuon(Muon):
    """Muon on each local TP shard (Megatron's ``blockwise``, MuonBP): no communication, inexact."""

    def _check_whole(self, p: torch.Tensor, local: torch.Tensor, index: int) -> None:
        pass  # the shard is the matrix here


class TPShardLocal(TPImpl):
    name = "tp_shard_local"
    same_numerics = False

    def make_opt(self, mesh: Any) -> torch.optim.Optimizer:
        if self.composed:
            self.notes.append("INEXACT (timing only): stock FSDP2 + TP, Newton-Schulz on each rank's local (dp, tp) "
                              "block, lr adjusted by the block's shape (Megatron 'blockwise' / MuonBP on the local "
                              "block); no optimizer communication")
        else:
            self.notes.append("INEXACT (timing only): Newton-Schulz on each rank's local shard, lr adjusted by the "
                              "shard's shape (Megatron 'blockwise' / MuonBP); no optimizer communication")
        return ShardLocalMuon(muon_param_groups(self.model.named_parameters()), **self.cfg.muon_kwargs())
