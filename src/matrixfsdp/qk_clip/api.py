"""``QKClip``: Kimi K2's QK-clip (MuonClip) on any model and placement.

[Note: QK-clip]
After each optimizer step, for every attention head ``h`` whose largest pre-softmax logit of the
step's forwards, ``S_h``, exceeds ``tau``, the rows producing its queries are scaled by
``gamma_h ** alpha`` and those producing its keys by ``gamma_h ** (1 - alpha)``, with
``gamma_h = tau / S_h`` (Kimi K2, Section 2.1, Algorithm 1); MLA's rotary query part by
``gamma_h``, its shared rotary key and the values never ([Note: QK-clip row blocks] in
``layout.py``). Under GQA a group's query heads and their key head share the factor of the
group's largest ``S``. Optimizer state (momentum) is never touched. Three phases:

* capture (``capture.py``, ``_hf.py``): every forward of the step folds each head's max logit
  into one packed float32 buffer on the device (all layers, every head, global head indices);
* reduce: one all-reduce with ``MAX`` of that buffer per step, over every rank that sees other data
  or other heads (the data-parallel ranks, HSDP replicas included, and the TP ranks under
  ``fully_shard`` + TP; ``placement.clip.data_parallel_device_and_group``), through ``comm/``'s
  counted collectives (``QKClip.counter``: ``"all_reduce_max"``). Nothing is read on the host: the
  factors are computed on the device, and a head that is not clipped is multiplied by exactly 1;
* rescale (:meth:`QKClip.clip`, an optimizer step post-hook): every rank scales the rows of
  the storage it holds (``placement.rows.local_rows``: an owner its whole matrix, a rank of an
  evenly sharded or hosted matrix its rows, a TP rank its heads, a replica its copy), whatever
  placement made it. A copy a runtime later overwrites (a non-stepping replica's, exchanged at the
  next forward) is scaled by the same factors, so every copy agrees either way.

[Note: QK-clip and QK-norm]
A module that normalizes each head's queries and keys (RMSNorm over ``head_dim``, as Qwen3 does)
divides the scale QK-clip puts into the projection's rows out again: the logits are bounded by the
norms' weights instead. The capture still records them; the scaling is applied as specified and
has (up to the norm's epsilon) no effect on the logits. ``QKClip`` warns once for such modules.

[Note: QK-clip floor]
``gamma = tau / S`` only where ``S > tau`` and ``S`` is finite; everywhere else ``gamma = 1``: a
head whose max logit is ``<= 0`` (where ``tau / S`` would be negative or infinite), that saw no
logit at all (``-inf``, e.g. a layer this rank's pipeline stage does not hold) or a NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..comm.collectives import CommCounter, collectives_for
from ..placement.clip import data_parallel_device_and_group
from ..placement.owned_tensor import local_tensor
from ..placement.rows import local_rows
from . import _hf
from .capture import sdpa_capture
from .layout import AttentionLayout, RowBlock, built_in_layout, warn_qk_norm

__all__ = ["QKClip"]

API = "matrixfsdp.qk_clip.QKClip"

Layouts = Mapping[str, AttentionLayout] | Callable[[str, nn.Module], "AttentionLayout | None"] | None


@dataclass
class _Rows:
    """One projection parameter of a layer, and the factor of each of its rows (see [Note:
    QK-clip row blocks])."""

    owner: nn.Module  # the module whose ``_parameters`` holds it
    attr: str
    param: torch.Tensor  # the parameter at attach time (the sharded one, under a runtime)
    blocks: list[tuple[RowBlock, torch.Tensor, torch.Tensor]]  # block, rows, heads (CPU int64)
    cached: dict[torch.device, list[tuple[str, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def current(self) -> torch.Tensor:
        """The parameter in the module's slot now, unless that is a runtime's unsharded leaf (a
        plain tensor in the slot of a DTensor parameter, during forward or backward)."""
        now = self.owner._parameters.get(self.attr)
        if now is None:
            return self.param
        if isinstance(self.param, DTensor) and not isinstance(now, DTensor):
            return self.param
        return now

    def on(self, device: torch.device) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        got = self.cached.get(device)
        if got is None:
            got = self.cached[device] = [(b.part, r.to(device), h.to(device)) for b, r, h in self.blocks]
        return got


@dataclass
class _Layer:
    name: str
    module: nn.Module
    layout: AttentionLayout
    offset: int  # the layer's first slot in the packed buffer
    rows: list[_Rows]
    head0: int | None = None  # global index of this rank's first computed head (TP), once known
    hooks: list[Any] = field(default_factory=list)
    modes: list[Any] = field(default_factory=list)


class QKClip:
    """QK-clip (MuonClip, Kimi K2): bound every attention head's max logit by ``tau`` after each
    optimizer step (see [Note: QK-clip] in ``qk_clip/api.py``).

    ``QKClip(model, optimizer)`` finds the attention modules of ``model`` (``layouts``: a
    ``{module name: AttentionLayout}`` mapping, a callable ``(name, module) -> AttentionLayout |
    None``, or ``None`` for the built-in layouts: matrixfsdp's decoder, Hugging Face Llama/Qwen
    (MHA, GQA) and DeepSeek-V3 (MLA); :func:`~matrixfsdp.qk_clip.built_in_layout`), attaches the
    capture to them, and registers :meth:`clip` as ``optimizer``'s step post-hook
    (``register_step_post_hook``; without ``optimizer``, call :meth:`clip` after each step). Any
    optimizer works, matrixfsdp's or torch's; any placement: a plain model, ``fully_shard``
    (flat, HSDP ``repeat``/``split``, hosted, + TP), ``replicate``, ``matrixfsdp.tp``, stock
    FSDP2. Build it after sharding and initialization, as the optimizer, on every rank.

    ``tau``: the threshold (Kimi K2: 100); ``alpha``: the query's share of the factor (0.5).
    ``process_group``: the group of the max all-reduce (default: every data-parallel and TP rank of
    the attention weights' meshes; a plain model: no reduction, or a ``DistributedDataParallel``'s
    group).

    Capture runs in training mode only (``module.training``). Attention through
    ``F.scaled_dot_product_attention`` (in eager mode), Hugging Face ``"sdpa"``/``"eager"``, and
    any kernel that reports its own maxima through :meth:`observe` (FlexAttention's ``max_scores``).

    Example::

        opt = matrixfsdp.optim.Muon(model, lr=0.02)
        qk = matrixfsdp.qk_clip.QKClip(model, opt, tau=100.0)
        for x, y in loader:
            loss(model(x), y).backward()
            opt.step()                       # then qk.clip(): one MAX all-reduce, rows rescaled
            opt.zero_grad()
            log(qk.max_logits())             # {layer: 0-dim tensor}, the step's maxima
    """

    def __init__(self, model: nn.Module, optimizer: Any = None, *, tau: float = 100.0, alpha: float = 0.5,
                 layouts: Layouts = None, process_group: Any = None) -> None:
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"{API}: tau must be a finite number > 0, got tau={tau!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"{API}: alpha must be a number in [0, 1], got alpha={alpha!r}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"{API}: model must be an nn.Module, got {type(model).__name__}")
        self.tau, self.alpha = float(tau), float(alpha)
        self._layers = self._find_layers(model, layouts)
        warn_qk_norm([l.name for l in self._layers if l.layout.qk_norm])
        self._group_arg = process_group
        self._ddp_group = getattr(model, "process_group", None)  # DistributedDataParallel's
        self._coll: Any = None
        self._resolved_for: tuple[int, ...] | None = None
        self._resolve_group()
        device = self._device()
        total = sum(l.layout.num_heads for l in self._layers)
        # the step's running maxima, and the last clipped step's (swapped at each clip)
        self._packed, self._last = (torch.full((total,), -math.inf, dtype=torch.float32, device=device)
                                    for _ in range(2))
        self._hf_configs: dict[int, tuple[Any, str]] = {}
        #: captures recorded since construction (for tests and diagnostics)
        self.records = 0
        #: clips run since construction
        self.steps = 0
        for layer in self._layers:
            self._attach(layer)
        self._step_hook = optimizer.register_step_post_hook(self._post_step) if optimizer is not None else None

    def _params(self) -> list[torch.Tensor]:
        return [r.current() for l in self._layers for r in l.rows]

    def _placed(self) -> tuple[int, ...]:
        return tuple(id(p) for p in self._params() if isinstance(p, DTensor) or hasattr(p, "_matrixfsdp_owned"))

    def _resolve_group(self) -> None:
        """The max all-reduce's group, from the parameters as they are now: at construction, and
        again at a clip that finds them placed otherwise (a QKClip built before sharding must
        reduce over the mesh the model was sharded on). May be collective (HSDP's flattened group
        is created on first use): every rank makes it at the same point."""
        params, group = self._params(), self._group_arg
        self._resolved_for = self._placed()
        if group is None and not any(isinstance(p, DTensor) or hasattr(p, "_matrixfsdp_owned") for p in params):
            group = self._ddp_group
        _, group = data_parallel_device_and_group(params, group)
        distributed = dist.is_available() and dist.is_initialized() and group is not None
        self._coll = collectives_for(group) if distributed and dist.get_world_size(group) > 1 else None

    # ------------------------------------------------------------------------------------- layers
    def _find_layers(self, model: nn.Module, layouts: Layouts) -> list[_Layer]:
        if layouts is not None and not callable(layouts) and not isinstance(layouts, Mapping):
            raise TypeError(f"{API}: layouts must be a mapping of module names to AttentionLayout, a callable "
                            f"(name, module) -> AttentionLayout | None, or None; got {type(layouts).__name__}")
        modules = dict(model.named_modules())
        if isinstance(layouts, Mapping):
            missing = sorted(set(layouts) - set(modules))
            if missing:
                raise ValueError(f"{API}: layouts name module(s) the model does not have: {missing[:3]}")
        layers, offset = [], 0
        for name, module in modules.items():
            if isinstance(layouts, Mapping):
                layout = layouts.get(name)
            elif layouts is not None:
                layout = layouts(name, module)
            else:
                layout = built_in_layout(module)
            if layout is None:
                continue
            if not isinstance(layout, AttentionLayout):
                raise TypeError(f"{API}: the layout of {name!r} must be an AttentionLayout, got {type(layout).__name__}")
            if getattr(module, _hf.RECORD_ATTR, None) is not None:
                raise ValueError(f"{API}: module {name!r} already has a QKClip attached; call remove() on it first")
            layers.append(_Layer(name, module, layout, offset, self._rows_of(name, module, layout)))
            offset += layout.num_heads
        if not layers:
            raise ValueError(f"{API}: found no attention module in {type(model).__name__} (built-in layouts: modules "
                             "with q_proj/k_proj or MLA's kv_b_proj and a config with num_attention_heads); declare "
                             "them with layouts={name: AttentionLayout.mha(...)}")
        return layers

    @staticmethod
    def _rows_of(name: str, module: nn.Module, layout: AttentionLayout) -> list[_Rows]:
        by_param: dict[str, _Rows] = {}
        for block in layout.blocks:
            path, _, attr = block.param.rpartition(".")
            try:
                owner = module.get_submodule(path) if path else module
            except AttributeError:
                owner = None
            p = owner._parameters.get(attr) if owner is not None else None
            if p is None:
                if block.optional:
                    continue
                raise ValueError(f"{API}: attention module {name!r} has no parameter {block.param!r} (its layout names it)")
            heads = layout.heads_of(block)
            need = block.offset + heads * block.stride
            if p.ndim < 1 or p.shape[0] < need:
                raise ValueError(
                    f"{API}: {name}.{block.param} has shape {tuple(p.shape)}, but its layout puts {heads} heads of "
                    f"{block.stride} rows at row {block.offset} (needs >= {need} rows)"
                )
            rows, hs = layout.rows_of(block)
            entry = by_param.setdefault(block.param, _Rows(owner, attr, p, []))
            entry.blocks.append((block, torch.tensor(rows, dtype=torch.long), torch.tensor(hs, dtype=torch.long)))
        return list(by_param.values())

    def _attach(self, layer: _Layer) -> None:
        record = lambda m, layer=layer: self._record(layer, m)  # noqa: E731
        if _hf.is_hf_attention(layer.module):
            _hf.attach(layer.module, record, self._hf_configs)
            return
        setattr(layer.module, _hf.RECORD_ATTR, record)

        def pre(module: nn.Module, args: Any) -> None:
            mode = sdpa_capture(record) if module.training else None
            if mode is not None:
                mode.__enter__()
            layer.modes.append(mode)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            mode = layer.modes.pop() if layer.modes else None
            if mode is not None:
                mode.__exit__(None, None, None)

        layer.hooks = [layer.module.register_forward_pre_hook(pre),
                       layer.module.register_forward_hook(post, always_call=True)]

    # ------------------------------------------------------------------------------------ capture
    def _record(self, layer: _Layer, m: torch.Tensor) -> None:
        H = layer.layout.num_heads
        m = m.detach().reshape(-1).float()
        n = m.numel()
        if n != H:  # this rank computes some heads only (TP): which, from the query rows it holds
            if layer.head0 is None:
                layer.head0 = self._first_head(layer, n)
            first = layer.head0
        else:
            first = 0
        if self._packed.device != m.device:  # the model moved after construction
            self._packed, self._last = self._packed.to(m.device), self._last.to(m.device)
        view = self._packed[layer.offset + first: layer.offset + first + n]
        torch.maximum(view, m, out=view)
        self.records += 1

    @staticmethod
    def _first_head(layer: _Layer, n: int) -> int:
        """The global index of the first of the ``n`` heads this rank computes: from the rows of
        the query projection in the module's slot during forward (a TP shard)."""
        q = next(((r, b) for r in layer.rows for b, _, _ in r.blocks if b.part == "q"), None)
        H = layer.layout.num_heads
        if q is not None:
            entry, block = q
            rows = local_rows(entry.owner._parameters[entry.attr])
            first, k = divmod(rows.start - block.offset, block.stride)
            if not k and len(rows) == n * block.stride and 0 <= first and first + n <= H:
                return first
        raise ValueError(
            f"{API}: attention module {layer.name!r} computed {n} of its {H} heads, and its query projection's "
            "local rows do not say which (expected a Shard(0) tensor-parallel projection holding whole heads)"
        )

    def observe(self, module: nn.Module, max_scores: torch.Tensor) -> None:
        """Record maxima a kernel reports itself for ``module`` (an attached attention module):
        ``max_scores`` ``[..., heads, L]`` (FlexAttention's ``AuxOutput.max_scores``, the scaled
        logit's maximum per query row) or ``[heads]``. Folded in like a captured forward, in
        training mode only.

        Example::

            out, aux = flex_attention(q, k, v, block_mask=bm, return_aux=AuxRequest(max_scores=True))
            qk.observe(self, aux.max_scores)
        """
        layer = next((l for l in self._layers if l.module is module), None)
        if layer is None:
            raise ValueError(f"{API}.observe: {type(module).__name__} is not an attention module of this QKClip")
        if not module.training:
            return
        t = max_scores.detach()
        if t.ndim >= 2:
            t = t.float().transpose(0, -2).reshape(t.shape[-2], -1).amax(1)
        self._record(layer, t)

    # ------------------------------------------------------------------------------------ rescale
    @torch.compiler.disable
    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # outside any graph of a compiled step (torch.compile(opt.step) traces its post-hooks): the
        # clip's all-reduce and the parameters' placement lookups stay eager
        self.clip()

    @torch.no_grad()
    def clip(self) -> None:
        """Reduce the step's max logits (one MAX all-reduce) and rescale every attention head
        whose max exceeds ``tau`` (see [Note: QK-clip]); then start the next step's maxima. Call on
        every rank after ``optimizer.step()`` (the step post-hook does)."""
        if self._placed() != self._resolved_for:  # sharded since construction
            self._resolve_group()
        if self._packed.device != (dev := self._device()):  # the model moved since (NCCL reduces on it)
            self._packed, self._last = self._packed.to(dev), self._last.to(dev)
        packed = self._packed
        if self._coll is not None:
            self._coll.all_reduce(packed, async_op=False, op="max")
        for layer in self._layers:
            self._rescale(layer, packed[layer.offset: layer.offset + layer.layout.num_heads])
        self._last, self._packed = packed, self._last
        self._packed.fill_(-math.inf)
        self.steps += 1

    def reset(self) -> None:
        """Drop the maxima recorded since the last :meth:`clip` (e.g. after a step that was
        skipped, such as a ``GradScaler`` step on non-finite gradients, whose forwards must not
        clip the next one). Local: no communication."""
        self._packed.fill_(-math.inf)

    def _rescale(self, layer: _Layer, S: torch.Tensor) -> None:
        L = layer.layout
        group_max = S.view(L.num_kv_heads, L.group_size).amax(1)
        # [Note: QK-clip floor]: only a finite max above tau clips
        gamma_kv = torch.where(torch.isfinite(group_max) & (group_max > self.tau), self.tau / group_max,
                               torch.ones_like(group_max))
        gamma = {"k": gamma_kv, "q": gamma_kv.repeat_interleave(L.group_size)}
        power = {"q": self.alpha, "q_rope": 1.0, "k": 1.0 - self.alpha}
        for entry in layer.rows:
            p = entry.current()
            rows = local_rows(p)
            if not len(rows):
                continue
            local = local_tensor(p)
            factor = torch.ones(p.shape[0], dtype=torch.float32, device=S.device)
            for part, idx, heads in entry.on(S.device):
                g = gamma["k" if part == "k" else "q"]
                factor[idx] = g[heads].pow(power[part])
            f = factor[rows.start: rows.stop].to(device=local.device, dtype=local.dtype)
            local.mul_(f.view(-1, *([1] * (local.ndim - 1))))

    # ------------------------------------------------------------------------------------ logging
    def max_logits(self, per_head: bool = False) -> dict[str, torch.Tensor]:
        """The last clipped step's max logits, reduced (the same on every rank), per layer name:
        a 0-dim tensor, or ``[num_heads]`` with ``per_head``; ``-inf`` where none was seen. Device
        tensors: reading them (``.item()``) is the caller's host sync."""
        out = {}
        for layer in self._layers:
            s = self._last[layer.offset: layer.offset + layer.layout.num_heads]
            out[layer.name] = s.clone() if per_head else s.max()
        return out

    def _device(self) -> torch.device:
        """Where the maxima are reduced and the factors computed: the device of the parameters'
        local tensors (the packed buffer follows the model if it moved after construction)."""
        for p in self._params():
            return local_tensor(p).device
        return self._packed.device

    @property
    def counter(self) -> CommCounter:
        """The counter of the collectives of the max all-reduce's group (``"all_reduce_max"``: one
        per :meth:`clip`), an empty one when there is no reduction."""
        return self._coll.counter if self._coll is not None else CommCounter()

    @property
    def layers(self) -> dict[str, AttentionLayout]:
        """The attention modules found, by name, with their layouts."""
        return {l.name: l.layout for l in self._layers}

    def remove(self) -> None:
        """Detach the capture and the step hook (the model runs as before ``QKClip``)."""
        for layer in self._layers:
            for h in layer.hooks:
                h.remove()
            layer.hooks = []
            _hf.detach(layer.module, {})
        _hf.detach(self._layers[0].module, self._hf_configs)
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
