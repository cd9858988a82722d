"""Hugging Face ``transformers.Trainer`` for matrixfsdp models: :class:`MatrixFSDPTrainer`.

A model sharded with :func:`matrixfsdp.fully_shard` (ZeRO-3 owners) or :func:`matrixfsdp.replicate`
(ZeRO-1/2) already owns its placement and gradient reduction, so accelerate must neither wrap it
in DDP (whose initial broadcast refuses matrixfsdp's per-owner meshes) nor shard it again. Stock
``Trainer`` skips the DDP wrap only for accelerate's own FSDP plugin (which would re-shard the
model) and for models transformers sharded at load time; clipping, checkpointing and saving also
have to change, which neither ``optimizers=`` nor a callback can do. So the integration point is
a ``Trainer`` subclass (transformers' advice for sharded setups: "subclass Trainer and override
..."), changing only what sharding changes::

    model = ...                                          # a transformers PreTrainedModel
    plan = matrixfsdp.plan_owners(model, mesh, block_types=(type(model.model.layers[0]),))
    for layer in model.model.layers:
        matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
    matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
    opt = matrixfsdp.optim.Muon(model, lr=0.02, ns_dtype=torch.float32)
    trainer = MatrixFSDPTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                                optimizers=(opt, None))      # None: the scheduler from args
    trainer.train()                                      # or train(resume_from_checkpoint=True)
    trainer.save_model("out/final")                      # every rank; from_pretrained loads it

What differs from ``Trainer``:

* preparation: the model goes through ``Accelerator.prepare_model(evaluation_mode=True)``, which
  applies mixed-precision autocast (``bf16=True``) and nothing else, and is marked prepared, so
  the later ``accelerator.prepare`` leaves it unwrapped (the optimizer is still wrapped);
* gradient accumulation: micro-batches before the last accumulate unreduced gradients
  (``set_requires_gradient_sync(False)``), one reduction per optimizer step, as accelerate does
  for FSDP2;
* ``max_grad_norm`` and the logged ``grad_norm``: :func:`matrixfsdp.clip_grad_norm_`, the norm
  over every rank's gradients (torch's ``clip_grad_norm_``, which Trainer calls, cannot combine
  gradients on different owner meshes);
* checkpoints (``save_strategy``): ``<checkpoint>/dcp``, one :func:`matrixfsdp.checkpoint.save`
  of model and optimizer (every rank writes what it owns), plus Trainer's own scheduler, RNG and
  trainer-state files; ``resume_from_checkpoint`` and ``load_best_model_at_end`` read it back
  with :func:`matrixfsdp.checkpoint.load` (a resume continues bitwise at the same world size;
  Trainer's data skipping and per-rank RNG files assume it). ``python -m matrixfsdp.checkpoint
  export --src <checkpoint>/dcp --dst model.safetensors`` turns one into weights offline;
* ``save_model``: :func:`matrixfsdp.checkpoint.save_pretrained` (gathered on rank 0), loadable
  by ``from_pretrained``. Call it on every rank.

The optimizer must be passed (``optimizers=(opt, scheduler_or_None)``), built on the sharded
model; Trainer's default AdamW over parameter groups is not built here.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from .. import checkpoint as _ckpt
from ..placement.clip import clip_grad_norm_
from .._fully_shard import MatrixFSDPModule
from .._replicate import MatrixReplicateModule

__all__ = ["MatrixFSDPTrainer", "DCP_DIR"]

API = "matrixfsdp.hf_trainer.MatrixFSDPTrainer"
#: The DCP checkpoint inside each ``checkpoint-<step>`` folder.
DCP_DIR = "dcp"


class MatrixFSDPTrainer(transformers.Trainer):
    """``transformers.Trainer`` for a model sharded by matrixfsdp (see the module docstring).

    Same arguments as ``Trainer``; ``optimizers=(optimizer, lr_scheduler)`` must hold an
    optimizer over the sharded model's parameters (``lr_scheduler=None`` builds Trainer's
    scheduler from ``args``). Refused: an unsharded model, ``fp16`` (use ``bf16``),
    ``fp16_full_eval``/``bf16_full_eval``, ``torch_compile``, ``fsdp`` and ``deepspeed``.
    """

    def __init__(self, model: nn.Module | None = None, args: transformers.TrainingArguments | None = None,
                 *pos: Any, optimizers: tuple[Any, Any] = (None, None), **kwargs: Any):
        _check_model(model)
        if pos:
            raise TypeError(f"{API}: pass the arguments after model and args by keyword "
                            f"(data_collator=..., train_dataset=...), got {len(pos)} more positional")
        if kwargs.get("model_init") is not None:
            raise ValueError(f"{API}: model_init is not supported (the model must be sharded before the "
                             "Trainer is built); pass model=")
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError(f"{API}: optimizer_cls_and_kwargs builds the optimizer from parameter groups; "
                             "pass optimizers=(matrixfsdp.optim.Muon(model, ...), None) instead")
        if not isinstance(optimizers, (tuple, list)) or len(optimizers) != 2:
            raise TypeError(f"{API}: optimizers must be a pair (optimizer, lr_scheduler), got {optimizers!r}")
        _check_optimizer(model, optimizers[0])
        if args is not None:
            _check_args(args, model)
        super().__init__(model=model, args=args, optimizers=tuple(optimizers), **kwargs)
        if args is None:
            _check_args(self.args, model)
        # autocast (bf16) and the "prepared" mark, without accelerate's DDP wrap; compile is refused
        prepared = self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
        if prepared is not self.model:
            raise RuntimeError(f"{API}: Accelerator.prepare_model returned a wrapper "
                               f"({type(prepared).__name__}); the model must stay unwrapped")
        self._in_checkpoint = False

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # Placement was checked in __init__. Trainer's model.to("cpu:0") is not a no-op on a
        # fully_shard model: it rebinds evenly sharded parameters away from the runtime's buffers.
        return None

    # ------------------------------------------------------------------ training
    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        # Trainer marks the last micro-batch of each accumulation window with sync_gradients
        sync = self.accelerator.sync_gradients or self.accelerator.gradient_state.plugin_kwargs.get(
            "sync_each_batch", False)
        self.model.set_requires_gradient_sync(bool(sync))
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self.model.set_requires_gradient_sync(True)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            grad_norm = clip_grad_norm_(self.model.parameters(), float("inf"))
        return grad_norm

    # ------------------------------------------------------------------ saving
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self._in_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._in_checkpoint = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """In a checkpoint: the DCP checkpoint ``<output_dir>/dcp`` (model, and optimizer unless
        ``save_only_model``). Otherwise a ``save_pretrained`` folder. Call on every rank."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if self._in_checkpoint:
            opt = None if self.args.save_only_model else _inner(self.optimizer)
            _ckpt.save(os.path.join(output_dir, DCP_DIR), self.model, opt)
            if self.args.should_save:
                self.model.config.save_pretrained(output_dir)
        else:
            _ckpt.save_pretrained(self.model, output_dir)
            if self.args.should_save:
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(output_dir)
                torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is not None:
            raise ValueError(f"{API}: _save(state_dict=...) is not supported: the weights are gathered "
                             "from their owners by matrixfsdp.checkpoint.save_pretrained")
        self.save_model(output_dir, _internal_call=True)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # the optimizer is in <output_dir>/dcp (save_model); the scheduler is the same on every rank
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    # ------------------------------------------------------------------ loading
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        _ckpt.load(_dcp_dir(resume_from_checkpoint), self.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = _dcp_dir(checkpoint)
        has_optim = any(k.startswith(_ckpt.OPTIM_KEY + ".")
                        for k in _ckpt.read_metadata(path, API).state_dict_metadata)
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if not has_optim or not os.path.isfile(sched):  # save_only_model: Trainer starts them afresh too
            return
        # the model is read again with it: matrixfsdp.checkpoint.load takes the model's layout from it
        _ckpt.load(path, self.model, _inner(self.optimizer))
        self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))

    def _load_best_model(self) -> None:
        _ckpt.load(_dcp_dir(self.state.best_model_checkpoint), self.model)


