"""Train with matrixfsdp from a torchtitan (0.3.x) training config.

From the command line (no registration in torchtitan: ``--module`` takes any importable module)::

    torchrun --nproc-per-node 8 -m torchtitan.train --module matrixfsdp.titan --config qwen3_debugmodel_muon

From Python, convert any dense Llama3/Qwen3 config::

    from torchtitan.models.qwen3.config_registry import qwen3_14b
    import matrixfsdp.titan
    config = matrixfsdp.titan.with_matrixfsdp(qwen3_14b(), optimizer="Muon", lr=0.02, adamw_lr=3e-4)

What the conversion does:

* ``model_spec.parallelize_fn`` becomes :func:`parallelize_matrixfsdp`: torchtitan's tensor
  parallelism if configured (see below), activation checkpointing as configured, then
  ``plan_owners`` over the decoder layers and ``matrixfsdp.fully_shard`` of every layer and of
  the root on torchtitan's ``"fsdp"`` mesh, or with ``dp_replicate > 1``
  (HSDP) on the 2-D ``["dp_replicate", "fsdp"]`` mesh torchtitan's own ``apply_fsdp`` takes
  (owners planned within ``fsdp``, ``replica_step`` from :func:`with_matrixfsdp`; mixed precision and
  ``fsdp_reshard_after_forward`` from the config), summed gradients (torchtitan normalizes the
  loss by the global token count) and full-tensor parameter initialization (see below);
* the config becomes a ``MatrixTrainer.Config``: :class:`MatrixTrainer` is torchtitan's Trainer
  whose gradient clipping goes to matrixfsdp's (torch's total norm cannot combine gradients on
  different owner meshes); nothing of torchtitan is replaced process-wide;
* the optimizer becomes :class:`MatrixOptimizersContainer` (``"Muon"``, ``"Shampoo"`` or
  ``"SOAP"``; torchtitan's own names still work): owned matrices get the matrix rule, every
  other parameter AdamW, in separate param groups so the LR schedule scales both;
* ``parallelism.spmd_backend = "partial_dtensor"`` (the "spmd_types" path parallelizes the model
  itself), ``training.disable_cuda_graphs = True`` (the runtime's hooks run Python between kernels). A
  ``ChunkedLossWrapper`` loss is kept: it runs the output head outside the model's forward, where
  the root's unsharded parameters stay in place (``reshard_after_forward=False`` for the root, as
  FSDP2).

Initialization: torchtitan runs ``nn.init`` functions on the parameters after ``to_empty``; on
owned DTensors some raise on non-owners (``trunc_normal_``) and random ones would advance only
the owner's generator. Every torchtitan module's ``_init_param`` is therefore redirected to run
the same initializer on a full temporary tensor -- every rank draws the same numbers, torchtitan
seeds all ranks alike -- and keep its segment (``matrixfsdp.set_full_``): the sharded model starts
from exactly the parameters an unsharded run with the same seed would, at any world size.

Activation checkpointing as configured is applied first; the block sharded is the wrapped inner
layer (the recomputation runs it without the wrapper's hooks). Modules that torchtitan initializes
with ``reset_parameters()`` (no ``param_init``) are also initialized on full tensors.

Tensor parallelism (``parallelism.tensor_parallel_degree > 1``, with or without
``enable_sequence_parallel``): torchtitan's own TP is applied first, as its
``parallelize_{llama,qwen3}`` do on the ``partial_dtensor`` path (``model.parallelize(parallel_dims)``:
the sharding configs the model config declares -- colwise ``wqkv``/``w1``/``w3``, rowwise
``wo``/``w2``, a vocab-parallel embedding and head, so the loss is torchtitan's vocab-parallel
cross-entropy -- leave ``Shard(0)``/``Shard(1)``/``Replicate()`` DTensors on the ``"tp"`` mesh); a
tied embedding is tied again (``parallelize`` registers a new parameter on each of the two
modules). Then owners are planned over torchtitan's 2-D ``parallel_dims.get_mesh(["fsdp", "tp"])``
and ``fully_shard`` runs on ``"fsdp"`` as without TP (docs/tp.md: every TP-sharded matrix is
stepped whole on one host of its owner's TP row). Initialization on full tensors keeps each
rank's TP shard (``set_full_``), clipping spans the ``(fsdp, tp)`` mesh, and torchtitan's
checkpointer saves and resumes it (DCP reshards to and from runs without TP).

HSDP (``parallelism.data_parallel_replicate_degree > 1``): the data-parallel mesh is torchtitan's
``parallel_dims.get_mesh(["dp_replicate", "fsdp"])``, the mesh its stock ``apply_fsdp`` gives
torch's ``fully_shard`` for HSDP (dimension 0 replicates, dimension 1 shards; ``fsdp`` is
``dp_shard * cp``, see below). Owners are planned within ``fsdp``, the same
layout in every replica; ``replica_step`` (``"auto"``, ``"repeat"`` or ``"split"``, see
``plan_owners``) says how each owned matrix is combined across the replicas. With TP too, owners
are planned over the 3-D ``parallel_dims.get_mesh(["dp_replicate", "fsdp", "tp"])`` and
``fully_shard`` runs on ``["dp_replicate", "fsdp"]`` (HSDP x TP, docs/tp.md).

Mixture-of-experts models (torchtitan's ``GroupedExperts`` stacks, Qwen3-MoE, DeepSeek-V3; see
docs/experts.md): with ``expert_parallel_degree=1`` the planner owns every expert whole, balanced
with the dense weights; with expert parallelism spanning the data-parallel shard group
(``expert_parallel_degree == data_parallel_shard_degree``, ``efsdp == 1``) torchtitan's EP keeps
its layout and token all-to-alls, the plan records each rank's experts as they are, and the
matrix optimizer steps them locally.

Pipeline parallelism (``parallelism.pipeline_parallel_degree > 1``, torchtitan's schedules:
1F1B, Interleaved1F1B, GPipe, ...): torchtitan's ``pipeline_llm`` calls this parallelize_fn once
per model part (a stage: a deep copy of the model without the other stages' modules). Each stage
plans its owners over its own ``"fsdp"`` mesh and checks its digest in that group only (no
collective of the initialization spans stages, whose plans differ); the routing rule counts the
whole model's vocabulary (``MatrixRule(vocab_sizes=)``), so a stage without the embedding routes
as the unsplit model. A stage without decoder layers (torchtitan's rule is one *effective* layer
per stage: the embedding, or norm and head, count) is sharded as its root alone; one without any
matrix steps element-wise. The microbatches' gradients accumulate unreduced and each block
reduces once per pipeline step (``MatrixTrainer.pp_forward_backward_step``; torch's schedules
call FSDP2's sync controls only on torch ``FSDPModule``s), every stage's optimizer step is
local, and clipping all-reduces the stages' norms over the ``"pp"`` mesh
(``clip_grad_norm_(pp_mesh=)``). torchtitan's checkpointer resumes
across PP degrees (FQNs are the whole model's). Refused: tied embeddings (torchtitan refuses them
too), expert parallelism with PP, and a torch whose schedules lack ``step(arg_mbs=)``, which
torchtitan 0.3's Trainer calls (2.15 has it, 2.11 and 2.13 not). Each stage initializes from the same seed,
so a pipelined run starts elsewhere than a plain one unless both load one seed checkpoint.

Context parallelism (``parallelism.context_parallel_degree > 1``): torchtitan's own CP forward
wrapper goes on every layer's attention (``apply_cp_to_forward``, as its ``parallelize_qwen3``
does on the ``partial_dtensor`` path), and since torchtitan's ``"fsdp"`` mesh folds the CP ranks
(``dp_shard * cp``), owners are planned over it and each CP rank's gradient of its sequence
shard is summed into its owner's, as FSDP2 reduces over that mesh. Not run: torchtitan's CP
cannot compute attention on a CPU (SDPA: DTensor has no sharding strategy for
``aten._scaled_dot_product_flash_attention_for_cpu``; FlexAttention has no CPU backward).

Compile (``compile.enable`` with ``"model"`` in ``compile.components``): torchtitan's own
``apply_compile`` (``block.compile(fullgraph=True)`` per layer) after AC, before sharding; a
checkpointed layer is compiled inside its wrapper. matrixfsdp's hooks run outside dynamo.

Not supported (clear errors, each with its reason): expert parallelism with an expert-FSDP
group (``efsdp > 1``), with HSDP, TP or PP; CPU offload ([Note: CPU offload]); async TP
(``compile.enable_async_tensor_parallel``: CUDA symmetric memory) and quantized linears
(Float8/MXFP8/NVFP4 model converters: CUDA). ``parallelize_matrixfsdp`` used with torchtitan's stock ``Trainer`` (not
``MatrixTrainer``) trains, but torchtitan's clipping then refuses the owned gradients: build the
Trainer from ``with_matrixfsdp``'s config or ``MatrixTrainer.Config``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import optim as _optim
from ..placement.clip import clip_grad_norm_ as _mfsdp_clip
from ..placement.owner import FQN_ATTR
from ..placement.experts import adopt_expert_stack, expert_rows, expert_stack_of
from ..placement.owned_tensor import owned_of, set_full_
from ..placement.stepping import planned_kind
from ..planner.owners import plan_owners
from ..planner.heads import head_splits
from ..planner.rules import DEFAULT_RULE, MatrixRule
from .._fully_shard import MatrixFSDPModule, MixedPrecisionPolicy, fully_shard

try:
    import torchtitan  # noqa: F401
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.trainer import Trainer
except ImportError as e:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(
        "matrixfsdp.titan needs torchtitan (pip install -c constraints.txt 'matrixfsdp[titan]'); "
        f"importing it failed: {e}"
    ) from e

__all__ = [
    "parallelize_matrixfsdp",
    "MatrixOptimizersContainer",
    "MatrixTrainer",
    "with_matrixfsdp",
    "qwen3_debugmodel_muon",
]

API = "matrixfsdp.titan"
_MATRIX_OPTIMIZERS = {"Muon": _optim.Muon, "Shampoo": _optim.Shampoo, "SOAP": _optim.SOAP}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ================================================================================ parallelize
def parallelize_matrixfsdp(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
    skip_dp: bool = False,
    policy: str = "balanced",
    plan_optimizer: str = "muon",
    collectives: str = "all_to_all",
    replica_step: str = "auto",
    per_head: bool = False,
) -> nn.Module:
    """torchtitan ``ModelSpec.parallelize_fn`` applying matrixfsdp's ``fully_shard``.

    Called by torchtitan's Trainer on the meta-device model (keywords as torchtitan passes them);
    ``policy``/``plan_optimizer``/``collectives``/``replica_step`` are bound by
    :func:`with_matrixfsdp` and go to ``plan_owners(policy=, optimizer=, replica_step=)`` and
    ``fully_shard(collectives=)`` (``replica_step`` matters only with ``dp_replicate > 1``).
    """
    tp = bool(parallel_dims.tp_enabled)
    if tp and getattr(compile_config, "enable_async_tensor_parallel", False):
        raise ValueError(
            f"{API}.parallelize_matrixfsdp: async tensor parallelism (compile.enable_async_tensor_parallel"
            "=True) is not supported: inductor's micro-pipelined TP needs CUDA symmetric memory, and "
            "matrixfsdp has not run it (its tests run on CPUs); set "
            "compile.enable_async_tensor_parallel=False (plain TP, compiled or not, works)"
        )
    if parallel_dims.pp_enabled:  # first: it names PP's own conflicts (EP among them)
        _check_pp_config(model, parallel_dims)
    ep = bool(parallel_dims.ep_enabled)
    if ep:
        _check_ep_config(parallel_dims)
    if getattr(training, "enable_cpu_offload", False):
        _refuse_cpu_offload()
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"{API}.parallelize_matrixfsdp: set parallelism.spmd_backend='partial_dtensor' "
            f"(with_matrixfsdp does), got {parallelism.spmd_backend=!r}"
        )
    _refuse_quantized_linears(model, parallel_dims)
    if parallel_dims.cp_enabled:
        _apply_cp(model, parallel_dims)
    if tp or ep:
        # torchtitan's own TP and EP, as its parallelize_{llama,qwen3} (partial_dtensor path): the
        # sharding configs the model config set (update_from_config -> set_*_sharding_config)
        # shard the parameters on the "tp" mesh, the expert stacks by whole experts on the "ep"
        # mesh, and wrap the forwards (EP: the token all-to-alls); then AC, then fully_shard.
        model.parallelize(parallel_dims)
        _retie_embeddings(model)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        # torchtitan's own per-block compile (``block.compile(fullgraph=True)``), after AC and
        # before sharding, as its parallelize_{llama,qwen3}: matrixfsdp's hooks run outside
        # dynamo (engine.backward.dynamo_disable), as FSDP2's do.
        _apply_compile(model, compile_config, parallel_dims)
    if skip_dp:
        return model
    layers = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    if not layers and not parallel_dims.pp_enabled:  # a pipeline stage may hold none (see _check_pp_config)
        raise ValueError(f"{API}.parallelize_matrixfsdp: the model has no layers")
    # Activation checkpointing wraps each layer; its recomputation runs the *inner* module (the
    # wrapper's hooks do not fire), so the inner module is the block we shard.
    layers = [_block_of(layer) for layer in layers]
    block_types = tuple({type(layer) for layer in layers})
    # As torchtitan's own apply_fsdp (models/{llama3,qwen3}/parallelize.py, partial_dtensor path):
    # HSDP is the 2-D ("dp_replicate", "fsdp") mesh, dimension 0 replicating, 1 sharding.
    mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else "fsdp")
    # With TP the owners are planned over the ("fsdp", "tp") view of the same world mesh, with HSDP
    # the 3-D ("dp_replicate", "fsdp", "tp") one (global shapes; tp taken from it), and fully_shard
    # runs on the data-parallel mesh as without TP.
    plan_mesh = parallel_dims.get_mesh(["dp_replicate", "fsdp", "tp"] if parallel_dims.dp_replicate_enabled
                                       else ["fsdp", "tp"]) if tp else mesh
    # Under EP the expert stacks are already whole experts per rank ("ep" Shard(0), efsdp == 1):
    # the plan records them as they are (one plan, one digest, dense weights balanced around
    # them) and fully_shard leaves them alone: their gradients are complete after backward (the
    # token all-to-alls bring every token of an expert to its rank), nothing to reduce.
    # block_types None: a pipeline stage without decoder layers is planned as its root alone
    rule = _stage_rule(model) if parallel_dims.pp_enabled else DEFAULT_RULE
    if per_head:  # the attention projections per head (the optimizer container splits them alike)
        rule = dataclasses.replace(rule, heads=head_splits(model))
    plan = plan_owners(model, plan_mesh, block_types=block_types or None, policy=policy, optimizer=plan_optimizer,
                       replica_step=replica_step, matrix_rule=rule)
    ep_stacks = {n: p for n, p in model.named_parameters() if ep and isinstance(p, DTensor)
                 and plan[n].placement == "experts"}
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[training.mixed_precision_param],
                              reduce_dtype=_DTYPES[training.mixed_precision_reduce])
    raf = {"default": None, "always": True, "never": False}[parallelism.fsdp_reshard_after_forward]
    ignored = set(ep_stacks.values())
    for layer in layers:
        fully_shard(layer, mesh=mesh, plan=plan, mp_policy=mp, reshard_after_forward=raf,
                    collectives=collectives, ignored_params=ignored)
    fully_shard(model, mesh=mesh, plan=plan, mp_policy=mp,
                reshard_after_forward=False if raf is None else raf, collectives=collectives,
                ignored_params=ignored)
    for name, p in ep_stacks.items():  # the same rows, described as the plan's expert stack
        adopt_expert_stack(model, name, p, plan[name].experts, plan[name].splits)
    model.set_gradient_divide_factor(1.0)  # type: ignore[attr-defined]
    _redirect_param_init(model)
    return model


def _check_pp_config(model: nn.Module, parallel_dims: Any) -> None:
    """Pipeline parallelism: torchtitan's ``pipeline_llm`` calls the parallelize_fn once per model
    part (a stage: a deep copy of the model without the other stages' modules), so owners are
    planned per stage over that stage's ``"fsdp"`` mesh and each stage checks its own plan digest
    in its own data-parallel group (no collective of ``fully_shard``'s initialization spans the
    pipeline). A stage torchtitan gives no decoder layer (only the embedding, or the norm and
    head; torchtitan's rule is one *effective* layer per stage) is sharded as a root alone; one
    without any matrix steps everything element-wise. Refused: what would span stages."""
    where = f"{API}.parallelize_matrixfsdp"
    if getattr(model, "enable_weight_tying", False):  # torchtitan's own config check refuses it too
        raise ValueError(f"{where}: tied embeddings (enable_weight_tying=True) with pipeline parallelism "
                         f"(parallelism.pipeline_parallel_degree={parallel_dims.pp}): the tied weight would "
                         "live in two stages; set enable_weight_tying=False or pipeline_parallel_degree=1")
    if not pp_schedules_take_microbatches():
        raise ValueError(f"{where}: pipeline parallelism (parallelism.pipeline_parallel_degree={parallel_dims.pp}) "
                         f"needs torch's PipelineSchedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...), which "
                         f"torchtitan's Trainer calls and torch {torch.__version__} lacks (torch 2.15 has it; 2.11 and 2.13 not); "
                         "upgrade torch or set pipeline_parallel_degree=1")
    if parallel_dims.ep_enabled:
        raise ValueError(f"{where}: expert parallelism (parallelism.expert_parallel_degree={parallel_dims.ep}) "
                         f"with pipeline parallelism (parallelism.pipeline_parallel_degree={parallel_dims.pp}) "
                         "is not supported; set one of them to 1")


def _apply_cp(model: nn.Module, parallel_dims: Any) -> None:
    """Context parallelism as torchtitan's ``parallelize_{llama,qwen3}`` apply it on the
    ``partial_dtensor`` path: each layer's inner attention forward is wrapped for the ``"cp"``
    mesh (before ``model.parallelize``, so TP's local_map boundary encloses it). Nothing else
    changes for matrixfsdp: torchtitan's ``"fsdp"`` mesh already folds ``cp`` into ``dp_shard``
    (``dp_shard * cp`` ranks), so owners are planned over it and each CP rank's gradient of its
    sequence shard is summed into the owner's, as FSDP2's reduce-scatter over that mesh does."""
    from torchtitan.distributed.context_parallel import apply_cp_to_forward

    layers = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    if layers:  # a pipeline stage may hold no layer
        apply_cp_to_forward([layer.attention.inner_attention for layer in layers], parallel_dims.get_mesh("cp"))


def _stage_rule(model: nn.Module) -> MatrixRule:
    """The routing rule of a pipeline stage: the whole model's vocabulary size counts for the
    output-head test (a weight with that many rows steps element-wise, as in the unsplit model,
    whose embedding this stage may lack); torchtitan's model parts keep the whole config."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "tok_embeddings", None),
                                                          "num_embeddings", None)
    return MatrixRule(vocab_sizes=(int(vocab),)) if vocab else DEFAULT_RULE


def pp_schedules_take_microbatches() -> bool:
    """Whether torch's pipeline schedules take microbatch lists in ``step(arg_mbs=...)``, as
    torchtitan 0.3's ``pp_forward_backward_step`` passes them (older torch splits unknown keywords
    as model inputs and fails inside the schedule)."""
    import inspect

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return "arg_mbs" in inspect.signature(PipelineScheduleSingle.step).parameters


def _block_of(layer: nn.Module) -> nn.Module:
    """The module matrixfsdp shards for a torchtitan layer: the inner module of an activation
    checkpointing wrapper (its recomputation runs the inner module, without the wrapper's hooks)."""
    return getattr(layer, "_checkpoint_wrapped_module", layer)


def _apply_compile(model: nn.Module, compile_config: Any, parallel_dims: Any) -> None:
    """torchtitan's ``apply_compile``: each layer compiled in place, ``fullgraph=True``. A layer
    wrapped by activation checkpointing is compiled inside its wrapper (the block matrixfsdp
    shards, see below): compiling the wrapper would put the block's forward hooks inside
    dynamo's checkpoint operator, which cannot run them eagerly."""
    from torchtitan.distributed.compile import apply_compile

    inner = nn.ModuleDict({name: _block_of(layer) for name, layer in model.layers.named_children()})
    shim = nn.Module()
    shim.layers = inner  # torchtitan's apply_compile reads model.layers and model.modules()
    apply_compile(shim, compile_config=compile_config, parallel_dims=parallel_dims)


def _refuse_cpu_offload() -> None:
    """[Note: CPU offload] FSDP2's ``CPUOffloadPolicy`` keeps each shard on the host and copies it
    to the device for compute. Under owners the offloaded state would be whole matrices and their
    optimizer state on the owner's host, stepped there or streamed to the device; that runtime
    is not built, and it could not be verified here: on the CPU-only machines matrixfsdp is
    tested on, host and device are one memory, so an offload test would pass without moving a
    byte. Refused rather than silently ignored."""
    raise ValueError(
        f"{API}.parallelize_matrixfsdp: training.enable_cpu_offload=True (FSDP2's CPUOffloadPolicy) is "
        "not supported: matrixfsdp keeps parameters, gradients and optimizer state on the device. "
        "Each rank already holds the optimizer state of only the matrices it owns (about 1/W of "
        "it); to fit more, raise parallelism.data_parallel_shard_degree or enable activation "
        "checkpointing (activation_checkpoint.mode='full'), and set training.enable_cpu_offload=False"
    )


def _check_ep_config(parallel_dims: Any) -> None:
    """Expert parallelism where each EP rank's experts are its own (``efsdp == 1``: EP spans the
    whole data-parallel shard group), without replicas or TP."""
    efsdp = parallel_dims.get_mesh("efsdp").size()
    problems = []
    if efsdp != 1:
        problems.append(f"expert_parallel_degree={parallel_dims.ep} leaves an expert-FSDP group of {efsdp} "
                        f"ranks (efsdp = dp_shard * tp / ep); set expert_parallel_degree to the data-parallel "
                        f"shard degree ({parallel_dims.dp_shard * parallel_dims.tp}), or 1 (matrixfsdp then "
                        "owns the experts itself, balanced with the dense weights)")
    if parallel_dims.dp_replicate_enabled:
        problems.append("HSDP (data_parallel_replicate_degree > 1) with expert parallelism; set "
                        "data_parallel_replicate_degree=1 or expert_parallel_degree=1")
    if parallel_dims.tp_enabled:
        problems.append("tensor parallelism with expert parallelism; use one of them")
    if problems:
        raise ValueError(f"{API}.parallelize_matrixfsdp: expert parallelism is supported where every EP "
                         f"rank owns its experts whole: {'; '.join(problems)}")


def _refuse_quantized_linears(model: nn.Module, parallel_dims: Any) -> None:
    """torchtitan's Float8/MXFP8/NVFP4 converters: never run under matrixfsdp (they need CUDA,
    SM89 or later for float8, and matrixfsdp is tested on CPUs; torchao's float8 all-gather
    extends FSDP2's sharded parameters, which owners are not); with TP their weights would also
    be TP-sharded DTensors inside matrixfsdp's fully_shard."""
    quantized = _quantized_linear_types()
    qfqns = [fqn for fqn, m in model.named_modules() if quantized and isinstance(m, quantized)]
    if qfqns:
        tp = parallel_dims.tp if parallel_dims.tp_enabled else 1
        raise ValueError(
            f"{API}.parallelize_matrixfsdp: quantized linears (Float8/MXFP8/NVFP4 model converters, e.g. "
            f"{qfqns[0]!r}) with parallelism.tensor_parallel_degree={tp} are not supported: matrixfsdp "
            "has not run them (they need CUDA; its tests run on CPUs), and torchao's float8 all-gather "
            "extends FSDP2's sharded parameters, not owned ones; drop the converter from the "
            "model_spec (model_registry(..., converters=[]))"
        )


def _retie_embeddings(model: nn.Module) -> None:
    """``Module.parallelize`` registers a new DTensor parameter on each module, so a tied
    embedding (``enable_weight_tying``: ``tok_embeddings.weight is lm_head.weight``) comes out as
    two parameters with the same layout (``Shard(0)`` on "tp"). torchtitan re-ties them only in
    ``init_states``, after its ``fully_shard``; matrixfsdp's ``fully_shard`` must see the one
    shared parameter (otherwise the embedding's copy is sharded on its own and never
    initialized, ``skip_param_init``), so tie them again here, as the unparallelized model is."""
    emb, head = getattr(model, "tok_embeddings", None), getattr(model, "lm_head", None)
    if not getattr(model, "enable_weight_tying", False) or emb is None or head is None:
        return
    if emb.weight is not head.weight:
        if tuple(emb.weight.placements) != tuple(head.weight.placements):  # type: ignore[union-attr]
            raise ValueError(f"{API}.parallelize_matrixfsdp: the tied tok_embeddings/lm_head weights "
                             f"were parallelized differently: {emb.weight.placements} vs "
                             f"{head.weight.placements}")  # type: ignore[union-attr]
        emb.weight = head.weight


def _quantized_linear_types() -> tuple[type, ...]:
    """torchtitan's quantized Linear classes that exist in this install (torchao-backed ones are
    ``None`` without torchao)."""
    from torchtitan.components.quantization import float8, mx, nvfp4

    found = (getattr(float8, "Float8Linear", None), getattr(mx, "MXFP8Linear", None),
             getattr(nvfp4, "NVFP4Linear", None))
    return tuple(t for t in found if isinstance(t, type))


def _redirect_param_init(model: nn.Module) -> None:
    """Make torchtitan's per-parameter initializers run on full tensors (see the module doc)."""
    for m in model.modules():
        _redirect_reset_parameters(m)
        orig = getattr(m, "_init_param", None)
        if orig is None or getattr(orig, "_matrixfsdp", False):
            continue

        def _init_param(self: nn.Module, name: str, param: nn.Parameter, _orig: Any = orig) -> None:
            fn = (getattr(self, "_param_init", None) or {}).get(name)
            if not isinstance(param, DTensor) or getattr(fn, "__name__", "") == "skip_param_init":
                _orig(name, param)  # e.g. a tied embedding: initialized through its other site
                return
            local = param._local_tensor
            full = torch.empty(tuple(param.shape), dtype=param.dtype, device=local.device)
            with torch.no_grad():
                _orig(name, full)
                set_full_(param, full)

        bound = types.MethodType(_init_param, m)
        bound.__func__._matrixfsdp = True  # type: ignore[attr-defined]
        m._init_param = bound  # type: ignore[method-assign]


def _redirect_reset_parameters(m: nn.Module) -> None:
    """torchtitan falls back to ``reset_parameters()`` for modules without ``param_init``
    (protocols/module.py ``_init_self_parameters``); run it on full plain tensors too, so random
    initializers draw alike on every rank."""
    orig = getattr(m, "_init_self_parameters", None)
    if orig is None or getattr(orig, "_matrixfsdp", False):
        return

    def _init_self_parameters(self: nn.Module, _orig: Any = orig) -> None:
        own = [(n, p) for n, p in self._parameters.items() if isinstance(p, DTensor)]
        if getattr(self, "_param_init", None) is not None or not own:
            _orig()
            return
        saved = dict(self._parameters)
        try:
            for n, p in own:
                full = torch.empty(tuple(p.shape), dtype=p.dtype, device=p._local_tensor.device)
                self._parameters[n] = nn.Parameter(full, requires_grad=p.requires_grad)
            with torch.no_grad():
                _orig()
            fulls = {n: self._parameters[n].detach() for n, _ in own}
        finally:
            self._parameters.update(saved)
        with torch.no_grad():
            for n, p in own:
                set_full_(p, fulls[n])

    bound = types.MethodType(_init_self_parameters, m)
    bound.__func__._matrixfsdp = True  # type: ignore[attr-defined]
    m._init_self_parameters = bound  # type: ignore[method-assign]


@torch.no_grad()
def _clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                     foreach: bool | None = None, pp_mesh: Any = None, ep_enabled: bool = False) -> torch.Tensor:
    """torchtitan's ``clip_grad_norm_`` signature; matrixfsdp's clipping when matrixfsdp
    parameters are involved (torch's total norm cannot combine gradients on different owner
    meshes; with ``pp_mesh`` the stages' norms are combined over it), torchtitan's own otherwise."""
    from torchtitan.distributed import utils as dist_utils

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    # expert parallelism included: its stacks are whole experts per rank, each gradient on
    # exactly one rank, which is what matrixfsdp's clip sums
    if any(_is_matrixfsdp(p, pp_mesh is not None) for p in params):
        return _mfsdp_clip(params, max_norm, norm_type, error_if_nonfinite, pp_mesh=pp_mesh)
    return dist_utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)


