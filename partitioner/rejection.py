"""Why a pending pod can never be placed on the cluster's GPU nodes as they are. Pure.

A pod is rejected (reported ``cannot place: <reason>``, never batched) when, for some slice it
asks for, the name is not one any node advertises, none of its eligible GPU nodes is of the
right kind (MIG or hybrid for ``nvidia.com/mig-<profile>``, MPS or hybrid for
``nvidia.com/gpu-<N>gb``), the MPS size is not positive, or no eligible node's GPU model has
the MIG profile under exactly that resource name
(:meth:`planner.catalog.GpuModel.requested_profile`), or it asks for more than one MPS slice
(:func:`planner.demand.one_mps_slice`: a container reaches one MPS daemon).  Anything else
(capacity) is the planner's to judge.

Names are matched exactly, as kube-scheduler and the kubelet match them: the node agent
advertises canonical names only (:mod:`planner.snapshot`), so a pod asking for
``nvidia.com/gpu-010gb``, ``nvidia.com/mig-1G.10GB`` or ``nvidia.com/mig-1g.10gb.shared`` could
never bind to a slice gpuslice made for it.  Such a near miss is rejected naming the canonical
name (``did you mean nvidia.com/mig-1g.10gb?``); lists of valid names are written as resource
names (``nvidia.com/mig-1g.5gb.me``, never the NVML spelling ``1g.5gb+me``).

A "no eligible node" reason blames the pod's nodeSelector, affinity and tolerations.  Under GPU
Feature Discovery's ``mig.strategy=single`` that is often gpuslice's own doing: GFD relabels
``nvidia.com/gpu.product`` as ``<model>-MIG-<profile>`` or ``<model>-MIG-INVALID`` once the
agent has reshaped the GPUs, so a pod selecting on the plain model stops matching the node it
was planned on.  :func:`product_selector_hint` finds that case (a single-strategy node of the
model the pod selects, which the pod would fit with the product it asks for) and says so,
with the fix: ClusterPolicy ``mig.strategy=mixed``.

A node that is cordoned or under a ``node.kubernetes.io/*`` taint is *paused*
(:func:`partitioner.eligibility.paused_why`): a pod it would fit once back, and whose GPUs could
serve it, is not rejected for it for good.  :func:`paused_fit` finds such a node and
:func:`paused_sentence` says so; the controller keeps the pod gated, and ``gpuslice status`` and
``plan --snapshot`` say the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from partitioner.eligibility import paused_why, pod_fits_node, pod_fits_when_back
from partitioner.node_labels import PRODUCT_LABEL, STRATEGY_LABEL, MigStrategy
from planner.catalog import CatalogError, GpuModel
from planner.demand import one_mps_slice
from planner.snapshot import (
    Mode,
    Unplaced,
    canonical_mps_resource,
    mig_profile_of,
    mps_gb_of,
    mps_near_miss,
)

__all__ = [
    "MIG_MODES",
    "PausedNode",
    "has_profile",
    "paused_fit",
    "paused_sentence",
    "product_selector_hint",
    "reject_reason",
]

MIG_MODES = (Mode.MIG, Mode.HYBRID)

_EXACT = "Kubernetes matches extended resource names exactly, case included"


def has_profile(model: GpuModel, resource: str) -> bool:
    """Whether ``model``'s nodes advertise ``resource`` (``nvidia.com/mig-<profile>``) exactly."""
    try:
        model.requested_profile(resource)
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
        canonical = canonical_mps_resource(resource)
        if (near_mps := mps_near_miss(resource)) is not None:
            return (
                f"unknown resource {resource}: gpuslice's nodes never advertise it ({_EXACT}, "
                f"and sizes have no leading zeros); did you mean {near_mps}? Ask for {near_mps} "
                f"in the pod's resources"
            )
        modes = MIG_MODES if profile is not None else (Mode.MPS, Mode.HYBRID)
        kind = "MIG" if profile is not None else "MPS"
        fitting = [model for mode, model in eligible if mode in modes]
        if not fitting:
            return (
                f"no eligible node: no opted-in {kind} node matches the pod's nodeSelector, "
                f"affinity and tolerations (for {resource})"
            )
        if canonical is not None and (gb is None or gb <= 0):
            return f"unknown resource {resource}: an MPS slice needs at least 1 GB"
        if profile is not None and not any(has_profile(m, resource) for m in fitting):
            models = sorted({m.name for m in fitting})
            near = next((p for m in fitting if (p := m.near_miss(resource)) is not None), None)
            if near is not None:
                return (
                    f"unknown resource {resource}: gpuslice's nodes never advertise it ({_EXACT}); "
                    f"did you mean {near.resource}? Ask for {near.resource} in the pod's resources"
                )
            valid = ", ".join(p.resource for p in fitting[0].profiles)
            return (
                f"unknown resource {resource}: no eligible GPU ({', '.join(models)}) has MIG "
                f"profile {profile}; valid on {fitting[0].name}: {valid}"
            )
    return None


