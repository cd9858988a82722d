"""``matrixfsdp.hf_trainer.MatrixFSDPTrainer``: transformers' ``Trainer`` on a sharded model, W=2, CPU.

A tiny Qwen3 (built in code, untied head) is sharded with ``fully_shard`` (every decoder layer,
then the root) or ``replicate`` (stage 2) and trained with ``matrixfsdp.optim.Muon`` (fp32
Newton-Schulz), gradient accumulation 2, ``max_grad_norm`` small enough to clip every step,
Trainer's linear schedule, evaluation and checkpoints every 2 steps, ``logging_steps=1``:

* parity: Trainer's logged loss, ``grad_norm``, learning rate and eval loss, and the final
  weights, against a plain loop over the same micro-batches (sequential sampling) with the same
  model, optimizer, schedule and :func:`matrixfsdp.clip_grad_norm_`. The loop computes the loss
  as Trainer does for a causal LM (token sum over the global token count of the accumulation
  window, times W: ``average_tokens_across_devices``), so training is bitwise equal. The
  per-micro-batch mean of ``recipes/hf_finetune.py``'s loop (divided by GA) is the same quantity
  (no padding here), and bitwise so too, since the two differ by a power-of-two factor; bf16
  autocast is compared against the loop under ``torch.autocast``;
* resume: ``train(resume_from_checkpoint=<checkpoint-2>)`` on a fresh model (random sampling,
  so Trainer's batch skipping and RNG restore are exercised) logs bitwise the losses of steps 3-4
  of the uninterrupted run and ends with bitwise equal weights;
* ``save_model`` writes a folder ``from_pretrained`` loads with the trained weights, bitwise;
* misuse raises ``TypeError``/``ValueError`` naming the API, the constraint and the value.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from _harness import get_pool

import matrixfsdp

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

W = 2
VOCAB, SEQ = 128, 16
BATCH, GA, STEPS = 2, 2, 4  # per-device micro-batch rows, accumulation, optimizer steps
CLIP = 0.05  # below every step's norm here, so clipping acts on every step
EVAL_ROWS = 8


# ================================================================================ helpers (on each rank)
def _env() -> None:
    # the harness ranks have a process group but no launcher variables, which accelerate reads
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))


def build(kind: str):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if kind == "fully_shard":
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(type(model.model.layers[0]),))
        for layer in model.model.layers:
            matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    else:
        matrixfsdp.replicate(model, mesh=mesh, stage=2)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, weight_decay=0.0, ns_dtype=torch.float32)
    opt.param_groups[1]["lr"] = 3e-3  # the AdamW group (adamw_lr=None: its lr, scaled by the schedule)
    return model, opt


def rows(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def dataset(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": x, "labels": x} for x in rows(n, seed)]


def args(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
                gradient_accumulation_steps=GA, max_steps=STEPS, max_grad_norm=CLIP, logging_steps=1,
                eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                prediction_loss_only=True, report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
    base.update(kw)
    return TrainingArguments(**base)


def full_state(model) -> dict[str, torch.Tensor]:
    from matrixfsdp.checkpoint.huggingface import gather_full_state_dict

    return gather_full_state_dict(model, rank0_only=False)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


class Recorder(transformers.TrainerCallback):
    """The logs of this run only (a resumed run's log_history also holds the checkpoint's)."""

    def __init__(self):
        self.logs: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({**logs, "step": state.global_step})


def logs_of(trainer) -> dict[str, list[float]]:
    (rec,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, Recorder)]
    return {k: [e[k] for e in rec.logs if k in e] for k in ("loss", "grad_norm", "learning_rate", "eval_loss", "step")}


def counter(model):
    from matrixfsdp._fully_shard import comm_counter

    return model.comm_counter() if isinstance(model, matrixfsdp.MatrixReplicateModule) else comm_counter(model)


def _autocast(bf16: bool):
    import contextlib

    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


# ================================================================================ parity
def reference_loop(kind: str, bf16: bool, formula: str) -> dict:
    """The plain loop Trainer's run must equal: rank r's k-th micro-batch is rows
    [(kW + r)B, (kW + r + 1)B) (sequential sampler, accelerate's batch sharding)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(kind)
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, STEPS)
    data, held = rows(STEPS * GA * world * BATCH, seed=1), rows(EVAL_ROWS, seed=2)
    n_items = torch.tensor(float(GA * world * BATCH * (SEQ - 1)))  # shifted labels, whole window
    out: dict[str, list[float]] = {"loss": [], "grad_norm": [], "learning_rate": [], "eval_loss": []}
    counter(model).reset()
    for step in range(STEPS):
        model.train()
        total = torch.tensor(0.0)
        for m in range(GA):
            k = step * GA + m
            x = data[(k * world + rank) * BATCH:(k * world + rank + 1) * BATCH]
            model.set_requires_gradient_sync(m == GA - 1)
            with _autocast(bf16):
                if formula == "trainer":
                    loss = model(input_ids=x, labels=x, num_items_in_batch=n_items).loss
                else:  # recipes/hf_finetune.py's per-rank mean, divided over the window
                    loss = model(input_ids=x, labels=x).loss
            loss = loss * world if formula == "trainer" else loss / GA
            loss.backward()
            total += loss.detach()
        model.set_requires_gradient_sync(True)
        norm = matrixfsdp.clip_grad_norm_(model.parameters(), CLIP)
        out["learning_rate"].append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
        model.zero_grad()
        gathered = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(gathered, total)
        out["loss"].append(torch.stack(gathered).mean().item())
        out["grad_norm"].append(norm.item())
        if (step + 1) % 2 == 0:
            model.eval()
            losses = []
            with torch.no_grad():
                for b in range(EVAL_ROWS // (world * BATCH)):
                    x = held[(b * world + rank) * BATCH:(b * world + rank + 1) * BATCH]
                    with _autocast(bf16):
                        losses.append(model(input_ids=x, labels=x).loss.float())
            mine = torch.stack(losses)
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            out["eval_loss"].append(torch.stack(every).mean().item())
    out["calls"] = dict(counter(model).calls)
    out["state"] = full_state(model)
    return out


def trainer_run(kind: str, bf16: bool, out: str) -> dict:
    from matrixfsdp.hf_trainer import MatrixFSDPTrainer

    _env()
    world = dist.get_world_size()
    model, opt = build(kind)
    autocast_dtypes: set[torch.dtype] = set()
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: autocast_dtypes.add(o.dtype))
    trainer = MatrixFSDPTrainer(
        model=model, args=args(out, bf16=bf16, train_sampling_strategy="sequential"),
        train_dataset=dataset(STEPS * GA * world * BATCH, seed=1), eval_dataset=dataset(EVAL_ROWS, seed=2),
        optimizers=(opt, None), callbacks=[Recorder()])
    seen: list[torch.Tensor] = []
    model.model.embed_tokens.register_forward_hook(lambda m, a, o: seen.append(a[0].clone()) if m.training else None)
    counter(model).reset()
    trainer.train()
    res = logs_of(trainer)
    res["calls"] = dict(counter(model).calls)
    res["state"] = full_state(model)
    res["unwrapped"] = trainer.model_wrapped is model and trainer.model is model
    res["autocast"] = sorted(map(str, autocast_dtypes))
    res["batches"] = seen
    # the end of a fine-tune: an HF folder
    final = os.path.join(out, "final")
    trainer.save_model(final)
    loaded, info = type(model).from_pretrained(final, output_loading_info=True)
    res["pretrained_diff"] = max_diff(loaded.state_dict(), {k: res["state"][k] for k in loaded.state_dict()})
    res["pretrained_missing"] = sorted(info["missing_keys"]) + sorted(info["unexpected_keys"])
    res["architectures"] = loaded.config.architectures
    res["ckpts"] = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    return res


