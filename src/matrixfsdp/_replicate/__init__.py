"""ZeRO-1/2 for replicated parameters on Canzona's balanced buckets: ``matrixfsdp.replicate``.

One concern per file: ``layout.py`` (pure: buckets and per-rank intervals from the owner plan),
``buckets.py`` (buckets, hooks, reduce-scatter in backward, all-gather at the next forward),
``api.py`` (the public call and the module controls).
"""

from .api import MatrixReplicateModule, replicate, state_of

__all__ = ["replicate", "MatrixReplicateModule", "state_of"]
