"""The mixture-of-experts rows of ``step_bench.py --model moe`` (issue 26): four ways to train the
tests' MoE decoder (``tests/_moe.py``: expert stacks ``w1/w3 [E, F, D]``, ``w2 [E, D, F]`` in a
module named ``experts``, a router ``gate``, shared experts) with Muon on every expert matrix.

Routing is the same in every row (and is checked against ``matrixfsdp.MatrixRule``'s): each
expert stack is ``E`` independent matrices (``splits`` per expert; the fused ``gate_up_proj``
two), the other 2-D weights (attention, router, shared experts) are matrices, the embedding, the
output head and the norms go to AdamW. Newton-Schulz runs in ``BenchConfig.ns_dtype`` everywhere.

* ``moe_ddp`` (the reference): DDP; Muon = ``matrixfsdp.optim.Muon`` on every rank over per-expert
  2-D *views* of the stacks (each expert matrix its own parameter, stepped by the per-matrix 2-D
  rule; what a user writes with ``torch.optim.Muon``, whose Newton-Schulz is bf16 only);
* ``moe_owners``: ``matrixfsdp.plan_owners`` + ``fully_shard`` per block + root, ``Muon(model)``:
  whole experts per rank, the local step batched over each rank's experts, no collective;
* ``moe_distmuon``: stock FSDP2, DistMuon's scheme (torchtitan ``flex_shard`` ``Owned()``) with
  expert stacks as whole units: every Muon tensor (2-D matrix or 3-D expert stack) has an owner
  rank (LPT on Newton-Schulz FLOPs); per block one ``all_to_all_single`` sends the
  momentum-updated shards to their owners, the owner orthogonalizes (a stack: batched per expert),
  one ``all_to_all_single`` sends each rank its rows back. Blocks are pipelined (all first
  all-to-alls issued, then per block: wait, Newton-Schulz, issue the return). torchtitan 0.3.0's
  own DistMuon refuses ``Owned()`` on 3-D tensors, hence this re-implementation;
* ``moe_gather_muon``: stock FSDP2, gather-Muon: every Muon tensor's momentum-updated shard is
  all-gathered (async), every rank orthogonalizes every matrix and every expert (stacks batched),
  keeps its rows.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from matrixfsdp.optim import Muon
from matrixfsdp.optim._muon import batched_newtonschulz, lr_ratio, zeropower_via_newtonschulz

from .core import BenchConfig, Impl, imbalance, ns_flops, strip_prefix
from .ddp import python_allreduce_hook
from .fsdp2 import shard_group

_TESTS_MOE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "_moe.py")
#: 2-D tensors on AdamW (as the routing rule decides for this model: embedding, output head)
MOE_ADAMW_2D = ("embed.weight", "lm_head.weight")


def moe_module() -> Any:
    """``tests/_moe.py``, the MoE decoder the expert tests pin, loaded by path (no sys.path change)."""
    name = "_matrixfsdp_bench_moe"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _TESTS_MOE)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load the MoE model from {_TESTS_MOE}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def moe_config(cfg: BenchConfig) -> Any:
    return moe_module().MoEConfig(vocab=cfg.vocab_size, dim=cfg.hidden_size, ffn=cfg.moe_ffn,
                                  layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                                  experts=cfg.experts, top_k=cfg.top_k, shared=cfg.moe_shared,
                                  fused=cfg.moe_fused)


def build_moe_model(cfg: BenchConfig, device: torch.device | str | None = None) -> nn.Module:
    """The seeded MoE model (CPU init, then moved), its routing checked against matrixfsdp's rule."""
    model = moe_module().MoEModel(moe_config(cfg), seed=cfg.model_seed)
    from matrixfsdp import MatrixRule

    rule = MatrixRule().kinds(model)
    for n, p in model.named_parameters():
        want = rule[n].kind
        mine = {"muon": "matrix", "experts": "experts", "adamw": "elementwise"}[moe_kind(n, p)]
        if mine != want or (want == "experts" and rule[n].splits != moe_splits(n)):
            raise RuntimeError(f"benchmark routing of {n} ({mine}) differs from MatrixRule's ({rule[n]})")
    if device is not None and torch.device(device).type != "cpu":
        model.to(device)
    return model


