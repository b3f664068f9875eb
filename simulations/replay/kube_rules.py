"""What the Kubernetes API server lets a pod be created and updated with, as pure checks.

The time replay's API store (:mod:`simulations.replay.kube`) and the tests' fake API server
(``tests/fake_apiserver.py``) both refuse what a real API server (>= 1.30) refuses, with these
functions, so a controller that relies on something Kubernetes forbids fails in both.

Model (facts/k8s-scheduling.md sections 1 and 2; ``pkg/apis/core/validation``)
------------------------------------------------------------------------------
Create (:func:`create_errors`):

* gate names are unique (``Duplicate``);
* ``spec.nodeName`` together with gates is ``Forbidden``.

Update of the pod's main resource (:func:`update_errors`, ``old`` -> ``new``):

* ``spec.schedulingGates``: names may only be removed, never added (``Forbidden``);
* ``spec.tolerations``: may only gain entries (an existing one may change only its
  ``tolerationSeconds``);
* ``spec.containers[*].image`` / ``spec.initContainers[*].image``: free;
* only while the **old** pod is gated (one request may narrow and drop the last gate):
  ``spec.nodeSelector`` may only gain keys; ``spec.affinity.nodeAffinity``'s preferred terms are
  free; its required terms may only be narrowed: an absent required affinity may be set, else
  the number of ``nodeSelectorTerms`` stays and each term keeps its ``matchExpressions`` and
  ``matchFields`` as a prefix (an empty term gains nothing);
* anything else in ``spec`` (resources, ``nodeName``, pod (anti-)affinity, ...) is
  ``Forbidden``.

Each error is ``"<field path>: <type>: <detail>"``; the API server answers 422 Invalid with
``Pod "<name>" is invalid: <errors>`` (:func:`invalid_message`).

:func:`merge_patch` applies an RFC 7386 JSON merge patch (what the partitioner sends);
:func:`validate_pod_create` / :func:`validate_pod_update` raise :class:`Invalid` with the
errors.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "Invalid",
    "create_errors",
    "invalid_message",
    "merge_patch",
    "update_errors",
    "validate_pod_create",
    "validate_pod_update",
]

Obj = Mapping[str, Any]
_FREE_WHILE_GATED = ("nodeSelector", "affinity")
_CHECKED = {"schedulingGates", "tolerations", "containers", "initContainers", *_FREE_WHILE_GATED}
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
_UPDATABLE = (
    "pod updates may not change fields other than spec.containers[*].image, "
    "spec.initContainers[*].image, spec.tolerations (only additions), spec.schedulingGates "
    "(only deletions) and, while the pod is gated, spec.nodeSelector (only additions) and "
    "spec.affinity.nodeAffinity (only narrowing)"
)


def _spec(pod: Obj) -> Obj:
    spec = pod.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _gate_names(pod: Obj) -> list[str]:
    return [str(g.get("name")) for g in _spec(pod).get("schedulingGates") or ()]


def _duplicates(names: Sequence[str]) -> list[str]:
    seen: set[str] = set()
    errors = []
    for i, name in enumerate(names):
        if name in seen:
            errors.append(f"spec.schedulingGates[{i}].name: Duplicate value: {name!r}")
        seen.add(name)
    return errors


def create_errors(pod: Obj) -> list[str]:
    names = _gate_names(pod)
    errors = _duplicates(names)
    if names and _spec(pod).get("nodeName"):
        errors.append(
            "spec.nodeName: Forbidden: cannot be set until all schedulingGates have been cleared"
        )
    return errors


def _gate_errors(old: Obj, new: Obj) -> list[str]:
    old_names, new_names = set(_gate_names(old)), _gate_names(new)
    errors = _duplicates(new_names)
    for i, name in enumerate(new_names):
        if name not in old_names:
            errors.append(
                f"spec.schedulingGates[{i}].name: Forbidden: only deletion is allowed, but found "
                f"new scheduling gate {name!r}"
            )
    return errors


def _toleration_errors(old: Obj, new: Obj) -> list[str]:
    def key(t: Obj) -> tuple[Any, ...]:
        return tuple(t.get(k) for k in ("key", "operator", "value", "effect"))

    new_keys = {key(t) for t in _spec(new).get("tolerations") or ()}
    return [
        f"spec.tolerations[{i}]: Forbidden: existing toleration can not be modified except its "
        f"tolerationSeconds"
        for i, t in enumerate(_spec(old).get("tolerations") or ())
        if key(t) not in new_keys
    ]


def _without_images(containers: Any) -> list[Any]:
    return [
        {k: v for k, v in c.items() if k != "image"} if isinstance(c, Mapping) else c
        for c in containers or ()
    ]


def _node_selector_errors(old: Obj, new: Obj) -> list[str]:
    before = dict(_spec(old).get("nodeSelector") or {})
    after = dict(_spec(new).get("nodeSelector") or {})
    if any(after.get(k) != v for k, v in before.items()):
        return [
            "spec.nodeSelector: Invalid: only additions to spec.nodeSelector are allowed (no "
            "mutations or deletions)"
        ]
    return []


def _is_prefix(before: Sequence[Any], after: Sequence[Any]) -> bool:
    return list(after[: len(before)]) == list(before)


def _required_affinity_errors(before: Obj | None, after: Obj | None) -> list[str]:
    path = f"spec.affinity.nodeAffinity.{_REQUIRED}"
    old_terms = list((before or {}).get("nodeSelectorTerms") or ())
    if not old_terms:
        return []  # an absent required affinity may be set to anything
    if after is None:
        return [f"{path}: Invalid: may not be removed (only narrowed)"]
    new_terms = list(after.get("nodeSelectorTerms") or ())
    if len(new_terms) != len(old_terms):
        return [
            f"{path}.nodeSelectorTerms: Invalid: no additions/deletions to non-empty "
            f"NodeSelectorTerms list are allowed"
        ]
    errors = []
    for i, (o, n) in enumerate(zip(old_terms, new_terms, strict=True)):
        empty = not o.get("matchExpressions") and not o.get("matchFields")
        for part in ("matchExpressions", "matchFields"):
            was, now = list(o.get(part) or ()), list(n.get(part) or ())
            if (empty and now) or not _is_prefix(was, now):
                errors.append(
                    f"{path}.nodeSelectorTerms[{i}].{part}: Invalid: only additions to the list "
                    f"of node selector requirements are allowed"
                )
    return errors


def _affinity_errors(old: Obj, new: Obj) -> list[str]:
    before = dict(_spec(old).get("affinity") or {})
    after = dict(_spec(new).get("affinity") or {})
    errors = [
        f"spec.affinity.{k}: Forbidden: {_UPDATABLE}"
        for k in ("podAffinity", "podAntiAffinity")
        if before.get(k) != after.get(k)
    ]
    old_na, new_na = before.get("nodeAffinity") or {}, after.get("nodeAffinity") or {}
    return errors + _required_affinity_errors(old_na.get(_REQUIRED), new_na.get(_REQUIRED))


def update_errors(old: Obj, new: Obj) -> list[str]:
    before, after = _spec(old), _spec(new)
    errors = _gate_errors(old, new) + _toleration_errors(old, new)
    for key in ("containers", "initContainers"):
        if _without_images(before.get(key)) != _without_images(after.get(key)):
            errors.append(f"spec.{key}: Forbidden: {_UPDATABLE}")
    gated = bool(_gate_names(old))
    for key in _FREE_WHILE_GATED:
        if (before.get(key) or None) != (after.get(key) or None) and not gated:
            errors.append(f"spec.{key}: Forbidden: {_UPDATABLE}")
    if gated:
        errors += _node_selector_errors(old, new) + _affinity_errors(old, new)
    for key in sorted((set(before) | set(after)) - _CHECKED):
        if before.get(key) != after.get(key):
            errors.append(f"spec.{key}: Forbidden: {_UPDATABLE}")
    return errors


def invalid_message(pod: Obj, errors: Sequence[str]) -> str:
    name = (pod.get("metadata") or {}).get("name") or (pod.get("metadata") or {}).get(
        "generateName", ""
    )
    listed = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
    return f'Pod "{name}" is invalid: {listed}'


class Invalid(ValueError):
    """The API server would answer 422 Invalid; the message names the field(s)."""


def validate_pod_create(pod: Obj) -> None:
    errors = create_errors(pod)
    if errors:
        raise Invalid(invalid_message(pod, errors))


def validate_pod_update(old: Obj, new: Obj) -> None:
    errors = update_errors(old, new)
    if errors:
        raise Invalid(invalid_message(new, errors))


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
