"""Resolution, registration and checks of ``matrixfsdp.fully_shard`` (FSDP2's ``_fsdp_init``).

[Note: resolution at the root call]
The plan names parameters by their fqn in the *planned model* (the module given to
``plan_owners``), but ``fully_shard(block)`` only sees the block, and identical blocks are
indistinguishable by structure. So a call on a block only registers it (hooks, class swap, the
parameters it manages, exactly FSDP2's bottom-up rule: parameters of already wrapped submodules
belong to those); the call on the planned model, recognized because every block of the plan is
one of its submodules, then resolves every registered block by module identity, checks the model
against the plan and shards all parameters at once. Wrap blocks first and the model last, as with
FSDP2; the optimizer must be built after the last call. A block whose root call never came raises
at its first forward.

[Note: meta-device initialization]
As with FSDP2, a model may be built under ``torch.device("meta")``, planned (the planner only
reads shapes) and sharded: resolution then creates meta DTensors with each rank's segment shape
and allocates nothing. ``MatrixFSDPModule.to_empty`` gives every parameter fresh storage of that
shape on the device (swapping contents into the same parameter objects, so optimizers built
earlier keep working) and re-creates the block buffers there. It handles our parameters itself
because DTensor's dispatch, on a rank outside an owned parameter's one-rank mesh, returns a 1-D
``tensor([])`` (a scalar for 0-dim parameters) instead of the ``[0, ...]`` segment every layout
computation assumes, and because torch's swap drops the :class:`Owned` metadata. For the same
reason initialization goes through ``set_full_`` (full tensors computed alike on every rank) or a
checkpoint load, not ``torch.nn.init`` on the DTensors (``trunc_normal_`` raises on non-owners).
If torch code swaps our parameters anyway (``to_empty``/``to`` called on an outer wrapper or an
inner submodule), ``BlockState.repair_layout`` -- run at every root forward outside backward and
in the checkpoint helpers -- restores the layout and metadata, keeping correctly shaped data;
parameters still on meta raise there.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..comm.collectives import collectives_for
from ..engine.exchange import Exchange, GatherUnit, any_rank, version_stamp
from ..engine.reducer import replica_comm
from ..engine.swap import attached_state
from ..mesh import MeshInfo
from ..placement.owner import FQN_ATTR, StepReceipt, mesh_scratch, owner_of, set_owner
from ..planner.owner_plan import OwnerPlan, ParamPlan
from ..planner.owners import plan_owners
from ..planner.rules import DecidedRule, MatrixRule, head_rows_of, moe_structure
from ..placement.stepping import KIND_OF_PLACEMENT, check_planned
from .param import ManagedParam, shard_param
from .param_group import CommContext, check_one_dtype
from .hosted import attach_dp_hosts
from .tp_params import attach_tp_hosts, check_plan_tp, localize, tp_layout
from .state import BlockState, RootContext

API = "matrixfsdp.fully_shard"
# Set on parameters claimed by a fully_shard call before resolution (detects top-down wrapping
# and parameters tied across blocks); a weakref to the claiming BlockState.
CLAIM_ATTR = "_matrixfsdp_claimed_by"


def get_state(module: nn.Module) -> BlockState | None:
    """The :class:`BlockState` of a ``matrixfsdp.fully_shard``-ed module, else ``None``."""
    return attached_state(module, BlockState)


def _collect_managed(module: nn.Module, ignored: set[nn.Parameter], dp: DeviceMesh) -> list[ManagedParam]:
    """Parameters of ``module`` not under an already wrapped submodule (FSDP2's rule); TP
    DTensors of ``dp``'s TP sibling mesh carry their layout (see [Note: owners of TP-sharded
    parameters] in ``tp_params.py``)."""
    by_id: dict[int, ManagedParam] = {}
    visited: set[int] = set()

    def visit(m: nn.Module, prefix: str) -> None:
        if id(m) in visited:
            return
        visited.add(id(m))
        for attr, p in m._parameters.items():
            name = prefix + attr
            if p is None or p in ignored:
                continue
            claim = getattr(p, CLAIM_ATTR, None)
            owner = claim() if claim is not None else None
            if owner is not None:
                raise ValueError(
                    f"{API}: parameter {name!r} of {type(module).__name__} is already managed by "
                    f"the fully_shard call on {type(owner.module).__name__}; wrap blocks "
                    "bottom-up (blocks first, the model last) and keep tied parameters inside "
                    "one wrapped module; a parameter shared by two separately planned models (e.g. "
                    "two pipeline stages of one rank) is not supported: give each its own"
                )
            tp = tp_layout(name, p, dp) if isinstance(p, DTensor) else None
            mp = by_id.get(id(p))
            if mp is None:
                by_id[id(p)] = ManagedParam(fqn=name, sites=((m, attr),), orig=p, tp=tp)
            else:
                mp.sites = (*mp.sites, (m, attr))
        for child_name, child in m.named_children():
            if get_state(child) is None:
                visit(child, f"{prefix}{child_name}.")

    visit(module, "")
    return list(by_id.values())


# [Note: drop-in planning]
# Without ``plan``, ``fully_shard`` works like torch's: every call shards the parameters it manages
# at once (so an optimizer built after the last call sees the sharded ones). Each call plans its
# own parameters with the planner's defaults, as one scope, and then relabels ranks so that the
# call's most loaded rank (owned parameter and optimizer-state bytes) goes to the rank the earlier
# calls of the same model loaded least: an online LPT over calls, in program order, identical on
# every rank, and checked across ranks (one 32-byte all-gather per call). A call whose module
# contains modules wrapped before becomes their root (FSDP2 finds its root the same way, lazily);
# the root must be wrapped before the first forward. A whole-model ``plan`` balances better (it
# sees every block at once); this path is for drop-in use.
#
# The tally is the model's, not the process's: each call keeps its per-rank loads on its
# BlockState, and the calls still waiting for a root are listed, weakly, in the mesh's scratch
# dict (``mesh_scratch``: shared by equal meshes, dropped with them). A call sums the loads of
# those and of the wrapped modules it adopts, in call order (the same float sums as one running
# tally); a call that adopts earlier calls completes a model and starts a new tally, so a second
# model's owners do not depend on the first one's existence. Blocks wrapped first and the model
# last balance as one scope; with nested roots (layers, then a stack of them, then the model) a
# stack's call starts a new tally for the next stack's layers, and the model's own call counts
# every module it adopts.
_PENDING = "fully_shard.dropin_pending"


def _tally(W: int, states: Iterable[BlockState]) -> list[float]:
    tally = [0.0] * W
    for s in states:
        for r, load in enumerate(s.dropin_loads or ()):
            tally[r] += load
    return tally


def plan_dropin(holder: nn.Module, decided: MatrixRule, world: Any) -> OwnerPlan:
    """The planner call of one drop-in call (pure: the property test plans with it too)."""
    # placement="owned": a call's plan is one scope of its own, and hosting needs one executor per
    # root with the whole model's host groups; a hosted entry with no host attached would be an
    # evenly sharded matrix that the optimizer steps element-wise (issue 39: the default became
    # placement="auto" in 5e016cd, and this path never attached hosts).
    return plan_owners(holder, world, blocks=[holder], matrix_rule=decided, placement="owned")


def plan_call(params: list[ManagedParam], info: MeshInfo, state: BlockState,
              adopted: list[BlockState], module: nn.Module, rule: MatrixRule) -> OwnerPlan:
    """The plan of one plan-less ``fully_shard`` call (see [Note: drop-in planning]); records
    the call's loads on ``state``. The routing rule classifies the parameters on their real
    modules (an ``nn.Embedding`` stays element-wise, an experts module's stacks are expert
    stacks), so a drop-in call routes as a planned one and the plain model do."""
    W = info.shard_size
    tp = [mp.fqn for mp in params if mp.tp is not None]
    if tp:
        raise ValueError(
            f"{API}: parameter {tp[0]!r} is tensor-parallel (a DTensor on the TP mesh); TP needs a "
            "whole-model plan: plan = matrixfsdp.plan_owners(model, mesh) with the "
            "(\"dp_shard\", \"tp\") mesh, then fully_shard(block, mesh=mesh[\"dp_shard\"], plan=plan)"
        )
    holder = nn.Module()  # the call's own parameters, by their names in the call's module
    for mp in params:
        *path, attr = mp.fqn.split(".")
        m = holder
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        orig = mp.orig
        m.register_parameter(attr, nn.Parameter(torch.empty(orig.shape, dtype=orig.dtype, device="meta"),
                                                requires_grad=orig.requires_grad))
    head_rows, structure = head_rows_of(module), moe_structure(module)
    decided = DecidedRule(decided={mp.fqn: rule.kind(mp.fqn, mp.orig, mp.sites[0][0], head_rows, structure)
                                   for mp in params})
    plan = plan_dropin(holder, decided, (info.replicate_size, W) if info.is_hsdp else W)
    loads = [0.0] * W
    for pp in plan.params:
        if pp.owner is not None:
            loads[pp.owner] += pp.nbytes + pp.state_nbytes
        elif pp.placement == "experts":
            for r in range(W):
                loads[r] += (pp.nbytes + pp.state_nbytes) * pp.share(r, W)
    tally = _tally(W, _scope(info, adopted))
    heavy = sorted(range(W), key=lambda r: (-loads[r], r))
    light = sorted(range(W), key=lambda r: (tally[r], r))
    perm = dict(zip(heavy, light))
    state.dropin_loads = [0.0] * W
    for r in range(W):
        state.dropin_loads[perm[r]] = loads[r]
    def relabel(pp: ParamPlan) -> ParamPlan:
        if pp.placement == "experts":  # rank perm[r] takes what the plan gave r
            counts = [0] * W
            for r, n in enumerate(pp.experts):
                counts[perm[r]] = n
            return dataclasses.replace(pp, experts=tuple(counts))
        return dataclasses.replace(pp, owner=None if pp.owner is None else perm[pp.owner])

    return dataclasses.replace(plan, params=tuple(relabel(pp) for pp in plan.params))


def _scope(info: MeshInfo, adopted: list[BlockState]) -> list[BlockState]:
    """The earlier calls of the model being wrapped: those waiting for a root on this mesh (in
    call order), then the ones this call adopts that are not among them (in module order)."""
    pending = [s for ref in mesh_scratch(info.mesh).get(_PENDING, ()) if (s := ref()) is not None]
    seen = {id(s) for s in pending}
    return pending + [s for s in adopted if id(s) not in seen]


def end_call(state: BlockState, info: MeshInfo, adopted: list[BlockState]) -> None:
    """After a plan-less call: it waits for a root, or, adopting earlier calls, closes the model's
    tally (see [Note: drop-in planning])."""
    scratch = mesh_scratch(info.mesh)
    if adopted:
        scratch.pop(_PENDING, None)
    elif state.dropin_loads is not None:
        scratch.setdefault(_PENDING, []).append(weakref.ref(state))


def chunk_order(params: list[ManagedParam], plan_order: dict[str, int]) -> None:
    """Order a block's parameters as its chunks travel: ``split`` parameters first (by plan
    order, which puts each owner's in step-replica order), then the rest (see [Note: replica
    phase] in ``param_group.py``). Without HSDP split this is plan order."""
    params.sort(key=lambda mp: (mp.plan.step_replica is None, plan_order[mp.fqn]))  # type: ignore[union-attr]


def attach_exchange(ctx: RootContext, info: MeshInfo) -> None:
    """HSDP split: one deferred gather per block holding split parameters on this rank, and the
    exchange on every split parameter's descriptor (see [Note: deferred gathers])."""
    split = [mp for s in ctx.states for mp in s.params if mp.plan.step_replica is not None]  # type: ignore[union-attr]
    if not info.is_hsdp or not split:
        return
    # the units gather over the replicate group, so that is where their stamps are agreed on
    agree = any_rank(collectives_for(info.replicate_group, ctx.root.config.collectives), info.device)
    ex = Exchange(agree=agree, refresh_after_settle=True)
    for s in ctx.states:
        g = s.group
        mine = [mp for mp in s.params
                if mp.plan.step_replica is not None and mp.plan.owner == info.shard_rank]  # type: ignore[union-attr]
        if mine:
            # the step replica writes these (and the other replicas receive them)
            unit = GatherUnit(g.replica_gather, lambda mine=mine: version_stamp(mp.sharded for mp in mine))
            ex.units.append(unit)
            g.exchange = (ex, unit)
    for mp in split:
        info = owner_of(mp.sharded)
        # a receipt per parameter, kept when an earlier drop-in call's blocks are re-rooted
        receipt = info.receipt if info.receipt is not None else StepReceipt()  # type: ignore[union-attr]
        set_owner(mp.sharded, dataclasses.replace(info, exchange=ex, receipt=receipt))  # type: ignore[arg-type]
    ctx.exchange = ex


