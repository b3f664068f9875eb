"""Kubernetes objects -> the planner's :class:`~planner.snapshot.Snapshot`. Pure.

Model
-----
The input is a :class:`ClusterView`: the raw API objects (plain dicts, as watched or as printed
by ``kubectl get -o json``) of Nodes, Pods and NodePartitionings.  :func:`read_cluster` turns
it into a :class:`ClusterReading`:

* **GPU nodes.** A node opts in with ``gpuslice.io/partitioning=mig|mps|hybrid`` (wins) or
  nos's ``nos.nebuly.com/gpu-partitioning=mig|mps``.  Its GPU model, count and memory come
  from GPU Feature Discovery's ``nvidia.com/gpu.product``, ``nvidia.com/gpu.count`` and
  ``nvidia.com/gpu.memory`` (MiB) labels.  An opted-in node whose labels are missing, malformed
  or name an unknown model becomes a :class:`NodeProblem` (reason + message naming the fix) and
  takes no part in planning.
* **Current layouts.** Per GPU, the instances/slices and whether a pod holds them come from the
  node's NodePartitioning ``status`` (written by the node agent).  Without a status the GPUs
  are taken as unpartitioned (the agent never destroys a slice in use, whatever the spec says).
* **Busy nodes.** A node whose NodePartitioning carries a plan (``spec.planId``) the agent has
  not yet observed (``status.observedGeneration < metadata.generation``), or observed but not
  applied and not given up on (no ``Degraded`` condition), is busy: it is left out of the
  snapshot and the pods that plan was for (annotation ``gpuslice.io/planned-pods``) are *in
  flight*, not candidates.  A busy node never blocks other nodes.
* **Free CPU and memory.** Node ``status.allocatable`` minus the requests of the pods bound to
  it that have not finished.
* **Candidates.** A pod is batchable when it requests a partitionable resource
  (``nvidia.com/mig-<profile>``, ``nvidia.com/gpu-<N>gb``; not every one of them as zero: such
  a pod is not gpuslice's, kube-scheduler places it like any pod), is ``Pending`` with no
  ``nodeName``, carries gpuslice's scheduling gate (``gpuslice.io/slice``: once gpuslice is
  installed its webhook gates every such pod, ``PodScheduled`` reason ``SchedulingGated``) or
  its ``PodScheduled`` condition is ``False``/``Unschedulable``, it is not nominated, not being
  deleted and not owned by a DaemonSet.  Its eligible nodes are the GPU nodes passing
  nodeSelector, required node affinity and taints (:mod:`.eligibility`) whose allocatable
  covers what else it asks for (``rdma/...``, ``hugepages-*``: kube-scheduler's
  NodeResourcesFit), as the controller's.  A batchable pod is then either *rejected* with a
  reason (no eligible node of the right mode, a MIG profile no eligible GPU has, a malformed
  quantity; a "no eligible node" reason names an opted-in node the pod would fit that is left
  out for its labels, as the controller's ``Unplaceable`` Event does), *waiting* (in flight: a
  plan for it not applied yet, or gpuslice promised it slices, reservation annotation
  ``gpuslice.io/reservation`` ``planned`` or ``released``, whose devices are then held on
  their node as the controller holds them; ``draining``: its GPUs are being emptied for it, and
  frozen here as the controller freezes them; held back by another controller's scheduling gate;
  or all its eligible nodes busy), or a *candidate* (:class:`~planner.snapshot.PendingPod`,
  eligible nodes restricted to the nodes in the snapshot).
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from contract.nodepartitioning import KIND as NP_KIND
from contract.nodepartitioning import NodePartitioning
from partitioner.adoption import Adopted, adopt_all
from partitioner.eligibility import eligible_nodes, pod_fits_node
from partitioner.gating import has_gate, other_gates
from partitioner.node_labels import (
    PRODUCT_LABEL,
    GpuLabels,
    LabelProblem,
    read_gpu_labels,
)
from partitioner.quantities import QuantityError, cpu_milli, memory_mib, pod_requests
from partitioner.rejection import (
    MIG_MODES,
    PausedNode,
    paused_fit,
    paused_sentence,
    product_selector_hint,
    reject_reason,
)
from partitioner.reservations import RESERVATION_ANNOTATION, Reservation, State
from planner.catalog import Catalog, CatalogError, GpuModel
from planner.snapshot import (
    GpuState,
    Mode,
    NodeState,
    PendingPod,
    Snapshot,
    is_partitionable_resource,
    mig_resource,
    mps_resource,
)

__all__ = [
    "COOLDOWN_ANNOTATION",
    "DRA_VALUE",
    "GPUSLICE_LABEL",
    "MANAGED_LABEL",
    "NOS_LABEL",
    "PLANNED_AT_ANNOTATION",
    "PLANNED_PODS_ANNOTATION",
    "ClusterReading",
    "ClusterView",
    "GpuNode",
    "NodeProblem",
    "cooldown_annotation",
    "cooldown_of",
    "invalid_partitioning_message",
    "is_batchable",
    "left_out_sentence",
    "no_eligible_notes",
    "opted_in",
    "parse_time",
    "pod_key",
    "read_cluster",
    "read_kubectl_list",
    "read_node",
    "reading_notes",
    "snapshot_from_kubectl_list",
]

NOS_LABEL = "nos.nebuly.com/gpu-partitioning"
GPUSLICE_LABEL = "gpuslice.io/partitioning"
DRA_VALUE = "dra"
"""``gpuslice.io/partitioning=dra``: the node runs the DRA agent (chart value dra.enabled); the
partitioner plans it as a MIG node for pods that ask through ResourceClaims, and the agent
publishes the plan's placements (:mod:`partitioner.claims`)."""
MANAGED_LABEL = "gpuslice.io/managed"
"""Set by the partitioner on nodes the device-plugin agent serves (:mod:`partitioner.optout`)."""
PLANNED_PODS_ANNOTATION = "gpuslice.io/planned-pods"
"""On a NodePartitioning: JSON list of the pod keys its current spec was written for."""
PLANNED_AT_ANNOTATION = "gpuslice.io/planned-at"
"""On a NodePartitioning: when its current spec was planned (seconds since the epoch)."""
COOLDOWN_ANNOTATION = "gpuslice.io/cooldown"
"""On a NodePartitioning, while its node cools down after a promise it did not keep: JSON
``{"until": "<RFC 3339>", "reason": "<the Event that started it>"}``.  The controller keeps its
cool-downs in memory and writes them here, so a restarted controller or a new leader keeps the
cool-down the previous one started (:meth:`partitioner.decide._Step.write_cooldowns`); it is
removed once the cool-down ends."""


