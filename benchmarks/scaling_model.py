"""Alpha-beta scaling model of one training step: where does flat owner placement stop paying?

    python benchmarks/scaling_model.py [--out benchmarks/results/scaling_model]

A simulation (no cluster exists here). For each Qwen3 preset and data-parallel size W it plans
owners with ``matrixfsdp.plan_owners`` and models, per transformer block, the forward/backward
compute and the collectives of:

* ``fsdp2_adamw``      stock FSDP2 (ring all-gather fwd + bwd, ring reduce-scatter), AdamW step;
* ``fsdp2_gather_muon`` stock FSDP2, Muon step all-gathers every gradient, NS on every rank;
* ``fsdp2_distmuon``   stock FSDP2, Muon step redistributes shards to owners and back (all-to-all
                       per matrix, as torchtitan's DistMuon), NS on owners;
* ``owner_direct``     matrixfsdp, flat owner placement, owners send their pieces straight to every
                       peer (fan-out bounded by gamma_B); zero-communication step;
* ``owner_two_phase``  matrixfsdp, flat owners, materialize as owner scatter + ring all-gather and
                       reduce as ring reduce-scatter + gather to owner (<= 2x ring volume whatever
                       gamma_B is); zero-communication step (the runtime's
                       ``fully_shard(..., collectives="two_phase")``);
* ``owner_groups8``    matrixfsdp with bounded owner groups (HSDP-style, to be built): owners
                       planned within groups of 8 ranks (one node, NVLink), replicas across
                       groups; gradients all-reduced across groups for the owned pieces only.

Communication overlaps compute per block (prefetch): a block costs max(compute, comm) in each
pass; the optimizer step is exposed. Hardware figures are assumptions stated in ``HW`` (H100-class
GPU, NVLink within a node of 8, 400 Gb/s InfiniBand per GPU across nodes); they are inputs, not
measurements. Output: JSON rows, a markdown table and PNG plots; the crossover W per model is where
``owner_direct``'s step time overtakes ``fsdp2_distmuon``'s.

Calibration status: the compute side (per-rank optimizer cost from the planner's FLOP model) was
checked on this CPU by ``step_balance.py`` (predicted imbalance 1.005, timed 1.020 at W=4; the
distributed step at 0.997x the timed balance limit at W=2). The communication side was not
calibrated on a cluster (none here); on the 2-core machine the emulated links are CPU-bound.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from dataclasses import asdict, dataclass

import torch

from matrixfsdp import plan_owners
from matrixfsdp._cost import newton_schulz_flops
from matrixfsdp._decoder import PRESETS, Decoder, DecoderLayer


@dataclass(frozen=True)
class Hardware:
    node: int = 8  # GPUs per node
    bw_intra: float = 360e9  # NVLink, bytes/s per GPU per direction (450 GB/s at 80%)
    bw_inter: float = 40e9  # 400 Gb/s NDR InfiniBand per GPU at 80%
    alpha_intra: float = 8e-6  # s per message step
    alpha_inter: float = 15e-6
    mm_flops: float = 400e12  # bf16 dense matmul, sustained (Newton-Schulz and fwd/bwd)
    mfu: float = 0.45  # fwd/bwd model FLOP utilization
    tokens_per_rank: int = 16384  # per step (e.g. micro-batch 4 x 4096)


HW = Hardware()
PARAM_BYTES = 2  # bf16 compute copies are materialized
GRAD_BYTES = 4  # fp32 reduce dtype


def ring(nbytes: float, W: int, hw: Hardware) -> float:
    """Ring all-gather / reduce-scatter of ``nbytes`` total over W ranks."""
    if W == 1:
        return 0.0
    bw, alpha = (hw.bw_intra, hw.alpha_intra) if W <= hw.node else (hw.bw_inter, hw.alpha_inter)
    return (W - 1) * alpha + (W - 1) / W * nbytes / bw


def fan_out(own: list[float], total: float, W: int, hw: Hardware) -> float:
    """Direct owner fan-out (uneven all-to-all): rank r sends its ``own[r]`` bytes to each of the
    W-1 peers and receives ``total - own[r]``; within a node over NVLink, across nodes over IB."""
    if W == 1:
        return 0.0
    n = min(W, hw.node)
    worst = 0.0
    for o in own:
        send = max((n - 1) * o / hw.bw_intra, (W - n) * o / hw.bw_inter if W > n else 0.0)
        recv_remote = (total - o) * (W - n) / W
        recv_local = (total - o) * (n - 1) / W
        recv = max(recv_local / hw.bw_intra, recv_remote / hw.bw_inter if W > n else 0.0)
        worst = max(worst, send, recv)
    alpha = hw.alpha_intra if W <= hw.node else hw.alpha_inter
    return (W - 1) * alpha + worst


def two_phase(own: list[float], total: float, W: int, hw: Hardware) -> float:
    """Owner scatter (each owner sends (W-1)/W of its bytes) then a ring all-gather."""
    if W == 1:
        return 0.0
    bw = hw.bw_intra if W <= hw.node else hw.bw_inter
    return ring(0, W, hw) + (W - 1) / W * max(own) / bw + ring(total, W, hw)


@dataclass
class Row:
    model: str
    world: int
    impl: str
    fwd_bwd_ms: float
    step_ms: float
    total_ms: float
    max_gamma: float


def block_own(plan, block: str, W: int, elem: int) -> tuple[list[float], float]:
    own = [0.0] * W
    for p in plan.params_of_block(block):
        for r in range(W):
            own[r] += p.share(r, W) * p.numel * elem
    return own, sum(own)


def simulate(name: str, W: int, hw: Hardware = HW) -> list[Row]:
    cfg = PRESETS[name]
    with torch.device("meta"):
        model = Decoder(cfg)
    plan = plan_owners(model, W, block_types=(DecoderLayer,))
    mats = [p for p in plan.params if p.placement == "matrix"]
    n_mat = sum(p.numel for p in mats)
    ns_total = sum(newton_schulz_flops(p.shape) for p in mats) / hw.mm_flops
    ns_owner = max(s.cost for s in plan.rank_stats) / hw.mm_flops  # plan cost = NS FLOPs
    blocks = list(plan.blocks)
    root_numel = sum(p.numel for p in plan.params_of_block(""))
    rows = []

    def passes(materialize, reduce) -> float:
        t = 0.0
        for b in blocks + [""]:
            numel = sum(p.numel for p in plan.params_of_block(b))
            fwd = 2 * numel * hw.tokens_per_rank / (hw.mm_flops * hw.mfu)
            ag = materialize(b, numel)
            rs = reduce(b, numel)
            t += max(fwd, ag) + max(2 * fwd, ag + rs)
        return t

    def fsdp_ag(b, numel):
        return ring(numel * PARAM_BYTES, W, hw)

    def fsdp_rs(b, numel):
        return ring(numel * GRAD_BYTES, W, hw)

    fsdp = passes(fsdp_ag, fsdp_rs)
    adamw = 16 * (n_mat + root_numel) / W / 3e12  # state traffic, HBM-bound
    gamma = max(bs.gamma for bs in plan.block_stats)
    rows.append(Row(name, W, "fsdp2_adamw", fsdp, adamw, fsdp + adamw, 1.0))
    gather_step = ring(n_mat * GRAD_BYTES, W, hw) + ns_total
    rows.append(Row(name, W, "fsdp2_gather_muon", fsdp, gather_step, fsdp + gather_step, 1.0))
    # DistMuon: per matrix an all-to-all to the owner and back (latency per matrix), owners by
    # round robin (its own assignment), NS on owners.
    rr = [0.0] * W
    for i, p in enumerate(sorted(mats, key=lambda p: -p.numel)):
        rr[i % W] += newton_schulz_flops(p.shape)
    a2a_bytes = 2 * (W - 1) / W * n_mat * GRAD_BYTES / W
    bw = hw.bw_intra if W <= hw.node else hw.bw_inter
    alpha = hw.alpha_intra if W <= hw.node else hw.alpha_inter
    dist_step = 2 * len(mats) * alpha * math.log2(max(W, 2)) + a2a_bytes / bw + max(rr) / hw.mm_flops
    rows.append(Row(name, W, "fsdp2_distmuon", fsdp, dist_step, fsdp + dist_step, 1.0))

    def own_of(b, elem):
        return block_own(plan, b, W, elem)

    direct = passes(lambda b, n: fan_out(*own_of(b, PARAM_BYTES), W, hw),
                    lambda b, n: fan_out(*own_of(b, GRAD_BYTES), W, hw))
    rows.append(Row(name, W, "owner_direct", direct, ns_owner, direct + ns_owner, gamma))
    tp = passes(lambda b, n: two_phase(*own_of(b, PARAM_BYTES), W, hw),
                lambda b, n: two_phase(*own_of(b, GRAD_BYTES), W, hw))
    rows.append(Row(name, W, "owner_two_phase", tp, ns_owner, tp + ns_owner, gamma))
    if W > hw.node and W % hw.node == 0:
        G = hw.node
        gplan = plan_owners(model, G, block_types=(DecoderLayer,))
        R = W // G

        def g_ag(b, n):
            own, tot = block_own(gplan, b, G, PARAM_BYTES)
            return fan_out(own, tot, G, hw)

        def g_rs(b, n):
            own, tot = block_own(gplan, b, G, GRAD_BYTES)
            # reduce to owner within the node, then all-reduce the owned pieces across R replicas
            # (ring over IB, 2 (R-1)/R of the largest owned piece)
            cross = 2 * (R - 1) / R * max(own) / hw.bw_inter + 2 * (R - 1) * hw.alpha_inter
            return fan_out(own, tot, G, hw) + cross

        grp = passes(g_ag, g_rs)
        g_ns = max(s.cost for s in gplan.rank_stats) / hw.mm_flops
        g_gamma = max(bs.gamma for bs in gplan.block_stats)
        rows.append(Row(name, W, "owner_groups8", grp, g_ns, grp + g_ns, g_gamma))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="*", default=["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"])
    ap.add_argument("--worlds", nargs="*", type=int, default=[8, 16, 32, 64, 128, 256])
    args = ap.parse_args(argv)
    rows: list[Row] = []
    for m in args.models:
        for W in args.worlds:
            for r in simulate(m, W):
                r.fwd_bwd_ms, r.step_ms, r.total_ms = (round(x * 1e3, 2) for x in (r.fwd_bwd_ms, r.step_ms, r.total_ms))
                print(json.dumps(asdict(r)), flush=True)
                rows.append(r)
    md = render(rows, args.models, args.worlds)
    print(md)
    if args.out:
        with open(args.out + ".jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(asdict(r)) + "\n")
        with open(args.out + ".md", "w") as f:
            f.write(md)
        plot(rows, args.models, args.out + ".png")
    return 0


def crossover(rows: list[Row], model: str, impl: str, ref: str = "fsdp2_distmuon") -> int | None:
    by = {(r.impl, r.world): r.total_ms for r in rows if r.model == model}
    for W in sorted({w for (_, w) in by}):
        if (impl, W) in by and (ref, W) in by and by[(impl, W)] > by[(ref, W)]:
            return W
    return None


def render(rows: list[Row], models, worlds) -> str:
    out = [
        "<!-- produced by: python benchmarks/scaling_model.py --out benchmarks/results/scaling_model -->",
        f"<!-- {datetime.date.today()} torch {torch.__version__} python {platform.python_version()}; "
        f"hardware assumptions: {asdict(HW)} -->",
        "",
        "Modelled step time (ms): fwd+bwd with per-block overlap + exposed optimizer step.",
        "",
        "| model | W | fsdp2_adamw | fsdp2_gather_muon | fsdp2_distmuon | owner_direct (gamma_B) | owner_two_phase | owner_groups8 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        for W in worlds:
            by = {r.impl: r for r in rows if r.model == m and r.world == W}
            g8 = by.get("owner_groups8")
            out.append(
                f"| {m} | {W} | {by['fsdp2_adamw'].total_ms:.0f} | {by['fsdp2_gather_muon'].total_ms:.0f} | "
                f"{by['fsdp2_distmuon'].total_ms:.0f} | {by['owner_direct'].total_ms:.0f} ({by['owner_direct'].max_gamma:.1f}) | "
                f"{by['owner_two_phase'].total_ms:.0f} | {'-' if g8 is None else f'{g8.total_ms:.0f}'} |"
            )
    out += ["", "Crossover W (first W where the variant's total exceeds fsdp2_distmuon's; '-' = none in range):", "",
            "| model | owner_direct | owner_two_phase | owner_groups8 |", "|---|---|---|---|"]
    for m in models:
        c = [crossover(rows, m, i) for i in ("owner_direct", "owner_two_phase", "owner_groups8")]
        out.append(f"| {m} | " + " | ".join("-" if x is None else str(x) for x in c) + " |")
    return "\n".join(out) + "\n"


def plot(rows: list[Row], models, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), sharex=True)
    for ax, m in zip(axes.flat, models):
        for impl in ("fsdp2_gather_muon", "fsdp2_distmuon", "owner_direct", "owner_two_phase", "owner_groups8", "fsdp2_adamw"):
            pts = sorted((r.world, r.total_ms) for r in rows if r.model == m and r.impl == impl)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(m)
        ax.set_xlabel("data-parallel ranks W")
        ax.set_ylabel("modelled step time (ms)")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Alpha-beta model (assumed H100 + NVLink + 400G IB); benchmarks/scaling_model.py")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
