"""The engine pieces both front-ends share, tested from the outside: the class swap (one naming
policy), the agreement ("every rank agrees or every rank raises"), device choice by what a
backend serves (never by its name), and the mesh-info object."""

from __future__ import annotations

import copy
import gc

import pytest

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool

import matrixfsdp
from matrixfsdp.placement.tp_host import tp_host_of
from matrixfsdp import mesh as mesh_mod
from matrixfsdp.comm import agree as agree_mod
from matrixfsdp.engine.swap import front_end_of, user_class


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _swapped(front: str) -> dict:
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if front == "fully_shard":
        matrixfsdp.fully_shard(model, mesh=mesh)
        mixin = matrixfsdp.MatrixFSDPModule
    else:
        matrixfsdp.replicate(model, mesh=mesh)
        mixin = matrixfsdp.MatrixReplicateModule
    try:
        copy.deepcopy(model)
        err = "no error"
    except Exception as e:  # noqa: BLE001 - the type is part of what is checked
        err = f"{type(e).__name__}: {e}"
    return {"name": type(model).__name__, "qualname": type(model).__qualname__,
            "isinstance": isinstance(model, mixin) and isinstance(model, Net),
            "user_class": user_class(model) is Net, "front_end": front_end_of(model) is mixin,
            "deepcopy": err}


@pytest.mark.parametrize("front", ["fully_shard", "replicate"])
def test_class_swap_keeps_the_user_class_name_and_refuses_deepcopy(front):
    api = f"matrixfsdp.{front}"
    for r in get_pool(2).run(_swapped, front):
        assert r["name"] == "Net" and r["qualname"] == Net.__qualname__, r
        assert r["isinstance"] and r["user_class"] and r["front_end"], r
        assert r["deepcopy"] == (f"TypeError: {api}: deepcopy of a managed module is not supported; copy "
                                 "the model before sharding it, or build a new one and load a state dict"), r


def _agree_error_on_one_rank() -> str:
    err = agree_mod.encode_error(FileNotFoundError("no such checkpoint")) if dist.get_rank() == 1 else None
    try:
        agree_mod.agree(err, fingerprint="same")
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_agreement_raises_one_ranks_error_on_every_rank():
    out = get_pool(2).run(_agree_error_on_one_rank)
    assert out == ["FileNotFoundError: no such checkpoint (reported by rank 1)",
                   "FileNotFoundError: no such checkpoint"]


def _agree_fingerprints() -> list:
    return agree_mod.agree(None, fingerprint=f"rank{dist.get_rank()}")


def test_agreement_returns_every_ranks_fingerprint_in_rank_order():
    assert get_pool(3).run(_agree_fingerprints) == [["rank0", "rank1", "rank2"]] * 3


@pytest.mark.parametrize("config,devices", [
    ("gloo", {"cpu", "mps"}),  # torch's default device map
    ("nccl", {"cuda"}),
    ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
    ("undefined", set()),
])
def test_backend_devices_come_from_the_backend_config(monkeypatch, config, devices):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert mesh_mod.backend_devices() == devices


@pytest.mark.parametrize("config,expected", [
    ("gloo", "cpu"),                 # small agreement tensors on the CPU
    ("cpu:gloo,cuda:nccl", "cpu"),   # torchtitan's mixed group: gloo serves the CPU
    ("undefined", "cpu"),
])
def test_agreement_device_needs_no_accelerator_when_the_cpu_is_served(monkeypatch, config, expected):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert agree_mod.agreement_device().type == expected


def test_agreement_device_is_the_accelerator_for_an_nccl_only_group(monkeypatch):
    class Acc:
        type = "cuda"

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "nccl")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: Acc())
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    assert agree_mod.agreement_device() == torch.device("cuda", 3)


def test_mesh_info_refuses_what_it_cannot_run_with_the_api_named():
    with pytest.raises(TypeError, match=r"^matrixfsdp\.replicate: mesh must be a DeviceMesh, got int$"):
        mesh_mod.mesh_info(4, api="matrixfsdp.replicate")


def _mesh_info_2d() -> str:
    m = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp_replicate", "dp_shard"))
    info = mesh_mod.mesh_info(m["dp_shard"], api="x")
    out = f"{info.shard_size} {info.shard_rank} {info.replicate_size} {info.tp_size} {info.device}"
    matrixfsdp.replicate(Net(), mesh=m)  # an HSDP mesh (here of one replica) is taken
    swapped = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp_shard", "dp_replicate"))
    try:
        matrixfsdp.replicate(Net(), mesh=swapped)
    except ValueError as e:
        return out + " | " + str(e)
    return out + " | no error"


