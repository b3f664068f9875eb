"""Test oracle: the placement level of the planner's objective, written from its rule only.

The rule (``PlannerSettings.placement_weight``, README design notes): with the default
``pods`` weight every pod counts 1; with ``compute`` a pod counts the GPU compute it asks for -- a MIG unit ``<c>g.<m>gb`` counts
``c``, an MPS slice of ``N`` GB counts ``ceil(N / 10)`` -- and every pod of a higher priority
outweighs all lower-priority pods together.  No waiting tiers
(the oracle tests plan pods that have not waited).  Nothing here is imported from the planner.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from planner.snapshot import PendingPod

__all__ = ["placement_weights", "size"]


def size(pod: PendingPod) -> int:
    """Compute units the pod asks for (at least 1)."""
    total = 0
    for resource, count in pod.requests.items():
        mig = re.fullmatch(r"nvidia\.com/mig-(?:\d+c\.)?(\d+)g\..*", resource)
        mps = re.fullmatch(r"nvidia\.com/gpu-(\d+)gb", resource)
        if mig:
            total += int(mig.group(1)) * count
        elif mps:
            total += math.ceil(int(mps.group(1)) / 10) * count
        else:
            total += count
    return max(1, total)


def placement_weights(pods: Iterable[PendingPod], by: str = "pods") -> dict[str, int]:
    """Pod name -> weight: lexicographic in priority, then compute (``by="pods"``: 1 per pod)."""
    pods = list(pods)
    out: dict[str, int] = {}
    below = 0
    for prio in sorted({p.priority for p in pods}):
        members = [p for p in pods if p.priority == prio]
        for p in members:
            out[p.name] = (below + 1) * (size(p) if by == "compute" else 1)
        below += sum(out[p.name] for p in members)
    return out
