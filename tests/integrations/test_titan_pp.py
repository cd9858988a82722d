"""matrixfsdp under torchtitan's pipeline parallelism (``parallelism.pipeline_parallel_degree``).

torchtitan's ``pipeline_llm`` splits the model into parts (deep copies without the other stages'
modules) and calls ``parallelize_matrixfsdp`` once per part: owners are planned per stage over
that stage's ``"fsdp"`` mesh, each stage checks its own digest, and ``MatrixTrainer`` clips with
matrixfsdp's norm all-reduced over the ``"pp"`` mesh too. Runs use the tiny Qwen3 of
tests/_titan_cpu.py with untied embeddings (torchtitan refuses tying with PP).

The initialization of a pipelined run differs from the plain run's (each stage's initializers
draw from the same seeded generator, not where the whole model's init would be at that stage;
torchtitan's answer is a seed checkpoint), so the parity runs start from one checkpoint: the plain
W=2 run saves at step 1, the PP=2 x DP=2 run resumes from it and must match the plain run's later
steps within 1e-4 relative; a PP=1 run (W=2) resumes from the PP run's checkpoint (PP=2 -> PP=1).
"""

from __future__ import annotations

import os
import shutil

import pytest

# torchtitan.trainer, not torchtitan: 0.3 imports on torch 2.11 but its trainer does not (it needs
# torch.distributed.fsdp.DataParallelMeshDims, from 2.13 on)
pytest.importorskip("torchtitan.trainer", exc_type=ImportError,
                    reason="torchtitan is not installed, or its trainer does not import with this torch "
                           "(torchtitan 0.3 needs torch>=2.13; pip install -e '.[titan]')")

from _harness import get_pool  # noqa: E402


def _pp_runs() -> bool:
    import _titan_cpu  # noqa: F401  (stubs triton kernels on CPU-only builds)
    import matrixfsdp.integrations.titan as mt

    return mt.pp_schedules_take_microbatches()


needs_pp_torch = pytest.mark.skipif(
    not _pp_runs(), reason="torchtitan 0.3's Trainer calls PipelineSchedule.step(arg_mbs=...), which this torch "
                           "lacks (torch 2.15 has it); parallelize_matrixfsdp refuses PP here (test_pp_refusals)")

STEPS = 3
GLOBAL_BATCH = 8  # PP: 4 microbatches of 1 row per data-parallel rank
RTOL = 1e-4
VOCAB = 128


def _train_pp(steps: int, folder: str, run: str, *, pp: int = 1, schedule: str = "1F1B",
              load_step: int | None = None, inspect_stages: bool = False) -> dict:
    """Pool worker: tiny untied Qwen3 via with_matrixfsdp (Muon) on W = pp * dp ranks, torchtitan's
    CheckpointManager saving every step into ``folder/run``; ``load_step`` resumes from there."""
    import torch
    import torch.distributed as dist

    from _titan_cpu import cpu_patches, run_trainer_metrics, tiny_qwen3_config
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.models.qwen3 import _EMBEDDING_INIT

    import matrixfsdp
    import matrixfsdp.titan as mt
    from matrixfsdp._fully_shard import comm_counter

    W = dist.get_world_size()
    # vocabulary 128 = the rows of each layer's fused wqkv ((4 + 2 * 2) heads x 16): the whole model
    # routes wqkv as an output head (AdamW); a stage without the embedding must too
    cfg = tiny_qwen3_config(steps=steps, global_batch=GLOBAL_BATCH, world_size=W // pp, dump_folder=folder,
                            vocab_size=VOCAB)
    cfg.model_spec.model.enable_weight_tying = False  # torchtitan refuses tying with PP
    cfg.model_spec.model.tok_embeddings.param_init = _EMBEDDING_INIT
    cfg.parallelism.pipeline_parallel_degree = pp
    cfg.parallelism.pipeline_parallel_schedule = schedule
    cfg.parallelism.pipeline_parallel_microbatch_size = 1
    cfg = mt.with_matrixfsdp(cfg, optimizer="Muon", lr=0.02, adamw_lr=8e-4,
                             optimizer_kwargs={"ns_dtype": torch.float32})
    cfg.checkpoint = CheckpointManager.Config(enable=True, folder=run, interval=1, last_save_model_only=False,
                                              load_step=-1 if load_step is None else load_step, keep_latest_k=0)

    def inspect(trainer) -> dict:
        parts = trainer.model_parts
        kinds = {f: (o.kind if (o := matrixfsdp.owned_of(p)) is not None else "even")
                 for m in parts for f, p in m.named_parameters()}
        meshes = sorted({tuple(p.device_mesh.mesh.flatten().tolist()) for m in parts for p in m.parameters()
                         if matrixfsdp.owned_of(p) is None})
        counters = [comm_counter(m) for m in parts]
        # MatrixTrainer reduces once per block per pipeline step (not per microbatch); the parts of
        # a rank share one counter (one data-parallel group)
        reduces = counters[0].calls.get("reduce_scatter", 0)
        # the layers, and the root where it holds parameters (embedding, or norm and head)
        blocks = sum(len(m.layers) + any(not f.startswith("layers.") for f, _ in m.named_parameters())
                     for m in parts)
        before = [sum(c.calls.values()) for c in counters]
        trainer.optimizers.step()  # the grads of the last step are still there
        after = [sum(c.calls.values()) for c in counters]
        return {"kinds": kinds, "even_meshes": meshes, "step_comm": (before, after), "reduces": reduces,
                "blocks": blocks,
                "stages": [s.stage_index for s in getattr(trainer.pp_schedule, "_stages", [])]
                if getattr(trainer, "pp_schedule", None) is not None else []}

    with cpu_patches(full_tensor_init=False):
        m = run_trainer_metrics(cfg, inspect=inspect if inspect_stages else None,
                                first_step=1 if load_step is None else load_step + 1)
    return {"losses": m.losses, "grad_norms": m.grad_norms, "inspected": m.inspected}


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(x), abs(y)) for x, y in zip(a, b))