Obj = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Raw API objects by key: nodes and partitionings by name, pods by ``namespace/name``."""

    nodes: Mapping[str, Obj] = field(default_factory=dict)
    pods: Mapping[str, Obj] = field(default_factory=dict)
    partitionings: Mapping[str, Obj] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GpuNode:
    """An opted-in node with valid GPU labels."""

    name: str
    mode: Mode
    model: GpuModel
    gpu_count: int
    gpu_memory_mib: int | None
    cpu_milli: int
    memory_mib: int
    labels: GpuLabels | None = None
    """Everything read from the GPU labels, by MIG strategy (:mod:`partitioner.node_labels`);
    ``gpu_count`` is 0 here when they cannot say and the agent's report must."""
    dra: bool = False
    """Served by gpuslice's DRA driver (``gpuslice.io/partitioning=dra``): planned as a MIG
    node whose planned placements the agent publishes as devices; only pods asking through
    ResourceClaims (:mod:`partitioner.claims`) are planned onto it."""


@dataclass(frozen=True, slots=True)
class NodeProblem:
    name: str
    reason: str
    """CamelCase, for Events and the node condition."""
    message: str


@dataclass(frozen=True, slots=True)
class ClusterReading:
    gpu_nodes: Mapping[str, GpuNode]
    """Opted-in nodes with valid labels (busy ones and those whose GPUs cannot be read yet
    included: the latter are also in ``problems``)."""
    problems: Mapping[str, NodeProblem]
    """Opted-in nodes that cannot be planned, and why."""
    partitionings: Mapping[str, NodePartitioning]
    """Valid NodePartitioning objects by name."""
    invalid_partitionings: Mapping[str, str]
    """NodePartitioning name -> validation error (a spec listing a GPU twice included: the
    API server admits it, the node agent refuses it); the node is left out (``busy``)."""
    busy: frozenset[str]
    """GPU nodes whose last spec is not applied yet."""
    nodes: tuple[NodeState, ...]
    """The snapshot's nodes: GPU nodes that are not busy, sorted by name."""
    candidates: Mapping[str, PendingPod]
    rejected: Mapping[str, str]
    """Batchable pod -> why it cannot be planned at all."""
    waiting: Mapping[str, str]
    """Batchable pod -> why it is left out of this batch."""
    batchable: frozenset[str]
    adopted: Mapping[str, Adopted] = field(default_factory=dict)
    """GPU node -> its GPUs now and what was assumed reading them (:mod:`partitioner.adoption`)."""
    left_out: Mapping[str, str] = field(default_factory=dict)
    """Candidate -> the eligible nodes no plan may touch now, each with why (an invalid
    NodePartitioning, a node problem, a plan in flight): its planner reason speaks of the
    other nodes only, so an unplaced pod's reason adds these."""

    def snapshot(self, pods: Iterable[str] | None = None) -> Snapshot:
        """The planner input for ``pods`` (default: all candidates)."""
        keys = sorted(self.candidates) if pods is None else sorted(pods)
        return Snapshot(nodes=self.nodes, pods=tuple(self.candidates[k] for k in keys))


