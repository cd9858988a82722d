"""Dry runs: sampled ranks of a W-rank job, through the real code on torch's fake process group.

    python -m matrixfsdp.dryrun --model qwen3-8b --world 1024
    python -m matrixfsdp.dryrun --model tiny --world 64 --replicas 8 --json

See [Note: dry runs] in ``rank.py`` for what is exact and what is not.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import traceback
from typing import Any, Callable

import torch

from .rank import FRONT_ENDS, MLP_TP, OPTIMIZERS, RankReport, run_rank

__all__ = ["RankReport", "dry_run", "sample_ranks", "preset_builder", "tp_fractions", "FRONT_ENDS", "OPTIMIZERS", "ROLES"]

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
                 roles: tuple[str, ...] = ROLES, plan_kwargs: dict[str, Any] | None = None,
                 tp: int = 1) -> dict[str, int]:
    """``{role: global rank}``: the plan's most loaded shard rank, a median one and rank 0 (in
    replica 0; with ``tp`` > 1, TP rank 0 of the data-parallel rank). Pure: plans on the ``meta``
    device, no process group (owners are planned on whole shapes, TP or not)."""
    from ..planner.owner_plan import rank_held_bytes
    from ..planner.owners import plan_owners

    _check_world(world_size, replicas, tp)
    with torch.device("meta"):
        model, layer_types, _ = build()
    S = world_size // replicas // tp
    kw = {**(plan_kwargs or {}), **({"tp": tp} if tp > 1 else {})}
    plan = plan_owners(model, (replicas, S) if replicas > 1 else S, block_types=layer_types, **kw)
    if tp > 1:  # what each data-parallel rank's TP rank 0 holds: its TP shard of the MLP matrices
        frac = tp_fractions(model, tp)
        load = [0.0] * S
        for p in plan.params:
            for r in range(S):
                if (sh := p.share(r, S)):
                    load[r] += sh * (2 * p.nbytes + p.state_nbytes) * frac.get(p.fqn, 1.0)
    else:
        load = rank_held_bytes(plan.params, S)  # parameter + gradient + state bytes
    order = sorted(range(S), key=lambda r: (load[r], r))
    picks = {"most_loaded": order[-1], "median": order[len(order) // 2], "rank0": 0}
    bad = [r for r in roles if r not in picks]
    if bad:
        raise ValueError(f"matrixfsdp.dryrun: unknown roles {bad}; choose from {list(ROLES)}")
    return {r: picks[r] * tp for r in roles}


def tp_fractions(model: Any, tp: int) -> dict[str, float]:
    """The fraction of each parameter TP rank 0 holds under :func:`rank.tensor_parallel`
    (``torch.chunk`` along ``MLP_TP``'s split dimension), computed from shapes alone."""
    from ..models.decoder import MLP

    out: dict[str, float] = {}
    for name, m in model.named_modules():
        if not isinstance(m, MLP):
            continue
        for proj, dim in MLP_TP:
            w = getattr(m, proj).weight
            n = w.shape[dim]
            out[f"{name}.{proj}.weight"] = min(n, -(-n // tp)) / n if n else 1.0
    return out


def _check_world(world_size: int, replicas: int, tp: int = 1) -> None:
    if world_size < 1 or replicas < 1 or world_size % replicas:
        raise ValueError(f"matrixfsdp.dryrun: the world size must be a positive multiple of the replicas, "
                         f"got world_size={world_size}, replicas={replicas}")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise ValueError(f"matrixfsdp.dryrun: tp must be an int >= 1 dividing the world size, "
                         f"got tp={tp!r}, world_size={world_size}")
    if tp > 1 and replicas > 1:
        raise ValueError(f"matrixfsdp.dryrun: tp={tp} with replicas={replicas}: the dry run's TP mesh is "
                         "(dp_shard, tp); run HSDP and TP separately")


def dry_run(model: str, world_size: int, *, replicas: int = 1, front_end: str = "fully_shard",
            optimizer: str = "muon", roles: tuple[str, ...] = ROLES, dtype: torch.dtype = torch.bfloat16,
            seq_len: int = 16, ns_steps: int = 5, steps: int = 2, plan_kwargs: dict[str, Any] | None = None,
            tp: int = 1, progress: Callable[[int, str, str], None] | None = None) -> list[RankReport]:
    """Run the sampled ranks of a ``world_size``-rank job of preset ``model``, one after the other,
    each in a fresh process of its own (spawned; its own fake process group); one
    :class:`RankReport` per distinct rank, in ``roles`` order (a rank sampled for two roles runs
    once, named by the first). A process per rank: state that outlives a process group within a
    process (torch's DTensor sharding-propagation cache compares meshes by value, so a TP
    parameter of a second process group came out on the first one's mesh) cannot leak from one
    sampled rank into the next. ``progress(rank, role, phase)``, if given, is called as each
    sampled rank starts a phase (``"starting"``, ``"planning"``, ``"sharding"``, ``"to_empty"``,
    ``"step i/n"``, ``"done"``). Shampoo and SOAP are planned for their own state and FLOPs."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"matrixfsdp.dryrun: front_end must be one of {FRONT_ENDS}, got {front_end!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"matrixfsdp.dryrun: optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if tp > 1 and front_end != "fully_shard":
        raise ValueError(f"matrixfsdp.dryrun: tp={tp} runs fully_shard's FSDP2 + TP pattern, got front_end={front_end!r}")
    if front_end == "replicate" and plan_kwargs is None:
        plan_kwargs = dict(REPLICATE_PLAN)  # what replicate plans when given no plan
    if optimizer in ("shampoo", "soap") and "optimizer" not in (plan_kwargs or {}):
        plan_kwargs = {**(plan_kwargs or {}), "optimizer": optimizer}  # their state and FLOPs, not Muon's
    build = preset_builder(model, dtype)
    picks = sample_ranks(build, world_size, replicas, roles, plan_kwargs, tp)
    out: list[RankReport] = []
    seen: set[int] = set()
    ctx = multiprocessing.get_context("spawn")
    for role, rank in picks.items():
        if rank in seen:
            continue
        seen.add(rank)
        kw = dict(world_size=world_size, rank=rank, role=role, replicas=replicas, front_end=front_end,
                  optimizer=optimizer, seq_len=seq_len, ns_steps=ns_steps, steps=steps, plan_kwargs=plan_kwargs, tp=tp)
        if progress is not None:
            progress(rank, role, "starting")
        out.append(_in_process(ctx, rank, role, model, dtype, kw, progress))
        if progress is not None:
            progress(rank, role, "done")
    return out


def _in_process(ctx: Any, rank: int, role: str, model: str, dtype: torch.dtype, kw: dict[str, Any],
                progress: Callable[[int, str, str], None] | None) -> RankReport:
    """Run one sampled rank in a spawned process, relaying its phases to ``progress``; its
    exception is raised here."""
    q = ctx.Queue()
    proc = ctx.Process(target=_run_preset, args=(q, model, dtype), kwargs=kw, daemon=True)
    proc.start()
    try:
        while True:
            try:
                kind, value = q.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"matrixfsdp.dryrun: the process of rank {rank} ({role}) exited with "
                                       f"status {proc.exitcode} before reporting") from None
                continue
            if kind == "phase":
                if progress is not None:
                    progress(rank, role, value)
            elif kind == "done":
                return value
            else:
                raise value
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _run_preset(q: Any, model: str, dtype: torch.dtype, **kw: Any) -> None:
    """:func:`run_rank` of preset ``model`` (a spawned process's entry: builders do not pickle);
    phases, then the report or the exception, go to the parent through ``q``."""
    import warnings

    # matrixfsdp's collectives call reduce_scatter_tensor, which torch 2.13 deprecates: a note for
    # the developers, nothing a dry run's user can act on
    warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor. is deprecated", category=FutureWarning)
    try:
        report = run_rank(preset_builder(model, dtype), name=model, progress=lambda ph: q.put(("phase", ph)), **kw)
    except BaseException as e:  # noqa: BLE001 - raised again in the parent
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001
            e = RuntimeError(f"matrixfsdp.dryrun: rank {kw.get('rank')} failed:\n{traceback.format_exc()}")
        q.put(("error", e))
        return
    q.put(("done", report))
