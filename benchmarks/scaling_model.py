"""Alpha-beta scaling model of one training step: where does flat owner placement stop paying?

    python benchmarks/scaling_model.py [--out benchmarks/results/scaling/scaling_model]
    python benchmarks/scaling_model.py --hsdp [--regime weak strong] [--optimizers muon shampoo soap] \
        [--out benchmarks/results/scaling/scaling_model_hsdp]      # HSDP (R x 8) rows of issue 17, W=8..1024
    python benchmarks/scaling_model.py --tp [--dps 1 2 4 8 16 32] [--optimizers muon shampoo soap] \
        [--out benchmarks/results/scaling/scaling_model_tp]        # TP (dp x 8) optimizer-step rows of issue 18

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
                       This is ``replica_step="repeat"``: the ``--hsdp`` output calls it
                       ``mf_repeat`` and adds ``mf_split`` and the HSDP baselines (see the HSDP
                       section below).

Communication overlaps compute per block (prefetch): a block costs max(compute, comm) in each
pass; the optimizer step is exposed. Hardware figures are assumptions stated in ``HW`` (H100-class
GPU, NVLink within a node of 8, 400 Gb/s InfiniBand per GPU across nodes); they are inputs, not
measurements. Output: JSON rows, a markdown table and PNG plots; the crossover W per model is where
``owner_direct``'s step time overtakes ``fsdp2_distmuon``'s.

Calibration: ``--validate STEP_BENCH.jsonl --calibration CALIBRATION.json`` runs the same cost
structure on figures measured on this machine by ``calibrate.py`` (per-op alpha-beta fits of the
gloo collectives, Newton-Schulz per shape, forward+backward, AdamW) for the step benchmark's
configuration and prints predicted vs measured fwd+bwd/step/total per implementation, as an
"overlap" and a "serial" bound (benchmarks/results/scaling/scaling_validation.md). On 2 shared cores the
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
MASTER_BYTES = 4  # fp32 parameters and optimizer state: what step replicas and hosts send back


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


def simulate(name: str, W: int, hw: Hardware = HW, optimizer: str = "muon") -> list[Row]:
    """Flat-mesh rows. ``optimizer`` picks the planner's FLOP formula for the matrix step (the
    plan's per-parameter ``cost``; Newton-Schulz for ``"muon"``, as before); the row names keep
    their Muon-era labels (``fsdp2_distmuon`` is the DistMuon-style exchange with that step)."""
    cfg = PRESETS[name]
    with torch.device("meta"):
        model = Decoder(cfg)
    # owner rows: every matrix owned (the hosted matrices of placement="auto" are priced in bytes by
    # rank_bytes / hosted_step_bytes, and measured by the dry run; benchmarks/placement_table.py)
    plan = plan_owners(model, W, block_types=(DecoderLayer,), optimizer=optimizer, placement="owned")
    mats = [p for p in plan.params if p.placement == "matrix"]
    n_mat = sum(p.numel for p in mats)
    ns_total = sum(p.cost for p in mats) / hw.mm_flops
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
            t += max(fwd, ag) + max(2 * fwd, (ag if b else 0.0) + rs)  # the root stays gathered
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
        for p in sorted(bm, key=lambda p: (-p.cost, p.fqn)):
            r = min(range(W), key=lambda i: (bl[i], rr[i], i))
            bl[r] += p.cost
            rr[r] += p.cost
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
        gplan = plan_owners(model, G, block_types=(DecoderLayer,), optimizer=optimizer)
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


# ================================================================================ bytes per rank
# The bytes the rows above move, per rank and phase: the part of the model a dry run of the real
# code measures exactly (``python -m matrixfsdp.dryrun``; benchmarks/dryrun_table.py compares the
# two, benchmarks/results/dryrun/table.md). Every block is materialized in the forward and every
# block but the root again in the backward (the root is not resharded after the forward, as in
# FSDP2); an owner fan-out gather sends the rank's bytes to each of the other ranks, a fan-out
# reduction every byte but its own; owners step without communication. Hosted matrices
# (``placement="auto"`` past the memory budget) step between two all-to-alls: every rank sends
# its rows of the gradient to the host, which sends every other rank its rows of the update
# (``hosted_step_bytes``). HSDP ``mf_split``: each owned matrix has one step replica (the plan's
# ``step_replica``); its gradient is reduced to that replica across the R replicas (every replica
# sends it but the step replica) and the step replica's updated matrices are sent to the other
# R-1 in the next forward; the rest of what a rank holds is all-reduced (a ring: 2 (R-1)/R of it).
# The dry run corrected the model here (issue 28): the root's backward gather was priced and is
# never made; the split exchange was priced as a balanced ring (2 (R-1)/R of every owned byte per
# rank) where the plan's whole-matrix intervals are uneven across replicas, and with a step
# replica partition of its own where the plan's (``step_replica``) is what runs; the usage flags
# of every reduction chunk were left out. ``passes`` and ``simulate_hsdp`` price the first two
# as ``rank_bytes`` does; the flags (< 16 bytes per destination and block) only here.


def hosted_step_bytes(plan, rank: int, elem: float | None = None) -> float:
    """Bytes shard rank ``rank`` sends in the step of ``plan``'s hosted matrices: its rows of each
    gradient to the host, and, on the host, every other rank's rows of the update. ``elem``: bytes
    per element (default: the parameters' own)."""
    S, sent = plan.world_size, 0.0
    for p in plan.params:
        if p.placement != "hosted":
            continue
        nbytes = p.nbytes if elem is None else p.numel * elem
        rows = p.share(rank, S) * nbytes
        sent += nbytes - rows if rank == p.host else rows
    return sent


def split_chunks(plan, shard_rank: int, R: int, block: str | None = None) -> tuple[list[float], float]:
    """``(elements of shard_rank's split tensors stepped by each replica, elements all-reduced)``
    (of ``block`` only, if given): owned tensors with a ``step_replica`` are split, everything else
    it holds is repeated."""
    S = plan.world_size
    chunks, rest = [0.0] * R, 0.0
    for p in (plan.params if block is None else plan.params_of_block(block)):
        n = p.share(shard_rank, S) * p.numel
        if not n:
            continue
        if R > 1 and p.placement != "even" and p.step_replica is not None:
            chunks[p.step_replica] += n
        else:
            rest += n
    return chunks, rest


def rank_bytes(plan, rank: int, replicas: int = 1, param_bytes: float = PARAM_BYTES,
               grad_bytes: float = GRAD_BYTES, master_bytes: float = MASTER_BYTES, tp: int = 1,
               tp_frac: dict[str, float] | None = None) -> dict[str, float]:
    """Bytes global rank ``rank`` sends in one step of ``plan`` (over a flat mesh, or over
    ``replicas`` x ``plan.world_size``), as ``simulate`` (``owner_direct``) and ``simulate_hsdp``
    (``mf_split``) price them: ``{"forward", "backward", "step", "across"}``; ``across`` (sent to
    other replicas) is included in the first two. ``param_bytes`` / ``grad_bytes`` /
    ``master_bytes``: element sizes of the materialized parameters, the reduced gradients and the
    parameters themselves (what a step replica or a host sends back; the time model's defaults:
    bf16 compute, fp32 reduction and parameters). Each destination's reduction chunk carries one
    usage flag per parameter of the block, padded to 16 bytes (the runtime's layout,
    ``engine/layout.py``); the flags and padding of a rank's chunk are all-reduced across
    replicas with its repeated tensors, in every block.

    ``tp`` > 1 (a ``(dp_shard, tp)`` mesh, rank = dp rank * tp + tp rank): the data-parallel
    collectives move each TP rank's shards (``tp_frac[fqn]``: the fraction of a parameter one TP
    rank holds, 1 where replicated), and the step is the TP host step of ``simulate_tp``'s
    ``mf_tp_microgroups``: the owner's TP-sharded matrices in micro-groups with LPT hosts
    (``tp_micro_groups``), each TP rank sending its gradient shard to the host and the host
    every other rank's update shard."""
    from matrixfsdp.engine.layout import aligned_numel

    S, R = plan.world_size, replicas
    frac = tp_frac or {}
    r, k = (rank // tp, 0) if tp > 1 else (rank % S, rank // S)
    ge = int(grad_bytes)
    fwd = bwd = across_f = across_b = 0.0
    for b in list(plan.blocks) + [""]:
        ps = plan.params_of_block(b)
        own = [round(sum(p.share(q, S) * p.numel * frac.get(p.fqn, 1.0) for p in ps)) for q in range(S)]
        chunk = [aligned_numel(n + len(ps), ge) for n in own]  # the reduction's chunk per destination
        gather = (S - 1) * own[r] * param_bytes
        fwd += gather
        bwd += (gather if b else 0.0) + (sum(chunk) - chunk[r]) * grad_bytes
        if R > 1:
            split, _ = split_chunks(plan, r, R, b)
            across_f += (R - 1) * split[k] * master_bytes
            across_b += (sum(split) - split[k]) * grad_bytes
            across_b += 2 * (R - 1) / R * (chunk[r] - sum(split)) * grad_bytes
    step = hosted_step_bytes(plan, r, master_bytes)
    if tp > 1:
        t = rank % tp
        mats = [p for p in plan.params if p.owner == r and p.placement == "matrix" and frac.get(p.fqn, 1.0) < 1.0]
        for grp in tp_micro_groups([(p.fqn, p.cost, p.numel * GRAD_BYTES) for p in mats], tp):
            for (fqn, _, nb), h in grp:
                n, f = nb / GRAD_BYTES, frac[fqn]
                step += n * (1 - f) * master_bytes if t == h else n * f * grad_bytes
    return {"forward": fwd + across_f, "backward": bwd + across_b, "step": step, "across": across_f + across_b}


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


# ================================================================================ HSDP (issue 17)
# HSDP mesh (R replicas) x (S shard ranks), W = R * S, S = HW.node = 8 (one node): shard within the
# node over NVLink, replicate across nodes over IB. Owners are planned within the shard group of 8
# and every replica group has the same layout. Rows (like for like, all on the same mesh):
#
# * ``hsdp_adamw``    stock torch HSDP + AdamW: ring all-gather within the group (fwd and bwd),
#                     ring reduce-scatter within the group then ring all-reduce of the shard across
#                     the R replicas (IB); AdamW on the 1/S shard (repeated on every replica).
# * ``hsdp_distmuon`` the same forward/backward; the step is torchtitan DistMuon-style within the
#                     group (every replica repeats it): per decoder-layer bucket an all-to-all to
#                     the owners and back over NVLink, the matrix step (Muon's Newton-Schulz, or
#                     Shampoo/SOAP's update) on the group's LPT owners, so its compute is total/S.
# * ``mf_repeat``     matrixfsdp ``replica_step="repeat"``: owner fan-out within the group, the
#                     owned full gradient all-reduced across the R owners; every replica's owner
#                     steps its matrices (total/S, R-fold redundant), zero step communication.
#                     This is the mode ``owner_groups8`` in scaling_model.md models (same fwd/bwd
#                     formulas; here the step counts element-wise AdamW as the other rows do).
# * ``mf_split``      matrixfsdp ``replica_step="split"``: each owner's matrices get step replicas
#                     among their R holders (the planner's alpha-balanced partition, contiguous
#                     whole-matrix intervals, balanced by optimizer FLOPs); backward reduce-scatters
#                     the owned tensors across replicas in those intervals (a block's owned norms
#                     ride in the same call; evenly sharded element-wise tensors all-reduce as in
#                     HSDP); the step runs only on the step replica (~total/W plus
#                     imbalance); the updated matrices (fp32) are all-gathered back across replicas
#                     at the next forward, per block, overlapped like the other gathers.
#
# Element-wise tensors (embeddings, head, norms) get AdamW in every row, at the HBM-bound rate the
# flat ``fsdp2_adamw`` row uses, on their 1/S share. Matrix-step FLOPs come from the planner's cost
# model (matrixfsdp.planner.cost: Newton-Schulz; Shampoo/SOAP with eigendecompositions amortized
# over the planner's default precondition_frequency=10) and run at ``HW.mm_flops``, as the flat
# rows' Newton-Schulz does: optimistic for eigendecompositions (see ``--opt-tflops``).
# A collective between two link classes (intra then inter for one block) is counted as the sum,
# pipelined across blocks by the per-block max(compute, comm) of each pass.

STRONG_GLOBAL_TOKENS = 4 * 1024 * 1024  # "4M tokens": 16384 per rank at W=256
ADAMW_BYTES_PER_S = 3e12  # HBM-bound AdamW state traffic, as the flat fsdp2_adamw row
ADAMW_BYTES_PER_ELEM = 16
HSDP_IMPLS = ("hsdp_adamw", "hsdp_distmuon", "mf_repeat", "mf_split")
FLAT_IMPLS = ("fsdp2_adamw", "fsdp2_distmuon", "owner_two_phase")  # flat rows shown next to HSDP


@dataclass
class HRow:
    model: str
    world: int
    replicas: int  # R (flat rows: 1)
    shard: int  # S (flat rows: W)
    optimizer: str
    regime: str  # "weak" | "strong"
    tokens_per_rank: int
    impl: str
    mesh: str  # "hsdp" | "flat"
    fwd_ms: float
    bwd_ms: float
    fwd_bwd_ms: float
    step_ms: float
    total_ms: float
    step_share: float  # step / total
    xbytes_rank: float | None  # bytes each rank sends across replicas per step, mean over the group
    xbytes_rank_max: float | None
    state_bytes_rank: float | None  # optimizer state per rank (max over ranks)
    exposed_fwd_ms: float | None = None  # sum over blocks of max(0, comm - compute), forward
    exposed_bwd_ms: float | None = None
    x_alpha_ms: float | None = None  # cross-replica ring latency terms (R-1)*alpha summed over blocks


def _ring_link(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Ring reduce-scatter or all-gather of ``nbytes`` total over ``n`` ranks on one link class."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / bw


def _uneven_link(total: float, chunks: list[float], bw: float, alpha: float) -> float:
    """Reduce-scatter (or all-gather) of ``total`` bytes over ``len(chunks)`` ranks where rank r
    keeps ``chunks[r]`` (whole-matrix intervals). Every rank must send (gather: receive) all of it
    but its own chunk, so the busiest rank moves ``total - min(chunks)``; a pipelined ring/chain
    reaches that. Balanced chunks give the ring's ``(n-1)/n * total``; one interval (a reduce to
    the step replica) gives ``total``."""
    n = len(chunks)
    if n <= 1 or total == 0:
        return 0.0
    return (n - 1) * alpha + (total - min(chunks)) / bw


def distmuon_loads(mats, blocks, n: int) -> list[float]:
    """torchtitan 0.3.0's _assign_balanced_owner_ranks over ``n`` ranks: LPT on step cost within
    each decoder-layer bucket, ties broken by the load carried from earlier buckets."""
    rr = [0.0] * n
    for b in blocks:
        bl = [0.0] * n
        for p in sorted((p for p in mats if p.block == b), key=lambda p: (-p.cost, p.fqn)):
            r = min(range(n), key=lambda i: (bl[i], rr[i], i))
            bl[r] += p.cost
            rr[r] += p.cost
    return rr


def simulate_hsdp(name: str, W: int, optimizer: str = "muon", regime: str = "weak", hw: Hardware = HW,
                  global_tokens: int = STRONG_GLOBAL_TOKENS, opt_flops: float | None = None,
                  flat: bool = True) -> list[HRow]:
    """HSDP rows (and, with ``flat``, the flat rows of :func:`simulate` at the same tokens)."""
    import dataclasses

    S = hw.node
    if W % S:
        raise ValueError(f"simulate_hsdp: W={W} is not a multiple of the group size {S}")
    R = W // S
    tokens = hw.tokens_per_rank if regime == "weak" else global_tokens // W
    if regime not in ("weak", "strong"):
        raise ValueError(f"simulate_hsdp: regime must be 'weak' or 'strong', got {regime!r}")
    hw = dataclasses.replace(hw, tokens_per_rank=tokens)
    opt_flops = hw.mm_flops if opt_flops is None else opt_flops
    with torch.device("meta"):
        model = Decoder(PRESETS[name])
    # the HSDP plan: owners within the group of S, and each owned matrix's step replica
    gplan = plan_owners(model, (R, S) if R > 1 else S, block_types=(DecoderLayer,), optimizer=optimizer)
    blocks = list(gplan.blocks) + [""]
    mats = [p for p in gplan.params if p.placement == "matrix"]
    n_all = sum(p.numel for p in gplan.params)
    n_mat = sum(p.numel for p in mats)
    n_elem = n_all - n_mat
    elem_step = ADAMW_BYTES_PER_ELEM * n_elem / S / ADAMW_BYTES_PER_S  # 1/S share, every replica
    elem_state = 2 * 4 * n_elem / S
    bi, ai, bx, ax = hw.bw_intra, hw.alpha_intra, hw.bw_inter, hw.alpha_inter
    numel = {b: sum(p.numel for p in gplan.params_of_block(b)) for b in blocks}
    fwd = {b: 2 * numel[b] * tokens / (hw.mm_flops * hw.mfu) for b in blocks}

    def passes(fcomm, bcomm) -> tuple[float, float, float, float]:
        # bcomm(b, gather): the backward's collectives, ``gather`` the block's re-gather (none for
        # the root, which stays gathered after the forward)
        f = sum(max(fwd[b], fcomm(b)) for b in blocks)
        b_ = sum(max(2 * fwd[b], bcomm(b, bool(b))) for b in blocks)
        return f, b_, f - sum(fwd.values()), b_ - 2 * sum(fwd.values())

    rows: list[HRow] = []

    def put(impl, fb, step, xb, state, x_alpha):
        f, b, ef, eb = fb
        tot = f + b + step
        xm = None if xb is None else statistics.fmean(xb)
        rows.append(HRow(name, W, R, S, optimizer, regime, tokens, impl, "hsdp", f * 1e3, b * 1e3, (f + b) * 1e3,
                         step * 1e3, tot * 1e3, step / tot, xm, None if xb is None else max(xb), state,
                         ef * 1e3, eb * 1e3, x_alpha * 1e3))

    xa = (R - 1) * ax if R > 1 else 0.0  # one ring pass across the replicas: latency

    # ---- stock HSDP: ring AG intra; ring RS intra + ring all-reduce of the 1/S shard across R
    def ar_x(nbytes):  # ring all-reduce across replicas = reduce-scatter + all-gather; none if empty
        return 2 * _ring_link(nbytes, R, bx, ax) if nbytes else 0.0

    hs = passes(lambda b: _ring_link(numel[b] * PARAM_BYTES, S, bi, ai),
                lambda b, g: g * _ring_link(numel[b] * PARAM_BYTES, S, bi, ai) + _ring_link(numel[b] * GRAD_BYTES, S, bi, ai)
                + ar_x(numel[b] * GRAD_BYTES / S))
    hs_x = [2 * (R - 1) / R * n_all * GRAD_BYTES / S] * S  # even layout: every rank holds 1/S
    put("hsdp_adamw", hs, ADAMW_BYTES_PER_ELEM * n_all / S / ADAMW_BYTES_PER_S, hs_x, 2 * 4 * n_all / S,
        2 * xa * len(blocks))
    # ---- HSDP + DistMuon-style step within the group (repeated on every replica)
    rr = distmuon_loads(mats, list(gplan.blocks), S)
    a2a = 2 * (S - 1) / S * n_mat * GRAD_BYTES / S / bi
    dist_step = 2 * len(gplan.blocks) * ai * math.log2(max(S, 2)) + a2a + max(rr) / opt_flops + elem_step
    put("hsdp_distmuon", hs, dist_step, hs_x, sum(p.state_nbytes for p in mats) / S + elem_state,
        2 * xa * len(blocks))

    # ---- matrixfsdp: per block and owner s, bytes held (matrices whole, element-wise shares)
    def held(b, s, elem, owned: bool | None = None) -> float:
        return sum(p.share(s, S) * p.numel * elem for p in gplan.params_of_block(b)
                   if owned is None or (p.placement != "even") == owned)

    own_p = {b: [held(b, s, PARAM_BYTES) for s in range(S)] for b in blocks}
    own_g = {b: [held(b, s, GRAD_BYTES) for s in range(S)] for b in blocks}
    fan_p = {b: fan_out(own_p[b], sum(own_p[b]), S, hw) for b in blocks}
    fan_g = {b: fan_out(own_g[b], sum(own_g[b]), S, hw) for b in blocks}
    held_g = [sum(own_g[b][s] for b in blocks) for s in range(S)]
    x_ar = [2 * (R - 1) / R * h for h in held_g]  # all-reduce of what each rank holds
    # repeat: all-reduce every held byte across the R owners (ring over IB)
    rep = passes(lambda b: fan_p[b], lambda b, g: g * fan_p[b] + fan_g[b] + ar_x(max(own_g[b])))
    mat_cost = [sum(p.cost for p in mats if p.owner == s) for s in range(S)]
    mat_state = [sum(p.state_nbytes for p in mats if p.owner == s) for s in range(S)]
    put("mf_repeat", rep, max(mat_cost) / opt_flops + elem_step, x_ar, max(mat_state) + elem_state,
        2 * xa * len(blocks))
    # split: each owned matrix has one step replica (the plan's ``step_replica``): its gradient is
    # reduced to that replica, which sends the updated matrix to the others in the next forward,
    # both in whole-tensor intervals (uneven across replicas); the rest of what a rank holds
    # (evenly sharded and owned element-wise tensors) is all-reduced across replicas as in HSDP
    chunks = {}  # (b, s) -> bytes of s's split tensors in b stepped by each replica
    rest = {}  # (b, s) -> bytes s holds in b that are all-reduced
    for b in blocks:
        for s in range(S):
            c = [0.0] * R
            for p in gplan.params_of_block(b):
                if R > 1 and p.placement != "even" and p.owner == s and p.step_replica is not None:
                    c[p.step_replica] += p.numel * GRAD_BYTES
            chunks[b, s] = c
            rest[b, s] = held(b, s, GRAD_BYTES) - sum(c)
    mx = {b: max(_uneven_link(sum(chunks[b, s]), chunks[b, s], bx, ax) for s in range(S)) for b in blocks}
    ex = {b: max(ar_x(rest[b, s]) for s in range(S)) for b in blocks}
    spl = passes(lambda b: mx[b] + fan_p[b], lambda b, g: g * fan_p[b] + fan_g[b] + mx[b] + ex[b])
    r_cost = {}
    r_state = {}
    for p in mats:
        k = (p.owner, p.step_replica or 0)
        r_cost[k] = r_cost.get(k, 0.0) + p.cost
        r_state[k] = r_state.get(k, 0.0) + p.state_nbytes
    # bytes each rank (s, replica k) sends across replicas: every split gradient but its replica's
    # own (reduced to their step replicas), its replica's updated matrices to the R-1 others (at
    # MASTER_BYTES), and the ring all-reduce of the rest (the same as rank_bytes's "across")
    x_split = []
    for s in range(S):
        c = [sum(chunks[b, s][k] for b in blocks) for k in range(R)]
        ar = 2 * (R - 1) / R * sum(rest[b, s] for b in blocks)
        x_split += [sum(c) - c[k] + (R - 1) * c[k] * MASTER_BYTES / GRAD_BYTES + ar for k in range(R)]
    n_ex = sum(1 for b in blocks if any(rest[b, s] for s in range(S)))
    n_mx = sum(1 for b in blocks if any(sum(chunks[b, s]) for s in range(S)))
    put("mf_split", spl, max(r_cost.values(), default=0.0) / opt_flops + elem_step, x_split,
        max(r_state.values(), default=0.0) + elem_state, xa * (2 * n_mx + 2 * n_ex))

    if flat:
        if opt_flops != hw.mm_flops:
            raise ValueError("simulate_hsdp: opt_flops applies to the HSDP rows only; pass flat=False")
        for r in simulate(name, W, hw, optimizer):  # seconds until main rounds them
            if r.impl not in FLAT_IMPLS:
                continue
            # the flat matrix rows get the element-wise AdamW the HSDP rows count, on 1/W shares
            step = r.step_ms + (0.0 if r.impl == "fsdp2_adamw" else elem_step * S / W)
            tot = r.fwd_bwd_ms + step
            rows.append(HRow(name, W, 1, W, optimizer, regime, tokens, r.impl, "flat", float("nan"), float("nan"),
                             r.fwd_bwd_ms * 1e3, step * 1e3, tot * 1e3, step / tot, None, None, None))
    return rows


def check_split(rows: list[HRow]) -> tuple[dict[tuple[str, str], tuple[int, int, list[str]]], list[str]]:
    """Issue 17's claim: mf_split at or below hsdp_distmuon in total AND step at every (preset, W).
    Returns {(optimizer, regime): (passed, points, failures)} and the summary lines."""
    by = {(r.optimizer, r.regime, r.model, r.world, r.impl): r for r in rows if r.mesh == "hsdp"}
    res: dict[tuple[str, str], tuple[int, int, list[str]]] = {}
    for (o, g, m, W, impl), sp in by.items():
        if impl != "mf_split":
            continue
        d = by[o, g, m, W, "hsdp_distmuon"]
        ok_t = sp.total_ms <= d.total_ms * (1 + 1e-12)
        ok_s = sp.step_ms <= d.step_ms * (1 + 1e-12)
        p, n, fails = res.get((o, g), (0, 0, []))
        if ok_t and ok_s:
            res[o, g] = (p + 1, n + 1, fails)
            continue
        why = []
        if not ok_s:
            why.append(f"step {sp.step_ms:.1f} > {d.step_ms:.1f} ms")
        if not ok_t:
            df, db = sp.fwd_ms - d.fwd_ms, sp.bwd_ms - d.bwd_ms
            dom = "forward" if df >= db else "backward"
            why.append(
                f"total {sp.total_ms:.1f} > {d.total_ms:.1f} ms: fwd {df:+.1f}, bwd {db:+.1f}, step "
                f"{sp.step_ms - d.step_ms:+.1f} ms; dominated by the {dom} pass's exposed communication "
                f"(split exposes {sp.exposed_fwd_ms:.1f}/{sp.exposed_bwd_ms:.1f} ms fwd/bwd, HSDP "
                f"{d.exposed_fwd_ms:.1f}/{d.exposed_bwd_ms:.1f}); split's cross-replica ring latency alone "
                f"is {sp.x_alpha_ms:.1f} ms (HSDP's {d.x_alpha_ms:.1f}) at R={sp.replicas}, "
                f"{sp.tokens_per_rank} tokens/rank")
        res[o, g] = (p, n + 1, fails + [f"{m} W={W}: " + "; ".join(why)])
    lines = []
    for (o, g), (p, n, fails) in sorted(res.items()):
        lines.append(f"check mf_split <= hsdp_distmuon (total and step), {o} {g}: {p}/{n} (preset, W) points pass"
                     + ("" if not fails else "; failures:"))
        lines += [f"  - {f}" for f in fails]
    return res, lines


def render_hsdp(rows: list[HRow], models, worlds, optimizers, regimes, command: str, opt_tflops: float | None,
                global_tokens: int) -> str:
    hsdp = ", ".join(HSDP_IMPLS)
    out = [
        f"<!-- produced by: {command} -->",
        f"<!-- {datetime.date.today()} torch {torch.__version__} python {platform.python_version()}; "
        f"hardware assumptions: {asdict(HW)}; HSDP groups of S={HW.node} (one node), R=W/{HW.node} replicas; "
        f"weak: {HW.tokens_per_rank} tokens/rank; strong: {global_tokens} global tokens, {global_tokens}/W per rank; "
        f"matrix-step FLOPs from matrixfsdp.planner.cost (Shampoo/SOAP eigendecompositions amortized over the "
        f"planner's default precondition_frequency=10) at "
        f"{(opt_tflops or HW.mm_flops / 1e12):g} TFLOP/s -->",
        "",
        "Modelled time per training step on an HSDP mesh (issue 17), ms: forward/backward with per-block "
        "overlap + the exposed optimizer step. Each cell: total (step, step's share of the total). "
        f"HSDP rows ({hsdp}) on the (R, 8) mesh; `flat_*` rows are scaling_model.py's flat modes at the same "
        "tokens and optimizer (ring over all W ranks). `mf_repeat` is the mode scaling_model.md calls "
        "`owner_groups8`. split/dist: mf_split over hsdp_distmuon. See docs/benchmarks.md.",
    ]
    _, summary = check_split(rows)
    for o in optimizers:
        for g in regimes:
            out += ["", f"### {o}, {g} scaling", "",
                    "| model | W | R | tokens/rank | hsdp_adamw | hsdp_distmuon | mf_repeat | mf_split | flat_fsdp2_distmuon | "
                    "flat_owner_two_phase | split/dist total | split/dist step | pass |",
                    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
            for m in models:
                for W in worlds:
                    by = {(r.mesh, r.impl): r for r in rows if (r.optimizer, r.regime, r.model, r.world) == (o, g, m, W)}
                    if ("hsdp", "mf_split") not in by:
                        continue

                    def cell(k):
                        r = by.get(k)
                        return "-" if r is None else f"{r.total_ms:.0f} ({r.step_ms:.1f}, {100 * r.step_share:.1f}%)"

                    sp, d = by["hsdp", "mf_split"], by["hsdp", "hsdp_distmuon"]
                    ok = sp.total_ms <= d.total_ms * (1 + 1e-12) and sp.step_ms <= d.step_ms * (1 + 1e-12)
                    out.append(f"| {m} | {W} | {sp.replicas} | {sp.tokens_per_rank} | " + " | ".join(
                        cell(k) for k in (("hsdp", i) for i in HSDP_IMPLS)) + " | " + " | ".join(
                        cell(("flat", i)) for i in ("fsdp2_distmuon", "owner_two_phase")) +
                        f" | {sp.total_ms / d.total_ms:.3f} | {sp.step_ms / d.step_ms:.3f} | {'yes' if ok else 'NO'} |")
    out += ["", "Optimizer state per rank, mf_split / mf_repeat (max over ranks; includes element-wise AdamW state):", "",
            "| optimizer | model | " + " | ".join(f"W={W}" for W in worlds) + " |",
            "|---|---|" + "---:|" * len(worlds)]
    for o in optimizers:
        for m in models:
            cells = []
            for W in worlds:
                by = {r.impl: r for r in rows if (r.optimizer, r.regime, r.model, r.world, r.mesh) == (o, regimes[0], m, W, "hsdp")}
                cells.append(f"{by['mf_split'].state_bytes_rank / by['mf_repeat'].state_bytes_rank:.2f}" if by else "-")
            out.append(f"| {o} | {m} | " + " | ".join(cells) + " |")
    out += ["", "Check (issue 17: mf_split at or below hsdp_distmuon in total and step at every preset and size):", "",
            "```", *summary, "```"]
    return "\n".join(out) + "\n"


def plot_hsdp(rows: list[HRow], models, optimizers, regimes, path: str, share_model: str = "qwen3-8b") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nr, nc = 2 * len(regimes), len(optimizers)
    fig, axes = plt.subplots(nr, nc, figsize=(5 * nc, 3.6 * nr), sharex=True, squeeze=False)
    styles = {("hsdp", "hsdp_adamw"): "-", ("hsdp", "hsdp_distmuon"): "-", ("hsdp", "mf_repeat"): "-",
              ("hsdp", "mf_split"): "-", ("flat", "fsdp2_distmuon"): "--", ("flat", "owner_two_phase"): "--"}
    sm = share_model if share_model in models else models[-1]
    for gi, g in enumerate(regimes):
        for oi, o in enumerate(optimizers):
            ax = axes[2 * gi][oi]
            for (mesh, impl), ls in styles.items():
                pts = sorted((r.world, 100 * r.step_share) for r in rows if (r.optimizer, r.regime, r.model, r.mesh, r.impl)
                             == (o, g, sm, mesh, impl))
                if pts:
                    ax.plot(*zip(*pts), ls, marker="o", ms=3, label=("flat_" if mesh == "flat" else "") + impl)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{sm}, {o}, {g}: step share of total")
            ax.set_ylabel("step / total (%)")
            ax = axes[2 * gi + 1][oi]
            for m in models:
                by = {(r.world, r.impl): r.total_ms for r in rows if (r.optimizer, r.regime, r.model, r.mesh) == (o, g, m, "hsdp")}
                ws = sorted({w for w, _ in by})
                ax.plot(ws, [by[w, "mf_split"] / by[w, "hsdp_distmuon"] for w in ws], marker="o", ms=3, label=m)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{o}, {g}: total, mf_split / hsdp_distmuon")
            ax.set_ylabel("ratio (< 1: split faster)")
    for ax in axes[-1]:
        ax.set_xlabel("data-parallel ranks W (groups of 8)")
    _finish(fig, axes, "HSDP alpha-beta model (assumed H100 + NVLink + 400G IB); benchmarks/scaling_model.py --hsdp", path)


def _finish(fig, axes, title: str, path: str) -> None:
    """Legends on the first column, the title, and the file (the HSDP and TP plots)."""
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main_hsdp(args, argv) -> int:
    models, worlds = args.models, args.worlds or [8, 16, 32, 64, 128, 256, 512, 1024]
    optimizers = args.optimizers or ["muon", "shampoo", "soap"]
    regimes = args.regime or ["weak", "strong"]
    opt_flops = None if args.opt_tflops is None else args.opt_tflops * 1e12
    rows: list[HRow] = []
    for o in optimizers:
        for g in regimes:
            for m in models:
                for W in worlds:
                    rows += simulate_hsdp(m, W, o, g, global_tokens=args.global_tokens, opt_flops=opt_flops,
                                          flat=opt_flops is None)
    for r in rows:
        for k in ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "step_ms", "total_ms", "exposed_fwd_ms", "exposed_bwd_ms", "x_alpha_ms"):
            v = getattr(r, k)
            if v is not None and math.isfinite(v):
                setattr(r, k, round(v, 3))
        r.step_share = round(r.step_share, 6)
    md = render_hsdp(rows, models, worlds, optimizers, regimes, bc.command_line(__file__, argv), args.opt_tflops,
                     args.global_tokens)
    _, summary = check_split(rows)
    print("\n".join(summary))
    if args.out:
        with open(args.out + ".jsonl", "w") as f:
            for r in rows:
                d = asdict(r)
                d.update({k: None for k, v in d.items() if isinstance(v, float) and not math.isfinite(v)})
                f.write(json.dumps(d) + "\n")
        with open(args.out + ".md", "w") as f:
            f.write(md)
        plot_hsdp(rows, models, optimizers, regimes, args.out + ".png")
    else:
        print(md)
    return 0


# ================================================================================ TP (issue 18)
# Optimizer step on a 2-D (dp, tp) mesh: tp = HW.node = 8 within a node (NVLink), dp = 1..32
# across nodes (IB), Canzona's setting for Qwen3-32B (DP=32 x TP=8 = 256 GPUs). Every matrix of a
# decoder layer is TP-split (q/k/v/gate/up column-wise, o/down row-wise: 1/tp of the matrix per TP
# rank, exact widths assumed); embeddings, head and norms are element-wise (AdamW, the same in every
# row) and left out: these rows are the matrix step only. Forward/backward is not modelled here (the
# TP activation collectives are the same in every row; the DP side differs as in the flat model:
# reduce-scatter for the FSDP rows, reduce-to-owner for matrixfsdp's, in backward, not in the step).
# Gradients and update shards move in fp32 (GRAD_BYTES). Matrix-step FLOPs: the planner's cost
# (matrixfsdp.planner.cost) at HW.mm_flops, as the other modes. All-to-all latency: alpha * log2(n)
# per call on the slowest link class it touches (the flat DistMuon row's term); its bandwidth term:
# the busiest rank's larger of sent and received bytes per link class. Rows:
#
# * ``tp_redundant``  Megatron ``TensorParallelMuon(mode="duplicated")`` / Canzona's SC baseline:
#                     per matrix a ring all-gather of the (momentum-updated) gradient over the TP
#                     group, the whole-matrix step on every TP rank of every DP replica (sum over
#                     all matrices, everywhere), each rank keeping its shard of the update. The DP
#                     side is plain DP (every DP rank holds its whole TP shard after backward's
#                     all-reduce), so no DP traffic in the step; gathers pipelined with the steps
#                     (the next matrix's gather under the current step: favourable to the row).
# * ``tp_redundant_fsdp`` the same with FSDP on the DP side (the TP shard is also split over dp):
#                     each matrix is first all-gathered over dp (ring over IB), then over tp.
# * ``tp_distmuon``   torchtitan-style DistMuon over the flattened dp x tp shard set (W = dp*tp):
#                     per decoder-layer bucket one all-to-all sends every rank's 1/W shard of each
#                     matrix to its owner and one sends the update shards back; owners by
#                     torchtitan 0.3.0's _assign_balanced_owner_ranks (LPT on step cost within the
#                     bucket, ties by the load carried from earlier buckets) over all W ranks, so
#                     the step compute is spread over every rank of the mesh. An owner receives
#                     (tp-1)/W of its matrix over NVLink and (W-tp)/W over IB. Time: first gather +
#                     last scatter + max(the other all-to-alls, the largest carried compute load):
#                     the most favourable pipelining reading (as the flat fsdp2_distmuon row;
#                     0.3.0's _BucketedRedistributionRuntime keeps two pipeline slots on one
#                     transfer stream, so the next bucket's all-to-all is prefetched under the
#                     current compute and the all-to-alls themselves run one after another).
#                     Reading of torchtitan 0.3.0 (torchtitan/distributed/flex_shard/dist_muon.py):
#                     ``ComputeLayout({"dp_shard": Owned(), "tp": Owned()})`` selects one owner from
#                     the Cartesian product, but a parameter sharded on both axes raises "multi-axis
#                     transport is not implemented" (and redistributing one axis needs every other
#                     storage axis replicated), so this row is that layout's transport as if it were
#                     implemented, not a measured code path; at dp=1 it is what 0.3.0 runs.
# * ``tp_distmuon_mean`` the same exchange priced as the flat ``fsdp2_distmuon`` row prices it: every
#                     rank moves the mean rank's bytes ((W-1)/W of the bucket / W), as if the owners'
#                     receives were spread over every rank's links. A lower bound for DistMuon.
# * ``mf_tp_microgroups`` matrixfsdp (issue 18): owners planned over dp (plan_owners(model, dp));
#                     the owner's TP group (one node) hosts each of its matrices' step on one TP
#                     rank. Micro-groups (tp_micro_groups below: Canzona's Algorithm 2, LPT hosts
#                     with greedy rollback at a per-host buffer capacity C_max) each move with one
#                     fused all-to-all gathering the gradient shards to the hosts and one scattering
#                     the update shards back ((tp-1)/tp of each matrix per direction); group k+1's
#                     gather and group k-1's scatter overlap group k's compute:
#                     g_1 + sum_k max(c_k, g_{k+1} + s_{k-1}) + s_K. No DP traffic in the step;
#                     the step time is the slowest owner group's.
# * ``mf_tp_fused_seq`` the same micro-groups run one after another (g_k + c_k + s_k summed):
#                     Canzona's own code, per the issue.
# * ``mf_tp_unfused``  the same hosts and groups, one all-to-all pair per matrix (its latency each),
#                     sequential.

TP_IMPLS = ("tp_redundant", "tp_redundant_fsdp", "tp_distmuon", "tp_distmuon_mean", "mf_tp_microgroups",
            "mf_tp_fused_seq", "mf_tp_unfused")
TP_C_MAX = 512 * 2**20  # bytes of whole matrices (fp32 gradient) one host takes per micro-group:
# Canzona's Fig. 14 plateau (~512 MB fused buffer)
CANZONA_TP_FLOPS_BALANCE = {"naive": 3.24, "micro_groups": 2.46}  # Fig. 3b as the review reports it


@dataclass
class TRow:
    model: str
    dp: int
    tp: int
    world: int
    optimizer: str
    impl: str
    step_ms: float
    comm_ms: float  # sum of the row's step collectives (overlapped or not)
    compute_ms: float  # the step compute on the critical path (busiest rank / group)
    collectives: int  # step collective calls on the busiest rank
    sent_bytes_rank: float  # bytes the busiest rank sends in the step
    groups: int | None = None  # micro-groups of the slowest owner group (mf rows)
    host_makespan_bound: float | None = None  # sum_k max-host load / (group total / tp), worst owner group
    naive_makespan_bound: float | None = None  # the same with round-robin hosts in the same groups
    flops_max_avg: float | None = None  # Canzona's ratio: max / mean step FLOPs over the dp*tp ranks
    flops_max_avg_naive: float | None = None  # ... with round-robin hosts (plan order) in each TP group
    tp_flops_max_avg: float | None = None  # max over owner groups of (max / mean over the group's tp hosts)
    tp_flops_max_avg_naive: float | None = None
    dp_max_mean: float | None = None  # owner plan over dp: max / mean owner cost


def lpt_hosts(costs: list[float], n: int) -> tuple[list[int], list[float]]:
    """Min-heap LPT (Canzona's MinHeapSolver, Algorithm 4): items in descending cost (index as the
    tie-break, so every rank computes the same answer) each to the least-loaded host, ties to the
    lowest host index. Mirrors the planner's micro-group host assignment
    (``matrixfsdp.planner.micro_groups.plan_micro_groups``, being built separately); this
    self-contained copy is the model's, it does not import it. Returns (host per item, loads)."""
    import heapq

    heap = [(0.0, r) for r in range(n)]
    host = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        host[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    loads = [0.0] * n
    for i, r in enumerate(host):
        loads[r] += costs[i]
    return host, loads


def tp_micro_groups(items: list[tuple[str, float, float]], tp: int, c_max: float = TP_C_MAX):
    """Canzona's Algorithm 2 (LPT with greedy rollback) on ``items`` = (fqn, step cost, bytes):
    global sort by (cost desc, fqn); add each item to the current group, re-run :func:`lpt_hosts`
    on the group, and if some host would then hold more than the capacity, close the group
    without it and start the next one with it. The capacity is ``c_max`` or the group's first
    (costliest) item's bytes, whichever is larger: read literally, a matrix above ``c_max`` would
    sit alone in its group and leave tp-1 hosts idle; here it takes its neighbours. Returns a list
    of groups, each a list of (item, host)."""
    order = sorted(items, key=lambda it: (-it[1], it[0]))
    groups, cur, cur_host = [], [], []
    for it in order:
        test = cur + [it]
        host, _ = lpt_hosts([c for _, c, _ in test], tp)
        held = [0.0] * tp
        for (_, _, nb), r in zip(test, host):
            held[r] += nb
        if cur and max(held) > max(c_max, cur[0][2]):
            groups.append(list(zip(cur, cur_host)))
            cur = [it]
            cur_host = [0]
        else:
            cur, cur_host = test, host
    if cur:
        groups.append(list(zip(cur, cur_host)))
    return groups


def _a2a_intra(send: list[float], recv: list[float], n: int, hw: Hardware) -> float:
    """One all-to-all within a node of ``n`` ranks: latency alpha*log2(n) + the busiest rank's
    larger of sent and received bytes over NVLink."""
    if n <= 1:
        return 0.0
    return hw.alpha_intra * math.log2(n) + max(max(send), max(recv)) / hw.bw_intra


def _pipeline(g: list[float], c: list[float], s: list[float]) -> float:
    """Stages k = 1..K: gather g_k, compute c_k, scatter s_k on one comm stream; group k+1's
    gather and group k-1's scatter run under group k's compute."""
    K = len(c)
    if K == 0:
        return 0.0
    t = g[0] + s[-1]
    for k in range(K):
        t += max(c[k], (g[k + 1] if k + 1 < K else 0.0) + (s[k - 1] if k > 0 else 0.0))
    return t


def tp_owner_group(mats, tp: int, hw: Hardware, opt_flops: float, c_max: float = TP_C_MAX) -> dict:
    """The step of one owner's TP group hosting ``mats`` (ParamPlans, whole-matrix costs)."""
    E = GRAD_BYTES
    items = [(p.fqn, p.cost, p.numel * E) for p in mats]
    groups = tp_micro_groups(items, tp, c_max)
    g, c, s, unf = [], [], [], 0.0
    host_loads = [0.0] * tp
    naive_loads = [0.0] * tp
    sent = [0.0] * tp
    ms_lpt = ms_naive = 0.0
    ncoll = 0
    naive = {p.fqn: i % tp for i, p in enumerate(mats)}  # round-robin hosts in plan order
    for grp in groups:
        send, recv = [0.0] * tp, [0.0] * tp
        load, nload = [0.0] * tp, [0.0] * tp
        unf_comm = 0.0
        for (fqn, cost, nb), h in grp:
            for r in range(tp):
                if r != h:
                    send[r] += nb / tp
            recv[h] += (tp - 1) / tp * nb
            load[h] += cost
            nload[naive[fqn]] += cost
            one = [nb / tp if r != h else 0.0 for r in range(tp)]
            one_r = [(tp - 1) / tp * nb if r == h else 0.0 for r in range(tp)]
            unf_comm += 2 * _a2a_intra(one, one_r, tp, hw)  # gather and scatter of this matrix alone
        gk = _a2a_intra(send, recv, tp, hw)
        sk = _a2a_intra(recv, send, tp, hw)  # the scatter mirrors the gather
        ck = max(load) / opt_flops
        g.append(gk)
        c.append(ck)
        s.append(sk)
        unf += unf_comm + ck
        ms_lpt += max(load)
        ms_naive += max(nload)
        for r in range(tp):
            host_loads[r] += load[r]
            naive_loads[r] += nload[r]
            sent[r] += send[r] + recv[r]  # gather: non-hosts send shards; scatter: hosts send
        ncoll += 2
    total = sum(p.cost for p in mats)
    bound = total / tp if total else 1.0
    return {
        "pipelined": _pipeline(g, c, s), "sequential": sum(g) + sum(c) + sum(s), "unfused": unf,
        "comm": sum(g) + sum(s), "unfused_comm": unf - sum(c), "compute": sum(c), "groups": len(groups),
        "collectives": ncoll, "unfused_collectives": 2 * len(mats), "sent": max(sent) if mats else 0.0,
        "makespan_bound": ms_lpt / bound if total else 1.0, "naive_makespan_bound": ms_naive / bound if total else 1.0,
        "host_loads": host_loads, "naive_loads": naive_loads,
    }


def simulate_tp(name: str, dp: int, optimizer: str = "muon", tp: int | None = None, hw: Hardware = HW,
                opt_flops: float | None = None, c_max: float = TP_C_MAX) -> list[TRow]:
    """The TP-mode rows for one preset on a (dp, tp) mesh (tp within a node)."""
    tp = hw.node if tp is None else tp
    if tp > hw.node:
        raise ValueError(f"simulate_tp: tp={tp} must fit in a node of {hw.node} (TP over NVLink)")
    opt_flops = hw.mm_flops if opt_flops is None else opt_flops
    W = dp * tp
    E = GRAD_BYTES
    with torch.device("meta"):
        model = Decoder(PRESETS[name])
    plan = plan_owners(model, dp, block_types=(DecoderLayer,), optimizer=optimizer)
    mats = [p for p in plan.params if p.placement == "matrix"]
    blocks = list(plan.blocks)
    bi, ai, bx, ax = hw.bw_intra, hw.alpha_intra, hw.bw_inter, hw.alpha_inter
    rows: list[TRow] = []

    def put(impl, step, comm, compute, ncoll, sent, **kw):
        rows.append(TRow(name, dp, tp, W, optimizer, impl, step * 1e3, comm * 1e3, compute * 1e3, ncoll, sent, **kw))

    # ---- redundant: per matrix ring all-gather over tp (and first over dp for FSDP), step everywhere
    c_all = [p.cost / opt_flops for p in mats]
    ag_tp = [_ring_link(p.numel * E, tp, bi, ai) for p in mats]
    ag_dp = [_ring_link(p.numel * E / tp, dp, bx, ax) for p in mats]
    zero = [0.0] * len(mats)
    sent_tp = sum((tp - 1) / tp * p.numel * E for p in mats)
    sent_dp = sum((dp - 1) / dp * p.numel * E / tp for p in mats)
    put("tp_redundant", _pipeline(ag_tp, c_all, zero), sum(ag_tp), sum(c_all), len(mats), sent_tp)
    both = [a + b for a, b in zip(ag_dp, ag_tp)]
    put("tp_redundant_fsdp", _pipeline(both, c_all, zero), sum(both), sum(c_all),
        len(mats) * (2 if dp > 1 else 1), sent_tp + sent_dp)

    # ---- DistMuon over the flattened dp x tp group (rank = d * tp + t, node d)
    carried = [0.0] * W
    comms, comms_mean = [], []
    sent_dm = [0.0] * W
    lat = (ax if dp > 1 else ai) * math.log2(max(W, 2))
    for b in blocks:
        bm = sorted((p for p in mats if p.block == b), key=lambda p: (-p.cost, p.fqn))
        if not bm or W == 1:
            carried[0] += sum(p.cost for p in bm)
            continue
        bl = [0.0] * W
        ri, rx = [0.0] * W, [0.0] * W
        si_node, si_adj, sx_node = [0.0] * dp, [0.0] * W, [0.0] * dp
        sx_all = 0.0
        for p in bm:
            o = min(range(W), key=lambda i: (bl[i], carried[i], i))
            bl[o] += p.cost
            carried[o] += p.cost
            piece = p.numel * E / W
            ri[o] += (tp - 1) * piece  # from the owner's node peers, NVLink
            rx[o] += (W - tp) * piece  # from every other node, IB
            si_node[o // tp] += piece  # every rank of the owner's node but the owner sends over NVLink
            si_adj[o] -= piece
            sx_all += piece  # every rank of the other nodes sends over IB
            sx_node[o // tp] -= piece
        busiest = 0.0
        for r in range(W):
            si = si_node[r // tp] + si_adj[r]
            sx = sx_all + sx_node[r // tp]
            busiest = max(busiest, si / bi, ri[r] / bi, sx / bx, rx[r] / bx)
            sent_dm[r] += si + sx + ri[r] + rx[r]  # gather: shards; scatter: updates
        comms += [lat + busiest] * 2  # gather to the owners; the scatter back mirrors it
        mean = (W - 1) / W * sum(p.numel for p in bm) * E / W  # the flat row's per-rank bytes
        mean_i, mean_x = mean * (tp - 1) / (W - 1), mean * (W - tp) / (W - 1)
        comms_mean += [lat + max(mean_i / bi, mean_x / bx)] * 2
    dm_compute = max(carried) / opt_flops

    def favourable(cs):  # first gather + last scatter exposed, the rest under the compute
        if not cs:
            return dm_compute
        fill = cs[0] + cs[-1]
        return fill + max(sum(cs) - fill, dm_compute)

    put("tp_distmuon", favourable(comms), sum(comms), dm_compute, len(comms), max(sent_dm))
    put("tp_distmuon_mean", favourable(comms_mean), sum(comms_mean), dm_compute, len(comms_mean),
        2 * (W - 1) / W * sum(p.numel for p in mats) * E / W)

    # ---- matrixfsdp: owners over dp, each owner's TP group hosts its matrices' steps
    per = [tp_owner_group([p for p in mats if p.owner == d], tp, hw, opt_flops, c_max) for d in range(dp)]
    owner_cost = [sum(p.cost for p in mats if p.owner == d) for d in range(dp)]
    dp_max_mean = max(owner_cost) / statistics.fmean(owner_cost)
    all_loads = [x for r in per for x in r["host_loads"]]
    all_naive = [x for r in per for x in r["naive_loads"]]

    def max_avg(xs):
        m = statistics.fmean(xs)
        return max(xs) / m if m else 1.0

    worst = max(range(dp), key=lambda d: per[d]["pipelined"])
    bal = dict(groups=per[worst]["groups"], host_makespan_bound=max(r["makespan_bound"] for r in per),
               naive_makespan_bound=max(r["naive_makespan_bound"] for r in per),
               flops_max_avg=max_avg(all_loads), flops_max_avg_naive=max_avg(all_naive),
               tp_flops_max_avg=max(max_avg(r["host_loads"]) for r in per),
               tp_flops_max_avg_naive=max(max_avg(r["naive_loads"]) for r in per), dp_max_mean=dp_max_mean)
    sent_mf = max(r["sent"] for r in per)
    for impl, key, comm_key, coll_key in (("mf_tp_microgroups", "pipelined", "comm", "collectives"),
                                          ("mf_tp_fused_seq", "sequential", "comm", "collectives"),
                                          ("mf_tp_unfused", "unfused", "unfused_comm", "unfused_collectives")):
        d = max(range(dp), key=lambda d: per[d][key])
        put(impl, per[d][key], per[d][comm_key], per[d]["compute"], max(r[coll_key] for r in per), sent_mf, **bal)
    return rows


def check_tp(rows: list[TRow]) -> tuple[dict[str, dict[str, tuple[int, int, list[str]]]], list[str]]:
    """Per optimizer, two checks at every (preset, dp). ``structural``: mf_tp_microgroups at or below
    both redundant readings, pipelined at or below sequential, fused at or below unfused (true by
    construction of the model). ``vs_distmuon``: mf_tp_microgroups at or below both DistMuon-TP
    readings (a result, not a construction). Returns {optimizer: {check: (passed, points,
    failures)}} and summary lines."""
    by = {(r.optimizer, r.model, r.dp, r.impl): r for r in rows}
    res: dict[str, dict[str, tuple[int, int, list[str]]]] = {}
    tol = 1 + 1e-12
    for (o, m, dp, impl), mg in by.items():
        if impl != "mf_tp_microgroups":
            continue

        def k(i):
            return by[o, m, dp, i].step_ms

        groups = {
            "structural": {"<= tp_redundant": mg.step_ms <= k("tp_redundant") * tol,
                           "<= tp_redundant_fsdp": mg.step_ms <= k("tp_redundant_fsdp") * tol,
                           "pipelined <= sequential": mg.step_ms <= k("mf_tp_fused_seq") * tol,
                           "fused <= unfused": k("mf_tp_fused_seq") <= k("mf_tp_unfused") * tol},
            "vs_distmuon": {f"{mg.step_ms:.2f} <= tp_distmuon {k('tp_distmuon'):.2f} ms":
                            mg.step_ms <= k("tp_distmuon") * tol,
                            f"{mg.step_ms:.2f} <= tp_distmuon_mean {k('tp_distmuon_mean'):.2f} ms":
                            mg.step_ms <= k("tp_distmuon_mean") * tol},
        }
        for name, checks in groups.items():
            p, n, fails = res.setdefault(o, {}).get(name, (0, 0, []))
            bad = [c for c, ok in checks.items() if not ok]
            res[o][name] = (p + (not bad), n + 1, fails + ([f"{m} dp={dp}: not " + "; not ".join(bad)] if bad else []))
    what = {"structural": "mf_tp_microgroups <= tp_redundant and tp_redundant_fsdp; pipelined <= sequential; "
                          "fused <= unfused",
            "vs_distmuon": "mf_tp_microgroups <= tp_distmuon and tp_distmuon_mean"}
    lines = []
    for o in sorted(res):
        for name, (p, n, fails) in res[o].items():
            lines.append(f"check {what[name]}, {o}: {p}/{n} (preset, dp) points pass" + ("; failures:" if fails else ""))
            lines += [f"  - {f}" for f in fails]
    return res, lines


def render_tp(rows: list[TRow], models, dps, optimizers, tp: int, command: str, c_max: float) -> str:
    out = [
        f"<!-- produced by: {command} -->",
        f"<!-- {datetime.date.today()} torch {torch.__version__} python {platform.python_version()}; "
        f"hardware assumptions: {asdict(HW)}; mesh (dp, tp={tp}): tp within a node (NVLink), dp across nodes (IB); "
        f"micro-group capacity C_max = {c_max / 2**20:g} MiB of whole fp32 gradients per host; gradients and "
        f"update shards in fp32; matrix-step FLOPs from matrixfsdp.planner.cost at {HW.mm_flops / 1e12:g} TFLOP/s "
        f"(Shampoo/SOAP eigendecompositions amortized over precondition_frequency=10) -->",
        "",
        f"Modelled optimizer step (matrix step only; element-wise AdamW and forward/backward left out) on a "
        f"(dp, {tp}) mesh, issue 18. Rows: `tp_redundant` (Megatron `duplicated` / Canzona SC: TP all-gather, "
        "every matrix stepped on every rank; plain DP), `tp_redundant_fsdp` (the same with the TP shard also "
        "FSDP-sharded over dp: a dp all-gather first), `tp_distmuon` (torchtitan-style DistMuon over the "
        "flattened dp x tp shard set, per-layer all-to-alls across nodes, most favourable pipelining; not "
        "runnable in torchtitan 0.3.0 at dp > 1, see the script), `mf_tp_microgroups` (owners over dp, TP "
        "hosts in LPT micro-groups, fused all-to-alls, pipelined), `mf_tp_fused_seq` (micro-groups one "
        "after another, as Canzona's code), `mf_tp_unfused` (an all-to-all pair per matrix, sequential). "
        "See docs/benchmarks.md.",
        "",
        "Balance columns (mf rows): `LPT mk/bd`: sum over micro-groups of the busiest host's FLOPs over "
        f"(owner group's FLOPs / {tp}), worst owner group (1 = every group perfectly split over its hosts); "
        "`naive mk/bd`: the same groups with round-robin hosts (plan order). `Max/Avg`: Canzona's load-balance "
        "ratio, max over mean step FLOPs of the dp x tp ranks (includes the owner plan's DP imbalance), LPT / "
        "naive; `TP Max/Avg`: the same within each owner's TP group (worst group), LPT / naive. Canzona Fig. "
        f"3b (Qwen3-32B, Muon, DP=32 x TP=8), as the review reports it: TP FLOPs Max/Avg {CANZONA_TP_FLOPS_BALANCE['naive']}x "
        f"naive (ASC), {CANZONA_TP_FLOPS_BALANCE['micro_groups']}x with micro-group scheduling (LB-ASC). Those are "
        "measured over Megatron's TP-split parameter set with numel as the cost and their own naive host rule; "
        "ours are modelled over our Decoder's matrices with the planner's FLOP cost and round-robin as naive. "
        "(The review also quotes 3.24x / 2.46x as Fig. 3c's DP naive FLOPs / memory ratios; "
        "benchmarks/canzona_fig3.py reproduces that reading.)",
    ]
    _, summary = check_tp(rows)
    for o in optimizers:
        out += ["", f"### {o}", "",
                "| model | dp | W | " + " | ".join(TP_IMPLS) + " | gain vs redundant | gain vs redundant_fsdp | gain vs distmuon | "
                "gain vs distmuon_mean | unfused/fused | "
                "seq/pipelined | groups | LPT mk/bd | naive mk/bd | Max/Avg LPT / naive | TP Max/Avg LPT / naive | "
                "owner dp max/mean |",
                "|---|---:|---:|" + "---:|" * 19]
        for m in models:
            for dp in dps:
                by = {r.impl: r for r in rows if (r.optimizer, r.model, r.dp) == (o, m, dp)}
                if "mf_tp_microgroups" not in by:
                    continue
                mg = by["mf_tp_microgroups"]
                st = lambda i: by[i].step_ms  # noqa: E731
                out.append(
                    f"| {m} | {dp} | {mg.world} | " + " | ".join(f"{st(i):.1f}" for i in TP_IMPLS) +
                    f" | {st('tp_redundant') / mg.step_ms:.1f}x | {st('tp_redundant_fsdp') / mg.step_ms:.1f}x | "
                    f"{st('tp_distmuon') / mg.step_ms:.2f}x | {st('tp_distmuon_mean') / mg.step_ms:.2f}x | "
                    f"{st('mf_tp_unfused') / st('mf_tp_fused_seq'):.3f} | "
                    f"{st('mf_tp_fused_seq') / mg.step_ms:.3f} | {mg.groups} | {mg.host_makespan_bound:.3f} | "
                    f"{mg.naive_makespan_bound:.3f} | {mg.flops_max_avg:.2f} / {mg.flops_max_avg_naive:.2f} | "
                    f"{mg.tp_flops_max_avg:.2f} / {mg.tp_flops_max_avg_naive:.2f} | {mg.dp_max_mean:.3f} |")
    out += ["", "Step breakdown at the largest dp (ms: collectives summed / compute on the critical path; "
            "collective calls on the busiest rank; MB sent by the busiest rank):", "",
            "| optimizer | model | dp | " + " | ".join(TP_IMPLS) + " |", "|---|---|---:|" + "---|" * len(TP_IMPLS)]
    for o in optimizers:
        for m in models:
            dp = max(dps)
            by = {r.impl: r for r in rows if (r.optimizer, r.model, r.dp) == (o, m, dp)}
            if by:
                out.append(f"| {o} | {m} | {dp} | " + " | ".join(
                    f"{by[i].comm_ms:.1f} / {by[i].compute_ms:.1f}, {by[i].collectives}, {by[i].sent_bytes_rank / 1e6:.0f}"
                    for i in TP_IMPLS) + " |")
    out += ["", "Checks (structural: true by the model's construction; vs_distmuon: a result):", "", "```", *summary, "```"]
    return "\n".join(out) + "\n"


def plot_tp(rows: list[TRow], models, optimizers, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nc = len(optimizers)
    fig, axes = plt.subplots(2, nc, figsize=(5.5 * nc, 8), squeeze=False)
    big = models[-1]
    for oi, o in enumerate(optimizers):
        ax = axes[0][oi]
        for impl in TP_IMPLS:
            pts = sorted((r.dp, r.step_ms) for r in rows if (r.optimizer, r.model, r.impl) == (o, big, impl))
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=impl, ls="--" if impl.startswith("tp_") else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{big}, {o}: optimizer step, tp=8")
        ax.set_xlabel("dp (nodes)")
        ax.set_ylabel("modelled step (ms)")
        ax = axes[1][oi]
        for m in models:
            by = {(r.dp, r.impl): r.step_ms for r in rows if (r.optimizer, r.model) == (o, m)}
            ds = sorted({d for d, _ in by})
            ln, = ax.plot(ds, [by[d, "tp_distmuon"] / by[d, "mf_tp_microgroups"] for d in ds], marker="o", ms=3,
                          label=m)
            ax.plot(ds, [by[d, "tp_distmuon_mean"] / by[d, "mf_tp_microgroups"] for d in ds], ls="--", marker="x",
                    ms=3, color=ln.get_color())
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{o}: step, tp_distmuon (solid) and _mean (dashed) / mf_tp_microgroups", fontsize=9)
        ax.set_xlabel("dp (nodes)")
        ax.set_ylabel("gain (> 1: micro-groups faster)")
    _finish(fig, axes, "TP (dp x 8) optimizer-step model (assumed H100 + NVLink + 400G IB); benchmarks/scaling_model.py --tp", path)


def main_tp(args, argv) -> int:
    models = args.models
    dps = args.dps or [1, 2, 4, 8, 16, 32]
    optimizers = args.optimizers or ["muon", "shampoo", "soap"]
    c_max = args.c_max_mib * 2**20
    rows: list[TRow] = []
    for o in optimizers:
        for m in models:
            for dp in dps:
                rows += simulate_tp(m, dp, o, tp=args.tp_degree, c_max=c_max)
    for r in rows:
        for k in ("step_ms", "comm_ms", "compute_ms"):
            setattr(r, k, round(getattr(r, k), 4))
        for k in ("host_makespan_bound", "naive_makespan_bound", "flops_max_avg", "flops_max_avg_naive",
                  "tp_flops_max_avg", "tp_flops_max_avg_naive", "dp_max_mean"):
            if getattr(r, k) is not None:
                setattr(r, k, round(getattr(r, k), 6))
        r.sent_bytes_rank = round(r.sent_bytes_rank)
    md = render_tp(rows, models, dps, optimizers, args.tp_degree, bc.command_line(__file__, argv), c_max)
    _, summary = check_tp(rows)
    print("\n".join(summary))
    if args.out:
        with open(args.out + ".jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(asdict(r)) + "\n")
        with open(args.out + ".md", "w") as f:
            f.write(md)
        plot_tp(rows, models, optimizers, args.out + ".png")
    else:
        print(md)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", nargs="*", default=["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"])
    ap.add_argument("--worlds", nargs="*", type=int, default=None,
                    help="default 8..256 (flat), 8..1024 (--hsdp)")
    ap.add_argument("--validate", nargs="*", default=None, metavar="STEP_BENCH.jsonl",
                    help="model these step_bench runs on --calibration figures and compare")
    ap.add_argument("--calibration", nargs="*", default=None, metavar="CALIBRATION.json",
                    help="benchmarks/calibrate.py output, one per --validate file")
    ap.add_argument("--hsdp", action="store_true",
                    help="HSDP mesh (R x 8) rows of issue 17: hsdp_adamw, hsdp_distmuon, mf_repeat, mf_split "
                         "(default worlds 8..1024, optimizers muon shampoo soap, regimes weak strong)")
    ap.add_argument("--regime", nargs="*", choices=("weak", "strong"), default=None,
                    help="weak: HW.tokens_per_rank per rank; strong: --global-tokens split over W "
                         "(flat mode: one regime, default weak)")
    ap.add_argument("--global-tokens", type=int, default=STRONG_GLOBAL_TOKENS,
                    help="global batch of the strong regime (default 4M = 4*2^20)")
    ap.add_argument("--optimizers", nargs="*", choices=("muon", "shampoo", "soap"), default=None,
                    help="matrix optimizer (planner FLOP formula); flat mode: one, default muon")
    ap.add_argument("--opt-tflops", type=float, default=None,
                    help="HSDP rows only: throughput of the matrix step in TFLOP/s (default HW.mm_flops); "
                         "omits the flat rows")
    ap.add_argument("--tp", action="store_true",
                    help="TP mesh (dp x tp, tp within a node) optimizer-step rows of issue 18: tp_redundant, "
                         "tp_redundant_fsdp, tp_distmuon, mf_tp_microgroups, mf_tp_fused_seq, mf_tp_unfused "
                         "(default dp 1..32, optimizers muon shampoo soap)")
    ap.add_argument("--dps", nargs="*", type=int, default=None, help="--tp: data-parallel sizes (default 1 2 4 8 16 32)")
    ap.add_argument("--tp-degree", type=int, default=HW.node, help="--tp: TP degree, at most HW.node (default 8)")
    ap.add_argument("--c-max-mib", type=float, default=TP_C_MAX / 2**20,
                    help="--tp: micro-group capacity, MiB of whole fp32 gradients per host (default 512)")
    args = ap.parse_args(argv)
    if args.tp:
        if args.hsdp or args.validate is not None or args.worlds is not None or args.regime is not None \
                or args.opt_tflops is not None:
            ap.error("--tp takes --models, --dps, --optimizers, --tp-degree, --c-max-mib and --out only")
        return main_tp(args, argv)
    if args.hsdp:
        if args.validate is not None:
            ap.error("--hsdp and --validate are separate modes")
        return main_hsdp(args, argv)
    if args.worlds is None:
        args.worlds = [8, 16, 32, 64, 128, 256]
    regime = (args.regime or ["weak"])
    optimizer = (args.optimizers or ["muon"])
    if len(regime) != 1 or len(optimizer) != 1 or args.opt_tflops is not None:
        ap.error("the flat model takes one --regime and one --optimizers value (and no --opt-tflops); "
                 "use --hsdp for sweeps")
    import dataclasses

    hw = HW if regime[0] == "weak" else dataclasses.replace(HW, tokens_per_rank=None)
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
            h = hw if hw.tokens_per_rank is not None else dataclasses.replace(HW, tokens_per_rank=args.global_tokens // W)
            for r in simulate(m, W, h, optimizer[0]):
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