def test_mesh_info_roles_and_the_2d_mesh_of_replicate():
    for r, out in enumerate(get_pool(2).run(_mesh_info_2d)):
        assert out == (f"2 {r} 1 1 cpu | matrixfsdp.replicate: dimension 0 of a 2-D mesh replicates and "
                       "dimension 1 shards (as torch's HSDP), but this mesh is named ('dp_shard', "
                       "'dp_replicate'); build it as init_device_mesh(device_type, (R, S), "
                       "mesh_dim_names=(\"dp_replicate\", \"dp_shard\"))"), out


def _paths_under(config: str) -> dict:
    """Collectives chosen for CPU and CUDA tensors when the group reports ``config``; then one
    uneven reduce-scatter and in-place gather really run on the CPU tensors."""
    from types import SimpleNamespace

    from matrixfsdp.comm.collectives import AllToAllCollectives

    real = dist.get_backend_config
    dist.get_backend_config = lambda group=None: config  # what torchtitan's or a bare init reports
    try:
        coll = AllToAllCollectives(dist.group.WORLD)
    finally:
        dist.get_backend_config = real
    cuda_like = SimpleNamespace(device=torch.device("cuda"))
    r, W = dist.get_rank(), dist.get_world_size()
    splits = [3, 1][:W]
    inp = torch.arange(sum(splits), dtype=torch.float32) + 10 * r
    out = torch.empty(splits[r])
    coll.reduce_scatter_segments(out, inp, splits, async_op=False).wait()
    buf = torch.full((sum(splits),), float(r))
    coll.all_gather_inplace(buf, splits, async_op=False).wait()
    return {"cpu": coll._uneven_lists(inp), "cuda": coll._uneven_lists(cuda_like),
            "reduced": out.tolist(), "gathered": buf.tolist()}


@pytest.mark.parametrize("config,cuda_native", [("cpu:gloo,cuda:nccl", True), ("undefined", False),
                                                 ("gloo", False), ("nccl", True)])
def test_collectives_are_chosen_by_the_tensor_device(config, cuda_native):
    out = get_pool(2).run(_paths_under, config)
    for r, o in enumerate(out):
        assert o["cpu"] is False and o["cuda"] is cuda_native, o  # CPU tensors: gloo's P2P forms
        assert o["reduced"] == ([10.0, 12.0, 14.0] if r == 0 else [16.0]), o
        assert o["gathered"] == [0.0, 0.0, 0.0, 1.0], o


def _replicate_collectives(kind: str) -> dict:
    """replicate with each collectives implementation: two steps of SGD on the same data."""
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    matrixfsdp.replicate(model, mesh=mesh, collectives=kind, bucket_numel=40)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    r = dist.get_rank()
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + r))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    model.sync_params()
    calls = model.comm_counter().snapshot()["calls"]
    return {"params": [p.detach().clone() for p in model.parameters()], "calls": calls}


def test_replicate_takes_every_collectives_implementation():
    """collectives= reaches replicate's reduce-scatter and in-place gather: p2p gives all_to_all's
    bits on gloo (the same P2P primitives), two_phase (ring phases, other summation order) agrees
    to float rounding, and its own phases are what ran."""
    runs = {k: get_pool(3).run(_replicate_collectives, k) for k in ("all_to_all", "p2p", "two_phase")}
    for r in range(3):
        base = runs["all_to_all"][r]["params"]
        assert all(torch.equal(a, b) for a, b in zip(base, runs["p2p"][r]["params"]))
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(base, runs["two_phase"][r]["params"]))
        assert all(torch.equal(a, b) for a, b in zip(base, runs["all_to_all"][0]["params"]))  # ranks agree
    phases = runs["two_phase"][0]["calls"]
    assert phases.get("two_phase_scatter", 0) > 0 and phases.get("two_phase_reduce_scatter", 0) > 0, phases
    assert "reduce_scatter" not in phases and "all_gather" not in phases, phases


def _replicate_bad_collectives() -> str:
    try:
        matrixfsdp.replicate(Net(), mesh=init_device_mesh("cpu", (dist.get_world_size(),)), collectives="ring")
    except ValueError as e:
        return str(e)
    return "no error"


def test_replicate_refuses_an_unknown_collectives_kind():
    assert get_pool(2).run(_replicate_bad_collectives) == [
        "matrixfsdp.replicate: collectives must be one of ('all_to_all', 'p2p', 'two_phase'), "
        "got collectives='ring'"] * 2


def test_set_find_unused_parameters_checks_its_argument():
    from matrixfsdp.engine.reducer import FlagRead, check_find_unused, read_flags

    assert check_find_unused(False, "matrixfsdp.replicate") is False
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match=r"matrixfsdp.replicate.set_find_unused_parameters: "
                                            r"find_unused_parameters must be a bool"):
            check_find_unused(bad, "matrixfsdp.replicate")
    # opted out: no read is started, every entry takes the reduced gradient
    entries = [("a", torch.zeros(2), torch.zeros(1)), ("b", torch.ones(2), torch.ones(1))]
    got = []
    read = read_flags(entries, find_unused=False)
    assert isinstance(read, FlagRead) and read.host is None
    read.resolve(lambda p, g: got.append(p), lambda p: got.append("unused:" + p))
    assert got == ["a", "b"]
    got.clear()
    read_flags(entries).resolve(lambda p, g: got.append(p), lambda p: got.append("unused:" + p))
    assert got == ["unused:a", "b"]


