"""The MPS packing target the partitioner learns from the cluster's pods.

The planner polishes its MPS placements with a node-level packing measure
(:mod:`planner.mps_polish`) against a *target workload*: the shapes of the pods expected next,
each a CPU request, an MPS slice size and a slice count.  The planner alone sees only the
pending pods and the slices in use, not the CPU of the pods holding those slices, so the
partitioner hands it the shapes of the pods it knows: every pod bound to an MPS node and
asking for one MPS slice (``nvidia.com/gpu-<N>gb: 1``), not finished, plus the pods waiting
for one -- the pods running and waiting now stand for the next ones.  A pod asking for more is
never placed (:func:`planner.demand.one_mps_slice`) and stands for nothing.  A target given
in the settings (``freeCapacity.mpsSizes``) is left alone, and with no such pod the planner
learns from its snapshot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from partitioner.index import PodInfo
from planner.snapshot import mps_gb_of

__all__ = ["learned_mps_shapes"]

_GIB = 1024


def learned_mps_shapes(
    bound: Iterable[PodInfo], waiting: Iterable[PodInfo], mps_nodes: frozenset[str]
) -> tuple[tuple[int, int, int, float], ...] | None:
    """``(CPU milli, slice MiB, slices, pods)`` of the pods bound to ``mps_nodes`` and of the
    ``waiting`` pods asking for one MPS slice size (module docstring); ``None`` for none."""
    counts: Counter[tuple[int, int, int]] = Counter()
    for pod in bound:
        if pod.node in mps_nodes and not pod.finished:
            shape = _shape(pod)
            if shape is not None:
                counts[shape] += 1
    for pod in waiting:
        shape = _shape(pod)
        if shape is not None:
            counts[shape] += 1
    if not counts:
        return None
    return tuple((c, mib, n, float(k)) for (c, mib, n), k in sorted(counts.items()))


def _shape(pod: PodInfo) -> tuple[int, int, int] | None:
    sizes = [(mps_gb_of(r), n) for r, n in pod.slices.items() if n > 0]
    if len(sizes) != 1:
        return None
    gb, n = sizes[0]
    if gb is None or n != 1:  # several slices: never placed (planner.demand.one_mps_slice)
        return None
    return (pod.cpu_milli, gb * _GIB, n)
