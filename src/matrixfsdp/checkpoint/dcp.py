"""Checkpointing matrixfsdp models with ``torch.distributed.checkpoint`` (DCP).

Two ways to save and resume, both writing the same DCP checkpoint:

* **the standard DCP path**, unchanged::

      from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
      msd, osd = get_state_dict(model, opt)
      dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)        # or dcp.async_save
      ...
      msd, osd = get_state_dict(model, opt)          # templates in the *current* layout
      sd = {"model": msd, "optim": osd}
      dcp.load(sd, checkpoint_id=path)
      set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

* **the helpers** :func:`save` / :func:`load`, on top of the same calls, which add an atomic
  commit (see [Note: atomic save]) and all-or-nothing, validated loading (see
  [Note: validated load]).

[Note: who writes which chunk]
A model state dict holds the parameters themselves. An owned parameter is a ``[Replicate()]``
DTensor on its one-rank owner mesh: DCP creates a write item for it only from the owner with
the whole tensor as one chunk at offset 0 (the other ranks are outside that mesh; their empty
items are dropped by DCP's planning), so it is written once, by its owner, with no gather.
Evenly sharded parameters are ``Shard(0)`` DTensors: every rank writes its ``torch.chunk`` rows,
exactly as stock FSDP2. Optimizer state follows the same layout, see
[Note: optimizer state in state dicts] in ``optim/state_dict.py``: the owner writes the full momentum /
moments / factors / eigenbases of its matrices; ``Shard(0)`` state is written as row shards;
scalar step counters are plain tensors (de-duplicated by DCP). Loading reads, for each tensor the
*loading* side presents, the overlapping parts of the saved chunks, so any layout can be loaded
from any other: another world size, another owner plan, stock FSDP2, or one process.

[Note: atomic save]
:func:`save` writes to ``<path>.tmp-<token>`` (a fresh sibling directory; ``token`` is chosen by
rank 0 and broadcast), waits for every rank (``dcp.save`` returns after rank 0 wrote the
``.metadata`` file) and then rank 0 renames the directory to ``<path>`` (one ``rename``: atomic
on POSIX file systems). If ``<path>`` already exists it is first renamed to
``<path>.old-<token>`` and removed after the commit; a crash between those two renames leaves
both complete directories and :func:`load` names the old one. A crash before the commit leaves
only a ``.tmp-`` directory, so the previous checkpoint in the same folder (and ``<path>`` itself
when overwriting) is never touched.

[Note: validated load]
:func:`load` first builds *fresh* buffers in the current layout (never the live parameters or
optimizer state), checks every key, shape, dtype and data file against the checkpoint metadata
on every rank and agrees on the first error across ranks (so all ranks raise the same error and
none hangs), then reads with ``dcp.load`` into the buffers (``.metadata`` allow-listed, non-tensor
values with ``weights_only=True``: see ``safe_pickle.py``), checks the optimizer's param groups,
and only then applies: ``optimizer.load_state_dict`` and a copy into each parameter's local
tensor. Any error before the apply leaves the model and optimizer untouched. The buffers cost
one extra copy of this rank's shards while loading.
"""

from __future__ import annotations

import copy
import os
import shutil
import uuid
from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate

from .._fully_shard import drop_stale_state, materialized_modules
from ..comm.agree import agree, encode_error, is_distributed
from ..optim._base import MatrixOptimizer
from ..placement.experts import expert_rows, wrap_expert_tensor
from ..placement.owned_tensor import local_tensor, owned_of, wrap_dtensor
from ..placement.owner import keeps_state
from ..placement.tp_host import tp_host_of
from .safe_pickle import SafeFileSystemReader, SafeLoadPlanner, UntrustedCheckpointError, load_metadata

__all__ = ["save", "load", "model_state_dict", "optimizer_state_dict", "MODEL_KEY", "OPTIM_KEY"]

#: Top-level keys of the state dict :func:`save` writes (and the CLI's default namespace).
MODEL_KEY = "model"
OPTIM_KEY = "optim"


