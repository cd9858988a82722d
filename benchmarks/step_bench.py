"""Side-by-side training-step benchmark: matrixfsdp against DDP/FSDP2/torchtitan/ZeRO-1 baselines.

Every implementation (``benchmarks/baselines/``) trains the same ``matrixfsdp.Decoder`` (seeded
init) on the same synthetic tokens with the same Muon / AdamW hyperparameters and the same
Newton-Schulz dtype (``--ns-dtype``: float32 by default on gloo, bfloat16 on nccl).

    python benchmarks/step_bench.py --world 4 [--impls ddp_muon,zero1_owner] [--repeats 3]
                                    [--out benchmarks/results/step/step_cpu_w4] [--netns]
    torchrun --nproc-per-node 2 benchmarks/step_bench.py --impl ddp_muon      # also works

The same script runs on GPUs with ``--backend nccl`` (one GPU per rank: ``cuda:<LOCAL_RANK>``
under torchrun, ``cuda:<rank % device_count>`` otherwise; it stops with an error before any
rendezvous if CUDA, NCCL or enough GPUs are missing):

    torchrun --nproc-per-node 8 benchmarks/step_bench.py --backend nccl --out benchmarks/results/step/step_nccl_w8
    python benchmarks/step_bench.py --world 8 --backend nccl --out benchmarks/results/step/step_nccl_w8
                                    [--ns-dtype float32] [--impls ...]            # driver form, one node

The driver starts one process per rank (FileStore rendezvous, hard timeout). Each rank runs, for
each repeat, every implementation in turn (``ddp_muon`` first, the others rotated per repeat): setup,
``--warmup`` steps (the parameters after ``--parity-steps`` steps are gathered on rank 0 and
compared with ``ddp_muon``'s), then ``--steps`` measured steps. Per step and rank it times forward,
backward and optimizer step (``time.perf_counter``; a barrier before each step, outside the timers;
on CUDA ``torch.cuda.synchronize()`` before every timer read) and counts collective calls/bytes per
phase. Per step, a phase's time is the max over ranks; a repeat reports the median over its
measured steps; the summary gives min/median/max of those medians over repeats, and ratios between
implementations within the same repeat.

Output: one JSON row per (implementation, repeat) on stdout, then a markdown summary; ``--out X``
writes ``X.jsonl`` and ``X.md``. Implementations that cannot run print a row with
``"status": "skipped"`` or ``"error"`` and the reason.

Noise control (the machine is shared): each (implementation, repeat) records the share of the CPU
that *other* processes used during its measured steps; above ``--max-foreign`` (15%) it is discarded
and rerun (``--retries``, after waiting up to ``--quiet-wait`` s for a quiet second), and the summary
uses only clean repeats. CPU seconds per phase (summed over ranks) are reported next to wall times.

``--netns``: run rank r inside network namespace ``mfb-r<r>`` over the veth/bridge/tbf network of
``benchmarks/netns/setup.sh`` (GLOO_SOCKET_IFNAME=mfb0); needs root and the setup script first.
gloo only (with the NIC byte counters it enables).

``--mesh R,S`` (issue 17, HSDP): every implementation gets the 2-D mesh
``init_device_mesh(dev, (R, S), mesh_dim_names=("dp_replicate", "dp_shard"))`` (rank = r*S + s) and
the default rows become the HSDP ones (``HSDP_DEFAULT_IMPLS``): ``single_muon`` (the single-process
run on every rank: parity reference and total step work), torch HSDP + AdamW (the ratio reference),
HSDP + DistMuon and HSDP + gather-Muon (optimizer collectives within the shard group, repeated by
every replica), matrixfsdp ``repeat`` and ``split``. Before the rows it measures gloo send/recv
throughput within a shard group and across replicas (``--link-check-mb``), and after each round
rank 0 times the single-process step alone (the other ranks idle in a barrier). With the two-node
network of ``benchmarks/netns/setup_two_level.sh``:

    sudo benchmarks/netns/setup_two_level.sh 1gbit
    python benchmarks/step_bench.py --world 4 --mesh 2,2 --netns --out benchmarks/results/hsdp/hsdp_two_level_1gbit

``--tp T`` (issue 18): with ``--world T`` (the default; dp=1) the T ranks form one 1-D ``("tp",)``
mesh and every rank sees the whole batch; the model is the
bench Decoder with torch's TP plan on every layer (q/k/v, gate/up ``ColwiseParallel``; o, down
``RowwiseParallel``; ``baselines.tp.tp_parallelize``; heads and KV heads must divide by T: the
defaults become 8 and 4). Default rows (``TP_DEFAULT_IMPLS``), ratios and parity against
``tp_redundant`` (Megatron's ``duplicated``: all-gather every TP-sharded update, whole-matrix
Newton-Schulz on every TP rank); ``tp_microgroups`` (``matrixfsdp.tp.host_matrices``, the
planner's micro-groups, pipelined), ``tp_sequential`` (the same groups, ``pipeline=False``),
``tp_unfused`` (one micro-group per matrix, LPT hosts) and ``tp_shard_local`` (Newton-Schulz on
each local shard: inexact, timing only). The report adds the issue's three targets:

    python benchmarks/step_bench.py --tp 4 --out benchmarks/results/tp/tp_step_cpu_tp4

With ``--world W``, W = dp * T > T, TP composes with data parallelism on the 2-D
``init_device_mesh(dev, (dp, T), mesh_dim_names=("dp_shard", "tp"))`` (rank = d*T + t; each dp
row gets 1/dp of the batch): the same rows, each parallelized on ``mesh["tp"]`` and then wrapped
per DecoderLayer + root over ``mesh["dp_shard"]``. ``tp_redundant``: stock torch ``fully_shard``
(FSDP2 + TP; 2-D DTensor parameters), each matrix's momentum-updated shard all-gathered over all
W ranks (its ``full_tensor``) and Newton-Schulz on every rank. ``tp_microgroups``:
``matrixfsdp.plan_owners(model, mesh)`` + ``matrixfsdp.fully_shard`` (whole-matrix owners per dp
rank, the owner's TP row hosts the step, 2 fused all-to-alls per micro-group); ``tp_unfused``: the
same with ``tp_c_max=1`` (one micro-group per matrix); ``tp_sequential``: the same as
``tp_microgroups`` after ``matrixfsdp.tp.set_pipeline(model, False)``; ``tp_shard_local``: stock
FSDP2 + TP, Newton-Schulz on each rank's local block (inexact, timing only); and (dp > 1 only)
``tp_unfused_lpt``: ``tp_unfused`` with its hosts re-assigned by LPT (``tp_c_max=1`` alone puts
every one-matrix group on TP rank 0 of its owner row, so ``tp_unfused`` also loses host balance):

    python benchmarks/step_bench.py --tp 2 --world 4 --out benchmarks/results/tp/tp_step_cpu_dp2_tp2

``--model moe`` (issue 26): every row trains the MoE decoder of ``tests/_moe.py`` (expert stacks
``w1/w3 [E, F, D]``, ``w2 [E, D, F]``, router ``gate``, a shared expert; ``--experts`` (16),
``--moe-ffn`` F (256), ``--top-k`` (2); hidden 128, 4 layers, 4 heads unless overridden) with Muon on
every expert matrix. Default rows (``MOE_DEFAULT_IMPLS``, ``baselines/moe.py``): ``moe_ddp`` (DDP,
each expert matrix a 2-D view stepped alone: ratio and parity reference), ``moe_owners``
(``plan_owners`` + ``fully_shard`` + ``Muon(model)``: whole experts per rank, local batched step),
``moe_distmuon`` (stock FSDP2, DistMuon's owner scheme with each expert stack all-to-all'd whole to
an owner and back), ``moe_gather_muon`` (stock FSDP2, every stack's update all-gathered, every rank
steps every expert); ``moe_tt_distmuon`` (torchtitan's DistMuon as shipped: ``Owned()`` 2-D
matrices, ``Shard(0)`` compute on stacks) on request. After the measured steps each rank's local
``moe_owners`` step is timed alone (``--alone-reps``), for the step's balance limit; the report adds
the step, total and optimizer-state ratios against DDP and the issue's goals:

    python benchmarks/step_bench.py --world 4 --model moe --out benchmarks/results/moe/moe_step_cpu_w4

``--render X.jsonl`` (alone) rewrites ``X.md`` from the rows of an earlier run, keeping its command line.

Memory: per rank, the sum of local tensor bytes (parameters, gradients, optimizer state and
scratch; any device); on CUDA also ``torch.cuda.max_memory_allocated`` from the start of each
implementation's setup to the end of its measured steps.

Under nccl the torchtitan CPU patches are not applied: DistMuon runs as shipped, except that its
hard-wired bf16 Newton-Schulz is patched (and the row's notes say so) if ``--ns-dtype`` is not bf16.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _bench_common as bc  # noqa: E402
from baselines import IMPLS, BenchConfig, Context, batch_for_step  # noqa: E402

DEFAULT_IMPLS = ("ddp_muon", "fsdp2_gather_muon", "fsdp2_distmuon", "zero1_owner", "fsdp2_adamw", "matrixfsdp")
REFERENCE = "ddp_muon"
HSDP_DEFAULT_IMPLS = ("single_muon", "hsdp_adamw", "hsdp_distmuon", "hsdp_gather_muon", "mfsdp_repeat", "mfsdp_split")
#: --mesh defaults: ratios against stock HSDP + AdamW, parity against the single-process run
HSDP_REFERENCE, HSDP_PARITY_REF = "hsdp_adamw", "single_muon"
TP_DEFAULT_IMPLS = ("tp_redundant", "tp_microgroups", "tp_sequential", "tp_unfused", "tp_shard_local")
#: --tp T --world dp*T (dp > 1): the same rows plus tp_unfused with LPT-balanced hosts
TP_DP_DEFAULT_IMPLS = (*TP_DEFAULT_IMPLS, "tp_unfused_lpt")
TP_REFERENCE = "tp_redundant"  #: --tp: ratio and parity reference
#: --model moe (issue 26): the MoE decoder of tests/_moe.py; ratios and parity against moe_ddp
MOE_DEFAULT_IMPLS = ("moe_ddp", "moe_owners", "moe_distmuon", "moe_gather_muon")
MOE_REFERENCE = "moe_ddp"
#: 2-D tensors on AdamW in either model (left out of the parity's "Muon matrices" column)
ADAMW_2D_NAMES = ("model.embed_tokens.weight", "lm_head.weight", "embed.weight")
MB = 1 << 20


# ================================================================================ worker side
def _rank_env() -> tuple[int, int, int | None, int]:
    """(rank, world, local rank or None, ranks on this node) from the launcher's environment,
    before any rendezvous: the driver's MFB_* (one node), else torchrun's RANK/WORLD_SIZE/
    LOCAL_RANK/LOCAL_WORLD_SIZE (without LOCAL_WORLD_SIZE every rank is taken to be on this node)."""
    env = os.environ
    if "MFB_STORE" in env:
        world = int(env["MFB_WORLD"])
        return int(env["MFB_RANK"]), world, None, world
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else None
    return rank, world, local_rank, int(env.get("LOCAL_WORLD_SIZE", world))


def _worker_device(args: argparse.Namespace) -> torch.device:
    """This rank's device (``ValueError`` if ``--backend nccl`` cannot have one); sets it on CUDA."""
    rank, _, local_rank, local_world = _rank_env()
    device = bc.resolve_device(args.backend, rank=rank, local_rank=local_rank, local_world=local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _init_dist(args: argparse.Namespace, device: torch.device) -> tuple[int, int]:
    timeout = timedelta(seconds=args.pg_timeout)
    # nccl: bind the process group to this rank's GPU (barriers and object collectives use it)
    kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    if "MFB_STORE" in os.environ:
        rank, world = int(os.environ["MFB_RANK"]), int(os.environ["MFB_WORLD"])
        store = dist.FileStore(os.environ["MFB_STORE"], world)
        dist.init_process_group(args.backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw)
    else:  # torchrun
        dist.init_process_group(args.backend, timeout=timeout, **kw)
        rank, world = dist.get_rank(), dist.get_world_size()
    return rank, world


def _agree(ok: bool, msg: str) -> tuple[bool, list[str]]:
    """All ranks learn whether every rank succeeded (and the messages of those that did not)."""
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, (ok, msg))
    return all(o for o, _ in got), [f"rank {r}: {m}" for r, (o, m) in enumerate(got) if not o]


