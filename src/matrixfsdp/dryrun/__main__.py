"""python -m matrixfsdp.dryrun: sampled ranks of a W-rank job through the real code (fake process group).

    python -m matrixfsdp.dryrun --model qwen3-8b --world 1024
    python -m matrixfsdp.dryrun --model qwen3-8b --world 1024 --replicas 128      # HSDP 128 x 8
    python -m matrixfsdp.dryrun --model qwen3-8b --world 1024 --tp 8              # FSDP2 + TP, 128 x tp 8
    python -m matrixfsdp.dryrun --model tiny --world 64 --front-end replicate --json
    python -m matrixfsdp.dryrun --model qwen3-8b --world 1024 --placement owned   # every matrix owned

Per sampled rank (the plan's most loaded, a median one, rank 0): local parameter, gradient and
optimizer-state bytes against FSDP2's even share, peak tensor memory, collective bytes per phase,
and the init time per phase (planning, sharding, to_empty). No data moves: see [Note: dry runs]
in matrixfsdp/dryrun/rank.py.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from . import FRONT_ENDS, OPTIMIZERS, ROLES, RankReport, dry_run
from .rank import INIT_PHASES, PHASES

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
_MIB = 2.0**20


def build_parser() -> argparse.ArgumentParser:
    from ..models import MOE_PRESETS, PRESETS

    p = argparse.ArgumentParser(prog="python -m matrixfsdp.dryrun", description=__doc__.split("\n")[0],
                                epilog="\n".join(__doc__.split("\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=sorted({**PRESETS, **MOE_PRESETS}),
                   help="built-in preset (default: %(default)s)")
    p.add_argument("--world", type=int, required=True, help="data-parallel world size (ranks)")
    p.add_argument("--replicas", type=int, default=1,
                   help="HSDP replicas: a (replicas, world/replicas) mesh (default: 1, flat)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: a (world/tp, tp) mesh, the preset's MLPs tensor-parallel, "
                        "fully_shard over the data-parallel dimension (default: %(default)s)")
    p.add_argument("--front-end", default="fully_shard", choices=FRONT_ENDS, help="default: %(default)s")
    p.add_argument("--optimizer", default="muon", choices=OPTIMIZERS,
                   help="muon (fp32 Newton-Schulz), shampoo or soap (default settings, planned for their "
                        "state and FLOPs) for the matrices, or adamw for every parameter (default: %(default)s)")
    p.add_argument("--placement", default=None, choices=("auto", "owned"),
                   help="fully_shard's plan: auto hosts the matrices past the memory budget, owned owns every "
                        "matrix (default: plan_owners' default, auto)")
    p.add_argument("--roles", nargs="+", default=list(ROLES), choices=ROLES, help="ranks to sample")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES),
                   help="parameter dtype (default: %(default)s, the released Qwen3 weights')")
    p.add_argument("--seq-len", type=int, default=16, help="tokens in the one-sequence batch (default: %(default)s)")
    p.add_argument("--ns-steps", type=int, default=5, help="Muon's Newton-Schulz iterations (default: %(default)s)")
    p.add_argument("--steps", type=int, default=2,
                   help="training steps; the table shows the last one's collectives; 0: planning, sharding "
                        "and to_empty only (init time at large W) (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object per sampled rank instead of the table")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="report each sampled rank's phases on stderr: a progress bar on a terminal (tqdm, "
                        "where installed), else one line per phase (default: on)")
    return p


def format_table(reports: list[RankReport]) -> str:
    hsdp = any(r.replicas > 1 for r in reports)
    head = ("role", "rank", "params MiB", "/even", "grads MiB", "state MiB", "held/FSDP2", "peak MiB",
            "fwd MiB", "bwd MiB", "step MiB", *(("across MiB",) if hsdp else ()), "plan s", "shard s",
            "to_empty s")
    rows = [head]
    for r in reports:
        across = (f"{sum(r.phase_bytes(ph, across=True) for ph in PHASES) / _MIB:.2f}",) if hsdp else ()
        rows.append((r.role, str(r.rank), f"{r.param_bytes / _MIB:.2f}", f"{r.param_ratio:.2f}",
                     f"{r.grad_bytes / _MIB:.2f}", f"{r.state_bytes / _MIB:.2f}", f"{r.held_ratio:.2f}",
                     f"{r.peak_bytes / _MIB:.2f}", *(f"{r.phase_bytes(ph) / _MIB:.2f}" for ph in PHASES),
                     *across, *(f"{r.seconds.get(k, float('nan')):.3f}" for k in INIT_PHASES)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


class _Progress:
    """Phases of the sampled ranks on stderr: a tqdm bar (one tick per phase) on a terminal,
    else a line per phase (logs, CI)."""

    def __init__(self, ranks: int, steps: int):
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:  # planning, sharding, to_empty and the steps, per sampled rank
                self.bar = tqdm(total=ranks * (3 + steps), unit="phase", file=sys.stderr, dynamic_ncols=True)

    def __call__(self, rank: int, role: str, phase: str) -> None:
        if self.bar is None:
            print(f"dryrun: rank {rank} ({role}): {phase}", file=sys.stderr, flush=True)
            return
        self.bar.set_description(f"rank {rank} ({role}): {phase}")
        if phase not in ("starting", "done"):
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.placement and args.front_end != "fully_shard":
        print(f"error: --placement chooses fully_shard's plan; {args.front_end} plans its own buckets "
              "(drop --placement)", file=sys.stderr)
        return 2
    progress = _Progress(len(set(args.roles)), args.steps) if args.progress else None
    try:
        reports = dry_run(args.model, args.world, replicas=args.replicas, front_end=args.front_end,
                          optimizer=args.optimizer, roles=tuple(args.roles), dtype=_DTYPES[args.dtype],
                          seq_len=args.seq_len, ns_steps=args.ns_steps, steps=args.steps,
                          plan_kwargs={"placement": args.placement} if args.placement else None, tp=args.tp,
                          progress=progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if progress is not None:
            progress.close()
    if args.json:
        for r in reports:
            print(json.dumps(r.as_dict()))
        return 0
    r0 = reports[0]
    mesh = (f"{args.replicas} x {args.world // args.replicas}" if args.replicas > 1
            else f"{args.world // args.tp} x tp {args.tp}" if args.tp > 1 else f"{args.world}")
    print(f"{args.model}, {args.front_end}, mesh {mesh}, {args.dtype}, {args.optimizer}, "
          f"one sequence of {args.seq_len} tokens (fake process group: no data moved)")
    print(format_table(reports))
    print(f"\neven share (FSDP2) of the parameters: {r0.even_param_bytes / _MIB:.2f} MiB per rank; "
          "bytes per phase are what the sampled rank sends" + (" (across MiB: the part sent to other replicas)"
                                                               if args.replicas > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
