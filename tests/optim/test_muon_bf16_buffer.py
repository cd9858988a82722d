"""Muon's momentum buffer with a bfloat16 parameter and ``nesterov=False``, against
``torch.optim.Muon`` (docs/optimizers.md, "torch.optim.Muon with bfloat16 parameters and
nesterov=False").

Through torch 2.14, torch's Newton-Schulz casts with ``grad.bfloat16()``, which returns the tensor
itself for a bf16 input: with ``nesterov=False`` that is the momentum buffer, and its in-place
normalization leaves the buffer at unit Frobenius norm after every step. torch 2.15 copies
(``grad.to(torch.bfloat16, copy=True)``). matrixfsdp's Muon never writes its Newton-Schulz input: its
buffer is the plain EMA of the gradients on every release, and its steps are torch 2.15's.
"""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

from matrixfsdp.optim import Muon

#: torch releases whose Muon normalizes a bf16 momentum buffer in place (nesterov=False)
TORCH_ALIASES_BUFFER = TorchVersion(torch.__version__) < (2, 15)


def test_bf16_buffer_stays_the_gradient_ema():
    shape, momentum, eps = (16, 24), 0.9, 1e-7
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    ours, ref = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    kw = {"lr": 0.02, "momentum": momentum, "nesterov": False, "weight_decay": 0.1}
    opt, torch_opt = Muon([ours], **kw), torch.optim.Muon([ref], **kw)
    g = torch.Generator().manual_seed(1)
    ema = torch.zeros(shape, dtype=torch.bfloat16)
    aliased = torch.zeros(shape, dtype=torch.bfloat16)  # torch <= 2.14's buffer, written out
    for step in range(4):
        grad = torch.randn(shape, generator=g).bfloat16()
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        torch_opt.step()
        ema.lerp_(grad, 1 - momentum)
        aliased.lerp_(grad, 1 - momentum)
        aliased.div_(aliased.norm().clamp(min=eps))  # the normalization, in place on the buffer
        buf, torch_buf = opt.state[ours]["momentum_buffer"], torch_opt.state[ref]["momentum_buffer"]
        assert torch.equal(buf, ema)
        assert buf.float().norm() > 1.5  # (the gradients' scale: no normalization)
        if TORCH_ALIASES_BUFFER:
            assert torch.equal(torch_buf, aliased), "torch.optim.Muon no longer normalizes its buffer: update the docs"
            assert abs(float(torch_buf.float().norm()) - 1) < 1e-2
            # the first step orthogonalizes the same (normalized) input; later ones weigh the
            # history by 1 / ||B|| against the new gradient and move elsewhere
            assert torch.equal(ours, ref) == (step == 0)
        else:  # torch >= 2.15 copies: its Muon is ours, bit for bit
            assert torch.equal(torch_buf, ema)
            assert torch.equal(ours, ref)
