"""matrixfsdp from a torchtitan training config: torchtitan 0.3.0's own Trainer, tiny Qwen3, CPU/gloo.

``matrixfsdp.titan.with_matrixfsdp`` converts the config (parallelize_fn -> matrixfsdp's
fully_shard over an owner plan, optimizer -> matrixfsdp Muon with the AdamW route in its own
group). The same global batch at W=2 and W=3 must give the W=1 run's losses and gradient norms
(the gradient-scale check: titan's loss is normalized by the global token count and expects summed
gradients), the hidden matrices must be owned whole, and the optimizer step must not communicate.
"""

from __future__ import annotations

import math
import os

import pytest

# torchtitan.trainer, not torchtitan: 0.3 imports on torch 2.11 but its trainer does not (it needs
# torch.distributed.fsdp.DataParallelMeshDims, from 2.13 on)
pytest.importorskip("torchtitan.trainer", exc_type=ImportError,
                    reason="torchtitan is not installed, or its trainer does not import with this torch "
                           "(torchtitan 0.3 needs torch>=2.13; pip install -e '.[titan]')")

from _harness import get_pool  # noqa: E402

STEPS = 4
GLOBAL_BATCH = 6
RTOL = 1e-5


def _train(steps: int, dump_folder: str, optimizer: str, variant: str = "plain", *,
           global_batch: int = GLOBAL_BATCH, dp_replicate: int = 1, replica_step: str = "auto",
           tp: int = 1, sequence_parallel: bool = True) -> dict:
    """Pool worker: tiny Qwen3 converted with with_matrixfsdp, trained in this rank's process.
    ``variant``: "ac" adds torchtitan's selective activation checkpointing; "reset_params" drops
    ``param_init`` from some modules so torchtitan initializes them with reset_parameters();
    "chunked" uses torchtitan's ChunkedLossWrapper (the head is applied outside the model's forward,
    chunk by chunk, each chunk backwarded on its own). ``dp_replicate > 1``: torchtitan's HSDP
    (``data_parallel_replicate_degree``, the rest of the world shards) with ``replica_step``.
    ``tp > 1``: torchtitan's tensor parallelism (``tensor_parallel_degree``; the data-parallel
    world is ``W / tp``), with or without its sequence parallelism."""
    import torch
    import torch.distributed as dist

    from _titan_cpu import cpu_patches, run_trainer_metrics, tiny_qwen3_config

    import matrixfsdp
    import matrixfsdp.titan as mt
    from matrixfsdp._fully_shard import comm_counter
    from matrixfsdp.placement.owner import owner_of
    from matrixfsdp.placement.tp_host import tp_host_of

    from torchtitan.distributed import utils as titan_dist_utils

    clip_before = titan_dist_utils.clip_grad_norm_
    W = dist.get_world_size()
    cfg = tiny_qwen3_config(steps=steps, global_batch=global_batch, world_size=W // tp,
                            dump_folder=os.path.join(dump_folder, f"{optimizer}-{variant}-w{W}-r{dp_replicate}"
                                                                  f"-{replica_step}-tp{tp}{'sp' * sequence_parallel}"))
    cfg.parallelism.data_parallel_replicate_degree = dp_replicate
    cfg.parallelism.tensor_parallel_degree = tp
    cfg.parallelism.enable_sequence_parallel = sequence_parallel
    if variant == "ac":
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        cfg.activation_checkpoint = SelectiveAC.Config()
    elif variant == "chunked":  # torchtitan's default loss: lm_head runs outside the forward
        from torchtitan.components.loss import ChunkedLossWrapper

        cfg.loss = ChunkedLossWrapper.Config(num_chunks=2, loss_fn=cfg.loss)
    elif variant in ("compile", "compile_ac"):  # torchtitan's per-block block.compile(fullgraph=True)
        cfg.compile.enable, cfg.compile.components = True, ["model"]
        if variant == "compile_ac":
            from torchtitan.distributed.activation_checkpoint import SelectiveAC

            cfg.activation_checkpoint = SelectiveAC.Config()
    elif variant == "reset_params":
        for layer in cfg.model_spec.model.layers:
            layer.feed_forward.w1.param_init = None
        cfg.model_spec.model.norm.param_init = None
    cfg = mt.with_matrixfsdp(cfg, optimizer=optimizer, lr=0.02, adamw_lr=8e-4, replica_step=replica_step,
                             optimizer_kwargs={"ns_dtype": torch.float32} if optimizer == "Muon" else {},
                             per_head=variant == "per_head")

    def inspect(trainer) -> dict:
        model = trainer.model_parts[0]
        kinds, meshes, step_replicas, tp_hosts, placements = {}, set(), {}, {}, {}
        executors = {}  # the TP host steps this rank runs (its owner row's), by id
        for fqn, p in model.named_parameters():
            o = matrixfsdp.owned_of(p)
            kinds[fqn] = "even" if o is None else o.kind
            meshes.add((tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.device_mesh.shape)))
            placements[fqn] = tuple(type(pl).__name__ + str(getattr(pl, "dim", "")) for pl in p.placements)
            if o is not None and o.kind == "matrix":
                step_replicas[fqn] = owner_of(p).step_replica
            host = tp_host_of(p)
            if host is not None:
                tp_hosts[fqn] = host.host
                if host.executor is not None:
                    executors[id(host.executor)] = host.executor
        algos = sorted({g["algorithm"] for opt in trainer.optimizers for g in opt.param_groups})
        heads = sorted({(g["param_names"][0].rpartition(".")[0].rpartition(".")[2], g["heads"])
                        for opt in trainer.optimizers for g in opt.param_groups if g.get("heads")})
        types_ = sorted({type(o).__name__ for o in trainer.optimizers})
        counter = comm_counter(model)
        before = (sum(counter.calls.values()), counter.bytes_sent)
        a2a = sum(e.calls["all_to_all"] for e in executors.values())
        trainer.optimizers.step()  # the grads of the last step are still there
        after = (sum(counter.calls.values()), counter.bytes_sent)
        a2a = sum(e.calls["all_to_all"] for e in executors.values()) - a2a
        return {"heads": heads, "kinds": kinds, "meshes": sorted(meshes), "step_replicas": step_replicas, "algos": algos, "optimizer_types": types_, "step_comm": (before, after),
                "tp_hosts": tp_hosts, "placements": placements, "tp_step_all_to_alls": a2a,
                "tp_micro_groups": sum(len(e.groups) for e in executors.values()),
                "model_class": type(model).__name__,
                "is_managed": isinstance(model, matrixfsdp.MatrixFSDPModule)}

    # The harness's own full-tensor init patch is off: matrixfsdp.titan must make the init
    # world-size independent by itself.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with cpu_patches(full_tensor_init=False):
        m = run_trainer_metrics(cfg, inspect=inspect)
    compiled = {"graph_breaks": dict(counters["graph_break"]), "unique_graphs": counters["stats"]["unique_graphs"]}
    clip = titan_dist_utils.clip_grad_norm_  # torchtitan's own, not replaced process-wide
    original = clip is clip_before and not hasattr(clip, "_matrixfsdp")
    return {"losses": m.losses, "grad_norms": m.grad_norms, "inspected": m.inspected,
            "titan_clip_original": original, "compiled": compiled}


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(x), abs(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("optimizer", ["Muon"])
def test_titan_trainer_matrixfsdp_world_size_invariant(tmp_path, optimizer):
    w1 = get_pool(1).run(_train, STEPS, str(tmp_path), optimizer, timeout=180)
    ref = w1[0]
    for W in (2, 3):
        res = get_pool(W).run(_train, STEPS, str(tmp_path), optimizer, timeout=180)
        for r in res:
            assert all(math.isfinite(x) for x in r["losses"] + r["grad_norms"]), r
            info = r["inspected"]
            assert info["is_managed"] and not info["model_class"].startswith("MatrixFSDP"), info
            assert info["optimizer_types"] == [optimizer], info
            assert info["algos"] == ["adamw", "auto"], info
            mats = [f for f, k in info["kinds"].items() if k == "matrix"]
            assert len(mats) >= 2 * 4, info["kinds"]  # wqkv, wo, w1, w2, w3 per layer (2 layers)
            before, after = info["step_comm"]
            assert before == after, info["step_comm"]  # the optimizer step makes no collective
            assert r["titan_clip_original"]  # clipping routed by MatrixTrainer, nothing patched
        got = res[0]
        assert _close(got["grad_norms"], ref["grad_norms"], RTOL), (W, got["grad_norms"], ref["grad_norms"])
        assert _close(got["losses"], ref["losses"], RTOL), (W, got["losses"], ref["losses"])
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]


