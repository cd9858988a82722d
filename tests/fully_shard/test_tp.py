"""fully_shard + TP (issue 18): torch's FSDP2 + TP pattern with owners on a ("dp_shard", "tp") mesh.

``parallelize_module(block, mesh["tp"], ...)``, ``plan_owners(model, mesh)``,
``fully_shard(block, mesh=mesh["dp_shard"], plan=plan)``. Each data-parallel rank sees its own
batch (the TP ranks of a row share it); the reference is the plain model in the same process over
the whole batch. Gradients are compared directly (each rank's local tensor against the matching
part of the reference gradient), then the parameters after a few steps, then ``full_tensor()``.
The step makes exactly two all-to-alls per micro-group, only in the owners' TP rows, and nothing
across data parallelism.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import matrixfsdp
from _harness import get_pool
from fully_shard.test_features import collective_spy
from tp.test_host_matrices import MLPBlock, TPNet, _opt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

VOCAB = 64


class FwdNet(TPNet):
    """TPNet whose ``forward`` is its loss (fully_shard's hooks run on ``forward``)."""

    def forward(self, idx, tgt):
        return self.loss(idx, tgt)


def _global_batch(step, dp):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2 * dp, 8), generator=g), torch.randint(0, VOCAB, (2 * dp, 8), generator=g)


def _expect(full, p):
    """The part of ``full`` this rank's local tensor of ``p`` holds (``None``: it holds none)."""
    if not isinstance(p, DTensor):
        return full
    if p._local_tensor.numel() == 0:
        return None
    shape, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(off, shape))]


def _diff(model, ref, what):
    """Worst relative difference of this rank's local tensors against the reference; NaN-aware
    (``max(x, nan)`` is ``x`` in Python: a NaN would pass unnoticed) and a missing gradient
    where the reference has one is a failure."""
    refp = dict(ref.named_parameters())
    worst = 0.0
    for f, p in model.named_parameters():
        rp = refp[f]
        a = p.grad if what == "grad" else p
        b = rp.grad if what == "grad" else rp.detach()
        exp = None if b is None else _expect(b, p)
        if exp is None or exp.numel() == 0:
            continue
        if a is None:
            return math.inf
        mine = a._local_tensor if isinstance(a, DTensor) else a.detach()
        assert mine.shape == exp.shape, (f, mine.shape, exp.shape)
        v = (mine.float() - exp).abs().max().item() / max(b.abs().max().item(), 1e-12)
        worst = max(worst, math.inf if math.isnan(v) else v)
    return worst


def _build(dp, tp, h, optimizer):
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    model = FwdNet(h)
    ref = copy.deepcopy(model)
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(MLPBlock,), optimizer=optimizer)
    for b in model.blocks:
        matrixfsdp.fully_shard(b, mesh=mesh["dp_shard"], plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh["dp_shard"], plan=plan)
    return mesh, model, ref, plan


def fsdp_tp_parity(dp, tp, h, opt_name, steps=3):
    mesh, model, ref, plan = _build(dp, tp, h, opt_name)
    d = mesh["dp_shard"].get_local_rank()
    opt, ref_opt = _opt(opt_name, model), _opt(opt_name, ref)
    hosted = [p for p in model.parameters() if matrixfsdp.tp.tp_host_of(p) is not None]
    executors = {id(e): e for p in hosted if (e := matrixfsdp.tp.tp_host_of(p).executor) is not None}
    out = {"grad0": 0.0, "steps": [], "plan_tp": plan.tp, "hosted": len(hosted),
           "hosted_bytes": sum(p.numel() * p.element_size() for p in hosted)}
    for step in range(steps):
        x, y = _global_batch(step, dp)
        n = x.shape[0] // dp
        model(x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]).backward()
        ref.loss(x, y).backward()
        if step == 0:
            out["grad0"] = _diff(model, ref, "grad")
        c0 = {k: (e.calls["all_to_all"], e.host_steps, e.bytes_sent) for k, e in executors.items()}
        with collective_spy() as spy:
            opt.step()
        out["steps"].append({
            "python": spy["python"],
            "a2a": sum(e.calls["all_to_all"] - c0[k][0] for k, e in executors.items()),
            "host_steps": sum(e.host_steps - c0[k][1] for k, e in executors.items()),
            "groups": sum(len(e.groups) for e in executors.values()),
            "bytes": sum(e.bytes_sent - c0[k][2] for k, e in executors.items()),
            "dispatcher": spy["dispatcher"],
        })
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["param"] = _diff(model, ref, "param")
    refp = dict(ref.named_parameters())
    out["full"] = max(((matrixfsdp.full_tensor(p) - refp[f].detach()).abs().max()
                       / refp[f].detach().abs().max()).item() for f, p in model.named_parameters())
    out["state_keepers"] = sorted(f for f, p in model.named_parameters() if p in opt.state and opt.state[p])
    return out