def run_one(name: str, cfg: BenchConfig, ctx: Context, args: argparse.Namespace, repeat: int,
            ref_state: dict[str, Any], counter: bc.CommCounter) -> dict[str, Any]:
    """Set up, warm up, parity-snapshot and time one implementation; returns its row (rank 0)."""
    rank, world = ctx.rank, ctx.world
    device = ctx.device
    cuda = device.type == "cuda"

    def sync() -> None:  # before every timer read: on CUDA the queued work must be finished
        bc.device_sync(device)

    row: dict[str, Any] = {"impl": name, "repeat": repeat, "world": world}
    impl = IMPLS[name](cfg, ctx)
    ok, err = True, ""
    cuda_base = 0
    if cuda:  # the peak is counted from here (setup) to the end of the measured steps
        sync()
        torch.cuda.reset_peak_memory_stats(device)
        cuda_base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    try:
        impl.setup()
        sync()
    except (ImportError, AttributeError) as e:
        ok, err = False, f"{type(e).__name__}: {e}"
        row["status_if_failed"] = "skipped"
    except Exception as e:
        ok, err = False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
    setup_s = time.perf_counter() - t0
    all_ok, errs = _agree(ok, err)
    if not all_ok:
        row["status"] = row.pop("status_if_failed", "error")
        row["reason"] = errs[0] if errs else err
        row["setup_s"] = setup_s
        impl.teardown()
        return row
    row.pop("status_if_failed", None)
    if getattr(impl, "balance", None) is not None:  # largest per-rank step work over the mean
        row["step_balance"] = round(float(impl.balance), 4)
    if getattr(impl, "micro_groups", None) is not None:  # --tp: TP host step's fused groups
        row["micro_groups"] = impl.micro_groups
    if getattr(impl, "micro_groups_per_row", None) is not None:  # --tp at dp > 1: per owner (dp) row
        row["micro_groups_per_row"] = impl.micro_groups_per_row

    n_steps = args.warmup + args.steps
    per_rank_times: list[tuple[float, float, float]] = []
    per_rank_cpu: list[tuple[float, float, float]] = []  # process CPU time (all threads) per phase
    losses: list[float] = []
    comm_snap: dict[str, Any] | None = None
    mem: dict[str, int] = {"params": bc.local_nbytes(impl.param_tensors())}
    parity_full = None
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") if args.netns else None
    nic: dict[str, list[int]] = {p: [0, 0] for p in ("fwd", "bwd", "step", "other")}

    def nic_add(phase: str, a: tuple[int, int] | None, b: tuple[int, int] | None) -> None:
        if measuring and a is not None and b is not None:
            nic[phase][0] += b[0] - a[0]
            nic[phase][1] += b[1] - a[1]

    measuring = False
    try:
        for s in range(n_steps):
            # data parallel ranks split the batch; the ranks of a TP group see the same tokens
            tokens = batch_for_step(cfg, s, rank // ctx.tp, world // ctx.tp, device)
            if s == args.warmup:
                counter.reset()
                cpu0, mach0 = bc.proc_cpu_ticks(), bc.machine_cpu_ticks()
                measuring = True
            n0 = bc.nic_bytes(ifname)
            with counter.in_phase("other"):
                dist.barrier()
            n1 = bc.nic_bytes(ifname)
            sync()
            c_a = time.process_time()
            t_a = time.perf_counter()
            with counter.in_phase("fwd"):
                loss = impl.forward(tokens)
            sync()
            t_b = time.perf_counter()
            c_b = time.process_time()
            n2 = bc.nic_bytes(ifname)
            with counter.in_phase("bwd"):
                impl.backward(loss)
            sync()
            t_c = time.perf_counter()
            c_c = time.process_time()
            n3 = bc.nic_bytes(ifname)
            if s == n_steps - 1:
                mem["grads"] = bc.local_nbytes(impl.grad_tensors())
            with counter.in_phase("step"):
                impl.step()
            sync()
            t_d = time.perf_counter()
            c_d = time.process_time()
            n4 = bc.nic_bytes(ifname)
            for ph, a, b in (("other", n0, n1), ("fwd", n1, n2), ("bwd", n2, n3), ("step", n3, n4)):
                nic_add(ph, a, b)
            impl.zero_grad()
            losses.append(float(loss.detach()))
            if s >= args.warmup:
                per_rank_times.append((t_b - t_a, t_c - t_b, t_d - t_c))
                per_rank_cpu.append((c_b - c_a, c_c - c_b, c_d - c_c))
            if s == args.parity_steps - 1:
                with counter.in_phase("other"):
                    parity_full = bc.gather_full_state(impl.named_parameters())
        comm_snap = counter.snapshot()
        cpu_used, mach1 = bc.proc_cpu_ticks() - cpu0, bc.machine_cpu_ticks()
        alone = None
        if args.alone_reps > 0 and hasattr(impl, "time_alone"):  # after the measured steps, untimed by them
            with counter.in_phase("other"):
                alone = impl.time_alone(batch_for_step(cfg, n_steps, rank, world, device), args.alone_reps)
        mem["opt_state"] = bc.local_nbytes(t for o in impl.optimizers() for t in bc.optimizer_state_tensors(o))
        mem["opt_scratch"] = bc.local_nbytes(impl.scratch_tensors())
        if cuda:  # allocator's view, next to the tensor-byte sums above
            sync()
            mem["cuda_base_allocated"] = cuda_base
            mem["cuda_max_allocated"] = torch.cuda.max_memory_allocated(device)
        ok, err = True, ""
    except Exception as e:
        ok, err = False, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
    all_ok, errs = _agree(ok, err)
    if not all_ok:
        row["status"] = "error"
        row["reason"] = errs[0] if errs else err
        impl.teardown()
        return row

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"times": per_rank_times, "cpu": per_rank_cpu, "comm": comm_snap, "mem": mem,
                                      "loss": losses, "cpu_ticks": cpu_used, "alone": alone,
                                      "nic": nic if ifname else None})
    row["notes"] = impl.notes
    row["status"] = "ok"
    if getattr(impl, "rank_cost", None) is not None:  # the owner plan's step cost (FLOPs) per rank
        row["plan_cost_per_rank"] = list(impl.rank_cost)
    impl.teardown()
    del impl
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if rank != 0:
        return row

    steps = len(gathered[0]["times"])
    fwd = [max(g["times"][i][0] for g in gathered) for i in range(steps)]
    bwd = [max(g["times"][i][1] for g in gathered) for i in range(steps)]
    fb = [max(g["times"][i][0] + g["times"][i][1] for g in gathered) for i in range(steps)]
    st = [max(g["times"][i][2] for g in gathered) for i in range(steps)]
    tot = [max(sum(g["times"][i]) for g in gathered) for i in range(steps)]
    med = statistics.median
    row.update({
        "setup_s": round(setup_s, 3),
        "fwd_s": med(fwd), "bwd_s": med(bwd), "fb_s": med(fb), "step_s": med(st), "total_s": med(tot),
        # CPU seconds summed over ranks (process CPU time incl. gloo threads): less sensitive to
        # other processes on the machine than wall time, blind to time spent waiting
        "cpu_fb_s": med([sum(g["cpu"][i][0] + g["cpu"][i][1] for g in gathered) for i in range(steps)]),
        "cpu_step_s": med([sum(g["cpu"][i][2] for g in gathered) for i in range(steps)]),
        "cpu_total_s": med([sum(sum(g["cpu"][i]) for g in gathered) for i in range(steps)]),
        "per_step_total_s": [round(x, 4) for x in tot],
        "per_step_step_s": [round(x, 4) for x in st],
        "loss_rank0": [round(x, 6) for x in gathered[0]["loss"]],
    })
    # communication: per rank, per measured step
    comm = []
    for g in gathered:
        c = {}
        for phase, v in g["comm"].items():
            c[phase] = {"calls": v["calls"] / steps, "buf": v["buf"] / steps, "wire": v["wire"] / steps,
                        "ops": {op: [x / steps for x in vals] for op, vals in v["ops"].items()}}
        comm.append(c)
    row["comm_per_rank"] = comm
    if gathered[0].get("alone") is not None:  # each rank's local step alone (the others in a barrier)
        row["alone_step_s_per_rank"] = [g["alone"] for g in gathered]
    row["mem_per_rank"] = [g["mem"] for g in gathered]
    if gathered[0].get("nic") is not None:  # measured on the rank's own veth (--netns)
        row["nic_per_rank"] = [{ph: [v[0] / steps, v[1] / steps] for ph, v in g["nic"].items()} for g in gathered]
    # how much of the machine other processes used during the measured steps (noise indicator)
    share = bc.foreign_cpu_share(mach0, mach1, sum(g["cpu_ticks"] for g in gathered))
    row["foreign_cpu_share"] = None if share is None else round(share, 3)
    # parity against ddp_muon after --parity-steps steps
    if parity_full is not None:
        if name == args.parity_ref and "ref" not in ref_state:
            ref_state["ref"] = parity_full
        ref = ref_state.get("ref")
        if ref is not None:
            d, worst, nans = bc.max_abs_diff(parity_full, ref)
            # Muon tensors: 2-D matrices and 3-D expert stacks (--model moe)
            mats = {k: v for k, v in parity_full.items() if v.ndim in (2, 3) and k not in ADAMW_2D_NAMES}
            dm, _, _ = bc.max_abs_diff(mats, ref)
            row["parity"] = {"steps": args.parity_steps, "max_abs_diff": d, "worst_param": worst,
                             "max_abs_diff_muon_matrices": dm, "nan_count": nans,
                             "max_abs_param": max(float(v.abs().max()) for v in ref.values()),
                             "reference": args.parity_ref + (" (repeat 0)" if name != args.parity_ref or repeat else "")}
        del parity_full
    return row