def check_wrapped(name: str, module: nn.Module, state: BlockState, mesh: Any, root: str) -> None:
    """The checks every wrapped module passes under its root, on either path: one mesh, and one
    parameter dtype unless ``mp_policy.param_dtype`` gives one."""
    where = repr(name) if name else type(module).__name__
    if state.config.mesh != mesh:
        raise ValueError(f"{API}: {where} was wrapped with mesh {state.config.mesh} but {root} with "
                         f"{mesh}; use one data-parallel mesh for the whole model")
    if state.resolved:  # sharded by an earlier drop-in call, which checked its dtypes
        return
    check_one_dtype(where, [mp.orig.dtype for mp in state.params], state.config.mp_policy)  # type: ignore[union-attr]


def make_root(root: BlockState, entries: list[tuple[str, BlockState]], info: MeshInfo) -> RootContext:
    """Make ``root`` the root of ``entries`` (every wrapped module under it, by name, itself
    included), on either path: one :class:`CommContext`; states not resolved yet are resolved
    onto it, those an earlier drop-in call resolved are re-rooted; one exchange for them all."""
    comm = CommContext(info.device)
    for name, s in entries:
        if s.resolved:  # an earlier drop-in call's: its blocks join the new root
            s.fqn = s.group.fqn = name
            s.group.comm = comm
            s.group.exchange = None
        else:
            s.resolve(fqn=name, rank=info.shard_rank,
                      coll=collectives_for(info.shard_group, s.config.collectives),
                      comm=comm, replicas=replica_comm(info, s.config.collectives))
    ctx = RootContext(root=root, states=[s for _, s in entries], comm=comm)
    for _, s in entries:
        s.ctx, s.is_root = ctx, s is root
    attach_exchange(ctx, info)
    return ctx


