"""The routing rule shared by the planner and the optimizers: which 2D tensors are matrices.

Pure: a parameter's name, shape and owning module decide. The planner uses it to place matrices
on owners, the optimizers to route a plain (unsharded) model's parameters to the matrix rule, so
a plain reference run and a sharded run step every parameter alike (see [Note: one routing rule]).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["default_matrix_filter"]

_HEAD_NAMES = ("lm_head", "output", "head", "classifier")


def default_matrix_filter(fqn: str, param: torch.Tensor, module: nn.Module, head_rows: frozenset[int]) -> bool:
    """The default ``matrix_filter``: 2D weights, except embeddings and the output head.

    Embeddings (``nn.Embedding`` weights) and the output head (a 2D weight whose owning module is
    named like ``lm_head``/``output``/``head``, or whose row count is an embedding's vocabulary
    size) go to AdamW, as in standard Muon recipes.
    """
    if param.ndim != 2 or isinstance(module, nn.Embedding):
        return False
    leaf = fqn.rsplit(".", 2)[-2] if fqn.count(".") >= 1 else ""
    if leaf in _HEAD_NAMES:
        return False
    return param.shape[0] not in head_rows
