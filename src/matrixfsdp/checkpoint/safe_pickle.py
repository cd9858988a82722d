"""Reading a DCP checkpoint without running its code (issue 20).

``.metadata`` is a pickle; ``pickle.load`` imports and calls whatever globals it names, so an
untrusted checkpoint could run code at load. :func:`load_metadata` unpickles with an allow-list:
DCP's metadata dataclasses, ``torch.Size``, torch dtypes and layouts, and the path class DCP
records as ``checkpoint_id``. Builtin containers and scalars need no global. The list is what the
checkpoints of this suite contain (``matrixfsdp.checkpoint.save``, ``dcp.save`` of stock FSDP2 and
of plain modules, ``import``'s ``no_dist`` save), listed from their pickles.

:class:`SafeFileSystemReader` is torch's ``FileSystemReader`` with the same unpickler, so the read
inside ``dcp.load`` is refused too, not only matrixfsdp's own validation. Every ``relative_path``
the metadata gives a data file must stay inside the checkpoint folder (no absolute path, no
``..``), or the metadata is refused.

The data files hold tensors, read by DCP with ``torch.load(weights_only=True)``, and non-tensor
values (optimizer hyperparameters, non-tensor optimizer state: floats, ints, bools, None, strings,
tuples and lists of them; dtypes are saved as strings), which DCP's ``DefaultLoadPlanner`` reads
with ``torch.load(weights_only=False)``. :class:`SafeLoadPlanner` reads them with
``weights_only=True`` (torch's data-only unpickler; the values above need no extra global), and a
refused global is a ``ValueError`` naming the data file, the key and the global.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import PurePosixPath, PureWindowsPath
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType

__all__ = ["RefusedGlobal", "UntrustedCheckpointError", "load_metadata", "SafeFileSystemReader", "SafeLoadPlanner"]


class UntrustedCheckpointError(ValueError):
    """A checkpoint refused because it would run code or reach outside its folder.

    Raised inside ``dcp.load`` too (from :class:`SafeLoadPlanner`), where DCP wraps it in a
    ``CheckpointException``; :func:`matrixfsdp.checkpoint.load` unwraps it into a ``ValueError``.
    """

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    *((_DCP_METADATA, n) for n in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a name -> torch.layout lookup, nothing else
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
})


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list (``module.name`` in ``qualname``)."""

    def __init__(self, module: str, name: str) -> None:
        self.qualname = f"{module}.{name}"
        super().__init__(self.qualname)


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    # torch.float32, torch.bfloat16, ...: looked up, never called with pickle arguments
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise RefusedGlobal(module, name)  # before any import: nothing of the file runs
        return super().find_class(module, name)


def load_metadata(f: IO[bytes], where: str, api: str) -> Metadata:
    """Unpickle DCP metadata from ``f`` with the allow-list; ``where`` names the file in errors.

    Raises ``ValueError`` for a refused global, an unreadable pickle or a non-``Metadata`` object.
    """
    try:
        md = _MetadataUnpickler(f).load()
    except RefusedGlobal as e:
        raise UntrustedCheckpointError(
            f"{api}: {where!r} refers to {e.qualname!r}, which DCP checkpoint metadata never holds; "
            "refused without importing or calling it (allowed: DCP's metadata classes, torch.Size, "
            "torch dtypes/layouts, paths, builtin values). Do not load this checkpoint unless you "
            "trust its source and inspect it"
        ) from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise ValueError(f"{api}: cannot read {where!r} ({type(e).__name__}: {e}); the file is damaged") from e
    if not isinstance(md, Metadata):
        raise ValueError(f"{api}: {where!r} holds a {type(md).__name__}, not DCP metadata")
    check_storage_paths(md, where, api)
    return md


def _outside(rel: str) -> bool:
    """``rel`` is absolute (POSIX or Windows: root, drive, UNC) or has a ``..`` component."""
    win = PureWindowsPath(rel)
    if os.path.isabs(rel) or rel.startswith(("/", "\\")) or win.drive or win.root:
        return True
    return ".." in PurePosixPath(rel.replace("\\", "/")).parts


