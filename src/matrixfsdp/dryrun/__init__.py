"""Dry runs: sampled ranks of a W-rank job, through the real code on torch's fake process group.

    python -m matrixfsdp.dryrun --model qwen3-8b --world 1024
    python -m matrixfsdp.dryrun --model tiny --world 64 --replicas 8 --json

See [Note: dry runs] in ``rank.py`` for what is exact and what is not.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .rank import FRONT_ENDS, OPTIMIZERS, RankReport, run_rank

__all__ = ["RankReport", "dry_run", "sample_ranks", "preset_builder", "FRONT_ENDS", "OPTIMIZERS", "ROLES"]

#: ``replicate``'s own plan (Canzona's alpha-balanced buckets, every parameter owned whole)
REPLICATE_PLAN = {"policy": "alpha_balanced", "elementwise": "owned"}

#: the ranks a dry run samples, by their planned load (parameter + gradient + optimizer-state bytes)
ROLES = ("most_loaded", "median", "rank0")


def preset_builder(name: str, dtype: torch.dtype = torch.bfloat16) -> Callable[[], tuple[Any, tuple[type, ...], int]]:
    """A ``build()`` for :func:`run_rank`: the built-in dense or mixture-of-experts preset ``name``
    (``matrixfsdp.models``) in ``dtype``."""
    from ..models import MOE_PRESETS, PRESETS, Decoder, DecoderLayer, MoEDecoder, MoEDecoderLayer

    if name in PRESETS:
        cfg, cls, layer = PRESETS[name], Decoder, DecoderLayer
    elif name in MOE_PRESETS:
        cfg, cls, layer = MOE_PRESETS[name], MoEDecoder, MoEDecoderLayer
    else:
        raise ValueError(f"matrixfsdp.dryrun: unknown model {name!r}; built-in presets: "
                         f"{sorted({**PRESETS, **MOE_PRESETS})}")

    def build() -> tuple[Any, tuple[type, ...], int]:
        return cls(cfg).to(dtype), (layer,), cfg.vocab_size

    return build


def sample_ranks(build: Callable[[], tuple[Any, tuple[type, ...], int]], world_size: int, replicas: int = 1,
                 roles: tuple[str, ...] = ROLES, plan_kwargs: dict[str, Any] | None = None) -> dict[str, int]:
    """``{role: global rank}``: the plan's most loaded shard rank, a median one and rank 0 (in
    replica 0). Pure: plans on the ``meta`` device, no process group."""
    from ..planner.owner_plan import rank_held_bytes
    from ..planner.owners import plan_owners

    _check_world(world_size, replicas)
    with torch.device("meta"):
        model, layer_types, _ = build()
    S = world_size // replicas
    plan = plan_owners(model, (replicas, S) if replicas > 1 else S, block_types=layer_types, **(plan_kwargs or {}))
    load = rank_held_bytes(plan.params, S)  # parameter + gradient + state bytes
    order = sorted(range(S), key=lambda r: (load[r], r))
    picks = {"most_loaded": order[-1], "median": order[len(order) // 2], "rank0": 0}
    bad = [r for r in roles if r not in picks]
    if bad:
        raise ValueError(f"matrixfsdp.dryrun: unknown roles {bad}; choose from {list(ROLES)}")
    return {r: picks[r] for r in roles}


def _check_world(world_size: int, replicas: int) -> None:
    if world_size < 1 or replicas < 1 or world_size % replicas:
        raise ValueError(f"matrixfsdp.dryrun: the world size must be a positive multiple of the replicas, "
                         f"got world_size={world_size}, replicas={replicas}")


def dry_run(model: str, world_size: int, *, replicas: int = 1, front_end: str = "fully_shard",
            optimizer: str = "muon", roles: tuple[str, ...] = ROLES, dtype: torch.dtype = torch.bfloat16,
            seq_len: int = 16, ns_steps: int = 5, steps: int = 2, plan_kwargs: dict[str, Any] | None = None) -> list[RankReport]:
    """Run the sampled ranks of a ``world_size``-rank job of preset ``model``, one after the other
    in this process (each on its own fake process group); one :class:`RankReport` per distinct
    rank, in ``roles`` order (a rank sampled for two roles runs once, named by the first)."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"matrixfsdp.dryrun: front_end must be one of {FRONT_ENDS}, got {front_end!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"matrixfsdp.dryrun: optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if front_end == "replicate" and plan_kwargs is None:
        plan_kwargs = dict(REPLICATE_PLAN)  # what replicate plans when given no plan
    build = preset_builder(model, dtype)
    picks = sample_ranks(build, world_size, replicas, roles, plan_kwargs)
    out: list[RankReport] = []
    seen: set[int] = set()
    for role, rank in picks.items():
        if rank in seen:
            continue
        seen.add(rank)
        out.append(run_rank(build, name=model, world_size=world_size, rank=rank, role=role, replicas=replicas,
                            front_end=front_end, optimizer=optimizer, seq_len=seq_len, ns_steps=ns_steps, steps=steps,
                            plan_kwargs=plan_kwargs))
    return out
