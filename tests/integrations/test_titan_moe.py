"""matrixfsdp from a torchtitan MoE config: torchtitan 0.3.0's Trainer, tiny Qwen3-MoE, CPU/gloo.

``with_matrixfsdp`` on a Qwen3-MoE config (torchtitan's ``GroupedExperts`` stacks ``[E, out, in]``,
a top-2 softmax router, the "standard" token dispatcher):

* ``expert_parallel_degree=1``: the planner owns every expert whole, balanced with the dense
  matrices (uneven counts at W=3 with E=4);
* ``expert_parallel_degree == W`` (EP spans the shard group, efsdp == 1): torchtitan's own EP
  (token all-to-alls, ``Shard(0)`` stacks on the ``"ep"`` mesh); the plan records each rank's
  experts as they are and the matrix optimizer steps them locally.

Both train the same global batch as one process does; the expert stacks are stepped by Muon with
no collective; torchtitan's checkpointer resumes within and across EP degrees.

Tolerances: losses within ``RTOL`` (1e-5, as the dense tests; measured <= 1e-6). Gradient norms
within ``GRAD_RTOL`` = 1e-4: torchtitan's ``GroupedExperts`` computes in bf16 whatever the
parameter dtype (``x.bfloat16() @ w.bfloat16()``, models/common/moe.py), so the ulp-level float32
differences between world sizes after step 1 (sums in another order) move bf16 roundings of the
expert activations, which shows in the norms (measured up to ~1.1e-5 relative at W=2, EP=1).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# torchtitan.trainer, not torchtitan: 0.3 imports on torch 2.11 but its trainer does not (it needs
# torch.distributed.fsdp.DataParallelMeshDims, from 2.13 on)
pytest.importorskip("torchtitan.trainer", exc_type=ImportError,
                    reason="torchtitan is not installed, or its trainer does not import with this torch "
                           "(torchtitan 0.3 needs torch>=2.13; pip install -e '.[titan]')")

from _harness import get_pool  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 6
EXPERTS = 4
RTOL = 1e-5
GRAD_RTOL = 1e-4  # bf16 grouped_mm in GroupedExperts, see the module docstring
ROOT = Path(__file__).resolve().parents[2]


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(x), abs(y)) for x, y in zip(a, b))


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), abs(y)) for x, y in zip(a, b))


def _config(steps: int, dump_folder: str, ep: int, model: str = "qwen3"):
    import torch
    import torch.distributed as dist

    from _titan_cpu import tiny_deepseek_v3_config, tiny_qwen3_config

    import matrixfsdp.titan as mt

    W = dist.get_world_size()
    build = tiny_qwen3_config if model == "qwen3" else tiny_deepseek_v3_config
    cfg = build(steps=steps, global_batch=GLOBAL_BATCH, world_size=W, num_experts=EXPERTS, dump_folder=dump_folder)
    cfg.parallelism.expert_parallel_degree = ep
    return mt.with_matrixfsdp(cfg, optimizer="Muon", lr=0.02, adamw_lr=8e-4,
                              optimizer_kwargs={"ns_dtype": torch.float32})


def _inspect(trainer) -> dict:
    """Expert stacks' layout and routes, then one more optimizer step under the spies."""
    import torch
    import torch.distributed as dist

    from fully_shard.test_features import collective_spy

    import matrixfsdp
    from matrixfsdp._fully_shard import comm_counter
    from matrixfsdp.placement import expert_stack_of
    from matrixfsdp.placement.owned_tensor import local_tensor
    from matrixfsdp.placement.stepping import planned_kind

    model = trainer.model_parts[0]
    rank = dist.get_rank()
    names = {id(p): n for n, p in model.named_parameters()}
    stacks, kinds = {}, {}
    for fqn, p in model.named_parameters():
        kinds[fqn] = planned_kind(p)
        st = expert_stack_of(p)
        if st is None:
            continue
        first, stop = st.local_experts
        full = p.full_tensor()  # every rank, same order
        local = p.to_local()
        stacks[fqn] = {"counts": st.counts, "local": (first, stop), "rows": local.shape[0],
                       "rows_match": torch.equal(local, full[first:stop]),
                       "mesh": tuple(st.mesh.mesh_dim_names or ()), "type": type(p).__name__}
    routes, state_rows = {}, {}
    for opt in trainer.optimizers:
        for g in opt.param_groups:
            for p in g["params"]:
                fqn = names[id(p)]
                routes[fqn] = (type(opt).__name__, g["algorithm"], opt._route(g, p))
                if fqn in stacks and "momentum_buffer" in opt.state[p]:
                    buf = opt.state[p]["momentum_buffer"]  # stored local (presented as a stack in state dicts)
                    state_rows[fqn] = tuple(local_tensor(buf).shape)
    counter = comm_counter(model)
    before = (sum(counter.calls.values()), counter.bytes_sent)
    with collective_spy() as step_spy:  # the optimizers themselves (the container's step would
        for opt in trainer.optimizers:  # also run torchtitan's load-balancing hook, an all-reduce)
            opt.step()
    after = (sum(counter.calls.values()), counter.bytes_sent)
    with collective_spy() as hook_spy:  # positive control: the container's step runs torchtitan's
        trainer.optimizers.step()      # load-balancing pre-hook, whose all-reduce the spy sees
    return {"stacks": stacks, "kinds": kinds, "routes": routes, "state_rows": state_rows, "rank": rank,
            "step_comm": (before, after), "step_spy": step_spy, "hook_spy": hook_spy}


