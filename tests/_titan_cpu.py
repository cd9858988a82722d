"""Run torchtitan 0.3.0's ``Trainer`` on CPU with gloo (tests only).

Use inside a ``tests/_harness.py`` pool worker (the process group is already initialized; titan's
``init_distributed`` then skips its own init, ``distributed/utils.py:466-471``)::

    from _titan_cpu import tiny_qwen3_config, run_trainer

    def _worker(tmp):                               # top-level, so the pool can pickle it
        cfg = tiny_qwen3_config(steps=4, dump_folder=tmp)
        return run_trainer(cfg)                     # per-step global average losses

    losses_per_rank = get_pool(2).run(_worker, tmp)

API
---
* :func:`cpu_patches` -- context manager with every monkeypatch titan needs on a CPU-only torch
  (:func:`install_cpu_patches` / :func:`uninstall_cpu_patches` are the idempotent pair behind it).
* :class:`NullTokenizer` -- a file-free ``BaseTokenizer``.
* :class:`SyntheticTokens` -- a ``BaseDataLoader`` over a fixed, seeded *global* batch split by dp
  rank, so a run is independent of the world size.
* :func:`tiny_qwen3_config` -- the stock qwen3 debug ``Trainer.Config`` made tiny and CPU-friendly.
* :func:`run_trainer` / :func:`run_trainer_metrics` -- build, train, close; per-step metrics.

Importing this module must happen *before* anything imports ``torchtitan.models`` /
``torchtitan.trainer`` when ``triton`` is not installed (see :func:`_stub_triton_kernels`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "cpu_patches",
    "install_cpu_patches",
    "uninstall_cpu_patches",
    "NullTokenizer",
    "SyntheticTokens",
    "tiny_qwen3_config",
    "TrainerMetrics",
    "run_trainer",
    "run_trainer_metrics",
]


# ------------------------------------------------------------------------------------------------
# Import-time workaround (must run before torchtitan.models / torchtitan.trainer is imported)
# ------------------------------------------------------------------------------------------------
_KERNELS_MOD = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
    "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
)


def _stub_triton_kernels() -> None:
    """Make ``import torchtitan.trainer`` work without ``triton`` (CPU-only torch has none).

    ``torchtitan/distributed/minimal_async_ep/kernels.py:10-11`` does ``import triton`` at module
    level, and it is imported unconditionally via trainer -> models.common.moe ->
    token_dispatcher.py:17 -> minimal_async_ep/api.py:30. Those are CUDA-only expert-parallel
    kernels that a dense CPU run never calls, so we pre-register a stand-in for *that torchtitan
    module only* (its 8 public names raise if called). We deliberately do not fake ``triton``
    itself: torch caches ``has_triton_package()`` and would then take Triton code paths.
    """
    if _KERNELS_MOD in sys.modules or importlib.util.find_spec("triton") is not None:
        return

    def _make(name: str) -> Callable[..., Any]:
        def _unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{_KERNELS_MOD}.{name}: needs triton/CUDA (stubbed by tests/_titan_cpu.py)")
        _unavailable.__name__ = name
        return _unavailable

    mod = types.ModuleType(_KERNELS_MOD, "CPU stand-in for titan's Triton EP kernels (tests/_titan_cpu.py)")
    for n in _KERNEL_NAMES:
        setattr(mod, n, _make(n))
    mod.__file__ = __file__
    sys.modules[_KERNELS_MOD] = mod


_stub_triton_kernels()

# Safe to import titan from here on.
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import Configurable  # noqa: E402


# ------------------------------------------------------------------------------------------------
# CPU patches
# ------------------------------------------------------------------------------------------------
class _CPUMemoryMonitor:
    """Stand-in for ``components/metrics.py:38`` ``DeviceMemoryMonitor`` (torch.cpu has no memory stats)."""

    device_name = "cpu"
    device_index = 0
    device_capacity = 0
    device_capacity_gib = 0.0

    def get_peak_stats(self) -> Any:
        from torchtitan.components.metrics import DeviceMemStats
        return DeviceMemStats(0, 0, 0, 0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


class _NoSleepTime(types.ModuleType):
    """``time`` for ``torchtitan.trainer`` without the final ``time.sleep(2)`` (trainer.py:1069-1071)."""

    def __init__(self) -> None:
        import time
        super().__init__("time")
        self.__dict__.update({k: v for k, v in vars(time).items() if not k.startswith("__")})
        self.sleep = lambda seconds: None


def _set_pg_timeouts_noop(timeout: Any, parallel_dims: Any) -> None:
    # trainer.py:1061-1067 -> distributed/utils.py:586-587: barrier(device_ids=[torch.cpu.current_device()])
    # and torch.cpu.synchronize; also it would shrink the *harness pool's* default-group timeout for good.
    return None


def _gloo_sum_only(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``distributed/fsdp.py:27-41`` ``disable_fsdp_gradient_division`` (called at fsdp.py:316).

    It sets FSDP2's gradient divide factor to 1.0, which makes torch pick
    ``ReduceOp.PREMUL_SUM(1.0)`` for the fp32 reduce-scatter
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:846-851), and gloo raises "Cannot use
    ReduceOp.PREMUL_SUM with Gloo". ``set_force_sum_reduction_for_comms(True)`` makes it a plain
    SUM followed by a division by 1.0: the same gradients.
    """
    from torch.distributed.fsdp import FSDPModule

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        orig(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    return disable_fsdp_gradient_division


def _full_tensor_init_param(orig: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``Module._init_param`` (protocols/module.py:192-209) to initialize DTensor params whole.

    On CPU there is no DTensor RNG tracker (torch/distributed/tensor/_random.py:43-52: torch.cpu has
    no ``set_rng_state``), so ``nn.init.*`` on a ``Shard(0)`` parameter draws the *local* shape on
    every rank from the same generator state: every rank gets the same rows and the model differs
    from the W=1 model. Here every rank draws the full tensor (same RNG consumption everywhere,
    bitwise the unsharded init) and keeps its own piece. Owned matrixfsdp parameters go through
    ``matrixfsdp.set_full_``; anything else (plain tensors, ``skip_param_init``) is untouched.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torchtitan.models.common.param_init import skip_param_init

    try:
        from matrixfsdp import owned_of, set_full_
    except ImportError:  # pragma: no cover - matrixfsdp is the repo under test
        owned_of = set_full_ = None  # type: ignore[assignment]

    def _init_param(self: Any, name: str, param: torch.nn.Parameter) -> None:
        init = (self._param_init or {}).get(name)
        if not isinstance(param, DTensor) or init is None or init is skip_param_init:
            return orig(self, name, param)
        local = param._local_tensor
        full = torch.empty(tuple(param.shape), dtype=param.dtype, device=local.device)
        init(full)
        with torch.no_grad():
            if owned_of is not None and owned_of(param) is not None:
                set_full_(param, full)  # owner copies all, other ranks nothing
                return
            if param.device_mesh.get_coordinate() is None or local.numel() == 0:
                return  # this rank holds nothing of it
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements)
            local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])

    _init_param._titan_cpu_wrapped = orig  # type: ignore[attr-defined]
    return _init_param