def test_titan_trainer_hsdp_matches_one_process(tmp_path):
    """``parallelism.data_parallel_replicate_degree=2`` at 4 ranks: torchtitan's HSDP layout,
    (dp_replicate=2, fsdp=2), built as its own apply_fsdp builds it. Both replica modes train the
    same global batch as one process does, to the W-invariance tolerance of the flat runs above
    (the same math; only the order of the gradient sums differs: shard group first, then across
    replicas); the matrices are owned whole within the shard dimension, under ``split`` each has
    one step replica (both used), and the step makes no collective."""
    batch = 8  # local batch 2 at 4 ranks
    ref = get_pool(1).run(_train, STEPS, str(tmp_path), "Muon", global_batch=batch, timeout=180)[0]
    for mode in ("split", "repeat"):
        res = get_pool(4).run(_train, STEPS, str(tmp_path), "Muon", global_batch=batch, dp_replicate=2,
                              replica_step=mode, timeout=240)
        for r in res:
            info = r["inspected"]
            assert info["is_managed"] and info["algos"] == ["adamw", "auto"], info
            # evenly sharded tensors: torchtitan's 2-D mesh; owned ones: the R=2 ranks holding them
            assert (("dp_replicate", "fsdp"), (2, 2)) in info["meshes"], info["meshes"]
            assert all(shape == (2,) for names, shape in info["meshes"] if names != ("dp_replicate", "fsdp"))
            mats = [f for f, k in info["kinds"].items() if k == "matrix"]
            assert len(mats) >= 2 * 4, info["kinds"]
            reps = set(info["step_replicas"].values())
            assert reps == ({0, 1} if mode == "split" else {None}), (mode, info["step_replicas"])
            before, after = info["step_comm"]
            assert before == after, info["step_comm"]
            assert r["losses"] == res[0]["losses"], "ranks disagree on the logged loss"
        got = res[0]
        assert _close(got["grad_norms"], ref["grad_norms"], RTOL), (mode, got["grad_norms"], ref["grad_norms"])
        assert _close(got["losses"], ref["losses"], RTOL), (mode, got["losses"], ref["losses"])
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]


