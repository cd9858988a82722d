"""``matrixfsdp.hf_trainer``: transformers' ``Trainer`` on a matrixfsdp-sharded model. The
implementation is :mod:`matrixfsdp.integrations.hf_trainer`; this name is the same module object."""

import sys

from .integrations import hf_trainer as _hf_trainer

sys.modules[__name__] = _hf_trainer