_INSTALLED: list[tuple[Any, str, Any]] | None = None  # (owner, attribute, previous value)
_MISSING = object()


def _setattr(saved: list[tuple[Any, str, Any]], owner: Any, attr: str, value: Any) -> None:
    saved.append((owner, attr, getattr(owner, attr, _MISSING)))
    setattr(owner, attr, value)


def install_cpu_patches(*, full_tensor_init: bool = True, skip_final_sleep: bool = True) -> None:
    """Apply the CPU/gloo monkeypatches (idempotent; undo with :func:`uninstall_cpu_patches`).

    ``full_tensor_init``: W-independent parameter init (see :func:`_full_tensor_init_param`).
    ``skip_final_sleep``: drop rank 0's 2 s sleep at the end of ``Trainer.train``.
    Also sets ``LOCAL_RANK`` (from the process group rank) if unset: ``tools/utils.py:73-75``.
    """
    global _INSTALLED
    if _INSTALLED is not None:
        return
    import torchtitan.components.metrics as titan_metrics
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.utils as titan_dist_utils
    import torchtitan.protocols.module as titan_module
    import torchtitan.tools.utils as titan_utils
    import torchtitan.trainer as titan_trainer

    saved: list[tuple[Any, str, Any]] = []
    # (1) tools/utils.py:54-60 picks "cuda"/torch.cuda on a CPU-only build; every module that did
    # `from torchtitan.tools.utils import device_type, device_module` holds its own copy
    # (distributed/utils.py:30, components/metrics.py:21, distributed/parallel_dims.py:19,
    # tools/profiler.py:21, models/common/token_dispatcher.py:26): trainer.py:297-301 set_device,
    # parallel_dims.py:281-283 init_device_mesh("cuda"), trainer.py:405-407 init device.
    old_type, old_module = titan_utils.device_type, titan_utils.device_module
    if old_type != "cpu":
        for name, mod in list(sys.modules.items()):
            if mod is None or not (name == "torchtitan" or name.startswith("torchtitan.")):
                continue
            d = getattr(mod, "__dict__", {})
            if d.get("device_type") == old_type and isinstance(d.get("device_type"), str):
                _setattr(saved, mod, "device_type", "cpu")
            if d.get("device_module") is old_module:
                _setattr(saved, mod, "device_module", torch.cpu)
    # (2) components/metrics.py:38-50,95-101,343 (and trainer.py:538-546): DeviceMemoryMonitor calls
    # get_device_name/get_device_properties/memory_stats/reset_peak_memory_stats, absent in torch.cpu.
    _setattr(saved, titan_metrics, "build_device_memory_monitor", _CPUMemoryMonitor)
    # (3) distributed/utils.py:567-597 set_pg_timeouts (called at trainer.py:1061-1067): see above.
    _setattr(saved, titan_dist_utils, "set_pg_timeouts", _set_pg_timeouts_noop)
    # (new) distributed/fsdp.py:316 divide factor 1.0 -> PREMUL_SUM reduce-scatter, unsupported by gloo.
    _setattr(saved, titan_fsdp, "disable_fsdp_gradient_division",
             _gloo_sum_only(titan_fsdp.disable_fsdp_gradient_division))
    # (12) DTensor random init on CPU is rank-local (no RNG tracker): draw full tensors instead.
    if full_tensor_init:
        _setattr(saved, titan_module.Module, "_init_param",
                 _full_tensor_init_param(titan_module.Module._init_param))
    # (13) trainer.py:1069-1071: rank 0 sleeps 2 s after training (4 s of a 60 s test budget).
    if skip_final_sleep:
        _setattr(saved, titan_trainer, "time", _NoSleepTime())
    # (4) tools/utils.py:73-75 get_local_device needs LOCAL_RANK (torchrun sets it).
    if "LOCAL_RANK" not in os.environ:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        saved.append((os.environ, "LOCAL_RANK", _MISSING))
        os.environ["LOCAL_RANK"] = str(rank)
    _INSTALLED = saved


