"""Issue 20 item 4: a checkpoint's ``.metadata`` is unpickled with an allow-list, so a crafted file
cannot run code in ``matrixfsdp.checkpoint.load`` (one process and W=2), ``read_metadata``, the
``export`` CLI, the ``dcp.load`` read (``SafeFileSystemReader``) or the main job's ``--resume``; a
foreign global is a ``ValueError`` naming the file and the global, on every rank. The non-tensor
values in the data files (param groups) are read with ``weights_only=True`` (``SafeLoadPlanner``),
and data-file paths must stay inside the checkpoint folder."""

from __future__ import annotations

import dataclasses
import fractions
import io
import json
import os
import pickle
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from _harness import get_pool
from _train_cli import train_in_process

# torch's dcp.load puts a failed read_metadata's error into its own ("metadata is None; global
# metadata read failed: ...") from 2.13 on; 2.11's swallows it (state_dict_loader.local_step)
_DCP_REPORTS_METADATA_ERRORS = torch.torch_version.TorchVersion(torch.__version__) >= "2.13"
from _models import TinyConfig, TinyDecoder, make_batch

import matrixfsdp
import matrixfsdp.checkpoint as mckpt
from matrixfsdp.checkpoint.safe_pickle import SafeFileSystemReader, SafeLoadPlanner, _allowed, _outside

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
    if _DCP_REPORTS_METADATA_ERRORS:
        assert f"refers to '{qualname}'" in text, text
    else:  # refused all the same (nothing ran, below); 2.11's loader logs the reader's error and drops it
        assert "metadata is None" in text, text
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
    other_opt.param_groups[0]["lr"] = 0.5  # the param groups come back from the bytes entries
    mckpt.load(path, other, other_opt)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert other_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


def test_allow_list_is_narrow():
    assert _allowed("torch", "bfloat16") and _allowed("torch", "Size")
    assert _allowed("torch.distributed.checkpoint.metadata", "TensorStorageMetadata")
    for mod, name in [("builtins", "eval"), ("builtins", "open"), ("os", "system"), ("torch", "load"),
                      ("torch", "tensor"), ("subprocess", "Popen"), ("torch.serialization", "load")]:
        assert not _allowed(mod, name), (mod, name)


# ------------------------------------------------------------------ non-tensor values in data files
BYTES_KEY = "optim.param_groups.0.lr"


def _replace_entry(path: str, key: str, payload) -> str:
    """Replace non-tensor entry ``key`` of checkpoint ``path`` by ``torch.save(payload)``: appended
    to the entry's data file, the (genuine) ``.metadata`` re-pointed at it. Returns the data file."""
    md = mckpt.read_metadata(path)
    assert isinstance(md.state_dict_metadata[key], BytesStorageMetadata)
    idx = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[idx]
    buf = io.BytesIO()
    torch.save(payload, buf)
    data_file = os.path.join(path, info.relative_path)
    offset = os.path.getsize(data_file)
    with open(data_file, "ab") as f:
        f.write(buf.getvalue())
    md.storage_data[idx] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    return data_file


def _expected_bytes(data_file: str, key: str, qualname: str, api: str) -> str:
    return (f"{api}: data file {data_file!r}, entry {key!r} (a non-tensor value), refers to {qualname!r}, "
            "which torch.load(weights_only=True) does not allow; refused without importing or calling it")


def _param_groups_template(opt) -> dict:
    return {"optim": {"param_groups": [{k: v for k, v in g.items() if k != "params"} | {"params": []}
                                       for g in opt.state_dict()["param_groups"]]}}


def test_crafted_bytes_entry_runs_under_stock_dcp_load(tmp_path):
    # the gap this closes: DCP's DefaultLoadPlanner unpickles bytes with weights_only=False
    marker = str(tmp_path / "ran")
    model, opt = _trained()
    path = str(tmp_path / "evil")
    mckpt.save(path, model, opt)
    _replace_entry(path, BYTES_KEY, _CreatesMarker(marker))
    dcp.load(_param_groups_template(opt), storage_reader=FileSystemReader(path), no_dist=True,
             planner=DefaultLoadPlanner(allow_partial_load=True))
    assert os.path.exists(marker)


