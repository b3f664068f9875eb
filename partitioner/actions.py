"""What the decision step asks the controller to do: plain, immutable action records.

The decision step (:mod:`partitioner.decide`) returns these; :mod:`partitioner.writer`
carries them out against the API (the simulator carries them out against its in-memory
cluster).  None of them reads or writes anything by itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from contract.nodepartitioning import NodePartitioningSpec, ReservationEntry
from partitioner.node_actions import RemoveNodeCondition, SetNodeLabel

__all__ = [
    "NODE_CONDITION",
    "Action",
    "CreatePartitioning",
    "DeletePartitioning",
    "EmitEvent",
    "EvictPod",
    "MarkCooldown",
    "ObjectRef",
    "PatchPod",
    "SetNodeCondition",
    "WriteReservations",
    "WriteSpec",
]

NODE_CONDITION = "GpusliceReady"
"""Node condition the partitioner sets: False (with reason) when an opted-in node is unusable."""


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The object an Event is about."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""
    api_version: str = "v1"


@dataclass(frozen=True, slots=True)
class EmitEvent:
    ref: ObjectRef
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class CreatePartitioning:
    """Create the (empty) NodePartitioning of a node that opted in, owned by the node."""

    node: str
    node_uid: str
    spec: NodePartitioningSpec


@dataclass(frozen=True, slots=True)
class DeletePartitioning:
    """Delete the NodePartitioning of a node that opted out or is gone."""

    node: str


@dataclass(frozen=True, slots=True)
class WriteSpec:
    """Replace a NodePartitioning's spec if it still has ``resource_version`` (else: conflict)."""

    node: str
    spec: NodePartitioningSpec
    resource_version: str | None
    planned_pods: tuple[str, ...] = ()
    on_success: tuple[EmitEvent, ...] = ()
    """Events to emit once the write succeeded (the pods' "planned" events)."""
    planned_at: float | None = None
    """When the plan was made (the step's clock): annotation ``gpuslice.io/planned-at``, read by
    the apply deadline."""


@dataclass(frozen=True, slots=True)
class PatchPod:
    """A JSON merge patch of a pod (reserve, release, drop a reservation, ungate).

    ``patch`` carries the pod's resourceVersion when the change depends on what was read (the
    API server refuses it with 409 otherwise; the next cycle decides again).  ``after_spec``:
    only if this cycle's spec write for that node succeeded (a reservation for a plan).
    """

    pod: str
    """``namespace/name``."""
    ref: ObjectRef
    patch: Mapping[str, Any]
    purpose: Literal["reserve", "release", "unreserve", "ungate"]
    after_spec: str | None = None
    on_success: tuple[EmitEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class EvictPod:
    """Evict a stranded pod (``policy/v1`` Eviction) so that its controller creates it again.

    The eviction carries the preconditions ``uid`` and ``resourceVersion`` the decision was made
    from: a pod that changed since (bound after all) or a new pod of the same name is refused
    (409) and kept.  The API server deletes a ``Pending`` pod at once, without consulting its
    PodDisruptionBudget, after adding the condition ``DisruptionTarget`` (reason
    ``EvictionByEvictionAPI``), which a Job's ``podFailurePolicy`` can match.
    """

    pod: str
    """``namespace/name``."""
    ref: ObjectRef
    resource_version: str | None
    on_success: tuple[EmitEvent, ...] = ()


@dataclass(frozen=True, slots=True)
class WriteReservations:
    """Replace ``status.reservations`` of a NodePartitioning (the partitioner's status field)."""

    node: str
    reservations: tuple[ReservationEntry, ...] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class MarkCooldown:
    """Write (``until`` set) or remove (``None``) the cool-down annotation of a NodePartitioning
    (:data:`partitioner.snapshot.COOLDOWN_ANNOTATION`): seconds since the epoch, and the reason."""

    node: str
    until: float | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SetNodeCondition:
    node: str
    status: Literal["True", "False"]
    reason: str
    message: str


Action = (
    CreatePartitioning
    | DeletePartitioning
    | WriteSpec
    | PatchPod
    | EvictPod
    | WriteReservations
    | MarkCooldown
    | SetNodeCondition
    | SetNodeLabel
    | RemoveNodeCondition
    | EmitEvent
)
