"""Expert stacks as outside code meets them: torch's own tensor APIs on a sharded MoE model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _moe import MoEConfig, MoEModel, moe_batch, shard


def foreach_over_expert_stacks() -> float:
    """``torch._foreach_mul_`` over the gradients of one experts module's stacks (w1, w2, w3: each
    an expert stack of the same E, but planned with other counts per rank)."""
    from matrixfsdp import full_tensor

    W = dist.get_world_size()
    cfg = MoEConfig(experts=5)
    model = MoEModel(cfg)
    mesh = init_device_mesh("cpu", (W,))
    shard(model, mesh)
    model.loss(*moe_batch(cfg, 0, 4)).backward()
    grads = [p.grad for p in model.blocks[0].mlp.experts.parameters()]
    before = [full_tensor(g).clone() for g in grads]
    torch._foreach_mul_(grads, 0.5)  # element-wise per list index: each stack with its own layout
    return max((full_tensor(g) - b * 0.5).abs().max().item() for g, b in zip(grads, before))


def test_foreach_over_stacks_of_other_counts():
    res = get_pool(2).run(foreach_over_expert_stacks, timeout=120)
    assert res == [0.0, 0.0]


def foreach_out_of_place_and_scalars() -> list:
    """An out-of-place foreach op over stacks of other counts gives each result its own stack's
    rows; a 0-dim replicated DTensor (a broadcast scalar) mixes with a stack; a stack with a plain
    row-sharded DTensor of another layout is refused."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from matrixfsdp.placement.experts import expert_rows

    W = dist.get_world_size()
    cfg = MoEConfig(experts=5)
    model = MoEModel(cfg)
    mesh = init_device_mesh("cpu", (W,))
    shard(model, mesh)
    stacks = list(model.blocks[0].mlp.experts.parameters())
    outs = torch._foreach_add(stacks, 1.0)
    same = [expert_rows(o) == expert_rows(p) for o, p in zip(outs, stacks)]
    coef = distribute_tensor(torch.tensor(0.5), mesh, [Replicate()])
    scaled = stacks[0].detach() * coef
    other = distribute_tensor(torch.zeros(stacks[0].shape), mesh, [Shard(0)])
    try:
        stacks[0].detach() + other
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    return [same, expert_rows(scaled) == expert_rows(stacks[0]), refused]


def test_foreach_out_of_place_and_scalars():
    for same, scaled, refused in get_pool(2).run(foreach_out_of_place_and_scalars, timeout=120):
        assert all(same) and scaled
        assert "mixes an expert stack (rows" in refused and "with a DTensor of another row layout" in refused, refused
