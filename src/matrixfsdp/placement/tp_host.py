"""The TP host descriptor: which rank of a tensor-parallel group steps a TP-sharded matrix.

[Note: TP hosts]
Under tensor parallelism (torch's ``parallelize_module``: ``ColwiseParallel`` gives ``Shard(0)``,
``RowwiseParallel`` ``Shard(1)`` on the ``"tp"`` mesh) no rank holds a weight whole. Canzona's
TP half gives every such matrix one *host* rank of its TP group: per micro-group of matrices one
fused all-to-all gathers the gradient shards to their hosts, each host runs the whole-matrix step
(its optimizer state lives there, whole, and nowhere else, unless ``shard_state`` below), and one
fused all-to-all scatters the
update shards back, which every rank adds to its shard. Only gradients and updates move.

The descriptor is what an optimizer sees of this (``tp_host_of``): ``host`` (the TP rank that
steps it), ``is_local`` (this rank is the host: it keeps the whole state, where state is kept
whole) and ``executor``, the runtime
object an optimizer hands its hosted parameters to with their update rules and its state
(``executor.step([(param, rule), ...], state)``, a collective within the TP group; see
``matrixfsdp/tp/host_step.py`` and [Note: update-rule protocol] in ``optim/rule.py``). ``host_mesh`` is the
one-rank mesh the host's state is presented on in state dicts. With ``shard_state`` (data-parallel
hosting) a rule whose state is element-wise keeps it on every rank's shard instead, and only the
update's whole-matrix half runs on the host ([Note: state on the shards] in ``optim/rule.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TPHosted", "tp_host_of", "set_tp_host"]

_ATTR = "_matrixfsdp_tp_host"


@dataclass(frozen=True)
class TPHosted:
    """TP rank ``host`` of ``mesh`` (the 1-D ``"tp"`` mesh) steps this matrix (see [Note: TP hosts]).

    Example::

        info = matrixfsdp.tp.tp_host_of(model.blocks[0].mlp.up.weight)
        info.host, info.is_local, info.group   # host rank, this rank steps it, micro-group index
    """

    host: int
    group: int  #: the micro-group it travels in
    mesh: DeviceMesh = field(compare=False, repr=False)
    executor: Any = field(default=None, compare=False, repr=False)
    host_mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    #: the host step keeps element-wise state on the shards (rules with ``shards_state``; see
    #: [Note: state on the shards] in ``optim/rule.py``): a hosted matrix under ``fully_shard``'s
    #: adaptive placement. ``False`` (TP): the host keeps every rule's state whole
    shard_state: bool = field(default=False, compare=False)

    @property
    def is_local(self) -> bool:
        return self.mesh.get_local_rank() == self.host


def tp_host_of(t: Any) -> TPHosted | None:
    """The TP host descriptor of a TP-sharded matrix under ``matrixfsdp.tp.host_matrices``."""
    return getattr(t, _ATTR, None)


def set_tp_host(t: Any, info: TPHosted) -> None:
    setattr(t, _ATTR, info)
