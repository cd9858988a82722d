"""``python -m matrixfsdp.train --device`` (issue 29, item 3): the device, backend and mixed
precision chosen from the flag and ``torch.cuda.is_available()`` (mocked: no GPU here), the
per-rank initialization on CUDA (mocked ``torch.cuda.set_device`` / ``init_process_group``), and
the refusal of ``--device cuda`` without CUDA. Single process, no training."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from matrixfsdp.train import DeviceChoice, TrainConfig, TrainError, build_parser, choose_device, config_from_args, main
from matrixfsdp.train import cli


def test_the_choice_follows_the_flag_and_cuda_availability():
    cpu = DeviceChoice("cpu", "gloo", None, torch.float32)
    cuda = DeviceChoice("cuda", "nccl", torch.bfloat16, torch.bfloat16)
    assert choose_device("cpu", cuda_available=True) == cpu
    assert choose_device("auto", cuda_available=False) == cpu
    assert choose_device("auto", cuda_available=True) == cuda
    assert choose_device("cuda", cuda_available=True) == cuda
    with mock.patch("torch.cuda.is_available", return_value=True):  # the default asks torch
        assert choose_device("auto") == cuda
    with mock.patch("torch.cuda.is_available", return_value=False):
        assert choose_device() == cpu
    with pytest.raises(TrainError, match="--device must be one of auto, cpu, cuda, got 'tpu'"):
        choose_device("tpu")


def test_device_cuda_without_cuda_is_a_clear_error(tmp_path, capsys):
    with mock.patch("torch.cuda.is_available", return_value=False):
        with pytest.raises(TrainError, match=r"--device cuda: CUDA is not available here .*pass --device cpu"):
            choose_device("cuda")
        status = main(["--out", str(tmp_path / "o"), "--device", "cuda"])
    assert status == 2
    err = capsys.readouterr().err
    assert "error: --device cuda: CUDA is not available here" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_parsing_and_the_config():
    p = build_parser()
    assert p.parse_args([]).device == "auto"
    assert p.parse_args(["--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        p.parse_args(["--device", "gpu"])
    with mock.patch("torch.cuda.is_available", return_value=False):
        assert config_from_args(p.parse_args(["--out", "/nonexistent/x"]), 2).device == "cpu"
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.device_count", return_value=2):
        assert config_from_args(p.parse_args(["--out", "/nonexistent/x"]), 2).device == "cuda"
        with pytest.raises(TrainError, match="--world 4 needs one GPU per rank, found 2"):
            config_from_args(p.parse_args(["--out", "/nonexistent/x", "--world", "4"]), 4)
        assert config_from_args(p.parse_args(["--out", "/nonexistent/x", "--device", "cpu"]), 4).device == "cpu"
    assert TrainConfig(out="x").device == "cpu"  # the dataclass default: what a CPU run was


def test_each_rank_takes_its_gpu_and_nccl_or_gloo():
    calls = []
    with mock.patch("torch.cuda.set_device", side_effect=lambda d: calls.append(("set_device", d))), \
            mock.patch("torch.distributed.init_process_group",
                       side_effect=lambda backend, **kw: calls.append(("init", backend, kw.get("rank")))):
        cli._init_rank(TrainConfig(out="x", device="cuda"), 3, rank=3, world_size=4)
        cli._init_rank(TrainConfig(out="x", device="cpu"), 1, rank=1, world_size=4)
    assert calls == [("set_device", 3), ("init", "nccl", 3), ("init", "gloo", 1)]
    assert cli._start_method("cuda") == "spawn"  # no fork after the parent asked the CUDA driver


def test_the_cuda_configuration_trains_on_the_cpu_with_its_mixed_precision(tmp_path):
    """The job's CUDA branch (bf16 mixed precision for both runs, bf16 Newton-Schulz, tensors
    moved to ``cfg.device``) run on the CPU: the choice mocked to bf16 on "cpu", one gloo rank."""
    import json
    import os

    import torch.distributed as dist

    from matrixfsdp.train import job

    bf16 = DeviceChoice("cpu", "gloo", torch.bfloat16, torch.bfloat16)
    cfg = TrainConfig(out=str(tmp_path / "o"), model="nano", steps=2, ckpt_every=2, eval_every=2, sample_bytes=4,
                      max_corpus_bytes=100000, threads=1, batch=4, seq_len=32)
    policies: dict[str, set] = {"matrixfsdp": set(), "fsdp2": set()}

    def spy(name, real):
        def f(module, *a, **k):
            policies[name].add(getattr(k.get("mp_policy"), "param_dtype", None))
            return real(module, *a, **k)
        return f

    import matrixfsdp
    import torch.distributed.fsdp as fsdp

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with mock.patch.object(job, "device_choice", return_value=bf16), \
                mock.patch.object(matrixfsdp, "fully_shard", spy("matrixfsdp", matrixfsdp.fully_shard)), \
                mock.patch.object(fsdp, "fully_shard", spy("fsdp2", fsdp.fully_shard)):
            finals = job.run_rank(cfg)
    finally:
        dist.destroy_process_group()
    # every fully_shard call of the matrixfsdp run and of stock FSDP2's computes in bf16
    assert policies == {"matrixfsdp": {torch.bfloat16}, "fsdp2": {torch.bfloat16}}, policies
    assert [f["run"] for f in finals] == ["matrixfsdp-muon", "fsdp2-adamw"]
    for name in ("matrixfsdp-muon", "fsdp2-adamw"):
        recs = [json.loads(x) for x in (tmp_path / "o" / f"{name}.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in recs if "loss" in r]
        assert len(losses) == 2 and losses[-1] < losses[0], losses
    assert os.path.exists(tmp_path / "o" / "loss.png")
