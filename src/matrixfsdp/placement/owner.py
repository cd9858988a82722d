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
front-end placed the parameter.

On an HSDP mesh (``replicas x S``) the owner is a shard coordinate: the owner's rank in *every*
replica holds the parameter whole (``holds``), and its owner sub-mesh spans those ``R`` ranks. With
a ``step_replica`` (``split``, see [Note: replicas and step replicas] in ``planner/owner_plan.py``) only
that replica's owner steps it and keeps its state (``is_local``), presented on a one-rank *step
mesh*; the others receive the new value from it (``exchange``, which the runtime sets, brings
them up to date on demand: ``settle()``). :func:`owned_of`, the public lookup, answers for ``"sharded"``
parameters only: they are the ones whose local tensor is empty on non-owners.

[Note: step receipts]
Under ``split`` an owner outside the step replica gets no ``.grad`` (only the step replica holds
the sum), yet every other rank learns from its ``.grad`` (whole, or an empty shard) that the
step replica keeps state, and state dicts must present the same keys on every rank. So the
runtime gives each ``split`` descriptor a :class:`StepReceipt` and sets it on that owner when a
reduction lands the sum on the step replica (some rank used the parameter); optimizers read it
through ``stepping_of(p).reduced_elsewhere`` where they read ``p.grad is not None``. It mirrors the
step replica's ``.grad``: a reducing backward after this rank's gradients of the block were
cleared (``zero_grad``) starts it afresh, one that accumulates onto them keeps it. What it cannot
see: gradients cleared between a backward and ``step()`` with no backward after (a step on no
gradients).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed
from torch.distributed.device_mesh import DeviceMesh

from ..mesh import flat_dp_mesh, mesh_tag
from .tp_host import tp_host_of

__all__ = ["Owned", "StepReceipt", "owner_of", "owned_of", "is_owned", "keeps_state", "set_owner", "owner_meshes",
           "step_meshes", "one_rank_meshes", "owner_tp_meshes", "shard_dim_mesh", "owner_source", "mesh_scratch",
           "dp_tp_mesh", "tp_mesh_of", "coordinates", "STORAGES"]

_ATTR = "_matrixfsdp_owned"
#: set by fully_shard on each sharded parameter (owned or even): its fqn, for messages
FQN_ATTR = "_matrixfsdp_fqn"
#: set by fully_shard on each sharded parameter: the plan's placement of it (``"matrix"``,
#: ``"hosted"``, ``"experts"``, ``"tail"``, ``"even"``), checked against how an optimizer would
#: step it (see [Note: routing invariant] in ``planner/rules.py``)
PLACEMENT_ATTR = "_matrixfsdp_placement"

#: what ranks other than the owner hold (see the Note)
STORAGES = ("sharded", "replicated")


class StepReceipt:
    """Whether a ``split`` parameter's step replica holds a reduced gradient, as this rank (an
    owner outside it) learned from the runtime (see [Note: step receipts])."""

    __slots__ = ("reduced",)

    def __init__(self) -> None:
        self.reduced = False


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
    #: the replica whose owner alone steps it (HSDP ``split``), else ``None``
    step_replica: int | None = None
    #: the runtime's pending replica exchange (an object with ``settle()``), if any
    exchange: Any = field(default=None, compare=False, repr=False)
    #: ``split``: the runtime's :class:`StepReceipt` (see [Note: step receipts]), else ``None``
    receipt: StepReceipt | None = field(default=None, compare=False, repr=False)

    @property
    def holds(self) -> bool:
        """Whether this rank holds the whole parameter (it is the owner in its replica)."""
        return self.mesh is not None and coordinates(self.mesh)[1] == self.owner

    @property
    def is_local(self) -> bool:
        """Whether this rank steps the parameter and keeps its state (the owner, in the step
        replica if it has one)."""
        if self.mesh is None:
            return False
        r, s = coordinates(self.mesh)
        return s == self.owner and (self.step_replica is None or r == self.step_replica)

    @property
    def owner_mesh(self) -> DeviceMesh:
        """The mesh its state is presented on in state dicts: the owner sub-mesh (one rank, or the
        owner of every replica), or under ``split`` the step replica's one-rank step mesh."""
        if self.mesh is None:
            raise ValueError(f"matrixfsdp: owner descriptor {self!r} has no data-parallel mesh")
        if self.step_replica is not None:
            return step_meshes(self.mesh)[self.step_replica][self.owner]
        return owner_meshes(self.mesh)[self.owner]

    @property
    def reduced_elsewhere(self) -> bool:
        """Whether this rank holds it, another replica steps it, and that replica holds a
        reduced gradient (see [Note: step receipts])."""
        return self.receipt is not None and self.receipt.reduced and self.holds and not self.is_local

    def settle(self) -> None:
        """Finish a pending replica exchange (a collective over the replicas; no-op otherwise)."""
        if self.exchange is not None:
            self.exchange.settle()