def parity_check(kind: str, bf16: bool, out: str) -> dict:
    got = trainer_run(kind, bf16, out)
    ref = reference_loop(kind, bf16, "trainer")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = rows(STEPS * GA * world * BATCH, seed=1)
    want_batches = [data[(k * world + rank) * BATCH:(k * world + rank + 1) * BATCH] for k in range(STEPS * GA)]
    res = {k: got[k] for k in ("unwrapped", "autocast", "pretrained_diff", "pretrained_missing", "architectures", "ckpts")}
    res["same_batches"] = len(got["batches"]) == len(want_batches) and all(
        torch.equal(a, b) for a, b in zip(got["batches"], want_batches))
    res["got"] = {k: got[k] for k in ("loss", "grad_norm", "learning_rate", "eval_loss")}
    res["ref"] = {k: ref[k] for k in ("loss", "grad_norm", "learning_rate", "eval_loss")}
    res["weight_diff"] = max_diff(got["state"], ref["state"])
    res["calls"], res["ref_calls"] = got["calls"], ref["calls"]
    if not bf16:
        mean = reference_loop(kind, bf16, "mean")
        res["mean_loss"] = mean["loss"]
        res["mean_weight_diff"] = max_diff(got["state"], mean["state"])
    return res


@pytest.mark.parametrize("kind,bf16", [("fully_shard", False), ("replicate", False), ("fully_shard", True)])
def test_trainer_matches_plain_loop(kind, bf16, tmp_path):
    res = get_pool(W).run(parity_check, kind, bf16, str(tmp_path), timeout=300)
    for r in res:
        got, ref = r["got"], r["ref"]
        print(f"{kind} bf16={bf16}: trainer loss {got['loss']} grad_norm {got['grad_norm']} eval {got['eval_loss']}; "
              f"loop loss {ref['loss']}; weight diff {r['weight_diff']:.1e}; "
              f"mean-formula loss {r.get('mean_loss')} weight diff {r.get('mean_weight_diff')}")
        assert r["unwrapped"], "accelerate wrapped the sharded model"
        assert r["same_batches"], "Trainer's micro-batches are not the rows the loop uses"
        assert r["autocast"] == (["torch.bfloat16"] if bf16 else ["torch.float32"]), r["autocast"]
        assert len(got["loss"]) == STEPS and len(got["eval_loss"]) == STEPS // 2, got
        assert min(ref["grad_norm"]) > CLIP, ref["grad_norm"]  # clipping acted on every step
        assert got["learning_rate"] == ref["learning_rate"] and ref["learning_rate"][0] > ref["learning_rate"][-1]
        # bitwise: same micro-batches, loss formula, reductions, clipping norm and optimizer
        assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"], (got, ref)
        assert r["weight_diff"] == 0.0, r["weight_diff"]
        # the same collectives: one gradient reduction per optimizer step (GA deferred), as the loop
        assert r["calls"] == r["ref_calls"], (r["calls"], r["ref_calls"])
        assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6, abs=0)
        if not bf16:
            # the two formulas differ by the scaling W / (GA * W) = 1 / GA, exact for GA = 2
            assert got["loss"] == r["mean_loss"] and r["mean_weight_diff"] == 0.0, (got["loss"], r["mean_loss"])
        # save_model: a from_pretrained folder with the trained weights
        assert r["pretrained_diff"] == 0.0 and not r["pretrained_missing"], r
        assert r["architectures"] == ["Qwen3ForCausalLM"], r["architectures"]
        assert r["ckpts"] == ["checkpoint-2", "checkpoint-4"], r["ckpts"]


