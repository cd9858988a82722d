"""Outside use of ``matrixfsdp.tp`` (issue 18): a Hugging Face ``Qwen3ForCausalLM`` split by its own
tensor-parallel plan, ``config.base_model_tp_plan``, at tp=2 on a ``"tp"`` mesh (dp=1), and under
``matrixfsdp.fully_shard`` at (dp=2, tp=2) (the last test).

Two ways to apply the plan, per decoder layer:

* ``"transformers"``: transformers' own ``apply_tensor_parallelism`` (exported by
  ``transformers.integrations.tensor_parallel``; what ``from_pretrained(distributed_config=...)``
  calls) with the plan's ``layers.*.`` rules expanded onto each layer's modules and parameters.
  It runs on CPU/gloo as it is: its ``ColwiseParallel``/``RowwiseParallel`` are transformers'
  classes (not torch's ``ParallelStyle``), and they leave ``Shard(0)``/``Shard(1)`` DTensor weights
  on the mesh, which is what ``host_matrices`` looks for. ``q_norm``/``k_norm``
  (``replicated_with_grad_allreduce``) stay plain, with a gradient all-reduce hook.
* ``"torch"``: torch's ``parallelize_module`` with ``"colwise"`` -> ``ColwiseParallel()``,
  ``"rowwise"`` -> ``RowwiseParallel()``; torch has no style for
  ``"replicated_with_grad_allreduce"``, so its parameters get the same all-reduce hook here.

No config change is needed for the local heads: Qwen3's attention reshapes the projections with
``view(*input_shape, -1, head_dim)``, so each rank sees ``num_heads / tp`` query heads and
``num_kv_heads / tp`` KV heads, and ``num_key_value_groups`` (a ratio) stays right for
``repeat_kv``. Heads must divide by tp (4 and 2 heads at tp=2 here).

The reference is the plain model in the same process on the same batch (every TP rank sees the
whole batch). Step 0's gradients are compared directly (each rank's shard against the matching
chunk of the reference gradient), then the parameters after 3 Muon steps. Each step makes two
all-to-alls per micro-group and steps each hosted matrix on exactly one rank.

``VOCAB`` is 96, not 128: the default matrix filter sends a 2D weight whose row count equals an
embedding's vocabulary size to AdamW (it takes it for an output head), and with a vocabulary of
128 the 128-row ``gate_proj``/``up_proj`` would silently leave Muon (on both sides, so parity
would still hold, but they would not be hosted).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import matrixfsdp
from _harness import get_pool
from tp.test_host_matrices import _diff

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

VOCAB, BATCH, SEQ, STEPS = 96, 4, 12, 3


def _model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager", dtype=torch.float32)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg)


def layer_plan(config) -> dict[str, str]:
    """``config.base_model_tp_plan``'s decoder-layer rules, relative to one layer
    (``"layers.*.mlp.up_proj"`` -> ``"mlp.up_proj"``)."""
    return {k.removeprefix("layers.*."): v for k, v in config.base_model_tp_plan.items() if k.startswith("layers.*.")}


def _grad_allreduce_hook(mesh):
    def hook(p):
        dist.all_reduce(p.grad, group=mesh.get_group())
    return hook


def parallelize(model, mesh, how: str) -> None:
    plan = layer_plan(model.config)
    for layer in model.model.layers:
        if how == "transformers":
            from transformers.integrations.tensor_parallel import apply_tensor_parallelism

            # one entry per parameter (to shard) and per module (to hook), as from_pretrained's
            # own expansion of the plan gives them
            expanded = {}
            for name, style in plan.items():
                for attr, _ in layer.get_submodule(name).named_parameters(recurse=False):
                    expanded[f"{name}.{attr}"] = style
                expanded[name] = style
            if len(inspect.signature(apply_tensor_parallelism).parameters) == 2:
                layer.tp_plan = expanded  # transformers 5.17 reads the plan from the module
                apply_tensor_parallelism(layer, mesh)
            else:  # 5.24
                apply_tensor_parallelism(layer, mesh, expanded)
        else:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            parallelize_module(layer, mesh, {n: styles[s]() for n, s in plan.items() if s in styles})
            for name, style in plan.items():
                if style == "replicated_with_grad_allreduce":
                    for p in layer.get_submodule(name).parameters():
                        p.register_post_accumulate_grad_hook(_grad_allreduce_hook(mesh))
                elif style not in styles:
                    raise NotImplementedError(style)


def _batch():
    """One batch, trained on for every step (so the loss on it must fall)."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(10))