def uninstall_cpu_patches() -> None:
    """Undo :func:`install_cpu_patches` (no-op if not installed)."""
    global _INSTALLED
    if _INSTALLED is None:
        return
    for owner, attr, old in reversed(_INSTALLED):
        if owner is os.environ:
            if old is _MISSING:
                os.environ.pop(attr, None)
            else:
                os.environ[attr] = old
        elif old is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, old)
    _INSTALLED = None


@contextlib.contextmanager
def cpu_patches(*, full_tensor_init: bool = True, skip_final_sleep: bool = True) -> Iterator[None]:
    """Context manager around :func:`install_cpu_patches` / :func:`uninstall_cpu_patches`.

    Re-entrant: a nested use inside an active one changes nothing and undoes nothing.
    """
    outer = _INSTALLED is None
    if outer:
        install_cpu_patches(full_tensor_init=full_tensor_init, skip_final_sleep=skip_final_sleep)
    try:
        yield
    finally:
        if outer:
            uninstall_cpu_patches()


# ------------------------------------------------------------------------------------------------
# Tokenizer and data
# ------------------------------------------------------------------------------------------------
class NullTokenizer(BaseTokenizer):
    """A tokenizer that needs no files: bytes modulo ``vocab_size`` (only ``get_vocab_size`` matters)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 256

    def __init__(self, config: Config, *, tokenizer_path: str | None = None, **kwargs: Any):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.eos_id = config.vocab_size - 1

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticTokens(BaseDataLoader):
    """Seeded synthetic token rows, one fixed *global* microbatch at a time, split by dp rank.

    Global microbatch ``m`` is rows ``[m*G, (m+1)*G)`` with ``G = local_batch_size * dp_world_size``;
    dp rank ``r`` gets rows ``m*G + r*b ... + b``. Row ``i`` depends only on ``(seed, i, seq_len,
    vocab_size)``, so an optimizer step sees the same token set whatever the world size (with the
    same global batch). ``pattern="arith"``: each row is ``(start + stride*t) % vocab`` (learnable,
    the loss falls); ``"uniform"``: i.i.d. tokens. Yields ``({"input": x}, labels)`` with
    ``x = row[:-1]``, ``labels = row[1:]``; infinite (``max_microbatches`` to bound it).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0
        vocab_size: int = 256
        pattern: str = "arith"
        max_microbatches: int | None = None

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any = None,
                 seq_len: int, local_batch_size: int, **kwargs: Any):
        if config.pattern not in ("arith", "uniform"):
            raise ValueError(f"SyntheticTokens: unknown pattern {config.pattern!r}")
        self.config = config
        self.dp_world_size = dp_world_size
        self.dp_rank = dp_rank
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.microbatch = 0  # next global microbatch index (checkpointed)

    def _row(self, i: int) -> torch.Tensor:
        c = self.config
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + i)
        n = self.seq_len + 1
        if c.pattern == "uniform":
            return torch.randint(0, c.vocab_size, (n,), generator=g, dtype=torch.int64)
        start = int(torch.randint(0, c.vocab_size, (1,), generator=g))
        stride = int(torch.randint(1, 5, (1,), generator=g))
        return (start + stride * torch.arange(n, dtype=torch.int64)) % c.vocab_size

    def global_batch(self, m: int) -> torch.Tensor:
        """Global microbatch ``m`` as a ``[local_batch_size * dp_world_size, seq_len + 1]`` tensor."""
        g = self.local_batch_size * self.dp_world_size
        return torch.stack([self._row(m * g + j) for j in range(g)])

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        b = self.local_batch_size
        while self.config.max_microbatches is None or self.microbatch < self.config.max_microbatches:
            g = b * self.dp_world_size
            base = self.microbatch * g + self.dp_rank * b
            rows = torch.stack([self._row(base + j) for j in range(b)])
            self.microbatch += 1
            yield {"input": rows[:, :-1].contiguous()}, rows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {"microbatch": self.microbatch, "dp_world_size": self.dp_world_size,
                "local_batch_size": self.local_batch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        rows = state_dict["microbatch"] * state_dict["dp_world_size"] * state_dict["local_batch_size"]
        g = self.local_batch_size * self.dp_world_size
        if rows % g:
            raise ValueError(f"SyntheticTokens: {rows} consumed rows is not a multiple of the "
                             f"global microbatch {g}")
        self.microbatch = rows // g


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------
def tiny_qwen3_config(*, steps: int, global_batch: int = 4, seq_len: int = 32, dump_folder: str,
                      world_size: int | None = None, vocab_size: int = 256, dim: int = 64,
                      n_layers: int = 2, seed: int = 0, num_experts: int = 0) -> Any:
    """torchtitan's ``qwen3_debugmodel()`` made tiny and CPU-runnable; returns a ``Trainer.Config``.

    Changes from the stock debug config (everything else stays as titan sets it):

    * model: ``n_layers`` x (dim 64, 4 heads, 2 kv heads, head_dim 16, ffn 128), vocab 256, tied
      embeddings (as the debug model), fused QKV, SDPA inner attention (FlexAttention would compile
      with inductor: study obstacle 5; SDPA is titan's test-only swap,
      experiments/graph_trainer/common_utils.py:63-71);
    * loss: plain ``CrossEntropyLoss`` (the debug config's ``ChunkedLossWrapper``, which calls
      ``lm_head`` outside the root forward, is the "chunked" variant of tests/integrations/test_titan.py);
    * data: :class:`NullTokenizer`, :class:`SyntheticTokens`; ``hf_assets_path=""``;
    * ``training``: ``global_batch_size=global_batch``, ``local_batch_size=global_batch //
      world_size`` (no gradient accumulation), ``seq_len``, ``steps``, float32 params and reduce,
      CUDA graphs disabled, ``max_norm`` left at titan's default 1.0 (clipping is active);
    * ``parallelism``: ``data_parallel_shard_degree=-1`` (= world size), ``spmd_backend=
      "partial_dtensor"`` (obstacle 9);
    * no activation checkpointing, no compile, checkpointing disabled;
    * LR schedule constant (``warmup_steps=0``, ``decay_ratio=0.0``); AdamW lr 8e-4 as stock;
    * ``debug.seed=seed``, ``debug.deterministic=True``; ``metrics.log_freq=1``; ``comm.trace_buf_size=0``.

    ``num_experts > 0``: Qwen3-MoE layers instead of the dense FFN (torchtitan's
    ``_build_qwen3_moe_layers``: ``num_experts`` ``GroupedExperts`` of hidden ``dim // 2``, top-2
    softmax router, the "standard" token dispatcher, which is local at EP=1 and torchtitan's
    all-to-all under ``parallelism.expert_parallel_degree > 1``).

    ``world_size`` defaults to the initialized process group's size (else 1).
    """
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import (_EMBEDDING_SKIP_INIT, _LINEAR_INIT, _build_qwen3_layers,
                                         _build_qwen3_moe_layers, _qwen3_norm)
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel
    from torchtitan.models.qwen3.model import Qwen3Model

    if world_size is None:
        world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if global_batch % world_size:
        raise ValueError(f"global_batch {global_batch} must be divisible by world_size {world_size}")

    config = qwen3_debugmodel()
    head_dim, n_heads, n_kv_heads = 16, 4, 2
    common = dict(fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                  head_dim=head_dim, attn_backend="flex",
                  rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=max(64, seq_len), theta=1000000.0))
    if num_experts:
        layers = _build_qwen3_moe_layers(moe_hidden_dim=dim // 2, num_experts=num_experts, top_k=2,
                                         moe_comm_backend="standard", **common)
    else:
        layers = _build_qwen3_layers(hidden_dim=2 * dim, **common)
    model = Qwen3Model.Config(  # mirrors models/qwen3/__init__.py _debugmodel, smaller
        vocab_size=vocab_size,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init=_EMBEDDING_SKIP_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=_LINEAR_INIT),
        layers=layers,
    )
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.model_spec = dataclasses.replace(config.model_spec, flavor="tiny_cpu_moe" if num_experts else "tiny_cpu",
                                            model=model)

    config.dump_folder = dump_folder
    config.hf_assets_path = ""
    config.tokenizer = NullTokenizer.Config(vocab_size=vocab_size)
    config.dataloader = SyntheticTokens.Config(seed=seed, vocab_size=vocab_size)
    config.loss = CrossEntropyLoss.Config(global_vocab_size=vocab_size)
    config.activation_checkpoint = None

    t = config.training
    t.steps = steps
    t.seq_len = seq_len
    t.global_batch_size = global_batch
    t.local_batch_size = global_batch // world_size
    t.mixed_precision_param = "float32"
    t.mixed_precision_reduce = "float32"
    t.disable_cuda_graphs = True

    p = config.parallelism
    p.data_parallel_shard_degree = -1
    p.spmd_backend = "partial_dtensor"

    config.compile.enable = False
    config.checkpoint.enable = False
    config.lr_scheduler.warmup_steps = 0
    config.lr_scheduler.decay_ratio = 0.0
    config.metrics.log_freq = 1
    config.comm.trace_buf_size = 0
    config.debug.seed = seed
    config.debug.deterministic = True
    return config


