"""What every implementation shares: the configuration (:class:`BenchConfig`), the run context,
the seeded model and data, the Muon/AdamW routing rule, the :class:`Impl` protocol and the
step-cost helpers behind the balance notes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from matrixfsdp import Decoder, DecoderConfig


#: 2D parameters that go to AdamW in every implementation (embedding, output head).
ADAMW_2D = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class BenchConfig:
    # model (Qwen3-style; dims divisible by 4 so FSDP2 shards are even at W=2 and W=4)
    vocab_size: int = 2048
    hidden_size: int = 320
    intermediate_size: int = 896
    num_hidden_layers: int = 6
    num_attention_heads: int = 5
    num_key_value_heads: int = 1
    head_dim: int = 64
    # data: a fixed global batch split evenly over ranks
    seq_len: int = 128
    global_batch: int = 8
    model_seed: int = 1234
    data_seed: int = 5678
    # Muon (torch.optim.Muon's defaults except lr / weight_decay)
    lr: float = 0.02
    weight_decay: float = 0.01
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    ns_dtype: str = "float32"
    # AdamW (embeddings, head, norms)
    adamw_lr: float = 3e-3
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.0
    # --model moe (issue 26): tests/_moe.py's MoE decoder (baselines/moe.py); hidden_size,
    # num_hidden_layers, num_attention_heads and vocab_size above size it too
    model: str = "decoder"
    experts: int = 16
    moe_ffn: int = 256  # expert (and shared expert) hidden size
    top_k: int = 2
    moe_shared: bool = True
    moe_fused: bool = False  # Hugging Face's gate_up_proj [E, 2F, D] instead of w1/w3

    def model_config(self) -> DecoderConfig:
        return DecoderConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
        )

    @property
    def ns_torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.ns_dtype]

    def muon_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``matrixfsdp.optim.Muon`` (and, minus the AdamW ones, DistMuon)."""
        return dict(
            lr=self.lr, weight_decay=self.weight_decay, momentum=self.momentum,
            nesterov=self.nesterov, ns_coefficients=tuple(self.ns_coefficients), eps=self.eps,
            ns_steps=self.ns_steps, adjust_lr_fn=self.adjust_lr_fn, ns_dtype=self.ns_torch_dtype,
            adamw_lr=self.adamw_lr, adamw_betas=tuple(self.adamw_betas), adamw_eps=self.adamw_eps,
            adamw_weight_decay=self.adamw_weight_decay,
        )

    @property
    def ns_short(self) -> str:
        """``fp32`` / ``bf16`` (for notes)."""
        return {"float32": "fp32", "bfloat16": "bf16"}[self.ns_dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Context:
    rank: int
    world: int
    mesh: Any  # 1-D DeviceMesh named ("dp_shard",), shared by every implementation
    matrixfsdp_source: str = "public"  # "public": matrixfsdp.fully_shard; "_runtime": private module
    # where the model, the data and every baseline's buffers live (the mesh's device type)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # step_bench --tp T: the mesh is the 1-D ("tp",) mesh (W = T, every rank sees the whole batch)
    # or, at W = dp * T > T, the 2-D ("dp_shard", "tp") mesh (a TP row shares its dp rank's batch)
    tp: int = 1


def build_model(cfg: BenchConfig, device: torch.device | str | None = None) -> Decoder:
    """The seeded model, initialized on CPU (same values on every device) then moved to ``device``."""
    model = Decoder(cfg.model_config())
    model.reset_parameters(seed=cfg.model_seed)
    if device is not None and torch.device(device).type != "cpu":
        model.to(device)
    return model


def batch_for_step(cfg: BenchConfig, step: int, rank: int, world: int,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """This rank's ``[global_batch / world, seq_len + 1]`` tokens of step ``step`` (seeded; drawn
    on CPU, so the same on every device, then moved to ``device``)."""
    if cfg.global_batch % world:
        raise ValueError(f"global_batch={cfg.global_batch} is not divisible by world={world}")
    g = torch.Generator().manual_seed(cfg.data_seed * 100_003 + step)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.global_batch, cfg.seq_len + 1), generator=g)
    per = cfg.global_batch // world
    out = tokens[rank * per:(rank + 1) * per].contiguous()
    return out if device is None else out.to(device)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def strip_prefix(name: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and strip_prefix(name) not in ADAMW_2D


def muon_param_groups(named: Iterable[tuple[str, torch.Tensor]], *, auto: bool = False) -> list[dict[str, Any]]:
    """Param groups for ``matrixfsdp.optim.Muon``, empty ones dropped.

    ``auto=False`` (baselines): explicit routing, independent of how ``"auto"`` treats DTensors:
    ``algorithm="muon"`` for the hidden 2D weights, ``"adamw"`` for embeddings/head and for every
    non-2D tensor. ``auto=True`` (the matrixfsdp slot, as docs/fully_shard.md describes): ``"adamw"`` for the
    embedding/head and ``"auto"`` for the rest, so routing follows the owner plan.
    """
    emb, mats, rest = [], [], []
    for n, p in named:
        if strip_prefix(n) in ADAMW_2D:
            emb.append(p)
        elif auto or is_muon_param(n, p):
            mats.append(p)
        else:
            rest.append(p)
    groups = []
    if emb:
        groups.append({"params": emb, "algorithm": "adamw"})
    if mats:
        groups.append({"params": mats} if auto else {"params": mats, "algorithm": "muon"})
    if rest:
        groups.append({"params": rest, "algorithm": "adamw"})
    return groups


def check_routes(opt: torch.optim.Optimizer, named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Raise unless ``opt`` (a matrixfsdp optimizer) sends exactly the hidden 2D weights among its
    parameters to Muon and everything else to AdamW; returns a one-line summary. Guards against
    silent mis-routing (e.g. of DTensors under ``algorithm="auto"``)."""
    names = {id(p): (strip_prefix(n), p) for n, p in named}
    counts: dict[str, int] = {}
    wrong = []
    for _, _, p, route in opt._routed():
        name, _ = names.get(id(p), ("?", p))
        want = "muon" if is_muon_param(name, p) else "adamw"
        counts[route] = counts.get(route, 0) + 1
        if route != want:
            wrong.append(f"{name}: {route} (want {want})")
    if wrong:
        raise RuntimeError(f"optimizer routing differs from the benchmark's rule for {len(wrong)} tensors, "
                           f"e.g. {wrong[:3]}")
    return "routes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


class Impl:
    """Base class; subclasses set ``name`` and implement ``setup``."""

    name = "?"
    #: False for implementations that run a different optimizer (parity is then informational)
    same_numerics = True

    def __init__(self, cfg: BenchConfig, ctx: Context):
        self.cfg, self.ctx = cfg, ctx
        self.rank, self.world = ctx.rank, ctx.world
        self.model: nn.Module | None = None
        self.opts: list[torch.optim.Optimizer] = []
        self.notes: list[str] = []

    # -- protocol -------------------------------------------------------------------------
    def setup(self) -> None:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model, tokens)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def forward_backward(self, tokens: torch.Tensor) -> torch.Tensor:
        loss = self.forward(tokens)
        self.backward(loss)
        return loss

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None

    def teardown(self) -> None:
        self.opts = []
        self.model = None

    # -- introspection --------------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(strip_prefix(n), p) for n, p in self.model.named_parameters()]

    def param_tensors(self) -> list[torch.Tensor]:
        return [p for _, p in self.named_parameters()]

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.param_tensors() if p.grad is not None]

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.opts)

    def scratch_tensors(self) -> list[torch.Tensor]:
        """Persistent optimizer-side buffers outside ``optimizer.state`` (DistMuon's)."""
        return []


# step cost, for the balance notes of the owner-placing rows
def ns_flops(shape: torch.Size) -> float:
    """Newton-Schulz FLOPs of one matrix step (5 iterations)."""
    m, n = sorted(shape[:2])
    return 5 * (4 * m * m * n + 2 * m ** 3)


def imbalance(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def muon_cost(n: str, p: torch.Tensor) -> float:
    """Per-parameter step work: Newton-Schulz FLOPs for Muon matrices, ~12 FLOPs/element for AdamW."""
    return ns_flops(p.shape) if is_muon_param(n, p) else 12.0 * p.numel()
