"""Planning: which rank owns each parameter, and the buckets, from shapes alone.

Pure, deterministic Python: no process group, no tensors beyond shapes. Modules:

* ``owners``: :func:`plan_owners`, the global balance-aware assignment; ``balance`` its
  ``balanced`` policy; ``partition`` Canzona's alpha-balanced ZeRO buckets and replicas;
  ``hosting`` data-parallel hosting of matrices past the memory budget; ``micro_groups`` the TP
  micro-groups (Canzona Algorithm 2);
* ``owner_plan``: the frozen plan records (:class:`OwnerPlan`, :class:`ParamPlan`), per-rank loads
  and bounds, JSON and the digest ranks compare;
* ``cost``: the per-optimizer cost model; ``rules``: the matrix rule shared with the optimizers
  (:class:`MatrixRule`); ``heads``: per-head matrices read from a model (:func:`head_splits`);
* ``report``: the human-readable report; ``expert_baselines``: the expert placement figures and
  baselines of the report.

The command line, ``python -m matrixfsdp.plan``, is :mod:`matrixfsdp.plan`.
"""

from .owners import ELEMENTWISE, POLICIES, default_matrix_filter, plan_owners
from .micro_groups import MicroGroup, plan_micro_groups
from .owner_plan import OwnerPlan, ParamPlan
from .heads import head_splits
from .rules import MatrixRule, ParamKind

__all__ = ["plan_owners", "OwnerPlan", "ParamPlan", "MicroGroup", "plan_micro_groups", "POLICIES", "ELEMENTWISE",
           "default_matrix_filter", "MatrixRule", "ParamKind", "head_splits"]