def coordinates(mesh: DeviceMesh) -> tuple[int | None, int | None]:
    """This rank's ``(replica, shard)`` coordinate in a 1-D or 2-D data-parallel mesh."""
    c = mesh.get_coordinate()
    if c is None:
        return None, None
    return (0, c[0]) if len(c) == 1 else (c[0], c[1])


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
    placed it. The one rule optimizers, checkpoint loaders and ``replicate`` apply; a hosted matrix
    whose rule keeps its state on the shards (Muon under ``fully_shard``'s hosting) is kept on
    every rank instead, which only the optimizer knows: ask ``stepping_of(p, elementwise_state=)``
    or ``opt.state_on_shards(p)``."""
    info, host = owner_of(t), tp_host_of(t)  # a TP-hosted matrix: its host keeps the state
    if info is None:
        return True if host is None else host.is_local
    if info.mesh is None:  # a descriptor built without its mesh: the local tensor tells
        return getattr(t, "_local_tensor", t).numel() != 0
    # under fully_shard + TP the owner's whole TP row holds the matrix; its host steps it
    return info.is_local and (host is None or host.is_local)


def set_owner(t: Any, info: Owned) -> None:
    """Attach ``info`` to parameter ``t`` (the front-ends call this once per parameter)."""
    if info.storage not in STORAGES:
        raise ValueError(f"matrixfsdp: storage must be one of {STORAGES}, got {info.storage!r}")
    setattr(t, _ATTR, info)


# [Note: mesh caches die with their meshes]
# The sub-meshes made here (owner, step, one-rank and TP-row meshes) and what each one stands for
# live on the mesh objects themselves, never in a module-level registry: a data-parallel mesh
# carries a _MeshCache of the sub-meshes made from it, and each sub-mesh carries the mesh its full
# value is broadcast over (and its owner's index there), plus, for a TP-row mesh, this rank's TP
# mesh. These are ordinary references, so a model's parameters keep their sub-meshes (and those
# their data-parallel mesh) alive, and once model and mesh are dropped the whole graph is garbage
# (cycles included). A slice or a default mesh is a new object per call, equal to the last and
# resolving the same process groups; such meshes share one cache, found by value through _CACHES,
# whose values are held weakly and whose keys are plain tuples, so nothing in it keeps a mesh alive.
# The value includes the names of the process groups the mesh resolves: sub-meshes carry the mesh
# their full value is broadcast over, so two meshes over the same ranks with other groups (two
# init_device_mesh calls) must not share them; their sub-meshes are distinct objects that compare
# equal, so ops between their owned tensors (loading one model's state dict into the other) are
# DTensor ops on one mesh, as DTensor compares meshes by value. When a dropped mesh's cache dies is
# up to the garbage collector, which runs at different times on different ranks; had an equal mesh
# with other groups found it alive on some ranks only, those ranks would broadcast over the old
# groups and the others over the new ones, and the broadcast would hang. The attributes travel with
# a mesh's __dict__ when it is pickled or copied (DeviceMesh.__getstate__), so a copy still answers
# owner_source(); a cache itself is not copied (it becomes None, and the copy looks its value up
# again).
_CACHE_ATTR = "_matrixfsdp_mesh_cache"
_SOURCE_ATTR = "_matrixfsdp_owner_source"
_TP_ATTR = "_matrixfsdp_tp_mesh"


class _MeshCache:
    """The sub-meshes made from one data-parallel mesh (see the Note above)."""

    __slots__ = ("group", "owner", "step", "one_rank", "owner_tp", "scratch", "__weakref__")

    def __init__(self, group: Any = None) -> None:
        # the process group the mesh's first dimension resolved when this cache was made: group
        # names restart with every init_process_group, so a mesh of a new process group can
        # equal, by value and names, one of a destroyed group whose cache the garbage collector
        # has not yet dropped; the group object tells them apart (held here, so its id is not reused)
        self.group = group
        self.owner: Sequence[DeviceMesh] | None = None
        self.step: tuple[Sequence[DeviceMesh], ...] | None = None
        self.one_rank: dict[str, Sequence[DeviceMesh]] = {}
        self.owner_tp: dict[tuple, tuple[DeviceMesh, ...]] = {}
        self.scratch: dict[str, Any] = {}

    def __reduce__(self) -> tuple:
        # a pickled or copied mesh carries no cache (it may hold weak references): the copy finds
        # the live one of its value, or starts its own
        return type(None), ()


_CACHES: "weakref.WeakValueDictionary[tuple, _MeshCache]" = weakref.WeakValueDictionary()


def _cache(mesh: DeviceMesh) -> _MeshCache:
    """``mesh``'s cache: its own, or the one of an equal mesh still alive (made once per value)."""
    c = mesh.__dict__.get(_CACHE_ATTR)
    if c is None:
        key = _identity(mesh)
        group = _first_group(mesh)
        c = _CACHES.get(key)
        if c is None or c.group is not group:  # none yet, or a destroyed process group's
            c = _CACHES[key] = _MeshCache(group)
        setattr(mesh, _CACHE_ATTR, c)
    return c


def _first_group(mesh: DeviceMesh) -> Any:
    """The process group ``mesh``'s first dimension resolves now (``None``: none resolves)."""
    try:
        return mesh.get_group(0)
    except (RuntimeError, ValueError, KeyError):
        return None


def _identity(mesh: DeviceMesh) -> tuple:
    """What makes two meshes interchangeable here: their value *and* the process groups they
    resolve (see [Note: mesh caches die with their meshes])."""
    return (mesh.device_type, tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape), mesh.mesh_dim_names,
            tuple(getattr(mesh, "_dim_group_names", None) or ()))