def _train(steps: int, folder: str, ep: int, *, save: str | None = None, load_from: str | None = None,
           load_step: int | None = None, inspect: bool = True, model: str = "qwen3") -> dict:
    """Pool worker: the tiny Qwen3-MoE via with_matrixfsdp at ``expert_parallel_degree=ep``.
    ``save``: torchtitan's CheckpointManager saves every 2 steps into that folder (under
    ``folder``); ``load_step``: resume from that step of ``load_from`` (saving there again)."""
    import torch.distributed as dist

    from _titan_cpu import cpu_patches, run_trainer_metrics
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.distributed import utils as titan_dist_utils

    clip_before = titan_dist_utils.clip_grad_norm_
    W = dist.get_world_size()
    cfg = _config(steps, os.path.join(folder, f"{model}-w{W}-ep{ep}" if save is None and load_from is None else ""),
                  ep, model)
    if save is not None or load_from is not None:
        cfg.checkpoint = CheckpointManager.Config(
            enable=True, folder=load_from or save, interval=2, last_save_model_only=False,
            load_step=-1 if load_step is None else load_step, keep_latest_k=0)
    with cpu_patches(full_tensor_init=False):  # matrixfsdp.titan makes the init W-independent itself
        m = run_trainer_metrics(cfg, inspect=_inspect if inspect else None,
                                first_step=1 if load_step is None else load_step + 1)
    clip = titan_dist_utils.clip_grad_norm_
    return {"losses": m.losses, "grad_norms": m.grad_norms, "inspected": m.inspected,
            "titan_clip_original": clip is clip_before and not hasattr(clip, "_matrixfsdp")}


