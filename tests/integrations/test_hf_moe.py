"""Hugging Face ``Qwen3MoeForCausalLM`` (tiny config built in code) under ``matrixfsdp.fully_shard``.

The model (hidden 64, 2 layers, 5 experts, top-2, expert hidden 32, eager attention, fp32) is
planned with ``plan_owners(block_types=(Qwen3MoeDecoderLayer,))``, every decoder layer is
sharded, then the root. Its expert stacks (``mlp.experts.gate_up_proj [5, 64, 64]``, fused: two
matrices per expert; ``mlp.experts.down_proj [5, 64, 32]``) are placed whole-expert per rank, so
at W=2 and W=3 the 5 experts split unevenly (counts the planner picks per stack); the router ``mlp.gate.weight [5, 64]``
is an ordinary owned matrix. Against a one-process copy of the same model on the same global
batch (DDP-average semantics: the reference loss is the mean of the ranks' slice losses):

* custom loop: each rank's local rows of every reduced gradient (an expert stack's rows are its
  experts, ``plan[fqn].local_rows``; the planner's counts, e.g. ``(2, 3, 0)`` at W=3) equal the reference rows, and after three steps of
  ``matrixfsdp.optim.Muon(model, ns_dtype=float32)`` on both sides the parameters do (<= 1e-6);
  with and without ``gradient_checkpointing_enable()``, and with the router's load-balancing
  loss (``output_router_logits=True``: ``loss += router_aux_loss_coef * aux_loss``) in one case;
* ``MatrixFSDPTrainer``: logged loss, ``grad_norm``, learning rate, eval loss and the final
  weights equal a plain loop's over the same micro-batches, bitwise (as for the dense Qwen3 in
  ``test_hf_trainer.py``), and a resume from ``checkpoint-2`` continues bitwise;
* ``matrixfsdp.checkpoint.save_pretrained`` (and transformers' own ``save_pretrained`` after
  ``enable_save_pretrained()``) writes the folder transformers writes for the unsharded model,
  tensor for tensor (transformers 5 stores Qwen3-MoE experts per expert on disk,
  ``experts.<e>.{gate,up,down}_proj.weight``, split from the full ``[E, ...]`` stacks it is
  given); ``from_pretrained`` of it gives the reference logits;
* ``generate`` (greedy) gives the reference tokens.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from fully_shard.test_parity import compare_to_ref

import matrixfsdp

transformers = pytest.importorskip("transformers")

TOL = 1e-6
BATCH = 6  # divisible by 2 and 3
SEQ = 12
VOCAB = 128
EXPERTS = 5
AUX_COEF = 0.1  # transformers' default 0.001 would hide a wrong aux-loss gradient under 1e-6
STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def config(aux: bool = False):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=64,
                          tie_word_embeddings=False, attn_implementation="eager", dtype=torch.float32,
                          output_router_logits=aux, router_aux_loss_coef=AUX_COEF)


def build(aux: bool = False):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config(aux))


def shard(model, mesh=None):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    mesh = mesh if mesh is not None else init_device_mesh("cpu", (dist.get_world_size(),))
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(Qwen3MoeDecoderLayer,))
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    return plan


def tokens(seed: int, rows: int = BATCH, cols: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, cols), generator=torch.Generator().manual_seed(seed))


def stack_layout(model) -> dict[str, tuple]:
    """(counts, splits, local rows) of every expert stack, as the sharded parameters carry them."""
    out = {}
    for name, p in model.named_parameters():
        info = matrixfsdp.placement.expert_stack_of(p)
        if info is not None:
            out[name] = (info.counts, info.splits, p.to_local().shape[0], info.local_experts)
    return out


# ================================================================================ custom loop
def train_check(checkpointing: bool, aux: bool, steps: int = 3) -> dict:
    from matrixfsdp.optim import Muon

    rank, W = dist.get_rank(), dist.get_world_size()
    model = build(aux)
    ref = copy.deepcopy(model)
    plan = shard(model)
    if checkpointing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_enable in v6
            model.gradient_checkpointing_enable()
            ref.gradient_checkpointing_enable()
    model.train()
    ref.train()
    opt = Muon(model, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, adamw_lr=3e-3)
    ref_opt = Muon(ref, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, adamw_lr=3e-3)
    adamw = {id(p) for g in ref_opt.param_groups if g["algorithm"] == "adamw" for p in g["params"]}
    per = BATCH // W
    out = {"grad_diff": [], "loss_diff": 0.0, "aux_diff": 0.0, "aux": [], "layout": stack_layout(model),
           "placements": {fqn: (plan[fqn].placement, plan[fqn].local_rows(rank, W)) for fqn in (pp.fqn for pp in plan.params)
                          if any(fqn.endswith(s) for s in STACKS)},
           "routes": [g["routes"] for g in opt.state_dict()["param_groups"]],
           "ref_routes": [g["routes"] for g in ref_opt.state_dict()["param_groups"]]}
    for step in range(steps):
        ids = tokens(step)
        mine = ids[rank * per:(rank + 1) * per]
        res = model(input_ids=mine, labels=mine)
        res.loss.backward()
        ref_res = [ref(input_ids=ids[r * per:(r + 1) * per], labels=ids[r * per:(r + 1) * per]) for r in range(W)]
        (sum(r.loss for r in ref_res) / W).backward()
        g = torch.stack([res.loss.detach(), res.aux_loss.detach() if aux else torch.tensor(0.0)])
        dist.all_reduce(g)
        out["loss_diff"] = max(out["loss_diff"], abs(g[0].item() / W - sum(r.loss.item() for r in ref_res) / W))
        if aux:  # the load-balancing loss is on the path: present, and the same per slice
            out["aux"].append(res.aux_loss.item())
            out["aux_diff"] = max(out["aux_diff"], abs(g[1].item() / W - sum(r.aux_loss.item() for r in ref_res) / W))
        out["grad_diff"].append(compare_to_ref(model, ref, plan, rank, W, "grad"))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    # parameters by route: Muon's (every matrix, expert stack and router) and AdamW's (embeddings,
    # head, norms); see the test for why AdamW's get a looser bound
    refp = dict(ref.named_parameters())
    out["param_diff"] = out["adamw_param_diff"] = 0.0
    for fqn, p in model.named_parameters():
        s, e = plan[fqn].local_rows(rank, W)
        mine = p._local_tensor if hasattr(p, "_local_tensor") else p
        if mine.numel():
            key = "adamw_param_diff" if id(refp[fqn]) in adamw else "param_diff"
            out[key] = max(out[key], (mine.detach() - refp[fqn].detach()[s:e]).abs().max().item())
    out["adamw_params"] = len(adamw)
    out["moved"] = max((p.detach() - q).abs().max().item() for p, q in
                       zip(ref.parameters(), build(aux).parameters()))
    return out


@pytest.mark.parametrize("W,checkpointing,aux", [
    (2, False, False),
    (2, True, True),
    (3, False, True),
    (3, True, False),
])
def test_hf_moe_training_parity(W, checkpointing, aux):
    res = get_pool(W).run(train_check, checkpointing, aux, timeout=300)
    print(f"qwen3-moe W={W} ckpt={checkpointing} aux={aux}: grad {max(max(r['grad_diff']) for r in res):.2e} "
          f"param {max(r['param_diff'] for r in res):.2e} (adamw {max(r['adamw_param_diff'] for r in res):.2e}) "
          f"loss {max(r['loss_diff'] for r in res):.2e} aux {max(r['aux_diff'] for r in res):.2e}")
    for rank, r in enumerate(res):
        assert max(r["grad_diff"]) <= TOL and r["loss_diff"] <= TOL and r["param_diff"] <= TOL, r
        # AdamW's first update is lr * g / (|g| + eps), of slope up to lr / eps where |g| ~ eps: at W=3
        # the reduced gradient and the one-process one sum the slices in another order, and one norm
        # weight's gradient element of 4.8e-8 (eps 1e-8) differs by 2.7e-10 (fp32 rounding; its
        # gradient is within 1e-6 as every other), which moves its update by ~2.4e-6 at lr 3e-3.
        # At W=2 both are bitwise (0.0). Muon's update is normalized by the whole matrix: no such slope.
        assert r["adamw_param_diff"] <= 10 * TOL and r["adamw_params"] == 2 + 2 * 4 + 1, r
        assert r["moved"] > 1e-3  # the steps changed the weights (a no-op would also agree)
        # whole experts per rank, 5 over 2 or 3 ranks: the planner picks the counts per stack to
        # balance the ranks' bytes over the model (at W=3 some rank holds none of a stack: (2, 3, 0));
        # fused gate_up two matrices per expert
        assert len(r["layout"]) == 4, r["layout"]
        for name, (cnt, splits, local, local_experts) in r["layout"].items():
            first = sum(cnt[:rank])
            assert len(cnt) == W and sum(cnt) == EXPERTS and local == cnt[rank], r["layout"]
            assert local_experts == (first, first + cnt[rank]), r["layout"]
            assert splits == (2 if name.endswith("gate_up_proj") else 1), (name, splits)
            assert r["placements"][name] == ("experts", local_experts), r["placements"][name]
        # the same routes on both sides (the one routing rule)
        assert r["routes"] == r["ref_routes"], (r["routes"], r["ref_routes"])
        if aux:
            assert r["aux_diff"] <= TOL and all(a > 0 for a in r["aux"]), r
        else:
            assert not r["aux"]


# ================================================================================ generate
def generate_check() -> dict:
    model = build()
    ref = copy.deepcopy(model)
    shard(model)
    model.eval()
    ref.eval()
    ids = tokens(7, rows=2, cols=5)
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=6, do_sample=False)
        b = ref.generate(ids, max_new_tokens=6, do_sample=False)
    return {"equal": torch.equal(a, b), "new": a.shape[1] - ids.shape[1], "tokens": a.tolist()}


@pytest.mark.parametrize("W", [2, 3])
def test_hf_moe_generate(W):
    res = get_pool(W).run(generate_check, timeout=300)
    assert all(r["equal"] and r["new"] == 6 for r in res), res


# ================================================================================ save_pretrained
def _read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def save_check(path: str) -> dict:
    rank = dist.get_rank()
    model = build()
    ref = copy.deepcopy(model)
    shard(model)
    out: dict = {}
    ret = matrixfsdp.checkpoint.save_pretrained(model, os.path.join(path, "hf"))
    out["ret"] = ret == os.path.join(path, "hf")
    # transformers' own save_pretrained on the sharded model, called on every rank, once asked for
    matrixfsdp.checkpoint.enable_save_pretrained()
    model.save_pretrained(os.path.join(path, "direct"))
    # what transformers writes for the unsharded model: the layout the folders must have
    stock = os.path.join(path, "stock")
    if rank == 0:  # under a process group transformers writes on rank 0 only
        ref.save_pretrained(stock)
    dist.barrier()
    want = _read_safetensors(stock)
    for name in ("hf", "direct"):
        got = _read_safetensors(os.path.join(path, name))
        out[f"{name}_keys_equal"] = sorted(got) == sorted(want)
        out[f"{name}_equal"] = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    out["keys"] = sorted(want)
    loaded = type(ref).from_pretrained(os.path.join(path, "hf"))
    refsd = ref.state_dict()
    out["weights_equal"] = loaded.state_dict().keys() == refsd.keys() and all(
        torch.equal(v, refsd[k]) for k, v in loaded.state_dict().items())
    out["stack_shapes"] = {k: tuple(v.shape) for k, v in loaded.state_dict().items() if "experts" in k}
    ids = tokens(3)
    with torch.no_grad():
        out["logit_diff"] = (loaded(ids).logits - ref(ids).logits).abs().max().item()
    import json

    out["architectures"] = json.load(open(os.path.join(path, "hf", "config.json")))["architectures"]
    return out


@pytest.mark.parametrize("W", [2, 3])
def test_hf_moe_save_pretrained_roundtrip(W, tmp_path):
    res = get_pool(W).run(save_check, str(tmp_path), timeout=300)
    for r in res:
        print(f"W={W}: logits {r['logit_diff']:.1e}")
        # the file transformers writes for the unsharded model, tensor for tensor, both ways of saving
        assert r["hf_keys_equal"] and r["direct_keys_equal"], r["keys"]
        assert r["hf_equal"] and r["direct_equal"], r
        # every expert of both stacks of both layers, each rank's experts gathered
        assert sum(".mlp.experts." in k for k in r["keys"]) == 2 * EXPERTS * 3, r["keys"]
        assert r["ret"] and r["weights_equal"] and r["logit_diff"] <= TOL, r
        assert r["stack_shapes"] == {f"model.layers.{i}.mlp.experts.{s}": shape for i in range(2)
                                     for s, shape in (("gate_up_proj", (5, 64, 64)), ("down_proj", (5, 64, 32)))}
        assert r["architectures"] == ["Qwen3MoeForCausalLM"], r["architectures"]


# ================================================================================ MatrixFSDPTrainer
# The helpers of the dense Trainer test (data, arguments, logs, full state); the model is the MoE one.
TW, TBATCH, GA, STEPS, CLIP, EVAL_ROWS, TSEQ = 2, 2, 2, 4, 0.05, 8, 16


def trainer_model():
    model = build()
    shard(model)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, weight_decay=0.0, ns_dtype=torch.float32)
    # groups: matrices, fused gate_up stacks (experts/2), down stacks (experts/1), AdamW
    assert [g["algorithm"] for g in opt.param_groups] == ["muon", "muon", "muon", "adamw"], opt.param_groups
    opt.param_groups[3]["lr"] = 3e-3  # the AdamW group, as in test_hf_trainer.py (scaled by the schedule)
    return model, opt


def trainer_reference_loop() -> dict:
    """The plain loop Trainer's run must equal (see ``test_hf_trainer.reference_loop``)."""
    from integrations.test_hf_trainer import counter, full_state, rows

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = trainer_model()
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, STEPS)
    data, held = rows(STEPS * GA * world * TBATCH, seed=1), rows(EVAL_ROWS, seed=2)
    n_items = torch.tensor(float(GA * world * TBATCH * (TSEQ - 1)))
    out: dict = {"loss": [], "grad_norm": [], "learning_rate": [], "eval_loss": []}
    counter(model).reset()
    for step in range(STEPS):
        model.train()
        total = torch.tensor(0.0)
        for m in range(GA):
            k = step * GA + m
            x = data[(k * world + rank) * TBATCH:(k * world + rank + 1) * TBATCH]
            model.set_requires_gradient_sync(m == GA - 1)
            loss = model(input_ids=x, labels=x, num_items_in_batch=n_items).loss * world
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
            with torch.no_grad():
                mine = torch.stack([model(input_ids=x, labels=x).loss for x in (
                    held[(b * world + rank) * TBATCH:(b * world + rank + 1) * TBATCH]
                    for b in range(EVAL_ROWS // (world * TBATCH)))])
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            out["eval_loss"].append(torch.stack(every).mean().item())
    out["calls"] = dict(counter(model).calls)
    out["state"] = full_state(model)
    return out


def trainer_parity_check(out: str) -> dict:
    from integrations.test_hf_trainer import Recorder, _env, args, counter, dataset, full_state, logs_of, max_diff

    from matrixfsdp.hf_trainer import MatrixFSDPTrainer

    _env()
    world = dist.get_world_size()
    model, opt = trainer_model()
    trainer = MatrixFSDPTrainer(
        # save_only_model: the checkpoints every 2 steps hold the model (expert stacks written whole
        # by their ranks' rows) but not the optimizer, whose expert-stack state DCP cannot take yet
        # (see test_trainer_moe_resume_is_exact)
        model=model, args=args(out, train_sampling_strategy="sequential", save_only_model=True),
        train_dataset=dataset(STEPS * GA * world * TBATCH, seed=1), eval_dataset=dataset(EVAL_ROWS, seed=2),
        optimizers=(opt, None), callbacks=[Recorder()])
    counter(model).reset()
    trainer.train()
    got = logs_of(trainer)
    got_calls, state = dict(counter(model).calls), full_state(model)
    final = os.path.join(out, "final")
    trainer.save_model(final)
    loaded, info = type(model).from_pretrained(final, output_loading_info=True)
    ref = trainer_reference_loop()
    return {
        "unwrapped": trainer.model_wrapped is model and trainer.model is model,
        "got": {k: got[k] for k in ("loss", "grad_norm", "learning_rate", "eval_loss")},
        "ref": {k: ref[k] for k in ("loss", "grad_norm", "learning_rate", "eval_loss")},
        "weight_diff": max_diff(state, ref["state"]), "calls": got_calls, "ref_calls": ref["calls"],
        "pretrained_diff": max_diff(loaded.state_dict(), {k: state[k] for k in loaded.state_dict()}),
        "pretrained_missing": sorted(info["missing_keys"]) + sorted(info["unexpected_keys"]),
        "moved": max_diff(state, build().state_dict()),
        "ckpts": sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")),
    }


def test_trainer_moe_matches_plain_loop(tmp_path):
    res = get_pool(TW).run(trainer_parity_check, str(tmp_path), timeout=400)
    for r in res:
        got, ref = r["got"], r["ref"]
        print(f"trainer loss {got['loss']} grad_norm {got['grad_norm']} eval {got['eval_loss']}; "
              f"loop loss {ref['loss']}; weight diff {r['weight_diff']:.1e}")
        assert r["unwrapped"], "accelerate wrapped the sharded model"
        assert len(got["loss"]) == STEPS and len(got["eval_loss"]) == STEPS // 2, got
        assert min(ref["grad_norm"]) > CLIP, ref["grad_norm"]  # clipping acted on every step
        assert got["learning_rate"] == ref["learning_rate"]
        # bitwise: same micro-batches, loss formula, reductions, clipping norm and optimizer
        assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"], (got, ref)
        assert r["weight_diff"] == 0.0 and r["moved"] > 1e-3, r
        assert r["calls"] == r["ref_calls"], (r["calls"], r["ref_calls"])
        assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-6, abs=0)
        assert r["pretrained_diff"] == 0.0 and not r["pretrained_missing"], r
        assert r["ckpts"] == ["checkpoint-2", "checkpoint-4"], r["ckpts"]


def trainer_resume_check(out: str) -> dict:
    from integrations.test_hf_trainer import Recorder, _env, args, dataset, full_state, logs_of, max_diff

    from matrixfsdp.hf_trainer import DCP_DIR, MatrixFSDPTrainer

    _env()
    world = dist.get_world_size()
    train = dataset(4 * STEPS * GA * world * TBATCH, seed=3)  # 4x the run: resume lands mid-epoch
    runs = {}
    for name, resume in (("full", None), ("resumed", os.path.join(out, "full", "checkpoint-2"))):
        model, opt = trainer_model()
        trainer = MatrixFSDPTrainer(model=model, args=args(os.path.join(out, name)), train_dataset=train,
                                    eval_dataset=dataset(EVAL_ROWS, seed=2), optimizers=(opt, None),
                                    callbacks=[Recorder()])
        trainer.train(resume_from_checkpoint=resume)
        runs[name] = {**logs_of(trainer), "state": full_state(model), "global_step": trainer.state.global_step}
    ckpt = os.path.join(out, "full", "checkpoint-2", DCP_DIR)
    keys = matrixfsdp.checkpoint.read_metadata(ckpt).state_dict_metadata
    return {
        "full": runs["full"]["loss"], "resumed": runs["resumed"]["loss"], "resumed_steps": runs["resumed"]["step"],
        "full_eval": runs["full"]["eval_loss"], "resumed_eval": runs["resumed"]["eval_loss"],
        "weight_diff": max_diff(runs["full"]["state"], runs["resumed"]["state"]),
        "steps": (runs["full"]["global_step"], runs["resumed"]["global_step"]),
        # the stacks are stored whole in the DCP checkpoint (each rank wrote its experts' rows)
        "stack_sizes": {k: tuple(v.size) for k, v in keys.items() if k.startswith("model.") and "experts" in k},
    }


def test_trainer_moe_resume_is_exact(tmp_path):
    res = get_pool(TW).run(trainer_resume_check, str(tmp_path), timeout=400)
    for r in res:
        print(f"uninterrupted {r['full']} resumed {r['resumed']} weight diff {r['weight_diff']:.1e}")
        assert r["steps"] == (STEPS, STEPS)
        assert r["resumed_steps"][:2] == [3, 4], r["resumed_steps"]
        assert r["resumed"] == r["full"][2:], r  # bitwise
        assert r["resumed_eval"] == r["full_eval"][1:], r
        assert r["weight_diff"] == 0.0, r["weight_diff"]
        assert len(r["stack_sizes"]) == 4 and all(s[0] == EXPERTS for s in r["stack_sizes"].values()), r["stack_sizes"]
