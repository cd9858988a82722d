"""The implementations compared by ``benchmarks/step_bench.py``: one small class each.

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
"""

from __future__ import annotations

import math
import os
import sys
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:
    import matrixfsdp  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import matrixfsdp  # noqa: F401

from matrixfsdp import Decoder, DecoderConfig, DecoderLayer
from matrixfsdp.optim import Muon
from matrixfsdp.optim._muon import adjusted_lr, zeropower_via_newtonschulz

__all__ = [
    "BenchConfig",
    "Context",
    "Impl",
    "IMPLS",
    "ADAMW_2D",
    "build_model",
    "batch_for_step",
    "patch_torchtitan_for_cpu",
    "patch_torchtitan_ns_dtype",
]

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


def _strip(name: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and _strip(name) not in ADAMW_2D


def muon_param_groups(named: Iterable[tuple[str, torch.Tensor]], *, auto: bool = False) -> list[dict[str, Any]]:
    """Param groups for ``matrixfsdp.optim.Muon``, empty ones dropped.

    ``auto=False`` (baselines): explicit routing, independent of how ``"auto"`` treats DTensors:
    ``algorithm="muon"`` for the hidden 2D weights, ``"adamw"`` for embeddings/head and for every
    non-2D tensor. ``auto=True`` (the matrixfsdp slot, as docs/fully_shard.md describes): ``"adamw"`` for the
    embedding/head and ``"auto"`` for the rest, so routing follows the owner plan.
    """
    emb, mats, rest = [], [], []
    for n, p in named:
        if _strip(n) in ADAMW_2D:
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
    names = {id(p): (_strip(n), p) for n, p in named}
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
        return [(_strip(n), p) for n, p in self.model.named_parameters()]

    def param_tensors(self) -> list[torch.Tensor]:
        return [p for _, p in self.named_parameters()]

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.param_tensors() if p.grad is not None]

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.opts)

    def scratch_tensors(self) -> list[torch.Tensor]:
        """Persistent optimizer-side buffers outside ``optimizer.state`` (DistMuon's)."""
        return []


# ================================================================================ DDP + Muon
def _python_allreduce_hook(process_group: Any, bucket: Any) -> torch.futures.Future:
    """DDP's default all-reduce (divide by W, SUM), issued from Python so it can be counted."""
    group = process_group if process_group is not None else dist.group.WORLD
    t = bucket.buffer()
    t.div_(dist.get_world_size(group))
    fut = dist.all_reduce(t, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


# DDP checks the hook's annotations against the real classes (strings under `from __future__`).
_python_allreduce_hook.__annotations__ = {
    "process_group": Any, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor],
}


class DDPMuon(Impl):
    """DDP + Muon on every rank (redundant Newton-Schulz): the numerics reference."""

    name = "ddp_muon"

    def setup(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = self.ctx.device
        model = build_model(self.cfg, dev)
        # the model has no buffers; device_ids: the one device of a single-device CUDA module
        self.model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                         gradient_as_bucket_view=True)
        self.model.register_comm_hook(None, _python_allreduce_hook)
        self.opts = [Muon(muon_param_groups(self.model.named_parameters()), **self.cfg.muon_kwargs())]
        self.notes.append(check_routes(self.opts[0], self.model.named_parameters()))
        self.notes.append("DDP(gradient_as_bucket_view=True, 25 MB buckets) with a Python all-reduce "
                          "comm hook (div by W, SUM; same math as DDP's default) so its collectives "
                          f"are counted; Muon = matrixfsdp.optim.Muon(ns_dtype={self.cfg.ns_short}) on every rank")


# ================================================================================ FSDP2 helpers
def shard_group(mesh: Any) -> Any:
    """The process group of the ``dp_shard`` dimension: the whole 1-D mesh, or under HSDP (a 2-D
    ``("dp_replicate", "dp_shard")`` mesh) this rank's shard group, where each replica repeats the
    baselines' optimizer collectives and Newton-Schulz."""
    return mesh.get_group() if mesh.ndim == 1 else mesh["dp_shard"].get_group()


def _fsdp2_wrap(model: Decoder, mesh: Any) -> Decoder:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class FSDP2AdamW(Impl):
    """Stock FSDP2 + torch AdamW on everything: the forward/backward reference."""

    name = "fsdp2_adamw"
    same_numerics = False

    def setup(self) -> None:
        model = _fsdp2_wrap(build_model(self.cfg, self.ctx.device), self.ctx.mesh)
        self.model = model
        c = self.cfg
        self.opts = [torch.optim.AdamW(model.parameters(), lr=c.adamw_lr, betas=c.adamw_betas,
                                       eps=c.adamw_eps, weight_decay=c.adamw_weight_decay)]
        self.notes.append("torch.optim.AdamW (default foreach) on every parameter: a different "
                          "optimizer, so its parity column is not a correctness check")


