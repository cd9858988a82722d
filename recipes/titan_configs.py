"""torchtitan configs trained by matrixfsdp: Qwen3 0.6B / 8B / 32B with Muon, Shampoo or SOAP,
and a CPU-sized Qwen3 on the Python standard library's source.

GPU clusters (torchtitan's own launcher; the configs are its stock Qwen3 configs -- c4 data, the
Qwen3 tokenizer under ./assets/hf/Qwen3-*, as torchtitan documents -- with the optimizer and the
parallelization replaced by matrixfsdp.titan.with_matrixfsdp)::

    pip install -c constraints.txt -e ".[titan]"
    torchrun --nproc-per-node 8 -m torchtitan.train --module recipes.titan_configs --config qwen3_8b_muon
    torchrun --nnodes 4 --nproc-per-node 8 ... --config qwen3_32b_soap --training.steps 3000

CPU (2 processes, a tiny Qwen3, byte tokens, no downloads; see recipes/titan_cpu.py for the three
shims torchtitan 0.3 needs on a CPU-only machine)::

    torchrun --nproc-per-node 2 recipes/titan_cpu.py --training.steps 50

Config names: ``qwen3_{0_6b,8b,32b}_{muon,shampoo,soap}``, ``qwen3_cpu_muon`` and ``qwen3_moe_cpu_muon``.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

from matrixfsdp.titan import with_matrixfsdp

#: (matrix lr, optimizer_kwargs) per optimizer; the AdamW rate of the other parameters comes
#: from the source config (3e-4 / 8e-4 in torchtitan's Qwen3 configs).
OPTIMIZERS: dict[str, tuple[float, dict[str, Any]]] = {
    "Muon": (0.02, {}),
    "Shampoo": (3e-3, {"precondition_frequency": 20, "start_preconditioning_step": 20}),
    "SOAP": (3e-3, {"precondition_frequency": 10}),
}


def _convert(config: Any, optimizer: str) -> Any:
    lr, kwargs = OPTIMIZERS[optimizer]
    return with_matrixfsdp(config, optimizer=optimizer, lr=lr, optimizer_kwargs=kwargs)


def _qwen3_8b() -> Any:
    """torchtitan 0.3 has no plain ``qwen3_8b`` config: its 14B config with the 8B model."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.qwen3 import model_registry
    from torchtitan.models.qwen3.config_registry import qwen3_14b

    config = qwen3_14b()
    config.model_spec = model_registry("8B")
    config.loss = CrossEntropyLoss.Config(global_vocab_size=config.model_spec.model.vocab_size)
    config.hf_assets_path = "./assets/hf/Qwen3-8B"
    return config


def _base(name: str) -> Any:
    from torchtitan.models.qwen3 import config_registry as reg

    return {"0_6b": reg.qwen3_0_6b, "8b": _qwen3_8b, "32b": reg.qwen3_32b}[name]()


def qwen3_0_6b_muon() -> Any: return _convert(_base("0_6b"), "Muon")          # noqa: E704
def qwen3_0_6b_shampoo() -> Any: return _convert(_base("0_6b"), "Shampoo")    # noqa: E704
def qwen3_0_6b_soap() -> Any: return _convert(_base("0_6b"), "SOAP")          # noqa: E704
def qwen3_8b_muon() -> Any: return _convert(_base("8b"), "Muon")              # noqa: E704
def qwen3_8b_shampoo() -> Any: return _convert(_base("8b"), "Shampoo")        # noqa: E704
def qwen3_8b_soap() -> Any: return _convert(_base("8b"), "SOAP")              # noqa: E704
def qwen3_32b_muon() -> Any: return _convert(_base("32b"), "Muon")            # noqa: E704
def qwen3_32b_shampoo() -> Any: return _convert(_base("32b"), "Shampoo")      # noqa: E704
def qwen3_32b_soap() -> Any: return _convert(_base("32b"), "SOAP")            # noqa: E704


