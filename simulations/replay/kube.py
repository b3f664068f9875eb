"""Kubernetes as the time replay sees it: the API store, kube-scheduler and the kubelet.

Nothing here knows a plan.  The partitioner talks to the cluster only through the API objects
(:class:`SimApi`), exactly as it does in production, and these parts react as Kubernetes does:

API server (:class:`SimApi`)
    Stores Pods, Nodes and NodePartitionings (plain dicts) and keeps the partitioner's
    :class:`~partitioner.index.ClusterIndex` in step with every change.  Pod creation runs the
    mutating webhook when the partitioner serves one (:func:`partitioner.gating.admission_patch`
    — the function the real webhook calls); pod patches are JSON merge patches checked against
    ``resourceVersion`` (409) and the API server's pod rules (422,
    :mod:`simulations.replay.kube_rules`).  Binding sets ``spec.nodeName`` (the binding subresource).

kube-scheduler (:class:`Scheduler`, default profile, facts/k8s-scheduling.md §1, §4, §5)
    A gated pod is parked and never tried.  Ungated pods wait in the active queue ordered by
    priority, then queue timestamp (set when first queued and refreshed when re-queued after a
    failure; ungating keeps it).  A scheduling cycle filters every node (NodeResourcesFit on
    cpu, memory and every extended resource against the node's ``status.allocatable`` minus what
    bound pods request; node selector, required node affinity, taints, cordon — the same filter
    functions the partitioner uses for eligibility) and scores the feasible ones with
    LeastAllocated (cpu, memory; non-zero defaults 100m / 200 MiB) plus BalancedAllocation
    (cpu, memory), extended resources unscored; ties are broken at random (seeded).  A pod that
    does not fit is marked ``PodScheduled=False/Unschedulable`` and parked; it is tried again
    when a node's allocatable grows in a resource it requests and it fits that node's bare
    allocatable, when a bound pod is deleted, or after 5 minutes (flushed every 30 s); a re-try
    waits out its backoff (1 s doubling to 10 s per failed attempt) while other pods are queued:
    with the active queue empty the scheduler pops the backoff queue at once, in the order of
    the backoff expiries (aligned to 1 s windows), then priority and queue timestamp
    (SchedulerPopFromBackoffQ, beta and on by default from Kubernetes 1.33;
    ``Scheduler.pop_from_backoff=False`` is the older queue).  Binding assumes the pod
    on the node at once.  There is no preemption (DefaultPreemption): a higher-priority pod
    waits for lower-priority pods to end (a replay of several priorities carries a warning,
    :func:`simulations.replay.engine.no_preemption_warning`).

DRA mode (``Scheduler.dra``)
    A pod's slice requests stand for a ResourceClaim: the filter asks the DRA allocator
    (:class:`simulations.replay.dra.DraPools`, first-fit over the node's published devices and
    their counters) instead of the node's allocatable; scoring is unchanged (DRA adds no score).

kubelet (:class:`Kubelet`)
    Posts node status every 10 s (a per-node phase, seeded): ``status.allocatable`` of every
    extended resource is the number of devices the node agent advertises (free or allocated;
    a device the agent withdrew is gone).  A device change therefore reaches kube-scheduler at
    the node's next status sync, not before.  Admission allocates devices for a bound pod: the
    device ids come from the node agent's own preferred-allocation rule
    (:func:`node_agent.deviceplugin.preferred_allocation`, with the GPUs the partitioner drains
    avoided, as the agent reads them from its NodePartitioning) among the free advertised
    devices, grouped as the agent groups them (by GPU; an MPS slice inside a hybrid MIG
    instance by that instance's daemon; a host instance is not advertised); if there are not enough (the status the scheduler saw
    is stale) the pod is rejected (``OutOf<resource>``, phase Failed) and its controller
    creates it again.  The kubelet then asks the agent's ``Allocate`` for each resource's
    picked devices (one request per resource, as the kubelet's device manager does), and the
    answer is the production rule itself: :func:`node_agent.deviceplugin.more_than_one_mps_slice`,
    then :func:`node_agent.devices.container_env` and :func:`node_agent.devices.container_mounts`
    of the devices as :func:`node_agent.devices.advertised_devices` builds them.  It refuses a
    container more than one MPS slice (its daemon caps each client at one slice) and MPS slices
    of two MPS daemons; the plugin answers
    ``INVALID_ARGUMENT`` and the kubelet fails the pod (``UnexpectedAdmissionError``, phase
    Failed, :meth:`Kubelet.refusal`).  Its controller creates it again, and it is refused
    again as long as the node's free devices stay as they are.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import math
import random
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from contract.nodepartitioning import (
    API_VERSION,
    KIND,
    ActualGpu,
    ActualMigInstance,
    ActualMpsSlice,
)
from node_agent.deviceplugin import more_than_one_mps_slice, preferred_allocation
from node_agent.devices import (
    advertised_devices,
    container_env,
    container_mounts,
    mps_slice_id,
)
from partitioner.eligibility import pod_fits_node
from partitioner.gating import admission_patch
from partitioner.index import ClusterIndex, PodInfo
from partitioner.node_labels import COUNT_LABEL, PRODUCT_LABEL
from partitioner.snapshot import GPUSLICE_LABEL, PLANNED_AT_ANNOTATION, PLANNED_PODS_ANNOTATION
from planner.snapshot import Mode
from simulations.replay.fake_cluster import Device, FakeCluster, FakeNode
from simulations.replay.kube_rules import (
    Invalid,
    merge_patch,
    validate_pod_create,
    validate_pod_update,
)
from simulations.replay.kube_score import resource_score

__all__ = [
    "Conflict",
    "Invalid",
    "Kubelet",
    "Scheduler",
    "SimApi",
    "rfc3339",
]

MPS_PIPE_ROOT = "/run/nvidia/mps"
"""The agent's ``mps_pipe_root`` (its default): the parent of the MPS daemons' pipe
directories.  Any one root gives the same ``Allocate`` answers: every device of a node shares it."""


class DraFit(Protocol):
    def fit(self, node: str, requests: Mapping[str, int]) -> Sequence[object] | None:
        """The DRA allocator's allocation of ``requests`` on ``node``, or ``None``."""
        ...