def _is_matrixfsdp(p: torch.Tensor, pipelined: bool) -> bool:
    """Whether ``p`` is a matrixfsdp parameter. Under pipeline parallelism every stage must
    choose the same clip (the norm is all-reduced over the pipeline mesh), and a stage without an
    owned matrix still holds ``fully_shard``'s evenly sharded parameters: those count too."""
    if owned_of(p) is not None or expert_stack_of(p) is not None:
        return True
    return pipelined and getattr(p, FQN_ATTR, None) is not None


class _DistUtils:
    """``torchtitan.distributed.utils`` as :class:`MatrixTrainer`'s ``train_step`` sees it: every
    name is torchtitan's (read at each use, so patches of the module apply), but
    ``clip_grad_norm_``."""

    clip_grad_norm_ = staticmethod(_clip_grad_norm_)

    def __getattr__(self, name: str) -> Any:
        from torchtitan.distributed import utils as dist_utils

        return getattr(dist_utils, name)


class _TrainerGlobals(dict):
    """The globals of torchtitan's ``trainer`` module, read live, with ``overrides`` in front (a
    function whose globals are a dict subclass looks names up with ``__getitem__``)."""

    def __init__(self, module: types.ModuleType, **overrides: Any):
        super().__init__(overrides)
        self._module = module

    def __missing__(self, key: str) -> Any:
        return self._module.__dict__[key]