def check_storage_paths(md: Metadata, where: str, api: str) -> None:
    """Every data file named in ``md.storage_data`` is a relative path inside the checkpoint folder.

    DCP writes plain names (``__0_0.distcp``); anything absolute or with ``..`` would make a
    reader open a file elsewhere. Raises :class:`UntrustedCheckpointError` (a ``ValueError``).
    """
    data = md.storage_data
    if data is None:
        return  # torch's reader refuses it (and nothing is read)
    if not isinstance(data, dict):
        raise ValueError(f"{api}: {where!r} holds storage data of type {type(data).__name__}, not a dict; "
                         "the file is damaged")
    for index, info in data.items():
        key = getattr(index, "fqn", index)
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel:
            raise ValueError(f"{api}: {where!r} gives key {key!r} the data file {rel!r}, not a file name; "
                             "the file is damaged")
        if _outside(rel):
            raise UntrustedCheckpointError(
                f"{api}: {where!r} places key {key!r} in data file {rel!r}, which is outside the "
                "checkpoint folder (a data file must be a relative path within it: no absolute path, "
                "no '..'); refused without opening it. Do not load this checkpoint unless you trust "
                "its source and inspect it"
            )


_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL (\S+)")


def load_bytes_entry(value: IO[bytes], file: str, key: str, api: str) -> Any:
    """A non-tensor value DCP saved with ``torch.save``, read with ``torch.load(weights_only=True)``.

    A global outside torch's weights-only allow-list is an :class:`UntrustedCheckpointError`
    naming ``file``, ``key`` and the global (found by disassembling the pickle, never by running
    it); any other failure propagates unchanged (a damaged file).
    """
    data = value.read()
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        try:
            refused = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
        except Exception:  # noqa: BLE001 - the message below names it instead
            refused = []
        if not refused:
            refused = sorted(set(_UNSUPPORTED.findall(str(e))))
        if not refused:
            raise
        raise UntrustedCheckpointError(
            f"{api}: data file {file!r}, entry {key!r} (a non-tensor value), refers to "
            f"{', '.join(map(repr, refused))}, which torch.load(weights_only=True) does not allow; "
            "refused without importing or calling it (non-tensor checkpoint values are floats, ints, "
            "bools, None, strings, tuples/lists/dicts of them, tensors and dtypes). Do not load this "
            "checkpoint unless you trust its source and inspect it"
        ) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose non-tensor values are read with ``weights_only=True``.

    ``path`` (the checkpoint folder) and ``api`` only name things in errors; the other arguments
    are ``DefaultLoadPlanner``'s.

    Example::

        dcp.load(sd, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(path))
    """

    def __init__(self, path: str | os.PathLike = "", *args: Any, api: str = "matrixfsdp.checkpoint",
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.path = os.fspath(path)
        self.api = api

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        info = (getattr(self.metadata, "storage_data", None) or {}).get(read_item.storage_index)
        rel = getattr(info, "relative_path", "?")
        obj = load_bytes_entry(value, os.path.join(self.path, rel), key, self.api)
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes
            set_element(self.original_state_dict, self.mappings[key], obj)
        else:
            self.state_dict[key] = obj


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the allow-listed unpickler (and checks the
    data files' paths); it reads non-tensor values only through a :class:`SafeLoadPlanner`."""

    api = "matrixfsdp.checkpoint"

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        get = getattr(self, "_get_metadata_path", None)  # torch >= 2.6; ".metadata" before
        path = get(kwargs.get("rank")) if get is not None else self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            md = load_metadata(f, str(path), self.api)
        # as torch's reader does: a load id for this read
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan: Any, planner: Any) -> Any:
        if not isinstance(planner, SafeLoadPlanner) and any(i.type == LoadItemType.BYTE_IO for i in plan.items):
            raise ValueError(
                f"{self.api}: SafeFileSystemReader reads non-tensor values only with a SafeLoadPlanner "
                f"(got {type(planner).__name__}, whose load_bytes may unpickle with weights_only=False); "
                "pass planner=SafeLoadPlanner(path)"
            )
        return super().read_data(plan, planner)