def test_titan_trainer_tp_matches_one_process(tmp_path):
    """``parallelism.tensor_parallel_degree=2`` at 4 ranks, (fsdp=2, tp=2): torchtitan's own TP
    (``Module.parallelize``: colwise wqkv/w1/w3, rowwise wo/w2, vocab-parallel tied embedding and
    head, hence its vocab-parallel cross-entropy), then matrixfsdp's owners over
    ``["fsdp", "tp"]``. With sequence parallelism (torchtitan's default) and without, the run
    trains the same global batch as one process does, to the W-invariance tolerance (the
    gradient norm checks clipping and the gradient scale; Muon's whole-matrix steps, not
    shard-local ones, are what make the losses agree). Every parameter is a TP DTensor owned by
    one TP row, every matrix is stepped on a TP host between 2 all-to-alls per micro-group, and
    fully_shard's own collectives stay out of the step."""
    ref = get_pool(1).run(_train, STEPS, str(tmp_path), "Muon", timeout=180)[0]
    for sp in (True, False):
        res = get_pool(4).run(_train, STEPS, str(tmp_path), "Muon", tp=2, sequence_parallel=sp, timeout=240)
        for r in res:
            info = r["inspected"]
            assert info["is_managed"] and info["algos"] == ["adamw", "auto"], info
            assert r["losses"] == res[0]["losses"], "ranks disagree on the logged loss"
            assert "even" not in info["kinds"].values(), info["kinds"]  # TP DTensors are always owned
            assert {shape for _, shape in info["meshes"]} == {(2,)}, info["meshes"]  # owners' TP rows
            assert all(n[0].startswith("tp_owned_by_rank") for n, _ in info["meshes"]), info["meshes"]
            pl = info["placements"]
            assert pl["layers.0.attention.qkv_linear.wqkv.weight"] == ("Shard0",), pl
            assert pl["layers.0.feed_forward.w2.weight"] == ("Shard1",), pl
            assert pl["tok_embeddings.weight"] == ("Shard0",) and "lm_head.weight" not in pl, pl  # tied
            mats = sorted(f for f, k in info["kinds"].items() if k == "matrix")
            assert len(mats) == 2 * 5 and sorted(info["tp_hosts"]) == mats, (mats, info["tp_hosts"])
            assert set(info["tp_hosts"].values()) == {0, 1}, info["tp_hosts"]
            before, after = info["step_comm"]
            assert before == after, info["step_comm"]  # no all-gather/reduce-scatter in the step
            assert info["tp_step_all_to_alls"] == 2 * info["tp_micro_groups"] > 0, info
        got = res[0]
        assert _close(got["grad_norms"], ref["grad_norms"], RTOL), (sp, got["grad_norms"], ref["grad_norms"])
        assert _close(got["losses"], ref["losses"], RTOL), (sp, got["losses"], ref["losses"])
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]