class Conflict(Exception):
    """409: the object changed since the resourceVersion the request carried."""


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --------------------------------------------------------------------------- API server


class SimApi:
    """Pods, Nodes and NodePartitionings of the simulated cluster (module docstring)."""

    def __init__(self, index: ClusterIndex, webhook: bool, gate_claims: bool = False) -> None:
        self.index = index
        self.webhook = webhook
        """The partitioner's mutating webhook is installed (pods asking for slices get gated)."""
        self.gate_claims = gate_claims
        """The webhook gates pods naming ResourceClaims too (DRA nodes served)."""
        self.pods: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.partitionings: dict[str, dict[str, Any]] = {}
        self.claims: dict[str, dict[str, Any]] = {}
        """ResourceClaims (DRA policies with planner-shaped publishing)."""
        self._rv = itertools.count(1)
        self.refused: Counter[str] = Counter()
        """Requests refused, by reason (``Conflict``, ``Invalid``)."""

    def _stamp(self, obj: dict[str, Any]) -> None:
        obj["metadata"]["resourceVersion"] = str(next(self._rv))

    # ------------------------------------------------------------------ pods

    def create_pod(self, pod: dict[str, Any], now: float) -> dict[str, Any]:
        if self.webhook:
            gates = admission_patch(pod, self.gate_claims)
            if gates is not None:
                pod["spec"]["schedulingGates"] = gates
        validate_pod_create(pod)
        pod["metadata"].setdefault("creationTimestamp", rfc3339(now))
        pod["metadata"].setdefault("uid", f"uid-{pod['metadata']['name']}-{next(self._rv)}")
        pod.setdefault("status", {"phase": "Pending"})
        self._stamp(pod)
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        self.pods[key] = pod
        self.index.upsert_pod(pod)
        return pod

    def patch_pod(self, key: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """JSON merge patch with the resourceVersion precondition and the pod rules."""
        old = self.pods.get(key)
        if old is None:
            self.refused["NotFound"] += 1
            raise KeyError(key)
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != old["metadata"]["resourceVersion"]:
            self.refused["Conflict"] += 1
            raise Conflict(f"pod {key}: resourceVersion {wanted} is stale")
        # merge_patch copies every mapping on the patch's paths and deep-copies the values it
        # sets, and never changes its target: ``new`` shares only untouched parts with ``old``,
        # which is dropped from the store below (no deep copy of the whole pod needed).
        new = merge_patch(old, patch)
        try:
            validate_pod_update(old, new)
        except Invalid:
            self.refused["Invalid"] += 1
            raise
        if new.get("metadata") is old.get("metadata"):  # stamped in place below
            new["metadata"] = dict(new["metadata"])
        self._stamp(new)
        self.pods[key] = new
        self.index.upsert_pod(new)
        return new

    def set_pod_status(self, key: str, status: Mapping[str, Any]) -> None:
        pod = self.pods[key]
        pod["status"] = dict(status)
        self._stamp(pod)
        self.index.upsert_pod(pod)

    def bind(self, key: str, node: str) -> None:
        """The binding subresource plus the kubelet's Running status."""
        pod = self.pods[key]
        pod["spec"]["nodeName"] = node
        pod["status"] = {
            "phase": "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
        }
        self._stamp(pod)
        self.index.upsert_pod(pod)

    def evict_pod(self, key: str, uid: str, resource_version: str | None) -> bool:
        """``pods/<name>/eviction`` of a pod that has not started: deleted if it is still the
        pod (``uid``) at the ``resourceVersion`` the request names (else refused: 409)."""
        pod = self.pods.get(key)
        if pod is None:
            self.refused["NotFound"] += 1
            return False
        meta = pod["metadata"]
        if (uid and uid != meta.get("uid")) or (
            resource_version is not None and resource_version != meta["resourceVersion"]
        ):
            self.refused["Conflict"] += 1
            return False
        self.delete_pod(key)
        return True

    def delete_pod(self, key: str) -> dict[str, Any] | None:
        pod = self.pods.pop(key, None)
        if pod is not None:
            self.index.apply("pods", "DELETED", pod)
        return pod

    # ------------------------------------------------------------------ claims

    def create_claim(self, claim: dict[str, Any]) -> None:
        self._stamp(claim)
        meta = claim["metadata"]
        self.claims[f"{meta['namespace']}/{meta['name']}"] = claim
        self.index.apply("claims", "ADDED", claim)

    def allocate_claim(self, key: str, node: str, devices: Iterable[str], driver: str) -> None:
        """kube-scheduler writes the allocation to the claim's status before binding."""
        claim = self.claims[key]
        results = [{"request": "gpu", "driver": driver, "pool": node, "device": d} for d in devices]
        claim["status"] = {"allocation": {"devices": {"results": results}}}
        self._stamp(claim)
        self.index.apply("claims", "MODIFIED", claim)

    def delete_claim(self, key: str) -> None:
        claim = self.claims.pop(key, None)
        if claim is not None:
            self.index.apply("claims", "DELETED", claim)

    # ------------------------------------------------------------------ nodes

    def add_node(self, node: FakeNode, partitioning: str | None = None) -> None:
        obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": node.name,
                "uid": f"node-{node.name}",
                "labels": {
                    GPUSLICE_LABEL: partitioning or node.mode.value,
                    PRODUCT_LABEL: node.model.name,
                    COUNT_LABEL: str(len(node.gpus)),
                },
            },
            "spec": {},
            "status": {
                "allocatable": {"cpu": f"{node.cpu_milli}m", "memory": f"{node.memory_mib}Mi"}
            },
        }
        self._stamp(obj)
        self.nodes[node.name] = obj
        self.index.upsert_node(obj)

    def set_allocatable(self, name: str, devices: Mapping[str, int]) -> set[str]:
        """The kubelet's status sync; returns the resources whose allocatable grew."""
        node = self.nodes[name]
        alloc = node["status"]["allocatable"]
        grew: set[str] = set()
        changed = False
        for resource in sorted(set(devices) | {r for r in alloc if r.startswith("nvidia.com/")}):
            before = int(alloc.get(resource, 0))
            after = int(devices.get(resource, 0))
            if before == after:
                continue
            changed = True
            if after > before:
                grew.add(resource)
            if after:
                alloc[resource] = str(after)
            else:
                alloc.pop(resource, None)
        if changed:
            self._stamp(node)
            self.index.upsert_node(node)
        return grew

    def set_node_condition(self, name: str, condition: Mapping[str, str]) -> None:
        """The partitioner's node condition write (``GpusliceReady``): replaces the condition
        of that type, as its status patch does."""
        node = self.nodes[name]
        status = node.setdefault("status", {})
        kept = [c for c in status.get("conditions") or () if c.get("type") != condition["type"]]
        status["conditions"] = [*kept, dict(condition)]
        self._stamp(node)
        self.index.upsert_node(node)

    # ------------------------------------------------------------------ partitionings

    def add_partitioning(self, node: FakeNode) -> None:
        obj: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {
                "name": node.name,
                "uid": f"np-{node.name}",
                "generation": 1,
                "annotations": {},
            },
            "spec": {"planId": "", "mode": node.mode.value, "gpus": []},
            "status": {"observedGeneration": 1, "gpus": [], "conditions": []},
        }
        self._stamp(obj)
        self.partitionings[node.name] = obj
        self.index.upsert_partitioning(obj)

    def write_spec(
        self,
        name: str,
        spec: Mapping[str, Any],
        resource_version: str | None,
        planned_pods: Iterable[str],
        planned_at: float | None,
    ) -> dict[str, Any]:
        np = self.partitionings[name]
        meta = np["metadata"]
        if resource_version is not None and resource_version != meta["resourceVersion"]:
            self.refused["Conflict"] += 1
            raise Conflict(f"NodePartitioning {name}: resourceVersion is stale")
        annotations = {PLANNED_PODS_ANNOTATION: json.dumps(list(planned_pods))}
        if planned_at is not None:
            annotations[PLANNED_AT_ANNOTATION] = f"{planned_at:.3f}"
        meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}  # merge patch
        if np["spec"] != spec:
            meta["generation"] = int(meta["generation"]) + 1
        np["spec"] = dict(spec)
        self._stamp(np)
        self.index.upsert_partitioning(np)
        return np

    def annotate_np(self, name: str, key: str, value: str | None) -> None:
        """A merge patch of one annotation of a NodePartitioning (``None`` removes it)."""
        np = self.partitionings.get(name)
        if np is None:
            return  # the API answers 404; the partitioner's writer passes it by
        meta = np["metadata"]
        annotations = dict(meta.get("annotations") or {})
        if value is None:
            annotations.pop(key, None)
        else:
            annotations[key] = value
        meta["annotations"] = annotations
        self._stamp(np)
        self.index.upsert_partitioning(np)

    def patch_np_status(self, name: str, status: Mapping[str, Any]) -> None:
        """A merge patch of the status subresource (agent fields or the partitioner's).

        Top-level fields only, each replaced whole (what both writers send); a patch that
        changes nothing changes nothing (no new resourceVersion, no watch event).
        """
        np = self.partitionings[name]
        old = np.get("status") or {}
        if all(old.get(k) == v for k, v in status.items()):
            return
        new = dict(old)
        for k, v in status.items():
            if v is None:
                new.pop(k, None)
            else:
                new[k] = v
        np["status"] = new
        self._stamp(np)
        self.index.upsert_partitioning(np)

    def draining_gpus(self, name: str) -> frozenset[int]:
        """GPUs the partitioner drains on ``name`` (what the node agent reads)."""
        entries = (self.partitionings[name].get("status") or {}).get("reservations") or ()
        return frozenset(
            i
            for e in entries
            if e.get("state") == "draining"
            for g in (e.get("gpus") or {}).values()
            for i in g
        )


