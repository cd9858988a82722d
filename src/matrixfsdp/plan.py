"""Command line: plan owners for a built-in preset or a Hugging Face config and print the report.

    python -m matrixfsdp.plan --model qwen3-32b --world 32
    python -m matrixfsdp.plan --hf-config path/to/config.json --world 64 --json > plan.json
    python -m matrixfsdp.plan --model qwen3-8b --world 64 --replicas 8 --replica-step auto   # HSDP 8 x 8
    python -m matrixfsdp.plan --model qwen3-32b --world 1 --tp 8   # TP micro-groups (planning only)
    python -m matrixfsdp.plan --model qwen3-30b-a3b --world 64   # experts, against two baselines

No process group, no weights: the model is built on the ``meta`` device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import torch

from .models.decoder import PRESETS, Decoder, DecoderLayer, config_from_hf
from .models.moe import MOE_PRESETS, MoEDecoder, MoEDecoderLayer
from .planner.owners import ELEMENTWISE, POLICIES, plan_owners
from .planner.owner_plan import REPLICA_STEPS
from .planner.hosting import PLACEMENT_MODES
from .planner.cost import COST_MODELS, OPTIMIZERS
from .planner.report import natural_key, plan_warnings


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help, and the examples (HSDP among them) laid out as written."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m matrixfsdp.plan",
        description=__doc__.split("\n")[0] + " Without --model or --hf-config, plans qwen3-32b.",
        formatter_class=_Formatter,
        epilog="examples:\n" + "\n".join(line for line in __doc__.splitlines() if "python -m" in line),
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="qwen3-32b", choices=sorted({**PRESETS, **MOE_PRESETS}, key=natural_key),
                     help="built-in preset (shapes from the published Hugging Face configs: dense Qwen3, and "
                          "the mixture-of-experts qwen3-30b-a3b and deepseek-v3, whose report adds experts per "
                          "rank against round-robin and chunked expert placements)")
    src.add_argument("--hf-config", metavar="PATH",
                     help="a Llama/Qwen-style Hugging Face config.json, or the model folder holding it")
    p.add_argument("--world", type=int, required=True, help="data-parallel world size (ranks)")
    p.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES],
                   help="parameter dtype for the byte figures; auto: the HF config's torch_dtype/dtype, "
                        "else bfloat16 (the dtype of the released Qwen3 weights)")
    p.add_argument("--policy", default="balanced", choices=POLICIES,
                   help="planner: balanced (bytes and cost together), role_greedy / scope_greedy "
                        "(simple baselines), alpha_balanced / naive_static (Canzona's ZeRO-1 buckets)")
    p.add_argument("--cost", default="flops", choices=COST_MODELS,
                   help="optimizer cost model to balance: FLOPs of the optimizer, state bytes, or numel")
    p.add_argument("--optimizer", default="muon", choices=OPTIMIZERS,
                   help="the optimizer whose FLOPs and state the plan balances")
    p.add_argument("--elementwise", default="auto", choices=ELEMENTWISE,
                   help="placement of element-wise tensors (norms, embeddings): auto owns a block's "
                        "tail when it fits its fair share, else shards it evenly")
    p.add_argument("--alpha", type=float, default=1.0, help="alpha_balanced blend factor, in [0, 1]")
    p.add_argument("--bucket-numel", type=int, default=None,
                   help="ZeRO-1 bucket size in elements (alpha_balanced / naive_static; default: Megatron's)")
    p.add_argument("--replicas", type=int, default=1,
                   help="HSDP: copies of the owner group; --world ranks form a (replicas, world/replicas) "
                        "mesh and owners are planned among world/replicas ranks")
    p.add_argument("--replica-step", default="auto", choices=REPLICA_STEPS,
                   help="HSDP: how owned parameters combine across replicas: repeat (all-reduce, every "
                        "replica steps), split (one step replica each), auto (split matrices, repeat tails)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree of each owner's TP group: with T > 1 the plan gets "
                        "micro-groups (fused all-to-all batches, a host TP rank per matrix) and the "
                        "report a table of them; planning only, the runtime is separate")
    p.add_argument("--tp-c-max", type=int, default=None, metavar="BYTES",
                   help="most bytes of one micro-group's fused all-to-all buffer (default: "
                        "max(512 MiB, tp x the largest matrix))")
    p.add_argument("--placement", default="auto", choices=PLACEMENT_MODES,
                   help="auto hosts the matrices whose ownership would put a rank above --memory-budget "
                        "(stored evenly, stepped whole on a planned host between fused all-to-alls); "
                        "owned keeps every matrix owned (zero step communication)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="X",
                   help="most a rank may hold under --placement auto, in multiples of FSDP2's most "
                        "loaded rank on the mesh, parameter + gradient + state bytes (default 1.25, met where hosting can; an explicit "
                        "budget that cannot be met is an error naming the smallest that can)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (OwnerPlan.to_json)")
    # off by default: at large W the tables run to thousands of lines and bury the summary and the
    # warnings (--no-ranks / --no-blocks, the old opt-outs, are still accepted)
    p.add_argument("--ranks", action=argparse.BooleanOptionalAction, default=False,
                   help="also print the per-rank table (owned tensors, bytes, cost per rank)")
    p.add_argument("--blocks", action=argparse.BooleanOptionalAction, default=False,
                   help="also print the per-block gamma_B table")
    return p


def _hf_dtype(path: Path) -> str | None:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    d = cfg.get("torch_dtype") or cfg.get("dtype")
    return d if d in _DTYPES else None


def _run(args: argparse.Namespace) -> int:
    if args.world < 1:
        raise ValueError(f"--world must be >= 1, got {args.world}")
    if args.replicas < 1 or args.world % args.replicas:
        raise ValueError(f"--replicas must be >= 1 and divide --world, got --replicas {args.replicas} "
                         f"with --world {args.world}")
    hf = None
    if args.hf_config:
        hf = Path(args.hf_config)
        if hf.is_dir():
            hf = hf / "config.json"
    moe = hf is None and args.model in MOE_PRESETS
    cfg = config_from_hf(hf) if hf else MOE_PRESETS[args.model] if moe else PRESETS[args.model]
    dtype_name = args.dtype if args.dtype != "auto" else ((_hf_dtype(hf) if hf else None) or "bfloat16")
    with torch.device("meta"):
        model = (MoEDecoder(cfg) if moe else Decoder(cfg)).to(_DTYPES[dtype_name])
    t0 = time.perf_counter()
    plan = plan_owners(
        model,
        (args.replicas, args.world // args.replicas) if args.replicas > 1 else args.world,
        block_types=(MoEDecoderLayer,) if moe else (DecoderLayer,),
        policy=args.policy,
        cost=args.cost,
        optimizer=args.optimizer,
        elementwise=args.elementwise,
        alpha=args.alpha,
        bucket_numel=args.bucket_numel,
        replica_step=args.replica_step,
        tp=args.tp,
        tp_c_max=args.tp_c_max,
        placement=args.placement,
        memory_budget=args.memory_budget,
    )
    ms = (time.perf_counter() - t0) * 1e3
    if args.json:
        print(plan.to_json(indent=1))
        return 0
    name = str(hf) if hf else args.model
    active = f" ({cfg.num_active_params / 1e9:.2f}B active)" if moe else ""
    print(f"# {name}: {cfg.num_params / 1e9:.2f}B parameters{active} in {dtype_name}, planned in {ms:.1f} ms")
    print(plan.report(per_rank=args.ranks, per_block=args.blocks))
    warned = bool(plan_warnings(plan))
    if warned and args.replicas == 1 and args.tp == 1:
        source = f"--hf-config {args.hf_config}" if hf else f"--model {args.model}"
        fit = _fitting_replicas(model, args.world, (MoEDecoderLayer,) if moe else (DecoderLayer,), args, source)
        print("\n".join(textwrap.wrap(f"# suggestion: {fit}", 120, subsequent_indent="#   ")))
    hidden = [f for f, on in (("--ranks", args.ranks), ("--blocks", args.blocks)) if not on]
    if hidden:
        print(f"\n# left out: {', '.join(hidden)} (the per-rank and per-block tables)")
    return 0


def _fitting_replicas(model: torch.nn.Module, world: int, layers: tuple, args: argparse.Namespace,
                      source: str) -> str:
    """The fewest HSDP replicas whose plan has no warning (replicas dividing ``world``)."""
    for R in (r for r in range(2, world + 1) if world % r == 0):
        plan = plan_owners(model, (R, world // R), block_types=layers, policy=args.policy, cost=args.cost,
                           optimizer=args.optimizer, elementwise=args.elementwise, alpha=args.alpha,
                           bucket_numel=args.bucket_numel, replica_step=args.replica_step,
                           placement=args.placement)
        if not plan_warnings(plan):
            return (f"--replicas {R} (owners planned among {world // R} ranks; HSDP example: python -m "
                    f"matrixfsdp.plan {source} --world {world} --replicas {R})")
    return "no HSDP replica count removes the warnings; shard this model evenly (torch's fully_shard)"


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (bad input: one ``error:`` line on stderr, 2)."""
    args = build_parser().parse_args(argv)
    try:
        status = _run(args)
        sys.stdout.flush()
        return status
    except (ValueError, TypeError) as e:
        msg = str(e)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `| head` closed the pipe: stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout without a file descriptor (captured)
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