def test_titan_trainer_hsdp_tp_matches_one_process(tmp_path):
    """``data_parallel_replicate_degree=2, tensor_parallel_degree=2`` at 8 ranks, (dp_replicate=2,
    fsdp=2, tp=2): torchtitan's TP, then owners planned over its 3-D ``["dp_replicate", "fsdp",
    "tp"]`` mesh and ``fully_shard`` on ``["dp_replicate", "fsdp"]``. ``replica_step="auto"`` splits
    the matrices (both step replicas used) and repeats the norms. The run trains the same global
    batch as one process does (losses and gradient norms within 1e-4 relative); every matrix is a
    TP DTensor on its owner's TP row, hosted, stepped between 2 all-to-alls per micro-group in the
    stepping rows, and fully_shard's own collectives stay out of the step."""
    batch = 8  # local batch 2 at 4 data-parallel ranks
    ref = get_pool(1).run(_train, STEPS, str(tmp_path), "Muon", global_batch=batch, timeout=180)[0]
    res = get_pool(8).run(_train, STEPS, str(tmp_path), "Muon", global_batch=batch, dp_replicate=2, tp=2,
                          timeout=300)
    for r in res:
        info = r["inspected"]
        assert info["is_managed"] and info["algos"] == ["adamw", "auto"], info
        assert r["losses"] == res[0]["losses"], "ranks disagree on the logged loss"
        assert "even" not in info["kinds"].values(), info["kinds"]  # TP DTensors are always owned
        assert all(n[0].startswith("tp_owned_by_rank") and shape == (2,) for n, shape in info["meshes"]), info["meshes"]
        mats = sorted(f for f, k in info["kinds"].items() if k == "matrix")
        assert len(mats) == 2 * 5 and sorted(info["tp_hosts"]) == mats, (mats, info["tp_hosts"])
        assert set(info["step_replicas"].values()) == {0, 1}, info["step_replicas"]
        before, after = info["step_comm"]
        assert before == after, info["step_comm"]
        assert info["tp_step_all_to_alls"] <= 2 * info["tp_micro_groups"], info
    assert sum(r["inspected"]["tp_step_all_to_alls"] for r in res) > 0
    got = res[0]
    assert _close(got["grad_norms"], ref["grad_norms"], 1e-4), (got["grad_norms"], ref["grad_norms"])
    assert _close(got["losses"], ref["losses"], 1e-4), (got["losses"], ref["losses"])
    print("losses", got["losses"], "reference", ref["losses"], "grad norms", got["grad_norms"], ref["grad_norms"])
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]


