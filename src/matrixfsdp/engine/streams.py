"""The side streams one model's collectives run on (FSDP2's ``FSDPCommContext``).

Both front-ends take their streams from here: ``fully_shard``'s blocks and ``replicate``'s
buckets copy in, gather and reduce on the same three streams, ordered against the compute stream
by events (see [Note: streams] in ``engine/reducer.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["CommContext"]


class CommContext:
    """The streams shared by all blocks or buckets under one root. ``None`` streams on the CPU,
    where gloo's asynchronous works are waited for by the host instead."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cpu":
            self.copy_in = self.gather = self.reduce = self.all_reduce = None
        else:
            mod = torch.get_device_module(device.type)
            # high priority, as FSDP2's: communication should not queue behind compute kernels
            self.copy_in = mod.Stream(device=device, priority=-1)
            self.gather = mod.Stream(device=device, priority=-1)
            self.reduce = mod.Stream(device=device, priority=-1)
            # HSDP's cross-replica phase (FSDP2's all-reduce stream): it overlaps the next block's
            # in-node reduce-scatter instead of queueing behind it on the reduce stream
            self.all_reduce = mod.Stream(device=device)

    @property
    def on_device(self) -> bool:
        return self.gather is not None

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        """Run the enclosed ops on ``stream`` after it waited for the compute stream."""
        if stream is None:
            return contextlib.nullcontext()
        mod = torch.get_device_module(self.device.type)
        # device-module types throughout (see [Note: event waits] in comm/collectives.py)
        stream.wait_stream(mod.current_stream(self.device))
        return mod.stream(stream)