# ==================================================================================== state dicts
def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(model)``: the parameters (DTensors under matrixfsdp) and buffers by fqn."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def _param_fqns(model: nn.Module) -> dict[int, str]:
    out: dict[int, str] = {}
    for fqn, p in model.named_parameters():
        out.setdefault(id(p), fqn)
    return out


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict keyed by parameter fqn, as ``get_optimizer_state_dict`` returns
    it, but without initializing missing state by a zero-gradient ``step()`` (torch's
    ``_init_optim_state``): a state that does not exist yet is simply absent.

    Example::

        osd = matrixfsdp.checkpoint.optimizer_state_dict(model, opt)
        osd["state"]["blocks.0.wqkv.weight"]["momentum_buffer"]  # a DTensor on its owner
    """
    fqns = _param_fqns(model)
    params = list(chain.from_iterable(g["params"] for g in optimizer.param_groups))
    names = []
    for i, p in enumerate(params):
        if id(p) not in fqns:
            raise ValueError(
                f"matrixfsdp.checkpoint: optimizer parameter {i} (shape {tuple(p.shape)}) is not a "
                "parameter of the model; build the optimizer from model.parameters() after "
                "fully_shard"
            )
        names.append(fqns[id(p)])
    sd = optimizer.state_dict()
    state = {names[i]: st for i, st in sd["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


# ==================================================================================== collectives
def _rank(process_group: Any = None) -> int:
    return dist.get_rank(process_group) if is_distributed() else 0


def _barrier(process_group: Any = None) -> None:
    if is_distributed():
        dist.barrier(group=process_group)


# ==================================================================================== save
def _check_sharded(model: nn.Module, api: str) -> None:
    busy = materialized_modules(model)
    if busy:
        raise RuntimeError(
            f"{api}: module {busy[0]!r} holds materialized (unsharded) parameters; "
            "a forward is still awaiting its backward: run the backward first (run forwards whose "
            "outputs you discard under torch.no_grad())"
        )


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: Any = None,
) -> str:
    """Save ``model`` (and ``optimizer``) to the DCP checkpoint directory ``path``, atomically.

    Call on every rank. Writes ``{"model": ..., "optim": ...}`` with ``dcp.save`` into
    ``<path>.tmp-<token>`` and renames it to ``path`` once every rank is done (see
    [Note: atomic save]); each owned tensor is written once by its owner, even shards by each
    rank (see [Note: who writes which chunk]). The result is a plain DCP checkpoint: ``dcp.load``
    and :func:`load` read it at any world size. Returns ``path``.

    Example::

        matrixfsdp.checkpoint.save(f"ckpt/step-{step}", model, opt)
    """
    api = "matrixfsdp.checkpoint.save"
    path = os.path.normpath(os.fspath(path))  # "ck/" must not put the staging dir inside "ck"
    error = None
    try:
        drop_stale_state(model)
        _check_sharded(model, api)
        sd: dict[str, Any] = {MODEL_KEY: model_state_dict(model)}
        if optimizer is not None:
            sd[OPTIM_KEY] = optimizer_state_dict(model, optimizer)
    except (ValueError, RuntimeError) as e:
        error = encode_error(e)
    agree(error, group=process_group)
    token = [uuid.uuid4().hex[:12] if _rank(process_group) == 0 else None]
    if is_distributed():
        dist.broadcast_object_list(token, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                                   group=process_group)
    tmp = f"{path}.tmp-{token[0]}"
    dcp.save(sd, checkpoint_id=tmp, process_group=process_group)
    _barrier(process_group)
    error = None
    if _rank(process_group) == 0:
        try:
            _commit(tmp, path, token[0])
        except OSError as e:  # every rank must learn it, or the others wait forever
            error = encode_error(RuntimeError(f"{api}: could not commit {tmp!r} to {path!r}: {e}"))
    agree(error, group=process_group)
    return path


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _commit(tmp: str, path: str, token: str) -> None:
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{token}"
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ==================================================================================== load
def _read_failure(e: CheckpointException, api: str, path: str) -> str:
    """The error (``encode_error`` form) for a failed ``dcp.load``: a refused untrusted value (the
    lowest rank's) as a ``ValueError`` with its own message, anything else as a RuntimeError."""
    for rank in sorted(e.failures):
        exc = e.failures[rank][0]
        if isinstance(exc, UntrustedCheckpointError):
            return encode_error(exc)
    return encode_error(RuntimeError(f"{api}: reading checkpoint {path!r} failed; the model and optimizer "
                                     f"are unchanged:\n{e}"))


def _fresh_like(v: Any) -> Any:
    """A new, uninitialized tensor with ``v``'s layout (never aliasing ``v``)."""
    rows = expert_rows(v)
    if rows is not None:  # an expert stack: its rows are the plan's, which DCP asks the class for
        return wrap_expert_tensor(torch.empty_like(v._local_tensor), v.device_mesh, rows, tuple(v.shape))
    if isinstance(v, DTensor):
        return DTensor(torch.empty_like(v._local_tensor), v._spec, requires_grad=False)
    if isinstance(v, torch.Tensor):
        return torch.empty_like(v)
    return copy.deepcopy(v)


def read_metadata(path: str | os.PathLike, api: str = "matrixfsdp.checkpoint") -> Metadata:
    """The DCP metadata of checkpoint directory ``path`` (no process group needed).

    Raises ``FileNotFoundError`` naming the missing directory or ``.metadata`` file (and an
    interrupted overwrite's ``.old-`` directory if there is one) and ``ValueError`` for an
    unreadable one.
    """
    path = os.fspath(path)
    mfile = os.path.join(path, ".metadata")
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path)) or "."
        base = os.path.basename(os.path.abspath(path))
        leftovers = sorted(n for n in os.listdir(parent) if n.startswith(base + ".")) if os.path.isdir(parent) else []
        hint = ""
        olds = [n for n in leftovers if n.startswith(base + ".old-")]
        tmps = [n for n in leftovers if n.startswith(base + ".tmp-")]
        if olds:
            hint = f"; an interrupted overwrite left the previous checkpoint at {os.path.join(parent, olds[-1])!r}"
        elif tmps:
            hint = f"; {os.path.join(parent, tmps[-1])!r} is an unfinished save (a crash before the commit)"
        raise FileNotFoundError(f"{api}: checkpoint directory {path!r} does not exist{hint}")
    if not os.path.isfile(mfile):
        raise FileNotFoundError(
            f"{api}: {mfile!r} is missing; {path!r} is not a complete DCP checkpoint (an "
            "unfinished save writes .metadata last)"
        )
    with open(mfile, "rb") as f:
        return load_metadata(f, mfile, api)  # allow-listed unpickling: a foreign global is refused


