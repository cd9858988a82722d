"""Minimal reproduction: inductor bakes an automatically-dynamic Python float into a kernel.

Found while compiling ``Optimizer.step`` under an LR scheduler (matrixfsdp issue 19). With a
Python-float learning rate that changes between calls, dynamo recompiles once and then treats the
float as dynamic (a ``SymFloat`` read from a 0-dim float64 input). When that same float is used
both as a tensor operand (``p * lr``, e.g. weight decay ``p.mul_(1 - lr * wd)``) and as the
``alpha`` of ``torch.add`` (e.g. ``p.add_(update, alpha=-lr)``), the inductor kernel reads the
first use from the input but emits the second as the constant seen when the dynamic graph was
traced, with no guard. Every later call silently uses that stale ``alpha``. ``aot_eager`` is
correct, so the fault is in inductor's lowering/codegen. Seen on CPU with torch 2.13; the same family as
pytorch/pytorch#194976 (stale dynamic float in ``clamp``).

``torch.optim.Muon`` (weight decay and ``add_(alpha=-adjusted_lr)``) hits it under
``torch.compile(opt.step)`` + ``LambdaLR``; ``torch.optim.AdamW`` does not (its float-lr path
recompiles instead). Immune: a 0-dim tensor learning rate (no SymFloat reaches ``alpha``), or
``torch._dynamo.config.specialize_float = True`` (recompiles every step), or ``backend="aot_eager"``.

A second, independent dynamo behaviour met while making the step capturable (``optimizer_attr``
below): inside ``torch.compile(opt.step)`` an assignment to an int attribute of a
``torch.optim.Optimizer`` (``self.k += 1``) is silently dropped, while the same update of a dict
entry (``self.box["k"] += 1``) and of an attribute of a plain object are kept. matrixfsdp keeps
its host step count in a dict for this reason.

Run: ``python benchmarks/repro/compile_muon_lr.py`` (CPU, about a minute). Exit status 1 while
the first bug is present, 0 once torch fixes it.
"""

from __future__ import annotations

import sys

import torch


def f(p: torch.Tensor, o: torch.Tensor, lr: float) -> torch.Tensor:
    return torch.add(p * lr, o, alpha=lr)


def minimal(backend: str, **config: bool) -> list[float]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    p, o = torch.randn(8, 8), torch.randn(8, 8)
    with torch._dynamo.config.patch(**config):
        cf = torch.compile(f, backend=backend)
        return [(f(p, o, lr) - cf(p, o, lr)).abs().max().item() for lr in (0.5, 0.25, 0.125, 0.0625)]


def torch_muon(lr_tensor: bool) -> list[float]:
    """Relative distance of compiled from eager ``torch.optim.Muon`` parameters per step."""
    grads = [[torch.randn(64, 64, generator=torch.Generator().manual_seed(10 * s + i)) for i in range(2)]
             for s in range(4)]

    def run(compiled: bool) -> list[list[torch.Tensor]]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(2)]
        opt = torch.optim.Muon(ps, lr=torch.tensor(0.02) if lr_tensor else 0.02, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        step = torch.compile(opt.step) if compiled else opt.step
        out = []
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            step()
            sched.step()
            out.append([p.detach().clone() for p in ps])
        return out

    eager, comp = run(False), run(True)
    return [max(((a - b).norm() / a.norm()).item() for a, b in zip(e, c)) for e, c in zip(eager, comp)]


class _Counting(torch.optim.Optimizer):
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})
        self.k = 0
        self.box = {"k": 0}

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        self.k += 1
        self.box["k"] += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-0.1)


def optimizer_attr() -> tuple[int, int]:
    """``(self.k, self.box["k"])`` after three compiled steps (eager: ``(3, 3)``)."""
    torch._dynamo.reset()
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = _Counting([p])
    step = torch.compile(opt.step)
    for _ in range(3):
        step()
    return opt.k, opt.box["k"]


def main() -> int:
    print(f"torch {torch.__version__}")
    rows = {
        "inductor, add(p * lr, o, alpha=lr)": minimal("inductor"),
        "aot_eager": minimal("aot_eager"),
        "inductor, specialize_float=True": minimal("inductor", specialize_float=True),
    }
    for name, diffs in rows.items():
        print(f"{name:40s} max|eager - compiled| per call: " + " ".join(f"{d:.1e}" for d in diffs))
    muon_float = torch_muon(lr_tensor=False)
    print("torch.optim.Muon, float lr + LambdaLR: relative param distance per step: "
          + " ".join(f"{d:.1e}" for d in muon_float))
    try:
        muon_tensor = torch_muon(lr_tensor=True)
        print("torch.optim.Muon, tensor lr + LambdaLR: relative param distance per step: "
              + " ".join(f"{d:.1e}" for d in muon_tensor))
    except Exception as e:  # torch's Muon may reject a tensor lr; the minimal repro is the point
        print(f"torch.optim.Muon with a tensor lr: {type(e).__name__}: {e}")
    k, box = optimizer_attr()
    print(f"Optimizer attribute after 3 compiled steps: self.k={k}, self.box['k']={box} (eager: 3, 3)")
    buggy = max(rows["inductor, add(p * lr, o, alpha=lr)"]) > 1e-3
    print("BUG PRESENT" if buggy else "fixed in this torch")
    return 1 if buggy else 0


if __name__ == "__main__":
    sys.exit(main())
