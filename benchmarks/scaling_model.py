"""Alpha-beta scaling model of one training step: where does flat owner placement stop paying?

    python benchmarks/scaling_model.py [--out benchmarks/results/scaling_model]

A simulation (no cluster exists here). For each Qwen3 preset and data-parallel size W it plans
owners with ``matrixfsdp.plan_owners`` and models, per transformer block, the forward/backward
compute and the collectives of:

* ``fsdp2_adamw``      stock FSDP2 (ring all-gather fwd + bwd, ring reduce-scatter), AdamW step;
* ``fsdp2_gather_muon`` stock FSDP2, Muon step all-gathers every gradient, NS on every rank;
* ``fsdp2_distmuon``   stock FSDP2, Muon step redistributes shards to owners and back (all-to-all
                       per decoder-layer bucket, as step_bench configures torchtitan's
                       DistMuon), NS on owners;
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

Calibration: ``--validate STEP_BENCH.jsonl --calibration CALIBRATION.json`` runs the same cost
structure on figures measured on this machine by ``calibrate.py`` (per-op alpha-beta fits of the
gloo collectives, Newton-Schulz per shape, forward+backward, AdamW) for the step benchmark's
configuration and prints predicted vs measured fwd+bwd/step/total per implementation, as an
"overlap" and a "serial" bound (benchmarks/results/scaling_validation.md). On 2 shared cores the
serial bound fits: ratios between implementations within ~10% at 4 Gbit/s and 1 Gbit/s; absolute
totals 0.85-1.24x the serial bound (FSDP2 copy-in/out and hook overheads are not modelled; at
50 Mbit/s the uneven all-to-all fit is poor and the model misses matrixfsdp's 1.09x fwd+bwd).
The compute side was also checked by ``step_balance.py`` (predicted imbalance 1.005, timed 1.020
at W=4). Nothing here is calibrated on GPUs (none were available): the cluster figures in ``HW``
are assumptions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

import _bench_common as bc

from matrixfsdp import plan_owners
from matrixfsdp.planner.cost import newton_schulz_flops
from matrixfsdp.models.decoder import PRESETS, Decoder, DecoderLayer


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
    # DistMuon: per decoder-layer bucket an all-to-all to the owners and back (latency per bucket,
    # as step_bench configures it: one BucketConfig per layer); owners as torchtitan 0.3.0's
    # _assign_balanced_owner_ranks: LPT on NS cost within each bucket, ties broken by the load
    # carried from earlier buckets. NS time = the largest carried load (buckets pipelined: the
    # most favourable reading for DistMuon).
    rr = [0.0] * W
    for b in blocks:
        bl = [0.0] * W
        bm = [p for p in mats if p.block == b]
        for p in sorted(bm, key=lambda p: (-newton_schulz_flops(p.shape), p.fqn)):
            r = min(range(W), key=lambda i: (bl[i], rr[i], i))
            bl[r] += newton_schulz_flops(p.shape)
            rr[r] += newton_schulz_flops(p.shape)
    a2a_bytes = 2 * (W - 1) / W * n_mat * GRAD_BYTES / W
    bw = hw.bw_intra if W <= hw.node else hw.bw_inter
    alpha = hw.alpha_intra if W <= hw.node else hw.alpha_inter
    dist_step = 2 * len(blocks) * alpha * math.log2(max(W, 2)) + a2a_bytes / bw + max(rr) / hw.mm_flops
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


# ================================================================================ validation
# The same cost structure, on figures measured on this machine (benchmarks/calibrate.py), applied to
# the step benchmark's configuration and compared with what benchmarks/step_bench.py measured.
# Two bounds per implementation: "overlap" (each collective hidden behind the compute it can run
# under, as the cluster model assumes) and "serial" (nothing overlaps). On 2 shared cores gloo's
# threads compete with compute, so the truth should lie between them.


ADAMW_2D = ("model.embed_tokens.weight", "lm_head.weight")  # AdamW in every bench implementation


class Calibrated:
    """Per-op ``alpha + beta * wire`` and compute times from a calibrate.py JSON."""

    def __init__(self, cal: dict):
        self.W = cal["world"]
        self.ops = {op: (v["alpha_s"], v["beta_s_per_byte"]) for op, v in cal["collectives"].items()}
        c = cal["compute"]
        self.ns_s = {tuple(int(x) for x in k.split("x")): v["s"] for k, v in c["ns"].items()}
        self.fb_s = c["fwd_bwd_s"]
        self.adamw_s_per_elem = c["adamw_s_per_elem"]

    def op(self, name: str, wire: float) -> float:
        a, b = self.ops[name]
        return a + b * wire

    def ns(self, shape) -> float:
        return self.ns_s[tuple(shape)]


def _bench_parts(cfg_dict: dict, W: int):
    """The step benchmark's model (plain, on meta), its matrixfsdp plan and per-block figures."""
    from matrixfsdp import DecoderConfig

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")
    with torch.device("meta"):
        model = Decoder(DecoderConfig(**{k: cfg_dict[k] for k in keys}))
    plan = plan_owners(model, W, block_types=(DecoderLayer,))
    named = dict(model.named_parameters())
    mats = [(n, tuple(p.shape)) for n, p in named.items() if p.ndim == 2 and n not in ADAMW_2D]
    adamw_numel = sum(p.numel() for n, p in named.items() if not (p.ndim == 2 and n not in ADAMW_2D))
    return model, plan, named, mats, adamw_numel