def check_files(path: str, md: Metadata, keys: Iterable[str] | None = None, api: str = "matrixfsdp.checkpoint") -> None:
    """Every data file the metadata references (for ``keys``, or all) exists and is long enough."""
    want = None if keys is None else set(keys)
    need: dict[str, tuple[int, str]] = {}
    for index, info in (md.storage_data or {}).items():
        if want is not None and index.fqn not in want:
            continue
        end = int(info.offset) + int(info.length)
        rel = info.relative_path
        if rel not in need or need[rel][0] < end:
            need[rel] = (end, index.fqn)
    for rel, (end, key) in sorted(need.items()):
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{api}: data file {f!r} is missing (it holds key {key!r})")
        size = os.path.getsize(f)
        if size < end:
            raise ValueError(
                f"{api}: data file {f!r} is truncated: {size} bytes, but the metadata needs {end} "
                f"(key {key!r})"
            )


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _check_tensor(api: str, key: str, tmeta: Any, value: torch.Tensor, path: str) -> None:
    if not isinstance(tmeta, TensorStorageMetadata):
        raise ValueError(f"{api}: key {key!r} in {path!r} is not a tensor ({type(tmeta).__name__})")
    saved_shape, shape = tuple(tmeta.size), tuple(value.shape)
    if saved_shape != shape:
        raise ValueError(
            f"{api}: shape mismatch for {key!r}: the checkpoint {path!r} has {saved_shape}, "
            f"the model/optimizer expects {shape}"
        )
    saved_dtype = tmeta.properties.dtype
    if saved_dtype != value.dtype:
        raise ValueError(
            f"{api}: dtype mismatch for {key!r}: the checkpoint {path!r} has "
            f"{_dtype_name(saved_dtype)}, the model/optimizer expects {_dtype_name(value.dtype)}"
        )
    numel = 1
    for s in saved_shape:
        numel *= s
    covered = 0
    for c in tmeta.chunks:
        n = 1
        for s in c.sizes:
            n *= s
        covered += n
    if covered != numel:
        raise ValueError(
            f"{api}: the chunks of {key!r} in {path!r} cover {covered} of {numel} elements; the "
            "checkpoint metadata is inconsistent"
        )


