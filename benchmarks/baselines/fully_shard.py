"""matrixfsdp's ``fully_shard`` (``matrixfsdp``): the runtime under test; on a 2-D mesh the
HSDP rows ``mfsdp_repeat`` / ``mfsdp_split`` (:func:`mfsdp_impl`).
"""

from __future__ import annotations

from typing import Any

import torch

from matrixfsdp import DecoderLayer
from matrixfsdp.optim import Muon

from .core import Impl, build_model, check_routes, muon_param_groups


class MatrixFSDP(Impl):
    """The runtime under test. Expected API (issue 3, being written)::

        plan = matrixfsdp.plan_owners(model, mesh, block_types=(DecoderLayer,))
        for layer in model.model.layers:
            matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
        opt = matrixfsdp.optim.Muon(groups, ..., ns_dtype=cfg.ns_torch_dtype)   # purely local step
    """

    name = "matrixfsdp"

    @staticmethod
    def resolve_api(source: str = "public") -> tuple[Any, Any]:
        """(fully_shard, plan_owners), or raise ImportError/AttributeError saying why not."""
        import matrixfsdp as mf

        if source == "public":
            return mf.fully_shard, mf.plan_owners
        if source == "_runtime":  # the in-progress private module (development only)
            from matrixfsdp._fully_shard import fully_shard

            return fully_shard, mf.plan_owners
        raise ValueError(f"unknown matrixfsdp source {source!r}")

    #: issue 17's ``plan_owners(..., replica_step=...)`` on a 2-D (HSDP) mesh; None: the flat API
    replica_step: str | None = None

    def _plan_kwargs(self, plan_owners: Any) -> dict[str, Any]:
        if self.replica_step is None:
            return {}
        import inspect

        if self.ctx.mesh.ndim != 2:
            raise ValueError(f"{self.name} needs a 2-D (dp_replicate, dp_shard) mesh: run step_bench with --mesh R,S")
        if "replica_step" not in inspect.signature(plan_owners).parameters:
            raise ImportError("matrixfsdp's HSDP API (issue 17) is not in this checkout: plan_owners() has no "
                              "replica_step argument; merge the 'HSDP runtime' commit to run this row")
        return {"replica_step": self.replica_step}

    def setup(self) -> None:
        fully_shard, plan_owners = self.resolve_api(self.ctx.matrixfsdp_source)
        extra = self._plan_kwargs(plan_owners)
        model = build_model(self.cfg)
        mesh = self.ctx.mesh
        plan = plan_owners(model, mesh, block_types=(DecoderLayer,), **extra)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, plan=plan)
        fully_shard(model, mesh=mesh, plan=plan)
        self.model = model
        self.plan = plan
        self.opts = [Muon(muon_param_groups(model.named_parameters(), auto=True), **self.cfg.muon_kwargs())]
        self.notes.append(check_routes(self.opts[0], model.named_parameters()))
        kw = "".join(f", {k}={v!r}" for k, v in extra.items())
        self.notes.append(f"plan_owners(model, mesh{' (2-D)' if mesh.ndim == 2 else ''}, block_types=(DecoderLayer,){kw}) "
                          f"digest={getattr(plan, 'digest', '?')}; fully_shard per DecoderLayer + root "
                          f"(source={self.ctx.matrixfsdp_source})")

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        # the parity gather reads values: under split, finish a pending replica exchange first
        sync = getattr(self.model, "sync_params", None)
        if self.replica_step is not None and callable(sync):
            sync()
        return super().named_parameters()

    def param_tensors(self) -> list[torch.Tensor]:
        # byte counts only (also read inside the last step's timing window): no exchange
        return list(self.model.parameters())


def mfsdp_impl(name: str, replica_step: str) -> type[Impl]:
    return type(f"MatrixFSDP_{replica_step}", (MatrixFSDP,), {"name": name, "replica_step": replica_step})
