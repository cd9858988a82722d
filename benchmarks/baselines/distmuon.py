"""Stock FSDP2 + torchtitan 0.3.0 ``DistMuon`` (``fsdp2_distmuon``), with the patches that let
it run on CPU/gloo and the one that sets its Newton-Schulz dtype.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from matrixfsdp.optim import Muon

from .core import Impl, build_model, check_routes, is_muon_param
from .fsdp2 import fsdp2_wrap


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
        model = fsdp2_wrap(build_model(self.cfg, dev), self.ctx.mesh)
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
