"""The layering contracts (``.importlinter``), stated once and checked here:

* the planner needs no runtime, collectives, optimizer or checkpoint code;
* optimizers see only the owner descriptor and local tensors;
* TP steps optimizers through the update-rule protocol alone (``optim/rule.py``) and knows no
  front-end; the protocol module depends on torch alone;
* the runtimes know nothing of Hugging Face, torchtitan, checkpoints or the main job;
* the two front-ends share code only through the engine;
* QK-clip (``qk_clip/``) works through the placement helpers and counted collectives alone: no
  runtime, optimizer, plan or checkpoint; no runtime imports it;
* the packages form layers (apps > integrations > checkpoint, QK-clip > front-ends, optimizers > engine >
  placement > collectives > planner > mesh), with no import cycles inside any package;
* no behaviour is chosen by inspecting a caller's frame, except in the version-gated compat module.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
CONFIG = ROOT / ".importlinter"


def _lint(src: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, str(CONFIG), "--no-cache"], capture_output=True,
                          text=True, env=env, timeout=120)


def test_every_layering_contract_is_kept():
    res = _lint(SRC)
    assert res.returncode == 0, res.stdout + res.stderr
    kept = re.findall(r"KEPT", res.stdout)
    assert len(kept) == 9, res.stdout  # every contract of .importlinter ran and held


def test_a_runtime_importing_an_integration_breaks_the_contracts(tmp_path):
    """The check can fail: the same tree with one forbidden import is refused, naming it."""
    shutil.copytree(SRC / "matrixfsdp", tmp_path / "matrixfsdp", ignore=shutil.ignore_patterns("__pycache__"))
    state = tmp_path / "matrixfsdp" / "_fully_shard" / "state.py"
    state.write_text(state.read_text() + "\nfrom ..integrations import titan as _titan  # noqa\n")
    res = _lint(tmp_path)
    assert res.returncode == 1, res.stdout
    assert "The runtimes know nothing of Hugging Face, torchtitan" in res.stdout
    assert "matrixfsdp._fully_shard.state -> matrixfsdp.integrations.titan" in res.stdout


def test_tp_importing_an_optimizer_breaks_the_contracts(tmp_path):
    """The TP host step may not reach past the update-rule protocol into an optimizer."""
    shutil.copytree(SRC / "matrixfsdp", tmp_path / "matrixfsdp", ignore=shutil.ignore_patterns("__pycache__"))
    step = tmp_path / "matrixfsdp" / "tp" / "host_step.py"
    step.write_text(step.read_text() + "\nfrom ..optim import _base as _optimizer  # noqa\n")
    res = _lint(tmp_path)
    assert res.returncode == 1, res.stdout
    assert "TP steps optimizers through the update-rule protocol alone" in res.stdout
    assert "matrixfsdp.tp.host_step -> matrixfsdp.optim._base" in res.stdout


def test_qk_clip_importing_an_optimizer_or_a_runtime_importing_it_breaks_the_contracts(tmp_path):
    """QK-clip rescales through placement alone, whatever optimizer stepped; runtimes never see it."""
    shutil.copytree(SRC / "matrixfsdp", tmp_path / "matrixfsdp", ignore=shutil.ignore_patterns("__pycache__"))
    api = tmp_path / "matrixfsdp" / "qk_clip" / "api.py"
    api.write_text(api.read_text() + "\nfrom ..optim import _muon as _optimizer  # noqa\n")
    reducer = tmp_path / "matrixfsdp" / "engine" / "reducer.py"
    reducer.write_text(reducer.read_text() + "\nfrom .. import qk_clip as _qk  # noqa\n")
    res = _lint(tmp_path)
    assert res.returncode == 1, res.stdout
    assert "QK-clip works on any placement through the placement helpers" in res.stdout
    assert "matrixfsdp.qk_clip.api -> matrixfsdp.optim._muon" in res.stdout
    assert "matrixfsdp.engine.reducer -> matrixfsdp.qk_clip" in res.stdout


def test_no_caller_frame_inspection_outside_the_compat_module():
    hits = []
    for f in (SRC / "matrixfsdp").rglob("*.py"):
        text = f.read_text()
        if re.search(r"sys\._getframe|inspect\.(stack|currentframe)", text) and f.name != "_compat.py":
            hits.append(str(f.relative_to(SRC)))
    assert hits == []


def test_the_compat_module_pins_the_torch_versions_it_was_verified_on():
    """A torch upgrade fails here until tests/checkpoint/test_full_state_load.py has been rerun on it and
    the version added (see [Note: torch's full state-dict loaders and owned tensors])."""
    from matrixfsdp.placement import _compat

    assert _compat.SUPPORTED_TORCH == ("2.11", "2.13", "2.14", "2.15")
    assert ".".join(torch.__version__.split(".")[:2]) in _compat.SUPPORTED_TORCH
    assert _compat.enabled()
