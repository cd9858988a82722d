"""Stock torch FSDP2 (``fully_shard`` per DecoderLayer + root) + AdamW (``fsdp2_adamw``): the
forward/backward reference; its wrapping and shard-group helpers serve the FSDP2-based rows.
"""

from __future__ import annotations

from typing import Any

import torch

from matrixfsdp import Decoder

from .core import Impl, build_model


def shard_group(mesh: Any) -> Any:
    """The process group of the ``dp_shard`` dimension: the whole 1-D mesh, or under HSDP (a 2-D
    ``("dp_replicate", "dp_shard")`` mesh) this rank's shard group, where each replica repeats the
    baselines' optimizer collectives and Newton-Schulz."""
    return mesh.get_group() if mesh.ndim == 1 else mesh["dp_shard"].get_group()


def fsdp2_wrap(model: Decoder, mesh: Any) -> Decoder:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class FSDP2AdamW(Impl):
    """Stock FSDP2 + torch AdamW on everything: the forward/backward reference."""

    name = "fsdp2_adamw"
    same_numerics = False

    def setup(self) -> None:
        model = fsdp2_wrap(build_model(self.cfg, self.ctx.device), self.ctx.mesh)
        self.model = model
        c = self.cfg
        self.opts = [torch.optim.AdamW(model.parameters(), lr=c.adamw_lr, betas=c.adamw_betas,
                                       eps=c.adamw_eps, weight_decay=c.adamw_weight_decay)]
        self.notes.append("torch.optim.AdamW (default foreach) on every parameter: a different "
                          "optimizer, so its parity column is not a correctness check")
