"""Adaptive placement: matrices whose ownership would overload a rank are hosted instead.

[Note: hosted matrices]
Owning whole matrices balances well while there are many more matrices than ranks. Past that
(Qwen3-8B on a flat mesh of 1024 ranks has 252 matrices) most ranks own nothing and the owners
hold several times an even share of the memory. ``plan_owners(..., placement="auto")`` (the
default) then *hosts* matrices, one at a time, until every rank holds at most ``memory_budget``
times what FSDP2's most loaded rank would hold on the same mesh (parameter + gradient +
optimizer-state bytes; ``fsdp2_held_bytes``: an even share, ``total / W``, while every tensor has
at least ``W`` rows):

* a hosted matrix is stored evenly sharded (``Shard(0)``, ``torch.chunk`` rows, as FSDP2 and the
  ``"even"`` placement): it is gathered and reduce-scattered like any evenly sharded tensor;
* its step runs whole on one *host* shard rank, between two fused all-to-alls per micro-group
  (gradient shards to the hosts, update shards back), pipelined over micro-groups: the TP host
  step of ``tp/host_step.py`` run over the data-parallel shard group;
* its optimizer state: Muon's momentum is element-wise and stays on the row shards, like an even
  parameter's (``ParamPlan.state_on_shards``; each rank advances its rows and sends them, the host
  runs Newton-Schulz and keeps nothing; [Note: state on the shards] in ``optim/rule.py``).
  Shampoo's and SOAP's factors are whole-matrix state: the host keeps it whole. (The plan
  assumes the matrix rule steps a hosted matrix; one put in an ``algorithm="adamw"`` group keeps
  AdamW's whole state on its host, more than planned);
* matrices that fit stay owned and step with no communication.

The rule (pure, deterministic): start from the owned plan; while the most loaded rank (ties: the
lowest) is above the budget, host its largest owned matrix (ties: the first fqn). Its storage is
spread over every rank as ``torch.chunk`` rows; its host is the rank with the least optimizer cost
among those whose memory stays within the budget (or, when none can, below the current peak)
with its whole state added (ties: least memory, then the lowest rank), else the least loaded
rank; with the state on the shards every rank fits. The loop stops when the budget holds or the
most loaded rank owns no matrix left to host. Then the hosted matrices are packed into micro-groups
(``plan_micro_groups`` with the chosen hosts: one fused all-to-all each way per group).

Where owning fits the budget, nothing is hosted and the plan (and its digest) is the owned plan.
An explicit ``memory_budget`` that the rule cannot meet raises a ``ValueError`` naming the
smallest budget it can meet; the default budget (:data:`DEFAULT_MEMORY_BUDGET`) is met where it
can be and otherwise approached as far as hosting goes, and the report says so. Where a host
keeps a hosted matrix's whole state (Shampoo, SOAP), that limit is about the largest matrix's
state over an even share; with Muon, hosting can go as far as FSDP2's even sharding.

What the host holds beyond its share is transient: the whole prepared matrix and the
orthogonalized update of the micro-group it is stepping (the receive and send buffers of
``tp/host_step.py``), as DistMuon's owner of a matrix does, freed after the step.
"""

from __future__ import annotations

import dataclasses

from .micro_groups import MicroGroup, default_c_max, plan_micro_groups
from .owner_plan import ParamPlan, fsdp2_held_bytes, held_bytes, rank_loads, spread_rows

__all__ = ["PLACEMENT_MODES", "DEFAULT_MEMORY_BUDGET", "host_over_budget"]

#: ``plan_owners(placement=...)``: ``"auto"`` hosts matrices past the memory budget, ``"owned"``
#: keeps every matrix owned whatever the memory (zero step communication)
PLACEMENT_MODES = ("auto", "owned")
#: default most a rank may hold, in multiples of FSDP2's most loaded rank on the same mesh (parameter +
#: gradient + state bytes; see fsdp2_held_bytes)
DEFAULT_MEMORY_BUDGET = 1.25


