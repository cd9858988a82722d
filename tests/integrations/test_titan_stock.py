"""torchtitan's stock Trainer (FSDP2 + AdamW) on CPU/gloo, tiny Qwen3: W=2 against W=1.

This is the baseline for the matrixfsdp integration tests: it shows that ``tests/_titan_cpu.py``
(CPU patches, synthetic data, tiny config) gives a Trainer whose per-step losses and gradient norms
do not depend on the world size for a fixed global batch. titan's loss is the local token sum
divided by the *global* token count and FSDP's division is off (divide factor 1.0), so gradients
are summed across ranks; a wrong gradient scale shows up in ``grad_norm`` (AdamW itself is nearly
scale-invariant, so the losses alone would not catch it).
"""

from __future__ import annotations

import math
import os

import pytest

# torchtitan.trainer, not torchtitan: 0.3 imports on torch 2.11 but its trainer does not (it needs
# torch.distributed.fsdp.DataParallelMeshDims, from 2.13 on)
pytest.importorskip("torchtitan.trainer", exc_type=ImportError,
                    reason="torchtitan is not installed, or its trainer does not import with this torch "
                           "(torchtitan 0.3 needs torch>=2.13; pip install -e '.[titan]')")

from _harness import get_pool  # noqa: E402

STEPS = 4
RTOL = 1e-5


def _train_stock(steps: int, dump_folder: str) -> dict:
    """Pool worker: the stock tiny-Qwen3 config, trained in this rank's process."""
    import torch.distributed as dist

    from _titan_cpu import run_trainer_metrics, tiny_qwen3_config

    cfg = tiny_qwen3_config(steps=steps, dump_folder=os.path.join(dump_folder, f"w{dist.get_world_size()}"))
    m = run_trainer_metrics(cfg)
    return {"losses": m.losses, "grad_norms": m.grad_norms, "lrs": [e.get("lr/AdamW") for e in m.extra]}


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * max(abs(x), abs(y)) for x, y in zip(a, b))


def test_stock_trainer_world_size_invariant(tmp_path):
    w2 = get_pool(2).run(_train_stock, STEPS, str(tmp_path), timeout=120)
    w1 = get_pool(1).run(_train_stock, STEPS, str(tmp_path), timeout=120)

    for res in w2 + w1:
        assert len(res["losses"]) == STEPS
        assert all(math.isfinite(x) for x in res["losses"] + res["grad_norms"]), res
        assert res["lrs"] == [8e-4] * STEPS  # constant schedule, no warmup
    # Metrics are reduced over the dp ranks, so both ranks report the same numbers.
    assert w2[0] == w2[1]
    ref, got = w1[0], w2[0]
    assert _close(got["losses"], ref["losses"], RTOL), (got["losses"], ref["losses"])
    assert _close(got["grad_norms"], ref["grad_norms"], RTOL), (got["grad_norms"], ref["grad_norms"])
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]  # the synthetic data is learnable