@pytest.mark.parametrize("dp, tp, h", [(2, 2, 80), (1, 2, 80), (1, 3, 80), (3, 1, 80)])  # 80 % 3 != 0
@pytest.mark.parametrize("opt_name", ["muon", "shampoo", "soap"])
def test_fsdp_tp_parity_and_step_collectives(dp, tp, h, opt_name):
    # SOAP after one step only (see tests/tp/test_host_matrices.py: its eigenbases of rank-deficient covariances
    # drift by percents under any change of reduction order, flat meshes included)
    steps, tol = (1, 1e-4) if opt_name == "soap" else (3, 1e-5)
    res = get_pool(dp * tp).run(fsdp_tp_parity, dp, tp, h, opt_name, steps)
    for r in res:
        print(dp, tp, h, opt_name, {k: r[k] for k in ("grad0", "param", "full", "hosted")})
        assert r["grad0"] < 1e-6 and r["param"] < tol and r["full"] < tol, r
        assert r["plan_tp"] == tp
        for s in r["steps"]:
            # only the owners' TP rows communicate: two all-to-alls per micro-group, nothing else
            assert all(c.endswith("all_to_all_single") for c in s["python"]), s["python"]
            assert len(s["python"]) == s["a2a"] == 2 * s["groups"], s
    hosted = res[0]["hosted"]
    assert hosted == (4 if tp > 1 else 0)
    # bytes: gradient shards to the hosts plus update shards back, (tp-1)/tp of every hosted matrix
    # each way, once in the world (only its owner's row moves it); 80 % 3 != 0 shards unevenly
    sent = sum(r["steps"][0]["bytes"] for r in res)
    assert sent == pytest.approx(2 * res[0]["hosted_bytes"] * (tp - 1) / tp, rel=0.02), sent
    for r in res:  # at the dispatcher too: nothing but all-to-alls (gloo's alltoall_base)
        assert all("alltoall" in e.lower().replace("_", "") or "record_param_comms" in e for e in r["steps"][0]["dispatcher"]), r["steps"][0]["dispatcher"]
    for k in range(steps):  # each TP matrix is stepped on exactly one rank of the world
        assert sum(r["steps"][k]["host_steps"] for r in res) == hosted
    if tp > 1:  # the hosted matrices' state lives on their host alone
        keepers = [f for r in res for f in r["state_keepers"] if f.endswith(("up.weight", "down.weight"))]
        assert sorted(keepers) == sorted(f"blocks.{i}.{n}.weight" for i in range(2) for n in ("up", "down"))


