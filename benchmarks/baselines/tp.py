"""What the ``tp_*`` rows (issue 18) share: the TP mesh, torch's Megatron-style TP plan on the
decoder (:func:`tp_parallelize`) and the :class:`TPImpl` base (FSDP2 over dp at dp > 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from matrixfsdp import Decoder

from .core import Context, Impl, build_model, check_routes
from .fsdp2 import fsdp2_wrap


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


def local_tensor(t: torch.Tensor) -> torch.Tensor:
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
        fsdp2_wrap(self.model, mesh2["dp_shard"])
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
                     for p in self._norms if p.grad is not None and (g := local_tensor(p.grad)).numel()]
            for w in works:
                w.wait()

    def step(self) -> None:
        for w in self.model._tp_pending:  # the q/k norms' gradient all-reduces, issued in backward
            w.wait()
        self.model._tp_pending.clear()
        super().step()
