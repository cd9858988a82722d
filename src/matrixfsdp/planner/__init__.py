"""Planning: which rank owns each parameter, and the buckets, from shapes alone.

Pure, deterministic Python: no process group, no tensors beyond shapes. ``record`` holds the
frozen plan dataclasses and their digest, ``planner`` the global balance-aware assignment,
``cost`` the per-optimizer cost model, ``buckets`` Canzona's alpha-balanced partition,
``micro_groups`` the TP micro-groups (Canzona Algorithm 2), ``rules`` the matrix rule shared with
the optimizers and ``report`` the human-readable report; ``balance`` is the ``balanced`` policy's
assignment and ``experts`` the expert placement figures and baselines of the report. The command line,
``python -m matrixfsdp.plan``, is :mod:`matrixfsdp.plan`.
"""

from .owners import ELEMENTWISE, POLICIES, default_matrix_filter, plan_owners
from .micro_groups import MicroGroup, plan_micro_groups
from .owner_plan import OwnerPlan, ParamPlan
from .heads import head_splits
from .rules import MatrixRule, ParamKind

__all__ = ["plan_owners", "OwnerPlan", "ParamPlan", "MicroGroup", "plan_micro_groups", "POLICIES", "ELEMENTWISE",
           "default_matrix_filter", "MatrixRule", "ParamKind", "head_splits"]
