"""The owner planner: pure, deterministic Python over parameter shapes.

``plan_owners`` reads names, shapes and dtypes off a model (a ``meta``-device model is fine: no
memory is touched), groups parameters into *roles* and assigns each owned role to one rank.

* Each 2D weight selected by ``matrix_filter`` inside a scope is one **matrix role**.
* Each expert of an expert stack (see [Note: one routing rule] in ``rules.py``) is one **expert
  role**; only how many experts of a stack each rank gets is recorded (see [Note: expert
  placement] in ``owner_plan.py``).
* The remaining (element-wise, AdamW-updated) tensors of a scope form one **tail role**, which is
  either owned by one rank or evenly sharded (``Shard(0)``, as stock FSDP2), see ``elementwise``.
* A scope is a wrapped block; parameters outside every block form the **root scope** (``""``).

[Note: determinism]
Every rank must compute the same plan without talking to the others. Nothing here depends on
dict/set iteration order of unordered inputs, ``hash()`` (salted per process for str), ids or
process state: roles are ordered by (priority, name) and ties between ranks go to the lowest rank,
so the plan is also invariant under permutation of the parameter registration order (except for the
ZeRO-1 bucket policies, whose buckets *are* the registration order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from ..mesh import mesh_info
from .hosting import DEFAULT_MEMORY_BUDGET, PLACEMENT_MODES, host_over_budget
from .cost import ELEMENTWISE_STATE, ParamInfo, resolve_cost, state_nbytes
from .micro_groups import plan_micro_groups
from .balance import _Role, balanced
from .owner_plan import REPLICA_STEPS, OwnerPlan, ParamPlan, even_rows
from .partition import BUCKET_POLICIES, partition_buckets, partition_replicas
from .rules import MatrixRule, ParamKind, check_rule, default_matrix_filter, head_rows_of, moe_structure

__all__ = ["plan_owners", "POLICIES", "ELEMENTWISE", "default_matrix_filter"]

POLICIES = ("balanced", "role_greedy", "scope_greedy", "alpha_balanced", "naive_static")
ELEMENTWISE = ("auto", "owned", "even")



@dataclass(frozen=True)
class _Spec:
    fqn: str
    block: str
    info: ParamInfo
    module_type: type
    #: a DTensor (tensor-parallel) parameter: owned whole by one data-parallel rank, never even
    tp: bool = False
    #: ``"experts"`` stacks: the rule's kind and splits (see [Note: one routing rule])
    kind: ParamKind = ParamKind("elementwise")
    #: an expert stack already sharded by whole experts (expert parallelism): its counts, which
    #: the plan records as they are (a fixed load the dense roles are balanced around)
    fixed: tuple[int, ...] = ()


def _world_size(world_size_or_mesh: Any) -> tuple[int, int, int | None]:
    """``(replicas, shard size, tp or None)`` of an int (flat), an ``(R, S)`` pair or a mesh (a
    ``("dp_shard", "tp")`` or ``("dp_replicate", "dp_shard", "tp")`` mesh gives its TP degree)."""
    what = ("an int, an (replicas, shard) pair, or a 1-D, 2-D (dp_replicate, dp_shard) or (dp_shard, tp), "
            "or 3-D (dp_replicate, dp_shard, tp) DeviceMesh")
    if isinstance(world_size_or_mesh, bool):
        raise TypeError(f"plan_owners: world_size_or_mesh must be {what}, got {world_size_or_mesh!r}")
    if isinstance(world_size_or_mesh, int):
        if world_size_or_mesh < 1:
            raise ValueError(f"plan_owners: world size must be >= 1, got world_size={world_size_or_mesh}")
        return 1, world_size_or_mesh, None
    if isinstance(world_size_or_mesh, tuple) and len(world_size_or_mesh) == 2:
        R, S = world_size_or_mesh
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in (R, S)):
            raise ValueError(f"plan_owners: an (replicas, shard) pair needs two ints >= 1, got {world_size_or_mesh!r}")
        return R, S, None
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(world_size_or_mesh, DeviceMesh):
        info = mesh_info(world_size_or_mesh, api="plan_owners", member=False)
        return info.replicate_size, info.shard_size, (info.tp_size if info.tp_dim is not None else None)
    raise TypeError(f"plan_owners: world_size_or_mesh must be {what}, got {type(world_size_or_mesh).__name__}")


def _block_fqns(model: nn.Module, blocks: Iterable[Any] | None, block_types: Any) -> list[str]:
    named = list(model.named_modules(remove_duplicate=False))
    by_id: dict[int, str] = {}
    for name, mod in named:
        by_id.setdefault(id(mod), name)
    names = {name for name, _ in named}
    out: set[str] = set()
    if blocks is not None:
        if isinstance(blocks, (nn.Module, str)):
            blocks = [blocks]
        blocks = list(blocks)
        if not blocks and block_types is None:
            raise ValueError(
                "plan_owners: blocks must name at least one submodule (the repeated blocks to wrap with "
                "fully_shard), got blocks=[] (pass blocks=None to plan the root scope only)"
            )
        for b in blocks:
            if isinstance(b, str):
                if b not in names:
                    raise ValueError(f"plan_owners: block {b!r} is not a submodule of the model")
                out.add(b)
            elif isinstance(b, nn.Module):
                if id(b) not in by_id:
                    raise ValueError(
                        f"plan_owners: block {type(b).__name__} (id {id(b):#x}) is not a submodule of the model"
                    )
                out.add(by_id[id(b)])
            else:
                raise TypeError(f"plan_owners: blocks must hold nn.Module or str fqns, got {type(b).__name__}")
    if block_types is not None:
        if isinstance(block_types, type):
            block_types = (block_types,)
        block_types = tuple(block_types)
        for t in block_types:
            if not (isinstance(t, type) and issubclass(t, nn.Module)):
                raise TypeError(f"plan_owners: block_types must hold nn.Module subclasses, got {t!r}")
        found = [name for name, mod in named if isinstance(mod, block_types)]
        if not found:
            raise ValueError(
                f"plan_owners: block_types must match at least one submodule of the model (the repeated "
                f"blocks to wrap with fully_shard), got block_types={tuple(t.__name__ for t in block_types)}, "
                f"which matches no module of {type(model).__name__}"
            )
        out.update(found)
    out.discard("")  # the model itself is the root scope
    return sorted(out)


def _is_dtensor(p: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _row_sharded_counts(p: Any, world_size: int) -> tuple[int, ...]:
    """The whole experts per rank of a stack already sharded by rows (``Shard(0)`` on a 1-D mesh
    of ``world_size`` ranks: torchtitan's expert parallelism with ``efsdp == 1``), in
    ``torch.chunk``'s layout; ``()`` for any other DTensor."""
    from torch.distributed.tensor import Shard

    mesh = p.device_mesh
    if mesh.ndim != 1 or mesh.size() != world_size or tuple(p.placements) != (Shard(0),):
        return ()
    return tuple(b - a for a, b in (even_rows(p.shape[0], world_size, r) for r in range(world_size)))


def _collect(
    model: nn.Module, block_fqns: list[str], matrix_filter: Callable[..., bool] | None, rule: MatrixRule,
    world_size: int,
) -> list[_Spec]:
    modules = dict(model.named_modules())
    head_rows, structure = head_rows_of(model), moe_structure(model)
    block_set = set(block_fqns)
    specs = []
    for fqn, p in model.named_parameters():  # de-duplicates tied parameters (first name wins)
        mod_fqn, _, _ = fqn.rpartition(".")
        module = modules[mod_fqn]
        # innermost enclosing block
        block, parts = "", mod_fqn.split(".") if mod_fqn else []
        for i in range(len(parts), 0, -1):
            cand = ".".join(parts[:i])
            if cand in block_set:
                block = cand
                break
        kind = rule.kind(fqn, p, module, head_rows, structure)
        if matrix_filter is not None and kind.kind != "experts":
            is_matrix = bool(matrix_filter(fqn, p))
            if is_matrix and p.ndim != 2:
                raise ValueError(
                    f"plan_owners: matrix_filter selected {fqn!r}, which is not 2D: got shape={tuple(p.shape)}"
                    + ("; a 3-D stack of expert matrices is selected by the rule instead: pass "
                       f"matrix_rule=MatrixRule(expert_stacks=({fqn!r},))" if p.ndim == 3 else "")
                )
            # (a per-head matrix the rule found keeps its heads)
            kind = (kind if kind.kind == "matrix" else ParamKind("matrix")) if is_matrix else ParamKind("elementwise")
        fixed: tuple[int, ...] = ()
        if kind.kind == "experts" and _is_dtensor(p):
            fixed = _row_sharded_counts(p, world_size)
            if not fixed:
                raise ValueError(
                    f"plan_owners: expert stack {fqn!r} is a DTensor with placements {tuple(p.placements)} on "
                    f"a mesh of shape {tuple(p.device_mesh.shape)}; experts are owned whole per data-parallel "
                    "rank: plan the model before distributing its experts, shard them by whole experts "
                    f"(Shard(0) on a 1-D mesh of the {world_size} shard ranks, as torchtitan's expert "
                    "parallelism with efsdp=1), or pass matrix_rule=MatrixRule(experts=False)"
                )
        info = ParamInfo(
            fqn=fqn,
            shape=tuple(p.shape),
            dtype=str(p.dtype).removeprefix("torch."),
            itemsize=p.element_size(),
            is_matrix=kind.kind == "matrix",
            requires_grad=p.requires_grad,
        )
        specs.append(_Spec(fqn, block, info, type(module), tp=_is_dtensor(p) and not fixed, kind=kind, fixed=fixed))
    if not specs:
        raise ValueError("plan_owners: the model has no parameters")
    return specs


def _stack_cost(s: _Spec, cost_fn: Callable[[ParamInfo], float]) -> float:
    E, k = s.info.shape[0], s.kind.splits
    return sum(k * cost_fn(expert_matrix_info(s.info, k, e)) for e in range(E))


def _cost(s: _Spec, cost_fn: Callable[[ParamInfo], float]) -> float:
    """What stepping ``s`` costs: an expert stack's matrices, a per-head matrix's ``H`` head
    matrices (``MatrixRule(heads=...)``: each orthogonalized alone), or the tensor itself."""
    if s.kind.kind == "experts":
        return _stack_cost(s, cost_fn)
    k = s.kind.splits
    if k > 1 and s.info.is_matrix:
        rows, cols = s.info.shape
        one = ParamInfo(fqn=f"{s.info.fqn}[0]", shape=(rows // k, cols), dtype=s.info.dtype,
                        itemsize=s.info.itemsize, is_matrix=True, requires_grad=s.info.requires_grad)
        return k * cost_fn(one)
    return cost_fn(s.info)


def expert_matrix_info(info: ParamInfo, splits: int, expert: int) -> ParamInfo:
    """One matrix of expert ``expert`` of the stack ``info`` (``[E, out, in]``, ``splits``
    matrices per expert): what the cost model and state sizes see of it."""
    _, rows, cols = info.shape
    return ParamInfo(fqn=f"{info.fqn}[{expert}]", shape=(rows // splits, cols), dtype=info.dtype,
                     itemsize=info.itemsize, is_matrix=True, requires_grad=info.requires_grad)


def plan_owners(
    model: nn.Module,
    world_size_or_mesh: Any,
    *,
    blocks: Iterable[nn.Module | str] | None = None,
    block_types: type | tuple[type, ...] | None = None,
    cost: str | Callable[[ParamInfo], float] = "flops",
    policy: str = "balanced",
    matrix_filter: Callable[[str, torch.Tensor], bool] | None = None,
    matrix_rule: MatrixRule | None = None,
    optimizer: str = "muon",
    elementwise: str = "auto",
    precondition_frequency: int = 10,
    alpha: float = 1.0,
    bucket_numel: int | None = None,
    replica_step: str = "auto",
    tp: int = 1,
    tp_c_max: int | None = None,
    placement: str = "auto",
    memory_budget: float | None = None,
) -> OwnerPlan:
    """Plan which data-parallel rank owns each parameter of ``model``.

    Pure and deterministic: no process group, works on a ``meta``-device model, and every rank
    gets the same plan (same ``digest``) for the same inputs.

    Args:
        model: the model to plan (any device, ``meta`` included).
        world_size_or_mesh: the number of data-parallel ranks, a 1-D ``DeviceMesh``, or an HSDP
            mesh ``init_device_mesh(dev, (R, S), mesh_dim_names=("dp_replicate", "dp_shard"))``
            (or the pair ``(R, S)`` offline): owners are planned among the ``S`` ranks of the
            shard dimension, identically in every replica. A ``("dp_shard", "tp")`` mesh
            (FSDP2 + TP) or a ``("dp_replicate", "dp_shard", "tp")`` mesh (HSDP x TP) gives
            ``tp`` too.
        blocks: modules (or fqns) that will be wrapped with ``fully_shard``; each is a scope of
            roles and a unit of materialization.
        block_types: module classes whose instances are blocks (added to ``blocks``).
        cost: ``"flops"`` (optimizer FLOPs of ``optimizer``), ``"bytes"`` (parameter plus
            optimizer-state bytes), ``"numel"`` (Canzona's proxy) or ``f(ParamInfo) -> float``.
        policy: ``"balanced"`` (default; global LPT over roles balancing bytes and cost together,
            a per-block byte cap that keeps every gamma_B at its lower bound, then move/swap local
            search), ``"role_greedy"``, ``"scope_greedy"``, or the ZeRO-1 bucket partitions
            ``"alpha_balanced"`` (Canzona Algorithm 1) and ``"naive_static"`` (its start-index rule).
        matrix_filter: ``f(fqn, param) -> bool`` choosing the 2D weights that get the matrix
            optimizer (default: :func:`default_matrix_filter`); expert stacks are chosen by
            ``matrix_rule`` alone.
        matrix_rule: the routing rule (:class:`~matrixfsdp.MatrixRule`, default
            ``MatrixRule()``): expert stacks, routers, fused expert projections (see
            [Note: one routing rule]); give the optimizer the same rule.
        optimizer: ``"muon"``, ``"shampoo"``, ``"soap"`` or ``"adamw"``: sizes optimizer state
            and selects the FLOP formula.
        elementwise: placement of tail roles (element-wise tensors of a scope): ``"owned"``,
            ``"even"`` (``Shard(0)``), or ``"auto"`` (default): owned when the tail fits in the
            scope's fair share ``max(largest matrix role, scope bytes / W)``, else even. This
            owns the tiny norms of a block (no extra pieces to move) and evenly shards embeddings
            and output heads, whose ownership would wreck byte balance at large W (see docs/planner.md).
            The bucket policies keep every tensor atomic under ``"auto"`` (Canzona's rule;
            ``replicate`` needs it); pass ``"even"`` to shard their element-wise tensors.
        precondition_frequency: amortization of Shampoo/SOAP eigendecompositions in ``"flops"``.
        alpha, bucket_numel: ``alpha_balanced`` blend factor in [0, 1] and ZeRO-1 bucket size in
            elements (default: Megatron's ``max(40M, 1M * W)``).
        replica_step: on an HSDP mesh, how owned parameters combine across the ``R`` replicas
            (see [Note: replicas and step replicas]): ``"repeat"`` (all-reduce, every replica's
            owner steps), ``"split"`` (each gets one step replica, balanced by cost; state and
            matrix work shrink ``R``-fold at the same bytes), or ``"auto"`` (default): ``split``
            for matrices, whose step costs superlinear work per element, ``repeat`` for
            element-wise tails, whose step costs about what re-gathering them would.
        tp, tp_c_max: tensor-parallel degree of each owner's TP group and the fused all-to-all
            buffer limit in bytes (default: ``planner.micro_groups.default_c_max``). With
            ``tp > 1`` every owner's ``"matrix"`` parameters (whole cost and bytes) are packed
            into micro-groups with a host TP rank each (Canzona Algorithm 2; see
            [Note: micro-group rule]), stored in ``plan.micro_groups``. This is the planning half
            of TP only: owners are planned exactly as with ``tp=1``; the runtime is separate.
        placement: ``"auto"`` (default) or ``"owned"``. ``"auto"``: where owning whole matrices
            would put a rank above ``memory_budget`` times FSDP2's most loaded rank on the same
            mesh (parameter + gradient + optimizer-state bytes; an even share while every tensor
            has at least ``W`` rows), at large ``W`` on a flat mesh, the matrices that cause it are
            *hosted*: stored evenly sharded as FSDP2 does, stepped whole on a planned host
            between fused all-to-alls (see [Note: hosted matrices] in ``planner/hosting.py``);
            where owning fits (few ranks per matrix), the plan is the owned plan, digest
            included. ``"owned"``: every matrix owned whatever the memory (zero step
            communication). The bucket policies (``replicate``) and ``tp > 1`` plans host nothing.
        memory_budget: the most a rank may hold, in multiples of FSDP2's most loaded rank on
            this mesh (``OwnerPlan.memory_vs_fsdp2``; parameter + gradient + state bytes), under
            ``placement="auto"`` (default ``DEFAULT_MEMORY_BUDGET`` = 1.25, met where
            hosting can meet it). An explicit budget that hosting cannot meet raises a
            ``ValueError`` naming the smallest one it can.
    Returns:
        A frozen :class:`OwnerPlan`.

    Example::

        with torch.device("meta"):
            model = Transformer(cfg)
        plan = plan_owners(model, 8, block_types=(TransformerBlock,))
        print(plan.report())
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan_owners: model must be an nn.Module, got {type(model).__name__}")
    R, W, mesh_tp = _world_size(world_size_or_mesh)
    if mesh_tp is not None:
        if tp not in (1, mesh_tp):
            raise ValueError(f"plan_owners: tp={tp} but the mesh's 'tp' dimension has size {mesh_tp}; "
                             "drop tp= (the mesh gives it)")
        tp = mesh_tp
    if replica_step not in REPLICA_STEPS:
        raise ValueError(f"plan_owners: replica_step must be one of {REPLICA_STEPS}, got {replica_step=!r}")
    if policy not in POLICIES:
        raise ValueError(f"plan_owners: policy must be one of {POLICIES}, got {policy=!r}")
    if elementwise not in ELEMENTWISE:
        raise ValueError(f"plan_owners: elementwise must be one of {ELEMENTWISE}, got {elementwise=!r}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"plan_owners: tp must be an int >= 1, got {tp=!r}")
    if placement not in PLACEMENT_MODES:
        raise ValueError(f"plan_owners: placement must be one of {PLACEMENT_MODES}, got {placement=!r}")
    if memory_budget is not None:
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not memory_budget > 0 \
                or memory_budget == float("inf"):
            raise ValueError(f"plan_owners: memory_budget must be a finite number > 0 (multiples of FSDP2's "
                             f"most loaded rank's parameter + gradient + state bytes), got {memory_budget=!r}")
        why = (f"placement={placement!r}" if placement != "auto" else
               f"policy={policy!r} (replicate's buckets)" if policy in BUCKET_POLICIES else
               f"tp={tp} (TP matrices are hosted within TP)" if tp > 1 else None)
        if why is not None:
            raise ValueError(f"plan_owners: memory_budget applies to placement='auto' on a tp=1 plan of the "
                             f"balanced policies, got it with {why}; drop memory_budget")
    if tp_c_max is not None and tp == 1:
        raise ValueError(f"plan_owners: tp_c_max needs tp > 1, got {tp_c_max=!r} with tp=1")
    rule = check_rule(matrix_rule, "plan_owners")
    cost_name, cost_fn = resolve_cost(cost, optimizer, precondition_frequency)
    block_fqns = _block_fqns(model, blocks, block_types)
    specs = _collect(model, block_fqns, matrix_filter, rule, W)
    if tp > 1 and any(s.kind.kind == "experts" for s in specs):
        name = next(s.fqn for s in specs if s.kind.kind == "experts")
        raise ValueError(
            f"plan_owners: expert stack {name!r} with tp={tp}: experts are not tensor-parallel here "
            "(torchtitan shards them by expert parallelism instead); plan with tp=1, or pass "
            "matrix_rule=MatrixRule(experts=False) to keep the stacks element-wise"
        )

    def make(spec: _Spec, placement: str, owner: int | None, counts: tuple[int, ...] = ()) -> ParamPlan:
        info = spec.info
        if placement == "even" and not info.shape:
            placement, owner = "tail", 0  # 0-dim cannot be split
        if placement == "experts":
            one = expert_matrix_info(info, spec.kind.splits, 0)
            E, k = info.shape[0], spec.kind.splits
            return ParamPlan(fqn=spec.fqn, placement="experts", owner=None, block=spec.block, shape=info.shape,
                             dtype=info.dtype, nbytes=info.nbytes, state_nbytes=E * k * state_nbytes(one, optimizer),
                             cost=E * k * cost_fn(one), experts=counts, splits=k)
        return ParamPlan(
            fqn=spec.fqn,
            placement=placement,
            owner=owner,
            block=spec.block,
            shape=info.shape,
            dtype=info.dtype,
            nbytes=info.nbytes,
            state_nbytes=state_nbytes(info, optimizer),
            cost=_cost(spec, cost_fn),
            splits=spec.kind.splits if placement in ("matrix", "hosted") else 1,
        )

    def counts_of(spec: _Spec, owners: dict[str, int]) -> tuple[int, ...]:
        counts = [0] * W
        for e in range(spec.info.shape[0]):
            counts[owners[f"{spec.fqn}#{e}"]] += 1
        return tuple(counts)

    meta: tuple[tuple[str, Any], ...] = ()
    if policy in BUCKET_POLICIES and elementwise == "auto":
        # Canzona's rule: ZeRO-1 buckets keep every tensor atomic, which is what replicate runs at
        # any W; "even" (embedding/head sharded, as in the Fig. 3c benchmark) stays on request.
        elementwise = "owned"
    fixed = [s for s in specs if s.fixed]
    roles, even = _build_roles([s for s in specs if not s.fixed], W, elementwise, cost_fn)
    params = [make(s, "even", None) for s in even] + [make(s, "experts", None, s.fixed) for s in fixed]
    if policy in BUCKET_POLICIES:
        # Buckets hold the owned parameters in registration order; evenly sharded element-wise
        # tensors sit in ordinary equal-chunk ZeRO-1 buckets and need no cut points.
        even_fqns = {s.fqn for s in even + fixed}
        seq = [s for s in specs if s.fqn not in even_fqns]
        owners, meta = partition_buckets(
            [s.fqn for s in seq],
            [_cost(s, cost_fn) for s in seq],
            W,
            policy=policy,
            alpha=alpha,
            bucket_numel=bucket_numel,
            numels=[s.info.numel for s in seq],
        )
        for s in seq:
            if s.kind.kind == "experts":  # atomic in a bucket: the whole stack on one rank
                params.append(make(s, "experts", None, tuple(s.info.shape[0] if r == owners[s.fqn] else 0
                                                             for r in range(W))))
            else:
                params.append(make(s, "matrix" if s.info.is_matrix else "tail", owners[s.fqn]))
    else:
        owners = _assign(roles, even + fixed, W, policy, cost_fn)  # fixed stacks load ranks as chunks do
        stacks: dict[str, _Spec] = {}
        for role in roles:
            if role.placement == "experts":
                stacks[role.members[0].fqn] = role.members[0]
                continue
            params += [make(s, role.placement, owners[role.key]) for s in role.members]
        params += [make(s, "experts", None, counts_of(s, owners)) for s in stacks.values()]
    params.sort(key=lambda p: p.fqn)
    host_groups: tuple[Any, ...] = ()
    if placement == "auto" and policy not in BUCKET_POLICIES and tp == 1:
        budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else float(memory_budget)
        params, host_groups = host_over_budget(params, W, budget, strict=memory_budget is not None,
                                               owned=frozenset(s.fqn for s in specs if s.tp),
                                               state_on_shards=optimizer in ELEMENTWISE_STATE)
    if R > 1:
        params = _assign_step_replicas(params, R, replica_step)
        meta = (*meta, ("replica_step", replica_step))
    micro_groups: tuple[tuple[Any, ...], ...] = ()
    if tp > 1:
        micro_groups = tuple(
            plan_micro_groups([(p.fqn, p.shape, p.cost, p.nbytes) for p in params
                               if p.placement == "matrix" and p.owner == s], tp, c_max=tp_c_max)
            for s in range(W)
        )
    return OwnerPlan(
        world_size=W,
        policy=policy,
        cost_model=cost_name,
        optimizer=optimizer,
        blocks=tuple(block_fqns),
        params=tuple(params),
        meta=meta,
        replicas=R,
        tp=tp,
        micro_groups=micro_groups,
        host_groups=host_groups,
    )


def _assign_step_replicas(params: list[ParamPlan], R: int, mode: str) -> list[ParamPlan]:
    """Give ``split`` parameters their step replica (see ``partition_replicas``); ``params`` are
    in plan order, which is each block's chunk order for one owner."""
    import dataclasses

    def splits(p: ParamPlan) -> bool:
        return p.owner is not None and (mode == "split" or (mode == "auto" and p.placement == "matrix"))

    step: dict[str, int] = {}
    for s in sorted({p.owner for p in params if p.owner is not None}):
        by_block: dict[str, list[tuple[str, float]]] = {}
        for p in params:
            if p.owner == s and splits(p):
                by_block.setdefault(p.block, []).append((p.fqn, p.cost))
        step.update(partition_replicas([by_block[b] for b in sorted(by_block)], R))
    return [dataclasses.replace(p, step_replica=step[p.fqn]) if p.fqn in step else p for p in params]


def _build_roles(
    specs: list[_Spec], W: int, elementwise: str, cost_fn: Callable[[ParamInfo], float]
) -> tuple[list[_Role], list[_Spec]]:
    by_block: dict[str, list[_Spec]] = {}
    for s in specs:
        by_block.setdefault(s.block, []).append(s)
    roles: list[_Role] = []
    even: list[_Spec] = []
    for block in sorted(by_block):
        members = sorted(by_block[block], key=lambda s: s.fqn)
        mats = [s for s in members if s.info.is_matrix]
        stacks = [s for s in members if s.kind.kind == "experts"]
        tail = [s for s in members if not s.info.is_matrix and s.kind.kind != "experts"]
        for s in mats:
            roles.append(_Role(s.fqn, block, (s,), "matrix", s.info.nbytes, _cost(s, cost_fn)))
        for s in stacks:
            E, k = s.info.shape[0], s.kind.splits
            nbytes = s.info.nbytes // E if E else 0
            roles += [_Role(f"{s.fqn}#{e}", block, (s,), "experts", nbytes,
                            k * cost_fn(expert_matrix_info(s.info, k, e))) for e in range(E)]
        if not tail:
            continue
        tail_bytes = sum(s.info.nbytes for s in tail)
        if elementwise == "auto":
            scope_bytes = sum(s.info.nbytes for s in members)
            largest = max([s.info.nbytes for s in mats] + [s.info.nbytes // s.info.shape[0] for s in stacks
                                                            if s.info.shape[0]], default=0)
            fair = max(largest, scope_bytes / W)
            owned = tail_bytes <= fair
        else:
            owned = elementwise == "owned"
        if owned:
            roles.append(
                _Role(f"{block}#tail", block, tuple(tail), "tail", tail_bytes, sum(cost_fn(s.info) for s in tail))
            )
        else:
            # 0-dim tensors cannot be split: they stay an owned tail role of their own; so do
            # TP-sharded ones (their owner's TP row holds them, see [Note: TP hosts]).
            scalars = tuple(s for s in tail if not s.info.shape or s.tp)
            even += [s for s in tail if s.info.shape and not s.tp]
            if scalars:
                roles.append(
                    _Role(f"{block}#tail", block, scalars, "tail",
                          sum(s.info.nbytes for s in scalars), sum(cost_fn(s.info) for s in scalars))
                )
    return roles, even


def _even_loads(even: list[_Spec], W: int, cost_fn: Callable[[ParamInfo], float]) -> tuple[list[float], list[float], dict[str, list[float]]]:
    """Per-rank bytes and cost of the evenly sharded tensors, and per-block bytes per rank."""
    nbytes = [0.0] * W
    cost = [0.0] * W
    per_block: dict[str, list[float]] = {}
    for s in even:
        n = s.info.shape[0]
        c = _cost(s, cost_fn)
        blk = per_block.setdefault(s.block, [0.0] * W)
        for r in range(W):
            a, b = even_rows(n, W, r)
            frac = (b - a) / n if n else 0.0
            nbytes[r] += s.info.nbytes * frac
            cost[r] += c * frac
            blk[r] += s.info.nbytes * frac
    return nbytes, cost, per_block


def _assign(
    roles: list[_Role],
    even: list[_Spec],
    W: int,
    policy: str,
    cost_fn: Callable[[ParamInfo], float],
) -> dict[str, int]:
    base_b, base_c, even_block = _even_loads(even, W, cost_fn)
    if policy == "scope_greedy":
        return _scope_greedy(roles, base_b, W)
    if policy == "role_greedy":
        return _role_greedy(roles, base_b, W)
    return balanced(roles, base_b, base_c, even_block, W)


def _scope_greedy(roles: list[_Role], base_b: list[float], W: int) -> dict[str, int]:
    """Layer-wise placement (as Megatron's layer-wise optimizer): each scope whole on one rank,
    scopes in LPT order by bytes to the rank with the fewest bytes."""
    scopes: dict[str, list[_Role]] = {}
    for r in roles:
        scopes.setdefault(r.block, []).append(r)
    order = sorted(scopes, key=lambda b: (-sum(r.nbytes for r in scopes[b]), b))
    load = list(base_b)
    out: dict[str, int] = {}
    for b in order:
        rank = min(range(W), key=lambda k: (load[k], k))
        for r in scopes[b]:
            out[r.key] = rank
            load[rank] += r.nbytes
    return out


def _role_greedy(roles: list[_Role], base_b: list[float], W: int) -> dict[str, int]:
    """Per block, roles in LPT order by bytes to the rank holding the fewest bytes *of this block*
    (ties: fewest bytes overall, then lowest rank): balances every block's fan-out locally, the
    global balance only through tie-breaking."""
    by_block: dict[str, list[_Role]] = {}
    for r in roles:
        by_block.setdefault(r.block, []).append(r)
    load = list(base_b)
    out: dict[str, int] = {}
    for b in sorted(by_block):
        local = [0.0] * W
        for role in sorted(by_block[b], key=lambda r: (-r.nbytes, r.key)):
            rank = min(range(W), key=lambda k: (local[k], load[k], k))
            out[role.key] = rank
            local[rank] += role.nbytes
            load[rank] += role.nbytes
    return out