def pod_key(pod: Obj) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _name(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


def opted_in(node: Obj) -> bool:
    """The node carries an opt-in label (whatever its value; ``gpuslice.io/partitioning=dra``,
    a DRA node, is planned too: its agent publishes the plan, :mod:`partitioner.claims`)."""
    labels: Mapping[str, str] = (node.get("metadata") or {}).get("labels") or {}
    return labels.get(GPUSLICE_LABEL) is not None or labels.get(NOS_LABEL) is not None


NOS_SPEC_PLAN = "nos.nebuly.com/spec-partitioning-plan"
NOS_STATUS_PLAN = "nos.nebuly.com/status-partitioning-plan"
NOS_AGENT_LABEL = ("app.kubernetes.io/part-of", "nos")
"""The label nos's chart puts on its pods (its MIG and GPU agents among them)."""


def nos_partitioning(name: str, annotations: Mapping[str, str]) -> NodeProblem | None:
    """``NosActive`` when nos's last plan for the node is not applied (its spec and status plan
    annotations differ): nos is still partitioning the node, or was uninstalled in the middle
    of it; both agents would create and destroy MIG instances on the same GPUs."""
    spec, status = annotations.get(NOS_SPEC_PLAN), annotations.get(NOS_STATUS_PLAN)
    if spec is None or spec == status:
        return None
    return NodeProblem(
        name,
        "NosActive",
        f"nos's plan {spec} is not applied on this node ({NOS_STATUS_PLAN} is "
        f"{status if status is not None else 'absent'}): nos is still partitioning it, or was "
        "uninstalled in the middle; uninstall nos first, then remove its annotations from the "
        "node (docs/operations.md, 'Migrate from nos')",
    )


def read_node(node: Obj, catalog: Catalog) -> GpuNode | NodeProblem | None:
    """A node's GPU facts, the problem that keeps it out of planning, or ``None`` (not opted in)."""
    name = _name(node)
    labels: Mapping[str, str] = (node.get("metadata") or {}).get("labels") or {}
    allowed: tuple[str, ...]
    dra = labels.get(GPUSLICE_LABEL) == DRA_VALUE
    if dra and labels.get(MANAGED_LABEL) is not None:
        # Leaving the device-plugin mode: its agent stays until its slices are drained
        # (partitioner.optout), and the DRA agent starts only then; not planned meanwhile.
        return None
    if dra:
        key, allowed = GPUSLICE_LABEL, (DRA_VALUE,)
    elif labels.get(GPUSLICE_LABEL) is not None:
        key, allowed = GPUSLICE_LABEL, ("mig", "mps", "hybrid")
    elif labels.get(NOS_LABEL) is not None:
        key, allowed = NOS_LABEL, ("mig", "mps")
    else:
        return None
    value = str(labels[key])
    if value not in allowed:
        return NodeProblem(
            name,
            "InvalidPartitioningLabel",
            f"label {key}={value!r} is not one of {', '.join(allowed)}; fix or remove the label",
        )
    nos_value = labels.get(NOS_LABEL)
    if key == GPUSLICE_LABEL and nos_value is not None and str(nos_value) != value:
        return NodeProblem(
            name,
            "ConflictingPartitioningLabels",
            f"labels {GPUSLICE_LABEL}={value} and {NOS_LABEL}={nos_value} disagree (removing "
            f"gpuslice's label alone would leave the node opted in as {nos_value}); remove "
            f"nos's: kubectl label node {name} {NOS_LABEL}-",
        )
    nos_problem = nos_partitioning(name, (node.get("metadata") or {}).get("annotations") or {})
    if nos_problem is not None:
        return nos_problem
    mode = Mode.MIG if dra else Mode(value)
    product = labels.get(PRODUCT_LABEL)
    if not product:
        return NodeProblem(
            name,
            "MissingGpuLabels",
            f"opted in ({key}={value}) but has no {PRODUCT_LABEL} label; run NVIDIA GPU "
            f"Feature Discovery on the node or set the label",
        )
    annotations: Mapping[str, str] = (node.get("metadata") or {}).get("annotations") or {}
    read = read_gpu_labels(labels, annotations, catalog, name)
    if isinstance(read, LabelProblem):
        return NodeProblem(name, read.reason, read.message)
    model = read.model
    if mode in MIG_MODES and not model.mig_capable:
        return NodeProblem(
            name,
            "MigNotSupported",
            f"{key}={value} but {model.name} is not MIG-capable; use mode mps",
        )
    if mode in MIG_MODES and str(labels.get(MIG_CAPABLE_LABEL, "")).strip().lower() == "false":
        return NodeProblem(
            name,
            "MigNotSupported",
            f"{key}={value} but GPU Feature Discovery labels {MIG_CAPABLE_LABEL}=false: NVML "
            f"says this node's {model.name} GPUs cannot enable MIG (a VM or platform without "
            f"MIG); use mode mps, or enable MIG on the platform and let GFD relabel the node",
        )
    alloc = (node.get("status") or {}).get("allocatable") or {}
    try:
        cpu = cpu_milli(alloc["cpu"]) if "cpu" in alloc else 1 << 40
        mem = memory_mib(alloc["memory"]) if "memory" in alloc else 1 << 50
    except QuantityError as e:
        return NodeProblem(name, "InvalidAllocatable", f"status.allocatable: {e}")
    return GpuNode(name, mode, model, read.gpu_count or 0, read.gpu_memory_mib, cpu, mem, read, dra)


MIG_CAPABLE_LABEL = "nvidia.com/mig.capable"
"""GFD's label: ``true`` iff NVML reports MIG supported on the node's GPUs."""


def _owned_by_daemonset(pod: Obj) -> bool:
    owners = (pod.get("metadata") or {}).get("ownerReferences") or ()
    return any(o.get("kind") == "DaemonSet" for o in owners)


def _partitionable(pod: Obj) -> list[str]:
    names: set[str] = set()
    spec = pod.get("spec") or {}
    # null reads as absent, as the API server and the snapshot file's check read it
    for c in [*(spec.get("containers") or ()), *(spec.get("initContainers") or ())]:
        res = c.get("resources") or {}
        names.update(res.get("requests") or {})
        names.update(res.get("limits") or {})
    return sorted(n for n in names if is_partitionable_resource(n))


def _asks_for_nothing(pod: Obj) -> bool:
    """Every slice the pod names is requested as zero (summed as kube-scheduler sums them):
    it is not gpuslice's; the webhook leaves it ungated and kube-scheduler places it like any
    pod.  A request that cannot be read is not "nothing": it is rejected naming the error."""
    try:
        requests = pod_requests(pod)
    except QuantityError:
        return False
    return not any(requests.get(r, 0) > 0 for r in _partitionable(pod))


def is_batchable(pod: Obj) -> bool:
    """Pending, unbound, not nominated, not a DaemonSet's, wants a slice (names a slice
    resource, not every one of them as zero), and either gated by gpuslice (carries
    :data:`~partitioner.gating.GATE`: once gpuslice is installed its webhook gates every such
    pod, and the API server sets ``PodScheduled=False`` with reason ``SchedulingGated``) or
    unschedulable (``PodScheduled=False``/``Unschedulable``: kube-scheduler tried it, as before
    gpuslice is installed)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or spec.get("nodeName") or status.get("nominatedNodeName"):
        return False
    if status.get("phase") != "Pending" or _owned_by_daemonset(pod):
        return False
    if not has_gate(pod):
        scheduled = next(
            (c for c in status.get("conditions") or () if c.get("type") == "PodScheduled"), None
        )
        if scheduled is None or scheduled.get("status") != "False":
            return False
        if scheduled.get("reason") != "Unschedulable":
            return False
    return bool(_partitionable(pod)) and not _asks_for_nothing(pod)


def is_busy(np: NodePartitioning) -> bool:
    """The partitioner wrote a plan the agent has not applied (nor given up on) yet."""
    if not np.spec.planId or np.applied:
        return False
    generation = np.metadata.generation or 0
    observed = np.status.observedGeneration if np.status else 0
    if observed == generation:  # above it: about an earlier object of that name
        degraded = np.condition("Degraded")
        return not (degraded is not None and degraded.status == "True")
    return True


def planned_pods(np: NodePartitioning) -> list[str]:
    """The pod keys in :data:`PLANNED_PODS_ANNOTATION` (a JSON list of strings); any other
    value (edited by hand: not JSON, nested too deep, a number of over 4300 digits) is none."""
    raw = np.metadata.annotations.get(PLANNED_PODS_ANNOTATION, "")
    try:
        pods = json.loads(raw) if raw else []
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return []
    return [p for p in pods if isinstance(p, str)] if isinstance(pods, list) else []


def parse_time(text: object) -> float | None:
    """RFC 3339 (``2026-11-23T10:00:00Z``) -> seconds since the epoch; ``None`` if unreadable."""
    if not isinstance(text, str) or not text:
        return None
    try:
        stamp = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.UTC)
    return stamp.timestamp()


def cooldown_annotation(until: float, reason: str) -> str:
    """The value of :data:`COOLDOWN_ANNOTATION` for a cool-down ending at ``until`` (seconds
    since the epoch), floored to the millisecond: a controller that reads it back never cools
    the node longer than the one that wrote it."""
    ms = math.floor(until * 1000)
    stamp = datetime.datetime.fromtimestamp(ms // 1000, datetime.UTC) + datetime.timedelta(
        milliseconds=ms % 1000
    )
    text = stamp.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return json.dumps({"until": text, "reason": reason})


def cooldown_of(np: NodePartitioning) -> tuple[float, str] | None:
    """The cool-down :data:`COOLDOWN_ANNOTATION` records: ``(until, reason)``; ``None`` if there
    is none or it is unreadable (edited by hand: the controller writes it again while the node
    cools down, and it never extends one by itself)."""
    raw = np.metadata.annotations.get(COOLDOWN_ANNOTATION)
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    until = parse_time(doc.get("until")) if isinstance(doc, dict) else None
    if until is None or not math.isfinite(until):
        return None
    reason = doc.get("reason")
    return until, reason[:64] if isinstance(reason, str) else ""


def _as_count(value: Decimal, resource: str) -> int:
    if value != value.to_integral_value() or value < 0:
        raise QuantityError(f"{resource}: {value} is not a whole number of devices")
    return int(value)


def left_out_sentence(pod: Obj, problems: Iterable[tuple[Obj, NodeProblem]]) -> str:
    """The opted-in nodes (object, label problem) the pod would fit (:func:`~partitioner.
    eligibility.pod_fits_node`) but gpuslice leaves out for a problem with their labels, as a
    sentence to add to a "no eligible node" reason, which otherwise blames the pod's
    selectors, affinity and tolerations while the cause is on the node; ``""`` for none.  The
    controller's ``Unplaceable`` Event says the same (``decide._Step._left_out``)."""
    fits = sorted(
        (problem for node, problem in problems if pod_fits_node(pod, node)), key=lambda p: p.name
    )
    if not fits:
        return ""
    name, problem = fits[0].name, fits[0]
    more = f" and {len(fits) - 1} more" if len(fits) > 1 else ""
    return (
        f"; node {name}{more}, which the pod would fit, is left out: {problem.reason}: "
        f"{problem.message}"
    )


def no_eligible_notes(
    pod: Obj,
    slices: Mapping[str, int],
    dra: bool,
    problems: Iterable[tuple[Obj, NodeProblem]],
    opted_in: Iterable[Obj],
    paused: Iterable[PausedNode],
) -> str:
    """What a "no eligible node" reason adds, worded alike in the controller's ``Unplaceable``
    Event, ``gpuslice status`` and ``plan --snapshot``: an opted-in node left out for its labels
    that the pod would fit (:func:`left_out_sentence`), a product label GFD rewrote under the
    single strategy (:func:`partitioner.rejection.product_selector_hint`), and a cordoned or
    not-ready node that could serve it once back (:func:`partitioner.rejection.paused_fit`)."""
    return (
        left_out_sentence(pod, problems)
        + product_selector_hint(pod, opted_in)
        + paused_sentence(paused_fit(pod, slices, dra, paused))
    )


def _classify_pod(
    pod: Obj,
    gpu_nodes: Mapping[str, GpuNode],
    view: ClusterView,
    problems: Mapping[str, NodeProblem] | None = None,
) -> PendingPod | str:
    """The pod as a planner input, or the reason it can never be placed now.  ``problems``:
    the opted-in nodes left out for their labels (not in ``gpu_nodes``), named in a "no
    eligible node" reason when the pod would fit them (:func:`left_out_sentence`).

    Its eligible nodes are those the controller allows (``ClusterIndex.eligible`` in
    :mod:`partitioner.index`): past nodeSelector, affinity and taints, a node's allocatable
    must cover what else the pod asks for beside slices, CPU and memory (``rdma/...``,
    ``hugepages-*``, other extended resources; kube-scheduler's NodeResourcesFit refuses a
    node without it), and a "no eligible node" reason names what it asks, as the controller's
    ``Unplaceable`` Event does."""
    from partitioner import index  # imports this module: read here, once both are loaded

    try:
        requests = pod_requests(pod)
        slices = {r: _as_count(v, r) for r, v in requests.items() if is_partitionable_resource(r)}
        cpu = cpu_milli(requests.get("cpu", 0))
        mem = memory_mib(requests.get("memory", 0))
    except QuantityError as e:
        return f"invalid resource request: {e}"
    slices = {r: n for r, n in slices.items() if n > 0}
    others = tuple(
        sorted((r, v) for r, v in requests.items() if v > 0 and index._other_resource(r))
    )
    eligible = eligible_nodes(pod, (view.nodes[n] for n in sorted(gpu_nodes)))
    if others:
        eligible = frozenset(
            n for n in eligible if index.covers(index._allocatable_other(view.nodes[n]), others)
        )
    reason = reject_reason(
        slices, [(gpu_nodes[n].mode, gpu_nodes[n].model) for n in sorted(eligible)]
    )
    if reason is not None:
        if reason.startswith("no eligible node") and others:
            # worded as the controller's (decide._reject_reason)
            asked = ", ".join(f"{r}: {v}" for r, v in others)
            reason = reason.replace(
                "affinity and tolerations",
                f"affinity and tolerations and advertises what else it asks for ({asked})",
                1,
            )
        if reason.startswith("no eligible node"):
            left_out = sorted((problems or {}).items())
            opted = sorted({*gpu_nodes, *(problems or {})} & view.nodes.keys())
            reason += no_eligible_notes(
                pod,
                slices,
                False,  # a pod read here asks through extended resources
                [(view.nodes[n], p) for n, p in left_out if n in view.nodes],
                [view.nodes[n] for n in opted],
                [
                    (n, view.nodes[n], g.mode, g.model, g.dra)
                    for n, g in sorted(gpu_nodes.items())
                    if n in view.nodes
                ],
            )
        return reason
    priority = (pod.get("spec") or {}).get("priority") or 0
    return PendingPod(
        name=pod_key(pod),
        requests=slices,
        cpu_milli=cpu,
        memory_mib=mem,
        priority=int(priority),
        eligible_nodes=frozenset(eligible),
    )


def _free_node_resources(
    view: ClusterView, gpu_nodes: Mapping[str, GpuNode]
) -> dict[str, tuple[int, int]]:
    free = {n: (g.cpu_milli, g.memory_mib) for n, g in gpu_nodes.items()}
    for pod in view.pods.values():
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if node not in free or phase in ("Succeeded", "Failed"):
            continue
        try:
            req = pod_requests(pod)
            cpu, mem = cpu_milli(req.get("cpu", 0)), memory_mib(req.get("memory", 0))
        except QuantityError:
            continue  # the API server admitted it; count nothing rather than guess
        c, m = free[node]
        free[node] = (c - cpu, m - mem)
    return free


def _why_not_plannable(
    name: str,
    invalid: Mapping[str, str],
    problems: Mapping[str, NodeProblem],
    busy: AbstractSet[str],
) -> str:
    """A node a pod may use but no plan may touch now, with the reason: its NodePartitioning
    fails validation, a node problem (labels, GPUs not reported yet), or a plan in flight."""
    if name in invalid:
        return f"{name} (its {NP_KIND} is invalid)"
    if name in problems:
        return f"{name} ({problems[name].reason})"
    if name in busy:
        return f"{name} (applying a previous plan)"
    return name


def _promise(pod: Obj, gpu_nodes: Mapping[str, GpuNode], view: ClusterView) -> Reservation | None:
    """The slices gpuslice promised ``pod`` and holds for it, read as the controller reads
    them (``partitioner.decide``, ``read_pods`` and ``_hold``): a valid reservation
    (:mod:`partitioner.reservations`; one written for another pod's uid or for other units is
    ignored, the pod planned again) in state ``planned`` or ``released``, on a pod waiting for
    its slice (not bound, finished or being deleted; not a DaemonSet's, not nominated), whose
    node is still a GPU node that accepts it, and that no other controller's scheduling gate
    holds back (the controller waits for those first and holds nothing); also a ``draining``
    one (its GPUs are frozen: :func:`_freeze`).  ``None`` otherwise: a gated pod whose node is
    gone or refuses it now is planned again."""
    meta = pod.get("metadata") or {}
    if RESERVATION_ANNOTATION not in (meta.get("annotations") or {}):
        return None
    if _owned_by_daemonset(pod) or (pod.get("status") or {}).get("nominatedNodeName"):
        return None
    from partitioner import index  # imports this module: read here, once both are loaded

    info = index._read_pod(pod)
    r = info.reservation
    if r is None or not info.waiting:
        return None
    if info.gated and info.other_gates:
        return None
    node = view.nodes.get(r.node)
    if r.node not in gpu_nodes or node is None or not pod_fits_node(pod, node):
        return None
    return r


def _units(r: Reservation) -> str:
    return ", ".join(
        f"{n} x {resource} on GPU {', '.join(str(i) for i in sorted(set(r.gpus[resource])))}"
        for resource, n in sorted(r.units().items())
    )


def _in_flight_reason(r: Reservation) -> str:
    how = (
        "released: kube-scheduler binds it there"
        if r.state is State.RELEASED
        else f"planned{' in plan ' + r.plan if r.plan else ''}: released once the node shows it"
    )
    return (
        f"in flight: gpuslice promised it {_units(r)} of node {r.node} ({how}); not planned again"
    )


def _resource_of(model: GpuModel, profile: str) -> str:
    try:
        return model.profile(profile).resource
    except CatalogError:
        return mig_resource(profile)


def _hold(gpu: GpuState, resource: str, model: GpuModel) -> GpuState:
    """``gpu`` with one free device of ``resource`` marked used (held for a promised pod, as
    the controller's ledger holds it); with none free (not reported as the promise expects),
    the GPU locked: its layout is kept as it is."""
    for k, inst in enumerate(gpu.mig):
        if not inst.used and not inst.mps and _resource_of(model, inst.profile) == resource:
            mig = (*gpu.mig[:k], replace(inst, used=True), *gpu.mig[k + 1 :])
            return replace(gpu, mig=mig)
    for k, sl in enumerate(gpu.mps):
        if not sl.used and mps_resource(sl.memory_mib // 1024) == resource:
            return replace(gpu, mps=(*gpu.mps[:k], replace(sl, used=True), *gpu.mps[k + 1 :]))
    for k, inst in enumerate(gpu.mig):
        for j, sl in enumerate(inst.mps):
            if not sl.used and mps_resource(sl.memory_mib // 1024) == resource:
                host = replace(
                    inst, mps=(*inst.mps[:j], replace(sl, used=True), *inst.mps[j + 1 :])
                )
                return replace(gpu, mig=(*gpu.mig[:k], host, *gpu.mig[k + 1 :]))
    return replace(gpu, locked=True)


def _freeze(adopted: Adopted, indices: Iterable[int], keys: Iterable[str]) -> Adopted:
    """``adopted`` with GPUs ``indices`` frozen for drains (pods ``keys``): every free device
    on them held and their layout kept, as the controller's ledger freezes them (nothing is
    promised or planned there until they empty and the drained pod is planned onto them)."""
    frozen = set(indices)

    def held(gpu: GpuState) -> GpuState:
        mig = tuple(
            replace(m, used=True, mps=tuple(replace(s, used=True) for s in m.mps)) for m in gpu.mig
        )
        mps = tuple(replace(s, used=True) for s in gpu.mps)
        return replace(gpu, mig=mig, mps=mps, locked=True)

    gpus = tuple(held(g) if g.index in frozen else g for g in adopted.gpus)
    note = (
        f"GPU {', '.join(str(i) for i in sorted(frozen))} drained for "
        f"{', '.join(sorted(keys))}: no other pod is planned there"
    )
    return replace(adopted, gpus=gpus, notes=(*adopted.notes, note))


def _hold_promises(
    adopted: Adopted, model: GpuModel, promises: Iterable[tuple[str, Reservation]]
) -> Adopted:
    """``adopted`` with the devices of the promises (pod key, reservation) on its node held:
    the controller never plans another pod onto a slice it promised, nor moves it."""
    gpus = {g.index: g for g in adopted.gpus}
    held: list[str] = []
    for key, r in promises:
        for resource, indices in sorted(r.gpus.items()):
            for i in indices:
                if i in gpus:
                    gpus[i] = _hold(gpus[i], resource, model)
        held.append(f"{key} ({_units(r)})")
    if not held:
        return adopted
    note = (
        f"held for {len(held)} pod(s) gpuslice promised slices and that are not bound yet: "
        + "; ".join(held)
    )
    return replace(adopted, gpus=tuple(gpus[i] for i in sorted(gpus)), notes=(*adopted.notes, note))


def read_cluster(view: ClusterView, catalog: Catalog) -> ClusterReading:
    gpu_nodes: dict[str, GpuNode] = {}
    problems: dict[str, NodeProblem] = {}
    for name in sorted(view.nodes):
        got = read_node(view.nodes[name], catalog)
        if isinstance(got, GpuNode):
            gpu_nodes[name] = got
        elif isinstance(got, NodeProblem):
            problems[name] = got
    label_problems = dict(problems)

    partitionings: dict[str, NodePartitioning] = {}
    invalid: dict[str, str] = {}
    for name, raw in view.partitionings.items():
        try:
            parsed = NodePartitioning.model_validate(dict(raw))
        except ValidationError as e:
            invalid[name] = (
                f"{NP_KIND} {name} is invalid: {e.error_count()} error(s): {e.errors()[0]['msg']} at {'.'.join(str(p) for p in e.errors()[0]['loc'])}"
            )
            continue
        indices = [g.index for g in parsed.spec.gpus]
        twice = next((i for i in indices if indices.count(i) > 1), None)
        if twice is not None:  # the API server admits it; the node agent refuses the spec
            invalid[name] = (
                f"{NP_KIND} {name} is invalid: GPU {twice}: listed twice in spec.gpus; list it "
                f"once (the node agent refuses the spec: InvalidSpec)"
            )
            continue
        partitionings[name] = parsed

    current: dict[str, Adopted] = {}
    for n, now in adopt_all(
        view.nodes, gpu_nodes, partitionings, view.pods.values(), catalog
    ).items():
        if isinstance(now, LabelProblem):  # kept in gpu_nodes: its agent must get to report
            problems[n] = NodeProblem(n, now.reason, now.message)
        else:
            current[n] = now
            gpu_nodes[n] = replace(gpu_nodes[n], gpu_count=now.gpu_count)
    busy = frozenset(
        n for n in gpu_nodes if n in invalid or (n in partitionings and is_busy(partitionings[n]))
    )
    in_flight: dict[str, str] = {}
    for n in sorted(busy):
        np = partitionings.get(n)
        for p in planned_pods(np) if np else ():
            in_flight[p] = (
                f"in flight: waiting for node {n} to apply plan {np.spec.planId if np else ''}"
            )

    # the controller removes the record when a cool-down ends: one in the dump was running
    cooling: set[str] = set()
    for n, np in sorted(partitionings.items()):
        recorded = cooldown_of(np) if n in gpu_nodes and n not in busy else None
        if recorded is not None and n not in problems:
            cooling.add(n)
            why = recorded[1] or "a promise it did not keep"
            problems[n] = NodeProblem(
                n,
                "CoolingDown",
                f"node {n} was cooling down when the dump was taken ({why}; annotation "
                f"{COOLDOWN_ANNOTATION}): the partitioner makes no promise there until it ends",
            )
    kept = {key: r for key in sorted(view.pods) if (r := _promise(view.pods[key], gpu_nodes, view))}
    promises = {k: r for k, r in kept.items() if r.state is not State.DRAINING}
    drains = {k: r for k, r in kept.items() if r.state is State.DRAINING}
    for n in sorted(current):
        mine = [(k, r) for k, r in promises.items() if r.node == n]
        if mine:
            current[n] = _hold_promises(current[n], gpu_nodes[n].model, mine)
        draining = [(k, r) for k, r in drains.items() if r.node == n]
        if draining:
            frozen_gpus = {i for _, r in draining for idx in r.gpus.values() for i in idx}
            current[n] = _freeze(current[n], frozen_gpus, [k for k, _ in draining])

    free = _free_node_resources(view, gpu_nodes)
    nodes = tuple(
        NodeState(
            name=g.name,
            mode=g.mode,
            model=g.model.name,
            gpus=current[g.name].gpus,
            cpu_milli_free=max(0, free[g.name][0]),
            memory_mib_free=max(0, free[g.name][1]),
            gpu_memory_mib=g.gpu_memory_mib,
        )
        for g in gpu_nodes.values()
        if g.name not in busy and g.name in current and g.name not in cooling
    )
    plannable = frozenset(n.name for n in nodes)

    candidates: dict[str, PendingPod] = {}
    rejected: dict[str, str] = {}
    waiting: dict[str, str] = {}
    left_out: dict[str, str] = {}
    batchable = set()
    for key in sorted(view.pods):
        pod = view.pods[key]
        if not is_batchable(pod):
            continue
        batchable.add(key)
        if key in in_flight:
            waiting[key] = in_flight[key]
            continue
        held_back = other_gates(pod) if has_gate(pod) else []
        if held_back:  # worded as the controller's (decide, read_pods)
            waiting[key] = "waiting for other scheduling gates to be removed: " + ", ".join(
                held_back
            )
            continue
        if key in promises:
            waiting[key] = _in_flight_reason(promises[key])
            continue
        if key in drains:
            r = drains[key]
            gpus = sorted({i for idx in r.gpus.values() for i in idx})
            waiting[key] = (
                f"draining: gpuslice empties node {r.node} GPU {', '.join(map(str, gpus))} for "
                f"it (planned onto them once their pods end); not planned again"
            )
            continue
        pending = _classify_pod(pod, gpu_nodes, view, label_problems)
        if isinstance(pending, str):
            rejected[key] = pending
            continue
        eligible = pending.eligible_nodes or frozenset()
        usable = eligible & plannable
        if not usable:
            waiting[key] = "no eligible node can be planned now: " + ", ".join(
                _why_not_plannable(n, invalid, problems, busy) for n in sorted(eligible)
            )
            continue
        candidates[key] = replace(pending, eligible_nodes=usable)
        if eligible - plannable:
            left_out[key] = ", ".join(
                _why_not_plannable(n, invalid, problems, busy) for n in sorted(eligible - plannable)
            )
    return ClusterReading(
        gpu_nodes=gpu_nodes,
        problems=problems,
        partitionings=partitionings,
        invalid_partitionings=invalid,
        busy=busy,
        nodes=nodes,
        candidates=candidates,
        rejected=rejected,
        waiting=waiting,
        batchable=frozenset(batchable),
        adopted=current,
        left_out=left_out,
    )


def view_from_items(items: Iterable[Obj]) -> ClusterView:
    """Split a list of API objects (any order, any kinds) into a :class:`ClusterView`."""
    nodes: dict[str, Obj] = {}
    pods: dict[str, Obj] = {}
    nps: dict[str, Obj] = {}
    for item in items:
        kind = item.get("kind")
        if kind == "Node":
            nodes[_name(item)] = item
        elif kind == "Pod":
            pods[pod_key(item)] = item
        elif kind == NP_KIND:
            nps[_name(item)] = item
    return ClusterView(nodes, pods, nps)


def read_kubectl_list(doc: Mapping[str, Any], catalog: Catalog) -> ClusterReading:
    """:func:`read_cluster` on ``kubectl get nodes,pods -A -o json`` output (NodePartitionings
    too once gpuslice's CRD is installed: ``kubectl get nodes,pods,nodepartitionings``)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("items"), list):
        raise ValueError(
            "expected a Kubernetes List with an 'items' array, as printed by "
            "'kubectl get nodes,pods -A -o json' (add ',nodepartitionings' once gpuslice is "
            "installed)"
        )
    return read_cluster(view_from_items(doc["items"]), catalog)


def invalid_partitioning_message(name: str, error: str) -> str:
    """The controller's ``InvalidPartitioning`` message (node condition and Event) for node
    ``name`` whose NodePartitioning fails validation with ``error``: what happens and the fix."""
    return (
        f"{error}; the node is left out of plans and nothing is promised there until it is "
        f"valid: undo the hand edit (kubectl edit nodepartitioning {name}), or run one gpuslice "
        f"version for the node agent and the partitioner (an agent newer than the partitioner "
        f"may report fields it does not know)"
    )


def reading_notes(reading: ClusterReading) -> list[str]:
    """What a reading left out and why, one line each."""
    notes = [f"node {p.name}: {p.reason}: {p.message}" for p in reading.problems.values()]
    notes += [
        f"node {n}: InvalidPartitioning: {invalid_partitioning_message(n, msg)}"
        for n, msg in sorted(reading.invalid_partitionings.items())
    ]
    notes += [
        f"node {n}: skipped, its last spec is not applied yet"
        for n in sorted(reading.busy - reading.invalid_partitionings.keys())
    ]
    notes += [f"pod {p}: cannot place: {r}" for p, r in sorted(reading.rejected.items())]
    notes += [f"pod {p}: {r}" for p, r in sorted(reading.waiting.items())]
    if not reading.gpu_nodes and not reading.problems:
        notes.append(
            f"no node is opted in: label GPU nodes {GPUSLICE_LABEL}=mig|mps|hybrid or "
            f"{NOS_LABEL}=mig|mps"
        )
    return notes


def snapshot_from_kubectl_list(
    doc: Mapping[str, Any], catalog: Catalog
) -> tuple[Snapshot, list[str]]:
    """Planner input from ``kubectl get nodes,pods[,nodepartitionings] -A -o json`` output.

    Every candidate pod is included (no batch window); the second value lists, one line each,
    what was left out and why (node problems, busy nodes, rejected and waiting pods).
    """
    reading = read_kubectl_list(doc, catalog)
    return reading.snapshot(), reading_notes(reading)
