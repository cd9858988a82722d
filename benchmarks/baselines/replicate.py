"""matrixfsdp's ``replicate`` (ZeRO-2 on the planner's bucket partition): the ``replicate_*``
rows, one per placement policy (:func:`replicate_impl`).
"""

from __future__ import annotations

import torch

from matrixfsdp.optim import Muon

from .core import Impl, build_model, check_routes, imbalance, muon_cost, muon_param_groups


#: bucket size of the replicate rows (elements): ~5 buckets on the benchmark model, so the
#: reduce-scatters overlap backward and the all-gathers overlap forward
REPLICATE_BUCKET_NUMEL = 1_500_000


class MatrixReplicate(Impl):
    """``matrixfsdp.replicate`` (ZeRO-2 on the planner's bucket partition): DDP-style flat buckets,
    one uneven reduce-scatter per bucket in backward, a local step on this rank's parameters only,
    one all-gather per bucket issued at the next forward (so ``step`` makes no collective)."""

    policy, alpha = "alpha_balanced", 0.5

    def setup(self) -> None:
        import matrixfsdp

        model = build_model(self.cfg)
        plan = matrixfsdp.plan_owners(model, self.ctx.mesh, policy=self.policy, alpha=self.alpha,
                                      elementwise="owned", bucket_numel=REPLICATE_BUCKET_NUMEL)
        matrixfsdp.replicate(model, mesh=self.ctx.mesh, plan=plan, stage=2)
        self.model = model
        self.opts = [Muon(muon_param_groups(model.named_parameters()), **self.cfg.muon_kwargs())]
        self.notes.append(check_routes(self.opts[0], model.named_parameters()))
        named = self.named_parameters()
        load = [0.0] * self.world
        for (n, p), pp in zip(named, (plan[f] for f, _ in model.named_parameters())):
            load[pp.owner] += muon_cost(n, p)
        self.balance = imbalance(load)
        self.notes.append(f"plan_owners(policy={self.policy!r}, alpha={self.alpha}, elementwise='owned', "
                          f"bucket_numel={REPLICATE_BUCKET_NUMEL}) -> {len(dict(plan.meta)['buckets'])} buckets; "
                          f"replicate(stage=2); step balance (max/mean Muon FLOPs) {self.balance:.3f}")

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        # after step() only owners hold the new values until the next forward's all-gathers;
        # anything that reads parameters in between finishes them first (as state_dict() does)
        self.model.sync_params()
        return super().named_parameters()


def replicate_impl(name: str, policy: str, alpha: float) -> type[Impl]:
    return type(f"MatrixReplicate_{name}", (MatrixReplicate,), {"name": name, "policy": policy, "alpha": alpha})