@pytest.mark.parametrize("variant", ["ac", "reset_params", "chunked"])
def test_titan_trainer_variants(tmp_path, variant):
    """Activation checkpointing (the default of torchtitan's configs: its recomputation runs the
    wrapped inner block, which is the one sharded), modules initialized by reset_parameters()
    (run on full tensors, so the init does not depend on the world size) and the chunked loss
    (the root's parameters stay unsharded after forward, so the head works outside it)."""
    ref = get_pool(1).run(_train, STEPS, str(tmp_path), "Muon", "reset_params" if variant == "reset_params" else "plain",
                          timeout=180)[0]
    got = get_pool(2).run(_train, STEPS, str(tmp_path), "Muon", variant, timeout=180)[0]
    assert _close(got["grad_norms"], ref["grad_norms"], RTOL), (got["grad_norms"], ref["grad_norms"])
    assert _close(got["losses"], ref["losses"], RTOL), (got["losses"], ref["losses"])


def test_titan_trainer_per_head_muon(tmp_path):
    """``with_matrixfsdp(per_head=True)``: torchtitan's fused ``wqkv`` (4 query + 2 key + 2 value
    heads) planned and stepped per head at W=2, as one process does (world-size invariant), and
    differently from whole-matrix Muon."""
    ref = get_pool(1).run(_train, STEPS, str(tmp_path), "Muon", "per_head", timeout=180)[0]
    got = get_pool(2).run(_train, STEPS, str(tmp_path), "Muon", "per_head", timeout=180)[0]
    plain = get_pool(1).run(_train, STEPS, str(tmp_path), "Muon", "plain", timeout=180)[0]
    assert got["inspected"]["heads"] == ref["inspected"]["heads"] == [("wqkv", 8)]
    assert _close(got["grad_norms"], ref["grad_norms"], RTOL), (got["grad_norms"], ref["grad_norms"])
    assert _close(got["losses"], ref["losses"], RTOL), (got["losses"], ref["losses"])
    assert not _close(plain["losses"], ref["losses"], 1e-7)


@pytest.mark.parametrize("variant", ["compile", "compile_ac"])
def test_titan_trainer_compile(tmp_path, variant):
    """``--compile.enable --compile.components model``: torchtitan's own ``apply_compile``
    (``block.compile(fullgraph=True)`` per layer, with and without its selective activation
    checkpointing; a checkpointed layer is compiled inside its wrapper) before matrixfsdp's
    fully_shard. Inductor on CPU, W=2, against the same eager
    run: no graph break, one graph for both layers; measured losses equal bit for bit, gradient
    norms within 1e-7 relative."""
    eager = get_pool(2).run(_train, STEPS, str(tmp_path), "Muon", "ac" if variant == "compile_ac" else "plain",
                            timeout=300)[0]
    got = get_pool(2).run(_train, STEPS, str(tmp_path), "Muon", variant, timeout=600)[0]
    assert got["compiled"] == {"graph_breaks": {}, "unique_graphs": 1}, got["compiled"]
    assert eager["compiled"]["unique_graphs"] == 0
    assert _close(got["losses"], eager["losses"], 1e-6), (got["losses"], eager["losses"])
    assert _close(got["grad_norms"], eager["grad_norms"], 1e-6), (got["grad_norms"], eager["grad_norms"])


def test_with_matrixfsdp_rejects_unknown_optimizer():
    import _titan_cpu  # noqa: F401  (stubs triton kernels on CPU-only builds)
    import matrixfsdp.titan as mt

    with pytest.raises(ValueError, match=r"optimizer must be one of \['Muon', 'SOAP', 'Shampoo'\], got optimizer='Adam'"):
        mt.with_matrixfsdp(mt.qwen3_debugmodel_muon(), optimizer="Adam")


