"""The target workload's MIG requests, and what a free MIG instance is worth against it. Pure.

Model
-----
The planner's usefulness level (:mod:`planner.mig_cpsat`, "Usefulness") values what a plan
leaves free.  Unallocated memory slots are valued by the largest profile that still fits them.
A *free instance* (created, no pod on it) is valued here: with the target's share ``t_r`` of
request ``r`` (``sum_r t_r = 1``) and ``s_i`` the memory slots of instance ``i``,

    ``value(l) = round(USEFUL_RESOLUTION * w_free_block * sum_{i in l, i not used} s_i t_{r(i)})``

per layout ``l`` of a MIG node's GPU: a free ``7g`` is worth eight slots if every next pod
asks for one, nothing if none does.  "Not used" means not in use *now*: an instance this plan
creates or fills for a pod counts too, so a layout is valued by its shape (the instances it
keeps standing for the next pods once these leave), not by what it leaves free after the
plan.  Measured (2026-12-07, ``simulations/results/variants-2026-12-07/``): subtracting the
instances the plan fills cost issue 9's grid two cells (default at 4 nodes reconfigured more
GPUs than greedy; gpushare40 at 5 nodes waited longer).  Hybrid nodes are left out: a free instance there may
become a host for MPS slices, which :mod:`planner.hybrid` values.  The target is ``settings.free_capacity_mig_profiles`` when given, else learned from
the snapshot: one count per instance in use on a MIG GPU (a hybrid host holding MPS slices is
not a request) and per unit of a pending pod's MIG request (the pods running and waiting now
stand for the next ones, as for the MPS target, :func:`planner.mps.mps_target`).

Why: without it, free instances were worth nothing and unallocated slots their span, so a ``4g``
pod with two idle GPUs to choose from, one holding a free ``7g`` and one two free ``3g``, took
the ``7g`` (same churn, and its slots 4-7 left unallocated); the next ``7g`` pod then flipped a
GPU back.  In the openb time replays that ``4g <-> 7g`` cycle was most of gpuslice's
reconfigurations (README design note "Free instances are valued by the requests that wait for
them").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from planner.geometry import Placement
from planner.mps import USEFUL_RESOLUTION
from planner.settings import PlannerSettings
from planner.snapshot import MIG_RESOURCE_PREFIX, Mode, Snapshot, mig_resource

__all__ = ["free_instance_value", "mig_target"]


def mig_target(snapshot: Snapshot, settings: PlannerSettings) -> dict[str, float]:
    """The target's MIG requests (resource -> share, summing to 1; empty: none)."""
    counts: dict[str, float] = {}
    if settings.free_capacity_mig_profiles is not None:
        for resource, weight in settings.free_capacity_mig_profiles:
            if resource.startswith(MIG_RESOURCE_PREFIX) and weight > 0:
                counts[resource] = counts.get(resource, 0.0) + weight
    else:
        for node in snapshot.nodes:
            if node.mode is Mode.MPS:
                continue
            for gpu in node.gpus:
                for inst in gpu.mig:
                    if inst.used and not inst.mps:
                        key = mig_resource(inst.profile)
                        counts[key] = counts.get(key, 0.0) + 1
        for pod in snapshot.pods:
            for resource, units in pod.requests.items():
                if resource.startswith(MIG_RESOURCE_PREFIX) and units > 0:
                    counts[resource] = counts.get(resource, 0.0) + units
    total = sum(counts.values())
    return {r: c / total for r, c in sorted(counts.items())} if total > 0 else {}


def free_instance_value(
    free: Iterable[Placement], target: Mapping[str, float], settings: PlannerSettings
) -> int:
    """``value(l)`` of the module docstring for the free instances ``free`` of a layout."""
    if not target:
        return 0
    total = sum(p.profile.memory_slices * target.get(p.profile.resource, 0.0) for p in free)
    return round(USEFUL_RESOLUTION * settings.weight_free_block * total)