def model_bench(cal: "Calibrated", cfg_dict: dict, W: int) -> dict[str, dict[str, dict[str, float]]]:
    """Predicted fwd+bwd / step / total seconds of each step_bench implementation (overlap, serial)."""
    if W != cal.W:
        raise ValueError(f"model_bench: calibration is for world {cal.W}, got {W=}")
    model, plan, named, mats, adamw_numel = _bench_parts(cfg_dict, W)
    E = 4  # the bench trains in fp32: params, grads and collectives
    L = cfg_dict["num_hidden_layers"]
    S = cfg_dict["seq_len"]
    qdim = cfg_dict["num_attention_heads"] * cfg_dict["head_dim"]
    blocks = [f"model.layers.{i}" for i in range(L)]
    numel = {b: sum(p.numel for p in plan.params_of_block(b)) for b in blocks + [""]}
    # fwd+bwd compute split over blocks by matmul FLOPs per token (attention scores included)
    fl = {b: 2 * numel[b] + 4 * S * qdim for b in blocks}
    fl[""] = 2 * cfg_dict["vocab_size"] * cfg_dict["hidden_size"]  # output head (embedding lookup ~0)
    tot = sum(fl.values())
    fwd = {b: cal.fb_s / 3 * fl[b] / tot for b in fl}  # backward = 2x forward
    ns_all = sum(cal.ns(s) for _, s in mats)

    def fsdp_passes(ag, rs) -> tuple[float, float]:
        """FSDP-style per-block pipeline; ``ag(b)``/``rs(b)`` seconds. Returns (overlap, serial).
        Forward: root then layers, next block's gather prefetched under the current compute.
        Backward: head (root, kept unsharded), layers in reverse with gathers prefetched, each
        block's reduction issued after its compute and overlapped with the next block's
        compute; the last reduction (layer 0's) exposed."""
        order = [""] + blocks
        f_ov = ag(order[0]) + sum(max(fwd[b], ag(order[i + 1]) if i + 1 < len(order) else 0.0)
                                  for i, b in enumerate(order))
        f_se = sum(ag(b) for b in order) + sum(fwd.values())
        border = [""] + blocks[::-1]
        comm = [(ag(border[i + 1]) if i + 1 < len(border) else 0.0) + (rs(border[i - 1]) if i > 0 else 0.0)
                for i in range(len(border))]
        b_ov = sum(max(2 * fwd[b], comm[i]) for i, b in enumerate(border)) + rs(border[-1])
        b_se = sum(ag(b) for b in blocks) + sum(rs(b) for b in border) + 2 * sum(fwd.values())
        return f_ov + b_ov, f_se + b_se

    def ring_ag(b):
        return cal.op("all_gather_into_tensor", (W - 1) / W * numel[b] * E)

    def ring_rs(b):
        return cal.op("reduce_scatter_tensor", (W - 1) / W * numel[b] * E)

    out: dict[str, dict[str, dict[str, float]]] = {}

    def put(name, fb: tuple[float, float], step: tuple[float, float]):
        out[name] = {k: {"fb_s": fb[i], "step_s": step[i], "total_s": fb[i] + step[i]}
                     for i, k in enumerate(("overlap", "serial"))}

    fsdp_fb = fsdp_passes(ring_ag, ring_rs)
    all_numel = sum(numel.values())
    # DDP: one all-reduce of every gradient (25 MB buckets) under backward; redundant NS + AdamW
    ar = cal.op("all_reduce", 2 * (W - 1) / W * all_numel * E)
    ddp_step = ns_all + cal.adamw_s_per_elem * adamw_numel
    put("ddp_muon", (max(cal.fb_s, cal.fb_s / 3 + ar), cal.fb_s + ar), (ddp_step, ddp_step))
    # FSDP2 + AdamW
    adamw_sh = cal.adamw_s_per_elem * all_numel / W
    put("fsdp2_adamw", fsdp_fb, (adamw_sh, adamw_sh))
    # FSDP2 + gather Muon: per matrix an all-gather, NS of every matrix on every rank
    ag_each = [cal.op("all_gather_into_tensor", (W - 1) / W * math.prod(s) * E) for _, s in mats]
    adamw_rest = cal.adamw_s_per_elem * adamw_numel / W
    put("fsdp2_gather_muon", fsdp_fb, (max(sum(ag_each), ns_all) + ag_each[0] + adamw_rest,
                                       sum(ag_each) + ns_all + adamw_rest))
    # FSDP2 + DistMuon: per decoder layer an all-to-all to owners and back; owners by LPT on NS
    # cost with loads carried across buckets (torchtitan's assignment). Serial: bucket by bucket;
    # overlap: the exchanges hidden under the (globally balanced) NS but for the first and last.
    loads = [0.0] * W
    se = 0.0
    a2a_total = 0.0
    for b in blocks:
        bm = [(n, s) for n, s in mats if n.startswith(b + ".")]
        bl = [0.0] * W
        for _, s in sorted(bm, key=lambda x: -cal.ns(x[1])):
            r = min(range(W), key=lambda i: (bl[i], loads[i]))
            bl[r] += cal.ns(s)
            loads[r] += cal.ns(s)
        a2a = cal.op("all_to_all_single", (W - 1) / W * sum(math.prod(s) for _, s in bm) * E / W)
        se += 2 * a2a + max(bl)
        a2a_total += 2 * a2a
    ov = max(a2a_total, max(loads)) + a2a_total / len(blocks)
    put("fsdp2_distmuon", fsdp_fb, (ov + adamw_rest, se + adamw_rest))
    # ZeRO-1 owners: per-parameter reduce under backward, owner step (LPT on NS FLOPs, as the
    # baseline), per-parameter broadcast
    ns_owner_lpt = [0.0] * W
    loads = [0.0] * W
    for n, s in sorted(mats, key=lambda x: (-newton_schulz_flops(x[1]), x[0])):
        r = loads.index(min(loads))
        loads[r] += newton_schulz_flops(s)
        ns_owner_lpt[r] += cal.ns(s)
    red = sum(cal.op("reduce", p.numel() * E) for p in named.values())
    bc = sum(cal.op("broadcast", p.numel() * E) for p in named.values())
    z_step = max(ns_owner_lpt) + cal.adamw_s_per_elem * adamw_numel / W
    # the reduces are issued from backward hooks and waited for at the start of the step
    put("zero1_owner", (cal.fb_s, cal.fb_s), (max(0.0, red - 2 * cal.fb_s / 3) + z_step + bc, red + z_step + bc))

    # matrixfsdp: uneven all-to-all fan-out from owners / uneven reduce-scatter to owners
    def own_bytes(b):
        own = [0.0] * W
        for p in plan.params_of_block(b):
            for r in range(W):
                own[r] += p.share(r, W) * p.numel * E
        return own

    def fan(b):
        own = own_bytes(b)
        t = sum(own)
        return cal.op("all_to_all_single", max(max((W - 1) * o, t - o) for o in own))

    def mf_rs(b):
        return cal.op("reduce_scatter_tensor", (W - 1) / W * numel[b] * E)

    mf_fb = fsdp_passes(fan, mf_rs)
    ns_rank = [0.0] * W
    el_rank = [0.0] * W
    for p in plan.params:
        for r in range(W):
            sh = p.share(r, W)
            if not sh:
                continue
            if p.placement == "matrix" and p.fqn not in ADAMW_2D:
                ns_rank[r] += cal.ns(p.shape) * sh
            else:
                el_rank[r] += sh * p.numel * cal.adamw_s_per_elem
    mf_step = max(a + b for a, b in zip(ns_rank, el_rank))
    put("matrixfsdp", mf_fb, (mf_step, mf_step))
    return out


