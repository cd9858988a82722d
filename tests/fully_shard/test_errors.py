"""Clear errors from matrixfsdp.fully_shard: messages are pinned with pytest.raises(match=...).

All cases run in one spawn (W=2); each builds a fresh model. Every rank executes the same calls
in the same order, so the one collective check (the plan digest exchange) stays in step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _models import TinyConfig, TinyDecoder, make_batch, make_plan
from fully_shard.test_features import TiedModel

from matrixfsdp.planner.owner_plan import OwnerPlan
from matrixfsdp._fully_shard import fully_shard


def _fresh(W, **plan_kw):
    model = TinyDecoder(TinyConfig(), seed=0)
    return model, make_plan(model, W, **plan_kw)


def _wrap_blocks(model, mesh, plan, blocks=None):
    for b in (model.blocks if blocks is None else blocks):
        fully_shard(b, mesh=mesh, plan=plan)


def check_errors() -> int:
    rank, W = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,))
    n = 0

    # --- argument types and unsupported keywords
    model, plan = _fresh(W)
    with pytest.raises(TypeError, match=r"matrixfsdp.fully_shard: plan must be None or a matrixfsdp OwnerPlan .* got dict"):
        fully_shard(model, mesh=mesh, plan={})
    with pytest.raises(TypeError, match=r"matrixfsdp.fully_shard: expects one nn.Module .* got list"):
        fully_shard([model.blocks[0]], mesh=mesh, plan=plan)
    with pytest.raises(ValueError, match=r"matrixfsdp.fully_shard: shard_placement_fn is not supported, placement comes from the plan"):
        fully_shard(model, mesh=mesh, plan=plan, shard_placement_fn=lambda p: None)
    n += 3

    # --- a 3-D mesh not named (dp_replicate, <shard>, tp) (HSDP x TP: tests/fully_shard/test_hsdp_tp.py)
    mesh3d = init_device_mesh("cpu", (1, 1, W), mesh_dim_names=("rep", "shard", "tp"))
    with pytest.raises(ValueError, match=r"matrixfsdp.fully_shard: a 3-D mesh must be HSDP x TP with its dimensions "
                                         r"named \('dp_replicate', 'dp_shard', 'tp'\) in this order .* this mesh of "
                                         r"shape \(1, 1, %d\) has dimension names \('rep', 'shard', 'tp'\)" % W):
        fully_shard(model.blocks[0], mesh=mesh3d, plan=plan)
    n += 1

    # --- plan for another world size
    model, plan_w = _fresh(W + 1)
    with pytest.raises(ValueError, match=r"matrixfsdp.fully_shard: the plan was built for world_size=%d but the mesh has %d ranks" % (W + 1, W)):
        fully_shard(model.blocks[0], mesh=mesh, plan=plan_w)
    n += 1

    # --- plans differ across ranks (digest exchange), raised on every rank
    model, plan_r = _fresh(W, owner_offset=rank)
    with pytest.raises(RuntimeError, match=r"matrixfsdp.fully_shard: the plan differs across ranks \(rank 0: [0-9a-f]{12}, rank 1: [0-9a-f]{12}"):
        fully_shard(model.blocks[0], mesh=mesh, plan=plan_r)
    n += 1

    # --- a parameter of the model missing from the plan
    model, plan = _fresh(W)
    dropped = OwnerPlan(**{**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.init},
                           "params": tuple(p for p in plan.params if p.fqn != "blocks.1.up.bias")})
    _wrap_blocks(model, mesh, dropped)
    with pytest.raises(ValueError, match=r"matrixfsdp.fully_shard: parameter 'blocks.1.up.bias' is not in the plan"):
        fully_shard(model, mesh=mesh, plan=dropped)
    n += 1

    # --- a plan whose shapes differ (built for another model)
    model = TinyDecoder(TinyConfig(), seed=0)
    other = make_plan(TinyDecoder(TinyConfig(hidden=128), seed=0), W)
    _wrap_blocks(model, mesh, other)
    with pytest.raises(ValueError, match=r"matrixfsdp.fully_shard: parameter 'blocks.0.up.weight' has shape \(160, 96\) but the plan says \(128, 96\)"):
        fully_shard(model, mesh=mesh, plan=other)
    n += 1

    # --- a plan with parameters the model lacks
    model = TinyDecoder(TinyConfig(), seed=0)
    bigger = TinyDecoder(TinyConfig(), seed=0)
    bigger.extra_head = nn.Linear(4, 4)
    plan_b = make_plan(bigger, W)
    _wrap_blocks(model, mesh, plan_b)
    with pytest.raises(ValueError, match=r"matrixfsdp.fully_shard: the plan has 2 parameter\(s\) the model lacks, e.g. 'extra_head.weight'"):
        fully_shard(model, mesh=mesh, plan=plan_b)
    n += 1

    # --- dtype mismatch
    model, plan_16 = _fresh(W, dtype="bfloat16")
    _wrap_blocks(model, mesh, plan_16)
    with pytest.raises(ValueError, match=r"matrixfsdp.fully_shard: parameter 'pos_emb' has dtype float32 but the plan says bfloat16"):
        fully_shard(model, mesh=mesh, plan=plan_16)
    n += 1

    # --- a planned block that was not wrapped (e.g. wrapping top-down)
    model, plan = _fresh(W)
    _wrap_blocks(model, mesh, plan, blocks=model.blocks[:2])
    with pytest.raises(ValueError, match=r"matrixfsdp.fully_shard: the plan has block 'blocks.2' but that module was not passed to matrixfsdp.fully_shard"):
        fully_shard(model, mesh=mesh, plan=plan)
    n += 1

    # --- a wrapped module that the plan does not know as a block
    model = TinyDecoder(TinyConfig(), seed=0)
    plan2 = make_plan(model, W, blocks=["blocks.0", "blocks.1"])
    _wrap_blocks(model, mesh, plan2)
    with pytest.raises(ValueError, match=r"matrixfsdp.fully_shard: fully_shard was applied to 'blocks.2' but the plan has no such block"):
        fully_shard(model, mesh=mesh, plan=plan2)
    n += 1

    # --- applied twice
    model, plan = _fresh(W)
    fully_shard(model.blocks[0], mesh=mesh, plan=plan)
    with pytest.raises(ValueError, match=r"matrixfsdp.fully_shard: already applied to this Block"):
        fully_shard(model.blocks[0], mesh=mesh, plan=plan)
    n += 1

    # --- forward before the planned model was wrapped
    model, plan = _fresh(W)
    _wrap_blocks(model, mesh, plan)
    with pytest.raises(RuntimeError, match=r"matrixfsdp.fully_shard: Block was registered but never resolved against its plan"):
        model.blocks[0](torch.randn(1, 8, 96))
    n += 1

    # --- parameters tied across two wrapped blocks
    tied = TiedModel()
    tied.blocks[1].a.weight = tied.blocks[0].a.weight
    plan_t = make_plan(tied, W)
    fully_shard(tied.blocks[0], mesh=mesh, plan=plan_t)
    with pytest.raises(ValueError, match=r"matrixfsdp.fully_shard: parameter 'a.weight' of TiedBlock is already managed by the fully_shard call on TiedBlock"):
        fully_shard(tied.blocks[1], mesh=mesh, plan=plan_t)
    n += 1

    # --- mixing with torch's fully_shard
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model, plan = _fresh(W)
    torch_fully_shard(model.blocks[0].up, mesh=mesh)  # (torch's FSDP2 rejects 0-dim params)
    torch_fully_shard(model.norm, mesh=mesh)
    with pytest.raises(RuntimeError, match=r"matrixfsdp.fully_shard: the module \(FSDPLayerNorm\) is already managed by torch's torch.distributed.fsdp.fully_shard"):
        fully_shard(model.norm, mesh=mesh, plan=plan)
    with pytest.raises(RuntimeError, match=r"matrixfsdp.fully_shard: submodule 'up' \(FSDPLinear\) is already managed by torch's"):
        fully_shard(model.blocks[0], mesh=mesh, plan=plan)
    _wrap_blocks(model, mesh, plan, blocks=model.blocks[1:])
    with pytest.raises(RuntimeError, match=r"matrixfsdp.fully_shard: submodule 'blocks.0.up' \(FSDPLinear\) is already managed by torch's"):
        fully_shard(model, mesh=mesh, plan=plan)
    n += 3

    # torch's fully_shard applied after ours: torch refuses our DTensor parameters on its own
    # (an obscure TypeError in 2.13); a torch-wrapped module added later is caught at the first
    # forward
    model, plan = _fresh(W)
    _wrap_blocks(model, mesh, plan)
    fully_shard(model, mesh=mesh, plan=plan)
    with pytest.raises(Exception):
        torch_fully_shard(model.norm, mesh=mesh)
    model.late = torch_fully_shard(nn.Linear(4, 4), mesh=mesh)
    x, y = make_batch(TinyConfig(), 0, 2)
    with pytest.raises(RuntimeError, match=r"matrixfsdp.fully_shard: submodule 'late' \(FSDPLinear\) is already managed by torch's"):
        model.loss(x, y)
    n += 2
    return n


def test_error_messages():
    counts = get_pool(2).run(check_errors)
    assert counts == [counts[0]] * 2 and counts[0] >= 17