def _state_template(api: str, p: torch.Tensor, fqn: str, name: str, tmeta: TensorStorageMetadata,
                    hosted_whole: bool = True) -> Any:
    """A fresh buffer for optimizer state ``name`` of parameter ``p`` in ``p``'s current layout;
    ``None`` when this rank keeps no such state (a non-owner of an owned or replicated parameter;
    an empty shard's state of another shape). An empty ``Shard(0)`` shard gets empty buffers and its
    step counter, as torch's optimizers keep them. ``hosted_whole``: the optimizer steps TP-hosted
    matrices on their hosts (``matrixfsdp.optim``), whose state is whole there; a stock optimizer
    (``torch.optim.AdamW``) steps them shard by shard on the owner's TP row, state like the
    parameter, as does a matrixfsdp optimizer that keeps a hosted matrix's state on the shards
    (``state_on_shards``)."""
    shape, dtype = tuple(tmeta.size), tmeta.properties.dtype
    local = local_tensor(p)
    if not isinstance(p, DTensor):
        if not keeps_state(p):
            return None  # matrixfsdp.replicate: the owner keeps (and loads) this state
        return torch.empty(shape, dtype=dtype, device=p.device)
    counts = expert_rows(p)
    if counts is not None:
        return _expert_state_template(api, p, fqn, name, shape, dtype, counts)
    host = tp_host_of(p) if hosted_whole else None
    if host is not None:  # a TP-hosted matrix: its host keeps the whole state (placement/tp_host.py)
        if not keeps_state(p):
            return None
        buf = torch.empty(shape, dtype=dtype, device=local.device)
        return buf if len(shape) == 0 or host.host_mesh is None else wrap_dtensor(buf, host.host_mesh, (Replicate(),), shape)
    info = owned_of(p)
    if info is not None:
        # (a stock optimizer's TP-hosted matrix: every rank of the owner's TP row keeps state)
        if not (keeps_state(p) if tp_host_of(p) is None else info.is_local):
            return None
        if name == "step" or shape != tuple(p.shape):
            # counters, and whole-matrix state of other shapes (Shampoo/SOAP factors)
            return torch.empty(shape, dtype=dtype, device=local.device)
        buf = torch.empty(local.shape, dtype=dtype, device=local.device)  # whole, or a TP owner's shard
        # Same layout as the parameter: torch optimizers (AdamW on DTensor params) keep their
        # state as DTensors like the parameter; matrixfsdp's accept either.
        return wrap_dtensor(buf, p.device_mesh, p.placements, shape)
    if len(shape) == 0:
        # a step counter: every rank keeps one, an empty shard's too (torch's optimizers create
        # state for every shard); loading it keeps the ranks' counters equal, so DCP's one writer
        # of this replicated value writes the right one
        return torch.empty((), dtype=dtype, device=local.device)
    if local.numel() == 0 and shape != tuple(p.shape):
        return None
    if shape != tuple(p.shape):
        raise ValueError(
            f"{api}: optimizer state {name!r} of {fqn!r} has shape {shape} in the checkpoint, "
            f"which cannot be placed on a parameter sharded as {tuple(p.placements)} with shape "
            f"{tuple(p.shape)} (only whole-matrix owners keep state of another shape)"
        )
    buf = torch.empty(local.shape, dtype=dtype, device=local.device)
    return wrap_dtensor(buf, p.device_mesh, p.placements, shape)


def _expert_state_template(api: str, p: torch.Tensor, fqn: str, name: str, shape: tuple[int, ...],
                           dtype: torch.dtype, counts: tuple[int, ...]) -> Any:
    """A buffer for state ``name`` of expert stack ``p``: this rank's experts' rows of the saved
    ``[E * f, ...]`` state (``f`` rows per expert), as the optimizer presents it
    ([Note: optimizer state in state dicts]); ``None`` on a rank holding none of its experts."""
    local = local_tensor(p)
    n = local.shape[0]
    if n == 0:
        return None  # the ranks holding its experts keep (and load) its state
    if len(shape) == 0:
        return torch.empty((), dtype=dtype, device=local.device)  # an AdamW-routed stack's counter
    E = sum(counts)
    if shape[0] % E:
        raise ValueError(
            f"{api}: optimizer state {name!r} of expert stack {fqn!r} has shape {shape} in the "
            f"checkpoint, which is not a whole number of rows for each of the stack's {E} experts "
            f"(global shape {tuple(p.shape)}): a checkpoint of another expert count"
        )
    f = shape[0] // E
    buf = torch.empty((n * f, *shape[1:]), dtype=dtype, device=local.device)
    return wrap_expert_tensor(buf, p.device_mesh, tuple(c * f for c in counts), shape)


