"""Tensor parallelism: TP-sharded matrices stepped whole on host ranks (Canzona's TP half).

    tp_mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    groups = matrixfsdp.tp.host_matrices(model, tp_mesh)        # micro-groups and hosts, planned
    opt = matrixfsdp.optim.Muon(model, lr=0.02)                 # hosted matrices: whole-matrix rule

See [Note: TP hosts] in ``placement/tp_host.py`` and ``host_step.py``.
"""

from ..placement.tp_host import TPHosted, tp_host_of
from .api import comm_counter, host_matrices, set_pipeline
from .host_step import TPHostStep

__all__ = ["host_matrices", "set_pipeline", "comm_counter", "tp_host_of", "TPHosted", "TPHostStep"]