# --------------------------------------------------------------------------- kube-scheduler


@dataclass(slots=True)
class _Entry:
    key: str
    priority: int
    timestamp: float
    attempts: int = 0
    backoff_until: float = 0.0
    unschedulable_since: float = 0.0


@dataclass(slots=True)
class Scheduler:
    """kube-scheduler's queue and default scoring (module docstring).

    Queues, cheaply (the time replay tries thousands of parked pods again after every
    departure): ``active`` is a plain list, sorted once when :meth:`run` drains it (a sorted
    list is popped in the order a heap would pop it: every entry is unique by its sequence
    number, and nothing is queued while :meth:`run` drains); ``parked`` is a deque, appended in
    ``(since, seq)`` order because scheduling time never goes back (an out-of-order entry is
    inserted in place).
    """

    api: SimApi
    rng: random.Random
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 10.0
    unschedulable_timeout_s: float = 300.0
    flush_period_s: float = 30.0
    entries: dict[str, _Entry] = field(default_factory=dict)
    active: list[tuple[int, float, int, str]] = field(default_factory=list)
    """Queued pods as ``(-priority, queue timestamp, seq, pod)``, unsorted until :meth:`run`."""
    backoff: list[tuple[float, int, str]] = field(default_factory=list)
    unschedulable: dict[str, None] = field(default_factory=dict)
    """Parked unschedulable pods (a dict as an ordered set: they are listed sorted, and a
    dict in the order they failed sorts much faster than a hash-ordered set)."""
    parked: deque[tuple[float, int, str]] = field(default_factory=deque)
    """(parked since, seq, pod) of unschedulable pods, oldest first (stale entries skipped)."""
    gated: set[str] = field(default_factory=set)
    dra: DraFit | None = None
    """DRA mode: pods' slice requests are ResourceClaims, filtered by the DRA allocator on
    each node's published devices (:class:`simulations.replay.dra.DraPools`) instead of the
    node's allocatable extended resources."""
    pop_from_backoff: bool = True
    """SchedulerPopFromBackoffQ (on from Kubernetes 1.33): with the active queue empty, pods
    still backing off are tried at once (module docstring)."""
    attempts: int = 0
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    _backoffs: tuple[float, ...] = ()
    """Backoff after the n-th failed attempt (index n, saturating at the last), computed once
    with the expression kube-scheduler's backoff is (same floats)."""

    def __post_init__(self) -> None:
        self._backoffs = tuple(
            min(self.max_backoff_s, self.initial_backoff_s * 2 ** min(n - 1, 16))
            for n in range(0, 18)
        )

    def _push_active(self, e: _Entry) -> None:
        self.active.append((-e.priority, e.timestamp, next(self._seq), e.key))

    def add(self, key: str, now: float) -> None:
        """A new pod: parked if gated, else queued."""
        info = self.api.index.pods.get(key)
        if info is None:
            return
        e = _Entry(key, info.priority, now)
        self.entries[key] = e
        if info.gated or info.other_gates:
            self.gated.add(key)
        else:
            self._push_active(e)

    def updated(self, key: str, now: float) -> None:
        """A pod update: ungating moves a parked pod to the queue (no backoff on a first try)."""
        e = self.entries.get(key)
        info = self.api.index.pods.get(key)
        if e is None or info is None or key not in self.gated:
            return
        if info.gated or info.other_gates:
            return
        self.gated.discard(key)
        self._requeue(e, now)

    def forget(self, key: str) -> None:
        self.entries.pop(key, None)
        self.gated.discard(key)
        self.unschedulable.pop(key, None)

    def _requeue(self, e: _Entry, now: float) -> None:
        self.unschedulable.pop(e.key, None)
        if e.backoff_until > now:
            heapq.heappush(self.backoff, (e.backoff_until, next(self._seq), e.key))
        else:
            self._push_active(e)

    def allocatable_grew(self, node: str, resources: set[str], now: float) -> None:
        """NodeResourcesFit's queueing hint for a node update."""
        if not resources or not self.unschedulable:
            return
        info_node = self.api.index.nodes.get(node)
        if info_node is None:
            return
        for key in sorted(self.unschedulable):
            pod = self.api.index.pods.get(key)
            if pod is None or not (set(pod.slices) & resources):
                continue
            if all(info_node.allocatable.get(r, 0) >= k for r, k in pod.slices.items()):
                self._requeue(self.entries[key], now)

    def devices_published(self, resources: set[str], now: float) -> None:
        """The DRA plugin's queueing hint for a ResourceSlice change: unschedulable pods
        asking for a newly published kind of device are tried again."""
        if not resources or not self.unschedulable:
            return
        for key in sorted(self.unschedulable):
            pod = self.api.index.pods.get(key)
            if pod is not None and set(pod.slices) & resources:
                self._requeue(self.entries[key], now)

    def bound_pod_deleted(self, now: float) -> None:
        """NodeResourcesFit's queueing hint for an assigned pod's deletion: try them again."""
        if not self.unschedulable:
            return
        keys = sorted(self.unschedulable)
        self.unschedulable.clear()  # each is requeued (as _requeue, inlined: thousands of pods)
        entries, active, backoff, seq = self.entries, self.active, self.backoff, self._seq
        for key in keys:
            e = entries[key]
            if e.backoff_until > now:
                heapq.heappush(backoff, (e.backoff_until, next(seq), key))
            else:
                active.append((-e.priority, e.timestamp, next(seq), key))

    def flush(self, now: float) -> None:
        """Unschedulable pods parked for 5 minutes go back to the queue."""
        parked, timeout = self.parked, self.unschedulable_timeout_s
        while parked and now - parked[0][0] >= timeout:
            since, _, key = parked.popleft()
            e = self.entries.get(key)
            if key in self.unschedulable and e is not None and e.unschedulable_since == since:
                self._requeue(e, now)

    def next_flush(self, now: float) -> float | None:
        """When the flush loop (every ``flush_period_s``) next moves a parked pod."""
        parked, unschedulable, entries = self.parked, self.unschedulable, self.entries
        while parked:
            since, _, key = parked[0]
            e = entries.get(key)
            if key in unschedulable and e is not None and e.unschedulable_since == since:
                due = since + self.unschedulable_timeout_s
                period = self.flush_period_s
                return max(now, math.ceil(due / period - 1e-9) * period)
            parked.popleft()
        return None

    def next_event(self) -> float | None:
        return self.backoff[0][0] if self.backoff else None

    def _ready(self, now: float) -> None:
        while self.backoff and self.backoff[0][0] <= now:
            _, _, key = heapq.heappop(self.backoff)
            e = self.entries.get(key)
            if e is not None and key not in self.gated:
                self._push_active(e)

    def _pop_backoff(self) -> list[tuple[int, float, int, str]]:
        """Every pod still backing off, in the order kube-scheduler pops its backoff queue
        once the active queue is empty (expiry aligned to 1 s windows, then priority, queue
        timestamp); the queue is left empty."""
        out: list[tuple[float, int, float, int, str]] = []
        for until, seq, key in self.backoff:
            e = self.entries.get(key)
            if e is not None and key not in self.gated:
                out.append((math.ceil(until), -e.priority, e.timestamp, seq, key))
        self.backoff.clear()
        out.sort()
        return [(p, ts, seq, key) for _, p, ts, seq, key in out]

    def _room(self) -> dict[str, int]:
        """Per extended resource, the most any node could still admit (a quick-reject bound)."""
        room: dict[str, int] = {}
        index = self.api.index
        for name, info in index.nodes.items():
            usage = index.usage(name)
            for r, alloc in info.allocatable.items():
                left = alloc - usage.slices.get(r, 0)
                if left > room.get(r, 0):
                    room[r] = left
        return room

    def _park(self, entry: tuple[float, int, str]) -> None:
        """Add to :attr:`parked`, keeping it sorted (appends but for a clock that went back)."""
        parked = self.parked
        if parked and parked[-1] > entry:
            bisect.insort(parked, entry)
        else:
            parked.append(entry)

    def run(self, now: float, bind: Callable[[str, str], bool]) -> None:
        """Schedule every pod in the active queue (scheduling takes no simulated time).

        A pod asking for more of a resource than any node has left fails its attempt at once
        (the filter would reject every node; the outcome and the backoff are the same).
        ``bind`` must not queue pods (the replay's does not).
        """
        self._ready(now)
        queue = self.active
        if not queue and not (self.pop_from_backoff and self.backoff):
            return
        queue.sort()  # the order heap pops would give
        if self.pop_from_backoff and self.backoff:  # popped once the active queue is empty
            queue.extend(self._pop_backoff())
        self.active = []
        seen: set[str] = set()
        room: dict[str, int] | None = None
        entries, pods = self.entries, self.api.index.pods
        unschedulable, seq, backoffs = self.unschedulable, self._seq, self._backoffs
        last = len(backoffs) - 1
        parked = self.parked
        in_order = not parked or parked[-1][0] <= now
        attempts = 0
        for item in queue:
            key = item[3]
            if key in seen:
                continue
            e = entries.get(key)
            pod = pods.get(key)
            if e is None or pod is None or not pod.waiting:  # waiting: not bound either
                continue
            seen.add(key)
            attempts += 1
            fits = True
            if self.dra is None:
                if room is None:
                    room = self._room()
                for r, k in pod.slices.items():
                    if room.get(r, 0) < k:
                        fits = False
                        break
            if fits:
                node = self._choose(pod)
                if node is not None and bind(key, node):
                    self.forget(key)
                    room = None
                    continue
            n = e.attempts = e.attempts + 1
            e.backoff_until = now + backoffs[n if n < last else last]
            e.timestamp = now
            e.unschedulable_since = now
            unschedulable[key] = None
            if in_order:
                parked.append((now, next(seq), key))
            else:
                self._park((now, next(seq), key))
            if not pod.unschedulable:
                self.api.set_pod_status(
                    key,
                    {
                        "phase": "Pending",
                        "conditions": [
                            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
                        ],
                    },
                )
        self.attempts += attempts
        if self.active:
            raise AssertionError("Scheduler.run: bind queued pods while the queue drained")

    def _choose(self, pod: PodInfo) -> str | None:
        index = self.api.index
        best: list[str] = []
        best_score = -math.inf
        for name in sorted(index.nodes):
            info = index.nodes[name]
            gpu = info.gpu
            if gpu is None or not pod_fits_node(pod.obj, info.obj):
                continue
            usage = index.usage(name)
            if self.dra is not None:
                if pod.slices and self.dra.fit(name, pod.slices) is None:
                    continue
            elif any(
                info.allocatable.get(r, 0) - usage.slices.get(r, 0) < k
                for r, k in pod.slices.items()
            ):
                continue
            if usage.cpu_milli + pod.cpu_milli > gpu.cpu_milli:
                continue
            if usage.memory_mib + pod.memory_mib > gpu.memory_mib:
                continue
            score = resource_score(
                gpu.cpu_milli,
                gpu.memory_mib,
                usage.cpu_milli,
                usage.memory_mib,
                pod.cpu_milli,
                pod.memory_mib,
            )
            if score > best_score:
                best, best_score = [name], score
            elif score == best_score:
                best.append(name)
        if not best:
            return None
        return best[0] if len(best) == 1 else self.rng.choice(best)


