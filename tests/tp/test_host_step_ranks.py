"""The TP host step when ranks disagree (issue 29): a gradient missing on one rank only, and
micro-groups mixing dtypes ([Note: gradients missing on some ranks] in ``tp/host_step.py``).

Before: the stages came from each rank's ``p.grad is not None``, so a rank without a gradient
left the matrix out of its all-to-all splits while its peer kept it in (gloo raised on the
mismatched sizes, NCCL hangs); and ``_all_to_all`` sent the members' promoted dtype but received
in the first member's, so a group of a bf16 and an fp32 matrix exchanged mismatched bytes.
Now every rank stages the same members and issues the same collectives with the same splits;
a missing gradient is stepped as zeros, a gradient missing everywhere is skipped everywhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import matrixfsdp
from _harness import get_pool
from matrixfsdp.tp.host_step import TPHostStep

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _params(mesh, b_dtype):
    """``b`` (Shard(1), 5 columns over 2 ranks: uneven) and ``a`` (fp32, Shard(0))."""
    g = torch.Generator().manual_seed(0)
    full_b = torch.randn(6, 5, generator=g).to(b_dtype)
    full_a = torch.randn(7, 4, generator=g)
    b = torch.nn.Parameter(distribute_tensor(full_b, mesh, [Shard(1)]))
    a = torch.nn.Parameter(distribute_tensor(full_a, mesh, [Shard(0)]))
    return b, a


def _grads(b, a, step):
    g = torch.Generator().manual_seed(10 + step)
    for p in (b, a):
        full = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)


class _HostBuilt(TorchDispatchMode):
    """Tensors built from host data (``torch.tensor(list)``: ``lift_fresh``); on an accelerator
    each is a host-to-device copy from pageable memory, a host sync."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


def _run(scenario, shard_state, grouping="fused", b_dtype=torch.float32, steps=2):
    """Two steps of a two-member host step; ``scenario`` says who lacks ``b``'s gradient in the
    first step: ``"zeros"`` (rank 1 holds zeros), ``"none"`` (rank 1 holds ``None``), ``"all_none"``
    (no rank holds one)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank = mesh.get_local_rank()
    b, a = _params(mesh, b_dtype)
    # the rules of an optimizer over plain stand-ins (the protocol alone reaches the host step)
    stand_ins = [torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype)) for p in (b, a)]
    opt = matrixfsdp.optim.Muon(stand_ins, lr=0.02, ns_dtype=torch.float32, weight_decay=0.1)
    state: dict = {}
    members = [("b", b, 0), ("a", a, 1)]
    groups = [members] if grouping == "fused" else [[m] for m in members]
    ex = TPHostStep(mesh, groups, shard_state=shard_state)
    items = [(b, opt.rule_for(stand_ins[0])), (a, opt.rule_for(stand_ins[1]))]
    out = {"after": []}
    for step in range(steps):
        _grads(b, a, step)
        if step == 0 and (scenario == "all_none" or (scenario == "none" and rank == 1)):
            b.grad = None
        elif step == 0 and scenario == "zeros" and rank == 1:
            b.grad._local_tensor.zero_()
        ex.counter.reset()
        with _HostBuilt() as built:
            ex.step(items, state)
        out.setdefault("host_built", []).append(built.n)
        out["after"].append({n: p.detach().full_tensor().float() for n, p in (("b", b), ("a", a))})
        out.setdefault("calls", []).append(dict(ex.counter.calls))
        out.setdefault("sent", []).append(dict(ex.counter.bytes_sent))
        out.setdefault("recv", []).append(dict(ex.counter.bytes_recv))
        out.setdefault("state_b", []).append({k: v.float().clone() if isinstance(v, torch.Tensor) else v
                                              for k, v in state.get(b, {}).items()})
    return out


def missing_grads() -> dict:
    return {(sc, ss): _run(sc, ss) for sc in ("zeros", "none", "all_none") for ss in (False, True)}


def _same(x, y):
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k], k


def test_a_gradient_missing_on_one_rank_is_stepped_as_zeros_with_the_same_collectives():
    res = get_pool(2).run(missing_grads, timeout=90)
    for ss in (False, True):  # whole state on the host; Muon's momentum on the shards
        for r in res:
            # the same collectives, the same sizes on every rank as with the gradient present
            assert r[("none", ss)]["calls"] == r[("zeros", ss)]["calls"] == [{"all_to_all_single": 2}] * 2
            assert r[("none", ss)]["sent"] == r[("zeros", ss)]["sent"]
            assert r[("all_none", ss)]["calls"] == r[("zeros", ss)]["calls"]
            # the flag chunks are made once per pattern (issue 40): none built from a host list
            # in a step whose patterns an earlier step had (before: one per host and direction)
            for sc in ("zeros", "none", "all_none"):
                assert r[(sc, ss)]["host_built"][0] > 0 and r[(sc, ss)]["host_built"][1] == 0, sc
            # None on one rank is zeros there, bitwise, in the parameters and in the state
            for k in range(2):
                _same(r[("none", ss)]["after"][k], r[("zeros", ss)]["after"][k])
                _same(r[("none", ss)]["state_b"][k], r[("zeros", ss)]["state_b"][k])
            # no rank has the gradient: skipped on every rank (no decay, no state), as an
            # optimizer skips a None .grad; ``a`` in the same micro-group is stepped as before
            skipped = r[("all_none", ss)]
            assert torch.equal(skipped["after"][0]["a"], r[("zeros", ss)]["after"][0]["a"])
            assert skipped["state_b"][0] == {}
            assert skipped["after"][1]["b"].ne(r[("zeros", ss)]["after"][0]["b"]).any()  # stepped at step 1
        assert sum(r[("none", ss)]["sent"][0]["all_to_all_single"] for r in res) == \
            sum(r[("none", ss)]["recv"][0]["all_to_all_single"] for r in res) > 0
    b0 = _params_full()
    for r in res:
        assert torch.equal(r[("all_none", False)]["after"][0]["b"], b0)  # untouched: no decay either


def _params_full():
    return torch.randn(6, 5, generator=torch.Generator().manual_seed(0))


def mixed_dtypes() -> dict:
    out = {}
    for ss in (False, True):
        fused, apart = (_run("zeros", ss, how, torch.bfloat16) for how in ("fused", "apart"))
        out[ss] = {"fused": fused["after"], "apart": apart["after"], "calls": (fused["calls"], apart["calls"])}
    return out


def test_a_micro_group_mixing_bf16_and_fp32_steps_as_separate_groups():
    # the bf16 member first: before, the receive was bf16 while the send was promoted to fp32
    for r in get_pool(2).run(mixed_dtypes, timeout=90):
        for ss, o in r.items():
            assert o["calls"][0][0] == {"all_to_all_single": 2} and o["calls"][1][0] == {"all_to_all_single": 4}
            for k in range(2):
                _same(o["fused"][k], o["apart"][k])  # one fp32 wire, each piece back in its dtype