def host_over_budget(params: list[ParamPlan], W: int, budget: float, *, strict: bool,
                     owned: frozenset[str] = frozenset(), state_on_shards: bool = False,
                     api: str = "plan_owners") -> tuple[list[ParamPlan], tuple[MicroGroup, ...]]:
    """Host the matrices that put a rank above ``budget`` times FSDP2's peak (see [Note: hosted
    matrices]); returns the parameters (hosted ones replaced) and the hosts' micro-groups.
    ``strict``: raise when the budget cannot be met. ``owned``: fqns that stay owned whatever
    the budget (DTensor parameters of a TP mesh: their owner's TP row steps them).
    ``state_on_shards``: the matrix rule's state is element-wise (Muon) and stays on the rows."""
    ref = max(fsdp2_held_bytes(params, W)) or 1.0  # FSDP2's most loaded rank on this mesh
    hosted, load = _greedy(params, W, budget * ref, owned, state_on_shards)
    reached = max(load) / ref
    if strict and reached > budget * (1 + 1e-9):
        _, floor = _greedy(params, W, 0.0, owned, state_on_shards)
        why = ("the rows of the parameters that stay evenly sharded or owned" if state_on_shards
               else "a host keeps a hosted matrix's whole state")
        raise ValueError(
            f"{api}: memory_budget={budget!r} cannot be met: hosting matrices brings the most loaded rank "
            f"down to {max(floor) / ref:.3f}x FSDP2's most loaded rank on this mesh (parameter + gradient + "
            f"state bytes) at best ({why}); pass memory_budget >= {max(floor) / ref:.3f}, "
            "or plan for HSDP (smaller owner groups: plan_owners(model, (R, W // R)))"
        )
    if not hosted:
        return params, ()
    by_fqn = {p.fqn: p for p in params}
    out = [dataclasses.replace(p, placement="hosted", owner=None, host=hosted[p.fqn], step_replica=None,
                               state_on_shards=state_on_shards)
           if p.fqn in hosted else p for p in params]
    items = [(f, by_fqn[f].shape, by_fqn[f].cost, by_fqn[f].nbytes) for f in sorted(hosted)]
    # one fused buffer holds what the hosts receive at once; the floor of TP's default bounds it
    c_max = default_c_max(1, max(n for _, _, _, n in items))
    groups = plan_micro_groups(items, W, c_max=c_max, hosts=hosted)
    return out, groups


def _greedy(params: list[ParamPlan], W: int, cap: float, owned: frozenset[str] = frozenset(),
            state_on_shards: bool = False) -> tuple[dict[str, int], list[float]]:
    """The hosting loop of the Note (``cap``: the most bytes a rank may hold): ``({fqn: host},
    per-rank held bytes)`` of the first point where the budget holds, else of the point with the
    lowest peak (the fewest hosted on ties): hosting never leaves the most loaded rank worse off
    than owning."""
    nbytes, state, cost, _, _ = rank_loads(params, W)
    load = [2 * n + st for n, st in zip(nbytes, state)]  # rank_held_bytes, with the costs alongside
    total = sum(load)
    if not total:
        return {}, load
    # each rank's owned matrices, largest first (ties: fqn), as candidates to host
    mats: dict[int, list[ParamPlan]] = {}
    for p in sorted((p for p in params if p.placement == "matrix" and p.fqn not in owned),
                    key=lambda p: (-held_bytes(p), p.fqn)):
        mats.setdefault(p.owner, []).append(p)  # type: ignore[arg-type]
    hosted: dict[str, int] = {}
    best = (max(load), 0, list(load))  # (peak, hosted count, loads) of the best point so far
    while True:
        top = max(range(W), key=lambda r: (load[r], -r))
        if load[top] < best[0]:
            best = (load[top], len(hosted), list(load))
        if load[top] <= cap * (1 + 1e-12):
            return hosted, load
        if not mats.get(top):
            break
        p = mats[top].pop(0)
        load[top] -= held_bytes(p)
        cost[top] -= p.cost
        on_host = 0 if state_on_shards else p.state_nbytes
        spread_rows(load, p.shape[0], 2 * p.nbytes + p.state_nbytes - on_host, W)
        # a host that keeps the state within the budget, or at least below the current peak
        limit = max(cap, max(load)) * (1 + 1e-12)
        fits = [r for r in range(W) if load[r] + on_host <= limit]
        if fits:
            h = min(fits, key=lambda r: (cost[r], load[r], r))
        else:
            h = min(range(W), key=lambda r: (load[r], r))
        load[h] += on_host
        cost[h] += p.cost
        hosted[p.fqn] = h
    _, n, load = best  # stuck above the budget: the best point reached (dicts keep insertion order)
    return dict(list(hosted.items())[:n]), load
