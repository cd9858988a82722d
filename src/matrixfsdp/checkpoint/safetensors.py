"""Offline conversion between DCP checkpoints and Hugging Face-style safetensors, streaming.

No process group is needed: the DCP side is read from its ``.metadata`` and data files directly
and written with ``dcp.save(..., no_dist=True)`` through a planner that loads each tensor only
when the writer asks for it.

[Note: streaming conversion]
At most one tensor is alive at a time, plus a bounded buffer:

* export: a tensor saved as one chunk (every owned matrixfsdp tensor) is read and written as is;
  a tensor saved in row shards (even ``Shard(0)`` tensors) is assembled into one buffer of its
  size from one saved shard at a time. The safetensors header is computed from the metadata
  first (shapes and dtypes are known), then the bytes are streamed out in slices of the tensor
  (views, no copy);
* import: each tensor is read from the safetensors file straight into its buffer (``readinto``),
  handed to DCP's writer, written to its own data file and released before the next one.

:class:`ByteTracker` counts the bytes of every buffer the reader and writer hold (``peak`` is the
maximum alive at once); the tests assert the bound.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .dcp import MODEL_KEY, _fsync_dir, check_files, read_metadata

__all__ = [
    "ByteTracker",
    "DCPTensorReader",
    "SafetensorsReader",
    "export_safetensors",
    "import_safetensors",
    "parse_size",
]

API_EXPORT = "matrixfsdp.checkpoint export"
API_IMPORT = "matrixfsdp.checkpoint import"

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
_ST_CODES = {v: k for k, v in _ST_DTYPES.items()}

#: Bytes per write call when streaming a tensor out.
WRITE_SLICE = 16 << 20


class ByteTracker:
    """Counts bytes of the buffers a conversion holds; ``peak`` is the most alive at once."""

    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0

    def _add(self, n: int) -> None:
        self.alive += n
        self.peak = max(self.peak, self.alive)

    def _sub(self, n: int) -> None:
        self.alive -= n

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor whose storage is a tracked numpy buffer (released when the last view dies)."""
        nbytes = _numel(shape) * _itemsize(dtype)
        arr = np.empty(max(nbytes, 1), dtype=np.uint8)
        self._add(nbytes)
        weakref.finalize(arr, self._sub, nbytes)
        t = torch.from_numpy(arr)[:nbytes]
        return t.view(dtype).reshape(shape)

    def track(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t`` (a tensor allocated elsewhere) until the object is garbage collected."""
        n = t.numel() * t.element_size()
        self._add(n)
        weakref.finalize(t, self._sub, n)
        return t


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def parse_size(text: str | int | None) -> int | None:
    """``"5GB"``, ``"500MB"``, ``"100KiB"``, ``"123"`` -> bytes (decimal units as Hugging Face's)."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"{API_EXPORT}: --max-shard-size must look like 5GB, 500MB or 1000000, got {text!r}")
    value, unit = float(m.group(1)), m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[:1] if unit[:1] in "KMGT" else ""]
    n = int(value * base**power)
    if n < 1:
        raise ValueError(f"{API_EXPORT}: --max-shard-size must be positive, got {text!r}")
    return n


# ==================================================================================== DCP reading
@dataclass(frozen=True)
class TensorEntry:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


class DCPTensorReader:
    """Reads whole tensors from a DCP checkpoint directory, one at a time, without a process group.

    Example::

        r = DCPTensorReader("ckpt/step-100")
        for e in r.entries("model."):
            t = r.read(e.key)   # the full tensor
    """

    def __init__(self, path: str | os.PathLike, tracker: ByteTracker | None = None, api: str = API_EXPORT):
        self.path = os.fspath(path)
        self.api = api
        self.md = read_metadata(self.path, api)
        self.tracker = tracker or ByteTracker()

    def entries(self, prefix: str = "") -> list[TensorEntry]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        out = []
        for key, m in self.md.state_dict_metadata.items():
            if key.startswith(prefix) and isinstance(m, TensorStorageMetadata):
                out.append(TensorEntry(key, tuple(m.size), m.properties.dtype))
        return sorted(out, key=lambda e: e.key)

    def check_files(self, keys: list[str]) -> None:
        check_files(self.path, self.md, keys, self.api)

    def _load_chunk(self, info: Any) -> torch.Tensor:
        from torch.distributed.checkpoint.utils import _create_file_view

        f = os.path.join(self.path, info.relative_path)
        with open(f, "rb") as stream:
            view = _create_file_view(stream, info.offset, info.length)
            try:
                return torch.load(view, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001
                raise ValueError(
                    f"{self.api}: cannot read bytes {info.offset}..{info.offset + info.length} of data file "
                    f"{f!r} ({type(e).__name__}: {e}); the file is damaged"
                ) from e

    def read(self, key: str) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        m = self.md.state_dict_metadata[key]
        shape, dtype = tuple(m.size), m.properties.dtype
        chunks = list(m.chunks)
        infos = [self.md.storage_data[MetadataIndex(key, c.offsets)] for c in chunks]
        if any(getattr(i, "transform_descriptors", None) for i in infos):
            raise ValueError(f"{self.api}: key {key!r} was saved with storage transforms, which export does not read")
        whole = len(chunks) == 1 and tuple(chunks[0].sizes) == shape
        if whole:
            t = self._load_chunk(infos[0])
            self._check(key, t, shape, dtype)
            return self.tracker.track(t)
        target = self.tracker.alloc(shape, dtype)
        for c, info in zip(chunks, infos):
            sizes = tuple(c.sizes)
            nbytes = _numel(sizes) * _itemsize(dtype)
            if nbytes == 0:
                continue
            self.tracker._add(nbytes)  # the saved shard, alive until ``del`` below
            try:
                chunk = self._load_chunk(info)
                self._check(key, chunk, sizes, dtype)
                view = target
                for d, (o, s) in enumerate(zip(c.offsets, sizes)):
                    view = view.narrow(d, o, s)
                view.copy_(chunk)
                del chunk, view
            finally:
                self.tracker._sub(nbytes)
        return target

    def _check(self, key: str, t: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{self.api}: a saved chunk of {key!r} is {got}, the metadata says {(shape, dtype)}")


# ==================================================================================== safetensors
def _header_bytes(entries: list[tuple[str, tuple[int, ...], torch.dtype]], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    off = 0
    for name, shape, dtype in entries:
        if dtype not in _ST_DTYPES:
            raise ValueError(f"{API_EXPORT}: tensor {name!r} has dtype {dtype}, which safetensors cannot store")
        n = _numel(shape) * _itemsize(dtype)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    return hb + b" " * (-len(hb) % 8)


class SafetensorsStreamWriter:
    """Writes a safetensors file tensor by tensor, in the order given (header first).

    Written to ``<path>.tmp-<uuid>`` and renamed on :meth:`close`.
    """

    def __init__(self, path: str, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None):
        self.path = path
        self.entries = entries
        self.tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        self._next = 0
        hb = _header_bytes(entries, metadata)
        self.f = open(self.tmp, "wb")
        self.f.write(struct.pack("<Q", len(hb)))
        self.f.write(hb)

    def write(self, name: str, t: torch.Tensor) -> None:
        ename, shape, dtype = self.entries[self._next]
        if name != ename or tuple(t.shape) != shape or t.dtype != dtype:
            raise RuntimeError(
                f"{API_EXPORT}: expected tensor {ename!r} {shape} {dtype}, got {name!r} {tuple(t.shape)} {t.dtype}"
            )
        self._next += 1
        if t.numel() == 0:
            return
        if not t.is_contiguous():
            raise RuntimeError(f"{API_EXPORT}: tensor {name!r} is not contiguous")
        flat = t.reshape(-1).view(torch.uint8)
        for i in range(0, flat.numel(), WRITE_SLICE):
            self.f.write(memoryview(flat[i: i + WRITE_SLICE].numpy()))
        del flat

    def close(self) -> None:
        if self._next != len(self.entries):
            raise RuntimeError(f"{API_EXPORT}: {self.path!r}: only {self._next} of {len(self.entries)} tensors written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self.f.close()
        finally:
            if os.path.exists(self.tmp):
                os.remove(self.tmp)


class SafetensorsReader:
    """Reads tensors of one safetensors file straight into tracked buffers (no mmap, no copy)."""

    def __init__(self, path: str, tracker: ByteTracker | None = None):
        self.path = path
        self.tracker = tracker or ByteTracker()
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{API_IMPORT}: safetensors file {path!r} does not exist")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{API_IMPORT}: {path!r} is truncated ({size} bytes): no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"{API_IMPORT}: {path!r} is truncated: header of {n} bytes, file of {size}")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise ValueError(f"{API_IMPORT}: {path!r} has a damaged header ({e})") from e
        self.data_start = 8 + n
        self.metadata = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype, int, int]] = {}
        for name, info in header.items():
            code = info.get("dtype")
            if code not in _ST_CODES:
                raise ValueError(f"{API_IMPORT}: tensor {name!r} in {path!r} has unsupported dtype {code!r}")
            begin, end = info["data_offsets"]
            shape = tuple(info["shape"])
            dtype = _ST_CODES[code]
            if end - begin != _numel(shape) * _itemsize(dtype):
                raise ValueError(f"{API_IMPORT}: tensor {name!r} in {path!r}: data_offsets do not match its shape")
            if self.data_start + end > size:
                raise ValueError(
                    f"{API_IMPORT}: {path!r} is truncated: {size} bytes, tensor {name!r} needs "
                    f"{self.data_start + end}"
                )
            self.tensors[name] = (shape, dtype, begin, end)

    def read(self, name: str, *, releasable: bool = False) -> torch.Tensor:
        """Tensor ``name``; ``releasable=True``: a torch-allocated tensor that the caller frees with
        :meth:`release` (counted until then), else a tracked buffer freed when unreferenced."""
        shape, dtype, begin, end = self.tensors[name]
        if releasable:
            t = torch.empty(shape, dtype=dtype)
            self.tracker._add(end - begin)
        else:
            t = self.tracker.alloc(shape, dtype)
        if end > begin:
            flat = t.reshape(-1).view(torch.uint8)
            with open(self.path, "rb") as f:
                f.seek(self.data_start + begin)
                if releasable:  # numpy views would pin the storage: copy through a bounded block
                    block = bytearray(min(WRITE_SLICE, end - begin))
                    self.tracker._add(len(block))
                    try:
                        pos = 0
                        while pos < end - begin:
                            got = f.readinto(block)
                            if not got:
                                break
                            n = min(got, end - begin - pos)
                            flat[pos: pos + n].copy_(torch.frombuffer(block, dtype=torch.uint8, count=n))
                            pos += n
                    finally:
                        self.tracker._sub(len(block))
                else:
                    pos = f.readinto(memoryview(flat.numpy()))
            if pos != end - begin:
                raise ValueError(f"{API_IMPORT}: {self.path!r} is truncated while reading {name!r}")
            del flat
        return t


# ==================================================================================== names
def _rename(name: str, strip_prefix: str, add_prefix: str) -> str:
    if strip_prefix and name.startswith(strip_prefix):
        name = name[len(strip_prefix):]
    return add_prefix + name


def _shard_groups(entries: list[TensorEntry], max_bytes: int | None) -> list[list[TensorEntry]]:
    if not max_bytes:
        return [entries]
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    return groups


# ==================================================================================== export
# [Note: tied weights on export]
# A DCP checkpoint of a model with tied input/output embeddings holds the tensor under both fqns
# (DCP records no aliasing: two storage entries), while Hugging Face writes it once (the keys of
# ``_tied_weights_keys``, e.g. ``lm_head.weight``, are left out and re-tied by ``from_pretrained``
# when the config says ``tie_word_embeddings``). Offline there is no model to ask, so export uses
# HF's naming convention plus the values: an entry named like an output head (``lm_head.weight``,
# ``output.weight``, optionally under a prefix) is dropped when an input embedding of the same
# prefix (``embed_tokens.weight``, ``tok_embeddings.weight``, ``wte.weight``,
# ``word_embeddings.weight``, ``tok_emb.weight``, possibly one module level down, e.g.
# ``model.embed_tokens.weight``) has the same shape, dtype and bitwise-equal values. Untied heads
# differ from the embedding after any training, so nothing else is dropped; reading both tensors
# of a candidate pair is the one place export holds two tensors at once.
_HEAD_LEAVES = ("lm_head.weight", "output.weight")
_EMBED_LEAVES = ("embed_tokens.weight", "tok_embeddings.weight", "wte.weight", "word_embeddings.weight",
                 "tok_emb.weight")


def _tied_heads(reader: Any, entries: list[Any], names: dict[str, str]) -> set[str]:
    by_name = {names[e.key]: e for e in entries}
    dropped: set[str] = set()
    for name, head in sorted(by_name.items()):
        leaf = next((h for h in _HEAD_LEAVES if name == h or name.endswith("." + h)), None)
        if leaf is None:
            continue
        scope = name[: -len(leaf)]
        for cand_name, emb in sorted(by_name.items()):
            if not cand_name.startswith(scope) or cand_name == name:
                continue
            rest = cand_name[len(scope):]
            if not any(rest == x or (rest.endswith("." + x) and rest.count(".") == x.count(".") + 1)
                       for x in _EMBED_LEAVES):
                continue
            if tuple(emb.shape) != tuple(head.shape) or emb.dtype != head.dtype:
                continue
            a = reader.read(head.key)
            b = reader.read(emb.key)
            same = torch.equal(a, b)
            del a, b
            if same:
                dropped.add(head.key)
                break
    return dropped


def export_safetensors(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    max_shard_size: int | str | None = None,
    state_key: str = MODEL_KEY,
    strip_prefix: str = "",
    add_prefix: str = "",
    tracker: ByteTracker | None = None,
    keep_tied: bool = False,
) -> list[str]:
    """Write the model weights of DCP checkpoint ``src`` as safetensors (streaming, no process group).

    Keys ``"<state_key>.<fqn>"`` become tensor names ``add_prefix + fqn`` (with ``strip_prefix``
    removed from the fqn first where present); optimizer state and non-tensor entries are left
    out. With ``max_shard_size`` (bytes or ``"5GB"``) the weights are split Hugging Face-style
    into ``<stem>-00001-of-0000N.safetensors`` next to ``dst`` plus ``<dst>.index.json`` (a single
    file when they fit). Returns the files written. See [Note: streaming conversion].

    Tied weights are written once, as Hugging Face's ``save_pretrained`` does (see
    [Note: tied weights on export]): an output head bitwise equal to the input embedding of the
    same scope is left out (``keep_tied=True`` writes both).

    Example::

        export_safetensors("ckpt/step-100", "out/model.safetensors", max_shard_size="5GB")
    """
    src, dst = os.fspath(src), os.fspath(dst)
    tracker = tracker or ByteTracker()
    reader = DCPTensorReader(src, tracker, API_EXPORT)
    prefix = f"{state_key}." if state_key else ""
    entries = reader.entries(prefix)
    if not entries:
        raise ValueError(
            f"{API_EXPORT}: checkpoint {src!r} has no tensors under {state_key!r} (keys start with "
            f"{sorted({k.split('.')[0] for k in reader.md.state_dict_metadata})}); pass --state-key"
        )
    reader.check_files([e.key for e in entries])
    names = {e.key: _rename(e.key[len(prefix):], strip_prefix, add_prefix) for e in entries}
    seen: dict[str, str] = {}
    for k, n in names.items():
        if n in seen:
            raise ValueError(f"{API_EXPORT}: keys {seen[n]!r} and {k!r} both become tensor {n!r}")
        seen[n] = k
    if not keep_tied:
        dropped = _tied_heads(reader, entries, names)
        entries = [e for e in entries if e.key not in dropped]
    entries = sorted(entries, key=lambda e: names[e.key])
    groups = _shard_groups(entries, parse_size(max_shard_size))
    out_dir = os.path.dirname(os.path.abspath(dst))
    os.makedirs(out_dir, exist_ok=True)
    meta = {"format": "pt"}
    if len(groups) == 1:
        files = [dst]
    else:
        stem = os.path.basename(dst)
        stem = stem[: -len(".safetensors")] if stem.endswith(".safetensors") else stem
        n = len(groups)
        files = [os.path.join(out_dir, f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]
    for group, path in zip(groups, files):
        w = SafetensorsStreamWriter(path, [(names[e.key], e.shape, e.dtype) for e in group], meta)
        try:
            for e in group:
                t = reader.read(e.key)
                w.write(names[e.key], t)
                del t
            w.close()
        except BaseException:
            w.abort()
            raise
    written = list(files)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {names[e.key]: os.path.basename(f) for g, f in zip(groups, files) for e in g},
        }
        ipath = (dst[: -len(".safetensors")] if dst.endswith(".safetensors") else dst) + ".safetensors.index.json"
        tmp = f"{ipath}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        os.replace(tmp, ipath)
        written.append(ipath)
    _fsync_dir(out_dir)
    return written


# ==================================================================================== import
def _safetensors_files(src: str) -> list[str]:
    if os.path.isdir(src):
        for cand in ("model.safetensors.index.json", "model.safetensors"):
            if os.path.exists(os.path.join(src, cand)):
                return _safetensors_files(os.path.join(src, cand))
        raise FileNotFoundError(
            f"{API_IMPORT}: {src!r} holds neither model.safetensors nor model.safetensors.index.json"
        )
    if src.endswith(".json"):
        if not os.path.isfile(src):
            raise FileNotFoundError(f"{API_IMPORT}: index file {src!r} does not exist")
        try:
            with open(src) as f:
                index = json.load(f)
            files = sorted(set(index["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{API_IMPORT}: {src!r} is not a safetensors index ({type(e).__name__}: {e})") from e
        base = os.path.dirname(os.path.abspath(src))
        return [os.path.join(base, f) for f in files]
    return [src]


def import_safetensors(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    state_key: str = MODEL_KEY,
    strip_prefix: str = "",
    add_prefix: str = "",
    tracker: ByteTracker | None = None,
) -> str:
    """Build a DCP checkpoint ``dst`` from safetensors ``src`` (a file, an index json or a
    directory), streaming and without a process group.

    Tensor ``name`` becomes key ``"<state_key>.<add_prefix + name minus strip_prefix>"``, the
    layout :func:`matrixfsdp.checkpoint.load` and ``dcp.load({"model": ...})`` read at any world
    size (load the model only: the checkpoint has no optimizer state). Written to a temporary
    sibling directory and renamed when complete. Returns ``dst``.

    Example::

        import_safetensors("Qwen3-0.6B/", "ckpt/init")
        matrixfsdp.checkpoint.load("ckpt/init", model)   # then build the optimizer and train
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    src, dst = os.fspath(src), os.fspath(dst)
    tracker = tracker or ByteTracker()
    readers = [SafetensorsReader(f, tracker) for f in _safetensors_files(src)]
    where: dict[str, SafetensorsReader] = {}
    for r in readers:
        for name in r.tensors:
            if name in where:
                raise ValueError(f"{API_IMPORT}: tensor {name!r} is in both {where[name].path!r} and {r.path!r}")
            where[name] = r
    if not where:
        raise ValueError(f"{API_IMPORT}: {src!r} holds no tensors")
    keys: dict[str, str] = {}
    for name in sorted(where):
        key = f"{state_key}.{_rename(name, strip_prefix, add_prefix)}" if state_key else _rename(name, strip_prefix, add_prefix)
        if key in keys:
            raise ValueError(f"{API_IMPORT}: tensors {keys[key]!r} and {name!r} both become key {key!r}")
        keys[key] = name

    meta_sd: dict[str, Any] = {}
    for key, name in keys.items():
        shape, dtype, _, _ = where[name].tensors[name]
        meta_sd[key] = torch.empty(shape, dtype=dtype, device="meta")

    class _LazyPlanner(DefaultSavePlanner):
        """Resolves each tensor from safetensors when the writer asks for it (one at a time)."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, dedup_save_to_lowest_rank=False)
            self._prev: torch.Tensor | None = None

        def resolve_data(self, write_item: Any) -> Any:
            # DCP's writer asks for tensor n+1 only after tensor n's file is written and closed,
            # but its loop variable still references tensor n: free its storage explicitly.
            self.release()
            key = write_item.index.fqn
            self._prev = where[keys[key]].read(keys[key], releasable=True)
            return self._prev

        def release(self) -> None:
            if self._prev is not None:
                n = self._prev.untyped_storage().nbytes()
                self._prev.untyped_storage().resize_(0)
                tracker._sub(n)
                self._prev = None

    tmp = f"{dst}.tmp-{uuid.uuid4().hex[:12]}"
    # One data file per tensor: DCP's writer keeps a file's tensors alive until the file is closed.
    writer = FileSystemWriter(tmp, single_file_per_rank=False, thread_count=1, sync_files=True)
    planner = _LazyPlanner()
    try:
        dcp_save(meta_sd, storage_writer=writer, planner=planner, no_dist=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        planner.release()
    from .dcp import _commit

    _commit(tmp, dst, uuid.uuid4().hex[:12])
    return dst