def _check_run(res: list[dict], ep: int) -> None:
    W = len(res)
    counts = None
    for r in res:
        info = r["inspected"]
        assert all(math.isfinite(x) for x in r["losses"] + r["grad_norms"]), r
        assert r["losses"] == res[0]["losses"], "ranks disagree on the logged loss"
        assert r["titan_clip_original"]  # clipping routed by MatrixTrainer, nothing patched
        stacks = info["stacks"]
        assert len(stacks) == 2 * 3, stacks  # w1, w2, w3 per MoE layer
        for fqn, s in stacks.items():
            assert s["type"] == "ExpertDTensor" and sum(s["counts"]) == EXPERTS and len(s["counts"]) == W, (fqn, s)
            assert s["local"] == (sum(s["counts"][:info["rank"]]), sum(s["counts"][:info["rank"] + 1])), (fqn, s)
            assert s["rows"] == s["counts"][info["rank"]] and s["rows_match"], (fqn, s)
            if ep > 1:  # torchtitan's own EP layout: E/ep whole experts per rank, on its "ep" mesh
                assert s["counts"] == (EXPERTS // ep,) * ep and s["mesh"] == ("ep",), (fqn, s)
            # Muon steps every stack: param group "auto", planned kind "experts", state rows = experts here
            assert info["kinds"][fqn] == "experts", (fqn, info["kinds"][fqn])
            assert info["routes"][fqn] == ("Muon", "auto", "muon"), (fqn, info["routes"][fqn])
            if s["rows"]:
                assert info["state_rows"][fqn][0] == s["rows"], (fqn, info["state_rows"])  # this rank's experts
        assert info["kinds"]["layers.0.moe.router.gate.weight"] in ("matrix", "elementwise")
        assert info["routes"]["layers.0.moe.router.gate.weight"][2] == (
            "muon" if info["kinds"]["layers.0.moe.router.gate.weight"] == "matrix" else "adamw")
        if counts is None:
            counts = {f: s["counts"] for f, s in stacks.items()}
        assert counts == {f: s["counts"] for f, s in stacks.items()}, "ranks disagree on the plan"
        before, after = info["step_comm"]
        assert before == after, info["step_comm"]  # matrixfsdp's own collectives: none in the step
        assert info["step_spy"]["python"] == [] and info["step_spy"]["dispatcher"] == [], info["step_spy"]
        if W > 1:
            assert "torch.distributed.all_reduce" in info["hook_spy"]["python"], info["hook_spy"]
            assert info["hook_spy"]["dispatcher"], info["hook_spy"]


def test_titan_moe_matches_one_process(tmp_path):
    """W=1 vs W=2 and W=3 (EP=1, the planner owns the experts; W=3 with 4 experts: uneven
    counts) and W=2 with EP=2 (torchtitan's expert parallelism): the same losses (1e-5) and
    gradient norms (1e-4, bf16 experts), every stack whole experts per rank as the plan says,
    stepped by Muon, the step without collectives."""
    folder = str(tmp_path)
    ref = get_pool(1).run(_train, STEPS, folder, 1, timeout=180)[0]
    _check_run([ref], 1)
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]
    for W, ep in ((2, 1), (3, 1), (2, 2)):
        res = get_pool(W).run(_train, STEPS, folder, ep, timeout=180)
        _check_run(res, ep)
        if W == 3:
            counts = set(res[0]["inspected"]["stacks"][f]["counts"] for f in res[0]["inspected"]["stacks"])
            assert all(max(c) > min(c) for c in counts), counts  # 4 experts on 3 ranks
        got = res[0]
        print(f"W={W} ep={ep}: counts {[s['counts'] for s in got['inspected']['stacks'].values()]}")
        print(f"W={W} ep={ep}: losses rel {_rel(got['losses'], ref['losses']):.2g}, "
              f"grad norms rel {_rel(got['grad_norms'], ref['grad_norms']):.2g}")
        assert _close(got["losses"], ref["losses"], RTOL), (W, ep, got["losses"], ref["losses"])
        assert _close(got["grad_norms"], ref["grad_norms"], GRAD_RTOL), (W, ep, got["grad_norms"], ref["grad_norms"])


def test_titan_moe_checkpoint_resume_across_ep(tmp_path):
    """torchtitan's CheckpointManager (DCP, flat optimizer state) at W=2: a run saved at step 2
    resumes bitwise at the same EP degree (1 and 2), and across EP degrees (saved at EP=2,
    resumed at EP=1, and the reverse: DCP reshards the stacks and their Muon momentum between
    torchtitan's (2, 2) layout and the plan's counts) as the uninterrupted run continued."""
    folder = str(tmp_path)
    full = {ep: get_pool(2).run(_train, STEPS, folder, ep, save=f"ep{ep}", inspect=False, timeout=180)[0]
            for ep in (1, 2)}
    for ep in (1, 2):
        assert os.path.isdir(os.path.join(folder, f"ep{ep}", "step-2")), os.listdir(folder)
        same = get_pool(2).run(_train, STEPS, folder, ep, load_from=f"ep{ep}", load_step=2, inspect=False,
                               timeout=180)[0]
        assert same["losses"] == full[ep]["losses"][2:], (ep, same, full[ep])
        assert same["grad_norms"] == full[ep]["grad_norms"][2:], (ep, same, full[ep])
    for saved, resumed in ((2, 1), (1, 2)):
        got = get_pool(2).run(_train, STEPS, folder, resumed, load_from=f"ep{saved}", load_step=2, inspect=False,
                              timeout=180)[0]
        ref = full[saved]
        print(f"saved at ep={saved}, resumed at ep={resumed}: losses rel {_rel(got['losses'], ref['losses'][2:]):.2g}, "
              f"grad norms rel {_rel(got['grad_norms'], ref['grad_norms'][2:]):.2g}")
        assert _close(got["losses"], ref["losses"][2:], RTOL), (saved, resumed, got, ref)
        assert _close(got["grad_norms"], ref["grad_norms"][2:], GRAD_RTOL), (saved, resumed, got, ref)


