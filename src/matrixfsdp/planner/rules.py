"""The routing rule shared by the planner and the optimizers: which tensors are matrices.

[Note: one routing rule]
Pure: a parameter's name, shape and owning module decide, through :meth:`MatrixRule.kind`. The
planner uses it to place matrices and expert stacks on owners, the optimizers (``Optimizer(model)``)
to route a plain (unsharded) model's parameters, and a plan-less ``fully_shard`` call classifies its
parameters on the real modules with it before planning them. So a plain reference run, a planned
run and a drop-in run step every parameter alike. The rule, in order:

* an **expert stack** (a 3-D parameter of an experts module: a module class named ``*Experts*``,
  such as torchtitan's ``GroupedExperts`` and Hugging Face's ``Qwen3MoeExperts``, or a module
  named ``experts``; or a name listed in ``MatrixRule.expert_stacks``) is ``E`` expert slices
  ``[out, in]``, each ``splits`` matrices stacked along its rows: ``gate_up_proj`` (Hugging Face's
  fused ``[E, 2F, D]``) is two matrices per expert, gate and up, by default (``MatrixRule.fused``);
  every other stack one. ``MatrixRule(experts=False)`` sends stacks to AdamW;
* a **router** (a 2-D weight of a module whose class is named ``*Router*``, or of a module named
  ``gate`` or ``router``) is a matrix; ``MatrixRule(routers=False)`` sends routers to AdamW;
* any other 2-D weight is a matrix, except embeddings (``nn.Embedding``) and output heads (a module
  named ``lm_head``/``output``/``head``/``classifier``, or a weight whose row count is an
  embedding's vocabulary size), which go to AdamW as in standard Muon recipes;
* everything else (vectors, scalars, other 3-D tensors such as convolution kernels) is element-wise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

import torch
import torch.nn as nn

__all__ = ["MatrixRule", "ParamKind", "KINDS", "default_matrix_filter", "DEFAULT_RULE", "DecidedRule", "head_rows_of",
           "check_rule"]

_HEAD_NAMES = ("lm_head", "output", "head", "classifier")
_ROUTER_NAMES = ("gate", "router")
#: The three kinds a parameter can be (see [Note: one routing rule]).
KINDS = ("matrix", "experts", "elementwise")


class ParamKind(NamedTuple):
    """What the rule makes of one parameter: ``kind`` in :data:`KINDS`; ``splits`` the matrices
    per expert along the rows of an expert slice (``1`` for anything else)."""

    kind: str
    splits: int = 1


MATRIX = ParamKind("matrix")
ELEMENTWISE = ParamKind("elementwise")


def _module_leaf(fqn: str) -> str:
    """The name of the module owning parameter ``fqn`` in its parent (``""`` at the root)."""
    parts = fqn.split(".")
    return parts[-2] if len(parts) >= 2 else ""


@dataclass(frozen=True)
class MatrixRule:
    """Which parameters get the matrix rule (see [Note: one routing rule]); one switch per choice.

    Args:
        routers: routers (``[num_experts, hidden]`` gate weights) are matrices (default) or, with
            ``False``, element-wise (AdamW).
        experts: expert stacks are ``E`` independent matrices (default) or, with ``False``,
            element-wise (AdamW).
        fused: ``((leaf name, splits), ...)``: expert stacks whose parameter is named ``leaf name``
            hold ``splits`` matrices per expert along the rows of each slice (default:
            ``(("gate_up_proj", 2),)``, Hugging Face's fused gate and up projections, stepped as
            the unfused model's two matrices); ``fused=()`` makes every stack one matrix per expert.
        expert_stacks: names (full fqns or their last component) of further 3-D parameters that
            are expert stacks although their module does not say so: the explicit opt-in a 3-D
            tensor needs to get a matrix rule.
        vocab_sizes: vocabulary sizes of embeddings outside the planned module, added to its own
            for the output-head test (:func:`default_matrix_filter`): a pipeline stage's model part
            routes as the whole model does although the embedding lives on another stage.

    Example::

        rule = MatrixRule(routers=False)                       # routers on AdamW
        plan = plan_owners(model, 8, block_types=Block, matrix_rule=rule)
        opt = Muon(model, matrix_rule=rule)                    # the plain run routes alike
    """

    routers: bool = True
    experts: bool = True
    fused: tuple[tuple[str, int], ...] = (("gate_up_proj", 2),)
    expert_stacks: tuple[str, ...] = ()
    vocab_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for key in ("routers", "experts"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"MatrixRule: {key} must be a bool, got {key}={getattr(self, key)!r}")
        fused = tuple(tuple(x) if isinstance(x, (tuple, list)) else x for x in self.fused)
        if any(not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], int)
                    and not isinstance(x[1], bool) and x[1] >= 1) for x in fused):
            raise ValueError(f"MatrixRule: fused must hold (parameter name, splits >= 1) pairs, got fused={self.fused!r}")
        object.__setattr__(self, "fused", fused)
        stacks = tuple(self.expert_stacks) if not isinstance(self.expert_stacks, str) else (self.expert_stacks,)
        if any(not isinstance(s, str) or not s for s in stacks):
            raise ValueError(f"MatrixRule: expert_stacks must hold parameter names, got {self.expert_stacks!r}")
        vocab = tuple(self.vocab_sizes) if isinstance(self.vocab_sizes, (tuple, list)) else None
        if vocab is None or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in vocab):
            raise ValueError(f"MatrixRule: vocab_sizes must hold positive ints, got vocab_sizes={self.vocab_sizes!r}")
        object.__setattr__(self, "vocab_sizes", vocab)
        object.__setattr__(self, "expert_stacks", stacks)

    def is_expert_stack(self, fqn: str, param: torch.Tensor, module: nn.Module) -> bool:
        """Whether 3-D ``param`` is a stack of expert matrices (by its module, or opted in)."""
        if param.ndim != 3:
            return False
        leaf = fqn.rpartition(".")[2]
        if fqn in self.expert_stacks or leaf in self.expert_stacks:
            return True
        return "experts" in type(module).__name__.lower() or _module_leaf(fqn) == "experts"

    def is_router(self, fqn: str, param: torch.Tensor, module: nn.Module) -> bool:
        """Whether 2-D ``param`` is a mixture-of-experts router."""
        return param.ndim == 2 and ("router" in type(module).__name__.lower()
                                    or _module_leaf(fqn) in _ROUTER_NAMES)

    def splits_of(self, fqn: str) -> int:
        leaf = fqn.rpartition(".")[2]
        return dict(self.fused).get(fqn, dict(self.fused).get(leaf, 1))

    def kind(self, fqn: str, param: torch.Tensor, module: nn.Module, head_rows: frozenset[int]) -> ParamKind:
        """The :class:`ParamKind` of parameter ``fqn`` (``module`` owns it, ``head_rows`` holds
        the vocabulary sizes of the model's embeddings)."""
        if self.is_expert_stack(fqn, param, module):
            if not self.experts:
                return ELEMENTWISE
            splits = self.splits_of(fqn)
            if param.shape[1] % splits:
                raise ValueError(
                    f"MatrixRule: expert stack {fqn!r} of shape {tuple(param.shape)} is fused from "
                    f"{splits} matrices per expert (fused={self.fused!r}), but its rows "
                    f"({param.shape[1]}) do not divide by {splits}; pass MatrixRule(fused=()) if each "
                    "expert slice is one matrix"
                )
            return ParamKind("experts", splits)
        if self.is_router(fqn, param, module):
            return MATRIX if self.routers else ELEMENTWISE
        if self.vocab_sizes:
            head_rows = head_rows | frozenset(self.vocab_sizes)
        return MATRIX if default_matrix_filter(fqn, param, module, head_rows) else ELEMENTWISE

    def kinds(self, model: nn.Module) -> dict[str, ParamKind]:
        """The kind of every parameter of ``model``, by fqn (tied parameters: first name)."""
        modules = dict(model.named_modules())
        head_rows = head_rows_of(model)
        return {fqn: self.kind(fqn, p, modules[fqn.rpartition(".")[0]], head_rows)
                for fqn, p in model.named_parameters()}


#: The rule every API uses when given none.
DEFAULT_RULE = MatrixRule()


@dataclass(frozen=True)
class DecidedRule(MatrixRule):
    """A rule whose answers were computed beforehand, by fqn: a plan-less ``fully_shard`` call
    classifies its parameters with the user's rule on the real modules, then plans stand-in
    modules that carry only names and shapes (see [Note: drop-in planning] in ``_fully_shard``)."""

    decided: Mapping[str, ParamKind] = field(default_factory=dict)

    def kind(self, fqn: str, param: torch.Tensor, module: nn.Module, head_rows: frozenset[int]) -> ParamKind:
        return self.decided[fqn]


def head_rows_of(model: nn.Module) -> frozenset[int]:
    """The vocabulary sizes of ``model``'s embeddings (an output head has that many rows)."""
    return frozenset(m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding))


def check_rule(rule: object, api: str) -> MatrixRule:
    """``rule`` itself if a :class:`MatrixRule`, the default for ``None``; else a ``TypeError``."""
    if rule is None:
        return DEFAULT_RULE
    if not isinstance(rule, MatrixRule):
        raise TypeError(f"{api}: matrix_rule must be a matrixfsdp.MatrixRule or None, got {type(rule).__name__}")
    return rule


def default_matrix_filter(fqn: str, param: torch.Tensor, module: nn.Module, head_rows: frozenset[int]) -> bool:
    """The default ``matrix_filter`` on 2D weights: all, except embeddings and the output head.

    Embeddings (``nn.Embedding`` weights) and the output head (a 2D weight whose owning module is
    named like ``lm_head``/``output``/``head``, or whose row count is an embedding's vocabulary
    size) go to AdamW, as in standard Muon recipes. Expert stacks and routers:
    :meth:`MatrixRule.kind`.
    """
    if param.ndim != 2 or isinstance(module, nn.Embedding):
        return False
    if _module_leaf(fqn) in _HEAD_NAMES:
        return False
    return param.shape[0] not in head_rows
