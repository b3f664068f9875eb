"""Why a pending pod can never be placed on the cluster's GPU nodes as they are. Pure.

A pod is rejected (reported ``cannot place: <reason>``, never batched) when, for some slice it
asks for, none of its eligible GPU nodes is of the right kind (MIG or hybrid for
``nvidia.com/mig-<profile>``, MPS or hybrid for ``nvidia.com/gpu-<N>gb``), the MPS size is not positive,
or no eligible node's GPU model has the MIG profile under exactly that name
(:meth:`planner.catalog.GpuModel.profile`), or it asks for more than one MPS slice
(:func:`planner.demand.one_mps_slice`: a container reaches one MPS daemon).  Anything else
(capacity) is the planner's to judge.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.catalog import CatalogError, GpuModel
from planner.demand import one_mps_slice
from planner.snapshot import Mode, Unplaced, mig_profile_of, mps_gb_of

__all__ = ["MIG_MODES", "has_profile", "reject_reason"]

MIG_MODES = (Mode.MIG, Mode.HYBRID)


def has_profile(model: GpuModel, profile: str) -> bool:
    try:
        model.profile(profile)
    except CatalogError:
        return False
    return True


def reject_reason(
    slices: Mapping[str, int], eligible: Sequence[tuple[Mode, GpuModel]]
) -> str | None:
    """Why a pod asking for ``slices`` can never be placed on its eligible GPU nodes
    (``(mode, model)`` each, in node-name order), or ``None``."""
    if (why := one_mps_slice(slices)) is not None:
        return f"{Unplaced.MPS_SLICES.value}: {why}"
    for resource in sorted(slices):
        profile, gb = mig_profile_of(resource), mps_gb_of(resource)
        modes = MIG_MODES if profile is not None else (Mode.MPS, Mode.HYBRID)
        kind = "MIG" if profile is not None else "MPS"
        fitting = [model for mode, model in eligible if mode in modes]
        if not fitting:
            return (
                f"no eligible node: no opted-in {kind} node matches the pod's nodeSelector, "
                f"affinity and tolerations (for {resource})"
            )
        if gb is not None and gb <= 0:
            return f"unknown resource {resource}: an MPS slice needs at least 1 GB"
        if profile is not None and not any(has_profile(m, profile) for m in fitting):
            models = sorted({m.name for m in fitting})
            valid = ", ".join(p.name for p in fitting[0].profiles)
            return (
                f"unknown resource {resource}: no eligible GPU ({', '.join(models)}) has MIG "
                f"profile {profile}; valid on {fitting[0].name}: {valid}"
            )
    return None
