"""Expert stacks under a matrix rule: each expert's matrices stepped as independent matrices.

[Note: expert optimizer state]
A matrix rule treats an expert stack ``[n, out, in]`` (this rank's ``n`` whole experts; all ``E``
on a plain model) with ``splits`` matrices per expert as ``m = n * splits`` independent
``[out / splits, in]`` matrices, in expert order and, within an expert, in row order
(:func:`matrices`: a view, no copy). Each matrix gets exactly the state, update, shape-based lr
and weight decay of the rule on a 2-D parameter of its shape, as ``torch.optim.Muon`` gives ``E``
separate parameters. The state of the stack is that per-matrix state stacked on a new leading
dim: every state tensor has ``m`` rows, one per matrix (Muon's momentum ``[m, out/splits, in]``,
Shampoo's factors ``[m, out/splits, out/splits]``, step counters ``[m]``). So a state dict holds
per-expert state whose layout is the parameter's (the stack's rows times ``splits``), and DCP
reshards it with the experts (``optim/state_dict.py``). The param group records the layout of
each parameter (``"routes"``: ``"<rule>:experts/<splits>"``), checked at load.

The step is batched where the rule allows: Muon runs its element-wise ops once over the stack and
its Newton-Schulz on chunks of at most :data:`NS_CHUNK_BYTES` of matrices (``bmm``/``baddbmm``;
on the CPU :data:`NS_CHUNK_BYTES_CPU`, a core's cache, so large matrices go one by one);
on a backend whose batched GEMM equals its GEMM (this CPU: ``torch.bmm`` equals ``torch.mm``
bitwise in float32) that is bitwise the per-matrix step. Shampoo and SOAP step the matrices one by
one through their 2-D rule (:func:`loop_step`), on views of the stacked state. The rules' stack
steps (``step_stack``, and ``update``/``prepare``/``finish`` with ``splits``; [Note: update rules
as classes] in ``optim/rules/base.py``) take the matrices per slice as an argument, so a stack of
one (a 2-D tensor) split into ``splits`` matrices is stepped alike.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["matrices", "init_stacked", "loop_step", "ns_chunks", "NS_CHUNK_BYTES", "NS_CHUNK_BYTES_CPU", "route_name"]

#: The most bytes of one Newton-Schulz batch of an expert stack or of a batched Muon group's
#: same-shape matrices ([Note: batched Muon] in ``optim/rules/muon.py``: its ``ns_dtype`` copy and the
#: Gram products); a stack larger than that is orthogonalized in chunks. On accelerators batching
#: saves kernel launches, so the bound is memory; on the CPU a batch gains only while it stays in a
#: core's cache (measured on an AMD EPYC, one thread: 16 experts of 64 x 32 batched 2.6x faster
#: than one by one, of 128 x 64 1.2x, of 512 x 256 0.93x, i.e. slower), hence the CPU's bound.
NS_CHUNK_BYTES = 64 * 2**20
NS_CHUNK_BYTES_CPU = 2**20


def route_name(rule: str, splits: int) -> str:
    """The route a state dict records for an expert stack under ``rule``."""
    return f"{rule}:experts/{splits}"


def matrices(t: Tensor, splits: int) -> Tensor:
    """``t`` (``[n, out, in]``; a 2-D ``[out, in]`` is a stack of one) as its ``n * splits``
    matrices ``[n * splits, out / splits, in]``, a view (the stack's local tensor and its gradient
    are contiguous)."""
    if t.ndim == 2:
        t = t.unsqueeze(0)
    n, rows, cols = t.shape
    return t.view(n * splits, rows // splits, cols)


def init_stacked(init_one: Callable[[Tensor], dict[str, Any]], mats: Tensor) -> dict[str, Any]:
    """The state a first step of the stack ``mats`` starts from: the 2-D rule's initial state of
    one matrix (it reads only shape, dtype and device), repeated for each of the ``m`` matrices."""
    m = mats.shape[0]
    one = init_one(mats.new_empty(tuple(mats.shape[1:])) if mats.device.type != "meta" else mats[0])
    return {k: v.unsqueeze(0).expand(m, *v.shape).clone() if isinstance(v, Tensor) else v for k, v in one.items()}


def loop_step(step_one: Callable[[Tensor, Tensor, dict[str, Any]], None], mats: Tensor, grads: Tensor,
              state: dict[str, Any]) -> None:
    """Step each matrix of ``mats`` with the 2-D rule ``step_one(param, grad, state)`` on views of
    the stacked ``state``; an entry the rule replaces (or creates) is written back to its row."""
    m = mats.shape[0]
    for i in range(m):
        views = {k: v[i] for k, v in state.items() if isinstance(v, Tensor) and v.ndim >= 1 and v.shape[0] == m}
        sub: dict[str, Any] = {**{k: v for k, v in state.items() if k not in views}, **views}
        step_one(mats[i], grads[i], sub)
        for k, v in sub.items():
            if not isinstance(v, Tensor):
                state[k] = v
            elif k not in state or not isinstance(state[k], Tensor) or state[k].shape[1:] != v.shape or (
                    state[k].shape[0] != m):
                if i != 0:
                    raise RuntimeError(f"matrixfsdp: the 2-D rule created state {k!r} for expert matrix {i} "
                                       "but not for matrix 0; expert matrices must step alike")
                state[k] = v.new_empty((m, *v.shape))
                state[k][0].copy_(v)
            elif v is not views.get(k):
                state[k][i].copy_(v)


def ns_chunks(m: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device | None = None) -> list[slice]:
    """Slices of ``m`` matrices ``[rows, cols]`` whose Newton-Schulz batch stays within
    :data:`NS_CHUNK_BYTES` (:data:`NS_CHUNK_BYTES_CPU` on the CPU; the ``dtype`` copy plus two
    Gram matrices of the smaller side)."""
    small = min(rows, cols)
    per = (rows * cols * 2 + 2 * small * small) * torch.empty((), dtype=dtype).element_size()
    budget = NS_CHUNK_BYTES_CPU if device is not None and device.type == "cpu" else NS_CHUNK_BYTES
    size = max(1, budget // max(per, 1))
    return [slice(i, min(i + size, m)) for i in range(0, m, size)]