def mesh_scratch(mesh: DeviceMesh) -> dict[str, Any]:
    """A dict shared by every mesh equal to ``mesh`` and dropped with the last of them, for a
    front-end's per-mesh bookkeeping (see [Note: mesh caches die with their meshes])."""
    return _cache(mesh).scratch


def owner_source(mesh: DeviceMesh) -> tuple[DeviceMesh, int] | None:
    """For a matrixfsdp owner, step, one-rank or TP-row mesh: the mesh its tensors' full value is
    broadcast over and the owner's rank in it; ``None`` for any other mesh."""
    return mesh.__dict__.get(_SOURCE_ATTR)


def _grid(mesh: DeviceMesh) -> list[list[int]]:
    """Global ranks as ``[replica][shard]`` (one replica for a 1-D mesh)."""
    return mesh.mesh.reshape(-1, int(mesh.shape[-1])).tolist()


def owner_meshes(mesh: DeviceMesh) -> Sequence[DeviceMesh]:
    """The owner sub-meshes for every shard coordinate ``s``: the ranks holding what ``s`` owns,
    one per replica (one rank on a 1-D mesh). Called collectively (HSDP makes its step group
    here); each sub-mesh is made, locally, on first access.

    Every rank must call this the first time for a given ``mesh`` (``fully_shard`` does).
    """
    cache = _cache(mesh)
    if cache.owner is None:
        tag, grid = mesh_tag(mesh), _grid(mesh)
        shard = mesh if mesh.get_coordinate() is None else shard_dim_mesh(mesh)

        def make(s: int) -> DeviceMesh:
            # No communicator: a [Replicate()] tensor on these meshes never communicates (W
            # new_group calls would mean W communicator splits, with eager NCCL init, for nothing).
            # Named after the owner, so DTensor's errors tell the meshes apart ("owned_by_rank3@...").
            sub = _mesh_without_group(mesh.device_type, [row[s] for row in grid], f"owned_by_rank{s}@{tag}")
            setattr(sub, _SOURCE_ATTR, (shard, s))  # full_tensor broadcasts within this rank's shard group
            return sub

        cache.owner = _LazyMeshes(make, len(grid[0]))
        if mesh.ndim == 2:
            _make_step_meshes(mesh, cache)
    return cache.owner