def _train_ckpt(steps: int, folder: str, load_step: int | None, optimizer: str = "Muon", *,
                tp: int = 1, load_from: str | None = None, dp_replicate: int = 1,
                global_batch: int = GLOBAL_BATCH) -> dict:
    """Pool worker: Muon via with_matrixfsdp with torchtitan's CheckpointManager saving every 2
    steps into ``folder``; ``load_step`` resumes from that step (DCP reshards to this world).
    ``tp``: torchtitan's tensor parallelism (data parallelism over ``W / tp``); ``dp_replicate``:
    its HSDP replicas; ``load_from``: the checkpoint folder to resume from (default: the W=2 run's)."""
    import torch
    import torch.distributed as dist

    from _titan_cpu import cpu_patches, run_trainer_metrics, tiny_qwen3_config
    from torchtitan.components.checkpoint import CheckpointManager

    import matrixfsdp.titan as mt

    W = dist.get_world_size()
    cfg = tiny_qwen3_config(steps=steps, global_batch=global_batch, world_size=W // tp,
                            dump_folder=folder)
    cfg.parallelism.tensor_parallel_degree = tp
    cfg.parallelism.data_parallel_replicate_degree = dp_replicate
    kw = ({"ns_dtype": torch.float32} if optimizer == "Muon" else
          {"start_preconditioning_step": 1, "precondition_frequency": 4})  # roots made at step 1, kept
    cfg = mt.with_matrixfsdp(cfg, optimizer=optimizer, lr=0.02 if optimizer == "Muon" else 1e-3,
                             adamw_lr=8e-4, optimizer_kwargs=kw)
    cfg.checkpoint = CheckpointManager.Config(
        enable=True, folder=(f"{optimizer}-w{W}" + (f"-tp{tp}" if tp > 1 else "")
                             + (f"-r{dp_replicate}" if dp_replicate > 1 else "") if load_step is None
                             else load_from or f"{optimizer}-w2"), interval=2,
        last_save_model_only=False, load_step=-1 if load_step is None else load_step,
        keep_latest_k=0)
    with cpu_patches(full_tensor_init=False):
        m = run_trainer_metrics(cfg, first_step=1 if load_step is None else load_step + 1)
    return {"losses": m.losses, "grad_norms": m.grad_norms}


@pytest.mark.parametrize("optimizer", ["Muon", "Shampoo"])
def test_titan_checkpoint_resume_and_reshard(tmp_path, optimizer):
    """torchtitan's own checkpointing (DCP, flat optimizer state) of a matrixfsdp run: resuming
    from step 2 at the same world size continues exactly -- for Shampoo too, whose inverse roots
    appear only after preconditioning starts (torchtitan's loader keeps only keys present after
    its state-initialization step); Muon at W=3 continues as a W=3 run from the same state would
    (within the W-invariance tolerance; Shampoo's roots amplify 1e-7 differences, see docs/benchmarks.md)."""
    folder = str(tmp_path)
    full = get_pool(2).run(_train_ckpt, STEPS, folder, None, optimizer, timeout=180)[0]
    assert os.path.isdir(os.path.join(folder, f"{optimizer}-w2", "step-2")), os.listdir(folder)
    same = get_pool(2).run(_train_ckpt, STEPS, folder, 2, optimizer, timeout=180)[0]
    assert same["losses"] == full["losses"][2:], (same, full)
    assert same["grad_norms"] == full["grad_norms"][2:], (same, full)
    if optimizer != "Muon":
        return
    resharded = get_pool(3).run(_train_ckpt, STEPS, folder, 2, optimizer, timeout=180)[0]
    assert _close(resharded["losses"], full["losses"][2:], RTOL), (resharded, full)
    assert _close(resharded["grad_norms"], full["grad_norms"][2:], RTOL), (resharded, full)


def test_titan_checkpoint_tp(tmp_path):
    """torchtitan's CheckpointManager at (fsdp=2, tp=2): resuming from step 2 at the same layout
    continues exactly (the TP hosts' whole-matrix state included), and the same checkpoint
    resumed without TP at W=2 (DCP reshards TP shards and host state into owners) continues as
    the TP run did, within the W-invariance tolerance."""
    folder = str(tmp_path)
    full = get_pool(4).run(_train_ckpt, STEPS, folder, None, "Muon", tp=2, timeout=240)[0]
    assert os.path.isdir(os.path.join(folder, "Muon-w4-tp2", "step-2")), os.listdir(folder)
    same = get_pool(4).run(_train_ckpt, STEPS, folder, 2, "Muon", tp=2, load_from="Muon-w4-tp2", timeout=240)[0]
    assert same["losses"] == full["losses"][2:], (same, full)
    assert same["grad_norms"] == full["grad_norms"][2:], (same, full)
    dp = get_pool(2).run(_train_ckpt, STEPS, folder, 2, "Muon", load_from="Muon-w4-tp2", timeout=180)[0]
    assert _close(dp["losses"], full["losses"][2:], RTOL), (dp, full)
    assert _close(dp["grad_norms"], full["grad_norms"][2:], RTOL), (dp, full)


