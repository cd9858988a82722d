"""Local matrix optimizers for matrixfsdp: Muon, Shampoo and SOAP.

Each is one ``torch.optim.Optimizer`` that routes 2D parameters to its matrix rule and every other
parameter to AdamW, per param group (key ``"algorithm"``: ``"auto"``, the rule's name or
``"adamw"``; see :mod:`matrixfsdp.optim.routing`). Under matrixfsdp each 2D weight lives whole on
one rank and is empty elsewhere, so ``step()`` runs on local tensors only, with no communication
(TP-hosted matrices excepted: two all-to-alls per micro-group within a TP row, ``matrixfsdp.tp``).

    >>> from matrixfsdp.optim import Muon
    >>> opt = Muon(model.parameters(), lr=0.02, ns_dtype=torch.float32)  # CPU; keep bf16 on CUDA

``capturable=True`` (a tensor ``lr``) makes ``torch.compile(opt.step)`` correct and
recompile-free under LR schedulers; ``batched=True`` batches Muon's same-shape Newton-Schulz.
See docs/optimizers.md.

``opt.rule_for(p)`` gives the rule that steps ``p`` as an :class:`UpdateRule` (``init_state``,
``step``, ``update``, ``decay``): the one interface through which a runtime (the TP host step)
runs an optimizer; see [Note: update-rule protocol] in ``optim/rule.py``. Muon's rule is also a
:class:`ShardedStateRule` (``shards_state``, ``prepare``, ``finish``): a hosted matrix keeps its
momentum on the row shards ([Note: state on the shards]).
"""

from ._muon import Muon
from ._shampoo import Shampoo
from ._soap import SOAP
from .rule import ShardedStateRule, UpdateRule

__all__ = ["Muon", "Shampoo", "SOAP", "UpdateRule", "ShardedStateRule"]
