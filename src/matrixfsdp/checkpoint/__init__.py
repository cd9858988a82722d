"""Checkpoints of matrixfsdp models: DCP save/load helpers and the offline export/import CLI.

Saving and resuming use ``torch.distributed.checkpoint`` (DCP); the standard path
(``get_state_dict`` / ``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` / ``set_state_dict``)
works unchanged. The helpers add an atomic commit and validated, all-or-nothing loading::

    import matrixfsdp.checkpoint as mckpt
    mckpt.save(f"ckpt/step-{step}", model, opt)           # every rank; owners write their tensors
    mckpt.load("ckpt/step-100", model, opt)                # any world size / owner plan / FSDP2 / 1 process

Offline, without a process group (streaming: one tensor in memory at a time)::

    python -m matrixfsdp.checkpoint export --src ckpt/step-100 --dst out/model.safetensors [--max-shard-size 5GB]
    python -m matrixfsdp.checkpoint import --src out/ --dst ckpt/init

Hugging Face ``transformers`` models: ``model.save_pretrained`` does not work on a sharded model
(it sees empty shards); :func:`save_pretrained` gathers full tensors and writes the same folder
(config, safetensors, tied weights once) from rank 0, and after :func:`enable_save_pretrained`
``model.save_pretrained`` itself does the same (called on every rank)::

    matrixfsdp.checkpoint.save_pretrained(model, "out/hf")     # every rank

Names: a checkpoint's model keys are ``"model.<fqn>"`` with the model's own fqns (for the built-in
:class:`matrixfsdp.Decoder` those are Hugging Face Qwen3 names such as
``model.layers.0.self_attn.q_proj.weight``); export writes ``<fqn>`` as the tensor name, with
``--strip-prefix P`` removing ``P`` from the front of each fqn and ``--add-prefix Q`` prepending
``Q``; import applies the same options to tensor names. Optimizer state (``"optim.*"``) is never
exported.

``python -m matrixfsdp.checkpoint`` runs ``matrixfsdp/checkpoint/__main__.py``, a module the
package never imports, so the interpreter prints no ``runpy`` RuntimeWarning (``import
matrixfsdp`` imports this package first).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .dcp import MODEL_KEY, OPTIM_KEY, load, model_state_dict, optimizer_state_dict, read_metadata, save
from .safetensors import ByteTracker, export_safetensors, import_safetensors
from .huggingface import enable_save_pretrained, save_pretrained

__all__ = [
    "save",
    "load",
    "model_state_dict",
    "optimizer_state_dict",
    "read_metadata",
    "export_safetensors",
    "import_safetensors",
    "ByteTracker",
    "save_pretrained",
    "enable_save_pretrained",
    "MODEL_KEY",
    "OPTIM_KEY",
    "main",
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m matrixfsdp.checkpoint",
        description="Convert between DCP checkpoints and Hugging Face-style safetensors (no process group).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="DCP checkpoint -> safetensors (model weights only)")
    ex.add_argument("--src", required=True, help="DCP checkpoint directory")
    ex.add_argument("--dst", required=True, help="output .safetensors path (index and shards go next to it)")
    ex.add_argument("--max-shard-size", default=None,
                    help="split into model-0000i-of-0000N.safetensors + index.json above this size (e.g. 5GB)")
    ex.add_argument("--keep-tied", action="store_true",
                    help="also write an output head equal to the input embedding (default: tied weights once, as HF)")
    im = sub.add_parser("import", help="safetensors (file, index json or directory) -> DCP checkpoint")
    im.add_argument("--src", required=True, help="a .safetensors file, a .safetensors.index.json or a directory")
    im.add_argument("--dst", required=True, help="DCP checkpoint directory to create")
    for sp in (ex, im):
        sp.add_argument("--state-key", default=MODEL_KEY,
                        help=f"top-level key of the model state in the checkpoint (default {MODEL_KEY!r})")
        sp.add_argument("--strip-prefix", default="", help="remove this prefix from names where present")
        sp.add_argument("--add-prefix", default="", help="prepend this prefix to names")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (errors print one line to stderr and return 2).

    Example::

        python -m matrixfsdp.checkpoint export --src ckpt/step-100 --dst out/model.safetensors
    """
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            files = export_safetensors(args.src, args.dst, max_shard_size=args.max_shard_size,
                                       state_key=args.state_key, strip_prefix=args.strip_prefix,
                                       add_prefix=args.add_prefix, keep_tied=args.keep_tied)
            for f in files:
                print(f)
        else:
            print(import_safetensors(args.src, args.dst, state_key=args.state_key,
                                     strip_prefix=args.strip_prefix, add_prefix=args.add_prefix))
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