# --------------------------------------------------------------------------- kubelet


@dataclass(slots=True)
class Kubelet:
    """Node status sync and device admission for every node (module docstring)."""

    fake: FakeCluster
    api: SimApi
    period_s: float = 10.0
    phases: dict[str, float] = field(default_factory=dict)
    rejected: int = 0
    down: set[str] = field(default_factory=set)
    """Nodes whose device plugin is gone: the kubelet marked its devices unhealthy (allocatable
    0 from the next status sync) and every Allocate fails, so admission rejects."""

    @classmethod
    def create(
        cls, fake: FakeCluster, api: SimApi, rng: random.Random, period_s: float = 10.0
    ) -> Kubelet:
        phases = {name: rng.uniform(0, period_s) for name in sorted(fake.nodes)}
        return cls(fake, api, period_s, phases)

    def next_sync(self, node: str, t: float) -> float:
        """The node's first status sync at or after ``t``."""
        phase = self.phases.get(node, 0.0)
        k = math.ceil((t - phase) / self.period_s - 1e-9)
        return phase + max(0, k) * self.period_s

    def sync(self, node: str) -> set[str]:
        """Post the node's allocatable devices; returns the resources that grew."""
        if node in self.down:
            return self.api.set_allocatable(node, {})
        return self.api.set_allocatable(node, self.fake.advertised(node))

    def rejection(self, node: str, pod: PodInfo) -> dict[str, Any]:
        """The status the kubelet gives a pod :meth:`admit` refused (its admission failure)."""
        if node in self.down:
            resource = min(pod.slices)
            return {
                "phase": "Failed",
                "reason": "UnexpectedAdmissionError",
                "message": f"Allocate failed due to no healthy devices present; cannot "
                f"allocate unhealthy devices {resource}, which is unexpected",
            }
        refused = self.refusal(node, pod)
        if refused is not None:
            return {
                "phase": "Failed",
                "reason": "UnexpectedAdmissionError",
                "message": f"Allocate failed due to rpc error: code = InvalidArgument desc = "
                f"{refused}, which is unexpected",
            }
        short = next(
            (r for r, k in sorted(pod.slices.items()) if len(self.fake.free_devices(node, r)) < k),
            min(pod.slices),
        )
        return {
            "phase": "Failed",
            "reason": f"OutOf{short}",
            "message": f"Node didn't have enough resource: {short}, requested: {pod.slices[short]}",
        }

    def admit(self, node: str, pod: PodInfo) -> list[tuple[int, Device]] | None:
        """The devices the kubelet allocates to ``pod`` (None: not enough, the device plugin
        is gone, or its ``Allocate`` refuses the devices picked: pod rejected)."""
        if node in self.down and pod.slices:
            return None
        picks = self._pick(node, pod)
        if picks is None or _allocate_error(self.fake.nodes[node], picks) is not None:
            return None
        return [p for _, p in picks]

    def refusal(self, node: str, pod: PodInfo) -> str | None:
        """The error the node agent's ``Allocate`` answers for the devices the kubelet picks
        for ``pod`` on ``node`` (module docstring); ``None`` when it serves them, or when
        there are not enough free devices or the plugin is gone (no ``Allocate`` is made).
        Only a change of the node's free devices (or of the GPUs it drains) lifts a refusal."""
        if node in self.down:
            return None
        picks = self._pick(node, pod)
        return None if picks is None else _allocate_error(self.fake.nodes[node], picks)

    def _pick(self, node: str, pod: PodInfo) -> list[tuple[str, tuple[int, Device]]] | None:
        """(resource, (GPU index, device)) per unit, each resource's devices as the agent's
        preferred allocation picks them among the free ones; None if some are short."""
        avoid = self.api.draining_gpus(node)
        picks: list[tuple[str, tuple[int, Device]]] = []
        for resource in sorted(pod.slices):
            free = self.fake.free_devices(node, resource)
            ids = {f"{gi}:{d.device_id}": (gi, d) for gi, d in free}
            # grouped as the agent groups them: by GPU, an MPS slice by its daemon (a hybrid
            # slice's host instance); a group on a drained GPU is avoided
            groups = {dev: _daemon_group(pick) for dev, pick in ids.items()}
            chosen = preferred_allocation(
                sorted(ids),
                [],
                pod.slices[resource],
                groups.__getitem__,
                (lambda group: int(group.split(" ", 1)[0]) in avoid) if avoid else None,
            )
            if len(chosen) < pod.slices[resource]:
                return None
            picks.extend((resource, ids[c]) for c in chosen)
        return picks