def dropin_mismatches(kinds: dict[str, Any], placements: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(fqn, kind the earlier call planned, kind of the whole model)`` for every parameter whose
    drop-in placement disagrees with the rule on the whole module (see [Note: routing invariant]
    in ``planner/rules.py``): a block's call cannot see what lies outside it (the embedding whose
    vocabulary makes a weight an output head, a router beside a wrapped experts module)."""
    out = []
    for fqn, placement in sorted(placements.items()):
        k = kinds.get(fqn)
        planned = KIND_OF_PLACEMENT.get(placement)
        if k is not None and planned is not None and k.kind != planned:
            out.append((fqn, planned, k.kind))
    return out


def check_dropin_kinds(module: nn.Module, entries: list[tuple[str, BlockState]], rule: MatrixRule) -> None:
    """A drop-in root: every parameter its earlier calls planned gets the kind the rule gives it on
    the whole module, or a ``ValueError`` (same modules and plans on every rank: raised alike)."""
    placements = {mp.fqn: mp.plan.placement for _, s in entries for mp in s.params  # type: ignore[union-attr]
                  if mp.plan is not None}
    bad = dropin_mismatches(rule.kinds(module), placements)
    if not bad:
        return
    fqn, planned, whole = bad[0]
    more = f" (and {len(bad) - 1} more: {[b[0] for b in bad[1:4]]})" if len(bad) > 1 else ""
    raise ValueError(
        f"{API}: drop-in calls planned {fqn!r} as {planned!r}, but the routing rule on the whole "
        f"{type(module).__name__} makes it {whole!r}{more}: the call that wrapped it could not see the "
        "modules around it (an embedding whose vocabulary size makes it an output head, a router "
        "beside an experts module wrapped alone); plan the whole model (plan = plan_owners(model, mesh, "
        "blocks=...), then fully_shard(..., plan=plan)), or pass every fully_shard call the same "
        "explicit matrix_rule (MatrixRule(vocab_sizes=..., expert_stacks=..., router_names=...))"
    )


def resolve_call(module: nn.Module, state: BlockState, plan: OwnerPlan | None, info: MeshInfo,
                 rule: MatrixRule | None = None) -> None:
    """Shard one plan-less call's parameters and make its module the root of every wrapped module
    under it (see [Note: drop-in planning])."""
    mesh = info.mesh
    check_wrapped("", module, state, mesh, "its root")
    if plan is not None:  # None: the module manages no parameter of its own
        order = {p.fqn: i for i, p in enumerate(plan.params)}
        for mp in state.params:
            mp.plan = plan[mp.fqn]
        chunk_order(state.params, order)
        for mp in state.params:
            shard_param(mp, info)
    entries = [(name, s) for name, m in module.named_modules() if (s := get_state(m)) is not None]
    for name, s in entries:
        if s.ctx is not None and s.ctx.forward_order:
            raise RuntimeError(
                f"{API}: {name!r} already ran forward under another root; wrap the root "
                "(the model) before the first forward"
            )
        if s is not state:  # (checked above, before sharding)
            check_wrapped(name, module.get_submodule(name), s, mesh, "its root")
    make_root(state, entries, info)
    if plan is not None:
        check_routing([state], f"drop-in fully_shard({type(module).__name__}) plan")
    names: dict[int, str] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    for _, s in entries:
        for mp in s.params:  # names relative to the (new) root
            mp.fqn = names.get(id(mp.sharded), mp.fqn)
            setattr(mp.sharded, FQN_ATTR, mp.fqn)
    if rule is not None and len(entries) > 1:
        check_dropin_kinds(module, entries, rule)


def check_routing(states: list[BlockState], where: str) -> None:
    """After a plan is applied: every parameter it placed as a matrix is stepped as one (see
    [Note: routing invariant] in ``planner/rules.py``); same plan, same answer on every rank."""
    for s in states:
        for mp in s.params:
            if mp.sharded is not None:
                check_planned(mp.sharded, where, mp.fqn)


def _is_planned_model(module: nn.Module, plan: OwnerPlan) -> bool:
    names = {name for name, _ in module.named_modules()}
    return all(b in names for b in plan.blocks)


def _resolve(root: nn.Module, plan: OwnerPlan, info: MeshInfo) -> None:
    """Check the whole model against the plan, then shard every parameter (root call only)."""
    mesh = info.mesh
    entries = [(name, m, s) for name, m in root.named_modules() if (s := get_state(m)) is not None]
    wrapped = {name for name, _, _ in entries}
    for b in plan.blocks:
        if b not in wrapped:
            raise ValueError(
                f"{API}: the plan has block {b!r} but that module was not passed to "
                "matrixfsdp.fully_shard before the planned model; wrap every planned block first"
            )
    for name, _, s in entries:
        if s.resolved:
            raise RuntimeError(f"{API}: {name!r} was already resolved by another root")
        if name and name not in plan.blocks:
            raise ValueError(
                f"{API}: fully_shard was applied to {name!r} but the plan has no such block "
                f"(plan blocks: {list(plan.blocks)[:6]}{'...' if len(plan.blocks) > 6 else ''}); "
                "plan with the same blocks you wrap"
            )

    fqns_of: dict[int, list[str]] = {}
    for fqn, p in root.named_parameters(remove_duplicate=False):
        fqns_of.setdefault(id(p), []).append(fqn)
    for name, _, s in entries:
        for mp in s.params:
            fqns = fqns_of[id(mp.orig)]
            sites = {(id(m), attr) for m, attr in mp.sites}
            for alias in fqns:
                mod_path, _, attr = alias.rpartition(".")
                if (id(root.get_submodule(mod_path)), attr) not in sites:
                    raise ValueError(
                        f"{API}: parameter {fqns[0]!r} is tied to {alias!r} in another wrapped "
                        "module; tied parameters must live inside one fully_shard module"
                    )
            mp.fqn = fqns[0]
            mp.plan = _check_param(mp.fqn, mp.orig, plan, name)  # type: ignore[arg-type]
            if mp.tp is not None:
                mp.plan = localize(mp.plan, mp.orig, mp.fqn)  # type: ignore[arg-type]
    _check_plan_covered(plan, (f for fs in fqns_of.values() for f in fs))
    check_plan_tp(plan, [mp for _, _, s in entries for mp in s.params])

    for name, m, s in entries:
        check_wrapped(name, m, s, mesh, "the planned model")

    order = {p.fqn: i for i, p in enumerate(plan.params)}
    rank = info.shard_rank
    for name, _, s in entries:
        chunk_order(s.params, order)  # identical on every rank
        for mp in s.params:
            shard_param(mp, info)
    # The planned model is the root of every state under it (FSDP2 picks its root lazily, at the
    # first forward; here resolution already knows it, so running one block alone is fine too).
    ctx = make_root(entries[0][2], [(name, s) for name, _, s in entries], info)
    attach_tp_hosts(ctx.states, plan, mesh, rank)
    attach_dp_hosts(ctx.states, plan, mesh)
    check_routing(ctx.states, f"fully_shard(plan=<plan {plan.digest[:12]}>)")


# ================================================================================ checks
# Local checks raise before any collective. The one collective check, verify_plan_digest, runs at
# the first fully_shard call of each (plan object, mesh) pair on every rank, *before* any check
# that depends on the plan's content, so that ranks holding different plans all fail together
# instead of some of them raising and the rest hanging in a later collective.
# See also [Note: digest exchange is keyed by plan object].


def _check_call(module: Any, plan: Any, shard_placement_fn: Any, offload_policy: Any) -> None:
    """Argument types and keywords we do not support."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{API}: expects one nn.Module (grouping several modules is not supported), "
            f"got {type(module).__name__}"
        )
    if plan is not None and not isinstance(plan, OwnerPlan):
        raise TypeError(
            f"{API}: plan must be None or a matrixfsdp OwnerPlan (from matrixfsdp.plan_owners), "
            f"got {type(plan).__name__}"
        )
    if shard_placement_fn is not None:
        raise ValueError(
            f"{API}: shard_placement_fn is not supported, placement comes from the plan "
            f"(got {shard_placement_fn!r}); change placements with matrixfsdp.plan_owners"
        )
    from torch.distributed.fsdp import OffloadPolicy

    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError(
            f"{API}: offload_policy is not supported, got {type(offload_policy).__name__}"
        )


