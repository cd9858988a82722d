"""Expert stacks as outside code meets them: torch's own tensor APIs on a sharded MoE model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _moe import MoEConfig, MoEModel, moe_batch


def foreach_over_expert_stacks() -> float:
    """``torch._foreach_mul_`` over the gradients of one experts module's stacks (w1, w2, w3: each
    an expert stack of the same E, but planned with other counts per rank)."""
    from matrixfsdp import fully_shard, full_tensor, plan_owners

    W = dist.get_world_size()
    cfg = MoEConfig(experts=5)
    model = MoEModel(cfg)
    mesh = init_device_mesh("cpu", (W,))
    plan = plan_owners(model, mesh, block_types=type(model.blocks[0]))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, plan=plan)
    fully_shard(model, mesh=mesh, plan=plan)
    model.loss(*moe_batch(cfg, 0, 4)).backward()
    grads = [p.grad for p in model.blocks[0].mlp.experts.parameters()]
    before = [full_tensor(g).clone() for g in grads]
    torch._foreach_mul_(grads, 0.5)  # element-wise per list index: each stack with its own layout
    return max((full_tensor(g) - b * 0.5).abs().max().item() for g, b in zip(grads, before))


@pytest.mark.xfail(strict=True, raises=Exception, reason=(
    "ExpertDTensor.__torch_dispatch__ checks every DTensor of a call against the first expert "
    "stack's rows, so a foreach op over stacks planned with different counts (w1 (3, 2), w2 (2, 3) "
    "at W=2, E=5) raises 'mixes an expert stack ... with a DTensor of another row layout', although "
    "a foreach op is element-wise per list index; the check (and the rewrap of outputs, which gives "
    "every output the first stack's rows) would have to be per index"))
def test_foreach_over_stacks_of_other_counts():
    res = get_pool(2).run(foreach_over_expert_stacks, timeout=120)
    assert res == [0.0, 0.0]
