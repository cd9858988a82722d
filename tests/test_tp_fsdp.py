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

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import matrixfsdp
from _harness import get_pool
from test_runtime_features import collective_spy
from test_tp import MLPBlock, TPNet, _opt

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
    refp = dict(ref.named_parameters())
    worst = 0.0
    for f, p in model.named_parameters():
        rp = refp[f]
        a = p.grad if what == "grad" else p
        b = rp.grad if what == "grad" else rp.detach()
        exp = None if a is None else _expect(b, p)
        if exp is None:
            continue
        mine = a._local_tensor if isinstance(a, DTensor) else a.detach()
        assert mine.shape == exp.shape, (f, mine.shape, exp.shape)
        worst = max(worst, (mine - exp).abs().max().item() / max(b.abs().max().item(), 1e-12))
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
    out = {"grad0": 0.0, "steps": [], "plan_tp": plan.tp, "hosted": len(hosted)}
    for step in range(steps):
        x, y = _global_batch(step, dp)
        n = x.shape[0] // dp
        model(x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]).backward()
        ref.loss(x, y).backward()
        if step == 0:
            out["grad0"] = _diff(model, ref, "grad")
        c0 = {k: (e.calls["all_to_all"], e.host_steps) for k, e in executors.items()}
        with collective_spy() as spy:
            opt.step()
        out["steps"].append({
            "python": spy["python"],
            "a2a": sum(e.calls["all_to_all"] - c0[k][0] for k, e in executors.items()),
            "host_steps": sum(e.host_steps - c0[k][1] for k, e in executors.items()),
            "groups": sum(len(e.groups) for e in executors.values()),
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


@pytest.mark.parametrize("dp, tp, h", [(2, 2, 80)])
@pytest.mark.parametrize("opt_name", ["muon"])
def test_fsdp_tp_parity(dp, tp, h, opt_name):
    res = get_pool(dp * tp).run(fsdp_tp_parity, dp, tp, h, opt_name)
    for r in res:
        print(dp, tp, h, opt_name, {k: r[k] for k in ("grad0", "param", "full", "plan_tp", "hosted")})
        assert r["grad0"] < 1e-6 and r["param"] < 1e-5 and r["full"] < 1e-5, r