def _last_stage(res: list[dict]) -> dict:
    """A rank whose losses torchtitan computed (the last stage's; the others log -1)."""
    return next(r for r in res if all(x > 0 for x in r["losses"]))


@needs_pp_torch
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_titan_pp_matches_plain_and_resumes_at_pp1(tmp_path, schedule):
    """1F1B: one stage per rank (embedding + layer 0, layer 1 + norm + head). Interleaved1F1B:
    two per rank, four stages of one effective layer each (torchtitan's rule), so stage 0 holds
    the embedding alone and stage 3 the norm and head alone: stages without a decoder layer and
    without any matrix (planned as a root alone, stepped element-wise)."""
    folder = str(tmp_path)
    plain = get_pool(2).run(_train_pp, STEPS, folder, "plain", timeout=180)[0]
    # the PP run starts from the plain run's step-1 checkpoint (same parameters and state)
    os.makedirs(os.path.join(folder, "pp"))
    shutil.copytree(os.path.join(folder, "plain", "step-1"), os.path.join(folder, "pp", "step-1"))
    res = get_pool(4).run(_train_pp, STEPS, folder, "pp", pp=2, schedule=schedule, load_step=1,
                          inspect_stages=True, timeout=240)
    got = _last_stage(res)
    assert _close(got["losses"], plain["losses"][1:], RTOL), (got["losses"], plain["losses"])
    for r in res:  # the clip's norm spans both stages: the plain run's, on every rank
        assert _close(r["grad_norms"], plain["grad_norms"][1:], RTOL), (r["grad_norms"], plain["grad_norms"])
        info = r["inspected"]
        before, after = info["step_comm"]
        assert before == after, info["step_comm"]  # every stage's step makes no collective
        assert info["reduces"] == (STEPS - 1) * info["blocks"], (info["reduces"], info["blocks"])
        assert any(k == "matrix" for k in info["kinds"].values()), info["kinds"]
        assert not any(k == "matrix" for f, k in info["kinds"].items() if "wqkv" in f), info["kinds"]
        if schedule != "1F1B":  # 2 stages per rank; the first and last hold no matrix
            assert len(info["stages"]) == 2, info["stages"]
        # evenly sharded parameters live on this stage's 2-rank data-parallel mesh only
        assert all(len(m) == 2 for m in info["even_meshes"]), info["even_meshes"]
    if schedule != "1F1B":
        return
    # PP=2 -> PP=1: the plain layout resumes from the pipelined run's step-2 checkpoint
    os.makedirs(os.path.join(folder, "pp1"))
    shutil.copytree(os.path.join(folder, "pp", "step-2"), os.path.join(folder, "pp1", "step-2"))
    back = get_pool(2).run(_train_pp, STEPS, folder, "pp1", load_step=2, timeout=180)[0]
    assert _close(back["losses"], plain["losses"][2:], RTOL), (back["losses"], plain["losses"])


def test_pp_refusals(monkeypatch):
    """What pipeline parallelism does not compose with, refused before anything is built (the
    config is the same on every rank, so every rank raises alike)."""
    from types import SimpleNamespace

    import torch.nn as nn

    import _titan_cpu  # noqa: F401
    import matrixfsdp.integrations.titan as mt

    dims = SimpleNamespace(tp_enabled=False, cp_enabled=False, ep_enabled=False, pp_enabled=True, pp=2, ep=1,
                           dp_replicate_enabled=False)
    off = SimpleNamespace(enable=False, components=[])
    kw = dict(parallel_dims=dims, training=SimpleNamespace(), parallelism=None, compile_config=off, ac_config=None,
              dump_folder="")
    tied = nn.Module()
    tied.enable_weight_tying = True
    monkeypatch.setattr(mt, "pp_schedules_take_microbatches", lambda: True)
    with pytest.raises(ValueError, match=r"parallelize_matrixfsdp: tied embeddings \(enable_weight_tying=True\) "
                                         r"with pipeline parallelism \(parallelism.pipeline_parallel_degree=2\)"):
        mt.parallelize_matrixfsdp(tied, **kw)
    dims.ep_enabled, dims.ep = True, 2
    with pytest.raises(ValueError, match=r"expert parallelism \(parallelism.expert_parallel_degree=2\) with "
                                         r"pipeline parallelism .* is not supported"):
        mt.parallelize_matrixfsdp(nn.Module(), **kw)
    dims.ep_enabled, dims.ep = False, 1
    monkeypatch.setattr(mt, "pp_schedules_take_microbatches", lambda: False)
    with pytest.raises(ValueError, match=r"needs torch's PipelineSchedule.step\(arg_mbs=.*torch .* lacks"):
        mt.parallelize_matrixfsdp(nn.Module(), **kw)
