"""One way TP hosts are attached, for both ways in: ``host_matrices`` (dp=1) and ``fully_shard``
over TP-sharded parameters (``_fully_shard/tp_params.py``).

Both hand :func:`attach_hosts` the micro-groups of every owner row (at dp=1 there is one row, the
TP group itself), this rank's row, and where each host presents its state; it builds this row's
host step and every member's :class:`~matrixfsdp.placement.tp_host.TPHosted`
descriptor (see [Note: TP hosts]).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch.distributed.device_mesh import DeviceMesh

from ..placement.owner import one_rank_meshes
from ..placement.tp_host import TPHosted, set_tp_host
from .host_step import TPHostStep

__all__ = ["attach_hosts", "row_hosts"]

#: ``rows[s]``: owner row ``s``'s micro-groups, ``(group index, [(fqn, parameter, host TP rank), ...])``
Rows = Sequence[Sequence[tuple[int, Sequence[tuple[str, Any, int]]]]]
#: ``host_meshes(s, h, p)``: the one-rank mesh on which TP rank ``h`` of row ``s`` presents ``p``'s whole state
HostMeshes = Callable[[int, int, Any], DeviceMesh]


def row_hosts(row_ranks: Sequence[Sequence[int]], state_over: DeviceMesh) -> HostMeshes:
    """``host_meshes`` for rows whose ranks are ``row_ranks[s][h]`` (global ranks): the one-rank
    mesh of that rank among ``state_over``'s (a 1-D mesh holding every row: the TP mesh at dp=1,
    the flattened ``(dp, tp)`` mesh under fully_shard). Local: no collective."""
    over = state_over.mesh.flatten().tolist()
    hosts = one_rank_meshes(state_over, "tp_host")  # the hosts' state is presented on these
    return lambda s, h, p: hosts[over.index(row_ranks[s][h])]


def attach_hosts(tp_mesh: DeviceMesh, rows: Rows, my_row: int, host_meshes: HostMeshes, *,
                 pipeline: bool = True, shard_state: bool = False, grads_agree: bool = False) -> TPHostStep:
    """Attach every member of ``rows`` to its host and return this rank's host step.

    ``tp_mesh`` is this rank's TP mesh and ``my_row`` the row it belongs to (the only one whose
    members get the executor: the others are stepped by their own row). A host's whole state is
    presented on ``host_meshes(s, h, p)`` (:func:`row_hosts`); with ``shard_state`` a rule with
    element-wise state keeps it on the shards instead (``TPHosted.shard_state``); ``grads_agree``:
    the gradients are landed by ``fully_shard`` (``TPHostStep``). Local: no collective."""
    executor = TPHostStep(tp_mesh, [list(members) for _, members in rows[my_row] if members], pipeline=pipeline,
                          shard_state=shard_state, grads_agree=grads_agree)
    for s, groups in enumerate(rows):
        for k, members in groups:
            for _, p, h in members:
                set_tp_host(p, TPHosted(host=h, group=k, mesh=tp_mesh, executor=executor if s == my_row else None,
                                        host_mesh=host_meshes(s, h, p), shard_state=shard_state))
    return executor