def _with_dist_utils(fn: Any) -> Any:
    """``fn``'s code with ``dist_utils`` bound to :class:`_DistUtils` for this function alone."""
    import sys

    if "dist_utils" not in fn.__code__.co_names:
        raise ImportError(
            f"{API}: torchtitan's {fn.__qualname__} does not call dist_utils.clip_grad_norm_ as "
            "torchtitan 0.3.x does; matrixfsdp.titan cannot route its gradient clipping"
        )
    scope = _TrainerGlobals(sys.modules[fn.__module__], dist_utils=_DistUtils())
    out = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__, out.__doc__, out.__module__ = fn.__qualname__, fn.__doc__, __name__
    return out


class MatrixTrainer(Trainer):
    """torchtitan's ``Trainer`` (what :func:`with_matrixfsdp`'s config builds), whose gradient
    clipping goes to :func:`matrixfsdp.clip_grad_norm_` for matrixfsdp's parameters.

    torchtitan's ``Trainer.train_step`` clips with ``dist_utils.clip_grad_norm_`` (a module-level
    name of ``torchtitan/trainer.py``), which cannot combine gradients owned on different one-rank
    meshes. This class runs the very same ``train_step`` code with that one name resolved to
    :func:`_clip_grad_norm_` (torchtitan's own for models without matrixfsdp parameters;
    matrixfsdp's otherwise, its norm all-reduced over the pipeline mesh too under PP); nothing of torchtitan is replaced, for other trainers
    in the process or at all. Build it from ``MatrixTrainer.Config`` (a ``Trainer.Config``).
    Under pipeline parallelism each ``pp_forward_backward_step`` reduces once per block, as FSDP2
    under torch's schedules does, instead of once per microbatch (see :meth:`pp_forward_backward_step`).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    train_step = _with_dist_utils(Trainer.train_step)

    def pp_forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        """torchtitan's, with the microbatches' gradients accumulated unreduced and reduced once per
        block at the end (``set_requires_gradient_sync(False)``, then
        ``reduce_accumulated_grads()``). torch's schedules run one backward per microbatch and
        call FSDP2's controls for that only on torch ``FSDPModule``s; without this every
        microbatch would reduce. The sums are the same (torchtitan normalizes by the global token
        count, summed gradients)."""
        parts = [m for m in self.model_parts if isinstance(m, MatrixFSDPModule)]
        for m in parts:
            m.set_requires_gradient_sync(False)
        try:
            loss = super().pp_forward_backward_step(**kwargs)
        finally:
            for m in parts:
                m.set_requires_gradient_sync(True)
        for m in parts:  # the same parts and blocks on every rank of a stage
            m.reduce_accumulated_grads()
        return loss


# ================================================================================ optimizers
#: the keys torchtitan's optimizer log shows (``OptimizersContainer._log_optimizer``)
_LOGGED_KEYS = ("lr", "weight_decay", "betas", "eps", "momentum", "nesterov", "fused", "foreach")


def logged_group_kwargs(group: dict[str, Any]) -> dict[str, Any]:
    """The settings of a matrixfsdp param group that its rule reads, under torchtitan's log keys:
    for an AdamW group (``algorithm="adamw"``) the ``adamw_*`` lr, weight decay, betas and eps it
    steps with (lr and weight decay falling back to the group's); for a matrix group the keys
    torchtitan logs."""
    if group.get("algorithm") == "adamw":
        out = {}
        for key in ("lr", "weight_decay", "betas", "eps"):  # adamw_lr / _weight_decay None: the group's
            v = group.get(f"adamw_{key}")
            if v is None:
                v = group.get(key) if key in ("lr", "weight_decay") else None
            if v is not None:
                out[key] = v
        return out
    return {k: group[k] for k in _LOGGED_KEYS if k in group}


class MatrixOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also knows ``"Muon"``, ``"Shampoo"`` and ``"SOAP"``
    (``matrixfsdp.optim``). Each configured group of a matrix optimizer is split in two: the
    parameters the plan owns as whole matrices (the matrix rule) and the rest (AdamW with the
    group's ``adamw_lr``/``adamw_*`` settings as its ``lr``/...), so torchtitan's LR schedule,
    which scales each group's ``lr``, applies to both.

    Example::

        MatrixOptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="Muon",
            optimizer_kwargs={"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 3e-4})])
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        implementation: str = "for-loop"  # matrixfsdp's optimizers ignore fused/foreach

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torchtitan's flat-state load restores only keys present in the live state after its
        state-initialization step; state our optimizers create later (Shampoo's inverse roots)
        would be dropped. Create those keys first (zeros; an all-zero placeholder that stays
        unloaded is discarded again by the optimizer), then load."""
        from torchtitan.components.optimizer.utils import init_optim_state, load_flat_optim_state_dict

        for opt in self.optimizers:
            init_optim_state(opt)
            for st in opt.state.values():
                for key, dep in getattr(opt, "_state_placeholders", {}).items():
                    if key not in st and dep in st:
                        st[key] = torch.zeros_like(st[dep])
            load_flat_optim_state_dict(opt, state_dict)

    def _log_optimizer(self, optimizer: Any, part_idx: int, patterns: list[str]) -> None:
        """torchtitan's log line per param group, with what each group's rule reads: the AdamW
        group of a matrix optimizer shows its ``adamw_*`` betas and eps, not the matrix rule's
        momentum and nesterov (which its group carries but the AdamW rule ignores)."""
        if type(optimizer).__name__ not in _MATRIX_OPTIMIZERS:
            return OptimizersContainer._log_optimizer(self, optimizer, part_idx, patterns)
        from torchtitan.tools.logging import logger

        for group, pattern in zip(optimizer.param_groups, patterns):
            logger.info(f"Optimizer {type(optimizer).__name__} (model_part={part_idx}): "
                        f"{len(group['params'])} params [{pattern}] {logged_group_kwargs(group)}")

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Any:
        if name in _MATRIX_OPTIMIZERS:
            return _MATRIX_OPTIMIZERS[name]
        return OptimizersContainer._resolve_optimizer_factory(name)

    @staticmethod
    def _build_param_groups(model: nn.Module, param_group_configs: list, impl_kwargs: dict) -> tuple:
        groups, patterns = OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)
        for name in list(groups):
            if name not in _MATRIX_OPTIMIZERS:
                continue
            split_groups, split_patterns = [], []
            for g, pat in zip(groups[name], patterns[name]):
                # with_matrixfsdp(per_head=True): per-head matrices in groups of their head count
                heads_rule = MatrixRule(heads=head_splits(model)) if g.pop("per_head", False) else None
                sharded = any(isinstance(m, MatrixFSDPModule) for m in model.modules())
                kinds = DEFAULT_RULE.kinds(model) if not sharded else {}
                lost = [n for n, p in zip(g["param_names"], g["params"])
                        if expert_rows(p) is not None and expert_stack_of(p) is None]
                if lost:  # it would go to AdamW silently
                    raise RuntimeError(
                        f"{API}.MatrixOptimizersContainer: expert stacks {lost} lost their expert-stack "
                        "metadata after parallelize_matrixfsdp (a parameter swap outside matrixfsdp), "
                        "so they would be stepped element-wise by AdamW; build the optimizer from the "
                        "model as parallelize_matrixfsdp (and torch's to_empty/to) left it")
                is_matrix = [planned_kind(p) in ("matrix", "experts") if sharded
                             else kinds[n].kind in ("matrix", "experts") for n, p in zip(g["param_names"], g["params"])]
                heads = [heads_rule.heads_of(n) if heads_rule is not None and m and p.ndim == 2 else 1
                         for n, p, m in zip(g["param_names"], g["params"], is_matrix)]
                for want, algo, h in [(True, "auto", h) for h in sorted(set(heads))] + [(False, "adamw", 1)]:
                    idx = [i for i, m in enumerate(is_matrix) if m == want and (not want or heads[i] == h)]
                    if not idx:
                        continue
                    ng = {k: v for k, v in g.items() if k not in ("params", "param_names")}
                    ng["params"] = [g["params"][i] for i in idx]
                    ng["param_names"] = [g["param_names"][i] for i in idx]
                    ng["algorithm"] = algo
                    if h > 1:
                        ng["heads"] = h
                    if algo == "adamw":
                        for key in ("lr", "weight_decay"):
                            if ng.get(f"adamw_{key}") is not None:
                                ng[key] = ng.pop(f"adamw_{key}")
                            ng.pop(f"adamw_{key}", None)
                    split_groups.append(ng)
                    split_patterns.append(f"{pat} [{'element-wise (AdamW)' if not want else 'matrices'}"
                                          f"{f', {h} heads' if h > 1 else ''}]")
            groups[name], patterns[name] = split_groups, split_patterns
        return groups, patterns


