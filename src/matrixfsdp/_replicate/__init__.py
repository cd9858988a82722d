"""ZeRO-1/2 for replicated parameters on Canzona's balanced buckets: ``matrixfsdp.replicate``.

One concern per file: ``_layout.py`` (pure: buckets and per-rank intervals from the owner plan),
``_replicate.py`` (buckets, hooks, reduce-scatter in backward, all-gather at the next forward),
``_api.py`` (the public call and the module controls).
"""

from .api import MatrixReplicateModule, replicate, state_of
from .buckets import ReplicaInfo, replica_of

__all__ = ["replicate", "MatrixReplicateModule", "ReplicaInfo", "replica_of", "state_of"]
