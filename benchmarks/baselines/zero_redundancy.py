"""DDP + torch's ``ZeroRedundancyOptimizer`` over ``matrixfsdp.optim.Muon``
(``zero_redundancy_muon``).
"""

from __future__ import annotations

import torch

from matrixfsdp.optim import Muon

from .core import Impl, build_model, imbalance, muon_cost, muon_param_groups
from .ddp import python_allreduce_hook


class ZeroRedundancyMuon(Impl):
    """DDP + torch's ``ZeroRedundancyOptimizer`` wrapping ``matrixfsdp.optim.Muon``: parameters
    partitioned by size (torch's greedy), each rank steps its partition, then every parameter is
    broadcast from its rank inside ``step()``."""

    name = "zero_redundancy_muon"

    def setup(self) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = build_model(self.cfg, self.ctx.device)
        self.model = DDP(model, gradient_as_bucket_view=True)
        self.model.register_comm_hook(None, python_allreduce_hook)
        zero = ZeroRedundancyOptimizer(muon_param_groups(self.model.named_parameters()), optimizer_class=Muon,
                                       **self.cfg.muon_kwargs())
        self.opts = [zero]
        names = {id(p): n for n, p in self.named_parameters()}
        load = [sum(muon_cost(names[id(p)], p) for g in groups for p in g["params"])
                for groups in zero._partition_parameters()]
        self.balance = imbalance(load)
        self.notes.append(f"ZeroRedundancyOptimizer(optimizer_class=matrixfsdp.optim.Muon), torch's size-greedy "
                          f"partition; step balance {self.balance:.3f}")

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o.optim for o in self.opts]  # the local optimizer holds this rank's state