def _flat_keys(prefix: str, obj: Any) -> dict[str, Any]:
    """DCP's flattening of nested dicts (lists of dicts for param_groups)."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_keys(f"{prefix}.{k}", v))
    elif isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        for i, v in enumerate(obj):
            out.update(_flat_keys(f"{prefix}.{i}", v))
    else:
        out[prefix] = obj
    return out


# [Note: state of other optimizers]
# A checkpoint of another optimizer (stock torch.optim.Muon + AdamW under FSDP2 or FSDP2 + TP,
# saved with get_state_dict(model, (muon, adamw)) + dcp.save) has torch's param groups: other
# hyperparameter keys (AdamW's "betas", no "algorithm"/"adamw_lr"/"routes"), so it cannot be
# loaded as a matrixfsdp optimizer's param groups. Its *state* can: torch.optim.Muon's
# "momentum_buffer" is the same EMA of the gradients as matrixfsdp's Muon rule (op for op, see
# optim/rules/muon.py), and AdamW's "exp_avg"/"exp_avg_sq"/"step" are matrixfsdp's AdamW rule's. With
# hparams="optimizer" every parameter's saved state must (1) have exactly the keys this optimizer
# keeps for it (its state schema; placeholder keys may be absent) and (2) come from a param group
# whose optimizer applies this optimizer's rule for it: a matrixfsdp group's recorded "routes", a
# torch.optim.Muon group ("ns_coefficients", "ns_steps", ...) for the muon rule, a torch Adam/AdamW
# group ("betas", "amsgrad"; not maximize/amsgrad) for AdamW. Key names alone are not enough: SGD
# also keeps a "momentum_buffer", a plain sum of gradients, not Muon's EMA.
_TORCH_MUON_KEYS = frozenset({"momentum", "nesterov", "ns_coefficients", "ns_steps"})
_TORCH_ADAM_KEYS = frozenset({"betas", "amsgrad"})


def _saved_group_names(saved: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """``{group index: {entry name: its metadata}}`` of the checkpoint's optimizer param groups."""
    prefix = f"{OPTIM_KEY}.param_groups."
    groups: dict[int, dict[str, Any]] = {}
    for key, meta in saved.items():
        if key.startswith(prefix):
            index, _, name = key[len(prefix):].partition(".")
            if index.isdigit() and name:
                groups.setdefault(int(index), {})[name] = meta
    return groups


