"""The controller's picture of the cluster, kept current one watch event at a time.

Model
-----
A :class:`ClusterIndex` holds the Nodes, Pods and NodePartitionings the partitioner watches,
each parsed once when it changes (not once per cycle):

* :class:`NodeInfo` — the node trimmed to what the controller reads (labels, taints,
  ``unschedulable``, ``status.allocatable``, its ``GpusliceReady`` condition), its reading
  (:func:`partitioner.snapshot.read_node`: a :class:`~partitioner.snapshot.GpuNode`, a
  :class:`~partitioner.snapshot.NodeProblem` or ``None``) and its allocatable slices.
* :class:`PodInfo` — only pods that ask for a slice or are bound to a node are kept, trimmed to
  the fields the controller reads; their requests are parsed once (a malformed quantity is
  kept as the error text), the reservation annotation is parsed once.
* :class:`NpInfo` — the NodePartitioning validated once (or its validation error).
* ResourceClaims (``resource.k8s.io/v1``, watched when DRA nodes are served), each read once
  into its demand (:func:`partitioner.claims.read_claim`).  A pod that names claims
  (``spec.resourceClaims``) asks for its claims' units (:attr:`PodInfo.dra`; only DRA nodes
  are eligible for it, and only non-DRA pods for other nodes); the pod is kept as received and
  read again when one of its claims appears, changes or goes.  A claim is allocated once,
  however many pods name it (all of them run where it is allocated), so its units count
  once: one pod naming it, its *carrier* (:func:`_carry_rank`: a bound pod that has not
  finished, else the oldest pending one), asks for them and the others for nothing of it.
  A pending pod that carries none of its claims asks for nothing new: if every such claim is
  allocated it loses its gate at once (a stray, below: kube-scheduler sends it where the
  claims are); else it *follows* the carriers of its unallocated claims
  (:attr:`PodInfo.claim_carriers`) and is released with them, to their node
  (:meth:`partitioner.decide._Step.release_sharers`).  The sharers of a claim are read again
  when a pod naming it appears, goes, binds or finishes (the carrier may change).

Derived, updated incrementally:

* per node, the CPU, memory and slices held by the pods bound to it that have not finished
  (:meth:`ClusterIndex.usage`);
* the keys of the *waiting* slice pods (asking for a slice, not bound, not finished, not being
  deleted) — the only pods a controller cycle looks at — also kept in age order (a bisect per
  pod that starts or stops waiting, instead of a sort of thousands of pods per cycle);
* :attr:`ClusterIndex.topology` — a counter bumped whenever a node appears, disappears or
  changes what pod eligibility depends on (labels, taints, ``unschedulable``, opt-in reading);
  a pod's eligible nodes are cached against it (:meth:`ClusterIndex.eligible`), and shared by
  the pods whose node constraints (``nodeSelector``, ``affinity``, ``tolerations``: all that
  :func:`~partitioner.eligibility.pod_fits_node` reads) are the same, so thousands of pods of
  a few shapes cost a few eligibility scans and hold a few node sets, not one each.

Events and relists
------------------
:meth:`ClusterIndex.apply` folds one watch event in (``ADDED``/``MODIFIED``/``DELETED``, or
``None`` for a listed object).  An object whose ``resourceVersion`` is older than the one held
is ignored, so a stale list can never overwrite newer watch state (resourceVersions are compared
as integers when both are integers, which the API server's are in practice; otherwise any
difference counts as newer).  :meth:`ClusterIndex.relist` reconciles one kind with a complete
listing: objects missing from it are removed (deleted while the watch was down), unless held at
a newer version than the listing's snapshot, and an object whose DELETED event arrived while
the listing was read is not brought back by it.

Cost: an event costs one object's parsing; a cycle costs O(waiting pods + nodes).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from contract.nodepartitioning import KIND as NP_KIND
from contract.nodepartitioning import NodePartitioning
from partitioner.claims import ClaimDemand, claim_key_of, pod_claim_keys, read_claim
from partitioner.eligibility import pod_fits_node
from partitioner.gating import GATE, has_gate
from partitioner.quantities import (
    QuantityError,
    container_slice_conflicts,
    cpu_milli,
    memory_mib,
    parse_quantity,
    pod_requests,
)
from partitioner.reservations import (
    RESERVATION_ANNOTATION,
    Reservation,
    ReservationError,
    State,
    parse_reservation,
)
from partitioner.snapshot import (
    NOS_AGENT_LABEL,
    GpuNode,
    NodeProblem,
    parse_time,
    pod_key,
    read_node,
)
from planner.catalog import Catalog
from planner.snapshot import is_partitionable_resource, mig_profile_of

__all__ = [
    "ClusterIndex",
    "NodeInfo",
    "NpInfo",
    "PodInfo",
    "Usage",
    "parse_time",
]

Obj = Mapping[str, Any]
KINDS = ("nodes", "pods", "partitionings", "claims")
_WHOLE_GPU = "nvidia.com/gpu"
_MAX_UNITS = 1 << 20
"""A device count above this is an input error, not a number to count with."""


def _newer(incoming: str | None, held: str | None) -> bool:
    """Whether ``incoming`` may replace ``held`` (see the module docstring)."""
    if held is None or incoming is None:
        return True
    if incoming.isdigit() and held.isdigit():
        return int(incoming) >= int(held)
    return True


def _rv(obj: Obj) -> str | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv is not None else None


# --------------------------------------------------------------------------- nodes


@dataclass(slots=True)
class NodeInfo:
    name: str
    uid: str
    rv: str | None
    obj: dict[str, Any]
    """The node trimmed to metadata (name, uid, labels), spec (taints, unschedulable) and
    status (allocatable, the GpusliceReady condition)."""
    reading: GpuNode | NodeProblem | None
    allocatable: Mapping[str, int]
    """Allocatable partitionable devices per resource, as kube-scheduler sees them."""
    other_allocatable: Mapping[str, Decimal] = field(default_factory=dict)
    """Allocatable of every other resource a pod may ask for beside its slice (extended
    resources, hugepages, ephemeral storage; not CPU, memory, pods or GPUs)."""
    derived: tuple[object, Any] | None = None
    """Derived data cached by :mod:`partitioner.ledger` (its GPUs now) with its input key."""

    @property
    def gpu(self) -> GpuNode | None:
        return self.reading if isinstance(self.reading, GpuNode) else None

    def topology_key(self) -> tuple[object, ...]:
        spec = self.obj.get("spec") or {}
        labels = (self.obj.get("metadata") or {}).get("labels") or {}
        return (
            tuple(sorted(labels.items())),
            repr(spec.get("taints")),
            bool(spec.get("unschedulable")),
            _reading_key(self.reading),
            tuple(sorted(self.other_allocatable.items())),
        )


def _reading_key(reading: GpuNode | NodeProblem | None) -> tuple[object, ...]:
    if isinstance(reading, GpuNode):
        return ("gpu", reading.mode, reading.model.name, reading.gpu_count, reading.dra)
    if isinstance(reading, NodeProblem):
        return ("problem", reading.reason, reading.message)
    return ()


_NODE_ANNOTATION_PREFIXES = ("gpuslice.io/", "nos.nebuly.com/")


def _trim_node(node: Obj) -> dict[str, Any]:
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    status = node.get("status") or {}
    annotations = {
        str(k): v
        for k, v in (meta.get("annotations") or {}).items()
        if str(k).startswith(_NODE_ANNOTATION_PREFIXES)
    }
    capacity = {
        str(k): v
        for k, v in (status.get("capacity") or {}).items()
        if str(k).startswith("nvidia.com/")
    }
    conditions = [
        c
        for c in status.get("conditions") or ()
        if isinstance(c, Mapping) and c.get("type") == "GpusliceReady"
    ]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": meta.get("name", ""),
            "uid": meta.get("uid", ""),
            "resourceVersion": meta.get("resourceVersion"),
            "labels": dict(meta.get("labels") or {}),
            "annotations": annotations,
        },
        "spec": {k: spec[k] for k in ("taints", "unschedulable") if k in spec},
        "status": {
            "allocatable": dict(status.get("allocatable") or {}),
            "capacity": capacity,
            "conditions": conditions,
        },
    }


def _same_but_rv(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two trimmed objects are equal but for ``metadata.resourceVersion``."""
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        if k != "metadata":
            if v != b[k]:
                return False
            continue
        meta_a, meta_b = v or {}, b[k] or {}
        if meta_a.keys() != meta_b.keys():
            return False
        if any(meta_a[m] != meta_b[m] for m in meta_a if m != "resourceVersion"):
            return False
    return True