def tiny_deepseek_v3_config(*, steps: int, global_batch: int = 4, seq_len: int = 32, dump_folder: str,
                            world_size: int | None = None, num_experts: int = 4, seed: int = 0) -> Any:
    """torchtitan's DeepSeek-V3 made tiny: 2 layers (the first dense), dim 64, MLA attention
    (kv_lora_rank 32, SDPA inner attention), ``num_experts`` routed ``GroupedExperts`` of hidden 32,
    top-2, one shared expert; everything else as :func:`tiny_qwen3_config` (data, precision,
    schedule, seed)."""
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    import torchtitan.models.deepseek_v3 as dsv3
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    config = tiny_qwen3_config(steps=steps, global_batch=global_batch, seq_len=seq_len, dump_folder=dump_folder,
                               world_size=world_size, seed=seed)
    dim, vocab, rope_dim = 64, 256, 16
    layers = dsv3._build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=rope_dim, v_head_dim=16, mscale=0.70,
        dense_hidden_dim=128, moe_hidden_dim=32, num_experts=num_experts, num_shared_experts=1,
        router_top_k=2, router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=max(64, seq_len),
                                                                    theta=10000.0))
    model = DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=dsv3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=dsv3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=dsv3._output_linear_init(dim)),
        layers=layers, mtp_layers=[])
    for layer in model.layers:  # FlexAttention compiles with inductor: SDPA on CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    spec = dsv3.model_registry("debugmodel")
    config.model_spec = dataclasses.replace(spec, flavor="tiny_cpu_dsv3", model=model)
    return config


