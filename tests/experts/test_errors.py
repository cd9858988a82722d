"""Bad input around expert stacks: each a ValueError naming the parameter, the constraint and the
fix, raised on every rank alike (no rank left waiting in a collective)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from _harness import get_pool
from _moe import MoEConfig, MoEModel


def _raises(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def plan_from_other_expert_count() -> str:
    from matrixfsdp import fully_shard, plan_owners

    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,))
    plan = plan_owners(MoEModel(MoEConfig(experts=5)), mesh, block_types=type(MoEModel(MoEConfig()).blocks[0]))
    model = MoEModel(MoEConfig(experts=4))

    def go():
        for b in model.blocks:
            fully_shard(b, mesh=mesh, plan=plan)
        fully_shard(model, mesh=mesh, plan=plan)
    return _raises(go)


def test_plan_from_another_expert_count():
    res = get_pool(2).run(plan_from_other_expert_count, timeout=120)
    assert res[0] == res[1]
    # the router is the first parameter the checks meet; a stack says it is one (next test)
    assert res[0].startswith("ValueError: matrixfsdp.fully_shard: parameter 'blocks.0.mlp.gate.weight' has shape "
                             "(4, 32) but the plan says (5, 32); the plan was built for another model: plan this "
                             "one with matrixfsdp.plan_owners(model, mesh, ...)"), res[0]


def test_plan_entry_of_another_expert_count_names_the_stack():
    from matrixfsdp import plan_owners
    from matrixfsdp._fully_shard.init import _check_param

    plan = plan_owners(MoEModel(MoEConfig(experts=5)), 2, block_types=type(MoEModel(MoEConfig()).blocks[0]))
    w1 = MoEModel(MoEConfig(experts=4)).blocks[0].mlp.experts.w1
    with pytest.raises(ValueError, match=r"'blocks.0.mlp.experts.w1' has shape \(4, 24, 32\) but the plan says "
                                         r"\(5, 24, 32\) \(an expert stack planned for 5 experts, \(\d, \d\) per "
                                         r"shard rank\); the plan was built for another model"):
        _check_param("blocks.0.mlp.experts.w1", w1, plan, "blocks.0")


def expert_stack_already_sharded() -> str:
    from torch.distributed.tensor import Shard, distribute_tensor

    from matrixfsdp import plan_owners

    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,))
    model = MoEModel(MoEConfig(experts=4))
    w1 = model.blocks[0].mlp.experts.w1
    model.blocks[0].mlp.experts.w1 = torch.nn.Parameter(distribute_tensor(w1.detach(), mesh, [Shard(1)]))
    return _raises(lambda: plan_owners(model, mesh, block_types=type(model.blocks[0])))


def test_expert_stack_split_by_custom_sharding():
    res = get_pool(2).run(expert_stack_already_sharded, timeout=120)
    assert res[0] == res[1]
    assert res[0].startswith("ValueError: plan_owners: expert stack 'blocks.0.mlp.experts.w1' is a DTensor"), res[0]
    assert "MatrixRule(experts=False)" in res[0]


def test_optimizer_refuses_split_expert_rows():
    """A stack whose local tensor is not whole experts (a user's own sharding) under the matrix rule."""
    from matrixfsdp.optim import Muon

    class Split(torch.Tensor):
        pass

    p = torch.nn.Parameter(torch.zeros(4, 6, 3))
    opt = Muon([dict(params=[p], experts=1)])
    assert opt.param_groups[0]["experts"] == 1
    with pytest.raises(ValueError, match=r"steps a parameter of shape \(4, 6, 3\) as an expert stack with 4 "
                                         r"matrices per expert, .* fix the group's experts= value"):
        Muon([dict(params=[p], experts=4)])


def test_plan_owners_matrix_filter_3d_names_the_opt_in():
    from matrixfsdp import plan_owners

    conv = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3))
    with pytest.raises(ValueError, match=r"matrix_filter selected '0.weight', which is not 2D: got shape=\(4, 4, 3\); "
                                         r"a 3-D stack of expert matrices is selected by the rule instead: pass "
                                         r"matrix_rule=MatrixRule\(expert_stacks=\('0.weight',\)\)"):
        plan_owners(conv, 2, matrix_filter=lambda f, p: True)


def test_tp_plan_refuses_experts():
    from matrixfsdp import plan_owners

    model = MoEModel(MoEConfig(experts=4))
    with pytest.raises(ValueError, match=r"expert stack 'blocks.0.mlp.experts.w1' with tp=2: .* plan with tp=1, "
                                         r"or pass matrix_rule=MatrixRule\(experts=False\)"):
        plan_owners(model, 2, block_types=type(model.blocks[0]), tp=2)
