"""The HSDP rows (issue 17): the single-process reference (``single_muon``) and the torch
baselines on the 2-D ``(dp_replicate, dp_shard)`` mesh (:func:`hsdp_impl`).
"""

from __future__ import annotations

import torch

from matrixfsdp.optim import Muon

from .core import Impl, batch_for_step, build_model, check_routes, lm_loss, muon_param_groups


class SingleMuon(Impl):
    """The single-process run, on every rank at once: the plain model on the whole global batch
    and ``matrixfsdp.optim.Muon`` over every parameter, no communication. Its parameters are the
    HSDP rows' parity reference; its step is the total matrix work (every matrix stepped once),
    timed under the same CPU contention as the distributed rows (every rank runs it)."""

    name = "single_muon"

    def setup(self) -> None:
        self.model = build_model(self.cfg, self.ctx.device)
        self.opts = [Muon(muon_param_groups(self.model.named_parameters()), **self.cfg.muon_kwargs())]
        self.notes.append(check_routes(self.opts[0], self.model.named_parameters()))
        self.notes.append("no process group: every rank runs the whole model on the whole global batch and "
                          "steps every parameter (the total step work, under the same CPU contention)")
        self._step = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = batch_for_step(self.cfg, self._step, 0, 1, self.ctx.device)  # the global batch
        self._step += 1
        return lm_loss(self.model, tokens)


def hsdp_impl(name: str, base: type[Impl], doc: str) -> type[Impl]:
    """``base`` on the 2-D ``(dp_replicate, dp_shard)`` mesh: torch's ``fully_shard(mesh=mesh_2d)``
    is HSDP, and the optimizer collectives of the Muon baselines run within the shard group."""

    def setup(self: Impl) -> None:
        if self.ctx.mesh.ndim != 2:
            raise ValueError(f"{self.name} needs a 2-D (dp_replicate, dp_shard) mesh: run step_bench with --mesh R,S")
        base.setup(self)
        self.notes.append(doc)

    return type(f"HSDP_{base.__name__}", (base,), {"name": name, "setup": setup})
