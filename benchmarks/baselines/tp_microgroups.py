"""matrixfsdp's TP step: each TP-sharded matrix stepped whole on one host, fused all-to-alls per
micro-group (``tp_microgroups``, and the ``tp_sequential`` / ``tp_unfused`` /
``tp_unfused_lpt`` variants of :func:`tp_hosted` and :class:`TPUnfusedLPT`).
"""

from __future__ import annotations

from typing import Any

import torch

from matrixfsdp import DecoderLayer
from matrixfsdp.optim import Muon

from .core import Impl, imbalance, ns_flops
from .tp import TPImpl, tp_composed
from .zero1_owner import lpt_owners


class TPMicroGroups(TPImpl):
    """``matrixfsdp.tp.host_matrices`` + ``matrixfsdp.optim.Muon(model)``: each TP-sharded matrix
    stepped whole on one host, two fused all-to-alls per micro-group.

    At dp > 1: ``matrixfsdp.plan_owners(model, mesh)`` on the ``("dp_shard", "tp")`` mesh and
    ``matrixfsdp.fully_shard(..., mesh=mesh["dp_shard"])`` per DecoderLayer + root instead: owners
    are whole matrices per dp rank, the owner's TP row hosts each matrix's step (the plan's
    micro-groups; ``per_matrix``: ``tp_c_max=1``, one group per matrix), other rows idle."""

    name = "tp_microgroups"
    pipeline = True
    per_matrix = False  # True: one micro-group per matrix (unfused); dp=1: hosts by LPT
    lpt_hosts = False  # dp > 1: re-assign the plan's hosts by LPT (lpt_hosted_plan)

    def wrap_dp(self, mesh2: Any) -> None:
        import matrixfsdp

        kw = {"tp_c_max": 1} if self.per_matrix else {}
        plan = matrixfsdp.plan_owners(self.model, mesh2, block_types=(DecoderLayer,), **kw)
        if self.lpt_hosts:
            plan = lpt_hosted_plan(plan)
        dpm = mesh2["dp_shard"]
        for layer in self.model.model.layers:
            matrixfsdp.fully_shard(layer, mesh=dpm, plan=plan)
        matrixfsdp.fully_shard(self.model, mesh=dpm, plan=plan)
        if not self.pipeline:
            matrixfsdp.tp.set_pipeline(self.model, False)
        self.plan = plan
        dp, tp = mesh2.shape
        ranks = mesh2.mesh.tolist()
        load = [0.0] * (dp * tp)
        shapes = {pp.fqn: pp.shape for pp in plan.params}
        for s, groups in enumerate(plan.micro_groups):
            for g in groups:
                for f, h in g.members:
                    load[ranks[s][h]] += ns_flops(torch.Size(shapes[f]))
        self.balance = imbalance(load)
        self.micro_groups_per_row = [len(gs) for gs in plan.micro_groups]
        self.micro_groups = sum(self.micro_groups_per_row)
        self.notes.append(f"matrixfsdp.plan_owners(model, ({dp}, {tp}) mesh, block_types=(DecoderLayer,)"
                          + (", tp_c_max=1" if self.per_matrix else "") + ")"
                          + ("; hosts re-assigned by LPT over each owner row's groups (lpt_hosted_plan)" if self.lpt_hosts else "")
                          + f" digest={getattr(plan, 'digest', '?')}; "
                          f"matrixfsdp.fully_shard per DecoderLayer + root on mesh['dp_shard']"
                          + ("; matrixfsdp.tp.set_pipeline(model, False)" if not self.pipeline else "")
                          + f": micro-groups per owner row {self.micro_groups_per_row} (sizes "
                          f"{[[len(g.members) for g in gs] for gs in plan.micro_groups]}); host balance over the "
                          f"{dp * tp} ranks (max/mean NS FLOPs) {self.balance:.3f}")

    def make_opt(self, mesh: Any) -> torch.optim.Optimizer:
        import matrixfsdp

        if self.composed:
            return Muon(self.model, **self.cfg.muon_kwargs())
        groups = None
        if self.per_matrix:
            named = [(f, self.model.get_parameter(f)) for f in self.tp_fqns]
            host = lpt_owners(named, mesh.size())
            groups = [[(f, host[f])] for f in self.tp_fqns]
        wanted = set(self.tp_fqns)  # the benchmark's rule (every TP-split matrix), not a vocab-size heuristic
        used = matrixfsdp.tp.host_matrices(self.model, mesh, groups=groups, pipeline=self.pipeline,
                                           matrix_filter=lambda fqn, *_: fqn in wanted)
        self.executor = matrixfsdp.tp.tp_host_of(self.model.get_parameter(self.tp_fqns[0])).executor
        load = [0.0] * mesh.size()
        for g in used:
            for f, h in g:
                load[h] += ns_flops(self.model.get_parameter(f).shape)
        self.balance = imbalance(load)
        self.micro_groups = len(used)
        self.notes.append(f"host_matrices({'one group per matrix, LPT hosts' if self.per_matrix else 'planner groups'}, "
                          f"pipeline={self.pipeline}): {len(used)} micro-groups of sizes {[len(g) for g in used]}; "
                          f"host balance (max/mean NS FLOPs) {self.balance:.3f}")
        return Muon(self.model, **self.cfg.muon_kwargs())


def lpt_hosted_plan(plan: Any) -> Any:
    """``plan`` with each owner row's hosts re-assigned by LPT on Newton-Schulz FLOPs over all of
    its micro-groups (in execution order; ties to the lowest TP rank); groups, their order and
    members unchanged. For ``tp_c_max=1`` plans, whose one-matrix groups all take TP rank 0 (a
    fresh group's first host): the per-matrix all-to-alls with the hosts balanced as at dp=1's
    ``tp_unfused``. An ``OwnerPlan`` is a validated record: ``dataclasses.replace`` re-checks it and
    recomputes its digest (the same on every rank)."""
    import dataclasses

    shapes = {pp.fqn: pp.shape for pp in plan.params}
    rows = []
    for groups in plan.micro_groups:
        load = [0.0] * plan.tp
        new = []
        for g in groups:
            members = []
            for f, _ in g.members:
                h = min(range(plan.tp), key=lambda i: (load[i], i))
                load[h] += ns_flops(torch.Size(shapes[f]))
                members.append((f, h))
            if len(members) > 1:
                raise ValueError("lpt_hosted_plan: for one-matrix micro-groups (tp_c_max=1) only")
            new.append(dataclasses.replace(g, members=tuple(members)))
        rows.append(tuple(new))
    return dataclasses.replace(plan, micro_groups=tuple(rows))


def tp_hosted(name: str, pipeline: bool, per_matrix: bool, lpt_hosts: bool = False) -> type[Impl]:
    return type(f"TPMicroGroups_{name}", (TPMicroGroups,), {"name": name, "pipeline": pipeline, "per_matrix": per_matrix,
                                                            "lpt_hosts": lpt_hosts})


class TPUnfusedLPT(TPMicroGroups):
    """dp > 1 only: ``tp_unfused`` (``tp_c_max=1``) with LPT-balanced hosts, isolating fusion from
    host balance (``tp_c_max=1`` alone hosts every matrix on TP rank 0 of its owner row)."""

    name = "tp_unfused_lpt"
    per_matrix = True
    lpt_hosts = True

    def setup(self) -> None:
        if not tp_composed(self.ctx):
            raise ValueError("tp_unfused_lpt runs at dp > 1 (--tp T --world dp*T); at dp=1 tp_unfused has LPT hosts")
        super().setup()