def test_cli_config_lookup_and_overrides():
    """`--module matrixfsdp.titan --config qwen3_debugmodel_muon` through torchtitan's own
    ConfigManager (module lookup + tyro CLI overrides on our Config subclass)."""
    import _titan_cpu  # noqa: F401  (stubs triton kernels on CPU-only builds)
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(["--module", "matrixfsdp.titan", "--config", "qwen3_debugmodel_muon",
                                      "--training.steps", "3"])
    assert cfg.training.steps == 3
    assert type(cfg.optimizer).__qualname__ == "MatrixOptimizersContainer.Config"
    assert cfg.optimizer.param_groups[0].optimizer_name == "Muon"
    assert cfg.model_spec.parallelize_fn.func.__name__ == "parallelize_matrixfsdp"
    assert cfg.parallelism.spmd_backend == "partial_dtensor" and cfg.training.disable_cuda_graphs


def test_parallelize_rejects_unsupported_parallelism():
    from types import SimpleNamespace

    import _titan_cpu  # noqa: F401
    import matrixfsdp.titan as mt

    # pipeline and context parallelism: supported (tests/integrations/test_titan_{pp,cp}.py)
    dims = SimpleNamespace(tp_enabled=False, cp_enabled=False, ep_enabled=False, pp_enabled=False,
                           dp_replicate_enabled=True)
    off = SimpleNamespace(enable=False, components=[])
    with pytest.raises(ValueError, match=r"training.enable_cpu_offload=True \(FSDP2's CPUOffloadPolicy\) is not "
                                         r"supported.*set training.enable_cpu_offload=False$"):
        mt.parallelize_matrixfsdp(None, parallel_dims=dims, training=SimpleNamespace(enable_cpu_offload=True),
                                  parallelism=None, compile_config=off, ac_config=None, dump_folder="")
    with pytest.raises(ValueError, match=r"set parallelism.spmd_backend='partial_dtensor'.*got "
                                         r"parallelism.spmd_backend='spmd_types'"):
        mt.parallelize_matrixfsdp(None, parallel_dims=dims, training=SimpleNamespace(),
                                  parallelism=SimpleNamespace(spmd_backend="spmd_types"),
                                  compile_config=off, ac_config=None, dump_folder="")


def test_parallelize_tp_refusals(monkeypatch):
    """What tensor parallelism does not compose with, each refused naming the config field."""
    from types import SimpleNamespace

    import torch.nn as nn

    import _titan_cpu  # noqa: F401
    import matrixfsdp.titan as mt
    from torchtitan.components.quantization import float8

    kw = dict(training=SimpleNamespace(), parallelism=SimpleNamespace(spmd_backend="partial_dtensor"),
              ac_config=None, dump_folder="")
    off = SimpleNamespace(enable=False, components=[], enable_async_tensor_parallel=False)
    dims = SimpleNamespace(tp_enabled=True, tp=2, cp_enabled=False, ep_enabled=False, pp_enabled=False,
                           dp_replicate_enabled=False, dp_replicate=1)  # HSDP x TP: test_titan_trainer_hsdp_tp_*
    model = nn.Sequential(nn.Linear(4, 4))
    on = SimpleNamespace(enable=True, components=["model", "loss"], enable_async_tensor_parallel=True)
    with pytest.raises(ValueError, match=r"async tensor parallelism \(compile.enable_async_tensor_parallel=True\) "
                                         r"is not supported.*set compile.enable_async_tensor_parallel=False"):
        mt.parallelize_matrixfsdp(model, parallel_dims=dims, compile_config=on, **kw)

    class FakeFloat8Linear(nn.Linear):  # torchao is not installed here: stand in for its class
        pass

    monkeypatch.setattr(float8, "Float8Linear", FakeFloat8Linear)
    for tp in (2, 1):  # refused with and without TP
        dims.tp, dims.tp_enabled = tp, tp > 1
        with pytest.raises(ValueError, match=rf"quantized linears \(Float8/MXFP8/NVFP4 model converters, e.g. '0'\) "
                                             rf"with parallelism.tensor_parallel_degree={tp} are not supported: "
                                             r"matrixfsdp has not run them \(they need CUDA.*converters=\[\]\)\)$"):
            mt.parallelize_matrixfsdp(nn.Sequential(FakeFloat8Linear(4, 4)), parallel_dims=dims, compile_config=off, **kw)


