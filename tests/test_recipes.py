"""recipes/ at smoke size: every CPU-sized recipe runs a few steps, so a broken recipe fails CI.

Each recipe runs as its README row says (a subprocess, its own ranks); the GPU-sized torchtitan
configs are built (not run) and checked to be matrixfsdp conversions of the intended model.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1")


def _run(cmd: list[str], cwd: Path) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=cwd)
    assert res.returncode == 0, f"{' '.join(cmd)}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res.stdout + res.stderr


def test_readme_table_lists_every_recipe():
    table = (RECIPES / "README.md").read_text()
    for f in ("plain_pytorch.py", "hf_finetune.py", "titan_configs.py", "titan_cpu.py"):
        assert (RECIPES / f).exists() and f in table, f


def test_plain_pytorch(tmp_path):
    out = _run([sys.executable, str(RECIPES / "plain_pytorch.py"), "--steps", "3", "--hidden", "64",
                "--layers", "2", "--out", str(tmp_path / "ckpt")], cwd=tmp_path)
    assert "step    3  loss" in out and "held-out loss" in out
    assert (tmp_path / "ckpt" / ".metadata").exists()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_hf_finetune(tmp_path):
    out = _run([sys.executable, str(RECIPES / "hf_finetune.py"), "--steps", "2", "--seq-len", "64",
                "--qk-clip", "100", "--out", str(tmp_path / "hf")], cwd=tmp_path)
    assert "held-out loss after" in out
    assert "max logit" in out  # QK-clip ran (the saved config keeps its own attention implementation)
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def _needs_titan() -> None:
    for mod in ("torchtitan", "triton"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} not installed (pip install -e '.[titan]')")
    pytest.importorskip("torchtitan.trainer", exc_type=ImportError,
                        reason="torchtitan's trainer does not import with this torch (torchtitan 0.3 needs torch>=2.13)")


def test_titan_cpu(tmp_path):
    _needs_titan()
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    out = _run([torchrun, "--standalone", "--nproc-per-node", "2", str(RECIPES / "titan_cpu.py"),
                "--training.steps", "3", "--metrics.log-freq", "1", "--dump-folder", str(tmp_path / "titan")],
               cwd=tmp_path)
    assert "step:  3" in out and "Training completed" in out


GPU_CONFIGS = [f"qwen3_{size}_{opt}" for size in ("0_6b", "8b", "32b") for opt in ("muon", "shampoo", "soap")]


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_titan_gpu_configs_build(name):
    _needs_titan()
    sys.path.insert(0, str(RECIPES))
    try:
        import titan_configs
    finally:
        sys.path.remove(str(RECIPES))
    config = getattr(titan_configs, name)()
    size, opt = name.split("_")[1:-1], name.split("_")[-1]
    assert config.model_spec.flavor == {"0_6b": "0.6B", "8b": "8B", "32b": "32B"}["_".join(size)]
    groups = config.optimizer.param_groups
    assert [g.optimizer_name.lower() for g in groups] == [opt]
    import matrixfsdp.titan  # the public path; the implementation lives in matrixfsdp.integrations

    assert sys.modules[config.model_spec.parallelize_fn.func.__module__] is matrixfsdp.titan