def _build_layout(dp, tp, h, opt_name="muon"):
    """(dp, tp) > (., 1): fully_shard + TP; tp == 0: fully_shard on a flat mesh without TP; dp == 0:
    one process, no sharding."""
    if dp == 0:
        return None, FwdNet(h), None
    if tp == 0:
        mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp_shard",))
        model = FwdNet(h)
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(MLPBlock,), optimizer=opt_name)
        for b in model.blocks:
            matrixfsdp.fully_shard(b, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
        return mesh, model, plan
    mesh, model, _, plan = _build(dp, tp, h, opt_name)
    return mesh, model, plan


def _whole_state(model, opt):
    """Optimizer state this rank holds whole (owners, TP hosts), by parameter fqn."""
    out = {}
    for f, p in model.named_parameters():
        st = opt.state.get(p) or {}
        for k in ("momentum_buffer", "exp_avg"):
            v = st.get(k)
            if v is not None:
                v = v._local_tensor if isinstance(v, DTensor) else v
                if tuple(v.shape) == tuple(p.shape):
                    out[f"{f}.{k}"] = v.detach().clone()
    return out


def fsdp_tp_checkpoint(root, dp, tp, save, h=80):
    """Train 2 steps and save (``save``), or load; then one more step. Full parameters after the
    save/load and after the extra step, and the whole optimizer state this rank holds."""
    mesh, model, _ = _build_layout(dp, tp, h)
    opt = _opt("muon", model)
    rows = max(dp, 1)
    d = mesh["dp_shard"].get_local_rank() if (mesh is not None and tp) else (mesh.get_local_rank() if mesh is not None else 0)
    return train_save_or_load(root, model, opt, d, rows, 2, save)


def train_save_or_load(root, model, opt, d, rows, batch, save):
    """Train 2 steps and save to ``root/ckpt`` (``save``), or load it; then one more step. Data
    rank ``d`` of ``rows`` takes its rows of the same global batch (``batch`` rows per rank of
    the widest layout) in every layout. Returns the full parameters after the save/load and
    after the extra step, and the whole optimizer state this rank holds."""
    import os

    import matrixfsdp.checkpoint as mckpt

    def step(k):
        x, y = _global_batch(k, batch)
        n = x.shape[0] // rows
        model(x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]).backward()
        opt.step()
        opt.zero_grad()

    if save:
        for k in range(2):
            step(k)
        mckpt.save(os.path.join(root, "ckpt"), model, opt)
    else:
        mckpt.load(os.path.join(root, "ckpt"), model, opt)
    full = {f: matrixfsdp.full_tensor(p).detach().clone() for f, p in model.named_parameters()}
    state = _whole_state(model, opt)
    step(2)
    after = {f: matrixfsdp.full_tensor(p).detach().clone() for f, p in model.named_parameters()}
    return full, state, after


def _merged(results, i):
    out = {}
    for r in results:
        out.update(r[i])
    return out


def test_fsdp_tp_checkpoints_reshard(tmp_path):
    """Saved at (dp=2, tp=2); loaded at (1, 3) (uneven shards), at dp=2 without TP, and in one
    process: parameters and every whole optimizer state bitwise; one more step agrees across
    layouts (different reduction orders: to 1e-6)."""
    saved = get_pool(4).run(fsdp_tp_checkpoint, str(tmp_path), 2, 2, True)
    full, state, after = saved[0][0], _merged(saved, 1), saved[0][2]
    assert {k for k in state if k.endswith("momentum_buffer")} == {
        f"blocks.{i}.{n}.weight.momentum_buffer" for i in range(2) for n in ("up", "down")}
    loads = {
        "(1,3)": get_pool(3).run(fsdp_tp_checkpoint, str(tmp_path), 1, 3, False),
        "dp=2, no TP": get_pool(2).run(fsdp_tp_checkpoint, str(tmp_path), 2, 0, False),
        "one process": [fsdp_tp_checkpoint(str(tmp_path), 0, 0, False)],
    }
    for name, res in loads.items():
        check_load(name, res, full, state, after)


def check_load(name, res, full, state, after):
    """Each rank of a load (``train_save_or_load`` results) has the saved full parameters, the
    ranks together hold every saved whole state bitwise (evenly sharded tensors, emb and head at
    dp=2, are whole in a layout without dp), and one more step stays within 1e-6."""
    for r in res:
        assert all(torch.equal(r[0][f], full[f]) for f in full), name
    got = _merged(res, 1)
    assert state.keys() <= got.keys(), (name, sorted(set(state) - set(got)))
    assert all(torch.equal(got[k], state[k]) for k in state), (name, [k for k in state if not torch.equal(got[k], state[k])])
    worst = max(((res[0][2][f] - after[f]).abs().max() / after[f].abs().max()).item() for f in after)
    print(name, "after one more step, max rel diff:", worst)
    assert worst < 1e-6, (name, worst)


