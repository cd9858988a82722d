"""torchtitan's optimizer log line per param group: the AdamW group of a matrix optimizer showed
the matrix rule's momentum and nesterov, which it ignores; it shows its AdamW betas and eps."""

from __future__ import annotations

import pytest
import torch

# torchtitan.trainer, not torchtitan: 0.3 imports on torch 2.11 but its trainer does not
pytest.importorskip("torchtitan.trainer", exc_type=ImportError,
                    reason="torchtitan is not installed, or its trainer does not import with this torch "
                           "(torchtitan 0.3 needs torch>=2.13; pip install -e '.[titan]')")

import matrixfsdp  # noqa: E402
from matrixfsdp.integrations.titan import MatrixOptimizersContainer, logged_group_kwargs  # noqa: E402


def test_adamw_group_logs_its_own_settings(monkeypatch):
    w, b = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    opt = matrixfsdp.optim.Muon([{"params": [w], "algorithm": "auto"}, {"params": [b], "algorithm": "adamw"}],
                                lr=0.02, momentum=0.95, adamw_lr=3e-4, adamw_betas=(0.8, 0.95), adamw_eps=1e-10)
    lines = []
    from torchtitan.tools import logging as tlog

    monkeypatch.setattr(tlog.logger, "info", lambda msg, *a, **k: lines.append(msg))
    MatrixOptimizersContainer._log_optimizer(object.__new__(MatrixOptimizersContainer), opt, 0, ["m", "e"])
    matrix, adamw = lines
    assert "'momentum': 0.95" in matrix and "'nesterov'" in matrix
    assert "momentum" not in adamw and "nesterov" not in adamw
    assert "'betas': (0.8, 0.95)" in adamw and "'eps': 1e-10" in adamw
    assert "'lr': 0.0003" in adamw and "'lr': 0.02" in matrix
    assert logged_group_kwargs({"algorithm": "adamw", "lr": 0.1, "adamw_lr": None, "weight_decay": 0.0})["lr"] == 0.1
