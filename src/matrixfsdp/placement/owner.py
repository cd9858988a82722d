"""The owner descriptor: which data-parallel rank updates a parameter and keeps its optimizer state.

[Note: one owner descriptor]
Both front-ends give each parameter they place on one rank an :class:`Owned` descriptor, reachable
with :func:`owner_of`. Its ``storage`` says what the other ranks hold:

* ``"sharded"`` (``fully_shard``, ZeRO-3): the parameter is an owned DTensor, whole on the owner
  and an empty ``[0, ...]`` shard elsewhere (see [Note: owned parameter representation]);
* ``"replicated"`` (``replicate``, ZeRO-1/2): every rank holds the whole (plain) tensor, the owner
  alone receives its reduced gradient and updates it, the others receive the new value at the next
  forward.

Optimizers, clipping and checkpoints consult this descriptor alone (``is_local``: this rank steps
it and keeps its state; ``owner_mesh``: where that state is presented in state dicts), whichever
front-end placed the parameter. :func:`owned_of`, the public lookup, answers for ``"sharded"``
parameters only: they are the ones whose local tensor is empty on non-owners.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Owned", "owner_of", "owned_of", "is_owned", "keeps_state", "set_owner", "owner_meshes", "STORAGES"]

_ATTR = "_matrixfsdp_owned"
#: set by fully_shard on each sharded parameter (owned or even): its fqn, for messages
FQN_ATTR = "_matrixfsdp_fqn"

#: what ranks other than the owner hold (see the Note)
STORAGES = ("sharded", "replicated")


@dataclass(frozen=True)
class Owned:
    """Rank ``owner`` of the data-parallel ``mesh`` updates this parameter and keeps its state.

    ``kind`` is the plan placement (``"matrix"`` or ``"tail"``); ``storage`` what the other ranks
    hold (see [Note: one owner descriptor]).

    Example::

        info = matrixfsdp.owned_of(model.blocks[0].attn.q_proj.weight)
        if info is not None and info.owner == mesh.get_local_rank():
            ...  # the whole matrix is p.to_local()
    """

    owner: int
    kind: str
    mesh: DeviceMesh | None = field(default=None, compare=False, repr=False)
    storage: str = "sharded"

    @property
    def is_local(self) -> bool:
        """Whether this rank is the owner (it steps the parameter and keeps its state)."""
        return self.mesh is not None and self.mesh.get_local_rank() == self.owner

    @property
    def owner_mesh(self) -> DeviceMesh:
        """The owner's one-rank sub-mesh, on which its state is presented in state dicts."""
        if self.mesh is None:
            raise ValueError(f"matrixfsdp: owner descriptor {self!r} has no data-parallel mesh")
        return owner_meshes(self.mesh)[self.owner]


def owner_of(t: Any) -> Owned | None:
    """The owner descriptor of a parameter placed by either front-end, else ``None``."""
    return getattr(t, _ATTR, None)


def owned_of(t: Any) -> Owned | None:
    """The :class:`Owned` metadata of a ``fully_shard``-owned parameter (whole on its owner, an
    empty shard elsewhere), else ``None``."""
    info = owner_of(t)
    return info if info is not None and info.storage == "sharded" else None


def is_owned(t: Any) -> bool:
    """Whether ``t`` is a ``fully_shard``-owned parameter."""
    return owned_of(t) is not None


def keeps_state(t: Any) -> bool:
    """Whether this rank steps ``t`` and keeps its optimizer state: every rank for a parameter
    without an owner (plain, or evenly sharded), only the owner otherwise, whichever front-end
    placed it. The one rule optimizers, checkpoint loaders and ``replicate`` apply."""
    info = owner_of(t)
    if info is None:
        return True
    if info.mesh is None:  # a descriptor built without its mesh: the local tensor tells
        return getattr(t, "_local_tensor", t).numel() != 0
    return info.is_local


def set_owner(t: Any, info: Owned) -> None:
    """Attach ``info`` to parameter ``t`` (the front-ends call this once per parameter)."""
    if info.storage not in STORAGES:
        raise ValueError(f"matrixfsdp: storage must be one of {STORAGES}, got {info.storage!r}")
    setattr(t, _ATTR, info)


_OWNER_MESHES: dict[DeviceMesh, tuple[DeviceMesh, ...]] = {}


def owner_meshes(mesh: DeviceMesh) -> tuple[DeviceMesh, ...]:
    """The one-rank sub-meshes ``[mesh.mesh[r]]`` for every ``r`` (created once, collectively).

    Every rank must call this the first time for a given ``mesh`` (``fully_shard`` does).
    """
    subs = _OWNER_MESHES.get(mesh)
    if subs is None:
        ranks = mesh.mesh.flatten().tolist()
        # Named after the owner, so DTensor's errors tell the meshes apart ("owned_by_rank3@..."),
        # and after the data-parallel mesh: two meshes over the same ranks that differ only in
        # their dimension names (or two groups sharing a rank) must not share an owner sub-mesh,
        # which DeviceMesh compares by ranks and names (the inverse map below would mix them up).
        tag = hashlib.sha1(repr((ranks, tuple(mesh.shape), mesh.mesh_dim_names, mesh.device_type))
                           .encode()).hexdigest()[:8]
        # No communicator: a one-rank [Replicate()] mesh never communicates (W new_group
        # calls would mean W communicator splits, with eager NCCL init, for nothing).
        subs = tuple(
            DeviceMesh(mesh.device_type, [g], mesh_dim_names=(f"owned_by_rank{r}@{tag}",), _init_backend=False)
            for r, g in enumerate(ranks)
        )
        _OWNER_MESHES[mesh] = subs
        for r, sub in enumerate(subs):
            _OWNER_OF[sub] = (mesh, r)
    return subs


# owner sub-mesh -> (data-parallel mesh, owner rank); filled by owner_meshes
_OWNER_OF: dict[DeviceMesh, tuple[DeviceMesh, int]] = {}
