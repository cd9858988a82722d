"""Human-readable plan reports (the CLI's default output)."""

from __future__ import annotations

import re
import textwrap
from typing import TYPE_CHECKING

from .partition import BUCKET_POLICIES

if TYPE_CHECKING:
    from .owner_plan import OwnerPlan

__all__ = ["format_plan", "plan_warnings", "remedy", "human_bytes", "natural_key", "MEMORY_BUDGET", "GAMMA_BUDGET"]

#: A plan whose most loaded rank holds more than this many times the parameter + gradient +
#: optimizer-state bytes of FSDP2's most loaded rank on the same mesh gets a warning: such a rank
#: can run out of memory where FSDP2 fits.
MEMORY_BUDGET = 1.25
#: ... and one whose worst block's collective moves this many times the bytes of an even one on
#: its most loaded rank. Owners send whole matrices, so gamma_B grows as W over a block's matrix
#: count (16.7 for Qwen3-8B at W=64, where prefetching hides it); far beyond that one rank's
#: link is the block's collective.
GAMMA_BUDGET = 32.0

#: Rows are kept within this many columns (the per-rank "owns" list is cut to fit).
WIDTH = 120


def natural_key(s: str) -> list:
    """Sort key that orders digit runs by value: ``layers.2`` before ``layers.10``."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", s) if t]


def _fit(names: list[str], width: int) -> str:
    """As many of ``names`` as fit in ``width`` columns, then ``... (+N)``."""
    out = ""
    for i, n in enumerate(names):
        more = len(names) - i - 1
        cand = (out + ", " if out else "") + n
        tail = f", ... (+{more})" if more else ""
        if len(cand) + len(tail) > width:
            return (out + ", " if out else "") + f"... (+{len(names) - i})"
        out = cand
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def plan_warnings(plan: "OwnerPlan") -> list[str]:
    """What makes a plan poor in absolute terms, however close it is to its own lower bound:
    ranks that step nothing (own, host and hold the experts of nothing), a rank far above FSDP2's
    most loaded rank's bytes, a block whose collective is far slower than an even one. Empty for a
    plan without those problems. Pure."""
    W, stats = plan.world_size, plan.rank_stats
    out = []
    # an expert matrix is stepped whole by the rank that holds it, like an owned one
    experts = plan.expert_matrices if plan.has_experts else (0,) * W
    idle = sum(1 for st, e in zip(stats, experts) if st.num_owned == 0 and st.num_hosted == 0 and e == 0)
    if idle and any(p.owner is not None or p.host is not None for p in plan.params):
        what = "own, host or hold the experts of" if plan.has_experts else "own or host"
        out.append(f"{idle} of {W} shard ranks {what} no tensor: they step nothing while the others "
                   "step whole matrices")
    held = plan.memory_vs_fsdp2
    if held > MEMORY_BUDGET:
        how = ""
        if plan.num_hosted:
            how = f"{plan.num_hosted} matrices hosted, the rest owned" + (
                "" if all(p.state_on_shards for p in plan.params if p.placement == "hosted")
                else "; a host keeps a hosted Shampoo/SOAP matrix's whole state")
        elif plan.policy not in BUCKET_POLICIES and plan.tp == 1:
            how = "placement='auto' would host the matrices behind it"
        out.append(f"the most loaded rank holds {held:.2f}x the parameter + gradient + optimizer-state "
                   f"bytes of FSDP2's most loaded rank on this mesh (budget {MEMORY_BUDGET:.2f}x): it "
                   f"can run out of memory where FSDP2 fits" + (f" ({how})" if how else ""))
    gamma = max((b.gamma for b in plan.block_stats), default=1.0)
    if gamma > GAMMA_BUDGET:
        out.append(f"the worst block's collective moves {gamma:.1f}x the bytes of an even one on its most "
                   f"loaded rank (gamma_B; budget {GAMMA_BUDGET:.0f}x; fully_shard(..., collectives=\"two_phase\") "
                   "bounds its traffic at 2x a ring's)")
    return out


def remedy(plan: "OwnerPlan", warnings: list[str]) -> str:
    """What would help a plan with ``warnings`` (:func:`plan_warnings`), including why the
    default ``placement='auto'`` did not."""
    text = ("remedy: HSDP, owners planned within smaller groups (plan_owners(model, (R, W // R)), an "
            "(R, W // R) mesh; CLI: --replicas R)")
    held = plan.memory_vs_fsdp2
    if held <= MEMORY_BUDGET and plan.tp == 1 and plan.policy not in BUCKET_POLICIES:
        # placement='auto' hosts only to meet the memory budget: within it, it has nothing to do
        if plan.num_hosted:
            text += (f". placement='auto' (the default) hosted {plan.num_hosted} matrices to keep every rank "
                     f"within {MEMORY_BUDGET:.2f}x FSDP2's most loaded rank; it hosts no more than that")
        else:
            text += (f". placement='auto' (the default) hosted nothing: it hosts matrices only to keep a rank "
                     f"within the memory budget ({MEMORY_BUDGET:.2f}x FSDP2's most loaded rank), and this plan's "
                     f"most loaded rank holds {held:.2f}x, so hosting cannot help these warnings")
    return text


def format_plan(plan: "OwnerPlan", *, per_rank: bool = True, per_block: bool = True) -> str:
    s = plan.summary()
    total = sum(p.nbytes for p in plan.params)
    n_even = sum(1 for p in plan.params if p.owner is None)
    mesh = (f"world_size={plan.world_size}" if plan.replicas == 1 else
            f"replicas={plan.replicas} x world_size={plan.world_size}  "
            f"replica_step={dict(plan.meta).get('replica_step', plan.replica_step)} ({plan.replica_step})")
    lines = [
        f"OwnerPlan  {mesh}  policy={plan.policy}  cost={plan.cost_model}  "
        f"optimizer={plan.optimizer}",
        f"  {len(plan.params)} parameters ({human_bytes(total)}), {len(plan.blocks)} blocks, "
        f"{n_even} evenly sharded",
        f"  digest {plan.digest}",
        "",
        "  imbalance (max/avg)      plan   lower bound   plan/bound",
        f"    optimizer cost     {s['cost_imbalance']:8.3f}  {s['cost_imbalance_bound']:11.3f}  "
        f"{s['cost_imbalance'] / s['cost_imbalance_bound']:10.3f}",
        f"    parameter bytes    {s['bytes_imbalance']:8.3f}  {s['bytes_imbalance_bound']:11.3f}  "
        f"{s['bytes_imbalance'] / s['bytes_imbalance_bound']:10.3f}",
        f"    params + state     {s['state_imbalance']:8.3f}",
        f"    params+grads+state {s['memory_imbalance']:8.3f}   (memory; FSDP2 on this mesh: "
        f"{s['fsdp2_memory_imbalance']:.3f})",
        f"    worst gamma_B / bound: {s['max_gamma_ratio']:.3f}  (max gamma_B {s['max_gamma']:.2f})",
        "    gamma_B: a block's most loaded owner's bytes / (block bytes / W), i.e. its collective's "
        "slowdown vs even",
    ]
    if plan.has_experts:
        lines += _format_experts(plan, s)
    if plan.replicas > 1:
        cost, state = plan.replica_stats
        n_split = sum(p.step_replica is not None for p in plan.params)
        n_owned = sum(p.owner is not None for p in plan.params)
        lines += [
            "",
            f"  replicas: {n_split} of {n_owned} owned parameters split (one step replica each), "
            f"{n_owned - n_split} repeated on every replica",
            "  busiest owner's step per replica:  " + "  ".join(
                f"r{q}: {c:.3e} cost, {human_bytes(s)} state" for q, (c, s) in enumerate(zip(cost, state))),
        ]
    if plan.tp > 1:
        lines += _format_micro_groups(plan)
    if plan.host_groups:
        lines += _format_hosted(plan)
    if per_rank:
        # the experts column only for plans that have experts: dense reports stay as they were
        experts = plan.expert_matrices if plan.has_experts else None
        lines += ["", "  rank  owned" + ("  experts" if experts else "") + "   param bytes   +state bytes        cost  owns"]
        for st in plan.rank_stats:
            owned = sorted((p.fqn for p in plan.owned_by(st.rank)), key=natural_key)
            row = (f"  {st.rank:4d}  {st.num_owned:5d}  " + (f"{experts[st.rank]:7d}  " if experts else "")
                   + f"{human_bytes(st.nbytes):>12}  {human_bytes(st.nbytes + st.state_nbytes):>13}  {st.cost:10.3e}  ")
            lines.append(row + _fit(owned, max(20, WIDTH - len(row))))
    if per_block and plan.block_stats:
        w = max(36, *(len(b.fqn) for b in plan.block_stats))
        lines += ["", f"  {'block':<{w}}      bytes    gamma_B   bound   ratio"]
        for b in sorted(plan.block_stats, key=lambda b: natural_key(b.fqn)):
            lines.append(
                f"  {b.fqn:<{w}} {human_bytes(b.nbytes):>10}  {b.gamma:8.3f}  {b.gamma_lower_bound:6.3f}  "
                f"{b.gamma / b.gamma_lower_bound:6.3f}"
            )
    # last, after the tables: the point of the report, next to the CLI's suggestion line
    warnings = plan_warnings(plan)
    if warnings:
        lines += ["", "  WARNING: a poor plan in absolute terms (plan/bound compares it with its own bound only)"]
        for w in warnings:
            lines += textwrap.wrap(w, WIDTH, initial_indent="    - ", subsequent_indent="      ")
        lines += textwrap.wrap(remedy(plan, warnings), WIDTH, initial_indent="    ", subsequent_indent="      ")
    return "\n".join(lines)


_BASELINE_LABELS = {
    "round_robin": "round-robin (expert e on rank e mod W)",
    "chunked": "chunked (torch.chunk homes, as EP)",
}


def _format_experts(plan: "OwnerPlan", s: dict) -> list[str]:
    """The experts section: expert matrices per rank, the plan against the two baselines (``s``:
    the plan's summary, passed in because its lower bounds take seconds on large MoE plans)."""
    rows = [(f"this plan ({plan.policy})", s["expert_imbalance"], s["cost_imbalance"], s["bytes_imbalance"],
             s["max_gamma_ratio"])]
    rows += [(_BASELINE_LABELS[name], s[f"expert_imbalance_{name}"], s[f"cost_imbalance_{name}"],
              s[f"bytes_imbalance_{name}"], s[f"max_gamma_ratio_{name}"]) for name in plan.expert_baselines]
    lines = [
        "",
        f"  experts: {s['expert_stacks']} stacks, {s['expert_matrices']} expert matrices, "
        f"{s['expert_matrices_min']}-{s['expert_matrices_max']} per shard rank",
        "  expert placement (max/avg)               expert mats      cost     bytes   worst gamma_B / bound",
    ]
    lines += [f"    {label:<38} {e:11.3f}  {c:8.3f}  {b:8.3f}  {g:8.3f}" for label, e, c, b, g in rows]
    lines.append("    baselines: the same dense weights re-planned (balanced) around the baseline's experts")
    return lines


def _format_hosted(plan: "OwnerPlan") -> list[str]:
    """The hosted section: what ``placement='auto'`` hosts, where, and what its step moves."""
    W = plan.world_size
    hosted = [p for p in plan.params if p.placement == "hosted"]
    nbytes = sum(p.nbytes for p in hosted)
    hosts = sorted({p.host for p in hosted})
    owned = sum(p.placement == "matrix" for p in plan.params)
    # every rank sends its rows of each hosted gradient to the host and receives its rows of the update
    moved = 2 * nbytes * (W - 1) / W / W
    text = [
        f"hosted: {len(hosted)} matrices ({human_bytes(nbytes)}) stored evenly and stepped whole on "
        f"{len(hosts)} host ranks, {owned} matrices owned (no step communication); their optimizer "
        + ("state stays on the row shards (element-wise), the hosts keep none"
           if all(p.state_on_shards for p in hosted) else "state is kept whole on the hosts"),
        f"{len(plan.host_groups)} micro-groups: two fused all-to-alls each per step, about "
        f"{human_bytes(moved)} sent per rank and step (DistMuon's all-to-all sends 2 (W-1)/W of every matrix)",
    ]
    lines = [""]
    for i, t in enumerate(text):
        indent = "  " if i == 0 else "    "
        lines += textwrap.wrap(t, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")
    return lines


def _format_micro_groups(plan: "OwnerPlan") -> list[str]:
    """The TP section: per owner its micro-group totals, and the busiest owner's groups."""
    s = plan.summary()
    stats = plan.tp_stats
    worst = s["tp_owner"]
    ratio = s["tp_makespan"] / s["tp_bound"] if s["tp_bound"] > 0 else 1.0
    ideal = sum(p.cost for p in plan.params if p.placement == "matrix" and p.owner == worst) / plan.tp
    lines = [
        "",
        f"  tensor parallel: tp={plan.tp}, {s['tp_groups']} micro-groups over {len(stats)} owner "
        f"TP groups (fused all-to-all each way per group; Canzona Algorithm 2)",
        f"    busiest owner {worst}: sum of makespans {s['tp_makespan']:.4e} vs sum of bounds "
        f"{s['tp_bound']:.4e}  (ratio {ratio:.3f}); vs its matrix cost / tp {ideal:.4e} "
        f"(ratio {s['tp_makespan'] / ideal if ideal > 0 else 1.0:.3f})",
    ]
    if len(stats) > 1:
        lines += ["", "  owner  groups  sum makespan    sum bound   ratio"]
        for r, (n, mk, bd) in enumerate(stats):
            lines.append(f"  {r:5d}  {n:6d}  {mk:12.4e}  {bd:11.4e}  {mk / bd if bd > 0 else 1.0:6.3f}")
    lines += ["", f"  owner {worst} micro-groups", "  group  members      makespan        bound   ratio   buffer"]
    for g in plan.micro_groups[worst]:
        lines.append(f"  {g.index:5d}  {len(g.members):7d}  {g.makespan:12.4e}  {g.bound:11.4e}  "
                     f"{g.ratio:6.3f}  {human_bytes(g.buffer_bytes):>11}")
    return lines