# ================================================================================ resume
def resume_check(kind: str, out: str) -> dict:
    from matrixfsdp.hf_trainer import DCP_DIR, MatrixFSDPTrainer

    _env()
    world = dist.get_world_size()
    train = dataset(4 * STEPS * GA * world * BATCH, seed=3)  # 4x the run: resume lands mid-epoch
    runs = {}
    for name, resume in (("full", None), ("resumed", os.path.join(out, "full", "checkpoint-2"))):
        model, opt = build(kind)
        trainer = MatrixFSDPTrainer(model=model, args=args(os.path.join(out, name)), train_dataset=train,
                                    eval_dataset=dataset(EVAL_ROWS, seed=2), optimizers=(opt, None),
                                    callbacks=[Recorder()])
        trainer.train(resume_from_checkpoint=resume)
        runs[name] = {**logs_of(trainer), "state": full_state(model), "global_step": trainer.state.global_step}
    ckpt = os.path.join(out, "full", "checkpoint-2")
    return {
        "full": runs["full"]["loss"], "resumed": runs["resumed"]["loss"], "resumed_steps": runs["resumed"]["step"],
        "full_eval": runs["full"]["eval_loss"], "resumed_eval": runs["resumed"]["eval_loss"],
        "weight_diff": max_diff(runs["full"]["state"], runs["resumed"]["state"]),
        "steps": (runs["full"]["global_step"], runs["resumed"]["global_step"]),
        "files": sorted(os.listdir(ckpt)), "dcp": os.path.isfile(os.path.join(ckpt, DCP_DIR, ".metadata")),
    }


