"""``matrixfsdp.titan``: the torchtitan integration, at the import path torchtitan configs name
(``--module matrixfsdp.titan``). The implementation is :mod:`matrixfsdp.integrations.titan`;
this name is the same module object, so its config registry and functions are found under
either path."""

import sys

from .integrations import titan as _titan

sys.modules[__name__] = _titan