# ------------------------------------------------------------------------------------------------
# CPU-sized: a byte tokenizer and the stdlib's source as data (no files to download)
# ------------------------------------------------------------------------------------------------
class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as tokens (vocabulary 256)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 256

    def __init__(self, config: Config, *, tokenizer_path: str | None = None, **kwargs: Any):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.eos_id = 0

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class StdlibBytes(BaseDataLoader):
    """Random byte windows of the stdlib's top-level ``*.py`` files (every 10th file left out).

    Global row ``i`` is row ``i % rows_per_draw`` of draw ``i // rows_per_draw``, a generator
    seeded with ``seed`` and the draw; global microbatch ``m`` is rows ``[m G, (m + 1) G)`` (``G =
    local_batch_size * dp_world_size``) and dp rank ``r`` takes its rows. So a step sees the same
    tokens at any world size, and also under pipeline parallelism, where torchtitan loads one
    pipeline microbatch at a time (``G`` = the microbatch size times the dp degree). The position
    (rows consumed) is checkpointed.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0
        rows_per_draw: int = 16  # the recipe's global batch: one draw per step, as before PP

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any = None,
                 seq_len: int, local_batch_size: int, **kwargs: Any):
        files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        text = b"".join(f.read_bytes() for i, f in enumerate(files) if i % 10 != 9)
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.seed, self.world, self.rank = config.seed, dp_world_size, dp_rank
        self.seq_len, self.local, self.per_draw = seq_len, local_batch_size, config.rows_per_draw
        self.microbatch = 0
        self._draw: tuple[int, torch.Tensor] | None = None

    def _starts(self, draw: int) -> torch.Tensor:
        if self._draw is None or self._draw[0] != draw:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + draw)
            self._draw = (draw, torch.randint(0, self.data.numel() - self.seq_len - 1, (self.per_draw,), generator=g))
        return self._draw[1]

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            first = self.microbatch * self.local * self.world + self.rank * self.local
            starts = torch.stack([self._starts(i // self.per_draw)[i % self.per_draw]
                                  for i in range(first, first + self.local)])
            rows = self.data[starts[:, None] + torch.arange(self.seq_len + 1)].long()
            self.microbatch += 1
            yield {"input": rows[:, :-1]}, rows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"microbatch": self.microbatch, "rows": self.microbatch * self.local * self.world}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rows = state_dict.get("rows")  # rows, not microbatches: resumable across layouts
        self.microbatch = (state_dict.get("microbatch", 0) if rows is None
                           else rows // (self.local * self.world))


def qwen3_cpu_muon() -> Any:
    """torchtitan's Qwen3 debug model made CPU-sized (dim 128, 4 layers, byte vocabulary, SDPA
    attention, fp32), trained on the stdlib's source by matrixfsdp + Muon."""
    from torchtitan.models.qwen3 import _build_qwen3_layers

    dim, head_dim, seq_len = 128, 32, 128
    return _cpu_config("cpu_bytes", _build_qwen3_layers(
        fuse_qkv=True, n_layers=4, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, hidden_dim=3 * dim,
        attn_backend="flex", rope=_rope(head_dim, seq_len)), dim, seq_len)


def qwen3_moe_cpu_muon() -> Any:
    """The CPU-sized Qwen3 made a mixture of experts (8 experts of hidden 128, top-2, 4 layers,
    torchtitan's ``GroupedExperts``): Muon steps every expert matrix, owned whole per rank
    (docs/experts.md); ``--parallelism.expert_parallel_degree 2`` on 2 ranks runs torchtitan's
    expert parallelism instead, each rank stepping its own experts."""
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers

    dim, head_dim, seq_len = 128, 32, 128
    return _cpu_config("cpu_bytes_moe", _build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=4, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=dim,
        num_experts=8, top_k=2, attn_backend="flex", moe_comm_backend="standard", rope=_rope(head_dim, seq_len)),
        dim, seq_len)


def _rope(head_dim: int, seq_len: int) -> Any:
    from torchtitan.models.common import CosSinRoPE

    return CosSinRoPE.Config(dim=head_dim, max_seq_len=seq_len, theta=1000000.0)


def _cpu_config(flavor: str, layers: Any, dim: int, seq_len: int) -> Any:
    """A Qwen3 ``Trainer.Config`` with ``layers``, a byte vocabulary, SDPA attention and fp32, on
    the stdlib's source, converted to matrixfsdp + Muon."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _qwen3_norm
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel
    from torchtitan.models.qwen3.model import Qwen3Model

    vocab = 256
    config = qwen3_debugmodel()
    model = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim), enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
        layers=layers,
    )
    for layer in model.layers:  # FlexAttention compiles with inductor: SDPA on CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.model_spec = dataclasses.replace(config.model_spec, flavor=flavor, model=model)
    config.hf_assets_path = ""
    config.dump_folder = "runs/titan_cpu"
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader = StdlibBytes.Config()
    config.loss = CrossEntropyLoss.Config(global_vocab_size=vocab)
    config.activation_checkpoint = None
    config.compile.enable = False
    config.checkpoint.enable = False
    t = config.training
    world = int(os.environ.get("WORLD_SIZE", "1"))
    t.steps, t.seq_len, t.global_batch_size, t.local_batch_size = 100, seq_len, 16, 16 // world
    t.mixed_precision_param = t.mixed_precision_reduce = "float32"
    config.parallelism.data_parallel_shard_degree = -1
    config.lr_scheduler.warmup_steps = 10
    config.metrics.log_freq = 10
    config.comm.trace_buf_size = 0
    # torchtitan's default debug.seed=None seeds every rank from rank 0's generator state, which
    # differs between runs here (torch.initial_seed() is not fixed): runs would not be comparable
    config.debug.seed = 0
    return with_matrixfsdp(config, optimizer="Muon", lr=0.02, adamw_lr=3e-3,
                           optimizer_kwargs={"ns_dtype": torch.float32})