def test_with_matrixfsdp_defaults_and_no_mutation():
    import _titan_cpu  # noqa: F401
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    import matrixfsdp.titan as mt

    base = qwen3_debugmodel()
    before = (type(base.optimizer).__qualname__, base.parallelism.spmd_backend, base.model_spec.parallelize_fn)
    cfg = mt.with_matrixfsdp(base)
    assert type(cfg) is mt.MatrixTrainer.Config and type(base) is not mt.MatrixTrainer.Config
    assert cfg.build.__self__._owner is mt.MatrixTrainer  # config.build() makes a MatrixTrainer
    kw = cfg.optimizer.param_groups[0].optimizer_kwargs
    assert kw["adamw_lr"] == base.optimizer.param_groups[0].optimizer_kwargs["lr"] == 8e-4  # from its AdamW
    assert (type(base.optimizer).__qualname__, base.parallelism.spmd_backend,
            base.model_spec.parallelize_fn) == before  # the caller's config is untouched
    cfg.lr_scheduler.warmup_steps = 99
    assert base.lr_scheduler.warmup_steps != 99
    assert cfg.model_spec.parallelize_fn.keywords["replica_step"] == "auto"
    assert mt.with_matrixfsdp(base, replica_step="split").model_spec.parallelize_fn.keywords["replica_step"] == "split"
    with pytest.raises(ValueError, match=r"replica_step must be one of \['auto', 'repeat', 'split'\], "
                                         r"got replica_step='half'"):
        mt.with_matrixfsdp(base, replica_step="half")
    base.optimizer.param_groups = []
    with pytest.raises(ValueError, match=r"pass adamw_lr \(the source config has no Adam/AdamW group"):
        mt.with_matrixfsdp(base)


def test_titan_checkpoint_hsdp_tp(tmp_path):
    """torchtitan's CheckpointManager at (dp_replicate=2, fsdp=2, tp=2), ``replica_step="auto"``:
    resuming from step 2 at the same layout continues exactly (the step replicas' hosts' state
    included), and the same checkpoint resumed at (fsdp=2, tp=2) without replicas continues as
    the HSDP x TP run did, within the W-invariance tolerance."""
    folder = str(tmp_path)
    full = get_pool(8).run(_train_ckpt, STEPS, folder, None, "Muon", tp=2, dp_replicate=2, global_batch=8,
                           timeout=300)[0]
    assert os.path.isdir(os.path.join(folder, "Muon-w8-tp2-r2", "step-2")), os.listdir(folder)
    same = get_pool(8).run(_train_ckpt, STEPS, folder, 2, "Muon", tp=2, dp_replicate=2, load_from="Muon-w8-tp2-r2",
                           global_batch=8, timeout=300)[0]
    assert same["losses"] == full["losses"][2:], (same, full)
    assert same["grad_norms"] == full["grad_norms"][2:], (same, full)
    tp_only = get_pool(4).run(_train_ckpt, STEPS, folder, 2, "Muon", tp=2, load_from="Muon-w8-tp2-r2",
                              global_batch=8, timeout=240)[0]
    print("full", full, "resumed", same, "at (2, 2) without replicas", tp_only)
    assert _close(tp_only["losses"], full["losses"][2:], RTOL), (tp_only, full)
    assert _close(tp_only["grad_norms"], full["grad_norms"][2:], RTOL), (tp_only, full)