def _owned_on_meshes_named_differently() -> list:
    """Models on meshes over the same ranks that differ only in their dimension names."""
    from torch.distributed.tensor import Replicate

    W = dist.get_world_size()
    out = []
    for names in (("dp_shard",), None, ("dp_shard",)):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4, bias=False))
        mesh = init_device_mesh("cpu", (W,), mesh_dim_names=names)
        matrixfsdp.fully_shard(m, mesh=mesh)
        w = m[0].weight
        out.append(torch.equal(w.redistribute(mesh, [Replicate()]).to_local(), w.full_tensor()))
    return out


def test_owner_meshes_of_meshes_differing_only_in_names_stay_apart():
    """Each data-parallel mesh has its own owner sub-meshes: an owned tensor redistributes on the
    mesh it was sharded on, also after another mesh over the same ranks (another name) was used
    (the second model raised 'got mesh DeviceMesh((dp_shard=2)...' before)."""
    assert get_pool(2).run(_owned_on_meshes_named_differently) == [[True, True, True]] * 2


_KEEP: list = []


def _equal_mesh_with_other_groups_kept_on_some_ranks() -> list:
    """Two (2, 2) meshes over the same ranks with their own process groups; the first one's model
    (and its cached sub-meshes) is kept alive on ranks 0 and 2 only, as the garbage collector may
    leave it. The second model's full values must broadcast over the second mesh's groups on
    every rank (rank 0 used the first mesh's shard group and rank 1 the second's: a hang)."""
    from torch.distributed.tensor import Replicate

    out = []
    for i in range(2):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        matrixfsdp.fully_shard(m, mesh=mesh)
        out.append([torch.equal(p.full_tensor(), q) for p, q in
                    zip(m.parameters(), (w.weight for w in _seeded_pair()))])
        if i == 0 and dist.get_rank() in (0, 2):
            _KEEP.append(m)
        del m, mesh
        gc.collect()
    _KEEP.clear()
    return out


def _seeded_pair() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))


def test_sub_meshes_of_an_equal_mesh_with_other_groups_are_not_shared():
    """The owner meshes' caches are keyed by the process groups too: whether a dropped equal mesh
    is still alive (garbage-collector timing, rank by rank) cannot choose the group a broadcast
    uses (CI hung in a full state dict after an earlier test's model on an equal mesh)."""
    assert get_pool(4).run(_equal_mesh_with_other_groups_kept_on_some_ranks, timeout=60) == [[[True] * 2] * 2] * 4


def _dropin_after_a_model_collected_on_one_rank_only() -> list:
    """A drop-in model dropped in a reference cycle (module <-> its state), collected by rank 0
    only: the next model's call tallies the earlier call on rank 1 alone."""
    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("gc_timing",))
    first = nn.Sequential(nn.Linear(8, 8, bias=False))
    matrixfsdp.fully_shard(first, mesh=mesh)
    del first
    if dist.get_rank() == 0:
        gc.collect()
    gc.disable()  # no collection of our own making on rank 1 before the next call's check
    try:
        second = nn.Sequential(nn.Linear(8, 8, bias=False))
        matrixfsdp.fully_shard(second, mesh=mesh)  # raised "the plan differs across ranks" before
    finally:
        gc.enable()
    w = second[0].weight  # one matrix on two ranks: owned, or hosted by the default plan
    return [getattr(matrixfsdp.owned_of(w), "owner", None), getattr(tp_host_of(w), "host", None)]


def test_dropin_plan_does_not_depend_on_gc_timing():
    owners = get_pool(2).run(_dropin_after_a_model_collected_on_one_rank_only)
    assert owners[0] == owners[1], owners


def _torch_adamw_on_fully_shard_after_a_replicate() -> tuple:
    """replicate's step pre-hook (``register_optimizer``) must touch only replicate's
    parameters: a torch AdamW over a fully_shard model keeps state for its empty shards, as torch
    does for any Shard(0) shard."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rep = matrixfsdp.replicate(Net(), mesh=mesh)
    torch.manual_seed(0)
    model = Net()
    matrixfsdp.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rep.register_optimizer(opt)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.step()  # the pre-hook runs with state present
    return sorted(int(st["step"]) for st in opt.state.values()), sum(1 for p in model.parameters())


def test_replicates_step_hook_leaves_other_models_state_alone():
    for steps, n in get_pool(2).run(_torch_adamw_on_fully_shard_after_a_replicate):
        assert steps == [2] * n, steps  # no counter restarted: no state was dropped
