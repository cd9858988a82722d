"""The TP host step through the project's protocols (issue 25): its all-to-alls go through comm/'s
counted collectives (``matrixfsdp.tp.comm_counter``), and it runs optimizers through the public
update-rule protocol alone (``opt.rule_for(p)``; [Note: update-rule protocol])."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import matrixfsdp
from _harness import get_pool
from fully_shard.test_features import collective_spy
from tp.test_host_matrices import _batch, _opt
from fully_shard.test_tp import FwdNet, _build, _global_batch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _hosted_bytes_sent(model, tp_rank, tp, flags):
    """Bytes this rank sends in one step: its gradient shards of matrices hosted elsewhere, and
    the update shards of the matrices it hosts for the other ranks (each with its flag where
    gradients are rank-local: ``host_matrices``, not ``fully_shard``)."""
    from matrixfsdp.tp.host_step import shard_sizes

    sent = 0
    for p in model.parameters():
        h = matrixfsdp.tp.tp_host_of(p)
        if h is None or h.executor is None:
            continue
        d = p.placements[0].dim % 2
        rows, cols = p.shape
        sizes = shard_sizes(p.shape[d], tp)
        # its rows, and the flag that goes with them ([Note: gradients missing on some ranks])
        shard = lambda q: (sizes[q] * (cols if d == 0 else rows) + flags) * p.element_size()  # noqa: E731
        sent += shard(tp_rank) if h.host != tp_rank else sum(shard(q) for q in range(tp) if q != tp_rank)
    return sent


def counted_dp1(steps=2):
    """host_matrices at dp=1: every step's all-to-alls are counted by comm/'s counter."""
    tp = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    model = FwdNet(80)
    for b in model.blocks:
        parallelize_module(b, mesh, {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
    groups = matrixfsdp.tp.host_matrices(model, mesh)
    opt = _opt("muon", model)
    counter = matrixfsdp.tp.comm_counter(model)
    out = {"groups": len(groups), "steps": [], "expected_bytes": _hosted_bytes_sent(model, mesh.get_local_rank(), tp, 1)}
    for step in range(steps):
        model(*_batch(step)).backward()
        counter.reset()
        with collective_spy() as spy:
            opt.step()
        out["steps"].append({"counted": counter.snapshot(), "python": list(spy["python"])})
        opt.zero_grad()
    return out


def counted_dp2():
    """fully_shard + TP at (2, 2): the step's collectives are the owner rows' counted TP
    all-to-alls; the data-parallel (shard) group's counter sees none."""
    mesh, model, _, plan = _build(2, 2, 80, "muon")
    d = mesh["dp_shard"].get_local_rank()
    opt = _opt("muon", model)
    tp_counter = matrixfsdp.tp.comm_counter(model)
    dp_counter = matrixfsdp._fully_shard.comm_counter(model)
    x, y = _global_batch(0, 2)
    model(x[2 * d:2 * d + 2], y[2 * d:2 * d + 2]).backward()
    tp_counter.reset()
    dp_counter.reset()
    with collective_spy() as spy:
        opt.step()
    return {"tp": tp_counter.snapshot(), "dp": dp_counter.snapshot(), "python": list(spy["python"]),
            "my_groups": len(plan.micro_groups[d]) if plan.micro_groups else 0,
            "expected_bytes": _hosted_bytes_sent(model, mesh["tp"].get_local_rank(), 2, 0)}


def rejects_a_non_rule():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = FwdNet(80)
    for b in model.blocks:
        parallelize_module(b, mesh, {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
    matrixfsdp.tp.host_matrices(model, mesh)
    w = model.blocks[0].up.weight
    coll = matrixfsdp.tp.tp_host_of(w).executor.coll
    msg = None
    try:  # comm/'s wrapper checks its splits before anything is issued
        coll.all_to_all_single(torch.empty(3), torch.empty(4), [1, 1], [2, 2], async_op=False)
    except ValueError as e:
        bad_splits = str(e)
    executor = matrixfsdp.tp.tp_host_of(w).executor
    try:
        executor.step([(w, object())], {})
    except TypeError as e:
        msg = str(e)
    # the earlier call form step(optimizer, group, params) goes through the public rule_for
    opt = _opt("muon", model)
    model(*_batch(0)).backward()
    group = opt.param_groups[0]
    hosted = [p for p in group["params"] if matrixfsdp.tp.tp_host_of(p) is not None]
    executor.counter.reset()
    executor.step(opt, group, hosted)
    return msg, bad_splits, executor.counter.calls, len(executor.groups), executor.host_steps


def test_tp_all_to_alls_are_counted_by_comm_at_dp1():
    res = get_pool(2).run(counted_dp1)
    for r in res:
        for s in r["steps"]:
            # what torch.distributed saw is what comm/ counted: 2 all-to-alls per micro-group
            assert s["python"] and all(c.endswith("all_to_all_single") for c in s["python"])
            assert s["counted"]["calls"] == {"all_to_all_single": 2 * r["groups"]} == {"all_to_all_single": len(s["python"])}
            assert s["counted"]["bytes_sent"] == {"all_to_all_single": r["expected_bytes"]}
    # every byte one rank sends another receives
    assert sum(r["steps"][0]["counted"]["bytes_sent"]["all_to_all_single"] for r in res) == \
        sum(r["steps"][0]["counted"]["bytes_recv"]["all_to_all_single"] for r in res) > 0


def test_tp_all_to_alls_are_counted_by_comm_under_fully_shard():
    res = get_pool(4).run(counted_dp2)
    for r in res:
        assert r["dp"]["calls"] == {}, r["dp"]  # nothing across data parallelism
        n = 2 * r["my_groups"]
        assert len(r["python"]) == n and r["tp"]["calls"] == ({"all_to_all_single": n} if n else {})
        if n:
            assert r["tp"]["bytes_sent"] == {"all_to_all_single": r["expected_bytes"]}
    assert sum(r["my_groups"] for r in res) > 0  # some row stepped something


def test_tp_host_step_takes_update_rules_only():
    res = get_pool(2).run(rejects_a_non_rule)
    msg, bad_splits, calls, groups, _ = res[0]
    assert calls == {"all_to_all_single": 2 * groups} and sum(r[4] for r in res) == 4
    assert msg is not None and "TPHostStep.step" in msg and "UpdateRule" in msg and "object" in msg
    assert "all_to_all_single: splits must have W=2 entries summing to the buffers' sizes" in bad_splits
    assert "recv_splits [1, 1] for 3" in bad_splits


def list_routing_warnings():
    """``Muon(model.parameters())`` on a host_matrices model: the hosted DTensors are stepped
    whole ("auto" asks the same descriptor as the warning), so nothing is reported."""
    import warnings

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = FwdNet(80)
    for b in model.blocks:
        parallelize_module(b, mesh, {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
    matrixfsdp.tp.host_matrices(model, mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = matrixfsdp.optim.Muon(list(model.parameters()), lr=0.02)
    hosted = [p for p in model.parameters() if matrixfsdp.tp.tp_host_of(p) is not None]
    return ([str(w.message) for w in caught if "routes" in str(w.message)],
            [opt.rule_for(p).name for p in hosted])


def test_list_routing_does_not_flag_tp_hosted_matrices():
    msgs, rules = get_pool(2).run(list_routing_warnings)[0]
    assert rules == ["muon"] * 4
    assert msgs == [], msgs