@pytest.mark.parametrize("case", ["reduce", "foreign_class", "foreign_stdlib"])
def test_crafted_bytes_entry_refused_in_one_process(tmp_path, case):
    marker = str(tmp_path / "ran")
    payload, qualname = {
        "reduce": (_CreatesMarker(marker), "io.open"),
        "foreign_class": (_Foreign(), f"{__name__}._Foreign"),
        "foreign_stdlib": (fractions.Fraction(1, 3), "fractions.Fraction"),
    }[case]
    model, opt = _trained()
    path = str(tmp_path / "evil")
    mckpt.save(path, model, opt)
    data_file = _replace_entry(path, BYTES_KEY, payload)
    model, opt = _trained(seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    groups_before = opt.state_dict()["param_groups"]
    api = "matrixfsdp.checkpoint.load"
    with pytest.raises(ValueError) as e:
        mckpt.load(path, model, opt)
    assert type(e.value) is ValueError
    assert str(e.value).startswith(_expected_bytes(data_file, BYTES_KEY, qualname, api)), str(e.value)
    # SafeLoadPlanner under a plain dcp.load: the same refusal, wrapped by DCP
    with pytest.raises(CheckpointException) as dcp_err:
        dcp.load(_param_groups_template(opt), storage_reader=SafeFileSystemReader(path), no_dist=True,
                 planner=SafeLoadPlanner(path, allow_partial_load=True))
    assert _expected_bytes(data_file, BYTES_KEY, qualname, "matrixfsdp.checkpoint") in str(dcp_err.value)
    # SafeFileSystemReader does not hand bytes to a planner that would unpickle them unsafely
    with pytest.raises(CheckpointException) as dcp_err:
        dcp.load(_param_groups_template(opt), storage_reader=SafeFileSystemReader(path), no_dist=True,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    assert ("SafeFileSystemReader reads non-tensor values only with a SafeLoadPlanner (got "
            "DefaultLoadPlanner" in str(dcp_err.value)), str(dcp_err.value)
    assert not os.path.exists(marker)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.state_dict()["param_groups"] == groups_before


def load_crafted_bytes(root: str) -> str:
    rank = dist.get_rank()
    marker = os.path.join(root, "ran")
    path = os.path.join(root, "evil")
    model, opt = _trained()
    mckpt.save(path, model, opt)
    if rank == 0:
        data_file = _replace_entry(path, BYTES_KEY, _CreatesMarker(marker))
        with open(os.path.join(root, "data_file"), "w") as f:
            f.write(data_file)
    dist.barrier()
    model, opt = _trained()
    try:
        mckpt.load(path, model, opt)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def test_crafted_bytes_entry_refused_on_every_rank(tmp_path):
    root = str(tmp_path)
    res = get_pool(2).run(load_crafted_bytes, root)
    data_file = (tmp_path / "data_file").read_text()
    exp = "ValueError: " + _expected_bytes(data_file, BYTES_KEY, "io.open", "matrixfsdp.checkpoint.load")
    for msg in res:
        assert msg.startswith(exp), msg
    assert not os.path.exists(os.path.join(root, "ran"))


# ------------------------------------------------------------------ data-file paths
def _repath(path: str, new_rel) -> tuple[str, str]:
    """Point every data-file path of checkpoint ``path`` at ``new_rel(old)`` (a genuine .metadata);
    returns the first entry's key and new path (the one an error names)."""
    md = mckpt.read_metadata(path)
    for idx, info in list(md.storage_data.items()):
        md.storage_data[idx] = dataclasses.replace(info, relative_path=new_rel(info.relative_path))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    idx, info = next(iter(md.storage_data.items()))
    return idx.fqn, info.relative_path


def _expected_path(path: str, key: str, rel: str, api: str) -> str:
    return (f"{api}: {os.path.join(path, '.metadata')!r} places key {key!r} in data file {rel!r}, which is "
            "outside the checkpoint folder (a data file must be a relative path within it: no absolute "
            "path, no '..'); refused without opening it")


@pytest.mark.parametrize("case", ["dotdot", "absolute"])
def test_data_file_outside_the_folder_refused(tmp_path, case, capsys):
    model, opt = _trained()
    path = str(tmp_path / "ck")
    mckpt.save(path, model, opt)
    # the data files move elsewhere; the metadata points there
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            shutil.move(os.path.join(path, name), elsewhere / name)
    new_rel = {"dotdot": lambda r: f"../elsewhere/{r}", "absolute": lambda r: str(elsewhere / r)}[case]
    key, rel = _repath(path, new_rel)
    # torch's reader follows the path out of the folder and loads
    sd = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(sd, storage_reader=FileSystemReader(path), no_dist=True)
    assert all(torch.equal(sd["model"][k], v) for k, v in model.state_dict().items())
    # matrixfsdp refuses, before opening anything
    other, other_opt = _trained(seed=1)
    before = [p.detach().clone() for p in other.parameters()]
    for api, call in [("matrixfsdp.checkpoint.load", lambda: mckpt.load(path, other, other_opt)),
                      ("matrixfsdp.checkpoint", lambda: mckpt.read_metadata(path)),
                      ("matrixfsdp.checkpoint", lambda: SafeFileSystemReader(path).read_metadata())]:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value).startswith(_expected_path(path, key, rel, api)), str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    rc = mckpt.main(["export", "--src", path, "--dst", str(tmp_path / "out.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: " + _expected_path(path, key, rel, "matrixfsdp.checkpoint export")), err
    assert not (tmp_path / "out.safetensors").exists()


def load_repathed(root: str) -> str:
    rank = dist.get_rank()
    path = os.path.join(root, "ck")
    model, opt = _trained()
    mckpt.save(path, model, opt)
    if rank == 0:
        with open(os.path.join(root, "first"), "w") as f:
            json.dump(_repath(path, lambda r: f"../{r}"), f)
    dist.barrier()
    model, opt = _trained()
    try:
        mckpt.load(path, model, opt)
    except ValueError as e:
        return f"ValueError: {e}"
    return "no error"


def test_data_file_outside_the_folder_refused_on_every_rank(tmp_path):
    res = get_pool(2).run(load_repathed, str(tmp_path))
    key, rel = json.loads((tmp_path / "first").read_text())
    exp = "ValueError: " + _expected_path(str(tmp_path / "ck"), key, rel, "matrixfsdp.checkpoint.load")
    for msg in res:
        assert msg.startswith(exp), msg


@pytest.mark.parametrize("rel, outside", [
    ("__0_0.distcp", False), ("sub/__0_0.distcp", False), ("a..b.distcp", False),
    ("../x", True), ("a/../../x", True), ("a/..", True), ("/etc/passwd", True), ("..\\x", True),
    ("C:\\x", True), ("C:x", True), ("\\\\server\\share\\x", True), ("\\x", True),
])
def test_outside_rule(rel, outside):
    assert _outside(rel) is outside


# ------------------------------------------------------------------ the main job's --resume
TRAIN = ["--model", "nano", "--steps", "4", "--ckpt-every", "2", "--eval-every", "2", "--sample-bytes", "0",
         "--max-corpus-bytes", "200000", "--threads", "1", "--no-compare"]


def _train(*args: str) -> subprocess.CompletedProcess:
    """``python -m matrixfsdp.train *args``, its main in this process and its ranks forked from the
    harness's forkserver (tests/_train_cli.py): the ranks' loading code is what is under test."""
    return train_in_process(*args)


def test_train_resume_refuses_crafted_checkpoints(tmp_path):
    out = tmp_path / "run"
    res = _train(*TRAIN, "--out", str(out), "--stop-after", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    ckpt = out / "ckpt" / "matrixfsdp-muon" / "step-000002"
    assert json.loads((ckpt.parent / "step-000002.json").read_text())["step"] == 2
    marker = tmp_path / "ran"

    crafted = tmp_path / "crafted_metadata"
    shutil.copytree(out, crafted)
    cpath = crafted / "ckpt" / "matrixfsdp-muon" / "step-000002"
    with open(cpath / ".metadata", "wb") as f:
        pickle.dump(_CreatesMarker(str(marker)), f)
    log = (crafted / "matrixfsdp-muon.jsonl").read_bytes()
    res = _train(*TRAIN, "--out", str(crafted), "--resume")
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"error: --resume: cannot load {str(cpath)!r} (" + _expected(
        str(cpath), "io.open", "matrixfsdp.checkpoint.load") in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not marker.exists()
    assert (crafted / "matrixfsdp-muon.jsonl").read_bytes() == log

    crafted = tmp_path / "crafted_bytes"
    shutil.copytree(out, crafted)
    cpath = crafted / "ckpt" / "matrixfsdp-muon" / "step-000002"
    data_file = _replace_entry(str(cpath), BYTES_KEY, _CreatesMarker(str(marker)))
    res = _train(*TRAIN, "--out", str(crafted), "--resume")
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"error: --resume: cannot load {str(cpath)!r} (" + _expected_bytes(
        data_file, BYTES_KEY, "io.open", "matrixfsdp.checkpoint.load") in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not marker.exists()

    # the untouched run resumes and finishes
    res = _train(*TRAIN, "--out", str(out), "--resume")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "matrixfsdp-muon: 4 steps at W=2" in res.stdout, res.stdout