def _same_pod(old: PodInfo, new: PodInfo) -> bool:
    """The same pod object with nothing the controller reads changed (all parsed fields and
    the trimmed object equal, the resourceVersion and the caches aside)."""
    return (
        old.uid == new.uid
        and all(getattr(old, f) == getattr(new, f) for f in _POD_CONTENT)
        and _same_but_rv(old.obj, new.obj)
    )


_NOT_OTHER = frozenset({"cpu", "memory", "pods", _WHOLE_GPU})


def _other_resource(name: str) -> bool:
    """A resource checked against a node's allocatable beside the slices, CPU and memory."""
    return name not in _NOT_OTHER and not is_partitionable_resource(name)


def _allocatable_other(node: Obj) -> dict[str, Decimal]:
    out: dict[str, Decimal] = {}
    for name, value in ((node.get("status") or {}).get("allocatable") or {}).items():
        if not _other_resource(str(name)):
            continue
        try:
            out[str(name)] = parse_quantity(value)
        except QuantityError:
            continue
    return out


def covers(allocatable: Mapping[str, Decimal], asked: Sequence[tuple[str, Decimal]]) -> bool:
    """A node with ``allocatable`` can hold what a pod asks beside its slice, CPU and memory
    (kube-scheduler's NodeResourcesFit refuses a node without it)."""
    return all(allocatable.get(name, Decimal(0)) >= amount for name, amount in asked)


def _allocatable_slices(node: Obj) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, value in ((node.get("status") or {}).get("allocatable") or {}).items():
        if not is_partitionable_resource(str(name)):
            continue
        try:
            out[str(name)] = max(0, int(Decimal(str(value))))
        except (ArithmeticError, ValueError):
            continue
    return out


# --------------------------------------------------------------------------- pods


@dataclass(slots=True)
class PodInfo:
    key: str
    uid: str
    rv: str | None
    obj: dict[str, Any]
    """The pod trimmed to what the controller reads (eligibility, events, patches)."""
    phase: str
    node: str
    """``spec.nodeName`` ("" while unbound)."""
    deleting: bool
    daemonset: bool
    gated: bool
    """Carries the gpuslice gate."""
    other_gates: tuple[str, ...]
    unschedulable: bool
    """``PodScheduled=False`` with reason ``Unschedulable`` (kube-scheduler tried and failed)."""
    nominated: bool
    slices: Mapping[str, int]
    """Partitionable resource -> units (empty if none or unreadable)."""
    resources: frozenset[str]
    """The keys of ``slices``."""
    whole_gpus: int
    """Units of ``nvidia.com/gpu`` (whole GPUs, or MIG devices under GFD's single strategy)."""
    cpu_milli: int
    memory_mib: int
    request_error: str
    priority: int
    created: float | None
    reservation: Reservation | None
    reservation_error: str
    dra: bool = False
    """Asks through ResourceClaims of gpuslice's DRA driver (:mod:`partitioner.claims`): its
    ``slices`` are its claims' units and only DRA nodes can serve it (only those serve DRA
    pods: a MIG request in extended resources never goes to a DRA node)."""
    claims: tuple[str, ...] = ()
    """Keys (``namespace/name``) of the pod's ResourceClaims."""
    other_requests: tuple[tuple[str, Decimal], ...] = ()
    """What it asks for beside slices, CPU, memory and GPUs (extended resources, hugepages,
    ephemeral storage), sorted: only nodes whose allocatable covers it are eligible."""
    claims_pending: bool = False
    """Some claim of the pod is not known yet (its demand is unknown, not planned yet)."""
    claim_carriers: tuple[str, ...] = ()
    """Keys of the other pods that carry the units of this pod's unallocated claims (a claim's
    units count once, module docstring): this pod is released with them, to their node."""
    sandbox_ready: bool = False
    """Condition ``PodReadyToStartContainers`` is ``True``: the kubelet made the pod's sandbox,
    which it does only after it prepared the pod's ResourceClaims, so the pod starts without
    the DRA agent (it may still be pulling its images)."""
    rejected: str = ""
    """The kubelet refused to admit the pod (phase ``Failed`` with reason
    ``UnexpectedAdmissionError``, as when a device plugin's Allocate fails, or ``OutOf<resource>``):
    ``"<reason>: <message>"``; empty otherwise (:func:`admission_rejection`)."""
    eligible_cache: tuple[int, frozenset[str]] | None = None
    reject_cache: tuple[int, str | None] | None = None
    # Derived flags, computed once in __post_init__ (the decision step and the simulator's
    # scheduler read them for every waiting pod, many times a second): a PodInfo's fields are
    # never reassigned once built but for ``rv``, ``obj`` and the caches above, which these do
    # not read, so the flags cannot go stale.
    plain: bool = field(init=False)
    """Nothing but its slice request to read: no DaemonSet owner, no nomination, readable
    requests, no reservation (valid or not) and no scheduling gate but gpuslice's.  Most
    waiting pods are plain; the decision step reads them on a short path."""
    finished: bool = field(init=False)
    """Phase ``Succeeded`` or ``Failed``."""
    waiting: bool = field(init=False)
    """Asks for a slice, is not bound, not finished, not being deleted."""
    stray: bool = field(init=False)
    """Carries gpuslice's gate but asks gpuslice for nothing (no slice request; or its
    ResourceClaims, all known, are another driver's, or allocated already), or is a
    DaemonSet's pod (its controller places it, gpuslice never gates it): the decision step
    removes the gate."""
    follower: bool = field(init=False)
    """Carries gpuslice's gate, asks for nothing itself and waits for the pods that carry its
    unallocated claims (:attr:`claim_carriers`): released with them."""
    unclaimed: bool = field(init=False)
    """Carries gpuslice's gate and asks for nothing readable yet because some ResourceClaim it
    names is not known (not created from its template yet, or named wrongly): the decision
    step tells it, and gives it back to kube-scheduler once that lasts a batch window."""
    plan_sig: tuple[object, ...] = field(init=False)
    """What a plan reads of the pod besides its eligible nodes and waiting time: its sorted
    requests, CPU, memory and priority (the decision step's plan key)."""

    def __post_init__(self) -> None:
        self.plain = not (
            self.daemonset
            or self.nominated
            or self.request_error
            or self.reservation is not None
            or self.reservation_error
            or self.other_gates
        )
        self.finished = self.phase in ("Succeeded", "Failed")
        self.waiting = bool(self.slices or self.request_error) and not (
            self.node or self.finished or self.deleting
        )
        idle = self.gated and not (self.waiting or self.node or self.finished or self.deleting)
        self.stray = (idle and not self.claims_pending and not self.claim_carriers) or (
            self.gated and self.daemonset and not (self.node or self.finished or self.deleting)
        )
        self.follower = idle and not self.claims_pending and bool(self.claim_carriers)
        self.unclaimed = idle and self.claims_pending and not self.daemonset
        self.plan_sig = (
            tuple(sorted(self.slices.items())),
            self.cpu_milli,
            self.memory_mib,
            self.priority,
        )

    @property
    def name(self) -> str:
        return str((self.obj.get("metadata") or {}).get("name", ""))

    @property
    def nominated_node(self) -> str:
        """The node kube-scheduler nominated for it (``status.nominatedNodeName``), or ``""``."""
        return str((self.obj.get("status") or {}).get("nominatedNodeName") or "")

    @property
    def preempts(self) -> bool:
        """kube-scheduler may preempt lower-priority pods for it (``spec.preemptionPolicy``
        is not ``Never``)."""
        return (self.obj.get("spec") or {}).get("preemptionPolicy") != "Never"

    @property
    def namespace(self) -> str:
        return str((self.obj.get("metadata") or {}).get("namespace", ""))


