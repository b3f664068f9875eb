"""The NodePartitioning contract (``gpuslice.io/v1alpha1``), defined once as pydantic models.

One cluster-scoped ``NodePartitioning`` per opted-in node, named after the node.

* ``spec`` is written by the partitioner only: the plan id, the mode, and per GPU index the
  desired MIG instances (profile + start slot) or MPS slices (memory MiB + active-thread %);
  in ``hybrid`` mode an instance may list the MPS slices it hosts (``gpus[].mig[].mps``), which
  are then advertised instead of the instance itself (:func:`NodePartitioningSpec` validation:
  only in hybrid mode, each slice's thread % at most 100, the slices of one instance within the
  memory its profile name states minus :data:`MPS_SERVER_RESERVE_MIB`; the agent checks the
  exact profile memory of its GPU model).
* ``status`` is written by the node agent: the generation it observed, per GPU the actual
  instances or slices with their device ids and whether a pod holds them, conditions
  (``Applied``, ``Degraded`` with a reason) and the last error.  One field of it,
  ``status.reservations``, is the partitioner's: the slices promised to pods not bound yet and
  the GPUs drained for waiting pods (see ``partitioner/reservations.py``).  Each side writes
  its own fields with a JSON merge patch of the status subresource, so neither overwrites the
  other's (:data:`PARTITIONER_STATUS_FIELDS`).

The spec's lists and numbers are bounded (at most 64 GPUs, 16 MIG instances and 256 MPS slices
per GPU, ...), so the API server refuses a spec no real node could apply before an agent reads
it.  The CRD YAML is generated from these models (:func:`crd_manifest`); a test fails if the
committed CRD (``charts/gpuslice/crds/``) drifts from it.  This module imports neither kopf nor
a Kubernetes client, so both the partitioner and the node agent depend on it alone.
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from contract.input_files import MAX_GPUS_PER_NODE
from planner.settings import PlannerSettings

__all__ = [
    "API_VERSION",
    "CLEARED_WHEN_EMPTY",
    "GROUP",
    "KIND",
    "MAX_FAILURE_MESSAGE",
    "MAX_PREPARE_FAILURES",
    "MPS_SERVER_RESERVE_MIB",
    "PARTITIONER_STATUS_FIELDS",
    "PLURAL",
    "PRINTER_COLUMNS",
    "VERSION",
    "ActualGpu",
    "ActualMigInstance",
    "ActualMpsSlice",
    "Condition",
    "DesiredGpu",
    "DesiredMigInstance",
    "DesiredMpsSlice",
    "NodePartitioning",
    "NodePartitioningSpec",
    "NodePartitioningStatus",
    "ObjectMeta",
    "PrepareFailure",
    "ReservationEntry",
    "crd_manifest",
]

GROUP = "gpuslice.io"
VERSION = "v1alpha1"
API_VERSION: Final = "gpuslice.io/v1alpha1"
KIND: Final = "NodePartitioning"
PLURAL = "nodepartitionings"
SINGULAR = "nodepartitioning"
SHORT_NAMES = ["np", "nodepart"]

Mode = Literal["mig", "mps", "hybrid"]

MAX_MIG_INSTANCES = 16
"""MIG instances of one GPU in a spec (NVIDIA's largest geometry has 7)."""
MAX_MPS_SLICES = 256
"""MPS slices of one GPU in a spec (1 GiB slices of the largest GPU)."""
MAX_SLICE_MIB = 16 * 1024 * 1024
MPS_SERVER_RESERVE_MIB: Final = PlannerSettings().mps_reserve_mib
"""GPU memory the MPS server takes in each hybrid instance (the planner's default
``mps_reserve_mib``): slices of one instance fit its memory minus this."""
_PROFILE_GB = re.compile(r"^\d+g\.(?P<gb>\d+)gb")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class DesiredMpsSlice(_Model):
    """An MPS slice the node should advertise as nvidia.com/gpu-<N>gb."""

    memoryMiB: int = Field(
        ge=1, le=MAX_SLICE_MIB, description="Pinned device memory limit of the slice, MiB"
    )
    activeThreadPercentage: int = Field(
        ge=1, le=100, description="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
    )


class DesiredMigInstance(_Model):
    """A MIG GPU instance the node should have, at an exact memory-slot start."""

    profile: str = Field(description="MIG profile name, e.g. 1g.10gb", min_length=1, max_length=64)
    start: int = Field(ge=0, le=63, description="Memory-slot start of the placement")
    mps: list[DesiredMpsSlice] = Field(
        default_factory=list,
        max_length=MAX_MPS_SLICES,
        description="hybrid mode: MPS slices inside this instance (served by its own MPS "
        "daemon and advertised as nvidia.com/gpu-<N>gb instead of the instance)",
    )


class DesiredGpu(_Model):
    index: int = Field(ge=0, lt=MAX_GPUS_PER_NODE, description="GPU index on the node (NVML order)")
    mig: list[DesiredMigInstance] = Field(default_factory=list, max_length=MAX_MIG_INSTANCES)
    mps: list[DesiredMpsSlice] = Field(default_factory=list, max_length=MAX_MPS_SLICES)


class NodePartitioningSpec(_Model):
    """Desired state, written by the partitioner."""

    planId: str = Field(
        default="", max_length=253, description="Id of the plan that produced this spec"
    )
    mode: Mode = Field(description="mig, mps or hybrid")
    gpus: list[DesiredGpu] = Field(default_factory=list, max_length=MAX_GPUS_PER_NODE)

    @model_validator(mode="after")
    def _hosted_slices(self) -> NodePartitioningSpec:
        """MPS slices inside MIG instances: hybrid mode only, within the instance's memory."""
        for gpu in self.gpus:
            for inst in gpu.mig:
                if not inst.mps:
                    continue
                where = f"GPU {gpu.index} instance {inst.profile}@{inst.start}"
                if self.mode != "hybrid":
                    raise ValueError(
                        f"{where} lists MPS slices, but the spec's mode is {self.mode!r}: slices "
                        "inside MIG instances need mode hybrid"
                    )
                m = _PROFILE_GB.match(inst.profile)
                if m is None:
                    continue  # an unknown name: the agent rejects it against its catalog
                room = int(m.group("gb")) * 1024 - MPS_SERVER_RESERVE_MIB
                total = sum(s.memoryMiB for s in inst.mps)
                if total > room:
                    raise ValueError(
                        f"{where}: its MPS slices need {total} MiB, more than the {room} MiB the "
                        f"instance offers ({m.group('gb')} GiB minus the {MPS_SERVER_RESERVE_MIB} "
                        "MiB MPS server reserve)"
                    )
        return self


_IMPLICIT_WHEN_FALSE = ("unhealthy", "foreign")
"""Status flags written only when true, so a status without them reads the same to a
partitioner that predates them."""


class _StatusModel(_Model):
    """Status parts: read with unknown fields ignored, so a component of the previous release
    reads what a newer one writes during an upgrade (the agent rolls after the partitioner; a
    new field of ``status.reservations`` or of a GPU's report must not fail its every pass).
    Specs stay strict: a misspelt field there is an error to report."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)


class _Health(_StatusModel):
    """A status entry the agent may report ``unhealthy``: advertised Unhealthy to the kubelet
    (an XID critical error, a GPU NVML cannot read), so it takes no new pod and the
    partitioner neither offers nor repartitions it.  ``unhealthy`` is written only when true, so
    a healthy status reads the same to a partitioner that predates the field."""

    unhealthy: bool = Field(
        default=False,
        description="Advertised Unhealthy (XID error, GPU unreadable): offered to no new pod "
        "and kept as it is",
    )

    @model_serializer(mode="wrap")
    def _healthy_is_implicit(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for flag in _IMPLICIT_WHEN_FALSE:
                if flag in data and not data[flag]:
                    del data[flag]
        return data


class ActualMpsSlice(_Health):
    memoryMiB: int = Field(ge=1)
    activeThreadPercentage: int = Field(ge=1, le=100)
    deviceId: str = Field(default="")
    used: bool = False


class ActualMigInstance(_Health):
    profile: str
    start: int = Field(ge=0)
    deviceId: str = Field(default="", description="MIG device UUID advertised to the kubelet")
    used: bool = Field(default=False, description="Allocated to a pod or running processes")
    foreign: bool = Field(
        default=False,
        description="Used by processes that no pod or claim holds it for (a job started "
        "outside Kubernetes): offered to no pod until they end; written only when true",
    )
    mps: list[ActualMpsSlice] = Field(
        default_factory=list,
        description="hybrid mode: the MPS slices this instance hosts (the instance itself is "
        "then not advertised); a used slice pins the instance",
    )


class ActualGpu(_Health):
    index: int = Field(ge=0)
    uuid: str = ""
    model: str = ""
    migEnabled: bool = False
    mig: list[ActualMigInstance] = Field(default_factory=list)
    mps: list[ActualMpsSlice] = Field(default_factory=list)


class Condition(_StatusModel):
    type: Literal["Applied", "Degraded", "Ready"]
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    lastTransitionTime: str = Field(default="", description="RFC 3339")
    observedGeneration: int = 0


class ReservationEntry(_StatusModel):
    """A promise the partitioner made on this node (written by the partitioner)."""

    pod: str = Field(description="namespace/name of the pod")
    state: Literal["draining", "planned", "released"] = Field(
        description="draining: GPUs being emptied for the pod; planned: slice planned or free, "
        "pod still gated; released: pod ungated and pinned to this node, not bound yet"
    )
    gpus: dict[str, list[int]] = Field(
        default_factory=dict,
        description="Resource -> GPU index per unit (draining: the frozen GPUs)",
    )
    plan: str = Field(default="", description="Plan id (empty: the slice already existed)")


MAX_PREPARE_FAILURES = 256
"""Most claims ``status.prepareFailures`` lists (the agent reports the oldest)."""
MAX_FAILURE_MESSAGE = 1024
"""Longest ``message`` of a prepare failure (the agent cuts longer ones)."""


class PrepareFailure(_StatusModel):
    """A ResourceClaim allocated on this node whose last prepare failed (DRA mode)."""

    claim: str = Field(max_length=512, description="namespace/name of the ResourceClaim")
    uid: str = Field(default="", max_length=128, description="the claim's uid")
    message: str = Field(
        default="",
        max_length=MAX_FAILURE_MESSAGE,
        description="the agent's error, as the kubelet got it",
    )
    since: str = Field(default="", description="RFC 3339: the first failure of this claim")


class NodePartitioningStatus(_StatusModel):
    """Actual state, written by the node agent (``reservations``: by the partitioner)."""

    observedGeneration: int = 0
    planId: str = Field(default="", description="planId of the spec last applied")
    gpus: list[ActualGpu] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list)
    lastError: str = ""
    prepareFailures: list[PrepareFailure] = Field(
        default_factory=list,
        max_length=MAX_PREPARE_FAILURES,
        description="DRA mode: claims allocated here whose last prepare failed (the kubelet "
        "retries), until one succeeds, the claim is unprepared or no longer allocated here, or "
        "no prepare of it came for five minutes; their pods cannot start meanwhile (the "
        "partitioner strands them and evicts those a controller owns)",
    )
    reservations: list[ReservationEntry] = Field(
        default_factory=list,
        description="Written by the partitioner: promises to pods not bound yet, and drains",
    )

    @model_serializer(mode="wrap")
    def _no_failures_is_implicit(self, handler: SerializerFunctionWrapHandler) -> Any:
        """``prepareFailures`` is written only when there are some, so a status without reads
        the same to a partitioner that predates the field (a merge patch then sends ``null``
        to remove an earlier list: :data:`CLEARED_WHEN_EMPTY`)."""
        data = handler(self)
        if isinstance(data, dict) and not data.get("prepareFailures"):
            data.pop("prepareFailures", None)
        return data


CLEARED_WHEN_EMPTY = ("prepareFailures",)
"""Agent ``status`` fields left out of a dump when empty: a merge patch must send them as
``null`` then, or the stored list would stay."""


PARTITIONER_STATUS_FIELDS = frozenset({"reservations"})
"""``status`` fields the partitioner writes; the node agent leaves them out of its patches."""


class ObjectMeta(BaseModel):
    """The subset of Kubernetes metadata the contract needs (other fields pass through)."""

    model_config = ConfigDict(extra="allow")

    name: str
    resourceVersion: str | None = None
    generation: int | None = None
    uid: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class NodePartitioning(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    apiVersion: Literal["gpuslice.io/v1alpha1"] = API_VERSION
    kind: Literal["NodePartitioning"] = KIND
    metadata: ObjectMeta
    spec: NodePartitioningSpec
    status: NodePartitioningStatus | None = None

    def condition(self, type_: str) -> Condition | None:
        if self.status is None:
            return None
        return next((c for c in self.status.conditions if c.type == type_), None)

    @property
    def applied(self) -> bool:
        """True when the agent has applied the current generation of the spec.  An
        ``observedGeneration`` above the object's generation is an agent's write meant for an
        earlier object of the same name (deleted and created again while its pass ran: the
        status patch goes by name): not applied, until the agent's next pass reports on this
        one."""
        if self.status is None or self.metadata.generation is None:
            return False
        c = self.condition("Applied")
        return (
            self.status.observedGeneration == self.metadata.generation
            and c is not None
            and c.status == "True"
        )


def _openapi(model: type[BaseModel]) -> dict[str, Any]:
    """Turn a pydantic JSON schema into a self-contained structural OpenAPI v3 schema."""
    schema = model.model_json_schema(ref_template="#/$defs/{model}")
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(defs[node["$ref"].split("/")[-1]])
            out: dict[str, Any] = {}
            for k, v in node.items():
                if k in ("title", "additionalProperties", "default"):
                    # no defaults: the API server fills them in on every write and read, so a
                    # flag the agent writes only when true would reach older readers, which
                    # do not know it, on every object after a CRD upgrade
                    continue
                if k == "const":
                    out["enum"] = [v]
                    continue
                if k in ("exclusiveMaximum", "exclusiveMinimum") and not isinstance(v, bool):
                    # JSON Schema's number form; a CRD's JSONSchemaProps takes the OpenAPI
                    # v3.0 form (a bound plus a boolean), and the API server refuses the other
                    out["maximum" if k == "exclusiveMaximum" else "minimum"] = v
                    out[k] = True
                    continue
                out[k] = walk(v)
            if "anyOf" in out:  # Optional[X]: pydantic emits anyOf [X, null]
                opts = [o for o in out.pop("anyOf") if o.get("type") != "null"]
                if len(opts) == 1:
                    out.update(opts[0])
                    out["nullable"] = True
            if out.get("type") == "object" and "properties" not in out:
                out["x-kubernetes-preserve-unknown-fields"] = True
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    result: dict[str, Any] = walk(schema)
    return result


def _condition_path(type_: str, field: str) -> str:
    return f'.status.conditions[?(@.type=="{type_}")].{field}'


PRINTER_COLUMNS: Final[list[dict[str, Any]]] = [
    {"name": "Mode", "type": "string", "jsonPath": ".spec.mode"},
    {"name": "Plan", "type": "string", "jsonPath": ".spec.planId", "description": "Desired plan"},
    {
        "name": "Applied",
        "type": "string",
        "jsonPath": _condition_path("Applied", "status"),
        "description": "The agent applied the current spec",
    },
    {
        "name": "Degraded",
        "type": "string",
        "jsonPath": _condition_path("Degraded", "status"),
        "description": "Some GPU's spec cannot be applied",
    },
    {
        "name": "State",
        "type": "string",
        "jsonPath": _condition_path("Applied", "reason"),
        "description": "Applied, InProgress, Waiting (pending: a transient block), Degraded or "
        "NoSpec",
    },
    {
        "name": "Applied-Plan",
        "type": "string",
        "jsonPath": ".status.planId",
        "priority": 1,
        "description": "Plan of the spec last applied",
    },
    {
        "name": "Degraded-Reason",
        "type": "string",
        "jsonPath": _condition_path("Degraded", "reason"),
        "priority": 1,
        "description": "Why the node is Degraded (AsExpected when it is not)",
    },
    {
        "name": "First-Pending",
        "type": "string",
        "jsonPath": ".status.reservations[0].pod",
        "priority": 1,
        "description": "The first pod holding a reservation on this node (all of them: "
        "-o jsonpath='{.status.reservations[*].pod}')",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
"""``kubectl get nodepartitionings`` columns (NAME is the node); ``priority: 1`` ones show with
``-o wide``.  STATE tells a pending change (InProgress, Waiting) from an applied or Degraded
one.  A column shows one value (the API server prints the first match of its JSONPath), so
First-Pending names one waiting pod, not all of them."""


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition for NodePartitioning, generated from the models."""
    spec_schema = _openapi(NodePartitioningSpec)
    status_schema = _openapi(NodePartitioningStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Cluster",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "Desired (spec, by the partitioner) and actual (status, "
                            "by the node agent) GPU partitioning of one node.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                            "required": ["spec"],
                        }
                    },
                }
            ],
        },
    }
