"""Which nodes a pending pod may run on: the scheduler's hard node filters, on plain API objects.

A pod may go to a node when all of these hold (the kube-scheduler's NodeUnschedulable,
NodeAffinity and TaintToleration filters):

* the node is not cordoned (``spec.unschedulable``), unless the pod tolerates
  ``node.kubernetes.io/unschedulable``;
* every ``spec.nodeSelector`` key/value equals the node's label;
* ``requiredDuringSchedulingIgnoredDuringExecution`` node affinity: at least one of the
  ``nodeSelectorTerms`` matches, where a term matches when all its ``matchExpressions``
  (operators ``In``, ``NotIn``, ``Exists``, ``DoesNotExist``, ``Gt``, ``Lt`` on labels) and all
  its ``matchFields`` (``metadata.name`` with ``In``/``NotIn``) hold; a term with neither
  matches nothing;
* every taint with effect ``NoSchedule`` or ``NoExecute`` is tolerated by some toleration
  (``PreferNoSchedule`` is a preference and is ignored).

``Gt``/``Lt`` compare integers as kube-scheduler reads them (``strconv.ParseInt(v, 10, 64)``:
ASCII digits after an optional sign, no ``_``, within int64; the requirement's value must also
be a valid label value, so unsigned): a node label that does not parse does not match; a
requirement value that does not parse fails its term.
An unknown operator matches nothing (the API server would have rejected it).

A node that is cordoned or carries one of Kubernetes' own lifecycle taints
(``node.kubernetes.io/*``: not-ready, unreachable, the pressure taints, unschedulable,
out-of-service) is *paused*, not gone: the kubelet and the node lifecycle controller take those
off again when the node is back (a reboot, a driver upgrade behind ``kubectl drain``).
:func:`paused_why` says why a node is paused, and :func:`pod_fits_when_back` whether the pod
would fit it once it is back (every other filter as it is now).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "affinity_matches",
    "eligible_nodes",
    "node_selector_matches",
    "paused_why",
    "pod_fits_node",
    "pod_fits_when_back",
    "taints_tolerated",
    "tolerates",
]

_HARD_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
_CORDON_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
_LIFECYCLE = "node.kubernetes.io/"
"""Prefix of the taints Kubernetes itself puts on a node while it is not ready for pods."""


def _labels(node: Mapping[str, Any]) -> Mapping[str, str]:
    labels: Mapping[str, str] = (node.get("metadata") or {}).get("labels") or {}
    return labels


def node_selector_matches(pod_spec: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    labels = _labels(node)
    selector: Mapping[str, str] = pod_spec.get("nodeSelector") or {}
    return all(labels.get(k) == v for k, v in selector.items())


_INT64 = re.compile(r"[+-]?(?P<digits>[0-9]+)")
"""What Go's ``strconv.ParseInt(v, 10, 64)`` reads: an optional sign, then ASCII digits, no
``_`` (its range is checked apart)."""
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def _as_int64(value: str) -> int | None:
    """``value`` as kube-scheduler reads a node label for ``Gt``/``Lt``: ``strconv.ParseInt(
    value, 10, 64)``, ``None`` where that fails (no ``_``, spaces or other scripts' digits,
    which Python's ``int`` takes; beyond int64)."""
    m = _INT64.fullmatch(value)
    digits = m["digits"].lstrip("0") if m else ""
    if m is None or len(digits) > 19:  # leading zeros are fine, however many
        return None
    n = -int(digits or "0") if value.startswith("-") else int(digits or "0")
    return n if -(2**63) <= n < 2**63 else None


def _bound(value: str) -> int | None:
    """A ``Gt``/``Lt`` requirement's value as kube-scheduler reads it (``labels.NewRequirement``):
    an int64 that is also a valid label value (63 characters at most, no sign); ``None``: the
    requirement is invalid and its term matches nothing."""
    if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
        return None
    return _as_int64(value)


def _expression_matches(expr: Mapping[str, Any], values: Mapping[str, str]) -> bool:
    key, op = expr.get("key", ""), expr.get("operator", "")
    wanted: list[str] = list(expr.get("values") or ())
    present = key in values
    actual = values.get(key)
    match op:
        case "In":
            return present and actual in wanted
        case "NotIn":
            return not present or actual not in wanted
        case "Exists":
            return present
        case "DoesNotExist":
            return not present
        case "Gt" | "Lt":
            if not present or len(wanted) != 1:
                return False
            have, bound = _as_int64(str(actual)), _bound(str(wanted[0]))
            if have is None or bound is None:
                return False
            return have > bound if op == "Gt" else have < bound
        case _:
            return False


def _term_matches(term: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    exprs = term.get("matchExpressions") or ()
    fields = term.get("matchFields") or ()
    if not exprs and not fields:
        return False
    labels = _labels(node)
    name = (node.get("metadata") or {}).get("name", "")
    field_values = {"metadata.name": name}
    for f in fields:
        if f.get("key") != "metadata.name" or f.get("operator") not in ("In", "NotIn"):
            return False
    return all(_expression_matches(e, labels) for e in exprs) and all(
        _expression_matches(f, field_values) for f in fields
    )


def affinity_matches(pod_spec: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """The pod's required node affinity holds on the node (true when it has none)."""
    node_affinity = (pod_spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True
    terms = required.get("nodeSelectorTerms") or ()
    return any(_term_matches(t, node) for t in terms)


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """One toleration tolerates one taint (key, operator Equal/Exists, value, effect)."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return not key or key == taint.get("key")
    if operator != "Equal":
        return False
    return key == taint.get("key") and (toleration.get("value") or "") == (taint.get("value") or "")


def taints_tolerated(pod_spec: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    node_spec = node.get("spec") or {}
    taints: list[Mapping[str, Any]] = [
        t for t in (node_spec.get("taints") or ()) if t.get("effect") in _HARD_EFFECTS
    ]
    if node_spec.get("unschedulable"):
        taints.append(_CORDON_TAINT)
    tolerations = pod_spec.get("tolerations") or ()
    return all(any(tolerates(tol, taint) for tol in tolerations) for taint in taints)


def paused_why(node: Mapping[str, Any]) -> str | None:
    """Why ``node`` takes no new pods for now (cordoned, or a ``node.kubernetes.io/*`` taint
    with a hard effect), or ``None``."""
    spec = node.get("spec") or {}
    why = ["cordoned (spec.unschedulable)"] if spec.get("unschedulable") else []
    why += [
        f"tainted {t.get('key')}:{t.get('effect')}"
        for t in spec.get("taints") or ()
        if isinstance(t, Mapping)
        and t.get("effect") in _HARD_EFFECTS
        and str(t.get("key") or "").startswith(_LIFECYCLE)
        and not (why and t.get("key") == _CORDON_TAINT["key"])  # the cordon, said already
    ]
    return ", ".join(why) or None


def pod_fits_when_back(pod: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """:func:`pod_fits_node` with the node's cordon and lifecycle taints gone (module
    docstring)."""
    spec = node.get("spec") or {}
    back = {
        **node,
        "spec": {
            **spec,
            "unschedulable": False,
            "taints": [
                t
                for t in spec.get("taints") or ()
                if not (isinstance(t, Mapping) and str(t.get("key") or "").startswith(_LIFECYCLE))
            ],
        },
    }
    return pod_fits_node(pod, back)


def pod_fits_node(pod: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    return (
        node_selector_matches(spec, node)
        and affinity_matches(spec, node)
        and taints_tolerated(spec, node)
    )


def eligible_nodes(pod: Mapping[str, Any], nodes: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """Names of the nodes among ``nodes`` the pod may be scheduled to."""
    return frozenset(
        (n.get("metadata") or {}).get("name", "") for n in nodes if pod_fits_node(pod, n)
    )