def _daemon_group(pick: tuple[int, Device]) -> str:
    """The preferred-allocation group of a device, as the agent's ``prefer`` forms it: its GPU,
    and for an MPS slice inside a hybrid host instance that instance's daemon."""
    gi, d = pick
    return f"{gi} host{d.host}" if d.host >= 0 else str(gi)


def _allocate_error(node: FakeNode, picks: Sequence[tuple[str, tuple[int, Device]]]) -> str | None:
    """What the node agent's ``Allocate`` answers for ``picks``, one request per resource (its
    resource plugin in :mod:`node_agent.deviceplugin` answers with
    :func:`~node_agent.devices.container_env` and :func:`~node_agent.devices.container_mounts`
    of the advertised devices, ``INVALID_ARGUMENT`` when they raise): the first refusal's
    message, or ``None`` when every request is served.

    The devices are built by the agent's own :func:`~node_agent.devices.advertised_devices`
    from an actual state listing the picked devices alone (a device's ``Allocate`` env and
    mounts depend on itself only: its GPU or host instance, its daemon's pipe, its memory
    and thread %), with stand-in UUIDs unique on the node; every GPU of a hybrid node runs a
    daemon per MIG instance (the agent's hybrid GPUs)."""
    mig: dict[int, dict[int, ActualMigInstance]] = {}
    mps: dict[int, list[ActualMpsSlice]] = {}
    wanted: dict[str, list[str]] = {}
    gpus = {g.index: g for g in node.gpus}
    for resource, (gi, d) in picks:
        if d.host >= 0:  # a slice inside a hybrid host instance
            host_uuid = f"MIG-{gi}-{d.host}"
            host = mig.setdefault(gi, {}).get(d.host)
            if host is None:
                profile = next(
                    x.profile for x in gpus[gi].devices if x.host < 0 and x.slot == d.host
                )
                host = ActualMigInstance(profile=profile, start=d.host, deviceId=host_uuid)
                mig[gi][d.host] = host
            dev_id = mps_slice_id(host_uuid, d.slot, d.memory_mib, d.thread_percentage)
            host.mps.append(
                ActualMpsSlice(
                    memoryMiB=d.memory_mib,
                    activeThreadPercentage=d.thread_percentage,
                    deviceId=dev_id,
                )
            )
        elif d.profile:  # a MIG instance
            dev_id = f"MIG-{gi}-{d.slot}"
            mig.setdefault(gi, {})[d.slot] = ActualMigInstance(
                profile=d.profile, start=d.slot, deviceId=dev_id
            )
        else:  # an MPS slice of a whole GPU
            dev_id = mps_slice_id(f"GPU-{gi}", d.slot, d.memory_mib, d.thread_percentage)
            mps.setdefault(gi, []).append(
                ActualMpsSlice(
                    memoryMiB=d.memory_mib,
                    activeThreadPercentage=d.thread_percentage,
                    deviceId=dev_id,
                )
            )
        wanted.setdefault(resource, []).append(dev_id)
    actual = [
        ActualGpu(
            index=gi,
            uuid=f"GPU-{gi}",
            migEnabled=node.mode is not Mode.MPS,
            mig=sorted(mig.get(gi, {}).values(), key=lambda m: m.start),
            mps=mps.get(gi, []),
        )
        for gi in sorted(set(mig) | set(mps))
    ]
    hybrid = set(gpus) if node.mode is Mode.HYBRID else set()
    advertised = advertised_devices(actual, mps_pipe_root=MPS_PIPE_ROOT, hybrid_gpus=hybrid)
    for resource, dev_ids in sorted(wanted.items()):
        by_id = {d.id: d for d in advertised.get(resource, ())}
        devices = [by_id[i] for i in dev_ids]
        refusal = more_than_one_mps_slice(resource, devices)  # the agent's own rule
        if refusal is not None:
            return refusal
        try:
            container_env(devices)
            container_mounts(devices)
        except ValueError as err:
            return str(err)
    return None
