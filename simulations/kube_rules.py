"""The Kubernetes API server's pod rules that gate-and-release depends on, as plain functions.

The time replay's API store (:mod:`simulations.kube`) refuses what a real API server (>= 1.30)
refuses, so a controller that relies on something Kubernetes forbids fails in the simulator
too.  Facts from ``pkg/apis/core/validation`` (see ../shared/facts/k8s-scheduling.md §1-2):

* creation: ``spec.nodeName`` together with scheduling gates is Forbidden; gate names must be
  unique;
* update: scheduling gates may only be removed (adding one is Forbidden);
* update: ``spec.nodeSelector`` may only gain keys, and the required node affinity may only be
  narrowed (same number of ``nodeSelectorTerms``; every term keeps its ``matchExpressions`` and
  ``matchFields`` as a prefix and only appends; an empty term gains nothing; an absent required
  affinity may be set) — and both only while the *old* pod is gated;
* update: tolerations may only be added;
* update: nothing else in ``spec`` may change (resources included).

:func:`merge_patch` applies an RFC 7386 JSON merge patch (what the partitioner sends).
Violations raise :class:`Invalid` (HTTP 422 in a real API server) naming the field.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Invalid", "merge_patch", "validate_pod_create", "validate_pod_update"]

_MUTABLE = frozenset({"schedulingGates", "nodeSelector", "affinity", "tolerations"})


class Invalid(ValueError):
    """The API server would answer 422 Invalid; the message names the field."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _gates(pod: Mapping[str, Any]) -> list[str]:
    return [
        str(g.get("name", ""))
        for g in (pod.get("spec") or {}).get("schedulingGates") or ()
        if isinstance(g, Mapping)
    ]


def validate_pod_create(pod: Mapping[str, Any]) -> None:
    gates = _gates(pod)
    if gates and (pod.get("spec") or {}).get("nodeName"):
        raise Invalid("spec.nodeName: Forbidden: cannot be set when scheduling gates are present")
    if len(gates) != len(set(gates)):
        raise Invalid(f"spec.schedulingGates: Duplicate value in {gates}")


def _required_terms(spec: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required is None:
        return None
    return list(required.get("nodeSelectorTerms") or ())


def _is_prefix(old: Sequence[Any], new: Sequence[Any]) -> bool:
    return len(new) >= len(old) and list(new[: len(old)]) == list(old)


def _check_affinity(old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    field = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    old_terms, new_terms = _required_terms(old), _required_terms(new)
    if old_terms is None or old_terms == new_terms:
        return
    if new_terms is None or len(new_terms) != len(old_terms):
        raise Invalid(f"{field}.nodeSelectorTerms: Invalid value: terms cannot be added or removed")
    for i, (o, n) in enumerate(zip(old_terms, new_terms, strict=True)):
        for part in ("matchExpressions", "matchFields"):
            before, after = list(o.get(part) or ()), list(n.get(part) or ())
            if not before and not (o.get("matchExpressions") or o.get("matchFields")) and after:
                raise Invalid(f"{field}.nodeSelectorTerms[{i}]: an empty term cannot gain {part}")
            if not _is_prefix(before, after):
                raise Invalid(
                    f"{field}.nodeSelectorTerms[{i}].{part}: Invalid value: existing "
                    f"requirements can only be appended to"
                )


def validate_pod_update(old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """Refuse what the API server refuses in a pod update (module docstring)."""
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    old_gates, new_gates = _gates(old), _gates(new)
    added = [g for g in new_gates if g not in old_gates]
    if added:
        raise Invalid(
            f"spec.schedulingGates: Forbidden: only deletion is allowed, but found new scheduling "
            f"gate {added[0]!r}"
        )
    for key in sorted(set(old_spec) | set(new_spec)):
        if key in _MUTABLE or key == "nodeName":
            continue
        if old_spec.get(key) != new_spec.get(key):
            raise Invalid(
                f"spec: Forbidden: pod updates may not change fields other than "
                f"schedulingGates, nodeSelector, affinity (node, while gated), tolerations "
                f"(additions); {key!r} changed"
            )
    if old_spec.get("nodeName") != new_spec.get("nodeName"):
        raise Invalid("spec.nodeName: Forbidden: set by binding only")
    gated = bool(old_gates)
    old_sel, new_sel = old_spec.get("nodeSelector") or {}, new_spec.get("nodeSelector") or {}
    if old_sel != new_sel:
        if not gated:
            raise Invalid("spec.nodeSelector: Forbidden: only mutable while the pod is gated")
        if any(new_sel.get(k) != v for k, v in old_sel.items()):
            raise Invalid("spec.nodeSelector: Invalid value: existing keys cannot change")
    old_aff, new_aff = old_spec.get("affinity") or {}, new_spec.get("affinity") or {}
    if old_aff != new_aff:
        for key in sorted(set(old_aff) | set(new_aff)):
            if key != "nodeAffinity" and old_aff.get(key) != new_aff.get(key):
                raise Invalid(f"spec.affinity.{key}: Forbidden: not mutable")
        if not gated:
            raise Invalid("spec.affinity: Forbidden: node affinity is only mutable while gated")
        _check_affinity(old_spec, new_spec)
    old_tol = list(old_spec.get("tolerations") or ())
    new_tol = list(new_spec.get("tolerations") or ())
    if old_tol != new_tol and not all(t in new_tol for t in old_tol):
        raise Invalid("spec.tolerations: Forbidden: existing tolerations cannot be removed")
