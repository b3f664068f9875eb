"""The scheduling gate: which pods gpuslice gates at admission, and the patches that gate and
release them. Pure: plain API objects in, plain patches out.

Model
-----
A pod that asks for a slice (``nvidia.com/mig-<profile>`` or ``nvidia.com/gpu-<N>gb`` in the
requests or limits of any container or init container) is created with the scheduling gate
:data:`GATE` by the partitioner's mutating admission webhook.  kube-scheduler ignores a gated
pod (it is parked, never tried), so nothing can bind it before gpuslice has decided which slice
it gets.  The rules the API server enforces (Kubernetes >= 1.30, KEP-3521 / KEP-3838):

* gates can only be set at creation (by the client or a mutating webhook); afterwards they can
  only be removed.  A pod with ``spec.nodeName`` cannot carry gates, and a repeated gate name
  fails the creation, so the webhook adds :data:`GATE` only when it is absent
  (:func:`admission_patch`);
* while a pod is gated its required node affinity may be *narrowed*: every existing
  ``nodeSelectorTerms`` entry may get requirements appended, none may be added or removed; an
  absent required affinity may be set.  One update may narrow and remove the last gate
  (:func:`release_patch` does both, with the resourceVersion it was computed from).

Who is gated (:func:`wants_gate`): pods that ask for a slice, are not bound (``nodeName``), are
not owned by a DaemonSet (those are placed per node by their controller), and do not opt out
(pod label :data:`OPT_OUT_LABEL` = ``disabled``; the same label on the namespace keeps the whole
namespace off the webhook, see the chart).  The webhook's ``matchConditions``
(:data:`MATCH_CONDITIONS`, CEL) select the same pods inside the API server, so no other pod ever
reaches the webhook; a test checks both agree.  Both go by resource *names*; the webhook
(:mod:`partitioner.webhook`) also reads the amounts (:func:`partitioner.quantities.pod_requests`)
and leaves a pod whose slice amounts are all zero ungated.

Release (:func:`release_patch`): the pod's required node affinity is narrowed to the node its
slice waits on by appending ``matchFields: metadata.name In [node]`` to every existing term (or
setting one term if there is none), :data:`GATE` is removed (other controllers' gates stay) and
the reservation annotation is set, as one JSON merge patch.  :func:`ungate_patch` removes
:data:`GATE` alone (``gpuslice ungate``, uninstall): the pod then takes the ordinary path.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "GATE",
    "MATCH_CONDITIONS",
    "MATCH_CONDITIONS_DRA",
    "OPT_OUT_LABEL",
    "OPT_OUT_VALUE",
    "admission_patch",
    "gates",
    "has_gate",
    "narrowed_affinity",
    "other_gates",
    "release_patch",
    "slice_resources",
    "ungate_patch",
    "wants_gate",
]

GATE = "gpuslice.io/slice"
"""The scheduling gate gpuslice adds at admission and removes on release."""
OPT_OUT_LABEL = "gpuslice.io/gating"
"""Pod or namespace label; the value :data:`OPT_OUT_VALUE` keeps the pod(s) ungated."""
OPT_OUT_VALUE = "disabled"

_MIG_PREFIX = "nvidia.com/mig-"
_MPS = re.compile(r"nvidia\.com/gpu-[0-9]+gb")
"""Matched whole (``fullmatch``) and ASCII digits only, exactly like the CEL ``matches`` (RE2) in
:data:`MATCH_CONDITIONS`: ``$`` would also match before a trailing newline and ``\\d`` any
Unicode digit."""

_CEL_SLICE_KEY = "k.startsWith('nvidia.com/mig-') || k.matches('^nvidia\\\\.com/gpu-[0-9]+gb$')"
_CEL_CONTAINERS = (
    f"(has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(k, {_CEL_SLICE_KEY})) || "
    f"(has(c.resources.requests) && c.resources.requests.exists(k, {_CEL_SLICE_KEY}))))"
)
_CEL_ASKS = (
    f"object.spec.containers.exists(c, {_CEL_CONTAINERS}) || "
    f"(has(object.spec.initContainers) && object.spec.initContainers.exists(c, "
    f"{_CEL_CONTAINERS}))"
)
_CEL_CLAIMS = "(has(object.spec.resourceClaims) && size(object.spec.resourceClaims) > 0)"
MATCH_CONDITIONS: tuple[tuple[str, str], ...] = (
    ("asks-for-a-slice", _CEL_ASKS),
    ("not-bound", "!has(object.spec.nodeName) || object.spec.nodeName == ''"),
    (
        "not-opted-out",
        f"!has(object.metadata.labels) || !('{OPT_OUT_LABEL}' in object.metadata.labels) || "
        f"object.metadata.labels['{OPT_OUT_LABEL}'] != '{OPT_OUT_VALUE}'",
    ),
    (
        "not-a-daemonset-pod",
        "!has(object.metadata.ownerReferences) || "
        "!object.metadata.ownerReferences.exists(o, o.kind == 'DaemonSet')",
    ),
)
"""``(name, CEL expression)`` pairs for the MutatingWebhookConfiguration's ``matchConditions``:
the API server calls the webhook only for pods :func:`wants_gate` would gate (ignoring whether
the gate is already there, which the webhook itself checks)."""
MATCH_CONDITIONS_DRA: tuple[tuple[str, str], ...] = (
    ("asks-for-a-slice", f"{_CEL_CLAIMS} || {_CEL_ASKS}"),
    *MATCH_CONDITIONS[1:],
)
"""The same with DRA nodes served (``claims=True`` in :func:`wants_gate`): pods naming
ResourceClaims are gated too."""

Obj = Mapping[str, Any]


def _is_slice_resource(name: str) -> bool:
    return name.startswith(_MIG_PREFIX) or _MPS.fullmatch(name) is not None


def slice_resources(pod: Obj) -> list[str]:
    """The partitionable resource names a pod requests or limits, sorted (any container)."""
    spec = pod.get("spec") or {}
    names: set[str] = set()
    for key in ("containers", "initContainers"):
        containers = spec.get(key) or ()
        if not isinstance(containers, Sequence):
            continue
        for c in containers:
            res = (c.get("resources") or {}) if isinstance(c, Mapping) else {}
            for part in ("requests", "limits"):
                values = res.get(part) or {}
                if isinstance(values, Mapping):
                    names.update(str(n) for n in values)
    return sorted(n for n in names if _is_slice_resource(n))


def gates(pod: Obj) -> list[str]:
    """The names of the pod's scheduling gates, in order."""
    raw = (pod.get("spec") or {}).get("schedulingGates") or ()
    return [str(g.get("name", "")) for g in raw if isinstance(g, Mapping)]


