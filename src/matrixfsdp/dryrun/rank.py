"""One sampled rank of a W-rank job, run through the real code on torch's fake process group.

[Note: dry runs]
torch's fake process group lets one process play rank ``r`` of ``W``: every collective returns at
once and moves no data (receive buffers keep what they held), but every shape, buffer and call
is the one the real job makes. So this module runs the real planner, the real front-end
(``fully_shard`` per layer and on the root, or ``replicate``) on a ``meta``-device model that is
then materialized with ``to_empty``, and one forward, backward and optimizer step on a short
batch. What it measures is exact for the sampled rank: the bytes of its local parameters,
gradients and optimizer state, its peak memory (the CPU allocator's events, ``peak.py``), and the calls and
bytes of every collective the front-end issues, per phase, from the project's own counters. The
*values* it computes are not (received buffers hold garbage), so it reports no loss; the
optimizer step runs on whatever arrived, which costs what a real step costs.

Agreement exchanges (plan digests, layouts) keep this rank's own entry in every receive buffer
(``comm/agree.py``), so a check that fails on the sampled rank still raises here, and peers look
like it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["RankReport", "run_rank", "tensor_parallel", "FRONT_ENDS", "OPTIMIZERS", "PHASES", "INIT_PHASES", "ACROSS", "MLP_TP"]

FRONT_ENDS = ("fully_shard", "replicate")
OPTIMIZERS = ("muon", "adamw", "shampoo", "soap")
#: the phases of a training step, as the report's ``comm`` and ``seconds`` name them
PHASES = ("forward", "backward", "step")
#: the phases of one rank's initialization, as the report's ``seconds`` names them: planning,
#: sharding (the front-end's calls) and ``to_empty`` (with the dry run's own initialization)
INIT_PHASES = ("plan", "shard", "to_empty")
#: prefix of the collectives an HSDP rank makes across replicas (the ``"replicate"`` role) in
#: :attr:`RankReport.comm`; those within its shard group (and the hosted step's) are unprefixed
ACROSS = "replicate/"


@dataclass
class RankReport:
    """What one sampled rank holds, peaks at and sends (see [Note: dry runs])."""

    model: str
    front_end: str
    world_size: int
    replicas: int
    rank: int
    role: str
    #: bytes of this rank's local parameters, gradients (after backward) and optimizer state
    param_bytes: int
    grad_bytes: int
    state_bytes: int
    #: FSDP2's even share of the parameters' bytes on this mesh (total / shard ranks; with TP, the
    #: total of each rank's TP shards / data-parallel ranks)
    even_param_bytes: float
    #: what the plan predicts for this rank (``OwnerPlan.rank_stats``)
    planned_param_bytes: float
    planned_state_bytes: float
    #: the most bytes the CPU allocator held over forward, backward and step (``peak.py``)
    peak_bytes: int
    #: per phase, per collective: ``{"calls": n, "sent": bytes, "recv": bytes}``; the collectives
    #: across HSDP replicas are named with the prefix ``ACROSS`` (``"replicate/all_reduce"``)
    comm: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    #: seconds: planning, sharding (front-end calls), ``to_empty`` (``INIT_PHASES``), and each
    #: phase of the last step on this CPU
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def param_ratio(self) -> float:
        """Local parameter bytes over FSDP2's even share."""
        return self.param_bytes / self.even_param_bytes if self.even_param_bytes else 1.0

    @property
    def held_ratio(self) -> float:
        """Parameter + gradient + state bytes over those of FSDP2's most loaded rank on the same
        mesh (``fsdp2_peak_bytes``; with TP, over the even shares of the three)."""
        ref = self.fsdp2_peak_bytes or self.even_param_bytes * 2 + self.planned_state_even
        return (self.param_bytes + self.grad_bytes + self.state_bytes) / ref if ref else 1.0

    #: FSDP2's even share of the optimizer state (total planned state / shard ranks; with TP, of
    #: each rank's TP shards)
    planned_state_even: float = 0.0
    #: tensor-parallel degree (``(dp_shard, tp)`` mesh; rank = dp rank * tp + tp rank)
    tp: int = 1
    #: parameter + gradient + state bytes of FSDP2's most loaded rank on this mesh (every tensor
    #: ``Shard(0)`` in ``torch.chunk`` rows: above an even share once tensors have fewer rows than
    #: ranks; ``planner.owner_plan.fsdp2_held_bytes``); 0 with TP
    fsdp2_peak_bytes: float = 0.0

    def phase_bytes(self, phase: str, across: bool | None = None) -> int:
        """Bytes this rank sent in ``phase``: all of them, or (``across``) only those across HSDP
        replicas, or (``across=False``) only those within its shard group."""
        return sum(v["sent"] for op, v in self.comm.get(phase, {}).items()
                   if across is None or op.startswith(ACROSS) == across)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["param_ratio"], d["held_ratio"] = self.param_ratio, self.held_ratio
        return d