def moe_block_type() -> type:
    return moe_module().MoEBlock


def moe_kind(name: str, p: torch.Tensor) -> str:
    """``"experts"`` (a 3-D expert stack), ``"muon"`` (a 2-D matrix) or ``"adamw"``."""
    name = strip_prefix(name)
    if p.ndim == 3:
        return "experts"
    return "muon" if p.ndim == 2 and name not in MOE_ADAMW_2D else "adamw"


def moe_splits(name: str) -> int:
    """Matrices per expert slice (MatrixRule's default ``fused``: ``gate_up_proj`` is two)."""
    return 2 if name.rpartition(".")[2] == "gate_up_proj" else 1


def tensor_ns_flops(name: str, p: torch.Tensor) -> float:
    """Newton-Schulz FLOPs of one step of a Muon tensor (a stack: all its expert matrices)."""
    if moe_kind(name, p) == "experts":
        s = moe_splits(name)
        return p.shape[0] * s * ns_flops(torch.Size((p.shape[1] // s, p.shape[2])))
    return ns_flops(p.shape)


def routes_note(named: list[tuple[str, torch.Tensor]]) -> str:
    kinds = [moe_kind(n, p) for n, p in named]
    mats = sum(p.shape[0] * moe_splits(n) for (n, p), k in zip(named, kinds) if k == "experts")
    return (f"routes: {kinds.count('muon')} matrices + {kinds.count('experts')} expert stacks ({mats} expert "
            f"matrices) Muon, {kinds.count('adamw')} AdamW")


def orthogonalize(name: str, full: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Newton-Schulz of a whole Muon tensor: a 2-D matrix, or each matrix of an expert stack
    (batched, as ``matrixfsdp.optim.Muon``'s expert step)."""
    args = (group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"])
    if full.ndim == 2:
        return zeropower_via_newtonschulz(full, *args)
    s = moe_splits(name)
    E, rows, cols = full.shape
    return batched_newtonschulz(full.reshape(E * s, rows // s, cols), *args).reshape(E, rows, cols)


def step_lr_ratio(name: str, p: torch.Tensor, group: dict[str, Any]) -> float:
    """Muon's per-shape lr factor of each matrix of ``p`` (a stack: of one expert matrix)."""
    if p.ndim == 3:
        s = moe_splits(name)
        return lr_ratio(group["adjust_lr_fn"], torch.Size((p.shape[1] // s, p.shape[2])))
    return lr_ratio(group["adjust_lr_fn"], p.shape)


def fsdp2_chunks(n: int, world: int) -> list[int]:
    """Rows per rank of FSDP2's ``Shard(0)`` (torch.chunk's rule; trailing ranks may get 0)."""
    sizes = [len(c) for c in torch.arange(n).chunk(world)]
    return sizes + [0] * (world - len(sizes))


def moe_fsdp2_wrap(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


# =========================================================================== moe_ddp (reference)
class MoEDDP(Impl):
    """DDP; ``matrixfsdp.optim.Muon`` on every rank, each expert matrix a 2-D view stepped alone."""

    name = "moe_ddp"

    def setup(self) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = self.ctx.device
        model = build_moe_model(self.cfg, dev)
        self.model = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, gradient_as_bucket_view=True)
        self.model.register_comm_hook(None, python_allreduce_hook)
        named = [(strip_prefix(n), p) for n, p in self.model.named_parameters()]
        mats, adamw, self._views = [], [], []
        for n, p in named:
            kind = moe_kind(n, p)
            if kind == "experts":
                s = moe_splits(n)
                E, rows, cols = p.shape
                whole = p.detach().view(E * s, rows // s, cols)
                for i in range(E * s):
                    v = whole[i]  # a view of the stack: the optimizer writes the stack in place
                    self._views.append((p, s, i, v))
                    mats.append(v)
            else:
                (mats if kind == "muon" else adamw).append(p)
        kw = self.cfg.muon_kwargs()
        self.opts = [Muon([{"params": mats, "algorithm": "muon"}, {"params": adamw, "algorithm": "adamw"}], **kw)]
        self.notes.append(routes_note(named) + f"; {len(mats)} 2-D Muon parameters after the per-expert views")
        self.notes.append("DDP(gradient_as_bucket_view=True, 25 MB buckets) with a Python all-reduce comm hook; "
                          f"matrixfsdp.optim.Muon(ns_dtype={self.cfg.ns_short}) on every rank, every expert matrix a "
                          "2-D view of its stack given to the optimizer as its own parameter (the per-matrix 2-D "
                          "step, one Newton-Schulz per expert matrix; torch.optim.Muon would do the same in bf16)")

    def step(self) -> None:
        for p, s, i, v in self._views:  # each view's gradient: its rows of the stack's gradient
            g = p.grad
            v.grad = None if g is None else g.view(-1, *v.shape)[i]
        super().step()

    def zero_grad(self) -> None:
        super().zero_grad()
        for _, _, _, v in self._views:
            v.grad = None


# =========================================================================== moe_owners
class MoEOwners(Impl):
    """matrixfsdp: ``plan_owners(model, mesh, block_types=MoEBlock)``, ``fully_shard`` per block +
    root, ``Muon(model)``; the step is local (whole experts per rank, batched Newton-Schulz)."""

    name = "moe_owners"

    def setup(self) -> None:
        import matrixfsdp

        model = build_moe_model(self.cfg)
        mesh = self.ctx.mesh
        plan = matrixfsdp.plan_owners(model, mesh, block_types=(moe_block_type(),))
        for block in model.blocks:
            matrixfsdp.fully_shard(block, mesh=mesh, plan=plan)
        matrixfsdp.fully_shard(model, mesh=mesh, plan=plan)
        self.model, self.plan = model, plan
        self.opts = [Muon(model, **self.cfg.muon_kwargs())]
        self.rank_cost = [s.cost for s in plan.rank_stats]
        self.balance = imbalance(self.rank_cost)
        routes = {}
        for g in self.opts[0].param_groups:
            key = g["algorithm"] + (f"/experts{g['experts']}" if g.get("experts") else "")
            routes[key] = routes.get(key, 0) + len(g["params"])
        stacks = [pp for pp in plan.params if pp.placement == "experts"]
        counts = sorted({tuple(pp.experts) for pp in stacks})
        self.notes.append(routes_note(list(model.named_parameters())) + "; Muon(model) groups: "
                          + ", ".join(f"{k} {v}" for k, v in routes.items()))
        self.notes.append(f"plan_owners(model, mesh, block_types=(MoEBlock,)) digest={plan.digest[:12]}; "
                          f"experts per rank {counts}; planner cost per rank (FLOPs) "
                          + ", ".join(f"{c / 1e9:.2f}G" for c in self.rank_cost)
                          + f" (max/mean {self.balance:.3f}); fully_shard per MoEBlock + root; "
                          f"Muon(model, ns_dtype={self.cfg.ns_short})")

    def param_tensors(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def time_alone(self, tokens: torch.Tensor, reps: int) -> float:
        """The local optimizer step of this rank timed while every other rank waits in a barrier
        (ranks in turn; one forward/backward first, whose gradients every timed step reuses):
        median of ``reps`` after one warm-up. Collective: every rank calls it."""
        import statistics
        import time

        self.forward_backward(tokens)
        mine = 0.0
        for r in range(self.world):
            dist.barrier()
            if r == self.rank:
                ts = []
                for i in range(reps + 1):
                    t0 = time.perf_counter()
                    self.step()
                    if i:
                        ts.append(time.perf_counter() - t0)
                mine = statistics.median(ts)
            dist.barrier()
        self.zero_grad()
        return mine


# =========================================================================== shared by the FSDP2 rows
class _ShardedMuonBase(torch.optim.Optimizer):
    """Muon on FSDP2 ``Shard(0)`` DTensors (2-D matrices and 3-D expert stacks; momentum on the
    local rows), AdamW (``matrixfsdp.optim.Muon``'s rule) on the rest; subclasses orthogonalize."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], cfg: BenchConfig, pg: Any) -> None:
        kw = cfg.muon_kwargs()
        self._names = {id(p): n for n, p in named}
        muon = [p for n, p in named if moe_kind(n, p) != "adamw"]
        super().__init__([{"params": muon}], {k: kw[k] for k in ("lr", "weight_decay", "momentum", "nesterov",
                                                                  "ns_coefficients", "eps", "ns_steps",
                                                                  "adjust_lr_fn", "ns_dtype")})
        self.adamw = Muon([{"params": [p for n, p in named if moe_kind(n, p) == "adamw"], "algorithm": "adamw"}],
                          **kw)
        self._pg = pg
        self.W = dist.get_world_size(pg)
        self.me = dist.get_rank(pg)

    def updates(self) -> list[tuple[str, torch.Tensor, torch.Tensor, dict[str, Any]]]:
        """Momentum step on the local rows: ``(name, param, local update, group)`` per Muon tensor."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = _local(p.grad)
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(grad)
                buf, m = st["momentum_buffer"], group["momentum"]
                buf.lerp_(grad, 1 - m)
                upd = grad.lerp(buf, m) if group["nesterov"] else buf
                out.append((self._names[id(p)], p, upd.contiguous(), group))
        return out

    def apply(self, name: str, p: torch.Tensor, ortho_rows: torch.Tensor, group: dict[str, Any]) -> None:
        param = _local(p)
        lr = group["lr"]
        param.mul_(1 - lr * group["weight_decay"])
        if param.numel():
            param.add_(ortho_rows.view_as(param), alpha=-(lr * step_lr_ratio(name, p, group)))


# =========================================================================== moe_gather_muon
def all_gather_single(*args: Any, **kwargs: Any) -> Any:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


class GatherStackMuon(_ShardedMuonBase):
    """gather-Muon: all-gather each Muon tensor's update (async, all issued first), every rank
    orthogonalizes everything, keeps its rows."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        pending = []
        for name, p, upd, group in self.updates():
            n = p.shape[0]
            rows = -(-n // self.W)
            send = upd.new_zeros((rows, *p.shape[1:]))
            send[: upd.shape[0]].copy_(upd)
            out = upd.new_empty((self.W * rows, *p.shape[1:]))
            pending.append((name, p, group, out, all_gather_single(out, send, group=self._pg, async_op=True)))
        for name, p, group, out, work in pending:
            work.wait()
            ortho = orthogonalize(name, out[: p.shape[0]], group)
            sizes = fsdp2_chunks(p.shape[0], self.W)
            off = sum(sizes[: self.me])
            self.apply(name, p, ortho[off: off + sizes[self.me]], group)
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


class MoEGatherMuon(Impl):
    name = "moe_gather_muon"

    def setup(self) -> None:
        model = moe_fsdp2_wrap(build_moe_model(self.cfg, self.ctx.device), self.ctx.mesh)
        self.model = model
        named = [(strip_prefix(n), p) for n, p in model.named_parameters()]
        self.opts = [GatherStackMuon(named, self.cfg, shard_group(self.ctx.mesh))]
        self.notes.append(routes_note(named))
        self.notes.append("stock torch fully_shard per MoEBlock + root (expert stacks Shard(0): "
                          f"{fsdp2_chunks(self.cfg.experts, self.world)} experts per rank); per Muon tensor one async "
                          "all_gather_single of the momentum-updated shard; every rank runs "
                          f"{self.cfg.ns_short} Newton-Schulz on every matrix and every expert (each stack batched), "
                          "keeps its rows")

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.opts[0], self.opts[0].adamw]  # Muon state and AdamW state


# =========================================================================== moe_distmuon
def lpt_tensor_owners(named: list[tuple[str, torch.Tensor]], world: int) -> dict[str, int]:
    """Owner of each Muon tensor (2-D matrix or whole expert stack): LPT on Newton-Schulz FLOPs."""
    load = [0.0] * world
    owners: dict[str, int] = {}
    for n, p in sorted(((n, p) for n, p in named if moe_kind(n, p) != "adamw"),
                       key=lambda x: (-tensor_ns_flops(*x), x[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        owners[n] = r
        load[r] += tensor_ns_flops(n, p)
    return owners


def all_to_all_single(*args: Any, **kwargs: Any) -> Any:
    return dist.all_to_all_single(*args, **kwargs)  # looked up at call time: the bench counts it


class OwnerStackMuon(_ShardedMuonBase):
    """DistMuon's scheme with expert stacks as whole units: per block, one all-to-all sends every
    rank's momentum-updated rows of each Muon tensor to its owner, the owner orthogonalizes its
    tensors whole (a stack batched per expert), one all-to-all returns the rows. All first
    all-to-alls are issued at once; then per block: wait, Newton-Schulz, issue the return."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], cfg: BenchConfig, pg: Any) -> None:
        super().__init__(named, cfg, pg)
        self.owner = lpt_tensor_owners(named, self.W)
        self.bucket_of = {n: (n.split(".")[1] if n.startswith("blocks.") else "root") for n, _ in named}
        load = [0.0] * self.W
        for n, p in named:
            if n in self.owner:
                load[self.owner[n]] += tensor_ns_flops(n, p)
        self.load = load

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        W, me = self.W, self.me
        buckets: dict[str, list[tuple[str, torch.Tensor, torch.Tensor, dict[str, Any]]]] = {}
        for item in self.updates():
            buckets.setdefault(self.bucket_of[item[0]], []).append(item)
        sent = []
        for items in buckets.values():
            # send: to each owner in rank order, the local rows of the tensors it owns (in order)
            order = sorted(range(len(items)), key=lambda i: (self.owner[items[i][0]], i))
            send = torch.cat([items[i][2].reshape(-1) for i in order])
            in_splits = [sum(items[i][2].numel() for i in order if self.owner[items[i][0]] == r) for r in range(W)]
            mine = [i for i in order if self.owner[items[i][0]] == me]
            row = {i: math.prod(items[i][1].shape[1:]) for i in mine}  # elements per dim-0 row
            out_splits = [sum(fsdp2_chunks(items[i][1].shape[0], W)[s] * row[i] for i in mine) for s in range(W)]
            recv = send.new_empty(sum(out_splits))
            work = all_to_all_single(recv, send, out_splits, in_splits, group=self._pg, async_op=True)
            sent.append((items, order, mine, row, in_splits, out_splits, recv, work))
        back = []
        for items, order, mine, row, in_splits, out_splits, recv, work in sent:
            work.wait()
            # rebuild each owned tensor whole: source s's piece holds its rows of every owned tensor
            pieces = list(recv.split(out_splits))
            fulls = {}
            for i in mine:
                name, p = items[i][0], items[i][1]
                chunks = fsdp2_chunks(p.shape[0], W)
                parts = []
                for s in range(W):
                    k = chunks[s] * row[i]
                    parts.append(pieces[s][:k])
                    pieces[s] = pieces[s][k:]
                fulls[i] = torch.cat(parts).view(p.shape)
            # Newton-Schulz on the owned tensors; return to each rank its rows, in the send layout
            orthos = {i: orthogonalize(items[i][0], fulls[i], items[i][3]) for i in mine}
            send_back = []
            for s in range(W):
                for i in mine:
                    chunks = fsdp2_chunks(items[i][1].shape[0], W)
                    off = sum(chunks[:s])
                    send_back.append(orthos[i][off: off + chunks[s]].reshape(-1))
            sb = torch.cat(send_back) if send_back else recv.new_empty(0)
            rb = recv.new_empty(sum(in_splits))
            back.append((items, order, rb, all_to_all_single(rb, sb, in_splits, out_splits, group=self._pg,
                                                             async_op=True)))
        for items, order, rb, work in back:
            work.wait()
            off = 0
            for i in order:  # rb holds, per owner in rank order, this rank's rows of its tensors
                name, p, upd, group = items[i]
                n = upd.numel()
                self.apply(name, p, rb[off: off + n], group)
                off += n
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)


class MoEDistMuon(Impl):
    name = "moe_distmuon"

    def setup(self) -> None:
        model = moe_fsdp2_wrap(build_moe_model(self.cfg, self.ctx.device), self.ctx.mesh)
        self.model = model
        named = [(strip_prefix(n), p) for n, p in model.named_parameters()]
        opt = OwnerStackMuon(named, self.cfg, shard_group(self.ctx.mesh))
        self.opts = [opt]
        self.balance = imbalance(opt.load)
        self.notes.append(routes_note(named))
        self.notes.append("stock torch fully_shard per MoEBlock + root; DistMuon's Owned() scheme re-implemented for "
                          "3-D stacks (torchtitan 0.3.0's DistMuon refuses Owned() on 3-D tensors): owners per Muon "
                          "tensor (each expert stack whole) by LPT on Newton-Schulz FLOPs, max/mean "
                          f"{self.balance:.3f}; per block one all_to_all_single of the momentum-updated shards to "
                          f"their owners and one back; {self.cfg.ns_short} Newton-Schulz on the owner, a stack batched "
                          "per expert; blocks pipelined")

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.opts[0], self.opts[0].adamw]  # Muon state and AdamW state


# =========================================================================== moe_tt_distmuon
class MoETorchtitanDistMuon(Impl):
    """Stock FSDP2 + torchtitan 0.3.0 ``DistMuon`` as documented for expert stacks: ``Owned()``
    per 2-D matrix (all-to-all to a temporary owner and back, one bucket per block) and
    ``Shard(0)`` compute for each 3-D stack ("a native batch-first 3D [M, R, C] parameter uses
    Shard(0) to distribute complete matrices"): each rank orthogonalizes the experts FSDP2's
    ``Shard(0)`` storage already gives it. The CPU patches of ``fsdp2_distmuon`` apply."""

    name = "moe_tt_distmuon"

    def setup(self) -> None:
        try:
            from torchtitan.distributed.flex_shard import (BucketConfig, ComputeLayout, Owned,
                                                           build_dist_muon)
        except ImportError as e:
            raise ImportError(f"torchtitan DistMuon unavailable: {e}") from e
        from torch.distributed.tensor import Shard

        from .distmuon import patch_torchtitan_for_cpu, patch_torchtitan_ns_dtype

        dev = self.ctx.device
        if dev.type == "cpu":
            patches = "CPU patches: " + "; ".join(patch_torchtitan_for_cpu(self.cfg.ns_torch_dtype))
        else:
            patches = patch_torchtitan_ns_dtype(self.cfg.ns_torch_dtype)
        model = moe_fsdp2_wrap(build_moe_model(self.cfg, dev), self.ctx.mesh)
        self.model = model
        named = [(strip_prefix(n), p) for n, p in model.named_parameters()]
        muon = [(n, p) for n, p in named if moe_kind(n, p) != "adamw"]
        if any(moe_splits(n) != 1 for n, p in muon if p.ndim == 3):
            raise ValueError("moe_tt_distmuon: fused stacks (gate_up_proj) are not one matrix per expert slice")
        owned = ComputeLayout(shardings_by_mesh_axis={"dp_shard": Owned()})
        batched = ComputeLayout(shardings_by_mesh_axis={"dp_shard": Shard(0)})
        kw = self.cfg.muon_kwargs()
        dist_muon = build_dist_muon(
            [{"params": [p for _, p in muon], "param_names": [n for n, _ in muon]}],
            compute_sharding_by_fqn={n: (batched if p.ndim == 3 else owned) for n, p in muon},
            bucket_configs=[BucketConfig(patterns=(f"blocks.{i}.*",), name=f"blocks.{i}")
                            for i in range(self.cfg.num_hidden_layers)],
            lr=kw["lr"], weight_decay=kw["weight_decay"], momentum=kw["momentum"], nesterov=kw["nesterov"],
            ns_coefficients=kw["ns_coefficients"], eps=kw["eps"], ns_steps=kw["ns_steps"],
            adjust_lr_fn=kw["adjust_lr_fn"],
        )
        adamw = Muon([{"params": [p for n, p in named if moe_kind(n, p) == "adamw"], "algorithm": "adamw"}], **kw)
        self.opts = [dist_muon, adamw]
        self.notes.append(routes_note(named))
        self.notes.append("stock torch fully_shard per MoEBlock + root; torchtitan DistMuon: Owned() per 2-D matrix, "
                          "Shard(0) compute per expert stack (each rank steps the experts of its FSDP2 shard, "
                          f"{fsdp2_chunks(self.cfg.experts, self.world)} per rank), one BucketConfig per block")
        self.notes.append(patches)

    def scratch_tensors(self) -> list[torch.Tensor]:  # DistMuon's reserved redistribution buffers
        from .distmuon import FSDP2DistMuon

        return FSDP2DistMuon.scratch_tensors(self)  # type: ignore[arg-type]


MOE_IMPLS: tuple[type[Impl], ...] = (MoEDDP, MoEOwners, MoEDistMuon, MoEGatherMuon, MoETorchtitanDistMuon)
