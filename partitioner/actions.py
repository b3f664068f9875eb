"""What the decision step asks the controller to do: plain, immutable action records.

The decision step (:mod:`partitioner.decide`) returns these; :mod:`partitioner.writer`
carries them out against the API (the simulator carries them out against its in-memory
cluster).  None of them reads or writes anything by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from contract.nodepartitioning import NodePartitioningSpec

__all__ = [
    "NODE_CONDITION",
    "Action",
    "CreatePartitioning",
    "DeletePartitioning",
    "EmitEvent",
    "ObjectRef",
    "SetNodeCondition",
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


@dataclass(frozen=True, slots=True)
class SetNodeCondition:
    node: str
    status: Literal["True", "False"]
    reason: str
    message: str


Action = CreatePartitioning | DeletePartitioning | WriteSpec | SetNodeCondition | EmitEvent
