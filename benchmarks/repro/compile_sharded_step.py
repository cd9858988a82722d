"""Minimal reproductions: the two torch 2.13 behaviours that kept ``torch.compile(opt.step)`` of a
matrixfsdp optimizer from working on a sharded model (matrixfsdp issue 19), both worked around.

1. ``dict_key_source``: dynamo names a tensor by the first path the trace reached it through and
   keeps that name. A parameter first met as a key of a tensor-keyed dict (``Optimizer.state``)
   gets a dict-key source, and every tensor reached from it, ``p.grad`` included, is guarded by
   identity (``match_on_id_for_tensor`` in ``torch/_dynamo/guards.py``; only the ``GradSource``
   that dynamo's ``_init_group`` special case builds for torch's own optimizers is exempt). With
   new gradient tensors every step (``zero_grad()``, or any FSDP-style runtime), each call finds
   its graph invalidated ("Cache line invalidated because ...grad got deallocated") and
   recompiles, until ``recompile_limit``. Reading ``param_groups`` first (dynamo then builds
   every parameter of the groups, with their sources) compiles once. matrixfsdp's ``step()`` and ``replicate``'s step pre-hook do that
   ([Note: compiled steps and sources] in ``optim/_base.py``).
2. ``mesh_without_group``: DeviceMesh is a dynamo opaque type whose registered members include
   ``_dim_group_names``; a mesh built with ``_init_backend=False`` (no process group, as
   matrixfsdp's one-rank owner meshes) has no such attribute, so tracing any DTensor on it
   raises ``Opaque object of type 'torch.distributed.device_mesh.DeviceMesh' was specified to
   have member '_dim_group_names', but this doesn't actually exist in the object``. An empty
   list (``placement/owner._mesh_without_group``) makes it traceable; no process group needed.

Run: ``python benchmarks/repro/compile_sharded_step.py`` (CPU, a few seconds). Prints what each
variant does; exit status 1 while either behaviour is present, 0 once torch changes both.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounter


class Opt(torch.optim.Optimizer):
    """A momentum-free SGD; its two steps differ only in what they read first."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__(params, {"lr": 0.1})
        for p in params:
            self.state[p]["buf"] = torch.zeros_like(p)

    @torch.no_grad()
    def step_state_first(self) -> None:
        if not self.state:  # the state dict, and so its parameter keys, first
            return
        for p in self.param_groups[0]["params"]:
            self.state[p]["buf"].add_(p.grad)
            p.add_(self.state[p]["buf"], alpha=-0.1)

    @torch.no_grad()
    def step_params_first(self) -> None:
        # dynamo builds every parameter of an Optimizer's param_groups at the first read of the
        # attribute (OptimizerVariable), so they keep param_groups sources
        groups = self.param_groups
        if not self.state:
            return
        for p in groups[0]["params"]:
            self.state[p]["buf"].add_(p.grad)
            p.add_(self.state[p]["buf"], alpha=-0.1)


def dict_key_source(order: str, calls: int = 5) -> int:
    """Compiles of ``calls`` calls with new gradient tensors before each."""
    torch._dynamo.reset()
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
    opt = Opt(params)
    counter = CompileCounter()
    step = torch.compile(getattr(opt, f"step_{order}_first"), backend=counter)
    for _ in range(calls):
        for p in params:
            p.grad = torch.randn_like(p)  # what zero_grad() + backward() amounts to
        step()
    return counter.frame_count


def mesh_without_group(empty_names: bool) -> str:
    """Trace a function of a DTensor on a one-rank mesh built without a process group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    torch._dynamo.reset()
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=(f"one_rank_{empty_names}",), _init_backend=False)
    if empty_names:
        mesh._dim_group_names = []
    local = torch.ones(4)
    spec = DTensorSpec(mesh, (Replicate(),), TensorMeta(local.shape, local.stride(), local.dtype))
    x = DTensor(local, spec, requires_grad=False)

    def f(t: torch.Tensor) -> None:
        t._local_tensor.mul_(2)

    try:
        torch.compile(f, backend="eager", fullgraph=True)(x)
    except Exception as e:  # noqa: BLE001 - the point is the message
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return f"ok ({local.tolist()})"


def main() -> int:
    state_first, params_first = dict_key_source("state"), dict_key_source("params")
    print(f"dict_key_source: 5 calls, new grads each: compiles {state_first} (state first), "
          f"{params_first} (param_groups first)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        bare, named = mesh_without_group(False), mesh_without_group(True)
    finally:
        dist.destroy_process_group()
    print(f"mesh_without_group: _init_backend=False: {bare}")
    print(f"mesh_without_group: with _dim_group_names = []: {named}")
    present = state_first > 1 or not bare.startswith("ok")
    print("both behaviours present" if present else "fixed in this torch", f"(torch {torch.__version__})")
    return 1 if present else 0


if __name__ == "__main__":
    sys.exit(main())
