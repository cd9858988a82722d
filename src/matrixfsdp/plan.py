"""Command line: plan owners for a built-in preset or a Hugging Face config and print the report.

    python -m matrixfsdp.plan --model qwen3-32b --world 32
    python -m matrixfsdp.plan --hf-config path/to/config.json --world 64 --json > plan.json

No process group, no weights: the model is built on the ``meta`` device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ._decoder import PRESETS, Decoder, DecoderLayer, config_from_hf
from ._planner import ELEMENTWISE, POLICIES, plan_owners
from ._cost import COST_MODELS, OPTIMIZERS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m matrixfsdp.plan", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="qwen3-32b", choices=sorted(PRESETS), help="built-in preset")
    src.add_argument("--hf-config", metavar="PATH", help="a Llama/Qwen-style Hugging Face config.json")
    p.add_argument("--world", type=int, required=True, help="data-parallel world size")
    p.add_argument("--policy", default="balanced", choices=POLICIES)
    p.add_argument("--cost", default="flops", choices=COST_MODELS)
    p.add_argument("--optimizer", default="muon", choices=OPTIMIZERS)
    p.add_argument("--elementwise", default="auto", choices=ELEMENTWISE)
    p.add_argument("--alpha", type=float, default=1.0, help="alpha_balanced blend factor")
    p.add_argument("--bucket-numel", type=int, default=None, help="ZeRO-1 bucket size (elements)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (OwnerPlan.to_json)")
    p.add_argument("--no-ranks", action="store_true", help="omit the per-rank table")
    p.add_argument("--no-blocks", action="store_true", help="omit the per-block gamma_B table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.world < 1:
        print(f"error: --world must be >= 1, got {args.world}", file=sys.stderr)
        return 2
    try:
        cfg = config_from_hf(args.hf_config) if args.hf_config else PRESETS[args.model]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with torch.device("meta"):
        model = Decoder(cfg)
    t0 = time.perf_counter()
    plan = plan_owners(
        model,
        args.world,
        block_types=(DecoderLayer,),
        policy=args.policy,
        cost=args.cost,
        optimizer=args.optimizer,
        elementwise=args.elementwise,
        alpha=args.alpha,
        bucket_numel=args.bucket_numel,
    )
    ms = (time.perf_counter() - t0) * 1e3
    if args.json:
        print(plan.to_json(indent=1))
        return 0
    name = args.hf_config or args.model
    print(f"# {name}: {cfg.num_params / 1e9:.2f}B parameters, planned in {ms:.1f} ms")
    print(plan.report(per_rank=not args.no_ranks, per_block=not args.no_blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
