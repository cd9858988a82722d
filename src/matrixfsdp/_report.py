"""Human-readable plan reports (the CLI's default output)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._plan import OwnerPlan

__all__ = ["format_plan", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_plan(plan: "OwnerPlan", *, per_rank: bool = True, per_block: bool = True) -> str:
    s = plan.summary()
    total = sum(p.nbytes for p in plan.params)
    n_even = sum(1 for p in plan.params if p.owner is None)
    lines = [
        f"OwnerPlan  world_size={plan.world_size}  policy={plan.policy}  cost={plan.cost_model}  "
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
        f"    worst gamma_B / bound: {s['max_gamma_ratio']:.3f}  (max gamma_B {s['max_gamma']:.2f})",
    ]
    if per_rank:
        lines += ["", "  rank  owned   param bytes   +state bytes        cost  owns"]
        for st in plan.rank_stats:
            owned = [p.fqn for p in plan.owned_by(st.rank)]
            shown = ", ".join(owned[:4]) + (f", ... (+{len(owned) - 4})" if len(owned) > 4 else "")
            lines.append(
                f"  {st.rank:4d}  {st.num_owned:5d}  {human_bytes(st.nbytes):>12}  "
                f"{human_bytes(st.nbytes + st.state_nbytes):>13}  {st.cost:10.3e}  {shown}"
            )
    if per_block and plan.block_stats:
        lines += ["", "  block                                   bytes    gamma_B   bound   ratio"]
        for b in plan.block_stats:
            lines.append(
                f"  {b.fqn:<36} {human_bytes(b.nbytes):>10}  {b.gamma:8.3f}  {b.gamma_lower_bound:6.3f}  "
                f"{b.gamma / b.gamma_lower_bound:6.3f}"
            )
    return "\n".join(lines)