# ================================================================================ configs
def with_matrixfsdp(
    config: Any,
    *,
    optimizer: str = "Muon",
    lr: float = 0.02,
    weight_decay: float = 0.01,
    adamw_lr: float | None = None,
    adamw_weight_decay: float | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    policy: str = "balanced",
    collectives: str = "all_to_all",
    replica_step: str = "auto",
    per_head: bool = False,
) -> Any:
    """Return ``config`` (a torchtitan ``Trainer.Config``) converted to train with matrixfsdp: a
    ``MatrixTrainer.Config``, which builds a :class:`MatrixTrainer`.

    ``optimizer`` is ``"Muon"``, ``"Shampoo"`` or ``"SOAP"`` with ``lr``/``weight_decay`` for the
    matrices and ``adamw_lr``/``adamw_weight_decay`` for everything else (``adamw_lr=None``: the
    ``lr`` of the source config's Adam/AdamW group, an error if it has none;
    ``adamw_weight_decay=None``: ``weight_decay``);
    ``optimizer_kwargs`` adds further keyword arguments (e.g. ``{"ns_dtype": torch.float32}``).
    ``policy`` and ``collectives`` go to ``plan_owners`` and ``fully_shard``; ``replica_step``
    (``"auto"``, ``"repeat"`` or ``"split"``) to ``plan_owners`` for HSDP configs
    (``parallelism.data_parallel_replicate_degree > 1``; unused otherwise). ``per_head=True``
    (Muon only): per-head Muon on the attention projections, head counts from the model's
    attention modules (``MatrixRule(heads=head_splits(model))`` in the plan and the optimizer's
    groups; docs/optimizers.md, "Per-head Muon"). See the module documentation for every field
    this changes.

    Example::

        config = with_matrixfsdp(qwen3_14b(), optimizer="Muon", lr=0.02, adamw_lr=3e-4)
    """
    if optimizer not in _MATRIX_OPTIMIZERS:
        raise ValueError(f"{API}.with_matrixfsdp: optimizer must be one of {sorted(_MATRIX_OPTIMIZERS)}, "
                         f"got {optimizer=!r}")
    if config.model_spec is None:
        raise ValueError(f"{API}.with_matrixfsdp: the config has no model_spec")
    from ..planner.owners import REPLICA_STEPS

    if per_head and optimizer != "Muon":
        raise ValueError(f"{API}.with_matrixfsdp: per_head=True is per-head Muon; it needs optimizer='Muon', "
                         f"got {optimizer=!r}")
    if replica_step not in REPLICA_STEPS:
        raise ValueError(f"{API}.with_matrixfsdp: replica_step must be one of {list(REPLICA_STEPS)}, "
                         f"got {replica_step=!r}")
    plan_opt = optimizer.lower()
    if adamw_lr is None:
        lrs = [g.optimizer_kwargs["lr"] for g in getattr(config.optimizer, "param_groups", ())
               if g.optimizer_name in ("Adam", "AdamW") and "lr" in g.optimizer_kwargs]
        if not lrs:
            raise ValueError(f"{API}.with_matrixfsdp: pass adamw_lr (the source config has no Adam/AdamW "
                             "group to take it from)")
        adamw_lr = float(lrs[0])
    if not isinstance(config, Trainer.Config) or type(config) not in (Trainer.Config, MatrixTrainer.Config):
        raise ValueError(
            f"{API}.with_matrixfsdp: config must be torchtitan's Trainer.Config (it is converted to "
            f"MatrixTrainer.Config, whose Trainer routes gradient clipping to matrixfsdp's), got "
            f"{type(config).__qualname__}"
        )
    config = copy.deepcopy(config)  # the caller's config (and its sections) stay untouched
    if type(config) is Trainer.Config:
        config = MatrixTrainer.Config(**{f.name: getattr(config, f.name)
                                         for f in dataclasses.fields(config) if f.init})
    config.model_spec = dataclasses.replace(
        config.model_spec,
        parallelize_fn=functools.partial(parallelize_matrixfsdp, policy=policy, plan_optimizer=plan_opt,
                                         collectives=collectives, replica_step=replica_step, per_head=per_head),
    )
    kw: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay, "adamw_lr": adamw_lr,
                          "adamw_weight_decay": adamw_weight_decay, **(optimizer_kwargs or {})}
    if per_head:  # read (and removed) by MatrixOptimizersContainer._build_param_groups
        kw["per_head"] = True
    config.optimizer = MatrixOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=optimizer, optimizer_kwargs=kw)],
    )
    config.parallelism = dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor")
    config.training = dataclasses.replace(config.training, disable_cuda_graphs=True)
    return config


def qwen3_debugmodel_muon() -> Any:
    """torchtitan's ``qwen3_debugmodel`` trained by matrixfsdp with Muon (lr 0.02, AdamW 8e-4)."""
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    return with_matrixfsdp(qwen3_debugmodel(), optimizer="Muon", lr=0.02, adamw_lr=8e-4)