def hf_tp_parity(how: str) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = _model()
    ref = copy.deepcopy(model)
    parallelize(model, mesh, how)
    used = matrixfsdp.tp.host_matrices(model, mesh)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    executor = matrixfsdp.tp.tp_host_of(model.model.layers[0].mlp.up_proj.weight).executor
    out = {"grad0": 0.0, "loss": [], "steps": []}
    for step in range(STEPS):
        ids = _batch()
        loss = model(input_ids=ids, labels=ids).loss
        ref_loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_loss.backward()
        out["loss"].append((loss.item(), ref_loss.item()))
        if step == 0:
            out["grad0"] = _diff(model, ref, "grad")
        a2a0, host0 = executor.calls["all_to_all"], executor.host_steps
        opt.step()
        ref_opt.step()
        out["steps"].append({"a2a": executor.calls["all_to_all"] - a2a0, "host_steps": executor.host_steps - host0})
        opt.zero_grad()
        ref_opt.zero_grad()
    out["param"] = _diff(model, ref, "param")
    out["groups"] = len(used)
    out["hosted"] = sorted(f for g in used for f, _ in g)
    out["sharded"] = sorted(f for f, p in model.named_parameters() if isinstance(p, DTensor))
    out["state_on_host"] = all(
        bool(p in opt.state and opt.state[p]) == matrixfsdp.tp.tp_host_of(p).is_local
        for f in out["hosted"] for p in [model.get_parameter(f)])
    return out


@pytest.mark.parametrize("how", ["transformers", "torch"])
def test_hf_qwen3_base_model_tp_plan_muon_parity(how):
    res = get_pool(2).run(hf_tp_parity, how)
    for r in res:
        print(how, {k: r[k] for k in ("grad0", "param", "groups")}, "losses", r["loss"])
        # every colwise/rowwise weight of both layers is a TP-sharded matrix, and every one is hosted
        assert len(r["sharded"]) == 14 and r["hosted"] == r["sharded"], r["hosted"]
        assert r["grad0"] < 1e-6, r
        assert r["param"] < 1e-5, r
        assert all(abs(a - b) < 1e-5 for a, b in r["loss"]), r["loss"]
        assert r["loss"][-1][1] < r["loss"][0][1]  # it trains (the same batch every step)
        assert r["state_on_host"], r
        assert all(s["a2a"] == 2 * r["groups"] for s in r["steps"]), r["steps"]
    for k in range(STEPS):
        assert sum(r["steps"][k]["host_steps"] for r in res) == 14


def hf_fsdp_tp_parity(how: str) -> dict:
    """(dp=2, tp=2): the plan applied per layer on mesh["tp"], then torch's FSDP2 + TP calls with
    matrixfsdp: plan_owners on the 2-D mesh, fully_shard(layer / model, mesh=mesh["dp_shard"]).
    Each data-parallel rank trains on its half of the batch; the reference on all of it."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    from fully_shard.test_tp import _diff as fsdp_diff

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = _model()
    ref = copy.deepcopy(model)
    parallelize(model, mesh["tp"], how)
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(Qwen3DecoderLayer,))
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh["dp_shard"], plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh["dp_shard"], plan=plan)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    ref_opt = matrixfsdp.optim.Muon(ref, lr=0.02, ns_dtype=torch.float32, adamw_lr=1e-3)
    d = mesh["dp_shard"].get_local_rank()
    hosted = [f for f, p in model.named_parameters() if matrixfsdp.tp.tp_host_of(p) is not None]
    out = {"grad0": 0.0, "loss": [], "hosted": sorted(hosted)}
    for step in range(STEPS):
        ids = _batch()
        mine = ids[d * BATCH // 2:(d + 1) * BATCH // 2]
        loss = model(input_ids=mine, labels=mine).loss
        ref_loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_loss.backward()
        out["loss"].append((loss.item(), ref_loss.item()))
        if step == 0:
            out["grad0"] = fsdp_diff(model, ref, "grad")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["param"] = fsdp_diff(model, ref, "param")
    refp = dict(ref.named_parameters())
    out["full"] = max(((matrixfsdp.full_tensor(p) - refp[f].detach()).abs().max()
                       / refp[f].detach().abs().max()).item() for f, p in model.named_parameters())
    return out


def test_hf_qwen3_base_model_tp_plan_under_fully_shard_dp2_tp2():
    res = get_pool(4).run(hf_fsdp_tp_parity, "transformers")
    for r in res:
        print({k: r[k] for k in ("grad0", "param", "full")}, "losses", r["loss"])
        assert len(r["hosted"]) == 14, r["hosted"]  # every colwise/rowwise weight of both layers
        assert r["grad0"] < 1e-6 and r["param"] < 1e-5 and r["full"] < 1e-5, r
        assert r["loss"][-1][0] < r["loss"][0][0]  # it trains (the same batch every step)
    # ranks are (dp, tp) row-major: the two data-parallel halves' losses average to the reference's
    for (a, ref_a), (b, _) in zip(res[0]["loss"], res[2]["loss"]):
        assert abs((a + b) / 2 - ref_a) < 1e-5, res[0]["loss"]
