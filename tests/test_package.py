"""``import matrixfsdp`` reaches every documented submodule."""

import importlib.util
import subprocess
import sys

import pytest


def test_documented_submodules_are_attributes():
    code = ("import matrixfsdp, sys; assert 'matrixfsdp.titan' not in sys.modules; "
            "print(matrixfsdp.optim.Muon, matrixfsdp.checkpoint.save, matrixfsdp.plan.main, matrixfsdp.train.main); "
            "assert 'titan' in dir(matrixfsdp)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    import matrixfsdp

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        matrixfsdp.nope


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None or importlib.util.find_spec("triton") is None,
                    reason="torchtitan/triton not installed (pip install -e '.[titan]')")
def test_readme_titan_snippet_as_written():
    pytest.importorskip("torchtitan.trainer", exc_type=ImportError,
                        reason="torchtitan's trainer does not import with this torch (torchtitan 0.3 needs torch>=2.13)")
    code = ("import matrixfsdp\n"
            "from torchtitan.models.qwen3.config_registry import qwen3_14b\n"
            "config = matrixfsdp.titan.with_matrixfsdp(qwen3_14b(), optimizer='Muon', lr=0.02, adamw_lr=3e-4)\n"
            "assert config.optimizer.param_groups[0].optimizer_name == 'Muon'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