@pytest.mark.parametrize("kind", ["fully_shard", "replicate"])
def test_trainer_resume_is_exact(kind, tmp_path):
    res = get_pool(W).run(resume_check, kind, str(tmp_path), timeout=300)
    for r in res:
        print(f"{kind}: uninterrupted {r['full']} resumed {r['resumed']} weight diff {r['weight_diff']:.1e}")
        assert r["steps"] == (STEPS, STEPS)
        assert len(r["resumed"]) == STEPS - 2  # steps 3 and 4 only
        assert r["resumed_steps"][:2] == [3, 4], r["resumed_steps"]
        assert r["resumed"] == r["full"][2:], r  # bitwise
        assert r["resumed_eval"] == r["full_eval"][1:], r
        assert r["weight_diff"] == 0.0, r["weight_diff"]
        assert r["dcp"] and {"scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= set(r["files"])
        assert "optimizer.pt" not in r["files"]  # the optimizer state is in the DCP checkpoint


def best_check(out: str) -> dict:
    from matrixfsdp.hf_trainer import DCP_DIR, MatrixFSDPTrainer

    _env()
    model, opt = build("fully_shard")
    trainer = MatrixFSDPTrainer(
        model=model, args=args(out, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                               save_only_model=True),
        train_dataset=dataset(STEPS * GA * W * BATCH, seed=1), eval_dataset=dataset(EVAL_ROWS, seed=2),
        optimizers=(opt, None), callbacks=[Recorder()])
    trainer.train()
    best = trainer.state.best_model_checkpoint
    fresh, _ = build("fully_shard")
    matrixfsdp.checkpoint.load(os.path.join(best, DCP_DIR), fresh)
    keys = matrixfsdp.checkpoint.read_metadata(os.path.join(best, DCP_DIR)).state_dict_metadata
    evals = logs_of(trainer)["eval_loss"]
    return {"best": os.path.basename(best), "evals": evals, "diff": max_diff(full_state(model), full_state(fresh)),
            "optim_keys": sum(k.startswith("optim.") for k in keys), "model_keys": sum(k.startswith("model.") for k in keys)}


def test_trainer_load_best_model_at_end(tmp_path):
    """save_only_model checkpoints hold the model only; load_best_model_at_end reads the best back."""
    for r in get_pool(W).run(best_check, str(tmp_path), timeout=300):
        assert r["best"] == f"checkpoint-{2 * (1 + r['evals'].index(min(r['evals'])))}", r
        assert r["best"] != f"checkpoint-{STEPS}", r  # else loading it back would change nothing
        assert r["diff"] == 0.0 and r["optim_keys"] == 0 and r["model_keys"] > 0, r


# ================================================================================ misuse
def misuse_check(out: str) -> dict:
    from transformers import Qwen3ForCausalLM

    from matrixfsdp.hf_trainer import MatrixFSDPTrainer

    _env()
    errors = {}

    def expect(name, fn, exc):
        try:
            fn()
        except exc as e:
            errors[name] = str(e)
        else:
            errors[name] = None

    model, opt = build("fully_shard")
    plain = Qwen3ForCausalLM(model.config)
    ok = dict(train_dataset=dataset(8, seed=1), eval_dataset=dataset(4, seed=2))
    expect("unsharded", lambda: MatrixFSDPTrainer(model=plain, args=args(out), optimizers=(opt, None), **ok), TypeError)
    expect("no_optimizer", lambda: MatrixFSDPTrainer(model=model, args=args(out), **ok), ValueError)
    foreign = torch.optim.SGD(plain.parameters(), lr=0.1)
    expect("foreign_optimizer", lambda: MatrixFSDPTrainer(model=model, args=args(out), optimizers=(foreign, None), **ok),
           ValueError)
    expect("torch_compile", lambda: MatrixFSDPTrainer(model=model, args=args(out, torch_compile=True),
                                                      optimizers=(opt, None), **ok), ValueError)
    expect("bf16_full_eval", lambda: MatrixFSDPTrainer(model=model, args=args(out, bf16_full_eval=True),
                                                       optimizers=(opt, None), **ok), ValueError)
    expect("world_size", lambda: MatrixFSDPTrainer(model=model, args=args(out, use_cpu=False),
                                                   optimizers=(opt, None), **ok), ValueError)
    trainer = MatrixFSDPTrainer(model=model, args=args(out), optimizers=(opt, None), **ok)
    os.makedirs(os.path.join(out, "stock"), exist_ok=True)
    expect("foreign_checkpoint", lambda: trainer.train(resume_from_checkpoint=os.path.join(out, "stock")), ValueError)
    return errors


def test_trainer_misuse(tmp_path):
    res = get_pool(W).run(misuse_check, str(tmp_path), timeout=300)
    api = "matrixfsdp.hf_trainer.MatrixFSDPTrainer"
    want = {
        "unsharded": "must be sharded by matrixfsdp at its root",
        "no_optimizer": "needs an optimizer built on the sharded model",
        "foreign_optimizer": "not parameters of the model",
        "torch_compile": "TrainingArguments(torch_compile=True) is not supported",
        "bf16_full_eval": "TrainingArguments(bf16_full_eval=True) is not supported",
        "world_size": "world_size=1 but the process group has 2 ranks",
        "foreign_checkpoint": "holds no 'dcp' folder",
    }
    for errors in res:
        for name, fragment in want.items():
            msg = errors[name]
            assert msg is not None, f"{name}: no error raised"
            assert msg.startswith(api) and fragment in msg, (name, msg)
    assert "got Qwen3ForCausalLM" in res[0]["unsharded"]


# ================================================================================ the recipe
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "hf_trainer.py")
SMOKE = ["--seq-len", "32", "--batch", "8", "--save-steps", "2"]


