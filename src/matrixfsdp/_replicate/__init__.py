"""ZeRO-1/2 for replicated parameters on Canzona's balanced buckets: ``matrixfsdp.replicate``.

One concern per file: ``bucket_layout.py`` (pure: buckets and per-rank intervals from the owner
plan), ``state.py`` (the buckets and the runtime state: hooks, the engine's reduction in backward,
the in-place gathers at the next forward), ``api.py`` (the public call and the module controls).
"""

from .api import MatrixReplicateModule, replicate, state_of

__all__ = ["replicate", "MatrixReplicateModule", "state_of"]