# ------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------
@dataclass
class TrainerMetrics:
    """What ``Trainer.train_step`` handed to ``MetricsProcessor.log`` at each logged step."""

    steps: list[int]
    losses: list[float]          # global average loss (sum over ranks of local sum / global tokens)
    max_losses: list[float]      # max over dp ranks of the local average loss
    grad_norms: list[float]      # total grad norm before clipping (clip_grad_norm_'s return value)
    extra: list[dict[str, Any]]  # lr per optimizer/group, n_tokens_seen
    inspected: Any = None        # return value of run_trainer_metrics(..., inspect=fn)


def _snapshot_globals() -> Callable[[], None]:
    """Save process state the Trainer changes for good; return the function that restores it."""
    import torchtitan.distributed.utils as titan_dist_utils
    from torchtitan.models.common.attention import FlexAttention

    det = torch.are_deterministic_algorithms_enabled()
    det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    flex_fn = FlexAttention.__dict__.get("_compiled_flex_attn", _MISSING)
    flex_cfg = dict(FlexAttention.inductor_configs)
    spmd_backend = titan_dist_utils.get_spmd_backend()
    env = dict(os.environ)
    dtype = torch.get_default_dtype()

    def restore() -> None:
        gc.enable()  # tools/utils.py:101-112 GarbageCollection calls gc.disable() (obstacle 11)
        torch.use_deterministic_algorithms(det, warn_only=det_warn)  # distributed/utils.py:200
        torch.utils.deterministic.fill_uninitialized_memory = fill
        if flex_fn is not _MISSING:  # distributed/utils.py:219-236 recompiles it in deterministic mode
            FlexAttention._compiled_flex_attn = flex_fn
        FlexAttention.inductor_configs.clear()
        FlexAttention.inductor_configs.update(flex_cfg)
        titan_dist_utils.set_spmd_backend(spmd_backend)  # trainer.py:318
        for k in set(os.environ) - set(env):  # PYTHONHASHSEED, CUBLAS_WORKSPACE_CONFIG, ...
            del os.environ[k]
        os.environ.update(env)
        torch.set_default_dtype(dtype)

    return restore