def _base_product(product: str) -> str:
    """The model part of a GFD product string (no ``-SHARED``, no ``-MIG-<profile>``)."""
    return product.removesuffix("-SHARED").partition("-MIG-")[0]


def _selected_products(pod: Mapping[str, Any]) -> list[str]:
    """The ``nvidia.com/gpu.product`` values the pod's nodeSelector or required node affinity
    (``In``) asks for."""
    spec = pod.get("spec") or {}
    wanted: list[str] = []
    selector = spec.get("nodeSelector") or {}
    if PRODUCT_LABEL in selector:
        wanted.append(str(selector[PRODUCT_LABEL]))
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or ():
        for expr in (term or {}).get("matchExpressions") or ():
            if (expr or {}).get("key") == PRODUCT_LABEL and expr.get("operator") == "In":
                wanted += [str(v) for v in expr.get("values") or ()]
    return sorted(set(wanted))


def product_selector_hint(pod: Mapping[str, Any], opted_in: Iterable[Mapping[str, Any]]) -> str:
    """A sentence to add to a "no eligible node" reason when the pod selects on
    ``nvidia.com/gpu.product`` and an opted-in node (API object) under GFD's
    ``mig.strategy=single`` is of that model, labelled with another product, and would take
    the pod if it still carried the product asked for (module docstring); ``""`` otherwise."""
    wanted = _selected_products(pod)
    if not wanted:
        return ""
    for node in sorted(opted_in, key=lambda n: str((n.get("metadata") or {}).get("name", ""))):
        meta = node.get("metadata") or {}
        labels: Mapping[str, str] = meta.get("labels") or {}
        product = labels.get(PRODUCT_LABEL)
        if labels.get(STRATEGY_LABEL) != MigStrategy.SINGLE.value or product is None:
            continue
        for value in wanted:
            if value == product or _base_product(value) != _base_product(product):
                continue
            relabelled = {**meta, "labels": {**labels, PRODUCT_LABEL: value}}
            if pod_fits_node(pod, {**node, "metadata": relabelled}):
                return (
                    f"; the pod selects {PRODUCT_LABEL}={value}, but node {meta.get('name')} "
                    f"is now labelled {product}: under the GPU Operator's mig.strategy=single "
                    f"GPU Feature Discovery relabels the product whenever gpuslice repartitions "
                    f"the GPUs; set ClusterPolicy mig.strategy=mixed (the product then stays "
                    f"the model), or select on a label of your own"
                )
    return ""


PausedNode = tuple[str, Mapping[str, Any], Mode, GpuModel, bool]
"""(name, Node object, mode, model, served by DRA) of an opted-in GPU node."""


def paused_fit(
    pod: Mapping[str, Any],
    slices: Mapping[str, int],
    dra: bool,
    nodes: Iterable[PausedNode],
) -> tuple[str, str] | None:
    """(name, why) of the first of ``nodes`` (in the order given) that is paused, whose GPUs
    could serve ``slices`` (:func:`reject_reason`) in the pod's way of asking (``dra``), and
    that the pod would fit once back (:func:`partitioner.eligibility.pod_fits_when_back`), or
    ``None`` (module docstring)."""
    for name, obj, mode, model, node_dra in nodes:
        why = paused_why(obj)
        if (
            why is not None
            and node_dra == dra
            and reject_reason(slices, [(mode, model)]) is None
            and pod_fits_when_back(pod, obj)
        ):
            return name, why
    return None


def paused_sentence(found: tuple[str, str] | None) -> str:
    """The sentence a "no eligible node" reason gets for :func:`paused_fit`'s node ("" for
    none)."""
    if found is None:
        return ""
    return (
        f"; node {found[0]}, which the pod would fit, is {found[1]}: the pod keeps its gate and "
        f"waits for the node to be back"
    )
