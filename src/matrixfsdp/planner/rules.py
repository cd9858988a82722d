"""The routing rule shared by the planner and the optimizers: which tensors are matrices.

[Note: one routing rule]
Pure: a parameter's name, shape, owning module and (for expert stacks and routers) its
neighbouring modules decide, through :meth:`MatrixRule.kind`. The planner uses it to place
matrices and expert stacks on owners, the optimizers (``Optimizer(model)``) to route a plain
(unsharded) model's parameters, and a plan-less ``fully_shard`` call classifies its parameters on
the real modules with it before planning them. So a plain reference run, a planned run and a
drop-in run step every parameter alike. The rule, in order:

* an **expert stack** is ``E`` expert slices ``[out, in]``, each ``splits`` matrices stacked along
  its rows: ``gate_up_proj`` (Hugging Face's fused ``[E, 2F, D]``) is two matrices per expert,
  gate and up, by default (``MatrixRule.fused``); every other stack one.
  ``MatrixRule(experts=False)`` sends stacks to AdamW. A 3-D parameter is an expert stack when
  (by structure, see [Note: mixture-of-experts structure]) a router of its MoE module scores ``E``
  experts, its leading dimension; or (by name) its module's class is named ``*Experts*`` or the
  module is named ``experts``; or it is listed in ``MatrixRule.expert_stacks``. A parameter of a
  convolution module is never one (unless listed);
* a **router** (a 2-D weight that scores the experts: found by structure, a module class named
  ``*Router*``, or a name listed in ``MatrixRule.router_names``; a module merely named ``gate`` is
  not one: SwiGLU's gate projection is a matrix) is a matrix; ``MatrixRule(routers=False)``
  sends routers to AdamW;
* any other 2-D weight is a matrix, except embeddings (``nn.Embedding``) and output heads (a module
  named ``lm_head``/``output``/``head``/``classifier``, or a weight whose row count is an
  embedding's vocabulary size), which go to AdamW as in standard Muon recipes;
* everything else (vectors, scalars, other 3-D tensors such as convolution kernels) is element-wise.

[Note: mixture-of-experts structure]
Expert stacks and routers are recognised by shape and position, not by the names a codebase
happens to use (:func:`moe_structure`). For every 3-D parameter ``S [E, a, b]`` outside a
convolution module, on module ``M``: its *MoE scopes* are ``M`` and ``M``'s parent. A *router* of a
scope ``P`` is a 2-D weight ``[E, D]`` with ``D`` in ``(a, b)``, held by ``P`` itself or by a module at
most two levels below it (``P.gate``, ``P.router.gate``), where the child of ``P`` on its path holds
no other parameter of two or more dimensions (a router module, not an MLP: a shared expert's
``Linear(D, F)`` with ``F == E`` is no router). ``S`` is an expert stack if some scope of it has a
router; every such router is one. A 2-D ``[E, rows]`` parameter beside a stack ``[E, rows, .]`` on
the same module is a stack of per-expert biases (element-wise). Layouts without stacks (Mixtral-style: a ``ModuleList`` of 2-D
experts) have no router by structure: their gate is a matrix, or a router by
``MatrixRule(router_names=...)``. The layouts this was tested on
(tests/experts/test_structure.py): Hugging Face Qwen3-MoE (``mlp.gate`` a ``Qwen3MoeTopKRouter``
``[E, D]``, ``mlp.experts.gate_up_proj/down_proj``), a gpt-oss-style block with the stacks held by
the MoE module itself beside ``router = Linear(D, E)`` (``w1/w2/w3`` or ``mlp1_weight``),
torchtitan's ``GroupedExperts`` beside ``router.gate = Linear(D, E)``, DeepSeek-V3 with shared
experts (``mlp.gate`` ``[E, D]``, ``mlp.experts``, ``mlp.shared_experts`` a dense MLP).

[Note: routing invariant]
The rule decides each parameter's *kind* (matrix, expert stack, element-wise) from the model, and
it decides identically for the plain model, a whole-model plan and drop-in ``fully_shard`` calls,
``replicate``, HSDP, TP, pipeline stages, torchtitan and Hugging Face models. Placement decides
only *where* a matrix is stepped (its owner, a host, whole experts per rank), never *whether* it
gets the matrix rule. It is checked where it can break: after a plan is applied (``fully_shard``'s
resolution) and at optimizer construction (``placement.stepping.check_planned``), a parameter the
plan placed as a matrix but that would be stepped element-wise (stored evenly with no host) is an
internal error naming it and the plan, raised on every rank alike (same plan, same answer). A
param group that asks for the matrix rule (by name, or ``"auto"`` with an explicit list) for a
parameter the plan made element-wise is refused with a ``ValueError`` naming the fix
(``optim/group_checks.py``); ``Optimizer(model)`` is the one-rule path. The property test
(tests/planner/test_routing_property.py) checks it over generated models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

import torch
import torch.nn as nn

__all__ = ["MatrixRule", "ParamKind", "KINDS", "default_matrix_filter", "DEFAULT_RULE", "DecidedRule", "head_rows_of",
           "check_rule", "MoEStructure", "moe_structure"]

_HEAD_NAMES = ("lm_head", "output", "head", "classifier")
#: The three kinds a parameter can be (see [Note: one routing rule]).
KINDS = ("matrix", "experts", "elementwise")


class ParamKind(NamedTuple):
    """What the rule makes of one parameter: ``kind`` in :data:`KINDS`; ``splits`` the matrices
    along the rows of an expert slice, or the heads of a per-head matrix (``1`` otherwise)."""

    kind: str
    splits: int = 1


MATRIX = ParamKind("matrix")
ELEMENTWISE = ParamKind("elementwise")


def _module_leaf(fqn: str) -> str:
    """The name of the module owning parameter ``fqn`` in its parent (``""`` at the root)."""
    parts = fqn.split(".")
    return parts[-2] if len(parts) >= 2 else ""


class MoEStructure(NamedTuple):
    """What :func:`moe_structure` found in a model: fqns (first names of tied parameters) of the
    3-D parameters that are expert stacks and the 2-D weights that are routers, by structure."""

    stacks: frozenset[str] = frozenset()
    routers: frozenset[str] = frozenset()
    #: 2-D ``[E, rows]`` parameters beside a stack of ``E`` experts with ``rows`` rows on the same
    #: module: per-expert bias vectors (gpt-oss's ``mlp1_bias``), element-wise
    biases: frozenset[str] = frozenset()


NO_STRUCTURE = MoEStructure()


def moe_structure(model: nn.Module) -> MoEStructure:
    """Expert stacks and routers of ``model`` by structure (see [Note: mixture-of-experts
    structure]): pure, over names, shapes and module types (a ``meta`` model is fine)."""
    from torch.nn.modules.conv import _ConvNd

    modules = dict(model.named_modules())
    first: dict[int, str] = {}
    for fqn, p in model.named_parameters():
        first.setdefault(id(p), fqn)
    own: dict[str, list[tuple[str, torch.Tensor]]] = {}  # module fqn -> its direct parameters
    for fqn, p in model.named_parameters():
        own.setdefault(fqn.rpartition(".")[0], []).append((fqn, p))

    def below(scope: str, mod: str) -> list[str] | None:
        """``mod``'s path below ``scope`` (``[]`` for ``scope`` itself), else ``None``."""
        if mod == scope:
            return []
        prefix = f"{scope}." if scope else ""
        if not mod.startswith(prefix):
            return None
        return mod[len(prefix):].split(".")

    def heavy(child: str) -> int:
        """How many parameters of >= 2 dimensions module ``child`` holds (its whole subtree)."""
        return sum(p.ndim >= 2 for _, p in modules[child].named_parameters())

    def routers_of(scope: str, E: int, dims: tuple[int, ...]) -> list[str]:
        out = []
        for mod, params in own.items():
            path = below(scope, mod)
            if path is None or len(path) > 2 or isinstance(modules[mod], (nn.Embedding, _ConvNd)):
                continue
            for fqn, p in params:
                if p.ndim != 2 or p.shape[0] != E or p.shape[1] not in dims or first[id(p)] != fqn:
                    continue
                if path:  # the child of scope on the path is a router module, not an MLP
                    child = f"{scope}.{path[0]}" if scope else path[0]
                    if heavy(child) != 1:
                        continue
                out.append(fqn)
        return out

    stacks: set[str] = set()
    routers: set[str] = set()
    for fqn, p in model.named_parameters():
        mod = fqn.rpartition(".")[0]
        if p.ndim != 3 or isinstance(modules[mod], _ConvNd):
            continue
        scopes = [mod] + ([mod.rpartition(".")[0]] if mod else [])
        found = [r for sc in scopes for r in routers_of(sc, p.shape[0], tuple(p.shape[1:]))]
        if found:
            stacks.add(fqn)
            routers.update(found)
    biases: set[str] = set()
    for mod, params in own.items():
        m = modules[mod]
        named = "experts" in type(m).__name__.lower() or mod.rpartition(".")[2] == "experts"
        rows = {(p.shape[0], p.shape[1]) for f, p in params if p.ndim == 3 and (f in stacks or named)}
        biases.update(f for f, p in params if p.ndim == 2 and (p.shape[0], p.shape[1]) in rows)
    return MoEStructure(frozenset(stacks), frozenset(routers), frozenset(biases))


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
        router_names: names (full fqns or last components, of the parameter or of its module) of
            further 2-D weights that are routers although the structure does not show it (see
            [Note: mixture-of-experts structure]).
        heads: ``((name, H), ...)`` (or a dict): per-head matrices (see [Note: per-head
            matrices]). A 2-D matrix named ``name`` (its fqn, its last component, its module's fqn
            or its module's name, e.g. ``"q_proj"``) holds ``H`` attention heads along its rows and
            is stepped as ``H`` independent ``[rows / H, cols]`` matrices (per-head Muon: Kimi K3,
            GLM-5's Muon Split); the planner costs it as ``H`` matrices. :meth:`per_head` reads
            them from a Hugging Face, torchtitan or matrixfsdp model.
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
    router_names: tuple[str, ...] = ()
    heads: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        raw = self.heads
        heads = tuple(raw.items()) if isinstance(raw, Mapping) else raw
        heads = tuple(tuple(x) if isinstance(x, (tuple, list)) else x for x in heads) if isinstance(
            heads, (tuple, list)) else None
        if heads is None or any(not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and x[0]
                                     and isinstance(x[1], int) and not isinstance(x[1], bool) and x[1] >= 1)
                                for x in heads):
            raise ValueError(f"MatrixRule: heads must hold (parameter or module name, head count >= 1) pairs, "
                             f"got heads={raw!r}")
        if len({name for name, _ in heads}) != len(heads):
            raise ValueError(f"MatrixRule: heads names each projection once, got heads={raw!r}")
        object.__setattr__(self, "heads", tuple(sorted(heads)))  # canonical: equal rules compare equal
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
        names = tuple(self.router_names) if not isinstance(self.router_names, str) else (self.router_names,)
        if any(not isinstance(s, str) or not s for s in names):
            raise ValueError(f"MatrixRule: router_names must hold module or parameter names, got {self.router_names!r}")
        object.__setattr__(self, "router_names", names)

    def is_expert_stack(self, fqn: str, param: torch.Tensor, module: nn.Module,
                        structure: MoEStructure = NO_STRUCTURE) -> bool:
        """Whether 3-D ``param`` is a stack of expert matrices (opted in, by structure, or by its
        module's name; never a convolution kernel unless opted in)."""
        if param.ndim != 3:
            return False
        leaf = fqn.rpartition(".")[2]
        if fqn in self.expert_stacks or leaf in self.expert_stacks:
            return True
        from torch.nn.modules.conv import _ConvNd

        if isinstance(module, _ConvNd):
            return False
        return (fqn in structure.stacks or "experts" in type(module).__name__.lower()
                or _module_leaf(fqn) == "experts")

    def is_router(self, fqn: str, param: torch.Tensor, module: nn.Module,
                  structure: MoEStructure = NO_STRUCTURE) -> bool:
        """Whether 2-D ``param`` is a mixture-of-experts router (by structure, its module's class
        name, or a listed name; a module merely named ``gate`` or ``router`` is not enough)."""
        if param.ndim != 2:
            return False
        names = (fqn, fqn.rpartition(".")[2], fqn.rpartition(".")[0], _module_leaf(fqn))
        return (fqn in structure.routers or "router" in type(module).__name__.lower()
                or any(n in self.router_names for n in names if n))

    def splits_of(self, fqn: str) -> int:
        leaf = fqn.rpartition(".")[2]
        return dict(self.fused).get(fqn, dict(self.fused).get(leaf, 1))

    @classmethod
    def per_head(cls, model: nn.Module, **options: object) -> "MatrixRule":
        """The rule with ``model``'s attention projections as per-head matrices
        (``heads=head_splits(model)``, see :func:`matrixfsdp.planner.head_splits`) and
        ``options`` (the other fields) as given.

        Example::

            rule = MatrixRule.per_head(model)          # Qwen3: q_proj 16 heads, k/v_proj 8
            plan = plan_owners(model, mesh, matrix_rule=rule)
            opt = Muon(model, matrix_rule=rule)        # per-head Muon, sharded or plain
        """
        from .heads import head_splits

        return cls(heads=head_splits(model), **options)  # type: ignore[arg-type]

    def heads_of(self, fqn: str) -> int:
        """Heads along the rows of matrix ``fqn`` (``1``: not a per-head matrix)."""
        if not self.heads:
            return 1
        mod = fqn.rpartition(".")[0]
        names = (fqn, fqn.rpartition(".")[2], mod, _module_leaf(fqn))
        table = dict(self.heads)
        return next((table[n] for n in names if n and n in table), 1)

    def _matrix(self, fqn: str, param: torch.Tensor) -> ParamKind:
        h = self.heads_of(fqn)
        if h == 1:
            return MATRIX
        if param.shape[0] % h:
            raise ValueError(
                f"MatrixRule: per-head matrix {fqn!r} of shape {tuple(param.shape)} holds {h} heads (heads="
                f"{self.heads!r}), but its rows ({param.shape[0]}) do not divide by {h}; fix its head count "
                "(MatrixRule.per_head(model) reads it from the model's config)"
            )
        return ParamKind("matrix", h)

    def kind(self, fqn: str, param: torch.Tensor, module: nn.Module, head_rows: frozenset[int],
             structure: MoEStructure = NO_STRUCTURE) -> ParamKind:
        """The :class:`ParamKind` of parameter ``fqn`` (``module`` owns it, ``head_rows`` holds
        the vocabulary sizes of the model's embeddings, ``structure`` is the model's
        :func:`moe_structure`); a per-head matrix's ``splits`` is its head count."""
        if self.is_expert_stack(fqn, param, module, structure):
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
        if fqn in structure.biases:  # per-expert bias vectors
            return ELEMENTWISE
        if self.is_router(fqn, param, module, structure):
            return self._matrix(fqn, param) if self.routers else ELEMENTWISE
        if self.vocab_sizes:
            head_rows = head_rows | frozenset(self.vocab_sizes)
        return self._matrix(fqn, param) if default_matrix_filter(fqn, param, module, head_rows) else ELEMENTWISE

    def kinds(self, model: nn.Module) -> dict[str, ParamKind]:
        """The kind of every parameter of ``model``, by fqn (tied parameters: first name)."""
        modules = dict(model.named_modules())
        head_rows, structure = head_rows_of(model), moe_structure(model)
        return {fqn: self.kind(fqn, p, modules[fqn.rpartition(".")[0]], head_rows, structure)
                for fqn, p in model.named_parameters()}


#: The rule every API uses when given none.
DEFAULT_RULE = MatrixRule()


@dataclass(frozen=True)
class DecidedRule(MatrixRule):
    """A rule whose answers were computed beforehand, by fqn: a plan-less ``fully_shard`` call
    classifies its parameters with the user's rule on the real modules, then plans stand-in
    modules that carry only names and shapes (see [Note: drop-in planning] in ``_fully_shard``)."""

    decided: Mapping[str, ParamKind] = field(default_factory=dict)

    def kind(self, fqn: str, param: torch.Tensor, module: nn.Module, head_rows: frozenset[int],
             structure: MoEStructure = NO_STRUCTURE) -> ParamKind:
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