def step_meshes(mesh: DeviceMesh) -> tuple[Sequence[DeviceMesh], ...]:
    """``[replica][shard]`` one-rank meshes, on which ``split`` state is presented (HSDP only;
    created by :func:`owner_meshes`)."""
    owner_meshes(mesh)
    subs = _cache(mesh).step
    if subs is None:
        raise ValueError(f"matrixfsdp: step meshes exist for 2-D (HSDP) meshes only, got {mesh}")
    return subs


def _make_step_meshes(mesh: DeviceMesh, cache: _MeshCache) -> None:
    # The full value of a step-mesh tensor is broadcast over every data-parallel rank: one
    # flattened group, created here, where every rank calls (collective).
    if mesh.get_coordinate() is None:
        return
    subs, S = one_rank_meshes(flat_dp_mesh(mesh), "stepped_by_rank"), int(mesh.shape[-1])
    cache.step = tuple(_LazyMeshes(lambda s, q=q: subs[q * S + s], S) for q in range(int(mesh.shape[0])))


def one_rank_meshes(over: DeviceMesh, label: str) -> Sequence[DeviceMesh]:
    """One-rank meshes ``{label}{i}@...``, one per rank ``i`` of the 1-D mesh ``over``, on which a
    tensor whole on that rank is presented (state dicts, DCP); its ``full_tensor()`` broadcasts
    over ``over``. No communicator (created once per ``(over, label)``; local)."""
    cache = _cache(over)
    subs = cache.one_rank.get(label)
    if subs is None:
        tag, ranks = mesh_tag(over), over.mesh.flatten().tolist()

        def make(i: int) -> DeviceMesh:
            sub = _mesh_without_group(over.device_type, [ranks[i]], f"{label}{i}@{tag}")
            setattr(sub, _SOURCE_ATTR, (over, i))
            return sub

        subs = cache.one_rank[label] = _LazyMeshes(make, len(ranks))
    return subs


class _LazyMeshes(Sequence):
    """A tuple of sub-meshes, each made on first access: a model uses the owner meshes of the
    ranks that own something, and making all ``W`` costs milliseconds each (seconds of every
    rank's init at thousands of ranks). Each is made once, so identity holds per index."""

    __slots__ = ("_make", "_items")

    def __init__(self, make: Callable[[int], DeviceMesh], n: int) -> None:
        self._make = make
        self._items: list[DeviceMesh | None] = [None] * n

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        got = self._items[i]
        if got is None:
            got = self._items[i] = self._make(range(len(self._items))[i])
        return got


def _mesh_without_group(device_type: str, ranks: list[int], name: str) -> DeviceMesh:
    """A 1-D mesh over ``ranks`` with no process group (owner, step and one-rank meshes).

    It records an empty list of group names: torch 2.13's dynamo reads ``_dim_group_names`` of
    every mesh it meets (DeviceMesh is a registered opaque type) and refuses a mesh built with
    ``_init_backend=False`` that lacks it, so ``torch.compile(opt.step)`` could not trace an
    owned parameter. Empty, no group is ever resolved (``__setstate__`` of dynamo's guard copies
    resolves none); a collective on such a mesh still fails in ``get_group()``, with an
    ``IndexError`` instead of torch's "process groups not initialized"."""
    sub = DeviceMesh(device_type, ranks, mesh_dim_names=(name,), _init_backend=False)
    sub._dim_group_names = []
    return sub


def shard_dim_mesh(dp: DeviceMesh) -> DeviceMesh:
    """This rank's shard dimension of a 1-D or HSDP data-parallel mesh (the mesh itself if 1-D)."""
    return dp if dp.ndim == 1 else dp[dp.mesh_dim_names[1]]