def run_trainer_metrics(config: Any, *, inspect: Callable[[Any], Any] | None = None,
                        patches: bool = True, first_step: int = 1) -> TrainerMetrics:
    """Build ``config`` into a Trainer in this process, train, close; return its logged metrics.

    The metrics come from wrapping ``trainer.metrics_processor.log`` (called by
    ``Trainer.train_step``, trainer.py:1009-1015, on every step when ``metrics.log_freq == 1``):
    those are exactly the numbers titan prints, already reduced over the dp ranks, so every rank
    returns the same lists. ``inspect(trainer)`` runs after training, before ``close()``.
    ``patches``: wrap the run in :func:`cpu_patches` (a no-op inside an active one). Process-wide
    state the Trainer changes (gc disabled, deterministic algorithms, ...) is restored afterwards.
    """
    restore = _snapshot_globals()
    rec = TrainerMetrics([], [], [], [], [])
    trainer = None
    ctx = cpu_patches() if patches else contextlib.nullcontext()
    try:
        with ctx:
            trainer = config.build()
            orig_log = trainer.metrics_processor.log

            def log(step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
                    extra_metrics: dict[str, Any] | None = None) -> None:
                rec.steps.append(int(step))
                rec.losses.append(float(global_avg_loss))
                rec.max_losses.append(float(global_max_loss))
                rec.grad_norms.append(float(grad_norm))
                rec.extra.append(dict(extra_metrics or {}))
                orig_log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

            trainer.metrics_processor.log = log
            trainer.train()
            if inspect is not None:
                rec.inspected = inspect(trainer)
    finally:
        try:
            if trainer is not None:
                trainer.close()
        finally:
            del trainer
            restore()
            gc.collect()
    expected = list(range(first_step, first_step + len(rec.steps)))  # > 1 when resuming
    if rec.steps != expected:
        raise RuntimeError(f"run_trainer: logged steps {rec.steps}, expected {expected} "
                           "(metrics.log_freq must be 1)")
    return rec


def run_trainer(config: Any) -> list[float]:
    """Build and train ``config`` in this process; return the per-step global average losses."""
    return run_trainer_metrics(config).losses