def validate(bench_path: str, cal_path: str) -> str:
    with open(cal_path) as f:
        cal = Calibrated(json.load(f))
    rows = [json.loads(line) for line in open(bench_path) if line.strip()]
    meta = next(r["meta"] for r in rows if "meta" in r)
    W = meta["world"]
    pred = model_bench(cal, meta["config"], W)
    meas: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("impl") in pred:
            for k in ("fb_s", "step_s", "total_s"):
                meas.setdefault(r["impl"], {}).setdefault(k, []).append(r[k])
    L = [f"<!-- produced by: python benchmarks/scaling_model.py --validate {bench_path} --calibration {cal_path} -->",
         "", f"## Model vs measurement, step_bench world {W} ({os.path.basename(bench_path)})", "",
         "Predicted seconds per step from the calibrated figures, as overlap .. serial bounds, next to "
         "the step benchmark's median over clean repeats; last column: measured total over the serial "
         "bound.", "",
         "| implementation | fwd+bwd predicted | fwd+bwd measured | step predicted | step measured | "
         "total predicted | total measured | total measured / serial |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
    errs = []
    for impl, p in pred.items():
        if impl not in meas:
            continue
        m = {k: statistics.median(v) for k, v in meas[impl].items()}
        cells = []
        for k in ("fb_s", "step_s", "total_s"):
            lo, hi = sorted((p["overlap"][k], p["serial"][k]))
            cells += [f"{lo:.3f}" if abs(hi - lo) < 5e-4 else f"{lo:.3f}-{hi:.3f}", f"{m[k]:.3f}"]
        errs.append(m["total_s"] / p["serial"]["total_s"])
        L.append(f"| {impl} | " + " | ".join(cells) + f" | {errs[-1]:.2f} |")
    L += ["", f"Measured total / serial bound: {min(errs):.2f}-{max(errs):.2f}."]
    # ratios the targets are stated in, predicted (overlap bound) vs measured
    def rat(a, b, k, src):
        return src[a][k] / src[b][k]
    mm = {i: {k: statistics.median(v) for k, v in meas[i].items()} for i in meas}
    po = {i: pred[i]["overlap"] for i in pred}
    ps = {i: pred[i]["serial"] for i in pred}
    L += ["", "| ratio | predicted (overlap) | predicted (serial) | measured |", "|---|---:|---:|---:|"]
    for a, b, k in (("fsdp2_gather_muon", "matrixfsdp", "step_s"), ("fsdp2_distmuon", "matrixfsdp", "step_s"),
                    ("fsdp2_distmuon", "matrixfsdp", "total_s"), ("matrixfsdp", "fsdp2_adamw", "fb_s")):
        if a in mm and b in mm:
            L.append(f"| {a} / {b} {k} | {rat(a, b, k, po):.2f} | {rat(a, b, k, ps):.2f} | {rat(a, b, k, mm):.2f} |")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="*", default=["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"])
    ap.add_argument("--worlds", nargs="*", type=int, default=[8, 16, 32, 64, 128, 256])
    ap.add_argument("--validate", nargs="*", default=None, metavar="STEP_BENCH.jsonl",
                    help="model these step_bench runs on --calibration figures and compare")
    ap.add_argument("--calibration", nargs="*", default=None, metavar="CALIBRATION.json",
                    help="benchmarks/calibrate.py output, one per --validate file")
    args = ap.parse_args(argv)
    if args.validate is not None:
        if not args.calibration or len(args.calibration) != len(args.validate):
            ap.error(f"--validate needs one --calibration per file, got {args.calibration=}")
        md = "".join(validate(b, c) + "\n" for b, c in zip(args.validate, args.calibration))
        print(md)
        if args.out:
            with open(args.out + ".md", "w") as f:
                f.write(md)
        return 0
    rows: list[Row] = []
    for m in args.models:
        for W in args.worlds:
            for r in simulate(m, W):
                r.fwd_bwd_ms, r.step_ms, r.total_ms = (round(x * 1e3, 2) for x in (r.fwd_bwd_ms, r.step_ms, r.total_ms))
                if not args.out:  # with --out, stdout gets only the summary
                    print(json.dumps(asdict(r)), flush=True)
                rows.append(r)
    md = render(rows, args.models, args.worlds, bc.command_line(__file__, argv))
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


def render(rows: list[Row], models, worlds, command: str) -> str:
    out = [
        f"<!-- produced by: {command} -->",
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
    out += ["", "Issue-5 targets in the model: DistMuon's optimizer step and total over owner placement's "
            "(direct fan-out / two-phase); > 1 means owner placement is faster. The step ratio is "
            "DistMuon's exposed redistribution plus its NS over the owners' NS; the total ratio adds the "
            "(overlapped) forward/backward both pay.", "",
            "| model | W | step: distmuon / owner | total: distmuon / owner_direct | total: distmuon / owner_two_phase |",
            "|---|---:|---:|---:|---:|"]
    for m in models:
        for W in worlds:
            by = {r.impl: r for r in rows if r.model == m and r.world == W}
            d, o, t = by["fsdp2_distmuon"], by["owner_direct"], by["owner_two_phase"]
            out.append(f"| {m} | {W} | {d.step_ms / o.step_ms:.2f} | {d.total_ms / o.total_ms:.2f} | "
                       f"{d.total_ms / t.total_ms:.2f} |")
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
