"""The mesh caches of [Note: mesh caches die with their meshes] across process groups: group names restart with every
``init_process_group``, so a mesh of a new process group can equal, by value and group names, a
mesh of a destroyed one that is still alive. Its sub-meshes must be made afresh on the new
groups, never found in the old mesh's cache (they would broadcast over destroyed groups)."""

from __future__ import annotations

import multiprocessing

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def _two_worlds() -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from matrixfsdp.placement.owner import _identity, owner_meshes, owner_source

    out = {}
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    old = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    old_subs = owner_meshes(old)
    old_group = owner_source(old_subs[1])[0].get_group()
    dist.destroy_process_group()
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    new = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    out["same_identity"] = _identity(new) == _identity(old)  # the situation the cache must survive
    new_subs = owner_meshes(new)
    out["fresh"] = all(a is not b for a, b in zip(old_subs, new_subs))
    # what a sub-mesh's full value is broadcast over: the new world's group, not the destroyed one
    group = owner_source(new_subs[1])[0].get_group()
    out["resolves"] = group is not None and group is not old_group
    out["again"] = owner_meshes(init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",)))[1] is new_subs[1]
    dist.destroy_process_group()
    return out


def test_a_mesh_of_a_new_process_group_never_gets_a_destroyed_groups_sub_meshes():
    # a process of its own: the default process group is initialized and destroyed twice
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out = pool.apply(_two_worlds)
    assert out == {"same_identity": True, "fresh": True, "resolves": True, "again": True}, out
