"""benchmarks/step_bench.py --backend: argument handling, device choice, fail-fast errors and the
CUDA parts of the report, without a GPU (the NCCL run itself needs GPUs and is not exercised here)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import _bench_common as bc  # noqa: E402
import step_bench  # noqa: E402
from baselines import BenchConfig, batch_for_step  # noqa: E402


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)


def test_backend_and_ns_dtype_defaults():
    a = step_bench.parse_args(["--world", "2"])
    assert (a.backend, a.ns_dtype) == ("gloo", "float32")
    assert step_bench._config(a).ns_dtype == "float32"
    a = step_bench.parse_args(["--world", "2", "--backend", "nccl"])
    assert (a.backend, a.ns_dtype) == ("nccl", "bfloat16")
    assert step_bench._config(a).ns_torch_dtype == torch.bfloat16
    a = step_bench.parse_args(["--world", "2", "--backend", "nccl", "--ns-dtype", "float32"])
    assert a.ns_dtype == "float32"


def test_netns_is_gloo_only(capsys):
    with pytest.raises(SystemExit) as e:
        step_bench.parse_args(["--world", "2", "--netns", "--backend", "nccl"])
    assert e.value.code == 2
    assert "--netns" in capsys.readouterr().err


def test_resolve_device(monkeypatch):
    assert bc.resolve_device("gloo", rank=3, local_world=8) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--backend nccl needs CUDA.*is_available\(\) is False"):
        bc.resolve_device("nccl", rank=0, local_world=2)
    _fake_gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match=r"--backend nccl needs one GPU per rank.*2 ranks per node.*device_count\(\) is 1"):
        bc.resolve_device("nccl", rank=0, local_world=2)
    _fake_gpus(monkeypatch, 4)
    assert bc.resolve_device("nccl", rank=5, local_world=4) == torch.device("cuda", 1)
    assert bc.resolve_device("nccl", rank=5, local_rank=3, local_world=4) == torch.device("cuda", 3)


def test_nccl_without_gpus_fails_before_any_rendezvous(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert step_bench.main(["--world", "2", "--backend", "nccl"]) == 2  # driver: nothing spawned
    assert "--backend nccl needs CUDA" in capsys.readouterr().err
    monkeypatch.setenv("MFB_RANK", "1")
    monkeypatch.setenv("MFB_WORLD", "2")
    monkeypatch.setenv("MFB_STORE", str(tmp_path / "store"))
    assert step_bench.main(["--_worker", "--backend", "nccl"]) == 2  # worker
    assert "error (rank 1): --backend nccl needs CUDA" in capsys.readouterr().err
    assert not dist.is_initialized() and not os.path.exists(tmp_path / "store")


def test_tokens_on_a_device_are_the_cpu_tokens():
    cfg = BenchConfig(global_batch=4, seq_len=8)
    assert torch.equal(batch_for_step(cfg, 2, 1, 2, torch.device("cpu")), batch_for_step(cfg, 2, 1, 2))


def _result(backend: str, device: str, mem_extra: dict) -> dict:
    phase = {"calls": 1.0, "buf": 8.0, "wire": 4.0, "ops": {"all_reduce": [1.0, 8.0, 4.0]}}
    comm = {p: dict(phase) for p in ("fwd", "bwd", "step", "other")}
    env = {"date": "d", "torch": "t", "python": "p", "platform": "x", "cpus": 16, "git": "g", "torchtitan": "0.3.0"}
    if device == "cuda":
        env.update(cuda="12.8", nccl="2.27.3", gpu="NVIDIA H200", gpu_count=8, gpu_memory_gib=139.8)
    rows = [{"impl": name, "repeat": 0, "world": 2, "status": "ok", "notes": ["n"], "fb_s": 1.0, "step_s": 1.0,
             "total_s": 2.0, "cpu_fb_s": 1.0, "cpu_step_s": 1.0, "cpu_total_s": 2.0, "foreign_cpu_share": 0.0,
             "comm_per_rank": [comm, comm],
             "mem_per_rank": [dict({"params": 1 << 20, "grads": 1 << 20, "opt_state": 0, "opt_scratch": 0}, **mem_extra)] * 2}
            for name in ("ddp_muon", "matrixfsdp")]
    step_bench.add_ratios(rows)
    cfg = BenchConfig().to_dict()
    args = vars(step_bench.parse_args(["--world", "2", "--backend", backend]))
    meta = {"world": 2, "backend": backend, "device": device, "threads_per_rank": 1, "config": cfg,
            "args": args, "env": env, "bytes_doc": bc.BYTES_DOC, "run_s": 1.0, "netns": False}
    return {"meta": meta, "rows": rows}


def test_markdown_names_backend_device_and_cuda_peak():
    md = step_bench.markdown(_result("nccl", "cuda", {"cuda_base_allocated": 0, "cuda_max_allocated": 3 << 20}),
                             "cmd")
    assert "# Step benchmark, world 2 (nccl, CUDA, NVIDIA H200)" in md
    assert "cuda 12.8 nccl 2.27.3 gpu NVIDIA H200 x8" in md
    assert "| ddp_muon | 1.00 | 1.00 | 0.00 | 0.00 | 2.00-2.00 | 3.00-3.00 |" in md
    md = step_bench.markdown(_result("gloo", "cpu", {}), "cmd")
    assert "(gloo, CPU)" in md and "CUDA" not in md


def test_markdown_of_results_without_backend_is_gloo_cpu():
    r = _result("gloo", "cpu", {})
    del r["meta"]["backend"], r["meta"]["device"]
    assert "# Step benchmark, world 2 (gloo, CPU)" in step_bench.markdown(r, "cmd")