def _check_not_torch_fsdp(module: nn.Module) -> None:
    """Refuse modules (or submodules) already managed by torch's ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    for name, m in module.named_modules():
        if isinstance(m, FSDPModule):
            where = "the module" if not name else f"submodule {name!r}"
            raise RuntimeError(
                f"{API}: {where} ({type(m).__name__}) is already managed by torch's "
                "torch.distributed.fsdp.fully_shard; matrixfsdp.fully_shard and torch's "
                "fully_shard cannot be mixed in one model"
            )


def _check_param(fqn: str, param: torch.Tensor, plan: OwnerPlan, block: str) -> ParamPlan:
    """The plan entry of ``fqn``, checked against the live parameter and its block."""
    if fqn not in plan:
        raise ValueError(
            f"{API}: parameter {fqn!r} is not in the plan (the plan has {len(plan.params)} "
            f"parameters, digest {plan.digest[:12]}); was the plan built for another model?"
        )
    pp = plan[fqn]
    if tuple(param.shape) != tuple(pp.shape):
        what = (f" (an expert stack planned for {pp.shape[0]} experts, {pp.experts} per shard rank)"
                if pp.placement == "experts" else "")
        raise ValueError(
            f"{API}: parameter {fqn!r} has shape {tuple(param.shape)} but the plan says "
            f"{tuple(pp.shape)}{what}; the plan was built for another model: plan this one with "
            "matrixfsdp.plan_owners(model, mesh, ...) and pass that plan"
        )
    dtype = str(param.dtype).removeprefix("torch.")
    if pp.dtype != dtype:
        raise ValueError(
            f"{API}: parameter {fqn!r} has dtype {dtype} but the plan says {pp.dtype}; "
            "plan after casting the model"
        )
    if pp.block != block:
        raise ValueError(
            f"{API}: the plan puts {fqn!r} in block {pp.block!r} but fully_shard was applied "
            f"to {block!r} as its closest enclosing module; plan with the same blocks you wrap"
        )
    return pp


def _check_plan_covered(plan: OwnerPlan, seen: Iterable[str]) -> None:
    """Every planned parameter must exist in the model."""
    seen = set(seen)
    missing = [p.fqn for p in plan.params if p.fqn not in seen]
    if missing:
        raise ValueError(
            f"{API}: the plan has {len(missing)} parameter(s) the model lacks, e.g. "
            f"{missing[0]!r}; was the plan built for another model?"
        )