def _ep_refusals() -> dict:
    """Rank 0 of a W=4 process group: torchtitan's ParallelDims with real meshes for the EP
    layouts matrixfsdp refuses; parallelize_matrixfsdp's message for each."""
    from types import SimpleNamespace

    from _titan_cpu import cpu_patches
    from torchtitan.distributed.parallel_dims import ParallelDims

    import matrixfsdp.titan as mt

    layouts = {"efsdp": dict(dp_replicate=1, dp_shard=4, tp=1, ep=2),
               "hsdp": dict(dp_replicate=2, dp_shard=2, tp=1, ep=2),
               "tp": dict(dp_replicate=1, dp_shard=2, tp=2, ep=4)}
    off = SimpleNamespace(enable=False, components=[], enable_async_tensor_parallel=False)
    out = {}
    with cpu_patches(full_tensor_init=False):
        for name, kw in layouts.items():
            dims = ParallelDims(cp=1, pp=1, world_size=4, spmd_backend="partial_dtensor", **kw)
            dims.build_mesh()
            try:
                mt.parallelize_matrixfsdp(None, parallel_dims=dims, training=SimpleNamespace(),
                                          parallelism=None, compile_config=off, ac_config=None, dump_folder="")
            except ValueError as e:
                out[name] = (dims.get_mesh("efsdp").size(), str(e))
    return out


def test_titan_moe_refuses_unsupported_ep_layouts():
    """EP where an EP rank's experts would be sharded further (an expert-FSDP group,
    efsdp = dp_shard * tp / ep > 1), EP with HSDP and EP with TP: ValueError naming the fix.
    The meshes are built in this process as rank 0 of 4 on torch's fake process group: the
    refusals read their shapes only, and a 4-rank gloo pool would import torchtitan 4 times."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        got = _ep_refusals()
    finally:
        dist.destroy_process_group()
    pre = r"parallelize_matrixfsdp: expert parallelism is supported where every EP rank owns its experts whole: "
    efsdp, msg = got["efsdp"]
    assert efsdp == 2 and re.search(pre + r"expert_parallel_degree=2 leaves an expert-FSDP group of 2 ranks.*set "
                                    r"expert_parallel_degree to the data-parallel shard degree \(4\), or 1", msg), msg
    efsdp, msg = got["hsdp"]
    assert efsdp == 1 and re.search(pre + r"HSDP \(data_parallel_replicate_degree > 1\) with expert parallelism; "
                                    r"set data_parallel_replicate_degree=1 or expert_parallel_degree=1$", msg), msg
    efsdp, msg = got["tp"]
    assert efsdp == 1 and re.search(pre + r"tensor parallelism with expert parallelism; use one of them$", msg), msg


# ------------------------------------------------------------------------------------------------
# The recipe, run as its docstring says (as tests/test_recipes.py runs the dense one)
# ------------------------------------------------------------------------------------------------
def _recipe_losses(tmp_path: Path, *extra: str) -> list[float]:
    for mod in ("torchtitan", "triton"):
        pytest.importorskip(mod)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", str(ROOT / "recipes" / "titan_cpu.py"),
           "--config", "qwen3_moe_cpu_muon", "--training.steps", "10", "--metrics.log-freq", "1",
           "--dump-folder", str(tmp_path / "titan"), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert "Training completed" in out, out[-3000:]
    steps = {}
    for step, loss in re.findall(r"step:\s+(\d+)\s+(?:\x1b\[\d+m)?loss:\s+([0-9.]+)", out):
        steps[int(step)] = float(loss)
    assert sorted(steps) == list(range(1, 11)), out[-3000:]
    return [steps[s] for s in range(1, 11)]


def test_titan_moe_recipe(tmp_path):
    """``torchrun --nproc-per-node 2 recipes/titan_cpu.py --config qwen3_moe_cpu_muon`` with and
    without ``--parallelism.expert_parallel_degree 2``: both train (exit code 0, the loss falls),
    from the same seeded initialization (the same step-1 loss) and along the same path."""
    plain = _recipe_losses(tmp_path)
    ep = _recipe_losses(tmp_path, "--parallelism.expert_parallel_degree", "2")
    print(f"recipe losses, EP=1: {plain}\nrecipe losses, EP=2: {ep}")
    for losses in (plain, ep):
        assert losses[-1] < losses[0] - 0.5, losses
    assert plain[0] == ep[0], (plain, ep)  # printed to 5 decimals
    assert _close(plain, ep, 1e-4), (plain, ep)


# ------------------------------------------------------------------------------------------------
# The regression behind the EP fix: torchtitan's Trainer calls model.to_empty() after
# parallelize_fn, which swaps every parameter torch-side
# ------------------------------------------------------------------------------------------------
def _adopted_stack_survives_swaps() -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from matrixfsdp.placement.experts import adopt_expert_stack, expert_rows, expert_stack_of
    from matrixfsdp.placement.stepping import planned_kind

    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("ep",))
    experts = nn.Module()
    experts.w = nn.Parameter(distribute_tensor(torch.randn(2 * W, 3, 5), mesh, [Shard(0)]))  # as torchtitan's EP
    model = nn.ModuleDict({"experts": experts})
    p = adopt_expert_stack(model, "experts.w", model["experts"].w, (2,) * W, 1)
    out = {"adopted": planned_kind(p)}
    model.to_empty(device="cpu")  # the Trainer's, after parallelize_fn
    q = model["experts"].w
    out["to_empty"] = (q is p, planned_kind(q), expert_stack_of(q), expert_rows(q))
    model.to(torch.float64)
    q = model["experts"].w
    out["to_float64"] = (planned_kind(q), q.dtype, expert_stack_of(q))
    # optimizer state and arithmetic keep the rows, but are not parameters of a stack
    out["zeros_like"] = (expert_rows(torch.zeros_like(q)), expert_stack_of(torch.zeros_like(q)))
    out["mul"] = expert_stack_of(q * 2)
    return out


def test_adopted_expert_stack_survives_to_empty_and_to():
    """An EP stack re-described by adopt_expert_stack keeps its ExpertStack through torch's
    ``nn.Module.to_empty`` / ``.to()`` (``swap_tensors`` with a tensor dispatch built): before the
    fix it kept its row layout but lost the stack, so ``planned_kind`` said "elementwise" and
    the optimizer container put torchtitan's EP experts in the AdamW group."""
    res = get_pool(2).run(_adopted_stack_survives_swaps, timeout=60)
    from matrixfsdp.placement.experts import ExpertStack

    for r in res:
        assert r["adopted"] == "experts", r
        same, kind, stack, rows = r["to_empty"]
        assert same and kind == "experts" and stack == ExpertStack(counts=(2, 2)) and rows == (2, 2), r
        assert r["to_float64"][0] == "experts" and str(r["to_float64"][1]) == "torch.float64", r
        assert r["to_float64"][2] == ExpertStack(counts=(2, 2)), r
        assert r["zeros_like"] == ((2, 2), None) and r["mul"] is None, r