# ====================================================================== checks
def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The user's optimizer inside accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def _dcp_dir(checkpoint: str) -> str:
    path = os.path.join(checkpoint, DCP_DIR)
    if not os.path.isdir(path):
        raise ValueError(f"{API}: {checkpoint!r} holds no {DCP_DIR!r} folder, so it was not written by "
                         f"{API}; resume from a checkpoint-<step> folder this trainer saved")
    return path


def _check_model(model: Any) -> None:
    if not isinstance(model, (MatrixFSDPModule, MatrixReplicateModule)):
        raise TypeError(
            f"{API}: model must be sharded by matrixfsdp at its root (matrixfsdp.fully_shard(model, ...) "
            f"after its blocks, or matrixfsdp.replicate(model, ...)), got {type(model).__name__}")


def _check_optimizer(model: nn.Module, optimizer: Any) -> None:
    if optimizer is None:
        raise ValueError(f"{API}: optimizers=(optimizer, lr_scheduler) needs an optimizer built on the "
                         "sharded model, e.g. (matrixfsdp.optim.Muon(model, lr=0.02), None); got None")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{API}: optimizers[0] must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    mine = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in mine for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise ValueError(f"{API}: {foreign} optimizer parameter(s) are not parameters of the model; build the "
                         "optimizer after sharding (matrixfsdp.fully_shard replaces the parameters)")


def _check_args(args: transformers.TrainingArguments, model: nn.Module) -> None:
    refused = {
        "fp16": "fp16 needs a GradScaler over owner-placed gradients, which this trainer does not run; use bf16=True",
        "fp16_full_eval": "it casts the sharded model; evaluate under bf16=True autocast instead",
        "bf16_full_eval": "it casts the sharded model; evaluate under bf16=True autocast instead",
        "torch_compile": "accelerate would return torch.compile's wrapper of the model, which this trainer "
                         "does not handle",
        "deepspeed": "the model is already sharded by matrixfsdp",
    }
    for name, why in refused.items():
        if getattr(args, name, None):
            raise ValueError(f"{API}: TrainingArguments({name}={getattr(args, name)!r}) is not supported: {why}")
    if args.fsdp:
        raise ValueError(f"{API}: TrainingArguments(fsdp={args.fsdp!r}) is not supported: the model is already "
                         "sharded by matrixfsdp")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if args.world_size != world:
        raise ValueError(f"{API}: TrainingArguments sees world_size={args.world_size} but the process group has "
                         f"{world} ranks; on CPU pass use_cpu=True (and launch with torchrun or set RANK, "
                         "WORLD_SIZE, LOCAL_RANK)")
    want = args.device
    devices = {p.device for p in model.parameters()}
    # Trainer's CPU device is "cpu:0"; the parameters' is "cpu"
    if any(d.type != want.type or (d.type != "cpu" and d.index != want.index) for d in devices):
        raise ValueError(f"{API}: the model's parameters are on {sorted(map(str, devices))} but "
                         f"TrainingArguments.device is {args.device}; move the model before sharding")