def _counters(model: nn.Module, front_end: str, hsdp: bool) -> list[tuple[str, Any]]:
    """``(prefix, counter)`` of every counter the rank's collectives are counted in."""
    roles = ("shard", "replicate") if hsdp else ("shard",)
    prefix = {"shard": "", "replicate": ACROSS}
    if front_end == "fully_shard":
        from .._fully_shard import comm_counter
        from ..placement.tp_host import tp_host_of

        # the engine's collectives, and the hosted matrices' step (its executor counts its own)
        hosts = {id(h.executor): h.executor.counter for p in model.parameters()
                 if (h := tp_host_of(p)) is not None and h.executor is not None}
        return [(prefix[role], comm_counter(model, role)) for role in roles] + [("", c) for c in hosts.values()]
    return [(prefix[role], model.comm_counter(role)) for role in roles]  # type: ignore[operator]


def _take(counters: list[tuple[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for prefix, c in counters:
        for op, n in c.calls.items():
            e = out.setdefault(prefix + op, {"calls": 0, "sent": 0, "recv": 0})
            e["calls"] += n
            e["sent"] += c.bytes_sent.get(op, 0)
            e["recv"] += c.bytes_recv.get(op, 0)
        c.reset()
    return out


def _local_nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = getattr(t, "_local_tensor", t)
    return local.numel() * local.element_size()


def _state_nbytes(opt: torch.optim.Optimizer) -> int:
    return sum(_local_nbytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))


def _optimizer(name: str, model: nn.Module, ns_steps: int) -> torch.optim.Optimizer:
    from ..optim import SOAP, Muon, Shampoo

    if name == "shampoo":  # default settings: preconditioners from step 10 on, grafted steps before
        return Shampoo(model, lr=1e-3)
    if name == "soap":
        return SOAP(model, lr=1e-3)
    if name == "muon":
        # fp32 Newton-Schulz: bf16 matmuls are 25x slower than fp32 on CPUs without AMX
        return Muon(model, lr=1e-3, ns_steps=ns_steps, ns_dtype=torch.float32)
    return Muon([{"params": list(model.parameters()), "algorithm": "adamw"}], lr=1e-3)


#: the dry run's TP of a preset's MLP: (projection, dimension split over TP ranks): dim 0 is
#: torch's ``ColwiseParallel`` of an ``nn.Linear``, dim 1 its ``RowwiseParallel``
MLP_TP = (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1))


def tensor_parallel(model: nn.Module, tp_mesh: Any) -> dict[str, float]:
    """torch's Megatron-style TP of every MLP of a built-in preset over ``tp_mesh`` (gate and up
    projections ``ColwiseParallel``, down ``RowwiseParallel``; attention stays replicated over
    TP: the preset's attention views its heads by the configured count). Returns each parameter's
    fraction held by this TP rank (1.0 where replicated)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ..models.decoder import MLP

    for m in model.modules():
        if isinstance(m, MLP):
            parallelize_module(m, tp_mesh, {proj: ColwiseParallel() if dim == 0 else RowwiseParallel()
                                            for proj, dim in MLP_TP})
    return {n: (_local_nbytes(p) / (p.numel() * p.element_size()) if p.numel() else 1.0)
            for n, p in model.named_parameters()}


def run_rank(build: Any, *, name: str, world_size: int, rank: int, role: str, replicas: int = 1,
             front_end: str = "fully_shard", optimizer: str = "muon", seq_len: int = 16,
             ns_steps: int = 5, steps: int = 2, plan_kwargs: dict[str, Any] | None = None,
             tp: int = 1, progress: Any = None) -> RankReport:
    """Rank ``rank`` of a ``world_size``-rank job on the fake process group (see [Note: dry
    runs]). ``build()`` returns ``(model, layer_types, vocab_size)`` for a model built on the
    current default device (``meta`` here). Runs ``steps`` training steps and reports the last
    one's collectives (a parameter exchange of ``replicate`` or HSDP ``split`` runs in the forward
    after a step); ``steps=0`` measures planning, sharding and ``to_empty`` alone. ``tp > 1``: a
    ``(dp_shard, tp)`` mesh of ``world_size / tp`` data-parallel ranks, the preset's MLPs tensor-
    parallel (:func:`tensor_parallel`), ``fully_shard`` over the data-parallel dimension, the TP
    host step for the owners' TP matrices. Initializes and destroys the default process group.
    ``progress(phase)``, if given, is called as each phase starts."""
    say = progress or (lambda phase: None)
    if steps < 0:
        raise ValueError(f"matrixfsdp.dryrun: steps must be >= 0 (0: planning and sharding only), got {steps}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .._fully_shard import fully_shard
    from .._replicate import replicate
    from ..planner.owner_plan import fsdp2_held_bytes
    from ..planner.owners import plan_owners
    from .peak import PeakMemory, storage_bytes

    if dist.is_initialized():
        raise ValueError("matrixfsdp.dryrun: a process group is already initialized in this process; "
                         "run the dry run in a process of its own (python -m matrixfsdp.dryrun)")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        hsdp = replicas > 1
        if tp > 1:
            mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp_shard", "tp"))
        elif hsdp:
            mesh = init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("dp_replicate", "dp_shard"))
        else:
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        seconds: dict[str, float] = {}
        with torch.device("meta"):
            model, layer_types, vocab = build()
        share = tensor_parallel(model, mesh["tp"]) if tp > 1 else {}
        dp_mesh = mesh["dp_shard"] if tp > 1 else mesh
        say("planning")
        t = time.perf_counter()
        plan = plan_owners(model, mesh, block_types=layer_types, **(plan_kwargs or {}))
        seconds["plan"] = time.perf_counter() - t
        if front_end == "replicate":
            # replicate keeps every parameter whole on every rank: it wraps a materialized model
            model.to_empty(device="cpu")
        say("sharding")
        t = time.perf_counter()
        if front_end == "fully_shard":
            for m in list(model.modules()):
                if isinstance(m, layer_types):
                    fully_shard(m, mesh=dp_mesh, plan=plan)
            fully_shard(model, mesh=dp_mesh, plan=plan)
        else:
            model = replicate(model, mesh=mesh, plan=plan)
        seconds["shard"] = time.perf_counter() - t
        say("to_empty")
        t = time.perf_counter()
        if front_end == "fully_shard":
            model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                getattr(p, "_local_tensor", p).normal_(0.0, 0.02)
            for b in model.buffers():
                b.zero_()
        seconds["to_empty"] = time.perf_counter() - t
        counters = _counters(model, front_end, hsdp)
        _take(counters)
        opt = _optimizer(optimizer, model, ns_steps)
        tokens = torch.randint(0, vocab, (1, seq_len))
        comm: dict[str, dict[str, dict[str, int]]] = {}
        grad_bytes = 0

        def live() -> int:  # what the allocator holds for the model, its gradients and optimizer state
            return storage_bytes([*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(),
                                  *(v for st in opt.state.values() for v in st.values()
                                    if isinstance(v, torch.Tensor)), tokens])

        tracker = PeakMemory(live)
        with tracker:
            for i in range(steps):  # the last step's figures: the first has no parameter exchange
                say(f"step {i + 1}/{steps}")
                comm = {}
                t = time.perf_counter()
                out = model(tokens)
                loss = (out.logits if hasattr(out, "logits") else out).float().mean()
                seconds["forward"] = time.perf_counter() - t
                comm["forward"] = _take(counters)
                t = time.perf_counter()
                loss.backward()
                seconds["backward"] = time.perf_counter() - t
                comm["backward"] = _take(counters)
                grad_bytes = sum(_local_nbytes(p.grad) for p in model.parameters())
                t = time.perf_counter()
                opt.step()
                seconds["step"] = time.perf_counter() - t
                comm["step"] = _take(counters)
                opt.zero_grad()
        peak = tracker.peak_bytes if steps else live()
        shard = rank // tp if tp > 1 else rank % (world_size // replicas)
        stats = plan.rank_stats
        # FSDP2's even shares: of the whole tensors, or with TP of each TP rank's shards
        total_bytes = sum(p.nbytes * share.get(p.fqn, 1.0) for p in plan.params)
        total_state = sum(p.state_nbytes * share.get(p.fqn, 1.0) for p in plan.params)
        return RankReport(
            model=name, front_end=front_end, world_size=world_size, replicas=replicas, rank=rank, role=role,
            param_bytes=sum(_local_nbytes(p) for p in model.parameters()), grad_bytes=grad_bytes,
            state_bytes=_state_nbytes(opt), even_param_bytes=total_bytes / plan.world_size,
            planned_param_bytes=stats[shard].nbytes, planned_state_bytes=stats[shard].state_nbytes,
            planned_state_even=total_state / plan.world_size, peak_bytes=peak, comm=comm, seconds=seconds, tp=tp,
            fsdp2_peak_bytes=0.0 if tp > 1 else max(fsdp2_held_bytes(plan.params, plan.world_size)),
        )
    finally:
        dist.destroy_process_group()