def has_gate(pod: Obj) -> bool:
    return GATE in gates(pod)


def other_gates(pod: Obj) -> list[str]:
    """Gates of other controllers (e.g. Kueue's): gpuslice waits until they are gone."""
    return [g for g in gates(pod) if g != GATE]


def _owned_by_daemonset(pod: Obj) -> bool:
    owners = (pod.get("metadata") or {}).get("ownerReferences") or ()
    return any(isinstance(o, Mapping) and o.get("kind") == "DaemonSet" for o in owners)


def wants_gate(pod: Obj, claims: bool = False) -> bool:
    """The pod is one gpuslice gates at admission (see the module docstring); with ``claims``
    (DRA nodes served) also a pod that names ResourceClaims: which driver they ask is not
    known at admission, so the partitioner removes the gate of a pod whose claims ask gpuslice
    for nothing (:mod:`partitioner.decide`)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if isinstance(labels, Mapping) and labels.get(OPT_OUT_LABEL) == OPT_OUT_VALUE:
        return False
    if (pod.get("spec") or {}).get("nodeName") or _owned_by_daemonset(pod):
        return False
    if claims:
        named = (pod.get("spec") or {}).get("resourceClaims")
        if isinstance(named, Sequence) and not isinstance(named, str) and len(named) > 0:
            return True
    return bool(slice_resources(pod))


def admission_patch(pod: Obj, claims: bool = False) -> list[dict[str, Any]] | None:
    """The gates list the webhook sets (existing gates + :data:`GATE`), or ``None``.

    ``None`` when the pod is not one to gate or already carries the gate (a repeated gate name
    would make the API server reject the pod).
    """
    if not wants_gate(pod, claims) or has_gate(pod):
        return None
    raw = (pod.get("spec") or {}).get("schedulingGates") or []
    return [*(dict(g) for g in raw if isinstance(g, Mapping)), {"name": GATE}]


def narrowed_affinity(pod: Obj, node: str) -> dict[str, Any]:
    """The pod's ``spec.affinity`` with its required node affinity narrowed to ``node``.

    Every existing ``nodeSelectorTerms`` entry keeps its requirements as a prefix and gets
    ``matchFields: metadata.name In [node]`` appended; an empty term (which matches nothing and
    may gain nothing) is kept as it is; no required affinity -> one term with that field.
    """
    affinity = copy.deepcopy(dict((pod.get("spec") or {}).get("affinity") or {}))
    node_affinity = dict(affinity.get("nodeAffinity") or {})
    required = dict(node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    pin = {"key": "metadata.name", "operator": "In", "values": [node]}
    terms = [dict(t) for t in required.get("nodeSelectorTerms") or () if isinstance(t, Mapping)]
    if not terms:
        terms = [{"matchFields": [pin]}]
    else:
        for term in terms:
            if term.get("matchExpressions") or term.get("matchFields"):
                term["matchFields"] = [*(term.get("matchFields") or ()), pin]
    required["nodeSelectorTerms"] = terms
    node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = required
    affinity["nodeAffinity"] = node_affinity
    return affinity


def _remaining_gates(pod: Obj) -> list[dict[str, Any]] | None:
    raw = (pod.get("spec") or {}).get("schedulingGates") or []
    left = [dict(g) for g in raw if isinstance(g, Mapping) and g.get("name") != GATE]
    return left or None


def release_patch(
    pod: Obj, node: str, annotations: Mapping[str, str | None] | None = None
) -> dict[str, Any]:
    """JSON merge patch: narrow the node affinity to ``node``, remove :data:`GATE`, annotate.

    Carries the pod's ``resourceVersion``, so the API server refuses it (409) if the pod changed
    since it was read.
    """
    meta: dict[str, Any] = {}
    rv = (pod.get("metadata") or {}).get("resourceVersion")
    if rv is not None:
        meta["resourceVersion"] = rv
    if annotations:
        meta["annotations"] = dict(annotations)
    return {
        "metadata": meta,
        "spec": {
            "affinity": narrowed_affinity(pod, node),
            "schedulingGates": _remaining_gates(pod),
        },
    }


def ungate_patch(pod: Obj) -> dict[str, Any] | None:
    """JSON merge patch removing :data:`GATE` only (``None`` when the pod has no such gate)."""
    if not has_gate(pod):
        return None
    meta: dict[str, Any] = {}
    rv = (pod.get("metadata") or {}).get("resourceVersion")
    if rv is not None:
        meta["resourceVersion"] = rv
    return {"metadata": meta, "spec": {"schedulingGates": _remaining_gates(pod)}}