# ================================================================================ FSDP2 + gather Muon
def _all_gather_single(*args: Any, **kwargs: Any) -> Any:
    """torch 2.13's all_gather_single (all_gather_into_tensor is its deprecated alias); looked up
    at call time so the benchmark's counting wrapper sees it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


class GatherMuon(Muon):
    """``matrixfsdp.optim.Muon`` for ``Shard(d)`` DTensors (FSDP2's ``Shard(0)``, TP's
    ``Shard(0)``/``Shard(1)``): momentum on the local shard, all-gather each matrix's (Nesterov)
    update over ``group``, Newton-Schulz on the whole matrix on every rank, keep this rank's
    shard (Megatron's ``duplicated`` TP mode). AdamW-routed parameters update their shard locally.

    Gathering the momentum-updated shard instead of the raw gradient shard moves the same bytes
    and gives the same matrix (the momentum update is element-wise), while keeping momentum sharded.
    All gathers are issued asynchronously first, then waited for in order.
    """

    def __init__(self, params: Any, *, group: Any = None, **kw: Any):
        self._pg = group
        super().__init__(params, **kw)

    def _check_whole(self, p: torch.Tensor, local: torch.Tensor, index: int) -> None:
        pass  # shards are expected here

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        W = dist.get_world_size(self._pg)
        pending = []
        for _, group, p, route in self._routed():
            if p.grad is None:
                continue
            param = p._local_tensor if isinstance(p, DTensor) else p
            grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            if route == "adamw":
                if param.numel():
                    self._adamw_step(param, grad, self.state[p], group)
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf, m = state["momentum_buffer"], group["momentum"]
            buf.lerp_(grad, 1 - m)
            upd = grad.lerp(buf, m) if group["nesterov"] else buf
            # gathered along rows: a Shard(1) matrix travels transposed (HSDP: the Shard of (Replicate, Shard))
            d = next(pl for pl in p.placements if pl.is_shard()).dim % 2
            upd = upd if d == 0 else upd.t()
            n, cols = p.shape[d], p.shape[1 - d]
            rows = -(-n // W)
            _, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            send = torch.zeros(rows, cols, dtype=upd.dtype, device=upd.device)
            send[: upd.shape[0]].copy_(upd)
            out = torch.empty(W * rows, cols, dtype=upd.dtype, device=upd.device)
            work = _all_gather_single(out, send, group=self._pg, async_op=True)
            pending.append((p, param, group, out, work, int(off[d]), d))
        for p, param, group, out, work, off, d in pending:
            work.wait()
            full = out[: p.shape[d]] if d == 0 else out[: p.shape[d]].t()
            ortho = zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"],
                                               group["eps"], group["ns_dtype"])
            lr = group["lr"]
            param.mul_(1 - lr * group["weight_decay"])
            if param.numel():
                param.add_(ortho.narrow(d, off, param.shape[d]), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return None


class FSDP2GatherMuon(Impl):
    name = "fsdp2_gather_muon"

    def setup(self) -> None:
        model = _fsdp2_wrap(build_model(self.cfg, self.ctx.device), self.ctx.mesh)
        self.model = model
        self.opts = [GatherMuon(muon_param_groups(model.named_parameters()),
                                group=shard_group(self.ctx.mesh), **self.cfg.muon_kwargs())]
        self.notes.append(check_routes(self.opts[0], model.named_parameters()))
        self.notes.append("stock fully_shard per DecoderLayer + root; per matrix one async "
                          "all_gather_single of the momentum-updated shard (padded to "
                          f"ceil(n/W) rows), {self.cfg.ns_short} NS on the whole matrix on every rank, "
                          "keep own rows")


# ================================================================================ FSDP2 + torchtitan DistMuon
_TT_PATCHES: list[str] | None = None
_TT_PATCHES_DTYPE: torch.dtype | None = None


class _CpuStream:
    """Stand-in for a device stream on CPU, where every op is synchronous."""

    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event

    def synchronize(self) -> None:
        pass


class _CpuEvent:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStreamCtx:
    def __init__(self, stream: Any) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_CPU_STREAM = _CpuStream()
_CPU_DEVICE_HANDLE = types.SimpleNamespace(
    Stream=_CpuStream, Event=_CpuEvent, stream=_CpuStreamCtx,
    current_stream=lambda device=None: _CPU_STREAM, synchronize=lambda device=None: None,
)


def patch_torchtitan_for_cpu(ns_dtype: torch.dtype) -> list[str]:
    """Make torchtitan 0.3.0's DistMuon run on CPU/gloo; returns what was patched (idempotent).

    1. ``DistMuon._validate_parameter_storage`` raises unless parameters are on CUDA: replaced by
       the same check without the CUDA requirement.
    2. Its bucketed runtime builds ``torch.get_device_module(device).Stream(device=, priority=)``
       and events; ``torch.cpu.Stream`` takes no arguments. The runtime module's ``torch`` is
       replaced by a proxy whose ``get_device_module`` returns no-op CPU streams/events (CPU ops
       are synchronous, so the stream ordering it encodes is trivially satisfied).
    3. ``_zeropower_via_newtonschulz`` casts to bf16 (about 25x slower than fp32 on this CPU): the
       same op sequence in ``ns_dtype`` (:func:`patch_torchtitan_ns_dtype`).

    CPU only: on CUDA DistMuon runs as shipped, apart from its NS dtype when ``--ns-dtype`` is
    not bf16 (see :class:`FSDP2DistMuon`).
    """
    global _TT_PATCHES, _TT_PATCHES_DTYPE
    if _TT_PATCHES is not None and _TT_PATCHES_DTYPE == ns_dtype:
        return _TT_PATCHES
    _TT_PATCHES_DTYPE = ns_dtype
    from torchtitan.distributed.flex_shard import _optimizer_reshard_runtime as rt
    from torchtitan.distributed.flex_shard import dist_muon as dm

    def _validate_parameter_storage(self: Any) -> torch.device:
        from torch.distributed.tensor import DTensor

        devices = set()
        for group in self.param_groups:
            for param in group["params"]:
                if not isinstance(param, DTensor):
                    raise TypeError("DistMuon requires DTensor parameters")
                devices.add(param.to_local().device)
        if len(devices) != 1:
            raise ValueError("DistMuon requires one device per process")
        return devices.pop()

    dm.DistMuon._validate_parameter_storage = _validate_parameter_storage

    class _TorchProxy(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def get_device_module(device: Any = None) -> Any:
            dev = torch.device(device) if device is not None else torch.device("cpu")
            if dev.type == "cpu":
                return _CPU_DEVICE_HANDLE
            return torch.get_device_module(dev)

    rt.torch = _TorchProxy("torch")
    _TT_PATCHES = [
        "DistMuon._validate_parameter_storage: CUDA-only check relaxed to 'one device'",
        "flex_shard runtime: no-op CPU Stream/Event via a torch proxy (torch.cpu.Stream takes no device/priority)",
        patch_torchtitan_ns_dtype(ns_dtype),
    ]
    return _TT_PATCHES


_TT_NS_ORIGINAL: Any = None  # DistMuon's own Newton-Schulz, kept when patched


def torchtitan_ns_dtype() -> torch.dtype | None:
    """The dtype the installed DistMuon's own Newton-Schulz casts to (torchtitan 0.3.0: bf16,
    hard-wired), read from its source; None if that cannot be recognised."""
    import inspect

    from torchtitan.distributed.flex_shard import dist_muon as dm

    fn = _TT_NS_ORIGINAL or dm._zeropower_via_newtonschulz
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    found = [dt for name, dt in (("bfloat16", torch.bfloat16), ("float32", torch.float32), ("float16", torch.float16))
             if f"dtype=torch.{name}" in src]
    return found[0] if len(found) == 1 else None


def torchtitan_ns_unpatched() -> None:
    """Undo :func:`patch_torchtitan_ns_dtype` (if applied in this process)."""
    if _TT_NS_ORIGINAL is not None:
        from torchtitan.distributed.flex_shard import dist_muon as dm

        dm._zeropower_via_newtonschulz = _TT_NS_ORIGINAL


def patch_torchtitan_ns_dtype(ns_dtype: torch.dtype) -> str:
    """Replace torchtitan 0.3.0's DistMuon Newton-Schulz (hard-wired ``update.to(torch.bfloat16)``,
    no argument or attribute selects another dtype) by the same op sequence in ``ns_dtype``;
    returns the note describing the patch. Nothing else of DistMuon changes. Used on CPU (part of
    :func:`patch_torchtitan_for_cpu`) and, on CUDA, only when ``ns_dtype`` is not bf16."""
    global _TT_NS_ORIGINAL
    from torchtitan.distributed.flex_shard import dist_muon as dm

    if _TT_NS_ORIGINAL is None:
        _TT_NS_ORIGINAL = dm._zeropower_via_newtonschulz

    def _zeropower(update: torch.Tensor, *, ns_coefficients: Any, ns_steps: int, eps: float) -> torch.Tensor:
        a, b, c = ns_coefficients
        result = update.to(dtype=ns_dtype, copy=True)
        transposed = result.shape[-2] > result.shape[-1]
        if transposed:
            result = result.transpose(-2, -1)
        result.div_(result.norm(dim=(-2, -1), keepdim=True).clamp_min(eps))
        if result.ndim == 2:
            for _ in range(ns_steps):
                gram = result @ result.T
                gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
                result = torch.addmm(result, gram_update, result, beta=a)
        else:
            shape = result.shape
            mats = result.reshape(-1, *shape[-2:])
            for _ in range(ns_steps):
                gram = mats @ mats.transpose(-2, -1)
                gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
                mats = torch.baddbmm(mats, gram_update, mats, beta=a)
            result = mats.reshape(shape)
        return result.transpose(-2, -1) if transposed else result

    dm._zeropower_via_newtonschulz = _zeropower
    return (f"dist_muon._zeropower_via_newtonschulz: same op sequence in "
            f"{str(ns_dtype).replace('torch.', '')} instead of bf16")


class FSDP2DistMuon(Impl):
    """Stock FSDP2 + torchtitan 0.3.0 ``DistMuon`` (``flex_shard``) for the hidden matrices, with
    ``ComputeLayout({"dp_shard": Owned()})`` per matrix (each step: all-to-all the shards to a
    temporary owner, NS there, all-to-all back) and one bucket per decoder layer; AdamW (via
    ``matrixfsdp.optim.Muon`` with ``algorithm="adamw"``) for the rest."""

    name = "fsdp2_distmuon"

    def setup(self) -> None:
        try:
            from torchtitan.distributed.flex_shard import BucketConfig, ComputeLayout, Owned, build_dist_muon
        except ImportError as e:
            raise ImportError(f"torchtitan DistMuon unavailable: {e} "
                              "(pip install -c constraints.txt torchtitan==0.3.0)") from e
        dev, ns = self.ctx.device, self.cfg.ns_torch_dtype
        if dev.type == "cpu":
            patches = ["CPU patches: " + "; ".join(patch_torchtitan_for_cpu(ns))]
        else:
            shipped = torchtitan_ns_dtype()
            if shipped == ns:
                torchtitan_ns_unpatched()
                patches = [f"torchtitan DistMuon unpatched on {dev.type}: its own Newton-Schulz runs in "
                           f"{self.cfg.ns_short} (hard-wired), the --ns-dtype {self.cfg.ns_dtype} of the others"]
            else:  # no option selects DistMuon's NS dtype: patch that one function, and say so
                seen = "unrecognised" if shipped is None else str(shipped).replace("torch.", "")
                patches = [f"{dev.type}: DistMuon unpatched except its Newton-Schulz, whose hard-wired dtype "
                           f"({seen}) does not honour --ns-dtype {self.cfg.ns_dtype}: "
                           + patch_torchtitan_ns_dtype(ns)]
        model = _fsdp2_wrap(build_model(self.cfg, dev), self.ctx.mesh)
        self.model = model
        muon_named = [(n, p) for n, p in model.named_parameters() if is_muon_param(n, p)]
        other_named = [(n, p) for n, p in model.named_parameters() if not is_muon_param(n, p)]
        layout = ComputeLayout(shardings_by_mesh_axis={"dp_shard": Owned()})
        kw = self.cfg.muon_kwargs()
        dist_muon = build_dist_muon(
            [{"params": [p for _, p in muon_named], "param_names": [n for n, _ in muon_named]}],
            compute_sharding_by_fqn={n: layout for n, _ in muon_named},
            bucket_configs=[BucketConfig(patterns=(f"model.layers.{i}.*",), name=f"layers.{i}")
                            for i in range(self.cfg.num_hidden_layers)],
            lr=kw["lr"], weight_decay=kw["weight_decay"], momentum=kw["momentum"],
            nesterov=kw["nesterov"], ns_coefficients=kw["ns_coefficients"], eps=kw["eps"],
            ns_steps=kw["ns_steps"], adjust_lr_fn=kw["adjust_lr_fn"],
        )
        adamw = Muon([{"params": [p for _, p in other_named], "algorithm": "adamw"}], **kw)
        self.notes.append(f"DistMuon: {len(muon_named)} matrices; " + check_routes(adamw, other_named))
        self.opts = [dist_muon, adamw]
        self.notes.extend(patches)
        self.notes.append("ComputeLayout(dp_shard=Owned()) per hidden matrix, one BucketConfig per "
                          "decoder layer")

    def scratch_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        rt = getattr(self.opts[0], "_redistribution_runtime", None) if self.opts else None
        if rt is None:
            return out
        slots = [rt._local_slot]
        if rt._context is not None:
            slots += [s.buffers for s in rt._context.slots]
        for slot in slots:
            for reserved in slot.buffers.values():
                for f in ("storage_exchange", "compute_exchange", "compute_scratch", "storage_scratch"):
                    t = getattr(reserved, f)
                    if t is not None:
                        out.append(t)
        return out


# ================================================================================ ZeRO-1 owner
def _ns_flops(shape: torch.Size) -> float:
    m, n = sorted(shape[:2])
    return 5 * (4 * m * m * n + 2 * m ** 3)


def lpt_owners(named: list[tuple[str, torch.Tensor]], world: int) -> dict[str, int]:
    """Deterministic owners: Muon matrices by LPT on Newton-Schulz FLOPs, then AdamW tensors by
    LPT on bytes (ties by name). Same on every rank (no hashing)."""
    owners: dict[str, int] = {}
    load = [0.0] * world
    mats = sorted(((n, p) for n, p in named if is_muon_param(n, p)), key=lambda x: (-_ns_flops(x[1].shape), x[0]))
    for n, p in mats:
        r = min(range(world), key=lambda i: (load[i], i))
        owners[n] = r
        load[r] += _ns_flops(p.shape)
    bytes_load = [0] * world
    for n, p in named:
        if n in owners:
            bytes_load[owners[n]] += p.numel()
    rest = sorted(((n, p) for n, p in named if n not in owners), key=lambda x: (-x[1].numel(), x[0]))
    for n, p in rest:
        r = min(range(world), key=lambda i: (bytes_load[i], i))
        owners[n] = r
        bytes_load[r] += p.numel()
    return owners


class Zero1Owner(Impl):
    """ZeRO-1-style owners: full parameters and gradients on every rank; each gradient is
    ``dist.reduce``d to its owner as soon as it is accumulated (async, from a post-accumulate-grad
    hook, so it overlaps backward like DDP's buckets); in ``step`` the owner divides by W and runs
    Muon/AdamW on what it owns (optimizer state only there), then every parameter is broadcast
    from its owner (async, all issued then waited)."""

    name = "zero1_owner"

    def setup(self) -> None:
        model = build_model(self.cfg)
        self.model = model
        named = list(model.named_parameters())
        self.owner = lpt_owners(named, self.world)
        self._params = [(n, p, self.owner[n]) for n, p in named]
        self._pending: list[tuple[torch.Tensor, int, Any]] = []
        for n, p, o in self._params:
            p.register_post_accumulate_grad_hook(self._make_hook(o))
        mine = [(n, p) for n, p, o in self._params if o == self.rank]
        self.opts = [Muon(muon_param_groups(mine), **self.cfg.muon_kwargs())] if mine else []
        if self.opts:
            self.notes.append(check_routes(self.opts[0], mine) + " (rank's own)")
        load = [0.0] * self.world
        for n, p in named:
            load[self.owner[n]] += _muon_cost(_strip(n), p)
        self.balance = _imbalance(load)
        self.notes.append("owners: LPT on Newton-Schulz FLOPs (matrices) then bytes (AdamW tensors); "
                          "per-parameter async dist.reduce in backward, async dist.broadcast after step")

    def _make_hook(self, owner: int) -> Any:
        def hook(p: torch.Tensor) -> None:
            self._pending.append((p, owner, dist.reduce(p.grad, dst=owner, async_op=True)))
        return hook

    def step(self) -> None:
        for p, owner, work in self._pending:
            work.wait()
            if owner == self.rank:
                p.grad.div_(self.world)
            else:
                p.grad = None  # a non-destination reduce buffer holds no meaningful value
        self._pending = []
        for o in self.opts:
            o.step()
        works = [dist.broadcast(p.data, src=o, async_op=True) for _, p, o in self._params]
        for w in works:
            w.wait()


# ================================================================================ matrixfsdp
class MatrixFSDP(Impl):
    """The runtime under test. Expected API (issue 3, being written)::

        plan = matrixfsdp.plan_owners(model, mesh, block_types=(DecoderLayer,))
        for layer in model.model.layers:
            matrixfsdp.fully_shard(layer, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
        opt = matrixfsdp.optim.Muon(groups, ..., ns_dtype=cfg.ns_torch_dtype)   # purely local step
    """

    name = "matrixfsdp"

    @staticmethod
    def resolve_api(source: str = "public") -> tuple[Any, Any]:
        """(fully_shard, plan_owners), or raise ImportError/AttributeError saying why not."""
        import matrixfsdp as mf

        if source == "public":
            return mf.fully_shard, mf.plan_owners
        if source == "_runtime":  # the in-progress private module (development only)
            from matrixfsdp._fully_shard import fully_shard

            return fully_shard, mf.plan_owners
        raise ValueError(f"unknown matrixfsdp source {source!r}")

    #: issue 17's ``plan_owners(..., replica_step=...)`` on a 2-D (HSDP) mesh; None: the flat API
    replica_step: str | None = None

    def _plan_kwargs(self, plan_owners: Any) -> dict[str, Any]:
        if self.replica_step is None:
            return {}
        import inspect

        if self.ctx.mesh.ndim != 2:
            raise ValueError(f"{self.name} needs a 2-D (dp_replicate, dp_shard) mesh: run step_bench with --mesh R,S")
        if "replica_step" not in inspect.signature(plan_owners).parameters:
            raise ImportError("matrixfsdp's HSDP API (issue 17) is not in this checkout: plan_owners() has no "
                              "replica_step argument; merge the 'HSDP runtime' commit to run this row")
        return {"replica_step": self.replica_step}

    def setup(self) -> None:
        fully_shard, plan_owners = self.resolve_api(self.ctx.matrixfsdp_source)
        extra = self._plan_kwargs(plan_owners)
        model = build_model(self.cfg)
        mesh = self.ctx.mesh
        plan = plan_owners(model, mesh, block_types=(DecoderLayer,), **extra)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, plan=plan)
        fully_shard(model, mesh=mesh, plan=plan)
        self.model = model
        self.plan = plan
        self.opts = [Muon(muon_param_groups(model.named_parameters(), auto=True), **self.cfg.muon_kwargs())]
        self.notes.append(check_routes(self.opts[0], model.named_parameters()))
        kw = "".join(f", {k}={v!r}" for k, v in extra.items())
        self.notes.append(f"plan_owners(model, mesh{' (2-D)' if mesh.ndim == 2 else ''}, block_types=(DecoderLayer,){kw}) "
                          f"digest={getattr(plan, 'digest', '?')}; fully_shard per DecoderLayer + root "
                          f"(source={self.ctx.matrixfsdp_source})")

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        # the parity gather reads values: under split, finish a pending replica exchange first
        sync = getattr(self.model, "sync_params", None)
        if self.replica_step is not None and callable(sync):
            sync()
        return super().named_parameters()

    def param_tensors(self) -> list[torch.Tensor]:
        # byte counts only (also read inside the last step's timing window): no exchange
        return list(self.model.parameters())


# ================================================================================ ZeRO-1/2 (issue 12)
def _imbalance(loads: list[float]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean else 1.0


def _muon_cost(n: str, p: torch.Tensor) -> float:
    """Per-parameter step work: Newton-Schulz FLOPs for Muon matrices, ~12 FLOPs/element for AdamW."""
    return _ns_flops(p.shape) if is_muon_param(n, p) else 12.0 * p.numel()


#: bucket size of the replicate rows (elements): ~5 buckets on the benchmark model, so the
#: reduce-scatters overlap backward and the all-gathers overlap forward
REPLICATE_BUCKET_NUMEL = 1_500_000


class MatrixReplicate(Impl):
    """``matrixfsdp.replicate`` (ZeRO-2 on the planner's bucket partition): DDP-style flat buckets,
    one uneven reduce-scatter per bucket in backward, a local step on this rank's parameters only,
    one all-gather per bucket issued at the next forward (so ``step`` makes no collective)."""

    policy, alpha = "alpha_balanced", 0.5

    def setup(self) -> None:
        import matrixfsdp

        model = build_model(self.cfg)
        plan = matrixfsdp.plan_owners(model, self.ctx.mesh, policy=self.policy, alpha=self.alpha,
                                      elementwise="owned", bucket_numel=REPLICATE_BUCKET_NUMEL)
        matrixfsdp.replicate(model, mesh=self.ctx.mesh, plan=plan, stage=2)
        self.model = model
        self.opts = [Muon(muon_param_groups(model.named_parameters()), **self.cfg.muon_kwargs())]
        self.notes.append(check_routes(self.opts[0], model.named_parameters()))
        named = self.named_parameters()
        load = [0.0] * self.world
        for (n, p), pp in zip(named, (plan[f] for f, _ in model.named_parameters())):
            load[pp.owner] += _muon_cost(n, p)
        self.balance = _imbalance(load)
        self.notes.append(f"plan_owners(policy={self.policy!r}, alpha={self.alpha}, elementwise='owned', "
                          f"bucket_numel={REPLICATE_BUCKET_NUMEL}) -> {len(dict(plan.meta)['buckets'])} buckets; "
                          f"replicate(stage=2); step balance (max/mean Muon FLOPs) {self.balance:.3f}")

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        # after step() only owners hold the new values until the next forward's all-gathers;
        # anything that reads parameters in between finishes them first (as state_dict() does)
        self.model.sync_params()
        return super().named_parameters()


def _replicate_impl(name: str, policy: str, alpha: float) -> type[Impl]:
    return type(f"MatrixReplicate_{name}", (MatrixReplicate,), {"name": name, "policy": policy, "alpha": alpha})


class ZeroRedundancyMuon(Impl):
    """DDP + torch's ``ZeroRedundancyOptimizer`` wrapping ``matrixfsdp.optim.Muon``: parameters
    partitioned by size (torch's greedy), each rank steps its partition, then every parameter is
    broadcast from its rank inside ``step()``."""

    name = "zero_redundancy_muon"

    def setup(self) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = build_model(self.cfg, self.ctx.device)
        self.model = DDP(model, gradient_as_bucket_view=True)
        self.model.register_comm_hook(None, _python_allreduce_hook)
        zero = ZeroRedundancyOptimizer(muon_param_groups(self.model.named_parameters()), optimizer_class=Muon,
                                       **self.cfg.muon_kwargs())
        self.opts = [zero]
        names = {id(p): n for n, p in self.named_parameters()}
        load = [sum(_muon_cost(names[id(p)], p) for g in groups for p in g["params"])
                for groups in zero._partition_parameters()]
        self.balance = _imbalance(load)
        self.notes.append(f"ZeroRedundancyOptimizer(optimizer_class=matrixfsdp.optim.Muon), torch's size-greedy "
                          f"partition; step balance {self.balance:.3f}")

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o.optim for o in self.opts]  # the local optimizer holds this rank's state


# ================================================================================ HSDP (issue 17)
class SingleMuon(Impl):
    """The single-process run, on every rank at once: the plain model on the whole global batch
    and ``matrixfsdp.optim.Muon`` over every parameter, no communication. Its parameters are the
    HSDP rows' parity reference; its step is the total matrix work (every matrix stepped once),
    timed under the same CPU contention as the distributed rows (every rank runs it)."""

    name = "single_muon"

    def setup(self) -> None:
        self.model = build_model(self.cfg, self.ctx.device)
        self.opts = [Muon(muon_param_groups(self.model.named_parameters()), **self.cfg.muon_kwargs())]
        self.notes.append(check_routes(self.opts[0], self.model.named_parameters()))
        self.notes.append("no process group: every rank runs the whole model on the whole global batch and "
                          "steps every parameter (the total step work, under the same CPU contention)")
        self._step = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = batch_for_step(self.cfg, self._step, 0, 1, self.ctx.device)  # the global batch
        self._step += 1
        return lm_loss(self.model, tokens)


def _hsdp_impl(name: str, base: type[Impl], doc: str) -> type[Impl]:
    """``base`` on the 2-D ``(dp_replicate, dp_shard)`` mesh: torch's ``fully_shard(mesh=mesh_2d)``
    is HSDP, and the optimizer collectives of the Muon baselines run within the shard group."""

    def setup(self: Impl) -> None:
        if self.ctx.mesh.ndim != 2:
            raise ValueError(f"{self.name} needs a 2-D (dp_replicate, dp_shard) mesh: run step_bench with --mesh R,S")
        base.setup(self)
        self.notes.append(doc)

    return type(f"HSDP_{base.__name__}", (base,), {"name": name, "setup": setup})


def _mfsdp_impl(name: str, replica_step: str) -> type[Impl]:
    return type(f"MatrixFSDP_{replica_step}", (MatrixFSDP,), {"name": name, "replica_step": replica_step})


HSDP_IMPLS: tuple[type[Impl], ...] = (
    SingleMuon,
    _hsdp_impl("hsdp_adamw", FSDP2AdamW, "torch HSDP: fully_shard(mesh=2-D): reduce-scatter in the shard group, "
               "all-reduce of the shard across replicas"),
    _hsdp_impl("hsdp_distmuon", FSDP2DistMuon, "HSDP: DistMuon's all-to-alls and Newton-Schulz within the shard "
               "group (dp_shard), repeated by every replica"),
    _hsdp_impl("hsdp_gather_muon", FSDP2GatherMuon, "HSDP: gather-Muon on the shard group, repeated by every replica"),
    _mfsdp_impl("mfsdp_repeat", "repeat"),
    _mfsdp_impl("mfsdp_split", "split"),
)


# ================================================================================ TP (issue 18)
def tp_composed(ctx: Context) -> bool:
    """Whether ``ctx.mesh`` is the 2-D ``("dp_shard", "tp")`` mesh of step_bench ``--tp T --world W``
    with W > T (TP composed with FSDP-style data parallelism) rather than dp=1's ``("tp",)`` mesh."""
    return ctx.mesh.ndim == 2 and tuple(ctx.mesh.mesh_dim_names or ()) == ("dp_shard", "tp")


def tp_mesh(ctx: Context) -> Any:
    """The TP mesh of step_bench ``--tp T``: the 1-D ``("tp",)`` mesh at dp=1 (every rank is one TP
    rank), ``mesh["tp"]`` of the ``("dp_shard", "tp")`` mesh at dp = W / T > 1."""
    if ctx.tp >= 2 and tp_composed(ctx):
        return ctx.mesh["tp"]
    if ctx.tp < 2 or ctx.mesh.mesh_dim_names != ("tp",):
        raise ValueError("the tp_* rows need a TP mesh: run step_bench with --tp T (T >= 2)")
    return ctx.mesh


def tp_parallelize(model: Decoder, mesh: Any, *, norm_hooks: bool = True) -> list[str]:
    """torch's Megatron-style TP plan on every decoder layer: q/k/v and gate/up
    ``ColwiseParallel``, o/down ``RowwiseParallel``; each attention module computes with its
    local heads (heads / tp, as torchtitan's TP plan does). The q/k norms act on local heads, so
    their gradients are all-reduced over the TP group (async, in backward; as Megatron does for
    norms whose inputs are split). Embedding, head and the other norms stay replicated (every
    rank computes them on the whole batch). Returns the TP-sharded matrices' FQNs.

    ``norm_hooks=False`` (TP composed with data parallelism): no gradient hooks; a data-parallel
    wrapper replaces the parameters, so the q/k norms' TP all-reduce is made after backward on
    the reduced (data-parallel) shards instead (:meth:`TPImpl.backward`)."""
    import dataclasses

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh.size()
    cfg = model.cfg
    if cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp:
        raise ValueError(f"TP {tp} needs heads ({cfg.num_attention_heads}) and KV heads "
                         f"({cfg.num_key_value_heads}) divisible by it (--heads, --kv-heads)")
    local = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                                num_key_value_heads=cfg.num_key_value_heads // tp)
    col, row = ("q_proj", "k_proj", "v_proj"), ("o_proj",)
    pending: list[Any] = []
    for layer in model.model.layers:
        parallelize_module(layer.self_attn, mesh, {**{n: ColwiseParallel() for n in col},
                                                  **{n: RowwiseParallel() for n in row}})
        parallelize_module(layer.mlp, mesh, {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                             "down_proj": RowwiseParallel()})
        layer.self_attn.cfg = local
        if cfg.qk_norm and norm_hooks:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.register_post_accumulate_grad_hook(
                    lambda p: pending.append(dist.all_reduce(p.grad, group=mesh.get_group(), async_op=True)))
    model._tp_pending = pending  # waited for in TPImpl.step
    return [f"model.layers.{i}.{m}.{n}.weight" for i in range(cfg.num_hidden_layers)
            for m, ns in (("self_attn", col + row), ("mlp", ("gate_proj", "up_proj", "down_proj"))) for n in ns]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class TPImpl(Impl):
    """Base of the ``tp_*`` rows: the bench Decoder under :func:`tp_parallelize` on the TP mesh;
    subclasses build the optimizer (``make_opt``).

    At dp > 1 (the ``("dp_shard", "tp")`` mesh) the parallelized model is then wrapped for data
    parallelism over ``mesh["dp_shard"]`` by ``wrap_dp`` (default: stock torch ``fully_shard`` per
    DecoderLayer + root, torch's FSDP2 + TP pattern; the matrixfsdp rows override it), and the q/k
    norms' TP all-reduce runs after backward on their data-parallel shards (:meth:`backward`)."""

    def setup(self) -> None:
        mesh = tp_mesh(self.ctx)
        self.composed = tp_composed(self.ctx)
        self.model = build_model(self.cfg, self.ctx.device)
        self.tp_fqns = tp_parallelize(self.model, mesh, norm_hooks=not self.composed)
        if self.composed:
            self.wrap_dp(self.ctx.mesh)
            self._norms = [self.model.get_parameter(f"model.layers.{i}.self_attn.{n}.weight")
                           for i in range(self.cfg.num_hidden_layers) for n in ("q_norm", "k_norm")] \
                if self.model.cfg.qk_norm else []
        self.opts = [self.make_opt(mesh)]
        self.notes.append(check_routes(self.opts[0], self.model.named_parameters()))

    def wrap_dp(self, mesh2: Any) -> None:
        """Stock torch FSDP2 over ``mesh2["dp_shard"]`` on the TP-parallelized model: every TP
        parameter becomes a 2-D DTensor ``(Shard(0) over dp, Shard(d) over tp)`` (``_StridedShard``
        when both split dim 0), the replicated ones ``Shard(0)`` over dp."""
        _fsdp2_wrap(self.model, mesh2["dp_shard"])
        self.notes.append(f"stock torch fully_shard per DecoderLayer + root on mesh['dp_shard'] "
                          f"({mesh2['dp_shard'].size()} ranks) over the TP-parallelized model (FSDP2 + TP)")

    def make_opt(self, mesh: Any) -> torch.optim.Optimizer:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if getattr(self, "composed", False) and self._norms:
            # the q/k norms' gradients are partial over TP (each TP rank normalizes its own heads):
            # sum the data-parallel-reduced shards over the TP group, as the dp=1 hooks do in backward
            group = tp_mesh(self.ctx).get_group()
            works = [dist.all_reduce(g, group=group, async_op=True)
                     for p in self._norms if p.grad is not None and (g := _local(p.grad)).numel()]
            for w in works:
                w.wait()

    def step(self) -> None:
        for w in self.model._tp_pending:  # the q/k norms' gradient all-reduces, issued in backward
            w.wait()
        self.model._tp_pending.clear()
        super().step()


def _chunk_sizes(n: int, k: int) -> list[int]:
    """Sizes of ``torch.chunk(range(n), k)`` padded with empty chunks to ``k`` (how DTensor's
    ``Shard`` and FSDP2 split a dimension)."""
    c = -(-n // k)
    return [max(0, min(c, n - i * c)) for i in range(k)]


class FullGatherMuon(Muon):
    """The redundant (Megatron ``duplicated`` / DistMuon-without-owners) step under FSDP2 + TP:
    momentum on the local ``(dp, tp)`` shard; per matrix one async ``all_gather_single`` of the
    momentum-updated shard over the whole ``("dp_shard", "tp")`` mesh (what ``full_tensor()`` of
    the update moves), Newton-Schulz on the whole matrix on every rank, keep this rank's shard.
    Stock FSDP2 lays the TP shard ``t`` of a matrix out as ``torch.chunk`` over dp of its rows, on
    rank ``mesh[d, t]``: the gathered pieces are pasted back in that order. AdamW-routed
    parameters update their shard locally."""

    def __init__(self, params: Any, *, mesh2: Any, **kw: Any):
        self._mesh2 = mesh2
        self._ranks = mesh2.mesh.tolist()  # [d][t] -> global rank
        self._flat = [r for row in self._ranks for r in row]
        if self._flat != list(range(dist.get_world_size())):
            raise ValueError("FullGatherMuon: the (dp_shard, tp) mesh must span the world in rank order")
        super().__init__(params, **kw)

    def _check_whole(self, p: torch.Tensor, local: torch.Tensor, index: int) -> None:
        pass  # shards are expected here

    def _layout(self, p: Any) -> tuple[int, list[int], list[list[int]]]:
        """(TP-split dim, TP-shard sizes along it, per TP rank the dp chunk sizes of its rows)."""
        from torch.distributed.tensor import Shard

        pl = p.placements[1]
        if not isinstance(pl, Shard):
            raise ValueError(f"FullGatherMuon: expected Shard over tp, got {p.placements}")
        dtp = pl.dim % 2
        dp, tp = self._mesh2.shape
        tsz = _chunk_sizes(p.shape[dtp], tp)
        rows = [_chunk_sizes(tsz[t] if dtp == 0 else p.shape[0], dp) for t in range(tp)]
        return dtp, tsz, rows

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        dp, tp = self._mesh2.shape
        me = dist.get_rank()
        d_me, t_me = divmod(me, tp)
        pending = []
        for _, group, p, route in self._routed():
            if p.grad is None:
                continue
            param = _local(p)
            grad = _local(p.grad)
            if route == "adamw":
                if param.numel():
                    self._adamw_step(param, grad, self.state[p], group)
                continue
            if not (isinstance(p, DTensor) and p.device_mesh.ndim == 2):
                raise ValueError("FullGatherMuon: Muon matrices must be 2-D (dp_shard, tp) DTensors")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf, m = state["momentum_buffer"], group["momentum"]
            buf.lerp_(grad, 1 - m)
            upd = grad.lerp(buf, m) if group["nesterov"] else buf
            dtp, tsz, rows = self._layout(p)
            R = max(max(r) for r in rows)
            C = max(tsz) if dtp == 1 else p.shape[1]
            send = torch.zeros(R, C, dtype=upd.dtype, device=upd.device)
            send[: upd.shape[0], : upd.shape[1]].copy_(upd)
            out = torch.empty(dp * tp * R, C, dtype=upd.dtype, device=upd.device)
            work = _all_gather_single(out, send, async_op=True)
            pending.append((p, param, group, out, work, dtp, tsz, rows, R))
        for p, param, group, out, work, dtp, tsz, rows, R in pending:
            work.wait()
            pieces = out.view(dp * tp, R, -1)
            cols = (lambda t: tsz[t]) if dtp == 1 else (lambda t: p.shape[1])
            shards = [torch.cat([pieces[self._ranks[d][t]][: rows[t][d], : cols(t)] for d in range(dp)], dim=0)
                      for t in range(tp)]
            full = torch.cat(shards, dim=dtp)
            ortho = zeropower_via_newtonschulz(full, group["ns_coefficients"], group["ns_steps"],
                                               group["eps"], group["ns_dtype"])
            mine = ortho.narrow(dtp, sum(tsz[:t_me]), tsz[t_me])
            mine = mine.narrow(0, sum(rows[t_me][:d_me]), rows[t_me][d_me])
            lr = group["lr"]
            param.mul_(1 - lr * group["weight_decay"])
            if param.numel():
                param.add_(mine, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return None


class TPRedundant(TPImpl):
    name = "tp_redundant"

    def make_opt(self, mesh: Any) -> torch.optim.Optimizer:
        if self.composed:
            self.notes.append(f"redundant baseline under FSDP2 + TP (Megatron 'duplicated' / DistMuon without owners): "
                              f"per TP-sharded matrix one async all_gather_single of the momentum-updated (dp, tp) "
                              f"shard over the whole ({'x'.join(map(str, self.ctx.mesh.shape))}) mesh (= full_tensor "
                              f"of the update), {self.cfg.ns_short} Newton-Schulz on the whole matrix on every rank, "
                              "keep own shard (FullGatherMuon)")
            return FullGatherMuon(muon_param_groups(self.model.named_parameters()), mesh2=self.ctx.mesh,
                                  **self.cfg.muon_kwargs())
        self.notes.append(f"Megatron TensorParallelMuon 'duplicated': per TP-sharded matrix one async all_gather_single "
                          f"of the momentum-updated shard over the TP group, {self.cfg.ns_short} Newton-Schulz on the "
                          "whole matrix on every TP rank, keep own shard (GatherMuon)")
        return GatherMuon(muon_param_groups(self.model.named_parameters()), group=mesh.get_group(),
                          **self.cfg.muon_kwargs())


class ShardLocalMuon(Muon):
    """Muon on each local TP shard (Megatron's ``blockwise``, MuonBP): no communication, inexact."""

    def _check_whole(self, p: torch.Tensor, local: torch.Tensor, index: int) -> None:
        pass  # the shard is the matrix here


class TPShardLocal(TPImpl):
    name = "tp_shard_local"
    same_numerics = False

    def make_opt(self, mesh: Any) -> torch.optim.Optimizer:
        if self.composed:
            self.notes.append("INEXACT (timing only): stock FSDP2 + TP, Newton-Schulz on each rank's local (dp, tp) "
                              "block, lr adjusted by the block's shape (Megatron 'blockwise' / MuonBP on the local "
                              "block); no optimizer communication")
        else:
            self.notes.append("INEXACT (timing only): Newton-Schulz on each rank's local shard, lr adjusted by the "
                              "shard's shape (Megatron 'blockwise' / MuonBP); no optimizer communication")
        return ShardLocalMuon(muon_param_groups(self.model.named_parameters()), **self.cfg.muon_kwargs())


class TPMicroGroups(TPImpl):
    """``matrixfsdp.tp.host_matrices`` + ``matrixfsdp.optim.Muon(model)``: each TP-sharded matrix
    stepped whole on one host, two fused all-to-alls per micro-group.

    At dp > 1: ``matrixfsdp.plan_owners(model, mesh)`` on the ``("dp_shard", "tp")`` mesh and
    ``matrixfsdp.fully_shard(..., mesh=mesh["dp_shard"])`` per DecoderLayer + root instead: owners
    are whole matrices per dp rank, the owner's TP row hosts each matrix's step (the plan's
    micro-groups; ``per_matrix``: ``tp_c_max=1``, one group per matrix), other rows idle."""

    name = "tp_microgroups"
    pipeline = True
    per_matrix = False  # True: one micro-group per matrix (unfused); dp=1: hosts by LPT
    lpt_hosts = False  # dp > 1: re-assign the plan's hosts by LPT (lpt_hosted_plan)

    def wrap_dp(self, mesh2: Any) -> None:
        import matrixfsdp

        kw = {"tp_c_max": 1} if self.per_matrix else {}
        plan = matrixfsdp.plan_owners(self.model, mesh2, block_types=(DecoderLayer,), **kw)
        if self.lpt_hosts:
            plan = lpt_hosted_plan(plan)
        dpm = mesh2["dp_shard"]
        for layer in self.model.model.layers:
            matrixfsdp.fully_shard(layer, mesh=dpm, plan=plan)
        matrixfsdp.fully_shard(self.model, mesh=dpm, plan=plan)
        if not self.pipeline:
            matrixfsdp.tp.set_pipeline(self.model, False)
        self.plan = plan
        dp, tp = mesh2.shape
        ranks = mesh2.mesh.tolist()
        load = [0.0] * (dp * tp)
        shapes = {pp.fqn: pp.shape for pp in plan.params}
        for s, groups in enumerate(plan.micro_groups):
            for g in groups:
                for f, h in g.members:
                    load[ranks[s][h]] += _ns_flops(torch.Size(shapes[f]))
        self.balance = _imbalance(load)
        self.micro_groups_per_row = [len(gs) for gs in plan.micro_groups]
        self.micro_groups = sum(self.micro_groups_per_row)
        self.notes.append(f"matrixfsdp.plan_owners(model, ({dp}, {tp}) mesh, block_types=(DecoderLayer,)"
                          + (", tp_c_max=1" if self.per_matrix else "") + ")"
                          + ("; hosts re-assigned by LPT over each owner row's groups (lpt_hosted_plan)" if self.lpt_hosts else "")
                          + f" digest={getattr(plan, 'digest', '?')}; "
                          f"matrixfsdp.fully_shard per DecoderLayer + root on mesh['dp_shard']"
                          + ("; matrixfsdp.tp.set_pipeline(model, False)" if not self.pipeline else "")
                          + f": micro-groups per owner row {self.micro_groups_per_row} (sizes "
                          f"{[[len(g.members) for g in gs] for gs in plan.micro_groups]}); host balance over the "
                          f"{dp * tp} ranks (max/mean NS FLOPs) {self.balance:.3f}")

    def make_opt(self, mesh: Any) -> torch.optim.Optimizer:
        import matrixfsdp

        if self.composed:
            return Muon(self.model, **self.cfg.muon_kwargs())
        groups = None
        if self.per_matrix:
            named = [(f, self.model.get_parameter(f)) for f in self.tp_fqns]
            host = lpt_owners(named, mesh.size())
            groups = [[(f, host[f])] for f in self.tp_fqns]
        wanted = set(self.tp_fqns)  # the benchmark's rule (every TP-split matrix), not a vocab-size heuristic
        used = matrixfsdp.tp.host_matrices(self.model, mesh, groups=groups, pipeline=self.pipeline,
                                           matrix_filter=lambda fqn, *_: fqn in wanted)
        self.executor = matrixfsdp.tp.tp_host_of(self.model.get_parameter(self.tp_fqns[0])).executor
        load = [0.0] * mesh.size()
        for g in used:
            for f, h in g:
                load[h] += _ns_flops(self.model.get_parameter(f).shape)
        self.balance = _imbalance(load)
        self.micro_groups = len(used)
        self.notes.append(f"host_matrices({'one group per matrix, LPT hosts' if self.per_matrix else 'planner groups'}, "
                          f"pipeline={self.pipeline}): {len(used)} micro-groups of sizes {[len(g) for g in used]}; "
                          f"host balance (max/mean NS FLOPs) {self.balance:.3f}")
        return Muon(self.model, **self.cfg.muon_kwargs())


def lpt_hosted_plan(plan: Any) -> Any:
    """``plan`` with each owner row's hosts re-assigned by LPT on Newton-Schulz FLOPs over all of
    its micro-groups (in execution order; ties to the lowest TP rank); groups, their order and
    members unchanged. For ``tp_c_max=1`` plans, whose one-matrix groups all take TP rank 0 (a
    fresh group's first host): the per-matrix all-to-alls with the hosts balanced as at dp=1's
    ``tp_unfused``. An ``OwnerPlan`` is a validated record: ``dataclasses.replace`` re-checks it and
    recomputes its digest (the same on every rank)."""
    import dataclasses

    shapes = {pp.fqn: pp.shape for pp in plan.params}
    rows = []
    for groups in plan.micro_groups:
        load = [0.0] * plan.tp
        new = []
        for g in groups:
            members = []
            for f, _ in g.members:
                h = min(range(plan.tp), key=lambda i: (load[i], i))
                load[h] += _ns_flops(torch.Size(shapes[f]))
                members.append((f, h))
            if len(members) > 1:
                raise ValueError("lpt_hosted_plan: for one-matrix micro-groups (tp_c_max=1) only")
            new.append(dataclasses.replace(g, members=tuple(members)))
        rows.append(tuple(new))
    return dataclasses.replace(plan, micro_groups=tuple(rows))


def _tp_hosted(name: str, pipeline: bool, per_matrix: bool, lpt_hosts: bool = False) -> type[Impl]:
    return type(f"TPMicroGroups_{name}", (TPMicroGroups,), {"name": name, "pipeline": pipeline, "per_matrix": per_matrix,
                                                            "lpt_hosts": lpt_hosts})


class TPUnfusedLPT(TPMicroGroups):
    """dp > 1 only: ``tp_unfused`` (``tp_c_max=1``) with LPT-balanced hosts, isolating fusion from
    host balance (``tp_c_max=1`` alone hosts every matrix on TP rank 0 of its owner row)."""

    name = "tp_unfused_lpt"
    per_matrix = True
    lpt_hosts = True

    def setup(self) -> None:
        if not tp_composed(self.ctx):
            raise ValueError("tp_unfused_lpt runs at dp > 1 (--tp T --world dp*T); at dp=1 tp_unfused has LPT hosts")
        super().setup()


TP_IMPLS: tuple[type[Impl], ...] = (TPRedundant, TPMicroGroups, _tp_hosted("tp_sequential", False, False),
                                    _tp_hosted("tp_unfused", True, True), TPShardLocal, TPUnfusedLPT)

IMPLS: dict[str, type[Impl]] = {
    c.name: c for c in (DDPMuon, FSDP2GatherMuon, FSDP2DistMuon, Zero1Owner, FSDP2AdamW, MatrixFSDP,
                        _replicate_impl("replicate_a0", "alpha_balanced", 0.0),
                        _replicate_impl("replicate_a0.5", "alpha_balanced", 0.5),
                        _replicate_impl("replicate_a1", "alpha_balanced", 1.0),
                        _replicate_impl("replicate_naive", "naive_static", 0.0),
                        ZeroRedundancyMuon, *HSDP_IMPLS, *TP_IMPLS)
}
