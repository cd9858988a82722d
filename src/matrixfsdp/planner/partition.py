"""ZeRO-1 bucket partitions with atomic parameters (Canzona, arXiv 2602.06079, Section 3).

Parameters are laid out in one flat buffer in registration order and cut into buckets (Megatron
style: a bucket closes after the parameter that brings it to ``bucket_numel`` elements). Inside a
bucket each rank owns a *contiguous* run of whole parameters, in rank order, so the coalesced
(variable-size) reduce-scatter/all-gather of ZeRO-1 still applies. Cut points are parameter
indices ``0 = s_0 <= s_1 <= ... <= s_W = len(bucket)``: rank ``r`` owns parameters
``[s_r, s_{r+1})`` of the bucket.

* ``naive_static``: Canzona's start-index rule (Eq. 1): with stride ``S = numel(B) / W``, a
  parameter starting at element offset ``o`` belongs to rank ``floor(o / S)``.
* ``alpha_balanced``: Canzona's Algorithm 1. Buckets are visited in LPT order (heaviest first);
  each rank's target share of the bucket blends an even split with filling its deficit to the
  global mean, ``v = (1 - alpha) / W + alpha * d_r / sum(d)``, and each cut is snapped to the
  parameter boundary whose cumulative load is closest to the cumulative target.
"""

from __future__ import annotations

from typing import Any

__all__ = ["partition_buckets", "make_buckets", "partition_replicas", "BUCKET_POLICIES"]

#: the ``plan_owners`` policies that are ZeRO-1 bucket partitions (``replicate``'s plans)
BUCKET_POLICIES = ("alpha_balanced", "naive_static")


def make_buckets(numels: list[int], bucket_numel: int) -> list[tuple[int, int]]:
    """``[start, end)`` parameter-index ranges of consecutive buckets."""
    out = []
    start, acc = 0, 0
    for i, n in enumerate(numels):
        acc += n
        if acc >= bucket_numel:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(numels):
        out.append((start, len(numels)))
    return out


def _naive_cuts(numels: list[int], W: int) -> list[int]:
    total = sum(numels)
    stride = total / W
    owner = []
    off = 0
    for n in numels:
        owner.append(min(int(off // stride), W - 1) if stride else 0)
        off += n
    # owners are non-decreasing: cut r = first parameter owned by a rank >= r
    cuts = [0] * (W + 1)
    for r in range(W + 1):
        cuts[r] = next((i for i, o in enumerate(owner) if o >= r), len(numels))
    cuts[0], cuts[W] = 0, len(numels)
    return cuts


def _alpha_cuts(loads: list[float], acc: list[float], mean: float, alpha: float) -> list[int]:
    W = len(acc)
    total = sum(loads)
    deficit = [max(0.0, mean - a) for a in acc]
    dsum = sum(deficit)
    fill = [d / dsum for d in deficit] if dsum > 0 else [1.0 / W] * W
    target = [total * ((1 - alpha) / W + alpha * f) for f in fill]
    prefix = [0.0]
    for x in loads:
        prefix.append(prefix[-1] + x)
    cuts = [0]
    c = 0.0
    u = 0
    for r in range(W - 1):
        c += target[r]
        # boundary u >= previous cut with prefix[u] closest to c (prefix is non-decreasing)
        best = u
        while best + 1 <= len(loads) and abs(prefix[best + 1] - c) <= abs(prefix[best] - c):
            best += 1
        u = best
        cuts.append(u)
        acc[r] += prefix[u] - prefix[cuts[-2]]
    cuts.append(len(loads))
    acc[W - 1] += prefix[len(loads)] - prefix[cuts[-2]]
    return cuts


def partition_buckets(
    fqns: list[str],
    loads: list[float],
    W: int,
    *,
    policy: str,
    alpha: float,
    bucket_numel: int | None,
    numels: list[int],
) -> tuple[dict[str, int], tuple[tuple[str, Any], ...]]:
    """Owner of every parameter, plus plan metadata (bucket size, alpha, per-bucket cuts)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"plan_owners: alpha must be a number in [0, 1], got {alpha=!r}")
    if bucket_numel is None:
        bucket_numel = max(40_000_000, 1_000_000 * W)  # Megatron's default bucket size
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"plan_owners: bucket_numel must be an int >= 1, got {bucket_numel=!r}")
    buckets = make_buckets(numels, bucket_numel)
    cuts: list[list[int]] = [[] for _ in buckets]
    if policy == "naive_static":
        for i, (a, b) in enumerate(buckets):
            cuts[i] = _naive_cuts(numels[a:b], W)
    else:
        mean = sum(loads) / W
        acc = [0.0] * W
        bload = [sum(loads[a:b]) for a, b in buckets]
        for i in sorted(range(len(buckets)), key=lambda i: (-bload[i], i)):  # LPT over buckets
            a, b = buckets[i]
            cuts[i] = _alpha_cuts(loads[a:b], acc, mean, float(alpha))
    owners: dict[str, int] = {}
    for (a, _b), cut in zip(buckets, cuts):
        for r in range(W):
            for j in range(cut[r], cut[r + 1]):
                owners[fqns[a + j]] = r
    meta = (
        ("alpha", float(alpha) if policy == "alpha_balanced" else None),
        ("bucket_numel", bucket_numel),
        ("buckets", tuple((tuple(fqns[a:b]), tuple(c)) for (a, b), c in zip(buckets, cuts))),
    )
    return owners, meta


def partition_replicas(groups: list[list[tuple[str, float]]], R: int, *, alpha: float = 1.0) -> dict[str, int]:
    """Step replica of every parameter of one owner (see [Note: replicas and step replicas] in
    ``owner_plan.py``): Algorithm 1 across the replicate dimension, with each of the owner's blocks as
    a bucket. ``groups`` holds, per block, ``(fqn, cost)`` in the block's chunk order; each block
    is cut into ``R`` contiguous runs, replica ``q`` taking run ``q``, so a block's reduce-scatter
    across replicas is one interval per replica, in replica order. Blocks are visited heaviest
    first and every cut fills the replicas' deficits to the owner's mean (``alpha`` blends in an
    even split), so the owner's total cost is balanced across its replicas."""
    out: dict[str, int] = {}
    mean = sum(c for g in groups for _, c in g) / R
    acc = [0.0] * R
    loads = [sum(c for _, c in g) for g in groups]
    for i in sorted(range(len(groups)), key=lambda i: (-loads[i], i)):
        g = groups[i]
        cuts = _alpha_cuts([c for _, c in g], acc, mean, alpha) if R > 1 else [0, len(g)]
        for q in range(R):
            for j in range(cuts[q], cuts[q + 1]):
                out[g[j][0]] = q
    return out