def test_titan_deepseek_v3_matches_one_process(tmp_path):
    """torchtitan's DeepSeek-V3 (MLA attention, a dense first layer, 4 routed experts and a shared
    expert) converted by with_matrixfsdp: W=2 with EP=1 and EP=2 against W=1, the routed stacks
    whole experts per rank and stepped by Muon, the shared expert's 2-D matrices owned, no
    collective in the optimizers' step."""
    folder = str(tmp_path)
    ref = get_pool(1).run(_train, STEPS, folder, 1, model="deepseek_v3", timeout=180)[0]
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]
    for W, ep in ((2, 1), (2, 2)):
        res = get_pool(W).run(_train, STEPS, folder, ep, model="deepseek_v3", timeout=180)
        for r in res:
            info = r["inspected"]
            assert len(info["stacks"]) == 3, info["stacks"]  # w1, w2, w3 of the one MoE layer
            for fqn, st in info["stacks"].items():
                assert sum(st["counts"]) == EXPERTS and st["rows_match"], (fqn, st)
                assert info["routes"][fqn] == ("Muon", "auto", "muon"), (fqn, info["routes"][fqn])
            shared = [f for f in info["kinds"] if ".shared_experts." in f]
            assert shared and all(info["kinds"][f] == "matrix" for f in shared), {f: info["kinds"][f] for f in shared}
            assert info["step_comm"][0] == info["step_comm"][1]
            assert info["step_spy"]["python"] == [] and info["step_spy"]["dispatcher"] == []
        got = res[0]
        print(f"deepseek_v3 W={W} ep={ep}: losses rel {_rel(got['losses'], ref['losses']):.2g}, "
              f"grad norms rel {_rel(got['grad_norms'], ref['grad_norms']):.2g}")
        assert _close(got["losses"], ref["losses"], RTOL), (W, ep, got["losses"], ref["losses"])
        assert _close(got["grad_norms"], ref["grad_norms"], GRAD_RTOL), (W, ep, got["grad_norms"], ref["grad_norms"])
