"""The TP host step: fused, pipelined all-to-alls around whole-matrix steps on host ranks.

See [Note: TP hosts] in ``placement/tp_host.py``. Per micro-group ``k`` (the planner's
``plan_micro_groups``: matrices packed by cost into fused buffers, hosts by LPT)::

    gather k     one all_to_all_single: every rank sends each member's gradient shard to its host
    (issue k+1)  the next group's gather is in flight while k computes (async on gloo; NCCL
                 queues it on its own stream)
    host step    each host assembles the whole gradients it hosts and runs each one's update
                 rule (``rule.update``, [Note: update-rule protocol] in ``optim/rule.py``): the
                 additive update before decay (``W <- W * (1 - lr * wd) + update``)
    scatter k    one all_to_all_single: the update shards back to every rank
    apply        every rank decays its shard (``rule.decay()``) and adds its update shard

With ``pipeline=False`` the groups run one after another, as Canzona's own code does: each
group's gather and scatter are waited for before the next group's gather is issued (the same
collectives and arithmetic, so the same parameters bitwise; for benchmarks).

So a step makes exactly two all-to-alls per micro-group, within the TP group, and moves the
gradient shards once and the update shards once; optimizer state stays on the hosts, whole.
With ``shard_state`` (data-parallel hosting under ``fully_shard``) a rule whose state is
element-wise (Muon) keeps it on every rank's shard instead: each rank runs the rule's
``prepare`` on its gradient shard (momentum) and sends that, the host runs ``finish``
(Newton-Schulz) and keeps nothing ([Note: state on the shards] in ``optim/rule.py``): the same
bytes moved, the same bits.
Shards follow DTensor's ``Shard(d)`` (``torch.chunk``) sizes, so widths not divisible by the TP
degree work exactly.

[Note: gradients missing on some ranks]
Which matrices travel must be the same on every rank of the group, or the all-to-alls' splits
disagree (a hang on NCCL). ``p.grad is None`` is rank-local (a user clears one rank's gradient,
a rank left a matrix unused), so the stages come from what every rank shares: the hosted
parameters handed in, with ``requires_grad``. A rank without a gradient sends zeros, and each
member's chunk to its host ends with one flag per member (1: this rank has a gradient); the host
steps a member iff some rank flagged it, as an optimizer skips a ``None`` gradient, and the
scatter's chunks end with one flag per member (1: stepped), so every rank decays and adds only
what was stepped. A flag is read on the host (a sync) only by a rank that lacks the gradient
itself: a step where every rank has every gradient reads none. With the state on the shards a
rank without a gradient prepares zeros into a scratch copy of its state, kept iff the member
was stepped. The flags add one element per member and peer each way, and a member no rank has a
gradient for still travels (as zeros). Under ``fully_shard`` (``grads_agree``) neither is paid:
its reductions land a gradient on every rank of the group or on none ([Note: unused parameters]
in ``engine/reducer.py``), so ``p.grad`` is shared state there and stages members as it is.
The wire dtype is the promotion of the group's parameter dtypes, the same on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..comm.collectives import AllToAllCollectives, CommCounter

if TYPE_CHECKING:  # the protocol only: the executor never sees an optimizer (.importlinter)
    from ..optim.rule import UpdateRule

__all__ = ["TPHostStep", "shard_sizes"]


def shard_sizes(n: int, tp: int) -> list[int]:
    """Sizes of ``torch.chunk(n, tp)`` along the sharded dimension, one per rank (0 past the end)."""
    c = -(-n // tp) if n else 0
    return [max(0, min(c, n - r * c)) for r in range(tp)]


@dataclass(frozen=True)
class _Member:
    fqn: str
    param: Any  # the DTensor parameter
    host: int
    dim: int  # its Shard dimension

    def shard_shape(self, r: int, tp: int) -> tuple[int, ...]:
        shape = list(self.param.shape)
        shape[self.dim] = shard_sizes(shape[self.dim], tp)[r]
        return tuple(shape)

    def shard_numel(self, r: int, tp: int) -> int:
        s = self.shard_shape(r, tp)
        return s[0] * s[1]


class TPHostStep:
    """Runs the hosted matrices' optimizer step for one TP mesh (see module docstring)."""

    def __init__(self, mesh: DeviceMesh, groups: Sequence[Sequence[tuple[str, Any, int]]], *,
                 pipeline: bool = True, shard_state: bool = False, grads_agree: bool = False):
        self.mesh = mesh
        #: every rank of the group holds a gradient for the same parameters (fully_shard's
        #: reductions land them so: [Note: unused parameters] in engine/reducer.py); False: ``p.grad``
        #: is rank-local and the all-to-alls carry flags ([Note: gradients missing on some ranks])
        self.grads_agree = bool(grads_agree)
        self.pipeline = bool(pipeline)  #: False: no overlap between micro-groups
        #: rules with element-wise state keep it on the shards (see [Note: state on the shards])
        self.shard_state = bool(shard_state)
        self.group = mesh.get_group()
        self.tp = mesh.size()
        self.rank = mesh.get_local_rank()
        self.groups = [[_Member(f, p, h, _shard_dim(p)) for f, p, h in g] for g in groups]
        # comm/'s counted collectives over the TP group; an instance of its own, not the cached
        # one per group, so that each executor counts its own all-to-alls (two models on one TP
        # group, or the group also serving other collectives, keep separate counts)
        self.coll = AllToAllCollectives(self.group)
        self.host_steps = 0  #: whole-matrix steps this rank ran
        self._flag_chunks: dict[tuple[torch.device, tuple[float, ...]], torch.Tensor] = {}

    @property
    def _nflag(self) -> int:
        """Flag elements per member in each chunk (see [Note: gradients missing on some ranks])."""
        return 0 if self.grads_agree else 1

    def _flag_chunk(self, flags: Sequence[float], device: torch.device) -> torch.Tensor:
        """The flags of one chunk as a device tensor, made once per pattern and kept (read only:
        the packed send copies it). Built from the host list each step it would be one
        host-to-device copy from pageable memory (a host sync) per host, per micro-group, per
        step; the patterns are few (all ones while every rank has every gradient)."""
        key = (device, tuple(flags))
        t = self._flag_chunks.get(key)
        if t is None:
            if len(self._flag_chunks) >= 1024:  # ranks losing gradients in ever new patterns
                self._flag_chunks.clear()
            t = self._flag_chunks[key] = torch.tensor(key[1], device=device)
        return t

    @property
    def counter(self) -> CommCounter:
        """Calls and bytes of this executor's collectives (``"all_to_all_single"``), as comm/
        counts every engine collective; ``reset()`` it to count a step."""
        return self.coll.counter

    @property
    def calls(self) -> dict[str, int]:
        """``{"all_to_all": n}``: the all-to-alls this executor issued (see :attr:`counter`)."""
        return {"all_to_all": self.counter.calls.get("all_to_all_single", 0)}

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent to other ranks in those all-to-alls."""
        return self.counter.bytes_sent.get("all_to_all_single", 0)

    # ----------------------------------------------------------------------------- the step
    # Eager under torch.compile, as FSDP2 runs its hooks (disabled at definition): the step is
    # collectives between ranks and a few matmuls per micro-group. matrixfsdp's optimizers step
    # eagerly anyway once they hold a hosted matrix (MatrixOptimizer._eager_step: a traced step
    # around this one drifted 1e-3 from eager); this covers a caller that compiles its own call.
    @torch._dynamo.disable(recursive=True, reason="matrixfsdp host step: collectives run eagerly")
    @torch.no_grad()
    def step(self, items: Any, state: Any, params: Sequence[Any] | None = None) -> None:
        """Step hosted parameters, each with its update rule (``items``: ``[(param, rule), ...]``,
        the same parameters on every TP rank; ``rule`` implements ``matrixfsdp.optim.UpdateRule``,
        e.g. ``opt.rule_for(param)``), their state in ``state`` (``{param: state dict}``, e.g. the
        optimizer's ``state``; only hosts read or write it). A collective over the TP group:
        every TP rank calls it with the same parameters. A parameter without a gradient on any rank
        is skipped, on every rank alike; one some ranks lack a gradient for is stepped with zeros
        for their shards (see [Note: gradients missing on some ranks]).

        The earlier form ``step(optimizer, group, params)`` still works, through the optimizer's
        public ``rule_for`` and ``state``."""
        if params is not None:
            opt = items
            items, state = [(p, opt.rule_for(p)) for p in params], opt.state
        self._step(items, state)

    def _step(self, items: Sequence[tuple[Any, "UpdateRule"]], state: MutableMapping[Any, dict[str, Any]]) -> None:
        rules: dict[int, Any] = {}
        split: set[int] = set()  # state on the shards: prepare here, finish on the host
        for p, rule in items:
            if not (callable(getattr(rule, "update", None)) and callable(getattr(rule, "decay", None))):
                raise TypeError("matrixfsdp.tp.TPHostStep.step: every hosted parameter needs an update rule "
                                "with update() and decay() (matrixfsdp.optim.UpdateRule, e.g. "
                                f"opt.rule_for(p)), got {type(rule).__name__}")
            # staged from what every rank shares: see [Note: gradients missing on some ranks]
            staged = p.grad is not None if self.grads_agree else p.requires_grad
            if staged:
                rules[id(p)] = rule
                if self.shard_state and getattr(rule, "shards_state", False):
                    split.add(id(p))
        # one rank has no peer to agree with: what it has no gradient for is not staged at all
        stages = [[m for m in g if id(m.param) in rules and (self.tp > 1 or m.param.grad is not None)]
                  for g in self.groups]
        stages = [g for g in stages if g]
        if not stages:
            return
        ctx = _Ctx(rules, split, state)
        if not self.pipeline:  # sequential micro-groups: nothing of group k+1 starts before k is applied
            for members in stages:
                work, recv = self._gather(ctx, members)
                work.wait()
                updates = self._host_steps(ctx, members, recv)
                self._apply(ctx, members, *self._scatter(members, updates))
            return
        pending = self._gather(ctx, stages[0])
        scattered: list[tuple[list[_Member], Any, torch.Tensor]] = []
        for k, members in enumerate(stages):
            work, recv = pending
            work.wait()
            if k + 1 < len(stages):
                pending = self._gather(ctx, stages[k + 1])  # overlaps this group's host steps
            updates = self._host_steps(ctx, members, recv)
            scattered.append((members, *self._scatter(members, updates)))
            if len(scattered) > 1:  # the previous group's scatter has had this group's compute
                self._apply(ctx, *scattered.pop(0))
        for item in scattered:
            self._apply(ctx, *item)

    def _gather(self, ctx: "_Ctx", members: list[_Member]) -> tuple[Any, torch.Tensor]:
        """Each member's gradient shard to its host, or with its state on the shards, the rule's
        ``prepare`` of it (advancing this shard's state; an empty shard keeps an empty one, so
        every rank presents the same state keys in state dicts), then one flag per member sent
        to that host: 1 where this rank has a gradient (see [Note: gradients missing on some
        ranks])."""
        T, r = self.tp, self.rank
        send_parts, in_splits = [], [0] * T
        for h in range(T):
            flags = []
            for m in members:
                if m.host == h:
                    g = self._grad_or_zeros(ctx, m)
                    send_parts.append(g.reshape(-1))
                    in_splits[h] += g.numel() + self._nflag
                    flags.append(float(m.param.grad is not None))
            if flags and self._nflag:
                send_parts.append(self._flag_chunk(flags, m.param._local_tensor.device))
        n_mine = sum(m.host == r for m in members) * self._nflag
        out_splits = [sum(m.shard_numel(q, T) for m in members if m.host == r) + n_mine for q in range(T)]
        return self._all_to_all(send_parts, in_splits, out_splits, members)

    def _grad_or_zeros(self, ctx: "_Ctx", m: _Member) -> torch.Tensor:
        """What this rank sends of ``m``: its gradient shard (or its ``prepare``), zeros where this
        rank has no gradient. A rank without a gradient prepares zeros into a scratch copy of its
        state, kept only if some rank had a gradient (``_apply``)."""
        grad = m.param.grad
        g = grad._local_tensor if grad is not None else torch.zeros_like(m.param._local_tensor)
        if id(m.param) in ctx.split:
            st = ctx.state.setdefault(m.param, {})
            if grad is None:
                st = ctx.scratch[id(m.param)] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                                 for k, v in st.items()}
            g = ctx.rules[id(m.param)].prepare(g, st)
        ctx.sent_dtype[id(m.param)] = g.dtype
        return g

    def _host_steps(self, ctx: "_Ctx", members: list[_Member], recv: torch.Tensor) -> dict[str, torch.Tensor]:
        """The whole gradients (or prepared matrices) this rank hosts, assembled from ``recv``
        (rank-major, each rank's pieces then its flags), stepped where some rank had a gradient:
        the update of each stepped member, by fqn."""
        T, r = self.tp, self.rank
        mine = [m for m in members if m.host == r]
        pieces: dict[str, list[torch.Tensor]] = {m.fqn: [] for m in mine}
        flags = []
        off = 0
        for q in range(T):
            for m in mine:
                n = m.shard_numel(q, T)
                # back to the dtype the rank sent (the wire may be wider: mixed groups)
                pieces[m.fqn].append(recv[off:off + n].view(m.shard_shape(q, T)).to(ctx.sent_dtype[id(m.param)]))
                off += n
            flags.append(recv[off:off + len(mine) * self._nflag])
            off += len(mine) * self._nflag
        stepped = self._any_grad(mine, lambda: torch.stack(flags).amax(0))
        out = {}
        for m, go in zip(mine, stepped):
            if not go:  # no rank has a gradient: skipped, as an optimizer skips a None .grad
                continue
            whole = torch.cat(pieces[m.fqn], dim=m.dim)
            rule = ctx.rules[id(m.param)]
            if id(m.param) in ctx.split:  # stateless here: the state stayed on the shards
                out[m.fqn] = rule.finish(whole, dtype=m.param.dtype)
            else:
                out[m.fqn] = rule.update(whole, ctx.state.setdefault(m.param, {}), dtype=m.param.dtype)
            self.host_steps += 1
        return out

    @staticmethod
    def _any_grad(members: list[_Member], read: Any) -> list[bool]:
        """Whether some rank has each member's gradient: known without a host read where this
        rank has it (every step of a model whose ranks all produce gradients); else the flags are
        read (a host sync, only then)."""
        local = [m.param.grad is not None for m in members]
        if all(local):
            return local
        return [a or f > 0 for a, f in zip(local, read().tolist())]

    def _scatter(self, members: list[_Member], updates: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """The update shards back to every rank, then one flag per member: 1 where it was
        stepped (zeros and 0 where no rank had a gradient)."""
        T, r = self.tp, self.rank
        mine = [m for m in members if m.host == r]
        send_parts, in_splits = [], [0] * T
        for q in range(T):
            for m in mine:
                u = updates.get(m.fqn)
                if u is None:
                    part = m.param._local_tensor.new_zeros(m.shard_numel(q, T))
                else:
                    part = u.tensor_split(_offsets(u.shape[m.dim], T), dim=m.dim)[q]
                send_parts.append(part.reshape(-1))
                in_splits[q] += part.numel() + self._nflag
            if mine and self._nflag:
                send_parts.append(self._flag_chunk([float(m.fqn in updates) for m in mine],
                                                   mine[0].param._local_tensor.device))
        out_splits = [sum(m.shard_numel(r, T) for m in members if m.host == h)
                      + sum(m.host == h for m in members) * self._nflag for h in range(T)]
        return self._all_to_all(send_parts, in_splits, out_splits, members)

    def _all_to_all(self, send_parts: list[torch.Tensor], in_splits: list[int], out_splits: list[int],
                    members: list[_Member]) -> tuple[Any, torch.Tensor]:
        """One fused, asynchronous ``all_to_all_single`` within the TP group, through comm/'s
        counted collectives; its buffers: the packed send (``sum(in_splits)``) and the receive
        (``sum(out_splits)``), both in one dtype every rank derives alike: the promotion of the
        members' parameter dtypes (a group mixing bf16 and fp32 matrices travels in fp32; each
        piece is cast back where it lands)."""
        wire = functools.reduce(torch.promote_types, (m.param.dtype for m in members))
        like = members[0].param._local_tensor
        send = torch.cat([t.to(wire) for t in send_parts]) if send_parts else like.new_empty(0, dtype=wire)
        recv = like.new_empty(sum(out_splits), dtype=wire)
        return self.coll.all_to_all_single(recv, send, out_splits, in_splits, async_op=True), recv

    def _apply(self, ctx: "_Ctx", members: list[_Member], work: Any, recv: torch.Tensor) -> None:
        work.wait()
        T = self.tp
        off = 0
        for h in range(T):
            theirs = [m for m in members if m.host == h]
            spans = []
            for m in theirs:
                spans.append(off)
                off += m.param._local_tensor.numel()
            flags = recv[off:off + len(theirs) * self._nflag]
            off += len(theirs) * self._nflag
            for m, start, go in zip(theirs, spans, self._any_grad(theirs, lambda: flags)):
                scratch = ctx.scratch.pop(id(m.param), None)
                if not go:
                    continue
                if scratch is not None:  # prepared zeros for a step some rank had a gradient for
                    ctx.state.setdefault(m.param, {}).update(scratch)
                lr, wd = ctx.rules[id(m.param)].decay()
                local = m.param._local_tensor
                if wd:
                    local.mul_(1 - lr * wd)
                local.add_(recv[start:start + local.numel()].view(local.shape))


@dataclass
class _Ctx:
    """One step's rules, split members and state, and what the gathers noted."""

    rules: dict[int, Any]
    split: set[int]
    state: MutableMapping[Any, dict[str, Any]]
    #: each member's dtype as sent (its gradient's, or its prepare's)
    sent_dtype: dict[int, torch.dtype] = field(default_factory=dict)
    #: states prepared on zeros by a rank without a gradient, kept if the member is stepped
    scratch: dict[int, dict[str, Any]] = field(default_factory=dict)


def _offsets(n: int, tp: int) -> list[int]:
    out, acc = [], 0
    for s in shard_sizes(n, tp)[:-1]:
        acc += s
        out.append(acc)
    return out


def _shard_dim(p: Any) -> int:
    # one Shard(d) on the host mesh; on a 2-D (HSDP) data-parallel mesh the other dimension
    # replicates it (a hosted matrix of fully_shard: (Replicate(), Shard(0)))
    shards = [pl for pl in getattr(p, "placements", ()) if isinstance(pl, Shard)]
    if not isinstance(p, DTensor) or len(shards) != 1 or len(p.placements) - 1 != sum(
            pl.is_replicate() for pl in p.placements):
        raise ValueError(f"matrixfsdp.tp: a hosted matrix must be a DTensor with one Shard(d) placement "
                         f"on the host mesh, got {getattr(p, 'placements', type(p).__name__)}")
    return shards[0].dim % p.ndim
