"""The update rules as classes: Muon, Shampoo, SOAP and the AdamW fallback ([Note: update rules as
classes] in ``rules/base.py``). Each owns its hyperparameters, its state layout and its steps (per
matrix, batched group, capturable, stacks of matrices, the additive update and its split); the
optimizers (``optim/_base.py``) route each parameter to one and call it, and ``opt.rule_for(p)``
hands a runtime the same object, bound to ``p``'s param group.
"""

from .adamw import AdamWRule
from .base import Increment, Rule
from .muon import MuonRule
from .shampoo import ShampooRule
from .soap import SOAPRule

__all__ = ["Rule", "Increment", "AdamWRule", "MuonRule", "ShampooRule", "SOAPRule"]
