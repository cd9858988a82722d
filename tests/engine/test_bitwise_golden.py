"""Bitwise guard of the reduction engine: losses, every gradient after backward and every parameter
after the step, hashed per rank, for ``fully_shard`` (W=2, planned), ``replicate`` (W=2, stages 1
and 2) and ``fully_shard`` on an HSDP (2, 2) mesh with ``replica_step="split"``, against goldens
computed at 25ffc19 (before the engine's one ``Reducer``). A refactor that changes one bit fails.

The bits depend on torch's CPU kernels: the goldens record the torch version and CPU capability
they were computed with (``torch.backends.cpu.get_cpu_capability()``), and on another pair the test
is skipped with that reason (regenerate from 25ffc19 on that machine to guard there).

The plans are part of the golden (``"plans"``, ``OwnerPlan.to_json``): the planner may move an
owner (a better balance), which changes which rank holds which bits but not the engine's
arithmetic; the guard runs the recorded plans, so it keeps guarding the engine alone.

Regenerate (only for an intentional numeric change, and say so in the commit)::

    PYTHONPATH=src python tests/engine/test_bitwise_golden.py --regen
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden", "bitwise.json")
CASES = ["fully_shard_w2", "replicate_w2_stage1", "replicate_w2_stage2", "fully_shard_hsdp22_split"]
WORLD = {"fully_shard_w2": 2, "replicate_w2_stage1": 2, "replicate_w2_stage2": 2, "fully_shard_hsdp22_split": 4}
BATCH = 12


def _digest(t: torch.Tensor | None) -> str:
    if t is None:
        return "none"
    t = getattr(t, "_local_tensor", t).detach().contiguous()
    return hashlib.sha256(t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16] + f":{tuple(t.shape)}"


def _plan(case: str, model, mesh, plan_json: str | None):
    import matrixfsdp
    from _models import Block

    if plan_json is not None:
        return matrixfsdp.OwnerPlan.from_json(plan_json)
    if case.startswith("replicate"):
        return matrixfsdp.plan_owners(model, mesh, policy="alpha_balanced", elementwise="owned", bucket_numel=40_000)
    if case == "fully_shard_hsdp22_split":
        return matrixfsdp.plan_owners(model, mesh, block_types=(Block,), replica_step="split")
    return matrixfsdp.plan_owners(model, mesh, block_types=(Block,))


def run_case(case: str, steps: int = 3, plan_json: str | None = None) -> dict:
    from _models import Block, TinyConfig, TinyDecoder, make_batch
    from torch.distributed.device_mesh import init_device_mesh

    import matrixfsdp

    rank, W = dist.get_rank(), dist.get_world_size()
    cfg = TinyConfig()
    model = TinyDecoder(cfg, seed=0)
    if case.startswith("replicate"):
        mesh = init_device_mesh("cpu", (W,))
        plan = _plan(case, model, mesh, plan_json)
        matrixfsdp.replicate(model, mesh=mesh, plan=plan, stage=int(case[-1]))
    else:
        if case == "fully_shard_hsdp22_split":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        else:
            mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("dp_shard",))
        plan = _plan(case, model, mesh, plan_json)
        for b in model.blocks:
            matrixfsdp.fully_shard(b, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3, weight_decay=0.01)
    per = BATCH // W
    out: dict = {"loss": [], "grad": [], "param": []}
    for step in range(steps):
        x, y = make_batch(cfg, step, BATCH)
        # step 1: the gated projection unused on rank 0 only (the usage flags)
        kw = {"use_extra": step != 1 or rank != 0}
        loss = model.loss(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per], **kw)
        loss.backward()
        out["loss"].append(float(loss).hex())
        out["grad"].append({n: _digest(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    if hasattr(model, "sync_params"):
        model.sync_params()
    out["param"] = {n: _digest(p) for n, p in model.named_parameters()}
    out["plan"] = plan.to_json()
    return out


def _env() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _compute(case: str, plan_json: str | None = None) -> list[dict]:
    from _harness import get_pool

    return get_pool(WORLD[case]).run(run_case, case, 3, plan_json)


@pytest.mark.parametrize("case", CASES)
def test_bitwise_against_25ffc19(case):
    with open(GOLDEN) as f:
        data = json.load(f)
    env = {k: data["env"][k] for k in ("torch", "cpu_capability")}
    if env != _env():
        pytest.skip(f"goldens computed with {env}, this machine has {_env()}: other kernels, other bits")
    golden = data["cases"][case]
    got = _compute(case, data["plans"][case])
    for r, (g, want) in enumerate(zip(got, golden)):
        assert g["loss"] == want["loss"], (case, r, "losses", g["loss"], want["loss"])
        for step, (gg, wg) in enumerate(zip(g["grad"], want["grad"])):
            bad = sorted(n for n in wg if gg.get(n) != wg[n])
            assert not bad, (case, r, f"gradients after backward {step}", bad)
        bad = sorted(n for n in want["param"] if g["param"].get(n) != want["param"][n])
        assert not bad, (case, r, "parameters", bad)


if __name__ == "__main__" and "--regen" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    data = {"env": {**_env(), "computed_at": sys.argv[sys.argv.index("--regen") + 1]
                    if len(sys.argv) > sys.argv.index("--regen") + 1 else "unknown"},
            "cases": {case: _compute(case) for case in CASES}}
    data["plans"] = {case: runs[0].pop("plan") for case, runs in data["cases"].items()}
    for runs in data["cases"].values():
        for r in runs:
            r.pop("plan", None)
    with open(GOLDEN, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    print("wrote", GOLDEN)