_POD_CONTENT = tuple(
    f.name
    for f in dataclasses.fields(PodInfo)
    if f.name
    not in (
        "key",
        "uid",
        "rv",
        "obj",
        "eligible_cache",
        "reject_cache",
        "plan_sig",
        "plain",
        "finished",
        "waiting",
        "stray",
        "follower",
    )
)
"""The parsed fields of a :class:`PodInfo` that describe the pod (``obj`` is compared apart,
without its resourceVersion; the derived flags follow from these)."""


def _wants_slices(pod: Obj) -> bool:
    if (pod.get("spec") or {}).get("resourceClaims"):
        return True  # its claims say (partitioner.claims)
    for key in ("containers", "initContainers"):
        for c in (pod.get("spec") or {}).get(key) or ():
            res = c.get("resources") or {} if isinstance(c, Mapping) else {}
            for part in ("requests", "limits"):
                if any(is_partitionable_resource(str(r)) for r in res.get(part) or {}):
                    return True
    return False


def _of_nos(pod: Obj) -> bool:
    """A pod of nos (its chart's label): an agent of nos still runs where it is bound."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    key, value = NOS_AGENT_LABEL
    return isinstance(labels, Mapping) and labels.get(key) == value


def _trim_pod(pod: Obj, rejected: bool) -> dict[str, Any]:
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    keep_meta: dict[str, Any] = {
        k: meta[k]
        for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp", "labels")
        if k in meta
    }
    if RESERVATION_ANNOTATION in annotations:
        keep_meta["annotations"] = {RESERVATION_ANNOTATION: annotations[RESERVATION_ANNOTATION]}
    owners = meta.get("ownerReferences")
    if owners:
        keep_meta["ownerReferences"] = [
            {k: o.get(k) for k in ("kind", "name", "controller") if k in o}
            for o in owners
            if isinstance(o, Mapping)
        ]
    keep_spec = {
        k: spec[k]
        for k in (
            "nodeName",
            "nodeSelector",
            "affinity",
            "tolerations",
            "schedulingGates",
            "resourceClaims",
        )
        if k in spec
    }
    for k in ("priority", "preemptionPolicy"):
        if k in spec:
            keep_spec[k] = spec[k]
    scheduled = [
        c
        for c in status.get("conditions") or ()
        if isinstance(c, Mapping) and c.get("type") == "PodScheduled"
    ]
    keep_status: dict[str, Any] = {"phase": status.get("phase", ""), "conditions": scheduled}
    if rejected:  # the kubelet's admission failure (admission_rejection): its words stay
        keep_status["reason"] = status.get("reason")
        keep_status["message"] = status.get("message", "")
    if status.get("nominatedNodeName"):
        keep_status["nominatedNodeName"] = status["nominatedNodeName"]
    if status.get("resourceClaimStatuses"):
        keep_status["resourceClaimStatuses"] = status["resourceClaimStatuses"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": keep_meta,
        "spec": keep_spec,
        "status": keep_status,
    }


_SLICES: dict[tuple[tuple[str, int], ...], tuple[Mapping[str, int], frozenset[str]]] = {}
"""Interned requests: thousands of pods ask for a few shapes, and pods asking for the same
units (in the same order) share one ``slices`` mapping and one ``resources`` set.  The
decision step and the replay's scheduler read every waiting pod's request many times a
second, and a few shared objects stay in the CPU cache where thousands of copies do not.
Nothing changes a PodInfo's request in place (it is ``Mapping``-typed and replaced with the
pod), so sharing is safe; the table is emptied when full (pods keep their objects)."""
_SLICES_MAX = 4096


def _interned(slices: dict[str, int]) -> tuple[Mapping[str, int], frozenset[str]]:
    key = tuple(slices.items())
    hit = _SLICES.get(key)
    if hit is None:
        if len(_SLICES) >= _SLICES_MAX:
            _SLICES.clear()
        hit = _SLICES[key] = (slices, frozenset(slices))
    return hit


def _claim_units(
    keys: tuple[str, ...],
    complete: bool,
    claims: Mapping[str, ClaimDemand],
    me: str = "",
    carriers: Mapping[str, str] | None = None,
) -> tuple[dict[str, int], str, bool, bool, tuple[str, ...]]:
    """The units the pod ``me``'s claims ask of it, the first error, whether all are known,
    whether some claim asks gpuslice for units (carried by it or not), and the carriers of its
    unallocated claims with units that it does not carry (``carriers``: claim -> the pod that
    carries it; a claim not in it is carried by ``me``)."""
    units: dict[str, int] = {}
    ours = False
    others: list[str] = []
    for k in keys:
        d = claims.get(k)
        if d is None:
            complete = False
            continue
        if d.error:
            return {}, d.error, True, True, ()
        if not d.units:
            continue
        ours = True
        carrier = (carriers or {}).get(k, me)
        if carrier != me:  # counted once, with its carrier's demand
            if not d.allocated and carrier not in others:
                others.append(carrier)
            continue
        for r, n in d.units.items():
            units[r] = units.get(r, 0) + n
    return units, "", complete, ours, tuple(sorted(others))


def _carry_rank(pod: Obj) -> tuple[int, float, str]:
    """Which pod naming a shared claim carries its units (the least rank): a bound pod that
    has not finished (it holds the claim's devices: the ledger counts them once, with it), else
    the oldest pending pod not being deleted (it is planned; the others are released with it,
    or lose their gate once the claim is allocated), else any (by age, then key)."""
    meta = pod.get("metadata") or {}
    finished = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
    bound = bool((pod.get("spec") or {}).get("nodeName"))
    group = 0 if bound and not finished else 2 if finished or meta.get("deletionTimestamp") else 1
    created = parse_time(meta.get("creationTimestamp"))
    return group, created if created is not None else float("inf"), pod_key(pod)


def _units_text(units: Mapping[str, int]) -> str:
    return ", ".join(f"{r} x{k}" for r, k in sorted(units.items())) or "nothing"


def _read_pod(
    pod: Obj,
    claims: Mapping[str, ClaimDemand] | None = None,
    carriers: Mapping[str, str] | None = None,
) -> PodInfo:
    """The pod as the controller reads it; ``carriers``: claim key -> the pod that carries the
    claim's units (:func:`_carry_rank`; a claim not in it is carried by this pod)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    slices: dict[str, int] = {}
    cpu = mem = whole = 0
    others: tuple[tuple[str, Decimal], ...] = ()
    error = ""
    claim_keys, complete = pod_claim_keys(pod)
    try:
        requests = pod_requests(pod)
        gpus = requests.get(_WHOLE_GPU)
        if gpus is not None and gpus == gpus.to_integral_value() and 0 <= gpus <= _MAX_UNITS:
            whole = int(gpus)
        for r, v in requests.items():
            if not is_partitionable_resource(r):
                continue
            if v != v.to_integral_value() or not 0 <= v <= _MAX_UNITS:
                raise QuantityError(f"{r}: {v} is not a device count (0..{_MAX_UNITS})")
            if v > 0:
                slices[r] = int(v)
        cpu = cpu_milli(requests.get("cpu", 0))
        mem = memory_mib(requests.get("memory", 0))
        others = tuple(sorted((r, v) for r, v in requests.items() if v > 0 and _other_resource(r)))
    except QuantityError as e:
        error = f"invalid resource request: {e}"
        slices = {}
    dra = pending = False
    followed: tuple[str, ...] = ()
    if claim_keys or not complete:
        units, claim_error, known, ours, followed = _claim_units(
            claim_keys, complete, claims or {}, pod_key(pod), carriers
        )
        pending = not known
        dra = bool(units or claim_error or ours)
        if dra and slices:
            error = (
                "asks for slices both as extended resources and through ResourceClaims of "
                "gpuslice's DRA driver; ask one way (a DRA node serves claims only)"
            )
            slices = {}
        elif claim_error and not error:
            error = claim_error
        elif (units or ours) and not known:
            dra = False  # a claim not created yet: its demand is unknown, not planned yet
        elif units:
            slices = units
    # Refusals of what a pod asks for, for pods not bound yet only: a bound pod holds its
    # devices whatever it asked, and they must count as used.
    unbound = not spec.get("nodeName")
    if unbound and slices and not error and len({mig_profile_of(r) is None for r in slices}) > 1:
        # the planner refuses it on every node; judged per resource, a cluster with MIG and
        # MPS nodes kept it gated and planned it in every batch, for good
        error = (
            f"asks for MIG and MPS slices at once ({', '.join(sorted(slices))}); a pod uses "
            f"one kind: ask for nvidia.com/mig-<profile> or for nvidia.com/gpu-<N>gb, or split "
            f"the pod"
        )
        slices = {}
    if unbound and slices and not error and not dra and (split := container_slice_conflicts(pod)):
        error = (
            f"{'; '.join(split)}: the kubelet gives a container the devices of one such "
            f"resource only (their device plugins' NVIDIA_VISIBLE_DEVICES overwrite each "
            f"other), so it would see one slice and hold the other idle; ask for one slice "
            f"resource per container (several units of it are fine), or split the container"
        )
        slices = {}
    if unbound and whole and slices and not error:
        # gpuslice nodes advertise no nvidia.com/gpu: released there, the pod could never bind
        # (a bound pod got both from NVIDIA's mixed plugin, and holds both)
        error = (
            f"asks for whole GPUs ({_WHOLE_GPU}: {whole}) and slices at once; gpuslice nodes "
            f"advertise no {_WHOLE_GPU}, so kube-scheduler could never bind it there; ask for "
            f"slices or for whole GPUs, not both"
        )
        slices = {}
    conditions = [c for c in status.get("conditions") or () if isinstance(c, Mapping)]
    scheduled = next((c for c in conditions if c.get("type") == "PodScheduled"), None)
    gate_names = [
        str(g.get("name", "")) for g in spec.get("schedulingGates") or () if isinstance(g, Mapping)
    ]
    owners = meta.get("ownerReferences") or ()
    reservation: Reservation | None = None
    reservation_error = ""
    raw = (meta.get("annotations") or {}).get(RESERVATION_ANNOTATION)
    if raw is not None:
        try:
            reservation = parse_reservation(str(raw))
        except ReservationError as e:
            reservation_error = f"annotation {RESERVATION_ANNOTATION} is malformed ({e})"
    uid = str(meta.get("uid", ""))
    if reservation is not None and reservation.pod and uid and reservation.pod != uid:
        # a copy of another pod's annotation (kubectl debug --copy-to, a re-applied manifest):
        # the promise is that pod's, and trusted here it took that pod's slice
        reservation_error = (
            f"annotation {RESERVATION_ANNOTATION} was written for another pod (uid "
            f"{reservation.pod}), not this one: copied from it, it holds nothing; remove it "
            f"from the manifest the pod was made from"
        )
        reservation = None
    if reservation is not None and slices and not error and reservation.units() != slices:
        # gpuslice writes a reservation for exactly the pod's request; any other one (edited
        # by hand, or by something else) would hold slices the pod does not use, or too few
        reservation_error = (
            f"annotation {RESERVATION_ANNOTATION} holds {_units_text(reservation.units())} "
            f"but the pod asks for {_units_text(slices)}"
        )
        reservation = None
    priority = spec.get("priority") or 0
    shared, resources = _interned(slices)
    rejected = admission_rejection(status)
    return PodInfo(
        key=pod_key(pod),
        uid=str(meta.get("uid", "")),
        rv=_rv(pod),
        obj=_trim_pod(pod, bool(rejected)),
        phase=str(status.get("phase", "")),
        node=str(spec.get("nodeName") or ""),
        deleting=bool(meta.get("deletionTimestamp")),
        daemonset=any(isinstance(o, Mapping) and o.get("kind") == "DaemonSet" for o in owners),
        gated=GATE in gate_names,
        other_gates=tuple(g for g in gate_names if g != GATE),
        unschedulable=scheduled is not None
        and scheduled.get("status") == "False"
        and scheduled.get("reason") == "Unschedulable",
        nominated=bool(status.get("nominatedNodeName")),
        slices=shared,
        resources=resources,
        whole_gpus=whole,
        cpu_milli=cpu,
        memory_mib=mem,
        request_error=error,
        priority=int(priority) if isinstance(priority, int) else 0,
        created=parse_time(meta.get("creationTimestamp")),
        reservation=reservation,
        reservation_error=reservation_error,
        dra=dra,
        claims=claim_keys,
        other_requests=others,
        claims_pending=pending,
        claim_carriers=followed if dra and not error else (),
        sandbox_ready=any(
            c.get("type") == "PodReadyToStartContainers" and c.get("status") == "True"
            for c in conditions
        )
        if claim_keys
        else False,
        rejected=rejected,
    )


def _released_and_rejected(info: PodInfo) -> bool:
    r = info.reservation
    return bool(info.rejected) and r is not None and r.state is State.RELEASED


ADMISSION_REASONS = ("UnexpectedAdmissionError",)
"""Reasons of a pod the kubelet failed at admission for its devices, besides ``OutOf<resource>``
(too few allocatable units): ``UnexpectedAdmissionError`` is what the device manager's failed
Allocate call (a device plugin gone, or its devices unhealthy) gives."""


def admission_rejection(status: Mapping[str, Any]) -> str:
    """``"<reason>: <message>"`` when the pod status is the kubelet's admission failure (phase
    ``Failed``; reason in :data:`ADMISSION_REASONS` or ``OutOf<resource>``), else ``""``."""
    if status.get("phase") != "Failed":
        return ""
    reason = str(status.get("reason") or "")
    if reason not in ADMISSION_REASONS and not reason.startswith("OutOf"):
        return ""
    message = str(status.get("message") or "")[:300]
    return f"{reason}: {message}" if message else reason


# --------------------------------------------------------------------------- partitionings


@dataclass(slots=True)
class NpInfo:
    name: str
    rv: str | None
    np: NodePartitioning | None
    error: str
    raw: dict[str, Any]
    pods_seen: int = 0
    """:attr:`ClusterIndex.node_pods` of the node when the agent's part of the status last
    changed: a different value now means pods bound to the node changed since the agent's last
    report, whose ``used`` flags may then miss a pod (:func:`partitioner.ledger.build_ledgers`)."""


def _agent_status(raw: Obj) -> Any:
    status = dict(raw.get("status") or {})
    status.pop("reservations", None)  # the partitioner's own field
    return status


def _read_np(raw: Obj) -> NpInfo:
    name = str((raw.get("metadata") or {}).get("name", ""))
    try:
        np = NodePartitioning.model_validate(dict(raw))
        error = ""
    except ValidationError as e:
        first = e.errors()[0]
        np = None
        error = (
            f"{NP_KIND} {name} is invalid: {e.error_count()} error(s): {first['msg']} at "
            f"{'.'.join(str(p) for p in first['loc'])}"
        )
    return NpInfo(name, _rv(raw), np, error, dict(raw))


# --------------------------------------------------------------------------- the index


@dataclass(slots=True)
class Usage:
    """What the pods bound to one node hold."""

    cpu_milli: int = 0
    memory_mib: int = 0
    slices: dict[str, int] = field(default_factory=dict)
    single: dict[str, int] = field(default_factory=dict)
    """Pods that hold one unit of one resource, per resource (the warm-slice mix:
    :meth:`partitioner.decide._Step.warm_slices`)."""

    def add(self, pod: PodInfo, sign: int) -> None:
        self.cpu_milli += sign * pod.cpu_milli
        self.memory_mib += sign * pod.memory_mib
        for r, k in pod.slices.items():
            _bump(self.slices, r, sign * k)
        if len(pod.slices) == 1:
            ((r, k),) = pod.slices.items()
            if k == 1:
                _bump(self.single, r, sign)


_NO_USAGE = Usage()
"""What a node holds with no pod bound (compared with, never changed)."""


def _bump(counts: dict[str, int], key: str, delta: int) -> None:
    """Add ``delta`` to ``counts[key]``, dropping the key when it reaches 0."""
    left = counts.get(key, 0) + delta
    if left:
        counts[key] = left
    else:
        counts.pop(key, None)


def _counts(pod: PodInfo) -> bool:
    """The pod holds its node's resources (bound and not finished)."""
    return bool(pod.node) and not pod.finished


_IDENTITIES = itertools.count(1)
_SHARED_ELIGIBLE_MAX = 4096
"""Distinct node-constraint sets whose eligible nodes are kept (the cache is emptied when full
or when the topology changes)."""


def _constraints_key(pod: PodInfo) -> str:
    """What :func:`~partitioner.eligibility.pod_fits_node` reads of the pod, as one string."""
    spec = pod.obj.get("spec") or {}
    return repr(
        (
            pod.dra,
            spec.get("nodeSelector"),
            spec.get("affinity"),
            spec.get("tolerations"),
            pod.other_requests,
        )
    )


class ClusterIndex:
    """Parsed, incrementally maintained Nodes, Pods and NodePartitionings (module docstring)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.nodes: dict[str, NodeInfo] = {}
        self.pods: dict[str, PodInfo] = {}
        self.partitionings: dict[str, NpInfo] = {}
        self.topology = 0
        """Bumped when pod eligibility may have changed on some node."""
        self.version = 0
        """Bumped on every change (any kind)."""
        self.identity = next(_IDENTITIES)
        """Unique per index in this process: ``(identity, version)`` names one cluster state
        (two indexes built from different objects may reach the same ``version``)."""
        self._usage: dict[str, Usage] = {}
        self._slice_priorities: Counter[int] = Counter()
        """Priority -> pods holding slices (bound, not finished): :meth:`lowest_slice_priority`."""
        self._waiting: set[str] = set()
        self._waiting_sorted: list[str] | None = None
        self._waiting_aged: list[str] | None = None
        self._aged: list[tuple[int, float, str]] = []
        """:func:`_age_key` of every waiting pod, kept sorted as pods come and go (a bisect
        each), so :meth:`waiting_by_age` never sorts the whole queue again: a pod's key is
        read from its :class:`PodInfo` (never changed once built), and the entry is removed
        with the same key when that PodInfo leaves the waiting set."""
        self.node_pods: dict[str, int] = {}
        """Node -> a stamp that changes whenever a pod bound to it appears, changes or goes
        (from one counter for all nodes, so a node's entry can go with its last pod: absent
        reads 0, which no stamp is)."""
        self._stamp = 0
        self._on_node: dict[str, set[str]] = {}
        """Node -> keys of the pods bound to it (any phase): :meth:`bound_pods` without a scan
        of every pod.  A node's entries here, in :attr:`node_pods` and in the usage go with its
        last pod: nodes of an autoscaled pool come and go under new names."""
        self.nos_agents: dict[str, set[str]] = {}
        """Node -> the pods of nos (its agents: label :data:`NOS_AGENT_LABEL`) bound there and
        not finished: such a node is not planned (``NosActive``)."""
        self._eligible_shared: dict[str, frozenset[str]] = {}
        """Node constraints (:func:`_constraints_key`) -> eligible nodes at topology
        :attr:`_eligible_topology`."""
        self._eligible_topology = -1
        self.claims: dict[str, ClaimDemand] = {}
        """ResourceClaim key -> its demand (:mod:`partitioner.claims`)."""
        self.silent_agents: frozenset[str] = frozenset()
        """Nodes whose agent has stopped renewing its heartbeat Lease
        (:mod:`partitioner.agent_leases`; set by the operator, or the replay)."""
        self._claim_rv: dict[str, str | None] = {}
        self._allocated: dict[str, dict[str, tuple[str, ...]]] = {}
        """Node (pool) -> claim key -> devices of gpuslice's driver allocated to that claim
        there (:attr:`ClaimDemand.devices`)."""
        self._claim_pods: dict[str, set[str]] = {}
        """Claim key -> keys of the pods naming it (their demand is re-read when it changes)."""
        self.strays: set[str] = set()
        self.unclaimed: set[str] = set()
        """Keys of the pods whose :attr:`PodInfo.unclaimed` is set."""
        """Keys of :attr:`PodInfo.stray` pods."""
        self.rejections: set[str] = set()
        """Keys of pods gpuslice released to a node (a ``released`` reservation) that the
        node's kubelet refused at admission (:attr:`PodInfo.rejected`)."""
        self._claim_pod_raw: dict[str, Obj] = {}
        """Pods with claims, as received: re-read when one of their claims changes."""
        self._carry_ranks: dict[str, tuple[int, float, str]] = {}
        """Pods with claims -> :func:`_carry_rank` (the least among a claim's pods carries it)."""
        self.followers: set[str] = set()
        """Keys of :attr:`PodInfo.follower` pods."""
        self.deletions: dict[tuple[str, str], str | None] | None = None
        """While not ``None`` (a listing is being read, :meth:`relist`): ``(kind, key)`` ->
        resourceVersion of every DELETED event folded in meanwhile."""
        self.write_deletions: dict[tuple[str, str], str | None] | None = None
        """The same while a step's writes are in flight (:meth:`stale_response`): a write's
        answer must not bring back an object deleted while it was in flight."""

    # ------------------------------------------------------------------ events

    def apply(self, kind: str, event_type: str | None, obj: Obj) -> None:
        """Fold one watch event (``kind``: nodes, pods or partitionings) in.

        A ``DELETED`` event of an object the index no longer holds under its name -- the name
        is held by a newer object (another uid: a StatefulSet pod recreated, a node registered
        again; for a claim, one at a later resourceVersion) -- changes nothing: kopf watches
        each object on its own, so the old one's deletion can come after its successor's
        addition, and dropping by name lost a gated pod for good or deleted a live node's
        NodePartitioning."""
        if event_type == "DELETED" and self._replaced(kind, obj):
            return
        if event_type == "DELETED":
            for recorded in (self.deletions, self.write_deletions):
                if recorded is not None:
                    recorded[(kind, _key_of(kind, obj))] = _rv(obj)
        if kind == "pods":
            key = pod_key(obj)
            if event_type == "DELETED":
                self._drop_pod(key)
            else:
                self.upsert_pod(obj)
        elif kind == "nodes":
            name = str((obj.get("metadata") or {}).get("name", ""))
            if event_type == "DELETED":
                self.remove_node(name)
            else:
                self.upsert_node(obj)
        elif kind == "partitionings":
            name = str((obj.get("metadata") or {}).get("name", ""))
            if event_type == "DELETED":
                self.remove_partitioning(name)
            else:
                self.upsert_partitioning(obj)
        elif kind == "claims":
            key = claim_key_of(obj)
            if event_type == "DELETED":
                self.remove_claim(key)
            else:
                self.upsert_claim(obj)
        else:
            raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")

    def _replaced(self, kind: str, obj: Obj) -> bool:
        """Is the object of this ``DELETED`` event not the one held under its name (:meth:`apply`)?"""
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid") or "")
        held: str = ""
        if kind == "pods":
            pod = self.pods.get(pod_key(obj))
            held = pod.uid if pod is not None else ""
        elif kind == "nodes":
            node = self.nodes.get(str(meta.get("name", "")))
            held = node.uid if node is not None else ""
        elif kind == "partitionings":
            np = self.partitionings.get(str(meta.get("name", "")))
            held = str(((np.raw.get("metadata") or {}).get("uid")) or "") if np is not None else ""
        elif kind == "claims":
            return _later(self._claim_rv.get(claim_key_of(obj)), _rv(obj))
        return bool(uid and held and uid != held)

    @staticmethod
    def stale_response(
        kind: str, obj: Obj, deletions: Mapping[tuple[str, str], str | None]
    ) -> bool:
        """``obj``, the API server's answer to a write of a step, is older than a DELETED event
        of its object folded in while the writes were in flight (``deletions``, as recorded in
        :attr:`write_deletions`): folding it in would bring back a deleted object, which no
        later event would remove (a ghost pod holding its slice for good).  A deletion whose
        version cannot be compared with the answer's wins."""
        key = (kind, _key_of(kind, obj))
        return key in deletions and not _later(_rv(obj), deletions[key])

    def relist(self, kind: str, objs: Iterable[Obj], version: str | None = None) -> list[str]:
        """Reconcile ``kind`` with a complete listing; returns the keys removed.

        ``version``: the listing's resourceVersion (its snapshot), when watch events may have
        been folded in while it was read: an object held at a newer version than the snapshot
        (created after it) stays, and a listed object whose DELETED event came in meanwhile
        (:attr:`deletions`, at a newer version than the listed one) is not brought back.  A
        listed object held at the same resourceVersion is the state held already: it is not
        read again (a relisting of 50,000 pods, nearly all unchanged, costs a dict lookup each,
        not a parse).  :meth:`relisting` does the same in parts, so a caller on an event loop
        can let other work run in between (watch events folded in meanwhile are guarded as
        above).
        """
        listing = self.relisting(kind, version)
        listing.fold(objs)
        return listing.finish()

    def relisting(self, kind: str, version: str | None = None) -> Relisting:
        """:meth:`relist` in parts: :meth:`Relisting.fold` the listed objects (in as many
        calls as wanted; watch events may be applied in between), then
        :meth:`Relisting.finish` to drop what the listing lacks."""
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        return Relisting(self, kind, version)

    def _held_rv(self, kind: str, key: str, uid: str) -> str | None:
        """The resourceVersion held for ``key`` (``None``: not held, or held under another
        ``uid``: another object of that name), for :meth:`Relisting.fold`."""
        if kind == "claims":
            return self._claim_rv.get(key)
        held: NodeInfo | PodInfo | NpInfo | None
        if kind == "pods":
            held = self.pods.get(key)
        elif kind == "nodes":
            held = self.nodes.get(key)
        else:
            held = self.partitionings.get(key)
        if held is None:
            return None
        held_uid = (
            str((held.raw.get("metadata") or {}).get("uid") or "")
            if isinstance(held, NpInfo)
            else held.uid
        )
        return held.rv if held_uid == uid else None

    def upsert_node(self, node: Obj) -> None:
        name = str((node.get("metadata") or {}).get("name", ""))
        old = self.nodes.get(name)
        if old is not None and not _newer(_rv(node), old.rv):
            return
        trimmed = _trim_node(node)
        if old is not None and _same_but_rv(old.obj, trimmed):
            # Nothing the controller reads changed (a status heartbeat, another condition):
            # newer resourceVersion, same content, no new version for the decision step.
            old.rv = _rv(node)
            return
        info = NodeInfo(
            name=name,
            uid=str((node.get("metadata") or {}).get("uid", "")),
            rv=_rv(node),
            obj=trimmed,
            reading=read_node(trimmed, self.catalog),
            allocatable=_allocatable_slices(node),
            other_allocatable=_allocatable_other(node),
        )
        self.nodes[name] = info
        if old is None or old.topology_key() != info.topology_key():
            self.topology += 1
        self.version += 1

    def set_silent_agents(self, nodes: frozenset[str]) -> None:
        """Record the nodes whose agent is silent (a change only when the set changes)."""
        if nodes != self.silent_agents:
            self.silent_agents = nodes
            self.version += 1

    def remove_node(self, name: str) -> None:
        if self.nodes.pop(name, None) is not None:
            self.topology += 1
            self.version += 1

    def upsert_pod(self, pod: Obj) -> None:
        key = pod_key(pod)
        old = self.pods.get(key)
        if old is not None and not _newer(_rv(pod), old.rv):
            return
        if (
            old is None
            and not (pod.get("spec") or {}).get("nodeName")
            and not _wants_slices(pod)
            and not has_gate(pod)  # a manifest copied from a gated pod carries the gate
        ):
            return  # not a slice pod, not bound, not gated by gpuslice: nothing to read
        keys, _ = pod_claim_keys(pod)
        old_keys = old.claims if old is not None else ()
        old_rank = self._carry_ranks.get(key)
        if old is not None and old.claims != keys:
            self._unlink_claims(key, old.claims)
        if keys:
            self._claim_pod_raw[key] = pod
            self._carry_ranks[key] = _carry_rank(pod)
            for c in keys:
                self._claim_pods.setdefault(c, set()).add(key)
        else:
            self._claim_pod_raw.pop(key, None)
            self._carry_ranks.pop(key, None)
        info = _read_pod(pod, self.claims, self._carriers(keys))
        self._store(key, old, info)
        if keys != old_keys or self._carry_ranks.get(key) != old_rank:
            self._reread_sharers(key, (*old_keys, *keys))

    def _carriers(self, keys: Iterable[str]) -> dict[str, str]:
        """Claim -> the pod naming it that carries its units (:func:`_carry_rank`)."""
        out: dict[str, str] = {}
        for c in keys:
            pods = self._claim_pods.get(c)
            if pods and len(pods) > 1:
                out[c] = min(pods, key=self._carry_ranks.__getitem__)
        return out

    def _reread_sharers(self, key: str, claims: Iterable[str]) -> None:
        """Read again the other pods naming ``claims``: which pod carries a claim follows the
        pods naming it (appearing, going, binding, finishing)."""
        sharers = {p for c in claims for p in self._claim_pods.get(c, ())} - {key}
        self._reread_pods(sharers)

    def _reread_pods(self, keys: Iterable[str]) -> None:
        """Read the claim pods ``keys`` again as received (their claims or carriers changed)."""
        for pod in sorted(keys):
            raw = self._claim_pod_raw.get(pod)
            old = self.pods.get(pod)
            if raw is not None and old is not None:
                info = _read_pod(raw, self.claims, self._carriers(old.claims))
                info.rv = old.rv
                self._store(pod, old, info)

    def _store(self, key: str, old: PodInfo | None, info: PodInfo) -> None:
        if old is not None and _same_pod(old, info):
            # Nothing the controller reads changed (another condition, container statuses):
            # keep the parsed pod and its caches, take the new resourceVersion (patches are
            # guarded by it), and no new version for the decision step.
            old.rv = info.rv
            old.obj = info.obj
            return
        if old is not None and old.uid == info.uid and old.eligible_cache is not None:
            same = old.obj.get("spec", {}).get("affinity") == info.obj["spec"].get("affinity")
            same = same and old.obj["spec"].get("nodeSelector") == info.obj["spec"].get(
                "nodeSelector"
            )
            same = same and old.obj["spec"].get("tolerations") == info.obj["spec"].get(
                "tolerations"
            )
            if same and old.dra == info.dra:
                info.eligible_cache = old.eligible_cache
        self._drop_pod(key, bump=False)
        self.pods[key] = info
        if _counts(info):
            self._usage.setdefault(info.node, Usage()).add(info, +1)
            if info.slices:
                self._slice_priorities[info.priority] += 1
        if info.node:
            self._stamp += 1
            self.node_pods[info.node] = self._stamp
            self._on_node.setdefault(info.node, set()).add(key)
            if not info.finished and _of_nos(info.obj):
                self.nos_agents.setdefault(info.node, set()).add(key)
        if info.stray:
            self.strays.add(key)
        if info.unclaimed:
            self.unclaimed.add(key)
        if info.follower:
            self.followers.add(key)
        if _released_and_rejected(info):
            self.rejections.add(key)
        if info.waiting and key not in self._waiting:
            self._waiting.add(key)
            bisect.insort(self._aged, _age_key(info))
            self._waiting_sorted = self._waiting_aged = None
        self.version += 1

    def _unlink_claims(self, key: str, claims: Iterable[str]) -> None:
        for c in claims:
            pods = self._claim_pods.get(c)
            if pods is not None:
                pods.discard(key)
                if not pods:
                    del self._claim_pods[c]

    def upsert_claim(self, claim: Obj) -> None:
        """A ResourceClaim changed: its pods' demand is read again if it changed."""
        key = claim_key_of(claim)
        if key in self._claim_rv and not _newer(_rv(claim), self._claim_rv[key]):
            return
        self._claim_rv[key] = _rv(claim)
        demand = read_claim(claim)
        if self.claims.get(key) == demand:
            return
        self._index_allocation(key, self.claims.get(key), demand)
        self.claims[key] = demand
        self._reread(key)

    def remove_claim(self, key: str) -> None:
        self._claim_rv.pop(key, None)
        old = self.claims.pop(key, None)
        if old is not None:
            self._index_allocation(key, old, None)
            self._reread(key)

    def _index_allocation(self, key: str, old: ClaimDemand | None, new: ClaimDemand | None) -> None:
        for pool, _ in old.devices if old is not None else ():
            entries = self._allocated.get(pool)
            if entries is not None:
                entries.pop(key, None)
                if not entries:
                    del self._allocated[pool]
        by_pool: dict[str, list[str]] = {}
        for pool, device in new.devices if new is not None else ():
            by_pool.setdefault(pool, []).append(device)
        for pool, devices in by_pool.items():
            self._allocated.setdefault(pool, {})[key] = tuple(devices)

    def allocated_devices(self, node: str) -> frozenset[str]:
        """Devices of gpuslice's DRA driver on ``node`` that some claim is allocated."""
        entries = self._allocated.get(node)
        return (
            frozenset(d for devices in entries.values() for d in devices)
            if entries
            else frozenset()
        )

    def _reread(self, claim: str) -> None:
        self.version += 1
        self._reread_pods(self._claim_pods.get(claim, ()))

    def _drop_pod(self, key: str, bump: bool = True) -> None:
        old = self.pods.pop(key, None)
        if old is None:
            return
        if bump:  # a removal, not a replacement (upsert_pod relinks the claims it keeps)
            self._unlink_claims(key, old.claims)
            self._claim_pod_raw.pop(key, None)
            if self._carry_ranks.pop(key, None) is not None:
                self._reread_sharers(key, old.claims)
        if _counts(old):
            usage = self._usage.get(old.node)
            if usage is not None:
                usage.add(old, -1)
                if usage == _NO_USAGE:
                    del self._usage[old.node]
            if old.slices:
                left = self._slice_priorities[old.priority] - 1
                if left > 0:
                    self._slice_priorities[old.priority] = left
                else:
                    del self._slice_priorities[old.priority]
        if old.node:
            on_node = self._on_node.get(old.node)
            if on_node is not None:
                on_node.discard(key)
            if on_node:
                self._stamp += 1
                self.node_pods[old.node] = self._stamp
            else:  # its last pod: the entries go (a stored stamp now differs from absent's 0)
                self._on_node.pop(old.node, None)
                self.node_pods.pop(old.node, None)
            nos = self.nos_agents.get(old.node)
            if nos is not None:
                nos.discard(key)
                if not nos:
                    del self.nos_agents[old.node]
        self.strays.discard(key)
        self.unclaimed.discard(key)
        self.followers.discard(key)
        self.rejections.discard(key)
        if key in self._waiting:
            self._waiting.discard(key)
            aged, age = self._aged, _age_key(old)
            at = bisect.bisect_left(aged, age)
            if at < len(aged) and aged[at] == age:
                del aged[at]
            else:  # pragma: no cover - the entry added with this PodInfo is always there
                aged.remove(next(a for a in aged if a[2] == key))
            self._waiting_sorted = self._waiting_aged = None
        if bump:
            self.version += 1

    def upsert_partitioning(self, raw: Obj) -> None:
        name = str((raw.get("metadata") or {}).get("name", ""))
        old = self.partitionings.get(name)
        if old is not None and not _newer(_rv(raw), old.rv):
            return
        info = _read_np(raw)
        if old is not None and _agent_status(old.raw) == _agent_status(raw):
            info.pods_seen = old.pods_seen
        else:
            info.pods_seen = self.node_pods.get(name, 0)
        self.partitionings[name] = info
        self.version += 1

    def remove_partitioning(self, name: str) -> None:
        if self.partitionings.pop(name, None) is not None:
            self.version += 1

    # ------------------------------------------------------------------ queries

    def usage(self, node: str) -> Usage:
        return self._usage.get(node) or Usage()

    def lowest_slice_priority(self) -> int:
        """The lowest priority of a pod holding slices (bound, not finished; on any node), 0
        when none does: a pod at or below it can preempt no slice pod anywhere."""
        return min(self._slice_priorities, default=0)

    def bound_pods(self, node: str) -> list[PodInfo]:
        """Pods bound to ``node`` that have not finished (key order)."""
        pods = self.pods
        return [p for k in sorted(self._on_node.get(node, ())) if not (p := pods[k]).finished]

    def waiting(self) -> list[PodInfo]:
        """Slice pods not bound, not finished, not being deleted (key order)."""
        if self._waiting_sorted is None:
            self._waiting_sorted = sorted(self._waiting)
        return [self.pods[key] for key in self._waiting_sorted]

    def waiting_by_age(self) -> list[str]:
        """Keys of the waiting slice pods, highest priority first, then oldest, then key."""
        if self._waiting_aged is None:
            self._waiting_aged = [a[2] for a in self._aged]
        return self._waiting_aged

    def gpu_nodes(self) -> dict[str, NodeInfo]:
        """Opted-in nodes with valid GPU labels, by name (sorted)."""
        return {n: self.nodes[n] for n in sorted(self.nodes) if self.nodes[n].gpu is not None}

    def eligible(self, pod: PodInfo, gpu_nodes: Mapping[str, NodeInfo]) -> frozenset[str]:
        """GPU nodes the pod may be scheduled to (cached until the topology changes)."""
        cached = pod.eligible_cache
        if cached is not None and cached[0] == self.topology:
            return cached[1]
        shared = self._eligible_shared
        if self._eligible_topology != self.topology or len(shared) >= _SHARED_ELIGIBLE_MAX:
            shared.clear()
            self._eligible_topology = self.topology
        key = _constraints_key(pod)
        names = shared.get(key)
        if names is None:
            names = frozenset(
                n
                for n, info in gpu_nodes.items()
                if info.gpu is not None
                and info.gpu.dra == pod.dra
                and pod_fits_node(pod.obj, info.obj)
                and covers(info.other_allocatable, pod.other_requests)
            )
            shared[key] = names
        pod.eligible_cache = (self.topology, names)
        return names

    def partitioning(self, name: str) -> NodePartitioning | None:
        info = self.partitionings.get(name)
        return info.np if info is not None else None

    @classmethod
    def from_objects(
        cls,
        catalog: Catalog,
        nodes: Iterable[Obj] = (),
        pods: Iterable[Obj] = (),
        partitionings: Iterable[Obj] = (),
        claims: Iterable[Obj] = (),
    ) -> ClusterIndex:
        index = cls(catalog)
        for c in claims:
            index.upsert_claim(c)
        for n in nodes:
            index.upsert_node(n)
        for p in pods:
            index.upsert_pod(p)
        for np in partitionings:
            index.upsert_partitioning(np)
        return index


class Relisting:
    """One listing of a kind being folded into the index (:meth:`ClusterIndex.relisting`)."""

    def __init__(self, index: ClusterIndex, kind: str, version: str | None) -> None:
        self.index, self.kind, self.version = index, kind, version
        self.seen: set[str] = set()
        """Keys of the listed objects folded so far."""

    def fold(self, objs: Iterable[Obj]) -> None:
        """Fold listed objects in: one deleted after the snapshot (:attr:`ClusterIndex.deletions`,
        read at each call) is not brought back; one held at its resourceVersion is skipped."""
        index, kind = self.index, self.kind
        deletions = index.deletions or {}
        for obj in objs:
            key = _key_of(kind, obj)
            self.seen.add(key)
            rv = _rv(obj)
            if _later(deletions.get((kind, key)), rv):
                continue  # deleted after the snapshot
            if rv is not None:
                uid = str((obj.get("metadata") or {}).get("uid") or "")
                if index._held_rv(kind, key, uid) == rv:
                    continue  # the very state held: nothing to read again
            index.apply(kind, None, obj)

    def finish(self) -> list[str]:
        """Drop the objects the listing lacked (unless held at a version newer than its
        snapshot: created after it); returns their keys."""
        index, kind = self.index, self.kind
        held: Mapping[str, Any] = (
            index.pods
            if kind == "pods"
            else index.nodes
            if kind == "nodes"
            else index.claims
            if kind == "claims"
            else index.partitionings
        )
        gone = sorted(
            k
            for k in set(held) - self.seen
            if not _later(index._claim_rv.get(k) if kind == "claims" else held[k].rv, self.version)
        )
        for key in gone:
            index.apply(kind, "DELETED", {"metadata": _key_meta(kind, key)})
        return gone


def _age_key(pod: PodInfo) -> tuple[int, float, str]:
    created = pod.created if pod.created is not None else float("inf")
    return (-pod.priority, created, pod.key)


def _key_of(kind: str, obj: Obj) -> str:
    if kind == "pods":
        return pod_key(obj)
    if kind == "claims":
        return claim_key_of(obj)
    return str((obj.get("metadata") or {}).get("name", ""))


def _later(rv: str | None, than: str | None) -> bool:
    """``rv`` is known to be a later version than ``than`` (both integers, as in practice)."""
    return (
        rv is not None
        and than is not None
        and rv.isdigit()
        and than.isdigit()
        and int(rv) > int(than)
    )


def _key_meta(kind: str, key: str) -> dict[str, str]:
    if kind in ("pods", "claims"):
        namespace, _, name = key.partition("/")
        return {"namespace": namespace, "name": name}
    return {"name": key}
