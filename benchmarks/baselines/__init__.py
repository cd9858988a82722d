"""The implementations compared by ``benchmarks/step_bench.py``: one small class each, one module
per baseline, and the registry :data:`IMPLS` (row name -> class) the runner picks from.

Every implementation trains THE SAME model (``matrixfsdp.Decoder``, seeded init) on the same
synthetic tokens with the same Muon/AdamW hyperparameters (:class:`BenchConfig`):

* 2D hidden weights (``model.layers.*``) get Muon (Newton-Schulz in ``BenchConfig.ns_dtype``: fp32
  by default on CPU/gloo, bf16 on CUDA/nccl; the same dtype in every implementation, see below);
* the embedding, the output head and every non-2D tensor (norms) get AdamW.

Devices: ``Context.device`` (``cpu`` for gloo, ``cuda:<local rank>`` for nccl). The model is
initialized on CPU (seeded, so bitwise the same everywhere) and moved to the device before any
wrapping; the tokens are drawn on CPU and moved likewise.

Interface (what the runner calls, in this order)::

    impl = Impl(cfg, ctx); impl.setup()
    loss = impl.forward(tokens); impl.backward(loss)     # == impl.forward_backward(tokens)
    impl.step(); impl.zero_grad()
    impl.named_parameters()   # for the parity gather (FQNs as in the plain model)
    impl.param_tensors(), impl.grad_tensors(), impl.optimizers(), impl.scratch_tensors()

Numerics: ``matrixfsdp.optim.Muon(..., ns_dtype=cfg.ns_torch_dtype)`` (bitwise ``torch.optim.Muon``
apart from the Newton-Schulz dtype; AdamW route bitwise ``torch.optim.AdamW(foreach=False)``) is
the optimizer wherever it applies; the gather and DistMuon baselines reuse its Newton-Schulz and
learning-rate adjustment (DistMuon's own NS kernel is the one exception: hard-wired to bf16 in
torchtitan 0.3.0; on CPU it is patched to ``ns_dtype`` with the rest of
:func:`patch_torchtitan_for_cpu`; on CUDA it runs unpatched when ``ns_dtype`` is bf16, otherwise
only its NS dtype is patched (:func:`patch_torchtitan_ns_dtype`), and the row's notes say which).

Modules: ``core`` (config, context, model and data, routing, the :class:`Impl` protocol, step
cost), ``ddp``, ``fsdp2``, ``gather_muon``, ``distmuon`` (torchtitan), ``zero1_owner``,
``zero_redundancy``, ``fully_shard`` and ``replicate`` (matrixfsdp), ``hsdp`` (issue 17), ``tp``
(the TP harness) with ``tp_redundant``, ``tp_shard_local``, ``tp_microgroups`` (issue 18), ``moe``
(``step_bench.py --model moe``: the MoE decoder of ``tests/_moe.py`` with expert stacks, issue 26).
"""

from __future__ import annotations

import os
import sys

try:
    import matrixfsdp  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
    import matrixfsdp  # noqa: F401

from .core import ADAMW_2D, BenchConfig, Context, Impl, batch_for_step, build_model, lm_loss
from .ddp import DDPMuon
from .distmuon import FSDP2DistMuon, patch_torchtitan_for_cpu, patch_torchtitan_ns_dtype
from .fsdp2 import FSDP2AdamW
from .fully_shard import MatrixFSDP, mfsdp_impl
from .gather_muon import FSDP2GatherMuon
from .hsdp import SingleMuon, hsdp_impl
from .moe import MOE_IMPLS
from .replicate import replicate_impl
from .tp_microgroups import TPMicroGroups, TPUnfusedLPT, tp_hosted
from .tp_redundant import TPRedundant
from .tp_shard_local import TPShardLocal
from .zero1_owner import Zero1Owner
from .zero_redundancy import ZeroRedundancyMuon

__all__ = [
    "BenchConfig",
    "Context",
    "Impl",
    "IMPLS",
    "ADAMW_2D",
    "build_model",
    "batch_for_step",
    "lm_loss",
    "patch_torchtitan_for_cpu",
    "patch_torchtitan_ns_dtype",
]

HSDP_IMPLS: tuple[type[Impl], ...] = (
    SingleMuon,
    hsdp_impl("hsdp_adamw", FSDP2AdamW, "torch HSDP: fully_shard(mesh=2-D): reduce-scatter in the shard group, "
              "all-reduce of the shard across replicas"),
    hsdp_impl("hsdp_distmuon", FSDP2DistMuon, "HSDP: DistMuon's all-to-alls and Newton-Schulz within the shard "
              "group (dp_shard), repeated by every replica"),
    hsdp_impl("hsdp_gather_muon", FSDP2GatherMuon, "HSDP: gather-Muon on the shard group, repeated by every replica"),
    mfsdp_impl("mfsdp_repeat", "repeat"),
    mfsdp_impl("mfsdp_split", "split"),
)

TP_IMPLS: tuple[type[Impl], ...] = (TPRedundant, TPMicroGroups, tp_hosted("tp_sequential", False, False),
                                    tp_hosted("tp_unfused", True, True), TPShardLocal, TPUnfusedLPT)

IMPLS: dict[str, type[Impl]] = {
    c.name: c for c in (DDPMuon, FSDP2GatherMuon, FSDP2DistMuon, Zero1Owner, FSDP2AdamW, MatrixFSDP,
                        replicate_impl("replicate_a0", "alpha_balanced", 0.0),
                        replicate_impl("replicate_a0.5", "alpha_balanced", 0.5),
                        replicate_impl("replicate_a1", "alpha_balanced", 1.0),
                        replicate_impl("replicate_naive", "naive_static", 0.0),
                        ZeroRedundancyMuon, *HSDP_IMPLS, *TP_IMPLS, *MOE_IMPLS)
}
