"""Reservations: the slice gpuslice promised a pod, recorded on the pod. Pure.

Model
-----
A reservation ties one pod to slices on one node.  It lives in the pod's annotation
:data:`RESERVATION_ANNOTATION` (JSON, :meth:`Reservation.to_json`), so it is visible with
``kubectl get pod -o yaml``, survives a partitioner restart (the cache is rebuilt from the API)
and is written in the same request that releases the pod.  The NodePartitioning's
``status.reservations`` lists the same promises per node for ``kubectl`` and the node agent (a
derived view, rewritten from the pods when it differs).

States, in order (:class:`State`):

``draining``
    The pod waited past the drain threshold and no GPU could host it: the GPUs named in
    ``gpus`` are being emptied for it (nothing new is released onto them).  The pod is still
    gated and still a candidate elsewhere: any plan or free slice that fits it wins.
``planned``
    A plan (``plan`` = its id; empty when the slice already existed) put the pod on ``node``;
    the node has to apply it, then the node's allocatable must show the slice.  The pod is
    gated.  ``deadline``: when the node must have applied, else the pod is planned elsewhere.
``released``
    The pod's node affinity is narrowed to ``node`` and its gate removed; kube-scheduler binds
    it where the slice waits.  ``deadline``: when it must be bound, else gpuslice finds out why
    (slice taken by a pod gpuslice did not gate, node gone) and re-plans on that node or reports
    the pod as stranded.

Once the pod is bound the annotation stays as a record; it no longer holds anything.
The annotation names the pod it was written for (``pod``: its uid); on a pod of another uid
(a copy: ``kubectl debug --copy-to``, a manifest saved and applied again) it holds nothing and
is reported like a malformed one.  An annotation without the field (written before it) is
read as before.
Times are seconds since the Unix epoch (the partitioner's clock; the simulator's clock there):
finite numbers of magnitude at most :data:`MAX_TIME`.
A malformed annotation (not JSON, integers past Python's 4300-digit limit, a field of the wrong
type, a time that is not finite or beyond :data:`MAX_TIME`) is reported and ignored (the pod is
treated as unreserved): :func:`parse_reservation` raises :class:`ReservationError` for it and
nothing else.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "RESERVATION_ANNOTATION",
    "Reservation",
    "ReservationError",
    "State",
    "parse_reservation",
]

RESERVATION_ANNOTATION = "gpuslice.io/reservation"
MAX_TIME = 1e12
"""The largest time (seconds, either sign) a reservation may hold: some 31,700 years."""


class ReservationError(ValueError):
    """The reservation annotation cannot be read; the message says what is wrong."""


class State(StrEnum):
    DRAINING = "draining"
    PLANNED = "planned"
    RELEASED = "released"


@dataclass(frozen=True, slots=True)
class Reservation:
    node: str
    state: State
    gpus: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Resource -> the GPU index of each unit (the expected devices; the kubelet picks)."""
    plan: str = ""
    since: float = 0.0
    """When the reservation entered its state."""
    deadline: float = math.inf
    """When the state must have moved on (``inf``: no deadline)."""
    pod: str = ""
    """The uid of the pod it was written for ("": an annotation written before the field).
    A pod created with a copy of another pod's annotation (``kubectl debug --copy-to``, a
    manifest saved with ``kubectl get -o yaml`` and applied again) holds nothing."""

    def units(self) -> dict[str, int]:
        """Resource -> units held."""
        return {r: len(g) for r, g in self.gpus.items()}

    def to_json(self) -> str:
        doc: dict[str, Any] = {
            "node": self.node,
            "state": self.state.value,
            "gpus": {r: list(g) for r, g in sorted(self.gpus.items())},
            "since": round(self.since, 3),
        }
        if self.plan:
            doc["plan"] = self.plan
        if self.pod:
            doc["pod"] = self.pod
        if math.isfinite(self.deadline):
            doc["deadline"] = round(self.deadline, 3)
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def _clip(value: Any) -> str:
    """``value`` in a message: its type for containers, else its repr, at most 40 characters."""
    if isinstance(value, dict | list):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'}"
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _number(doc: Mapping[str, Any], key: str, default: float) -> float:
    if key not in doc:
        return default
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReservationError(f"{key!r} must be a number, got {_clip(value)}")
    if not (isinstance(value, int) or math.isfinite(value)) or not -MAX_TIME <= value <= MAX_TIME:
        raise ReservationError(
            f"{key!r} must be a finite time of at most {MAX_TIME:.0e} seconds, got {_clip(value)}"
        )
    return float(value)


def parse_reservation(text: str) -> Reservation:
    """The reservation in an annotation value; :class:`ReservationError` if malformed."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ReservationError(f"not JSON: {e}") from None
    except ValueError:  # json.loads' int() refuses integers of more than 4300 digits
        raise ReservationError("holds a number of more than 4300 digits") from None
    if not isinstance(doc, dict):
        raise ReservationError("not a JSON object")
    node = doc.get("node")
    if not isinstance(node, str) or not node:
        raise ReservationError("'node' must be a non-empty string")
    raw_state = doc.get("state")
    try:
        state = State(raw_state if isinstance(raw_state, str) else "")
    except ValueError:
        raise ReservationError(
            f"'state' must be one of {', '.join(s.value for s in State)}, got {_clip(raw_state)}"
        ) from None
    raw_gpus = doc.get("gpus") or {}
    if not isinstance(raw_gpus, dict):
        raise ReservationError("'gpus' must map resource names to GPU index lists")
    gpus: dict[str, tuple[int, ...]] = {}
    for resource, indices in raw_gpus.items():
        if not isinstance(indices, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1024 for i in indices
        ):
            raise ReservationError(f"'gpus.{resource}' must be a list of GPU indices (0-1023)")
        gpus[str(resource)] = tuple(indices)
    plan = doc.get("plan", "")
    if not isinstance(plan, str):
        raise ReservationError("'plan' must be a string")
    pod = doc.get("pod", "")
    if not isinstance(pod, str):
        raise ReservationError("'pod' must be a string (the pod's uid)")
    return Reservation(
        node=node,
        state=state,
        gpus=gpus,
        plan=plan,
        since=_number(doc, "since", 0.0),
        deadline=_number(doc, "deadline", math.inf),
        pod=pod,
    )
