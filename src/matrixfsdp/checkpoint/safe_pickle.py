"""Reading a DCP ``.metadata`` file without running its code (issue 20).

``.metadata`` is a pickle; ``pickle.load`` imports and calls whatever globals it names, so an
untrusted checkpoint could run code at load. :func:`load_metadata` unpickles with an allow-list:
DCP's metadata dataclasses, ``torch.Size``, torch dtypes and layouts, and the path class DCP
records as ``checkpoint_id``. Builtin containers and scalars need no global. The list is what the
checkpoints of this suite contain (``matrixfsdp.checkpoint.save``, ``dcp.save`` of stock FSDP2 and
of plain modules, ``import``'s ``no_dist`` save), listed from their pickles.

:class:`SafeFileSystemReader` is torch's ``FileSystemReader`` with the same unpickler, so the read
inside ``dcp.load`` is refused too, not only matrixfsdp's own validation.
"""

from __future__ import annotations

import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

__all__ = ["RefusedGlobal", "load_metadata", "SafeFileSystemReader"]

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
        raise ValueError(
            f"{api}: {where!r} refers to {e.qualname!r}, which DCP checkpoint metadata never holds; "
            "refused without importing or calling it (allowed: DCP's metadata classes, torch.Size, "
            "torch dtypes/layouts, paths, builtin values). Do not load this checkpoint unless you "
            "trust its source and inspect it"
        ) from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise ValueError(f"{api}: cannot read {where!r} ({type(e).__name__}: {e}); the file is damaged") from e
    if not isinstance(md, Metadata):
        raise ValueError(f"{api}: {where!r} holds a {type(md).__name__}, not DCP metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the allow-listed unpickler."""

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
