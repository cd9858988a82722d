"""The matrix rules on expert stacks, one process: each expert matrix stepped exactly as a 2-D
parameter of its own (see [Note: expert optimizer state] in optim/_expert_step.py).

The reference is what a user writes without stacks: every expert matrix (gate and up apart for a
fused stack) its own 2-D ``nn.Parameter``, stepped by ``matrixfsdp.optim`` on 2-D parameters
(bitwise ``torch.optim.Muon`` with bf16 Newton-Schulz, tests/optim/test_muon.py) and by
``torch.optim.Muon`` itself.
"""

from __future__ import annotations

import pytest
import torch

from _moe import expert_matrices

from matrixfsdp.optim import SOAP, Muon, Shampoo

E, ROWS, COLS = 5, 16, 8


def _stack_and_reference(splits: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    stack = torch.nn.Parameter(torch.randn(E, ROWS, COLS, generator=g))
    mats = {k: torch.nn.Parameter(v.detach().clone()) for k, v in expert_matrices("w", stack, splits).items()}
    return stack, mats


def _grads(stack, mats, splits, step):
    g = torch.Generator().manual_seed(100 + step)
    stack.grad = torch.randn(E, ROWS, COLS, generator=g)
    for k, v in expert_matrices("w", stack.grad, splits).items():
        mats[k].grad = v.clone()


def _same(stack, mats, splits) -> float:
    return max((v.detach() - mats[k].detach()).abs().max().item()
               for k, v in expert_matrices("w", stack, splits).items())


OPTS = {
    "muon_fp32": lambda ps, **kw: Muon(ps, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, **kw),
    "muon_match_rms": lambda ps, **kw: Muon(ps, lr=0.02, ns_dtype=torch.float32, adjust_lr_fn="match_rms_adamw",
                                            nesterov=False, **kw),
    "shampoo": lambda ps, **kw: Shampoo(ps, lr=0.01, precondition_frequency=2, start_preconditioning_step=2, **kw),
    "soap": lambda ps, **kw: SOAP(ps, lr=0.01, precondition_frequency=2, **kw),
}


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("name", list(OPTS))
def test_stack_is_bitwise_per_expert_2d(name, splits):
    stack, mats = _stack_and_reference(splits)
    opt = OPTS[name]([dict(params=[stack], experts=splits)])
    ref = OPTS[name](list(mats.values()))
    for step in range(4):
        _grads(stack, mats, splits, step)
        opt.step()
        ref.step()
        assert _same(stack, mats, splits) == 0.0, (name, splits, step)
    # per-expert state: one row per matrix, equal to each 2-D parameter's state
    for key, value in opt.state[stack].items():
        if not isinstance(value, torch.Tensor):
            continue
        assert value.shape[0] == E * splits, (key, tuple(value.shape))
        for i, p in enumerate(mats.values()):
            assert torch.equal(value[i], ref.state[p][key]), (key, i)


def test_odd_shapes_within_rounding():
    """On this CPU torch.bmm equals torch.mm bitwise for most shapes, not for all (6 x 8 matrices
    differ in the last bit): there the batched step is within float32 rounding of per-expert."""
    g = torch.Generator().manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(E, 12, 8, generator=g))
    mats = {k: torch.nn.Parameter(v.detach().clone()) for k, v in expert_matrices("w", stack, 2).items()}
    opt = OPTS["muon_fp32"]([dict(params=[stack], experts=2)])
    ref = OPTS["muon_fp32"](list(mats.values()))
    stack.grad = torch.randn(E, 12, 8, generator=g)
    for k, v in expert_matrices("w", stack.grad, 2).items():
        mats[k].grad = v.clone()
    opt.step()
    ref.step()
    assert _same(stack, mats, 2) <= 1e-6


def test_stack_against_torch_muon_bf16():
    """torch.optim.Muon orthogonalizes in bf16 only: within bf16 rounding of it (bitwise where
    the batched bf16 GEMM equals the GEMM; not on every shape on this CPU)."""
    stack, mats = _stack_and_reference(2)
    opt = Muon([dict(params=[stack], experts=2)], lr=0.02, weight_decay=0.1)
    ref = torch.optim.Muon(list(mats.values()), lr=0.02, weight_decay=0.1)
    for step in range(3):
        _grads(stack, mats, 2, step)
        opt.step()
        ref.step()
    assert _same(stack, mats, 2) <= 2e-3


def test_batched_newton_schulz_is_chunked_and_bitwise(monkeypatch):
    """Chunks of bounded bytes give the same bits as one batch (and as each matrix alone)."""
    import matrixfsdp.optim._expert_step as experts

    stack, mats = _stack_and_reference(1)
    chunked = torch.nn.Parameter(stack.detach().clone())
    opt = OPTS["muon_fp32"]([dict(params=[stack], experts=1)])
    small = OPTS["muon_fp32"]([dict(params=[chunked], experts=1)])
    _grads(stack, mats, 1, 0)
    chunked.grad = stack.grad.clone()
    opt.step()
    per = (ROWS * COLS * 2 + 2 * COLS * COLS) * 4
    monkeypatch.setattr(experts, "NS_CHUNK_BYTES_CPU", 2 * per)  # chunks of 2 matrices
    assert [s.stop - s.start for s in experts.ns_chunks(E, ROWS, COLS, torch.float32, torch.device("cpu"))] == [2, 2, 1]
    assert [s.stop - s.start for s in experts.ns_chunks(E, ROWS, COLS, torch.float32)] == [5]  # accelerators: 64 MiB
    small.step()
    assert torch.equal(stack, chunked)


def test_capturable_and_compiled_with_scheduler():
    """capturable=True with a tensor lr under torch.compile and an LR scheduler: the stack steps
    as the eager per-expert reference with the same schedule."""
    stack, mats = _stack_and_reference(1)
    opt = Muon([dict(params=[stack], experts=1)], lr=torch.tensor(0.02), ns_dtype=torch.float32, capturable=True)
    ref = Muon(list(mats.values()), lr=0.02, ns_dtype=torch.float32)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 1 / (1 + s))
    # aot_eager: dynamo and AOTAutograd trace the stack's capturable step as inductor's front end
    # does, without inductor's C++ code generation (~30 s on a 2-core box with a cold cache);
    # inductor's numerics of the batched (3-D) Newton-Schulz are test_step_modes.py's muon-batched
    step = torch.compile(opt.step, backend="aot_eager")
    for i in range(3):
        _grads(stack, mats, 1, i)
        step()
        ref.step()
        sched.step()
        ref_sched.step()
    assert _same(stack, mats, 1) <= 1e-6


def test_state_dict_records_layout_and_refuses_another():
    stack, _ = _stack_and_reference(2)
    opt = OPTS["muon_fp32"]([dict(params=[stack], experts=2)])
    _grads(stack, {k: torch.nn.Parameter(v) for k, v in expert_matrices("w", torch.zeros(E, ROWS, COLS), 2).items()},
           2, 0)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["routes"] == ["muon:experts/2"]
    assert tuple(sd["state"][0]["momentum_buffer"].shape) == (E * 2, ROWS // 2, COLS)
    again = OPTS["muon_fp32"]([dict(params=[stack], experts=2)])
    again.load_state_dict(sd)
    assert torch.equal(again.state[stack]["momentum_buffer"], opt.state[stack]["momentum_buffer"])
    other = OPTS["muon_fp32"]([dict(params=[stack], experts=1)])
    with pytest.raises(ValueError, match=r"saved 'muon:experts/2', now 'muon:experts/1'"):
        other.load_state_dict(sd)