def owner_tp_meshes(dp: DeviceMesh, tp: DeviceMesh) -> tuple[DeviceMesh, ...]:
    """The TP-row mesh of every owner ``s`` of ``dp`` (FSDP2 + TP: ``dp = mesh["dp_shard"]``,
    ``tp = mesh["tp"]`` of one ``("dp_shard", "tp")`` mesh): the ``T`` ranks at shard coordinate
    ``s``, on which a TP-sharded parameter owned by ``s`` is presented with its TP placements
    (see [Note: owned parameter representation]). This rank's own row reuses the TP group (no new
    communicator); the other rows have none (this rank is not in them). Local; cached.

    On an HSDP ``dp`` (HSDP x TP) the rows are those of this rank's replica: every replica's owner
    row holds the parameter (``repeat``, or ``split`` once exchanged), and each presents it within
    its replica (DCP writes one of the identical chunks; ``full_tensor`` broadcasts within the
    replica's shard group)."""
    dp = shard_dim_mesh(dp)
    cache = _cache(dp)
    subs = cache.owner_tp.get(_identity(tp))
    if subs is None:
        pair = dp_tp_mesh(dp, tp)
        grid = pair.mesh.tolist()
        tag, mine = mesh_tag(pair), dp.get_local_rank()
        out = []
        for s, row in enumerate(grid):
            name = (f"tp_owned_by_rank{s}@{tag}",)
            if s == mine:
                sub = DeviceMesh.from_group(tp.get_group(), tp.device_type, mesh=row, mesh_dim_names=name)
            else:
                sub = _mesh_without_group(tp.device_type, row, name[0])
            setattr(sub, _SOURCE_ATTR, (dp, s))
            setattr(sub, _TP_ATTR, tp)  # the full value's TP all-gather runs on this rank's TP mesh
            out.append(sub)
        subs = cache.owner_tp[_identity(tp)] = tuple(out)
    return subs


def dp_tp_mesh(dp: DeviceMesh, tp: DeviceMesh) -> DeviceMesh:
    """The ``(dp, tp)`` mesh whose dimensions ``dp`` and ``tp`` are: ``root[(dp, tp)]`` of their
    common root (a ``("dp_shard", "tp")`` mesh; with an HSDP ``dp``, the 3-D ``("dp_replicate",
    "dp_shard", "tp")`` one), or, when the root knows neither name as one of its dimensions
    (torchtitan slices ``"fsdp"`` and ``"tp"`` from different unflattenings of its 1-D world
    mesh), the slices joined (``DeviceMesh._concatenate``, torch 2.13; existing groups). Two
    slices of different roots raise."""
    root = dp._get_root_mesh()
    names = (*(dp.mesh_dim_names or (None,) * dp.ndim), (tp.mesh_dim_names or (None,))[0])
    pair = None
    if None not in names:
        try:
            pair = root if tuple(root.mesh_dim_names or ()) == names else root[names]
        except (KeyError, RuntimeError, ValueError):
            # The two are slices of different unflattenings of the root (torchtitan: "fsdp" of its
            # dense mesh, "tp" of its data-loading mesh, both from the 1-D world mesh, which
            # knows neither name): join their layouts (and existing groups) directly.
            try:
                pair = DeviceMesh._concatenate([dp, tp])
            except (KeyError, RuntimeError, ValueError):
                pair = None
    # DeviceMesh compares by value (a DTensor's mesh may be an equal object of another root), so
    # the check is by ranks: this rank's row (last dimension) and column of the pair are tp and dp
    if pair is not None:
        grid, me = pair.mesh, torch.distributed.get_rank()
        at = (grid == me).nonzero()
        if pair.ndim != dp.ndim + 1 or len(at) != 1:
            pair = None
        else:
            *rest, t = at[0].tolist()
            if grid[tuple(rest)].tolist() != tp.mesh.tolist() or grid[..., t].tolist() != dp.mesh.tolist():
                pair = None
    if pair is None:
        raise ValueError(
            f"matrixfsdp: the data-parallel mesh {dp} and the parameters' TP mesh {tp} must be "
            f"{'two' if dp.ndim == 1 else 'three'} named dimensions of one mesh: "
            "init_device_mesh(device_type, (dp, tp), mesh_dim_names=(\"dp_shard\", \"tp\")), then "
            "mesh[\"dp_shard\"] and mesh[\"tp\"] (HSDP x TP: (R, S, T) named (\"dp_replicate\", "
            "\"dp_shard\", \"tp\"), then mesh[\"dp_replicate\", \"dp_shard\"] and mesh[\"tp\"])"
        )
    return pair


def tp_mesh_of(owner_mesh: DeviceMesh) -> DeviceMesh | None:
    """This rank's TP mesh for an owner TP-row mesh (:func:`owner_tp_meshes`), else ``None``."""
    return owner_mesh.__dict__.get(_TP_ATTR)
