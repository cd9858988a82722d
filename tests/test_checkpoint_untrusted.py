"""Issue 20 item 4: a checkpoint's ``.metadata`` is unpickled with an allow-list, so a crafted file
cannot run code in ``matrixfsdp.checkpoint.load`` (one process and W=2), ``read_metadata``, the
``export`` CLI or the ``dcp.load`` read (``SafeFileSystemReader``); a foreign global is a
``ValueError`` naming the file and the global, on every rank."""

from __future__ import annotations

import fractions
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from _harness import get_pool
from _models import TinyConfig, TinyDecoder, make_batch

import matrixfsdp
import matrixfsdp.checkpoint as mckpt
from matrixfsdp.checkpoint.safe_pickle import SafeFileSystemReader, _allowed

KW = dict(lr=0.02, ns_dtype=torch.float32, adamw_lr=3e-3)


class _CreatesMarker:
    """Unpickling this calls ``open(marker, "w")``: the file appears iff the pickle ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _Foreign:  # harmless, but not DCP metadata
    pass


def _trained(seed: int = 0):
    cfg = TinyConfig()
    model = TinyDecoder(cfg, seed=seed)
    opt = matrixfsdp.optim.Muon(model, **KW)
    x, y = make_batch(cfg, 0, 4)
    model.loss(x, y).backward()
    opt.step()
    return model, opt


def _craft(root: str, name: str, payload) -> str:
    """A real checkpoint (valid data files) whose .metadata is replaced by ``payload``'s pickle."""
    model, opt = _trained()
    path = os.path.join(root, name)
    mckpt.save(path, model, opt)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(payload, f)
    return path


def _expected(path: str, qualname: str, api: str) -> str:
    return (f"{api}: {os.path.join(path, '.metadata')!r} refers to {qualname!r}, which DCP checkpoint "
            "metadata never holds; refused without importing or calling it")


def test_payload_really_runs_under_plain_pickle(tmp_path):
    # the crafted file is live: plain pickle.load creates the marker (so the tests below can fail)
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_CreatesMarker(str(marker))))
    assert marker.exists()


@pytest.mark.parametrize("case", ["reduce", "foreign_class", "foreign_stdlib", "nested"])
def test_crafted_metadata_refused_in_one_process(tmp_path, case):
    marker = str(tmp_path / "ran")
    payload, qualname = {
        "reduce": (_CreatesMarker(marker), "io.open"),
        "foreign_class": (_Foreign(), f"{__name__}._Foreign"),
        "foreign_stdlib": (fractions.Fraction(1, 3), "fractions.Fraction"),
        # inside an otherwise genuine Metadata object
        "nested": (None, "io.open"),
    }[case]
    if case == "nested":
        model, opt = _trained()
        real = os.path.join(tmp_path, "real")
        mckpt.save(real, model, opt)
        md = mckpt.read_metadata(real)
        md.planner_data = {"x": _CreatesMarker(marker)}
        payload = md
    path = _craft(str(tmp_path), "evil", payload)
    model, opt = _trained(seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    api = "matrixfsdp.checkpoint.load"
    with pytest.raises(ValueError) as e:
        mckpt.load(path, model, opt)
    assert str(e.value).startswith(_expected(path, qualname, api)), str(e.value)
    with pytest.raises(ValueError, match="refers to"):
        mckpt.read_metadata(path)
    # the dcp.load read itself (torch's FileSystemReader would run the payload)
    sd = {"model": model.state_dict()}
    with pytest.raises(CheckpointException) as dcp_err:  # DCP wraps it (a BaseException)
        dcp.load(sd, storage_reader=SafeFileSystemReader(path), no_dist=True)
    text = str(dcp_err.value) + "".join(map(str, getattr(dcp_err.value, "failures", {}).values()))
    assert f"refers to '{qualname}'" in text, text
    assert not os.path.exists(marker)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # untouched


def test_export_cli_refuses_crafted_metadata(tmp_path, capsys):
    marker = str(tmp_path / "ran")
    path = _craft(str(tmp_path), "evil", _CreatesMarker(marker))
    rc = mckpt.main(["export", "--src", path, "--dst", str(tmp_path / "out.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: " + _expected(path, "io.open", "matrixfsdp.checkpoint export")), err
    assert not os.path.exists(marker) and not (tmp_path / "out.safetensors").exists()


def load_crafted(root: str) -> str:
    rank = dist.get_rank()
    marker = os.path.join(root, "ran")
    path = os.path.join(root, "evil")
    model, opt = _trained()
    mckpt.save(path, model, opt)  # collective: a genuine W=2 checkpoint first
    if rank == 0:
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(_CreatesMarker(marker), f)
    dist.barrier()
    model, opt = _trained()
    try:
        mckpt.load(path, model, opt)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def test_crafted_metadata_refused_on_every_rank(tmp_path):
    root = str(tmp_path)
    res = get_pool(2).run(load_crafted, root)
    exp = "ValueError: " + _expected(os.path.join(root, "evil"), "io.open", "matrixfsdp.checkpoint.load")
    for msg in res:
        assert msg.startswith(exp), msg
    assert not os.path.exists(os.path.join(root, "ran"))


def test_genuine_metadata_reads_as_torch_reads_it(tmp_path):
    # the allow-listed read gives the same metadata as torch's reader, and a load is bitwise
    model, opt = _trained()
    path = str(tmp_path / "ok")
    mckpt.save(path, model, opt)
    ours, theirs = SafeFileSystemReader(path).read_metadata(), FileSystemReader(path).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    other, other_opt = _trained(seed=5)
    mckpt.load(path, other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_allow_list_is_narrow():
    assert _allowed("torch", "bfloat16") and _allowed("torch", "Size")
    assert _allowed("torch.distributed.checkpoint.metadata", "TensorStorageMetadata")
    for mod, name in [("builtins", "eval"), ("builtins", "open"), ("os", "system"), ("torch", "load"),
                      ("torch", "tensor"), ("subprocess", "Popen"), ("torch.serialization", "load")]:
        assert not _allowed(mod, name), (mod, name)