def worker_main(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    try:  # before any rendezvous: a missing GPU must not leave the other ranks waiting
        device = _worker_device(args)
    except ValueError as e:
        print(f"step_bench: error (rank {_rank_env()[0]}): {e}", file=sys.stderr)
        return 2
    counter = bc.install_comm_counter()  # before matrixfsdp/torchtitan capture any function
    threads = args.threads or max(1, (os.cpu_count() or 1) // _world_hint(args))
    torch.set_num_threads(threads)
    rank, world = _init_dist(args, device)
    from torch.distributed.device_mesh import init_device_mesh

    if args.mesh:
        R, S = args.mesh
        if R * S != world:
            raise SystemExit(f"--mesh {R},{S} needs {R * S} ranks, not {world}")
        mesh = init_device_mesh(device.type, (R, S), mesh_dim_names=("dp_replicate", "dp_shard"))
        link_check = _link_check(args, S) if args.link_check_mb > 0 else None
    elif args.tp:
        if world % args.tp:
            raise SystemExit(f"--tp {args.tp} needs a world divisible by it (dp = world / tp), not {world}")
        if world == args.tp:  # dp=1
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
        else:  # TP composed with data parallelism (rank = d * T + t)
            mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp_shard", "tp"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    cfg = _config(args)
    ctx = Context(rank=rank, world=world, mesh=mesh, matrixfsdp_source=args.matrixfsdp_source, device=device,
                  tp=args.tp or 1)
    impls = _impl_list(args)
    rows: list[dict[str, Any]] = []
    ref_state: dict[str, Any] = {}
    dead: dict[str, dict[str, Any]] = {}
    alone: list[float | None] = []
    t_start = time.perf_counter()
    for rep in range(args.repeats):
        first = args.parity_ref  # its parameters are the parity reference: first in every round
        others = [i for i in impls if i != first]
        k = rep % max(1, len(others))
        order = ([first] if first in impls else []) + others[k:] + others[:k]
        for name in order:
            if name in dead:
                continue
            attempt = 0
            while True:
                attempt += 1
                # rank 0 waits (bounded) for the machine to be quiet; the others wait for it
                waited = None
                if rank == 0 and args.quiet_wait > 0:
                    waited = bc.wait_quiet(args.quiet_wait, threshold=args.max_foreign, window_s=1.0, need=1)
                dist.barrier()
                t0 = time.perf_counter()
                row = run_one(name, cfg, ctx, args, rep, ref_state, counter)
                row["attempt"] = attempt
                retry = [False]
                if rank == 0:
                    row["wall_s"] = round(time.perf_counter() - t0, 2)
                    if waited is not None:
                        row["pre_busy_share"] = [round(x, 2) for x in waited[-3:]]
                    share = row.get("foreign_cpu_share")
                    retry[0] = (row.get("status") == "ok" and share is not None and share > args.max_foreign
                                and attempt <= args.retries
                                and time.perf_counter() - t_start < args.retry_budget)
                    print(f"[rank0] repeat {rep} {name} attempt {attempt}: {row.get('status')} "
                          f"total_s={row.get('total_s')} foreign_cpu={share} wall={row['wall_s']}s"
                          + (" -> retry (contaminated)" if retry[0] else ""), file=sys.stderr, flush=True)
                dist.broadcast_object_list(retry, src=0)
                if not retry[0]:
                    break
                if rank == 0:
                    row["status"] = "discarded"
                    rows.append(row)
            if row.get("status") != "ok":
                dead[name] = row
            rows.append(row)
        if args.mesh and "single_muon" in impls:
            alone.append(_time_alone_step(cfg, ctx, args))
    if rank == 0:
        meta = {"world": world, "backend": args.backend, "device": device.type,
                "threads_per_rank": threads, "config": cfg.to_dict(),
                "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                "env": bc.env_info(device), "bytes_doc": bc.BYTES_DOC,
                "run_s": round(time.perf_counter() - t_start, 1),
                "netns": bool(os.environ.get("GLOO_SOCKET_IFNAME")) and args.netns}
        if args.mesh:
            meta.update(mesh=list(args.mesh), mesh_dim_names=["dp_replicate", "dp_shard"], link_check=link_check,
                        alone_step_s=alone)
        if args.tp:
            meta.update(tp=args.tp, dp=world // args.tp,
                        mesh_dim_names=["tp"] if world == args.tp else ["dp_shard", "tp"])
        if meta["netns"]:  # rank 0 runs inside mfb-r0: record the shaping of its veth
            import subprocess

            try:
                meta["netns_qdisc"] = subprocess.run(
                    ["tc", "qdisc", "show", "dev", os.environ["GLOO_SOCKET_IFNAME"]],
                    capture_output=True, text=True, timeout=10).stdout.strip()
            except Exception as e:
                meta["netns_qdisc"] = f"unknown ({e})"
        result = {"meta": meta, "rows": rows}
        if args._result:
            with open(args._result, "w") as f:
                json.dump(result, f, default=str)
        else:  # torchrun: report here
            emit(result, args, command=f"torchrun --nproc-per-node {world} " + " ".join(shlex.quote(a) for a in sys.argv))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _world_hint(args: argparse.Namespace) -> int:
    return int(os.environ.get("MFB_WORLD") or os.environ.get("WORLD_SIZE") or args.world or 1)


def _link_check(args: argparse.Namespace, S: int) -> dict[str, Any]:
    """gloo send/recv throughput: within a shard group (rank 0 -> 1), across replicas (0 -> S) and
    every replica pair at once (r -> r + S for r < S: what HSDP's cross-replica all-reduce puts on
    a shared inter-node link)."""
    n = int(args.link_check_mb * MB)
    out = {"within shard group 0->1": bc.p2p_throughput([(0, 1)], n),
           f"across replicas 0->{S}": bc.p2p_throughput([(0, S)], n),
           "across replicas, all pairs at once": bc.p2p_throughput([(r, r + S) for r in range(S)], n)}
    if dist.get_rank() == 0:
        print("[rank0] link check (Mbit/s per pair): "
              + ", ".join(f"{k}: {v['mbit_s_per_pair']}" for k, v in out.items()), file=sys.stderr, flush=True)
    return out


def _time_alone_step(cfg: BenchConfig, ctx: Context, args: argparse.Namespace) -> float | None:
    """Rank 0 alone (the others wait in a barrier): the single-process optimizer step over every
    parameter, median of ``--steps`` steps after ``--warmup``; None on the other ranks."""
    t = None
    if ctx.rank == 0:
        impl = IMPLS["single_muon"](cfg, ctx)
        impl.setup()
        impl.forward_backward(batch_for_step(cfg, 0, 0, 1, ctx.device))
        times = []
        for s in range(args.warmup + args.steps):
            bc.device_sync(ctx.device)
            t0 = time.perf_counter()
            impl.step()
            bc.device_sync(ctx.device)
            if s >= args.warmup:
                times.append(time.perf_counter() - t0)
        impl.teardown()
        t = statistics.median(times)
        print(f"[rank0] single-process step alone: {t:.4f} s", file=sys.stderr, flush=True)
    dist.barrier()
    return t


# ================================================================================ reporting
def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per repeat: every ok row gets ``ratios[metric][other] = mine / other's`` (same repeat)."""
    by_rep: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r.get("status") == "ok":
            by_rep.setdefault(r["repeat"], {})[r["impl"]] = r
    for rep, impls in by_rep.items():
        for name, r in impls.items():
            r["ratios"] = {m: {o: r[m] / impls[o][m] for o in impls if o != name and impls[o][m] > 0}
                           for m in ("fb_s", "step_s", "total_s", "cpu_fb_s", "cpu_step_s", "cpu_total_s")}


def _fmt3(s: dict[str, Any], scale: float = 1.0, nd: int = 3) -> str:
    mark = "†" if s.get("dirty") else ""
    return f"{s['median'] * scale:.{nd}f} ({s['min'] * scale:.{nd}f}-{s['max'] * scale:.{nd}f}){mark}"


def markdown(result: dict[str, Any], command: str) -> str:
    meta, rows = result["meta"], result["rows"]
    env, cfg = meta["env"], meta["config"]
    ok = [r for r in rows if r.get("status") == "ok"]
    names = []
    for r in rows:
        if r["impl"] not in names:
            names.append(r["impl"])
    backend = meta.get("backend", "gloo")  # results written before --backend existed: gloo on CPU
    on_cuda = meta.get("device", "cpu") == "cuda"
    where = f"CUDA, {env.get('gpu', 'GPU')}" if on_cuda else "CPU"
    cuda_env = (f" cuda {env.get('cuda')} nccl {env.get('nccl')} gpu {env.get('gpu')} x{env.get('gpu_count')}"
                if on_cuda else "")
    L: list[str] = []
    L.append(f"<!-- produced by: {command} -->")
    L.append(f"<!-- {env['date']} torch {env['torch']} torchtitan {env.get('torchtitan')} python {env['python']} "
             f"git {env.get('git')} {env['platform']} cpus={env['cpus']}{cuda_env} -->")
    L.append("")
    L.append(f"# Step benchmark, world {meta['world']} ({backend}, {where}{', netns' if meta.get('netns') else ''})"
             + (f", TP {meta['tp']} x DP {meta['dp']}" if meta.get("tp") else ""))
    L.append("")
    if meta.get("tp") and meta.get("dp", 1) == 1:
        L.append(f"Tensor parallelism at dp=1 (issue 18): the {meta['tp']} ranks form one `(\"tp\",)` mesh and every "
                 "rank sees the whole global batch; the Decoder's q/k/v, gate/up are `ColwiseParallel`, o, down "
                 "`RowwiseParallel` (torch `parallelize_module`; each attention module computes its local heads; "
                 "the q/k-norm gradients are all-reduced over TP in backward); embedding, head and the other norms "
                 "are replicated and stepped by AdamW on every rank in every row. (TP composed with data "
                 "parallelism: `--tp T --world dp*T`.)  ")
    elif meta.get("tp"):
        dp, tp = meta["dp"], meta["tp"]
        L.append(f"Tensor parallelism composed with data parallelism (issue 18): the {meta['world']} ranks form the "
                 f"`({dp}, {tp})` mesh `(\"dp_shard\", \"tp\")` (rank = d*{tp} + t; TP groups "
                 + ", ".join(str(list(range(d * tp, (d + 1) * tp))) for d in range(dp))
                 + "); each dp row sees 1/" + str(dp) + " of the global batch, its TP ranks the same tokens. The "
                 "Decoder's q/k/v, gate/up are `ColwiseParallel`, o, down `RowwiseParallel` on `mesh[\"tp\"]` "
                 "(torch `parallelize_module`, each attention module computes its local heads), then every "
                 "DecoderLayer and the root are wrapped over `mesh[\"dp_shard\"]`: stock torch `fully_shard` "
                 "(FSDP2 + TP) in `tp_redundant` and `tp_shard_local`, `matrixfsdp.fully_shard` with "
                 "`plan_owners(model, mesh)` in the hosted rows (owners: whole matrices per dp rank; the owner's "
                 "TP row hosts each TP matrix's step between two fused all-to-alls per micro-group, the other rows "
                 "do nothing in the step). The q/k norms act on local heads: their data-parallel-reduced gradient "
                 "shards are all-reduced over TP at the end of backward in every row. Embedding, head and the "
                 "other norms are TP-replicated and stepped by AdamW.  ")
    if meta.get("netns") and not meta.get("link_qdisc"):  # flat setup.sh (two-level: _hsdp_header)
        L.append(f"Emulated interconnect: each rank in its own network namespace (benchmarks/netns/setup.sh), "
                 f"gloo over a veth pair into a bridge, token-bucket shaping on both ends of every veth; "
                 f"rank 0's qdisc: `{meta.get('netns_qdisc', '?')}`. No latency emulation (netem is not in "
                 f"this kernel).  ")
    if meta.get("mesh"):
        L.extend(_hsdp_header(meta))
    L.append(f"Command: `{command}`  ")
    L.append(f"Date: {env['date']}; torch {env['torch']}; torchtitan {env.get('torchtitan')}; python {env['python']}; "
             f"git {env.get('git')}; {env['cpus']} CPUs, {meta['threads_per_rank']} intra-op thread(s) per rank; "
             + (f"{backend} on one GPU per rank ({env.get('gpu')}, {env.get('gpu_memory_gib')} GiB; CUDA "
                f"{env.get('cuda')}, NCCL {env.get('nccl')}); " if on_cuda else "")
             + f"whole run {meta['run_s']} s.  ")
    if cfg.get("model") == "moe":
        L.append(f"Model: the MoE decoder of tests/_moe.py (issue 26), vocab {cfg['vocab_size']}, dim "
                 f"{cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads; per layer "
                 f"{cfg['experts']} experts (stacks {'gate_up_proj [E, 2F, D], down_proj' if cfg.get('moe_fused') else 'w1/w3 [E, F, D], w2'}"
                 f" [E, D, F], F = {cfg['moe_ffn']}), top-{cfg['top_k']} router `gate`, "
                 f"{'a shared expert (dense MLP, hidden F)' if cfg.get('moe_shared') else 'no shared expert'}; fp32; "
                 f"Muon on every 2-D weight but the embedding and the head (attention, router, shared expert) and on "
                 f"every expert matrix; global batch {cfg['global_batch']} x {cfg['seq_len']} tokens (split over ranks). "
                 f"Muon lr {cfg['lr']} wd {cfg['weight_decay']} momentum {cfg['momentum']} nesterov {cfg['nesterov']} "
                 f"ns_steps {cfg['ns_steps']} NS dtype {cfg['ns_dtype']}; AdamW (embedding, head, norms) lr "
                 f"{cfg['adamw_lr']} betas {tuple(cfg['adamw_betas'])} wd {cfg['adamw_weight_decay']}.  ")
    else:
        L.append(f"Model: matrixfsdp.Decoder vocab {cfg['vocab_size']}, hidden {cfg['hidden_size']}, MLP "
             f"{cfg['intermediate_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads / "
             f"{cfg['num_key_value_heads']} KV x {cfg['head_dim']}, fp32; global batch {cfg['global_batch']} x "
             f"{cfg['seq_len']} tokens (split over ranks). Muon lr {cfg['lr']} wd {cfg['weight_decay']} momentum "
             f"{cfg['momentum']} nesterov {cfg['nesterov']} ns_steps {cfg['ns_steps']} NS dtype {cfg['ns_dtype']}; "
             f"AdamW (embedding, head, norms) lr {cfg['adamw_lr']} betas {tuple(cfg['adamw_betas'])} wd "
             f"{cfg['adamw_weight_decay']}.  ")
    a = meta["args"]
    L.append(f"Per repeat and implementation: {a['warmup']} warm-up + {a['steps']} measured steps; "
             f"{a['repeats']} repeats. Times: per step the max over ranks, median over measured steps; "
             f"cells show median (min-max) of those medians over repeats. "
             + ("Every timer is read after torch.cuda.synchronize(); CPU seconds below are the ranks' host "
                "CPU time." if on_cuda else
                "CPU times on 2 shared cores are noisy: read the ratios, not the absolute values."))
    L.append("")
    # status
    skipped = [r for r in rows if r.get("status") not in ("ok", "discarded")]
    discarded = [r for r in rows if r.get("status") == "discarded"]
    if discarded:
        L.append(f"- {len(discarded)} measurement(s) discarded and rerun because other processes used more than "
                 f"{a['max_foreign']:.0%} of the machine's CPU during their measured steps (rows with "
                 f"\"status\": \"discarded\" in the .jsonl): "
                 + ", ".join(f"{r['impl']} r{r['repeat']} ({r.get('foreign_cpu_share', 0):.0%})" for r in discarded))
    seen = set()
    for r in skipped:
        if r["impl"] in seen:
            continue
        seen.add(r["impl"])
        reason = str(r.get("reason", "")).strip().splitlines()[0] if r.get("reason") else ""
        L.append(f"- **{r['impl']}: {r['status']}** (repeat {r['repeat']}): {reason}")
    if skipped or discarded:
        L.append("")

    maxf = a.get("max_foreign", 1.0)

    def is_clean(r: dict[str, Any]) -> bool:
        f = r.get("foreign_cpu_share")
        return f is None or f <= maxf

    clean_of = {(r["impl"], r["repeat"]): is_clean(r) for r in ok}

    def stats(name: str, key: str, clean_only: bool = True) -> dict[str, Any] | None:
        """Wall times: only repeats not contaminated by other processes, if there are any."""
        rs = [r for r in ok if r["impl"] == name]
        clean = [r for r in rs if is_clean(r)] if clean_only else rs
        use = clean or rs
        if not use:
            return None
        out: dict[str, Any] = bc.summarize([r[key] for r in use])
        out.update(n=len(use), total=len(rs), dirty=not clean)
        return out

    def ratio_stats(name: str, key: str, other: str, clean_only: bool = True) -> dict[str, Any] | None:
        pairs = [(r, r["ratios"][key][other]) for r in ok
                 if r["impl"] == name and other in r.get("ratios", {}).get(key, {})]
        clean = [x for r, x in pairs if is_clean(r) and clean_of.get((other, r["repeat"]), True)] \
            if clean_only else [x for _, x in pairs]
        use = clean or [x for _, x in pairs]
        if not use:
            return None
        out: dict[str, Any] = bc.summarize(use)
        out.update(n=len(use), dirty=not clean)
        return out

    ok_names = [n for n in names if any(r["impl"] == n for r in ok)]
    REF = a.get("reference") or REFERENCE  # ratio reference (results written before --reference: ddp_muon)
    PARITY_REF = a.get("parity_ref") or REF  # parameters compared with; its step = every rank steps everything
    L.append("## Time per step (seconds)")
    L.append("")
    L.append(f"| implementation | fwd+bwd s | optimizer step s | total s | total / {REF} | step / {REF} | fwd+bwd / {REF} | clean repeats | foreign CPU (max) |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in ok_names:
        cells = [_fmt3(stats(n, k)) for k in ("fb_s", "step_s", "total_s")]
        rs = []
        for k in ("total_s", "step_s", "fb_s"):
            s = ratio_stats(n, k, REF) if n != REF else {"median": 1, "min": 1, "max": 1}
            rs.append(_fmt3(s, nd=2) if s else "n/a")
        fc = [r.get("foreign_cpu_share") for r in ok if r["impl"] == n and r.get("foreign_cpu_share") is not None]
        st_ = stats(n, "total_s")
        rs.append(f"{sum(1 for r in ok if r['impl'] == n and is_clean(r))}/{st_['total']}")
        rs.append(f"{max(fc):.0%}" if fc else "n/a")
        L.append(f"| {n} | " + " | ".join(cells + rs) + " |")
    L.append("")
    L.append("Ratios: per repeat, this implementation's median over that of the reference in the same repeat; "
             "median (min-max) over repeats. Foreign CPU: the share of the machine's CPU capacity used by "
             "processes other than the benchmark's ranks during an implementation's measured steps (from "
             f"/proc/stat minus the ranks' own CPU time). Wall-time cells and ratios use only *clean* repeats "
             f"(foreign CPU <= {maxf:.0%}; for ratios both sides clean); † = no clean repeat, all repeats used.")
    L.append("")
    L.append("### CPU seconds per step, summed over ranks")
    L.append("")
    L.append(f"Process CPU time (all threads, {backend}'s included) per phase, summed over the ranks, median over measured "
             "steps; median (min-max) over all repeats. Blind to waiting, less sensitive to other processes than wall time.")
    L.append("")
    L.append(f"| implementation | fwd+bwd CPU s | step CPU s | total CPU s | total / {REF} | step / {REF} |")
    L.append("|---|---:|---:|---:|---:|---:|")
    for n in ok_names:
        if stats(n, "cpu_total_s", clean_only=False) is None:
            continue
        cells = [_fmt3(stats(n, k, clean_only=False)) for k in ("cpu_fb_s", "cpu_step_s", "cpu_total_s")]
        for k in ("cpu_total_s", "cpu_step_s"):
            s_ = ratio_stats(n, k, REF, clean_only=False) if n != REF else {"median": 1, "min": 1, "max": 1}
            cells.append(_fmt3(s_, nd=2) if s_ else "n/a")
        L.append(f"| {n} | " + " | ".join(cells) + " |")
    L.append("")
    def ratio_matrix(title: str, key: str) -> None:
        L.extend([title, "", "| row / col | " + " | ".join(ok_names) + " |", "|---|" + "---:|" * len(ok_names)])
        for n in ok_names:
            cells = []
            for o in ok_names:
                s = ratio_stats(n, key, o) if o != n else None
                cells.append("1" if o == n else (f"{s['median']:.2f}" + ("†" if s["dirty"] else "") if s else "n/a"))
            L.append(f"| {n} | " + " | ".join(cells) + " |")
        L.append("")

    if meta.get("mesh"):
        L.extend(_hsdp_section(meta, ok, ok_names, stats, ratio_stats, REF))
    if meta.get("tp"):
        L.extend(_tp_section(meta, ok, ok_names, stats, ratio_stats, REF))
    if cfg.get("model") == "moe":
        L.extend(_moe_section(meta, ok, ok_names, stats, ratio_stats, REF, is_clean))
    ratio_matrix("### Total-time ratios, row / column (same repeat; median over repeats)", "total_s")
    balanced = [n for n in ok_names if any("step_balance" in r for r in ok if r["impl"] == n)]
    if balanced and PARITY_REF in ok_names:
        L.append("### Sharded optimizer steps against their balance limit")
        L.append("")
        L.append(f"balance = largest per-rank step work / mean (Muon Newton-Schulz FLOPs, ~12 FLOPs per AdamW "
                 f"element); limit = {PARITY_REF} step (every rank steps everything) x balance / W, the step time "
                 "of a perfectly parallel split with this imbalance; medians over clean repeats.")
        L.append("")
        L.append(f"| implementation | balance | step s | limit s | step / limit | fwd+bwd / {PARITY_REF} fwd+bwd |")
        L.append("|---|---:|---:|---:|---:|---:|")
        ref_step = stats(PARITY_REF, "step_s")
        ref_fb = stats(PARITY_REF, "fb_s")
        W = meta["world"]
        for n in balanced:
            b = next(r["step_balance"] for r in ok if r["impl"] == n and "step_balance" in r)
            st, fb = stats(n, "step_s"), stats(n, "fb_s")
            if not (st and ref_step and fb and ref_fb):
                continue
            limit = ref_step["median"] * b / W
            L.append(f"| {n} | {b:.3f} | {st['median']:.4f} | {limit:.4f} | {st['median'] / limit:.2f} | "
                     f"{fb['median'] / ref_fb['median']:.3f} |")
        L.append("")
    ratio_matrix("### Optimizer-step ratios, row / column", "step_s")
    # communication (repeat 0 rows; deterministic)
    L.append("## Communication per rank per step (measured steps; max over ranks)")
    L.append("")
    L.append("Counted by wrapping the torch.distributed Python API; a call is attributed to the phase that "
             "issues it (an async call issued in backward and waited for in the step counts as backward). "
             + meta["bytes_doc"])
    L.append("")
    L.append("| implementation | fwd calls | fwd wire MB | bwd calls | bwd wire MB | step calls | step wire MB | total wire MB | ops (calls/step, all phases, rank 0) |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for n in ok_names:
        r = next(r for r in ok if r["impl"] == n)
        cpr = r["comm_per_rank"]

        def mx(phase: str, key: str) -> float:
            return max(c[phase][key] for c in cpr)

        total_wire = max(sum(c[p]["wire"] for p in ("fwd", "bwd", "step")) for c in cpr)
        ops: dict[str, float] = {}
        for p in ("fwd", "bwd", "step"):
            for op, vals in cpr[0][p]["ops"].items():
                ops[op] = ops.get(op, 0) + vals[0]
        ops_s = ", ".join(f"{op} {v:g}" for op, v in sorted(ops.items()))
        L.append(f"| {n} | {mx('fwd', 'calls'):g} | {mx('fwd', 'wire') / MB:.2f} | {mx('bwd', 'calls'):g} | "
                 f"{mx('bwd', 'wire') / MB:.2f} | {mx('step', 'calls'):g} | {mx('step', 'wire') / MB:.2f} | "
                 f"{total_wire / MB:.2f} | {ops_s} |")
    L.append("")
    if any("nic_per_rank" in r for r in ok):
        L.append("### Measured on the emulated NIC (--netns): bytes sent per rank per step (max over ranks)")
        L.append("")
        L.append("tx bytes of each rank's veth (`/sys/class/net/mfb0/statistics`, read at phase boundaries; "
                 "includes TCP/IP headers; asynchronous traffic is attributed to the phase in which it left; "
                 "'other' = the barrier before each step).")
        L.append("")
        L.append("| implementation | fwd MB | bwd MB | step MB | other MB | total MB | estimated wire MB (table above) |")
        L.append("|---|---:|---:|---:|---:|---:|---:|")
        for n in ok_names:
            r = next((r for r in ok if r["impl"] == n and "nic_per_rank" in r), None)
            if r is None:
                continue
            npr = r["nic_per_rank"]
            est = max(sum(c[p]["wire"] for p in ("fwd", "bwd", "step")) for c in r["comm_per_rank"])
            tot = max(sum(x[p][0] for p in ("fwd", "bwd", "step", "other")) for x in npr)
            L.append(f"| {n} | " + " | ".join(f"{max(x[p][0] for x in npr) / MB:.2f}" for p in ("fwd", "bwd", "step", "other"))
                     + f" | {tot / MB:.2f} | {est / MB:.2f} |")
        L.append("")
    L.append("## Resident bytes per rank (MB; min-max over ranks)")
    L.append("")
    L.append("Sum of local tensor nbytes: parameters after setup, gradients after the last backward, optimizer "
             "state after the last step (`optimizer.state` tensors), plus persistent optimizer scratch buffers "
             "outside the state (DistMuon's reserved redistribution buffers).")
    L.append("")
    has_cuda_mem = any("cuda_max_allocated" in x for r in ok for x in r["mem_per_rank"])
    if has_cuda_mem:
        L.append("CUDA peak: `torch.cuda.max_memory_allocated` from the start of setup (peak stats reset there) "
                 "to the end of the measured steps, minus what was allocated when setup started "
                 "(activations and temporaries included; the caching allocator's reserve is not).")
        L.append("")
    L.append("| implementation | params | grads | optimizer state | optimizer scratch | sum |"
             + (" CUDA peak |" if has_cuda_mem else ""))
    L.append("|---|---:|---:|---:|---:|---:|" + ("---:|" if has_cuda_mem else ""))
    for n in ok_names:
        r = next(r for r in ok if r["impl"] == n)
        m = r["mem_per_rank"]

        def rng(key: str) -> str:
            xs = [x.get(key, 0) / MB for x in m]
            return f"{min(xs):.2f}" if max(xs) - min(xs) < 0.005 else f"{min(xs):.2f}-{max(xs):.2f}"

        sums = [sum(x.get(k, 0) for k in ("params", "grads", "opt_state", "opt_scratch")) / MB for x in m]
        peak = ""
        if has_cuda_mem:
            ps = [(x["cuda_max_allocated"] - x.get("cuda_base_allocated", 0)) / MB for x in m if "cuda_max_allocated" in x]
            peak = (f" {min(ps):.2f}-{max(ps):.2f} |" if ps else " n/a |")
        L.append(f"| {n} | {rng('params')} | {rng('grads')} | {rng('opt_state')} | {rng('opt_scratch')} | "
                 f"{min(sums):.2f}-{max(sums):.2f} |" + peak)
    L.append("")
    L.append(f"## Parity: max |param - {PARITY_REF}| after {a['parity_steps']} steps (same data)")
    L.append("")
    L.append("| implementation | max abs diff (all, worst over repeats) | worst parameter | Muon matrices only | max abs param | note |")
    L.append("|---|---:|---|---:|---:|---|")
    for n in ok_names:
        rs = [r for r in ok if r["impl"] == n and "parity" in r]
        if not rs:
            continue
        worst = max(rs, key=lambda r: r["parity"]["max_abs_diff"])
        p = worst["parity"]
        note = ""
        if n == PARITY_REF:
            note = "repeat k vs repeat 0: run-to-run determinism"
        elif n in ("fsdp2_adamw", "hsdp_adamw"):
            note = "different optimizer (AdamW everywhere): not a correctness check"
        if p.get("nan_count"):
            note += f" {p['nan_count']} NaN/unfilled entries!"
        L.append(f"| {n} | {p['max_abs_diff']:.3e} | {p['worst_param'] if p['max_abs_diff'] > 0 else '-'} | {p['max_abs_diff_muon_matrices']:.3e} | "
                 f"{p['max_abs_param']:.3g} | {note} |")
    L.append("")
    L.append("## Notes per implementation")
    L.append("")
    for n in names:
        r = next((r for r in rows if r["impl"] == n and r.get("notes")), None)
        if r:
            L.append(f"- **{n}**: " + " | ".join(r["notes"]))
    L.append("")
    return "\n".join(L)


def _hsdp_header(meta: dict[str, Any]) -> list[str]:
    R, S = meta["mesh"]
    L = [f"HSDP mesh ({R}, {S}) = (dp_replicate, dp_shard), rank = r*{S} + s: shard groups "
         + ", ".join(str(list(range(r * S, (r + 1) * S))) for r in range(R)) + "; replicate groups "
         + ", ".join(str(list(range(s, R * S, S))) for s in range(S)) + ".  "]
    if meta.get("link_qdisc"):
        L.append(f"Emulated two-level network (benchmarks/netns/setup_two_level.sh): each rank in its own network "
                 f"namespace, the ranks of a shard group on one bridge (unshaped veths), the two bridges joined by "
                 f"one veth pair shaped with tbf on both ends, shared by all cross-replica traffic: "
                 f"`{meta['link_qdisc']}`. No latency emulation (netem is not in this kernel).  ")
    lc = meta.get("link_check")
    if lc:
        L.append("Measured link throughput (gloo send/recv of "
                 f"{next(iter(lc.values()))['bytes'] / MB:.0f} MB, median of "
                 f"{len(next(iter(lc.values()))['seconds'])}, Mbit/s per pair): "
                 + "; ".join(f"{k} **{v['mbit_s_per_pair']}**" for k, v in lc.items()) + ".  ")
    return L


def _hsdp_section(meta: dict[str, Any], ok: list[dict[str, Any]], ok_names: list[str], stats: Any,
                  ratio_stats: Any, ref: str) -> list[str]:
    """Issue 17's targets: step bytes 0, fwd+bwd <= 1.05x stock HSDP + AdamW, split's step within
    1.10x of the total step work / W."""
    W = meta["world"]
    single = stats("single_muon", "step_s") if "single_muon" in ok_names else None
    alone = [x for x in meta.get("alone_step_s") or [] if x]
    alone_med = statistics.median(alone) if alone else None
    L = ["### HSDP targets (issue 17)", "",
         "work/W: the single-process optimizer step over every parameter (the total step work) / W, "
         f"W = {W}. Two measures of the total: `single_muon`'s step (every rank runs it at once: the same CPU "
         "contention as the distributed rows) "
         + (f"= {single['median']:.4f} s; " if single else "(not run); ")
         + "and rank 0 alone while the others idle "
         + (f"= {alone_med:.4f} s (median over {len(alone)} rounds: {', '.join(f'{x:.4f}' for x in alone)}). "
            if alone_med else "(not run). ")
         + f"{W} ranks share {meta['env']['cpus']} CPUs, so wall-clock step times depend on how the ranks' steps "
         "overlap; the contention-free measure of the step's work is its CPU time: `step work` = the step's CPU "
         "seconds summed over ranks / `single_muon`'s per rank (1 = every matrix stepped once in all, as split "
         "should; R = every replica repeats it).",
         "",
         f"| implementation | fwd+bwd / {ref} (target <= 1.05) | step s | step calls | step wire MB (target 0) | "
         "step / (single_muon step / W) | step / (alone / W) (target <= 1.10) | step work | total / " + ref + " |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    single_cpu = stats("single_muon", "cpu_step_s") if "single_muon" in ok_names else None
    for n in ok_names:
        r = next(r for r in ok if r["impl"] == n)
        cpr = r["comm_per_rank"]
        calls = max(c["step"]["calls"] for c in cpr)
        wire = max(c["step"]["wire"] for c in cpr)
        st = stats(n, "step_s")
        fb = ratio_stats(n, "fb_s", ref) if n != ref else {"median": 1.0, "dirty": False}
        tot = ratio_stats(n, "total_s", ref) if n != ref else {"median": 1.0, "dirty": False}

        def cell(x: dict[str, Any] | None) -> str:
            return "n/a" if x is None else f"{x['median']:.3f}" + ("†" if x.get("dirty") else "")

        vs_single = f"{st['median'] / (single['median'] / W):.2f}" if single and n != "single_muon" else "-"
        vs_alone = f"{st['median'] / (alone_med / W):.2f}" if alone_med and n != "single_muon" else "-"
        cs = stats(n, "cpu_step_s")
        work = f"{cs['median'] / (single_cpu['median'] / W):.2f}" if single_cpu and cs else "n/a"
        L.append(f"| {n} | {cell(fb)} | {st['median']:.4f} | {calls:g} | {wire / MB:.2f} | {vs_single} | "
                 f"{vs_alone} | {work} | {cell(tot)} |")
    L.append("")
    return L


def _moe_section(meta: dict[str, Any], ok: list[dict[str, Any]], ok_names: list[str], stats: Any,
                 ratio_stats: Any, ref: str, is_clean: Any) -> list[str]:
    """Issue 26's MoE rows: step, total and optimizer state per rank against DDP; the owners step
    against its balance limit; the goals (step <= 1.10x the limit, total below every other row)."""
    OWN = "moe_owners"
    W, cpus = meta["world"], meta["env"]["cpus"]
    L = ["## MoE rows (issue 26)", "",
         f"Ratios against `{ref}` in the same repeat (median (min-max) over clean repeats); optimizer state: "
         "`optimizer.state` tensors per rank after the last step (max over ranks); step calls and wire: the "
         "optimizer step's collectives per rank per step (max over ranks).", "",
         f"| implementation | step s | step / {ref} | total s | total / {ref} | optimizer state MB per rank | "
         f"state / {ref} | step calls | step wire MB |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(x: dict[str, Any] | None, nd: int = 3) -> str:
        if x is None:
            return "n/a"
        return f"{x['median']:.{nd}f} ({x['min']:.{nd}f}-{x['max']:.{nd}f})" + ("†" if x.get("dirty") else "")

    def state_mb(n: str) -> float:
        r = next(r for r in ok if r["impl"] == n)
        return max(x.get("opt_state", 0) for x in r["mem_per_rank"]) / MB

    one = {"median": 1.0, "min": 1.0, "max": 1.0}
    for n in ok_names:
        r = next(r for r in ok if r["impl"] == n)
        cpr = r["comm_per_rank"]
        st = ratio_stats(n, "step_s", ref) if n != ref else one
        tot = ratio_stats(n, "total_s", ref) if n != ref else one
        sr = state_mb(n) / state_mb(ref) if ref in ok_names and state_mb(ref) else float("nan")
        L.append(f"| {n} | {cell(stats(n, 'step_s'), 4)} | {cell(st, 2)} | {cell(stats(n, 'total_s'), 4)} | "
                 f"{cell(tot, 2)} | {state_mb(n):.2f} | {sr:.3f} | {max(c['step']['calls'] for c in cpr):g} | "
                 f"{max(c['step']['wire'] for c in cpr) / MB:.2f} |")
    L.append("")
    if OWN not in ok_names:
        return L
    # the balance limit: each rank's local step timed alone (the others in a barrier), 1 thread
    rows = [r for r in ok if r["impl"] == OWN and r.get("alone_step_s_per_rank")]
    clean = [r for r in rows if is_clean(r)] or rows
    step = stats(OWN, "step_s")
    limit = None
    if clean:
        per_rank = [statistics.median(r["alone_step_s_per_rank"][k] for r in clean) for k in range(W)]
        largest, total = max(per_rank), sum(per_rank)
        limit = max(largest, total / min(cpus, W))
        L.append(f"**`{OWN}` against its balance limit.** Method: after each repeat's measured steps every rank's "
                 "local optimizer step is timed alone (ranks in turn, the others waiting in a barrier; one "
                 f"forward/backward first, median of {meta['args'].get('alone_reps')} steps after a warm-up, "
                 f"{meta['threads_per_rank']} intra-op thread(s) as in the run): per rank "
                 + ", ".join(f"{x * 1e3:.1f}" for x in per_rank) + " ms (median over "
                 f"{len(clean)} repeat(s)); the most loaded rank's {largest * 1e3:.1f} ms. The {W} ranks share "
                 f"{cpus} cores, so no schedule finishes the step before max(largest rank, sum over ranks / "
                 f"{min(cpus, W)} cores) = max({largest * 1e3:.1f}, {total / min(cpus, W) * 1e3:.1f}) = "
                 f"**{limit * 1e3:.1f} ms**, the balance limit on this machine (on one core per rank it is the "
                 f"largest rank's time). Measured step {step['median'] * 1e3:.1f} ms = "
                 f"**{step['median'] / limit:.2f}x** the limit.")
        cpu = stats(OWN, "cpu_step_s", clean_only=False)
        if cpu:
            L.append(f"The step's CPU seconds summed over the ranks ({cpu['median'] * 1e3:.1f} ms, median over all "
                     f"repeats) are {cpu['median'] / total:.2f}x the per-rank alone times summed ({total * 1e3:.1f} "
                     "ms): the work itself is the same in the run; the rest of the gap is waiting and contention.")
        cost = next((r.get("plan_cost_per_rank") for r in rows if r.get("plan_cost_per_rank")), None)
        if cost:
            mean = sum(cost) / len(cost)
            L.append(f"The plan's cost model (Newton-Schulz FLOPs per rank: "
                     + ", ".join(f"{c / 1e9:.2f}G" for c in cost) + f"; max/mean {max(cost) / mean:.3f}) against "
                     f"the timed per-rank steps (max/mean {largest / (total / W):.3f}).")
        L.append("")
    L.append("Goals:")
    L.append("")
    if limit is not None:
        ratio = step["median"] / limit
        L.append(f"- `{OWN}` step <= 1.10x its balance limit: {step['median'] * 1e3:.1f} ms / {limit * 1e3:.1f} ms "
                 f"= {ratio:.2f}: **{'met' if ratio <= 1.10 else 'not met'}**")
    else:
        L.append(f"- `{OWN}` step <= 1.10x its balance limit: not measured (--alone-reps 0)")
    others = [n for n in ok_names if n != OWN]
    cmp = []
    for o in others:
        s_ = ratio_stats(OWN, "total_s", o)
        if s_ is not None:
            cmp.append((o, s_))
    met = bool(cmp) and all(s_["median"] < 1 for _, s_ in cmp)
    L.append(f"- `{OWN}` total (fwd+bwd+step) below every other row's: **{'met' if met else 'not met'}** ("
             + "; ".join(f"{OWN} / {o} = {cell(s_, 2)}" for o, s_ in cmp) + ")")
    L.append("")
    return L


def _tp_section(meta: dict[str, Any], ok: list[dict[str, Any]], ok_names: list[str], stats: Any,
                ratio_stats: Any, ref: str) -> list[str]:
    """Issue 18's targets: step >= 2x faster than the redundant baseline, fused faster than
    unfused, pipelined faster than sequential micro-groups (same-repeat ratios of step_s)."""
    dp = meta.get("dp", 1)
    L = [f"### TP step (issue 18, TP {meta['tp']}, dp={dp})", "",
         "Per rank per step (max over ranks): the optimizer step's all-to-alls, all-gathers and wire bytes as "
         "counted at the torch.distributed API (matrixfsdp's executor moves the gradient shards to their hosts "
         "and the update shards back: (tp-1)/tp of every TP-sharded matrix each way, summed over ranks"
         + (f"; at dp={dp} only in the owner's TP row, so per rank about 1/{dp} of the matrices; `tp_redundant` "
            f"all-gathers every matrix over all {meta['world']} ranks" if dp > 1 else "") + ").", "",
         f"| implementation | step s | step / {ref} | total / {ref} | micro-groups | step all-to-alls | "
         "step all-gathers | step wire MB | host balance | parity vs " + ref + " (max abs) |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(x: dict[str, Any] | None) -> str:
        return "n/a" if x is None else f"{x['median']:.3f} ({x['min']:.3f}-{x['max']:.3f})" + ("†" if x.get("dirty") else "")

    for n in ok_names:
        r = next(r for r in ok if r["impl"] == n)
        cpr = r["comm_per_rank"]
        ops = [c["step"]["ops"] for c in cpr]
        a2a = max(o.get("all_to_all_single", [0])[0] for o in ops)
        ag = max(sum(v[0] for k, v in o.items() if k.startswith("all_gather")) for o in ops)
        wire = max(c["step"]["wire"] for c in cpr)
        one = {"median": 1.0, "min": 1.0, "max": 1.0}
        st = ratio_stats(n, "step_s", ref) if n != ref else one
        tot = ratio_stats(n, "total_s", ref) if n != ref else one
        par = max((x["parity"]["max_abs_diff_muon_matrices"] for x in ok if x["impl"] == n and "parity" in x), default=None)
        note = " (inexact by design)" if n == "tp_shard_local" else ""
        mg = r.get("micro_groups", "-")
        if r.get("micro_groups_per_row"):
            mg = f"{mg} ({'+'.join(map(str, r['micro_groups_per_row']))} per dp row)"
        L.append(f"| {n} | {stats(n, 'step_s')['median']:.4f} | {cell(st)} | {cell(tot)} | {mg} | "
                 f"{a2a:g} | {ag:g} | {wire / MB:.2f} | {r.get('step_balance', '-')} | "
                 + ("-" if par is None else f"{par:.2e}") + f"{note} |")
    L.append("")
    targets = (("step >= 2x faster than the redundant baseline", "tp_microgroups", ref, 0.5),
               ("fused faster than unfused", "tp_microgroups", "tp_unfused", 1.0),
               ("pipelined faster than sequential micro-groups", "tp_microgroups", "tp_sequential", 1.0))
    if "tp_unfused_lpt" in ok_names:  # dp > 1: tp_c_max=1 hosts every matrix on TP rank 0
        targets += (("(supplementary, not an issue target) fused faster than unfused with LPT-balanced hosts",
                     "tp_microgroups", "tp_unfused_lpt", 1.0),)
    L.append("Targets (step-time ratio in the same repeat, median over clean repeats; met when below the bound):")
    L.append("")
    for what, a, b, bound in targets:
        s = ratio_stats(a, "step_s", b) if a in ok_names and b in ok_names else None
        if s is None:
            L.append(f"- {what}: not measured ({a} or {b} missing)")
            continue
        per = [r["ratios"]["step_s"][b] for r in ok if r["impl"] == a and b in r.get("ratios", {}).get("step_s", {})]
        wins = sum(1 for x in per if x < bound)
        line = (f"- {what}: {a} / {b} step = {cell(s)} (bound {bound}): **{'met' if s['median'] < bound else 'not met'}** "
                f"(below the bound in {wins}/{len(per)} repeats")
        if not s.get("dirty") and s.get("n", len(per)) < len(per):  # few clean pairs: say so, show all
            line += f"; {s['n']} clean pair(s); median over all {len(per)} repeats {statistics.median(per):.3f}"
        cpu = ratio_stats(a, "cpu_step_s", b, clean_only=False)
        if cpu is not None:  # the step's work, blind to overlap (pipelining cannot show here)
            line += f"; step CPU seconds {a} / {b} = {cell(cpu)}"
        L.append(line + ")")
    L.append("")
    return L


def emit(result: dict[str, Any], args: argparse.Namespace, command: str) -> None:
    add_ratios(result["rows"])
    lines = [bc.dumps({"meta": result["meta"]})] + [bc.dumps(r) for r in result["rows"]]
    if not args.out:  # with --out, stdout gets only the markdown summary
        for ln in lines:
            print(ln)
        print()
    md = markdown(result, command)
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".jsonl", "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(args.out + ".md", "w") as f:
            f.write(md)
        print(f"wrote {args.out}.jsonl and {args.out}.md", file=sys.stderr)


# ================================================================================ driver side
def driver_main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Start the ranks, collect their rows, write the report; ``argv``: the arguments ``main``
    parsed, for the report's header (``None``: ``sys.argv[1:]``)."""
    world = args.world
    impls = _impl_list(args)
    try:  # one node: every rank needs its own GPU under nccl; say so now rather than hang later
        bc.resolve_device(args.backend, rank=0, local_world=world)
    except ValueError as e:
        print(f"step_bench: error: {e}", file=sys.stderr)
        return 2
    netns_prefix = None
    ifname = args.gloo_ifname
    if args.netns:
        import subprocess

        have = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        missing = [r for r in range(world) if not any(ln.split()[0] == f"mfb-r{r}" for ln in have.splitlines() if ln.strip())]
        if missing:
            print(f"--netns: namespaces {['mfb-r%d' % r for r in missing]} missing; run "
                  f"`sudo benchmarks/netns/setup.sh {world} 4gbit` first", file=sys.stderr)
            return 2
        netns_prefix, ifname = "mfb-r", ifname or "mfb0"
    tmp = tempfile.mkdtemp(prefix="step_bench-")
    result_path = os.path.join(tmp, "result.json")
    argv = [sys.executable, os.path.abspath(__file__), "--_worker", "--_result", result_path,
            "--impls", ",".join(impls)]
    for k in ("repeats", "warmup", "steps", "parity_steps", "threads", "pg_timeout", "max_foreign", "retries",
              "quiet_wait", "retry_budget", "alone_reps", "model", "experts", "moe_ffn", "top_k", "hidden", "layers",
              "intermediate", "seq", "global_batch", "heads", "kv_heads", "vocab"):
        v = getattr(args, k)
        if v is not None:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    argv += ["--matrixfsdp-source", args.matrixfsdp_source, "--backend", args.backend, "--ns-dtype", args.ns_dtype,
             "--reference", args.reference, "--parity-ref", args.parity_ref, "--link-check-mb", str(args.link_check_mb)]
    if args.mesh:
        argv += ["--mesh", ",".join(map(str, args.mesh))]
    if args.tp:
        argv += ["--tp", str(args.tp)]
    if args.netns:
        argv += ["--netns"]
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    if args.wait_quiet > 0:
        samples = bc.wait_quiet(args.wait_quiet)
        print(f"step_bench: machine busy share before start: {[round(x, 2) for x in samples]}", file=sys.stderr)
    t0 = time.perf_counter()
    codes = bc.launch_ranks(world, argv, store_path=os.path.join(tmp, "store"), threads=threads,
                            timeout_s=args.timeout, netns_prefix=netns_prefix, gloo_ifname=ifname)
    if any(codes) or not os.path.exists(result_path):
        print(f"step_bench: ranks exited with {codes} after {time.perf_counter() - t0:.0f}s "
              f"(no result)", file=sys.stderr)
        return 1
    with open(result_path) as f:
        result = json.load(f)
    if args.netns and args.mesh:  # the driver is in the root namespace: the inter-node link's shaping
        import subprocess

        qd = subprocess.run(["tc", "qdisc", "show", "dev", "mfbla"], capture_output=True, text=True).stdout.strip()
        result["meta"]["link_qdisc"] = qd or "mfbla absent (not the setup_two_level.sh network)"
    shutil.rmtree(tmp, ignore_errors=True)
    command = bc.command_line(__file__, argv)
    emit(result, args, command)
    return 0


def _impl_list(args: argparse.Namespace) -> list[str]:
    default = HSDP_DEFAULT_IMPLS if args.mesh else DEFAULT_IMPLS
    if args.tp:
        default = TP_DP_DEFAULT_IMPLS if _world_hint(args) > args.tp else TP_DEFAULT_IMPLS
    if args.model == "moe":
        default = MOE_DEFAULT_IMPLS
    names = [s.strip() for s in (args.impls or args.impl or ",".join(default)).split(",") if s.strip()]
    bad = [n for n in names if n not in IMPLS]
    if bad:
        raise SystemExit(f"unknown implementation(s) {bad}; choose from {list(IMPLS)}")
    wrong = [n for n in names if n.startswith("moe_") != (args.model == "moe")]
    if wrong:
        raise SystemExit(f"implementation(s) {wrong} train the other model: the moe_* rows need --model moe and "
                         "the others the default --model decoder")
    return names


def _config(args: argparse.Namespace) -> BenchConfig:
    kw: dict[str, Any] = {"ns_dtype": args.ns_dtype}
    if args.tp:  # heads divisible by every TP degree run here (2, 4, 8)
        kw.update(num_attention_heads=8, num_key_value_heads=4)
    if args.model == "moe":  # --model moe defaults (one owners step ~0.1 s on this CPU at W=4)
        kw.update(model="moe", hidden_size=128, num_hidden_layers=4, num_attention_heads=4)
        for a, f in (("experts", "experts"), ("moe_ffn", "moe_ffn"), ("top_k", "top_k")):
            if getattr(args, a) is not None:
                kw[f] = getattr(args, a)
    for a, f in (("hidden", "hidden_size"), ("layers", "num_hidden_layers"), ("intermediate", "intermediate_size"),
                 ("seq", "seq_len"), ("global_batch", "global_batch"), ("heads", "num_attention_heads"),
                 ("kv_heads", "num_key_value_heads"), ("vocab", "vocab_size")):
        v = getattr(args, a)
        if v is not None:
            kw[f] = v
    return BenchConfig(**kw)


def _mesh_arg(v: str) -> tuple[int, int]:
    try:
        R, S = (int(x) for x in v.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh takes R,S (two integers), not {v!r}") from None
    return R, S


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=None, help="spawn this many ranks (driver mode)")
    p.add_argument("--impls", default=None, help=f"comma list (default: all: {','.join(DEFAULT_IMPLS)})")
    p.add_argument("--impl", default=None, help="alias of --impls")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (>= 2)")
    p.add_argument("--steps", type=int, default=5, help="measured steps (>= 5)")
    p.add_argument("--parity-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (default cpus // world)")
    p.add_argument("--backend", default="gloo", choices=bc.BACKENDS,
                   help="gloo: ranks on CPU (default); nccl: one CUDA GPU per rank (cuda:<LOCAL_RANK> under "
                        "torchrun, else cuda:<rank %% device_count>)")
    p.add_argument("--ns-dtype", default=None, choices=("float32", "bfloat16"),
                   help="Newton-Schulz dtype of every implementation (default: float32 on gloo, bfloat16 on nccl)")
    p.add_argument("--pg-timeout", type=int, default=180, help="collective timeout, seconds")
    p.add_argument("--timeout", type=float, default=900, help="driver: kill all ranks after this many seconds")
    p.add_argument("--wait-quiet", type=float, default=0,
                   help="driver: before starting, wait up to this many seconds for the machine to be idle "
                        "(two 2 s windows under 10%% busy)")
    p.add_argument("--max-foreign", type=float, default=0.15,
                   help="a (implementation, repeat) whose measured steps saw other processes use more than this "
                        "share of the machine's CPU is discarded and rerun (see --retries)")
    p.add_argument("--retries", type=int, default=2, help="reruns of a contaminated measurement")
    p.add_argument("--quiet-wait", type=float, default=20,
                   help="before each measurement, wait up to this many seconds for a quiet 1 s window")
    p.add_argument("--retry-budget", type=float, default=240,
                   help="no more reruns once the run has lasted this many seconds")
    p.add_argument("--out", default=None, help="write OUT.jsonl and OUT.md")
    p.add_argument("--netns", action="store_true", help="ranks in namespaces mfb-r<k> (benchmarks/netns/setup.sh)")
    p.add_argument("--gloo-ifname", default=None, help="GLOO_SOCKET_IFNAME for the ranks")
    p.add_argument("--mesh", default=None, type=_mesh_arg,
                   help="R,S: HSDP on the 2-D (dp_replicate, dp_shard) mesh (issue 17); default rows "
                        f"{','.join(HSDP_DEFAULT_IMPLS)}")
    p.add_argument("--tp", type=int, default=None,
                   help="T: tensor parallelism (issue 18): dp=1 on a ('tp',) mesh of T ranks, or with --world "
                        "W = dp*T > T on a (dp_shard, tp) mesh under FSDP-style data parallelism; default rows "
                        f"{','.join(TP_DEFAULT_IMPLS)}; --world defaults to T")
    p.add_argument("--reference", default=None,
                   help=f"ratio reference (default {REFERENCE}; with --mesh {HSDP_REFERENCE})")
    p.add_argument("--parity-ref", default=None,
                   help=f"parity reference, run first in every round (default {REFERENCE}; with --mesh {HSDP_PARITY_REF})")
    p.add_argument("--link-check-mb", type=float, default=8.0,
                   help="--mesh: MB per gloo send/recv of the link check before the rows (0: none)")
    p.add_argument("--matrixfsdp-source", default="public", choices=("public", "_runtime"),
                   help="where the matrixfsdp slot gets fully_shard: the public matrixfsdp.fully_shard "
                        "(default) or the in-progress private matrixfsdp._fully_shard (development only)")
    for a in ("hidden", "layers", "intermediate", "seq", "global-batch", "heads", "kv-heads", "vocab"):
        p.add_argument(f"--{a}", type=int, default=None, help="model/data override")
    p.add_argument("--model", default="decoder", choices=("decoder", "moe"),
                   help="decoder: matrixfsdp.Decoder (default); moe: the MoE decoder of tests/_moe.py (issue 26: "
                        f"rows {','.join(MOE_DEFAULT_IMPLS)}; defaults hidden 128, 4 layers, 4 heads)")
    p.add_argument("--experts", type=int, default=None, help="--model moe: experts per layer (default 16)")
    p.add_argument("--moe-ffn", type=int, default=None, help="--model moe: expert hidden size (default 256)")
    p.add_argument("--top-k", type=int, default=None, help="--model moe: experts per token (default 2)")
    p.add_argument("--alone-reps", type=int, default=5,
                   help="rows that can (moe_owners): after the measured steps, each rank's local optimizer step "
                        "timed alone, the others waiting in a barrier (median of this many; 0: off)")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.netns and args.backend != "gloo":
        p.error(f"--netns (network namespaces, NIC byte counters) works with --backend gloo only, "
                f"not --backend {args.backend}")
    if args.ns_dtype is None:
        args.ns_dtype = "bfloat16" if args.backend == "nccl" else "float32"
    if args.tp is not None and (args.tp < 2 or args.mesh):
        p.error("--tp T needs T >= 2 and no --mesh (TP with data parallelism: --world dp*T)")
    if args.tp and not args.world and "WORLD_SIZE" not in os.environ:
        args.world = args.tp
    if args.tp and args.world and args.world % args.tp:
        p.error(f"--tp {args.tp} --world {args.world}: the world must be dp * T")
    if args.model == "moe" and (args.mesh or args.tp):
        p.error("--model moe runs on the flat data-parallel mesh (no --mesh, no --tp)")
    default_ref = (HSDP_REFERENCE if args.mesh else TP_REFERENCE if args.tp else MOE_REFERENCE if args.model == "moe"
                   else REFERENCE)
    args.reference = args.reference or default_ref
    args.parity_ref = args.parity_ref or (HSDP_PARITY_REF if args.mesh else TP_REFERENCE if args.tp
                                          else MOE_REFERENCE if args.model == "moe" else REFERENCE)
    if args.warmup < 2 or args.steps < 5:
        print("step_bench: note: the protocol asks for >= 2 warm-up and >= 5 measured steps", file=sys.stderr)
    return args


def render(jsonl: str) -> int:
    """Rewrite ``X.md`` from ``X.jsonl`` (after a change to the report; the rows are not touched)."""
    with open(jsonl) as f:
        lines = [json.loads(ln) for ln in f if ln.strip()]
    result = {"meta": lines[0]["meta"], "rows": lines[1:]}
    a = result["meta"]["args"]
    with open(jsonl[: -len(".jsonl")] + ".md") as f:  # keep the command the results were produced by
        first = f.readline()
    command = first.split("produced by: ", 1)[1].rsplit(" -->", 1)[0] if "produced by: " in first else "?"
    with open(jsonl[: -len(".jsonl")] + ".md", "w") as f:
        f.write(markdown(result, command))
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if len(argv) == 2 and argv[0] == "--render":
        return render(argv[1])
    args = parse_args(argv)
    if args._worker or ("RANK" in os.environ and "WORLD_SIZE" in os.environ and args.world is None):
        return worker_main(args)
    if not args.world:
        raise SystemExit("give --world W (driver mode) or run under torchrun")
    return driver_main(args, argv)


if __name__ == "__main__":
    code = main()
    if "--_worker" in sys.argv:
        # A rank launched by the driver leaves without the interpreter's teardown: after the final
        # barrier and destroy_process_group, destructors of gloo's C++ threads once aborted a rank
        # ("terminate called without an active exception", exit -6) on a loaded CPU after every
        # row was measured, failing the run. Nothing is left to clean up but buffered output.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
