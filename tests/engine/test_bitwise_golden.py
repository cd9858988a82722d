"""Bitwise guard of the reduction engine: losses, every gradient after backward and every parameter
after the step, hashed per rank, for ``fully_shard`` (W=2, planned), ``replicate`` (W=2, stages 1
and 2) and ``fully_shard`` on an HSDP (2, 2) mesh with ``replica_step="split"``, against goldens
computed at 25ffc19 (before the engine's one ``Reducer``). A refactor that changes one bit fails.

The bits depend on torch's CPU kernels: each golden file records the torch version, CPU
capability (``torch.backends.cpu.get_cpu_capability()``) and CPU vendor it was computed with (the
same AVX512 capability gives other fp32 matmul bits on Intel than on AMD: MKL dispatches by
vendor), and the test runs against the file of this machine's triple, or is skipped with that
reason. ``bitwise.json``: AMD, computed at 25ffc19; ``bitwise_genuineintel.json``: Intel, computed
at 9e7f754 with the engine that is bitwise 25ffc19's on AMD (this guard, on that machine).

The plans are part of the golden (``"plans"``, ``OwnerPlan.to_json``): the planner may move an
owner (a better balance), which changes which rank holds which bits but not the engine's
arithmetic; the guard runs the recorded plans, so it keeps guarding the engine alone.

Regenerate (only for an intentional numeric change, and say so in the commit; ``--out`` for
another machine's file)::

    PYTHONPATH=src python tests/engine/test_bitwise_golden.py --regen COMMIT [--out tests/golden/bitwise_<vendor>.json]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden")
GOLDEN = os.path.join(GOLDEN_DIR, "bitwise.json")
_ENV_KEYS = ("torch", "cpu_capability", "cpu_vendor")
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


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def _env() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_vendor": _cpu_vendor()}


def _golden_for(env: dict) -> tuple[str | None, list[dict]]:
    """``(path of the golden file computed on env's triple or None, every file's env)``."""
    seen = []
    for name in sorted(os.listdir(GOLDEN_DIR)):
        if not (name.startswith("bitwise") and name.endswith(".json")):
            continue
        path = os.path.join(GOLDEN_DIR, name)
        with open(path) as f:
            recorded = json.load(f)["env"]
        e = {k: recorded.get(k) for k in _ENV_KEYS}
        seen.append(e)
        if e == env:
            return path, seen
    return None, seen


def _compute(case: str, plan_json: str | None = None) -> list[dict]:
    from _harness import get_pool

    return get_pool(WORLD[case]).run(run_case, case, 3, plan_json)


@pytest.mark.parametrize("case", CASES)
def test_bitwise_against_25ffc19(case):
    path, seen = _golden_for(_env())
    if path is None:
        pytest.skip(f"goldens computed with {seen}, this machine has {_env()}: other kernels, other bits")
    with open(path) as f:
        data = json.load(f)
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
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else GOLDEN
    at = sys.argv[sys.argv.index("--regen") + 1] if len(sys.argv) > sys.argv.index("--regen") + 1 else "unknown"
    # the recorded plans of an existing golden keep every machine's guard on the same plans
    plans = {}
    if os.path.exists(GOLDEN):
        with open(GOLDEN) as f:
            plans = json.load(f).get("plans", {})
    data = {"env": {**_env(), "computed_at": at},
            "cases": {case: _compute(case, plans.get(case)) for case in CASES}}
    data["plans"] = {case: runs[0].pop("plan") for case, runs in data["cases"].items()}
    for runs in data["cases"].values():
        for r in runs:
            r.pop("plan", None)
    with open(out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    print("wrote", out)