def _refuse_foreign_groups(api: str, path: str, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """A matrixfsdp optimizer cannot take another optimizer's param groups (hparams='checkpoint')."""
    if not isinstance(optimizer, MatrixOptimizer):
        return
    for i, names in sorted(_saved_group_names(saved).items()):
        if "algorithm" not in names:
            raise ValueError(
                f"{api}: the optimizer state in {path!r} was not written by a matrixfsdp optimizer: "
                f"its param group {i} holds {sorted(n for n in names if n != 'params')}, not "
                f"{type(optimizer).__name__}'s hyperparameters (e.g. stock torch.optim.Muon + AdamW). "
                "Pass hparams='optimizer' to load its state tensors where they mean the same "
                "(torch.optim.Muon's momentum_buffer, AdamW's exp_avg/exp_avg_sq/step) and keep this "
                "optimizer's hyperparameters, or load the weights alone with load(path, model)"
            )


def _saved_groups_template(api: str, path: str, saved: dict[str, Any]) -> list[dict[str, Any]]:
    """Buffers to read the checkpoint's own param groups into (hparams='optimizer')."""
    groups = _saved_group_names(saved)
    if sorted(groups) != list(range(len(groups))):
        raise ValueError(f"{api}: the optimizer param groups of {path!r} are numbered {sorted(groups)}, "
                         "not 0, 1, ...; the checkpoint metadata is inconsistent")
    out = []
    for i in range(len(groups)):
        g: dict[str, Any] = {}
        for name, meta in groups[i].items():
            if isinstance(meta, TensorStorageMetadata):  # a tensor hyperparameter (capturable lr)
                g[name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            else:
                g[name] = b""  # a plain value: DCP replaces the placeholder
        out.append(g)
    return out


def _check_state_keys(api: str, path: str, optimizer: Any, p: torch.Tensor, fqn: str, names: set[str]) -> None:
    """The saved state of ``p`` has the keys this optimizer keeps for it (hparams='optimizer')."""
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    expected = set(optimizer._state_schema(p, group))
    optional = set(getattr(optimizer, "_state_placeholders", {}))
    if names - expected or (expected - optional) - names:
        raise ValueError(
            f"{api}: the optimizer state of {fqn!r} in {path!r} has keys {sorted(names)}, but "
            f"{type(optimizer).__name__} keeps {sorted(expected)} for it (the "
            f"{optimizer._route(group, p)!r} rule): it was written by another kind of optimizer. "
            "Load the weights alone with load(path, model) and start the optimizer afresh"
        )


def _saved_rule(g: dict[str, Any] | None, fqn: str) -> tuple[str | None, str]:
    """The rule the optimizer of saved param group ``g`` applied to ``fqn``, and who that was."""
    if g is None:
        return None, "no param group of the checkpoint"
    if "algorithm" in g:
        routes = g.get("routes")
        if routes is not None:
            return routes[list(g["params"]).index(fqn)], "a matrixfsdp optimizer"
        return (None if g["algorithm"] == "auto" else g["algorithm"]), "a matrixfsdp optimizer"
    keys = set(g)
    if _TORCH_MUON_KEYS <= keys:
        return "muon", "torch.optim.Muon"
    if _TORCH_ADAM_KEYS <= keys:
        if g.get("amsgrad") or g.get("maximize"):
            return None, "torch.optim.Adam/AdamW with amsgrad or maximize"
        return "adamw", "torch.optim.AdamW/Adam"
    return None, f"an optimizer this loader does not know (param group keys {sorted(keys - {'params'})})"


def _check_saved_rules(api: str, path: str, model: nn.Module, optimizer: Any, groups: list[dict[str, Any]],
                       with_state: set[str]) -> str | None:
    """The error (``encode_error`` form) if a parameter's saved state comes from another rule."""
    group_of: dict[str, dict[str, Any]] = {}
    for g in groups:
        for f in g.get("params", ()):
            group_of.setdefault(f, g)
    fqns = _param_fqns(model)
    for group in optimizer.param_groups:
        for p in group["params"]:
            fqn = fqns[id(p)]
            if fqn not in with_state:
                continue
            live = optimizer._route(group, p)
            rule, who = _saved_rule(group_of.get(fqn), fqn)
            if rule != live:
                return encode_error(ValueError(
                    f"{api}: the optimizer state of {fqn!r} in {path!r} was written by {who}"
                    f"{f' (the {rule!r} rule)' if rule else ''}, but {type(optimizer).__name__} "
                    f"steps it with the {live!r} rule, whose state means something else. Load the "
                    "weights alone with load(path, model) and start the optimizer afresh"
                ))
    return None


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    process_group: Any = None,
    hparams: str = "checkpoint",
) -> None:
    """Load a DCP checkpoint into ``model`` (and ``optimizer``), validated and all-or-nothing.

    Call on every rank. Works at any world size and layout (matrixfsdp at another owner plan,
    stock FSDP2, a plain module in one process): every tensor is read in the layout the live
    model/optimizer has now, so optimizer state follows its parameter to its new owner. Reads
    checkpoints written by :func:`save` or by the standard ``dcp.save({"model": ..., "optim":
    ...})``. ``strict=False`` tolerates checkpoint keys the model lacks and model keys the
    checkpoint lacks (they keep their values); shapes and dtypes are always checked.

    Optimizer state is loaded for the parameters the checkpoint has state for; others stay
    uninitialized, as in an optimizer that never stepped them. Hyperparameters (``lr`` ...)
    come from the checkpoint, as with ``Optimizer.load_state_dict`` (``hparams="checkpoint"``).

    ``hparams="optimizer"`` (a ``matrixfsdp.optim`` optimizer) loads the state tensors only and
    keeps the live optimizer's param groups: for checkpoints of other optimizers whose state
    means the same, such as stock ``torch.optim.Muon`` + ``torch.optim.AdamW`` (FSDP2, FSDP2 +
    TP; see [Note: state of other optimizers]). Refused, naming the parameter, when a
    parameter's saved state has other keys than this optimizer keeps for it, or was written by an
    optimizer whose rule differs from this optimizer's rule for it. With the default, a
    checkpoint whose param groups are not a matrixfsdp optimizer's is refused, naming both ways
    out (``hparams="optimizer"``, or ``load(path, model)`` for the weights alone).

    Errors (``FileNotFoundError``/``ValueError``/``RuntimeError``) name the key or file and the
    values seen; the model and optimizer are untouched when one is raised (see
    [Note: validated load]).

    Example::

        model, opt = build()                      # any world size
        matrixfsdp.checkpoint.load("ckpt/step-100", model, opt)
    """
    api = "matrixfsdp.checkpoint.load"
    path = os.path.normpath(os.fspath(path))
    error: str | None = None
    model_tpl: dict[str, Any] = {}
    optim_tpl: dict[str, Any] = {}
    groups_tpl: list[dict[str, Any]] = []
    state_tpl: dict[str, dict[str, Any]] = {}
    saved_state_fqns: set[str] = set()
    kept_elsewhere: dict[str, dict[str, Any]] = {}  # state this rank does not keep, by fqn
    try:
        if hparams not in ("checkpoint", "optimizer"):
            raise ValueError(f"{api}: hparams must be 'checkpoint' or 'optimizer', got {hparams!r}")
        # Loading writes into the sharded local tensors: materialized copies must go first,
        # or a model whose root is materialized would be loaded into soon-freed buffers.
        drop_stale_state(model)
        _check_sharded(model, api)
        md = read_metadata(path, api)
        saved = md.state_dict_metadata
        live_model = model_state_dict(model)
        model_tpl = {k: _fresh_like(v) for k, v in live_model.items()}
        want = {f"{MODEL_KEY}.{k}": v for k, v in model_tpl.items()}
        have_model = {k for k in saved if k.startswith(MODEL_KEY + ".")}
        found = [k for k in want if k in saved]
        if want and len(found) * 2 < len(want):
            example_saved = sorted(have_model)[:2] or sorted(saved)[:2]
            raise ValueError(
                f"{api}: {path!r} is not a checkpoint of this model: only {len(found)} of its "
                f"{len(want)} model keys are there (e.g. {next(k for k in want if k not in saved)!r} "
                f"is missing; the checkpoint has {example_saved})"
            )
        for key, v in want.items():
            if key not in saved:
                if strict:
                    raise ValueError(f"{api}: key {key!r} is missing from checkpoint {path!r}")
                model_tpl.pop(key[len(MODEL_KEY) + 1:])
                continue
            if isinstance(v, torch.Tensor):
                _check_tensor(api, key, saved[key], v, path)
        if strict:
            extra = sorted(have_model - set(want))
            if extra:
                raise ValueError(
                    f"{api}: checkpoint {path!r} has {len(extra)} model key(s) the model lacks, e.g. "
                    f"{extra[0]!r} (strict=True)"
                )
        if optimizer is not None:
            osd = optimizer_state_dict(model, optimizer)
            params = {fqn: p for fqn, p in model.named_parameters()}
            opt_fqns = list(chain.from_iterable(g["params"] for g in osd["param_groups"]))
            state_keys = [k for k in saved if k.startswith(f"{OPTIM_KEY}.state.")]
            hosted_whole = isinstance(optimizer, MatrixOptimizer)
            if not any(k.startswith(f"{OPTIM_KEY}.") for k in saved):
                raise ValueError(f"{api}: checkpoint {path!r} has no optimizer state (no {OPTIM_KEY!r} keys)")
            if hparams == "optimizer":
                if not isinstance(optimizer, MatrixOptimizer):
                    raise ValueError(
                        f"{api}: hparams='optimizer' needs a matrixfsdp.optim optimizer, got "
                        f"{type(optimizer).__name__}; load a torch optimizer's state with "
                        "hparams='checkpoint' (the same optimizer class) or load(path, model)"
                    )
                groups_tpl = _saved_groups_template(api, path, saved)
            else:
                _refuse_foreign_groups(api, path, optimizer, saved)
                groups_tpl = [{k: copy.deepcopy(v) for k, v in g.items()} for g in osd["param_groups"]]
            claimed: set[str] = set()
            for fqn in opt_fqns:
                prefix = f"{OPTIM_KEY}.state.{fqn}."
                if hparams == "optimizer":
                    names = {k[len(prefix):] for k in state_keys if k.startswith(prefix)}
                    if names:
                        saved_state_fqns.add(fqn)
                        _check_state_keys(api, path, optimizer, params[fqn], fqn, names)
                for key in state_keys:
                    if not key.startswith(prefix):
                        continue
                    claimed.add(key)
                    name = key[len(prefix):]
                    tmeta = saved[key]
                    if isinstance(tmeta, BytesStorageMetadata):
                        buf: Any = None  # a non-tensor state value: loaded as bytes
                        state_tpl.setdefault(fqn, {})[name] = buf
                        continue
                    whole = hosted_whole and not optimizer.state_on_shards(params[fqn])
                    buf = _state_template(api, params[fqn], fqn, name, tmeta, whole)
                    if buf is not None:
                        _check_tensor(api, key, tmeta, buf, path)
                        state_tpl.setdefault(fqn, {})[name] = buf
                    elif whole and (owned_of(params[fqn]) is not None or expert_rows(params[fqn]) is not None
                                           or tp_host_of(params[fqn]) is not None):
                        kept_elsewhere.setdefault(fqn, {})[name] = None
            unclaimed = sorted(set(state_keys) - claimed)
            if unclaimed and strict:
                raise ValueError(
                    f"{api}: checkpoint {path!r} has optimizer state for a parameter the optimizer "
                    f"does not hold: {unclaimed[0]!r} (strict=True)"
                )
            flat_groups = _flat_keys(f"{OPTIM_KEY}.param_groups", groups_tpl)
            for key in flat_groups if hparams == "checkpoint" else ():
                if key not in saved:
                    raise ValueError(
                        f"{api}: optimizer param group entry {key!r} is missing from checkpoint "
                        f"{path!r} (another optimizer or another param-group layout?)"
                    )
            extra_groups = sorted(
                k for k in saved if k.startswith(f"{OPTIM_KEY}.param_groups.") and k not in flat_groups
                and hparams == "checkpoint"
            )
            if extra_groups:
                raise ValueError(
                    f"{api}: checkpoint {path!r} has optimizer param group entry {extra_groups[0]!r} "
                    "that this optimizer lacks (another optimizer or another param-group layout?)"
                )
            optim_tpl = {"state": state_tpl, "param_groups": groups_tpl}
        sd_keys = [f"{MODEL_KEY}.{k}" for k in model_tpl]
        if optimizer is not None:
            sd_keys += [f"{OPTIM_KEY}.state.{f}.{n}" for f, st in state_tpl.items() for n in st]
            sd_keys += list(_flat_keys(f"{OPTIM_KEY}.param_groups", groups_tpl))
        check_files(path, md, sd_keys, api)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        error = encode_error(e)
    agree(error, group=process_group)

    # Non-tensor optimizer state needs a placeholder DCP can replace.
    for st in state_tpl.values():
        for n, v in st.items():
            if v is None:
                st[n] = b""
    sd: dict[str, Any] = {MODEL_KEY: model_tpl}
    if optimizer is not None:
        sd[OPTIM_KEY] = optim_tpl
    error = None
    try:
        # SafeLoadPlanner: non-tensor values (param groups ...) are read with weights_only=True
        dcp.load(sd, storage_reader=SafeFileSystemReader(path), process_group=process_group,
                 planner=SafeLoadPlanner(path, allow_partial_load=not strict, api=api))
    except CheckpointException as e:  # DCP raises it on every rank, with every rank's failure
        error = _read_failure(e, api, path)
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"{api}: reading checkpoint {path!r} failed ({type(e).__name__}: {e}); "
                           "the model and optimizer are unchanged") from e
    model_tpl = sd[MODEL_KEY]

    if optimizer is not None and error is None:
        loaded_groups = sd[OPTIM_KEY]["param_groups"]
        live_groups = optimizer_state_dict(model, optimizer)["param_groups"]
        if hparams == "optimizer":  # the live param groups stay; the saved ones only vouch for the state
            error = _check_saved_rules(api, path, model, optimizer, loaded_groups, saved_state_fqns)
            sd[OPTIM_KEY]["param_groups"] = live_groups
            loaded_groups = []
        for i, (g, live) in enumerate(zip(loaded_groups, live_groups)):
            if list(g["params"]) != list(live["params"]):
                diff = next((a, b) for a, b in zip(list(g["params"]) + [None] * len(live["params"]),
                                                   list(live["params"]) + [None] * len(g["params"])) if a != b)
                error = (f"ValueError|{api}: param group {i} of checkpoint {path!r} holds other "
                         f"parameters than the optimizer's (first difference: checkpoint {diff[0]!r}, "
                         f"optimizer {diff[1]!r})")
                break
    agree(error, group=process_group)

    # ---- apply (cannot fail on validated input)
    if optimizer is not None:
        # A matrixfsdp optimizer learns which state is kept on other ranks (an owned parameter's
        # owner, the ranks holding a stack's experts) from entries it then drops, as after a
        # step: its state_dict() presents their keys on every rank (optim/state_dict.py), so the
        # ranks' keys match, which torch's full state dict needs (it gathers key by key).
        state = {**{f: st for f, st in kept_elsewhere.items()}, **sd[OPTIM_KEY]["state"]}
        optimizer.load_state_dict({"state": state, "param_groups": sd[OPTIM_KEY]["param_groups"]})
    live = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, v in model_tpl.items():
            target = live[k]
            if isinstance(target, torch.Tensor):
                dst = local_tensor(target)
                src = local_tensor(v)
                if dst.numel():
                    dst.copy_(src)
            else:  # pragma: no cover - non-tensor extra state
                pass