def fsdp_tp_outsider():
    """(2, 2): what a client does around the training loop, against the reference."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    mesh, model, ref, _ = _build(2, 2, 80, "muon")
    d = mesh["dp_shard"].get_local_rank()
    opt, ref_opt = _opt("muon", model), _opt("muon", ref)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda k: 1.0 / (1 + k))
    out = {"norms": []}
    # an exception in forward leaves the model usable (the next step matches the reference)
    try:
        model(torch.full((2, 8), VOCAB + 5), torch.zeros(2, 8, dtype=torch.long))
    except IndexError:
        out["raised"] = True
    for step in range(3):
        x, y = _global_batch(step, 2)
        model(x[2 * d:2 * d + 2], y[2 * d:2 * d + 2]).backward()
        ref(x, y).backward()
        mine = matrixfsdp.clip_grad_norm_(model.parameters(), 0.05)
        theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        out["norms"].append((mine.item(), theirs.item()))
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["param"] = _diff(model, ref, "param")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    refsd = ref.state_dict()
    out["full_sd"] = max(((full[k] - refsd[k]).abs().max() / refsd[k].abs().max()).item() for k in refsd)
    out["full_sd_keys"] = sorted(full) == sorted(refsd)
    return out


def test_fsdp_tp_outside_use():
    """Clipping (the global norm across DP and TP), an LR scheduler, an exception in forward, and
    DCP's full state dict, at (dp=2, tp=2)."""
    res = get_pool(4).run(fsdp_tp_outsider)
    for r in res:
        print(r)
        assert r["raised"]
        for mine, theirs in r["norms"]:
            assert abs(mine - theirs) < 1e-5 * theirs, r["norms"]
        assert r["param"] < 1e-5, r
        assert r["full_sd_keys"] and r["full_sd"] < 1e-5, r


def err(fn):
    """The ValueError/TypeError ``fn()`` raises, as "Type: message", or None."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def fsdp_tp_refusals():
    """Clear errors, raised on every rank alike (no rank hangs)."""
    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))

    def fresh():
        model = FwdNet(80)
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()})
        return model

    model = fresh()
    out["whole_mesh"] = err(lambda: matrixfsdp.fully_shard(model.blocks[0], mesh=mesh))
    out["dropin"] = err(lambda: matrixfsdp.fully_shard(fresh().blocks[0], mesh=mesh["dp_shard"]))
    flat_plan = matrixfsdp.plan_owners(fresh(), 2, block_types=(MLPBlock,))

    def with_flat_plan():
        m = fresh()
        for b in m.blocks:
            matrixfsdp.fully_shard(b, mesh=mesh["dp_shard"], plan=flat_plan)
        matrixfsdp.fully_shard(m, mesh=mesh["dp_shard"], plan=flat_plan)
    out["flat_plan"] = err(with_flat_plan)
    out["tp_mismatch"] = err(lambda: matrixfsdp.plan_owners(fresh(), mesh, tp=4))
    return out


def test_fsdp_tp_refusals():
    res = get_pool(4).run(fsdp_tp_refusals)
    assert all(r == res[0] for r in res), res  # the same error on every rank
    r = res[0]
    print(r)
    assert "got the ('dp_shard', 'tp') mesh of shape (2, 2); pass its data-parallel dimension, mesh['dp_shard']" in r["whole_mesh"]
    assert "is tensor-parallel (a DTensor on the TP mesh); TP needs a whole-model plan" in r["dropin"]
    assert "the model's TP mesh has 2 ranks but the plan was built with tp=1" in r["flat_plan"]
    assert "tp=4 but the mesh's 'tp' dimension has size 2; drop tp=" in r["tp_mismatch"]
