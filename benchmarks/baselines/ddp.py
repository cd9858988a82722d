"""DDP + Muon on every rank (``ddp_muon``): the numerics reference, and the Python all-reduce
comm hook that makes DDP's collectives countable (also used by ``zero_redundancy_muon``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from matrixfsdp.optim import Muon

from .core import Impl, build_model, check_routes, muon_param_groups


def python_allreduce_hook(process_group: Any, bucket: Any) -> torch.futures.Future:
    """DDP's default all-reduce (divide by W, SUM), issued from Python so it can be counted."""
    group = process_group if process_group is not None else dist.group.WORLD
    t = bucket.buffer()
    t.div_(dist.get_world_size(group))
    fut = dist.all_reduce(t, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


# DDP checks the hook's annotations against the real classes (strings under `from __future__`).
python_allreduce_hook.__annotations__ = {
    "process_group": Any, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor],
}


class DDPMuon(Impl):
    """DDP + Muon on every rank (redundant Newton-Schulz): the numerics reference."""

    name = "ddp_muon"

    def setup(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = self.ctx.device
        model = build_model(self.cfg, dev)
        # the model has no buffers; device_ids: the one device of a single-device CUDA module
        self.model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                         gradient_as_bucket_view=True)
        self.model.register_comm_hook(None, python_allreduce_hook)
        self.opts = [Muon(muon_param_groups(self.model.named_parameters()), **self.cfg.muon_kwargs())]
        self.notes.append(check_routes(self.opts[0], self.model.named_parameters()))
        self.notes.append("DDP(gradient_as_bucket_view=True, 25 MB buckets) with a Python all-reduce "
                          "comm hook (div by W, SUM; same math as DDP's default) so its collectives "
                          f"are counted; Muon = matrixfsdp.optim.Muon(ns_dtype={self.cfg.ns_short}) on every rank")
