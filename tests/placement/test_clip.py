"""``matrixfsdp.clip_grad_norm_``'s arithmetic (issue 29, item 2): ``torch._foreach_norm`` per
device and dtype with float32 accumulation, ``torch._foreach_mul_`` for the scaling, against
``torch.nn.utils.clip_grad_norm_`` and the earlier per-gradient float32 formula, and no float32
copy of a bf16 gradient at the dispatcher. Single process (plain parameters: the norm's
reduction over ranks is tested in tests/fully_shard/test_robustness.py)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import matrixfsdp


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [((64, 48), torch.bfloat16), ((48,), torch.float32), ((33, 17), torch.bfloat16),
              ((5, 7), torch.float32), ((0,), torch.bfloat16)]
    out = []
    for shape, dtype in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype))
        p.grad = (torch.randn(shape, generator=g) * 3).to(dtype)
        out.append(p)
    return out


def _earlier(params, norm_type):
    """The earlier formula: a float32 copy of every gradient, summed |g| ** p (or the max)."""
    gs = [p.grad for p in params if p.grad.numel()]
    if math.isinf(norm_type):
        return max(g.abs().max().float() for g in gs)
    return sum(g.float().abs().pow(norm_type).sum() for g in gs) ** (1.0 / norm_type)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
def test_clip_matches_torch_and_the_earlier_formula(norm_type):
    mine = _params()
    ref = [torch.nn.Parameter(p.detach().float()) for p in _params()]  # torch on the fp32 values
    for q, p in zip(ref, _params()):
        q.grad = p.grad.float()
    earlier = _earlier(mine, norm_type)
    total = matrixfsdp.clip_grad_norm_(mine, 0.5, norm_type)
    # (torch's own max norm refuses an empty gradient)
    ref_total = torch.nn.utils.clip_grad_norm_([q for q in ref if q.numel()], 0.5, norm_type, foreach=True)
    assert total.dtype == torch.float32 and total.shape == ()
    if math.isinf(norm_type):
        assert torch.equal(total, earlier)  # the max is exact in any dtype
    # a p-norm: each tensor's root is rounded once more than the earlier formula did (float32 ulps)
    assert abs(total.item() - earlier.item()) <= 1e-6 * earlier.item(), (total, earlier)
    assert abs(total.item() - ref_total.float().item()) <= 1e-6 * ref_total.item(), (total, ref_total)
    coef = min(1.0, 0.5 / (total.item() + 1e-6))
    assert coef < 1.0  # it clipped
    for p, q, fresh in zip(mine, ref, _params()):
        # scaled by the coefficient rounded to the gradient's dtype (as g.mul_(coef.to(dtype)) did)
        c = torch.clamp(0.5 / (total + 1e-6), max=1.0).to(p.grad.dtype)
        assert torch.equal(p.grad, fresh.grad * c), p.shape
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=1e-2 if p.dtype == torch.bfloat16 else 1e-5,
                                   atol=0)


class _Float32Allocs(TorchDispatchMode):
    """The aten ops that produce a float32 tensor of ``numel`` elements or more."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.seen = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() >= self.numel:
                self.seen.append(str(func))
        return out


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_no_float32_copy_of_a_bf16_gradient(norm_type):
    params = [p for p in _params() if p.dtype == torch.bfloat16 and p.numel()]
    smallest = min(p.numel() for p in params)
    with _Float32Allocs(smallest) as mode:
        matrixfsdp.clip_grad_norm_(params, 0.5, norm_type)
    assert mode.seen == [], mode.seen  # before (p-norms): aten._to_copy.default once per gradient
    with _Float32Allocs(smallest) as mode:  # the probe sees one when there is one
        _earlier(params, 2.0)
    assert "aten._to_copy.default" in mode.seen