def _run_recipe(cmd: list[str], cwd: str) -> str:
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


def test_recipe_readme_row():
    table = open(os.path.join(ROOT, "recipes", "README.md")).read()
    assert "[hf_trainer.py](hf_trainer.py)" in table and "torchrun --nproc-per-node 2 recipes/hf_trainer.py" in table


def test_recipe_starts_its_own_ranks(tmp_path):
    """`python recipes/hf_trainer.py`, as recipes/README.md gives it, at smoke size."""
    import sys

    out = _run_recipe([sys.executable, RECIPE, "--steps", "2", *SMOKE, "--out", "run"], cwd=str(tmp_path))
    assert "held-out loss after" in out and "'eval_loss'" in out, out[-2000:]
    run = tmp_path / "run"
    assert (run / "checkpoint-2" / "dcp" / ".metadata").is_file()
    assert not (tmp_path / "run.store").exists()  # the launcher's rendezvous file is removed
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(str(run / "final"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def recipe_main(argv: list[str]) -> None:
    import importlib.util

    _env()
    spec = importlib.util.spec_from_file_location("hf_trainer_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    recipe.main(recipe.parse(argv))


def test_recipe_torchrun_resume(tmp_path):
    """`torchrun ... recipes/hf_trainer.py --resume --bf16` continues a run of the recipe's main
    (run here on the harness ranks, to save a launch) from its checkpoint-2 to step 4."""
    import json
    import shutil
    import sys

    run = tmp_path / "run"
    get_pool(W).run(recipe_main, ["--steps", "2", *SMOKE, "--out", str(run)], timeout=300)
    assert (run / "checkpoint-2" / "dcp" / ".metadata").is_file()
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    out = _run_recipe([torchrun, "--standalone", "--nproc-per-node", "2", RECIPE, "--steps", "4", "--resume", "--bf16",
                       *SMOKE, "--out", "run"], cwd=str(tmp_path))
    assert f"resuming from {os.path.join('run', 'checkpoint-2')}" in out, out[-2000:]
    assert "held-out loss after" in out, out[-2000:]
    assert json.load(open(run / "checkpoint-4" / "trainer_state.json"))["global_step"] == 4
