"""The time-replay protocol: a discrete-event simulation of gpuslice on a trace over time.

Model
-----
Pods (:class:`ReplayPod`) arrive at their creation time and, once bound, run for their trace
lifetime ``deletion - creation`` (at least 1 s), then depart.  Times are divided by
``time_compression``; ``copies > 1`` overlays that many copies of the trace, copy ``i > 0``
shifted by a seeded uniform offset and wrapped around the trace span (so the load density is
multiplied, for clusters larger than the trace's).  CPU-only pods are left out.

Fractional GPU requests become slices with a :mod:`simulations.inputs.mapping` rule
(``settings.mapping``; default :func:`default_mapping`: ``mig-compute`` when every node is MIG
(the smallest profile whose compute covers ``gpu_milli * 7 / 1000``), ``mps-memory`` when every
node is MPS, and ``hybrid-threshold:500`` when some node is hybrid or MIG and MPS nodes are
mixed: shares of at least 500 milli and whole GPUs get a whole MIG instance, smaller shares an
MPS slice, which a hybrid node makes inside a MIG instance).

Several GPU models and modes
----------------------------
Every node has its own catalog model and mode.  A pod's request is one set of Kubernetes
resource names, the same whatever node it lands on, so a trace pod is mapped *once*, for the
cluster's *reference model* (:func:`reference_model`: the model with the most GPUs, ties by
name; among MIG-capable models in MIG/hybrid mode when the rule can give MIG profiles).  The
request then means what the resource name means on each node: ``nvidia.com/mig-3g.40gb`` is a
3g.40gb instance of whichever model advertises that name, and a node whose model has no such
profile (an A100-40GB names its 3-slice profile ``3g.20gb``) or whose mode serves the other kind
never advertises it, so the pod cannot go there (:func:`serves`).  On the mixed cluster the
benchmark runs (A100-SXM4-80GB and H100-80GB) every profile name and every MPS size exists on
both models (the same grid, 79 GiB offered to MPS slices on each), so every pod may run on
either model.  A request no node advertises is an error naming the pods.  Pods that name their
slices (:mod:`simulations.inputs.workload_slices`) keep them; on a mixed or hybrid cluster they are
checked the same way.  The allocation metric of a cluster with several models or modes is the
mean over GPUs of each GPU's used fraction (:meth:`FakeCluster.gpu_fraction_used`).

Hybrid nodes
------------
The fake agent models MPS slices inside MIG instances as the node agent does
(:mod:`simulations.replay.fake_cluster`): a host instance is advertised only as its slices, a bound
slice pins its instance, and the status the agent reports lists each host's slices with their
``used`` flags (``ActualMigInstance.mps``), which is what the partitioner's ledger reads.

The cluster is Kubernetes as :mod:`simulations.replay.kube` models it, and nothing more: an API store
with the API server's pod rules and the partitioner's admission webhook (when the policy gates
pods), kube-scheduler's queue and default scoring (it knows no plan: it binds whichever pod it
tries first to whatever the node advertises), the kubelet's 10 s node-status sync and device
admission through the node agent's preferred allocation.  The node agents are
:class:`~simulations.replay.fake_cluster.FakeCluster`: a written spec withdraws the devices it removes
at once and is applied ``apply_delay_s`` later; the agent reports its NodePartitioning status
then and at every resync (``agent_resync_s``), so ``used`` flags lag as in production.

The partitioner is the real decision step (:func:`partitioner.decide.decide`) on the real
:class:`~partitioner.index.ClusterIndex`, run ``react_s`` after its last step once anything
it reads changed elsewhere, one cycle (``cycle_s``) after its own writes, and at its
time-based decisions (batch window, retries, deadlines, drains), as the operator's loop runs
it; its actions go through the API store (a refused patch is refused).  Planning takes no
simulated time; its wall time is recorded.  A policy with ``reservation`` gates pods at admission and
reserves and releases them (:mod:`partitioner.decide`); without it (nos's behaviour, the
``greedy`` baseline) pods are never gated.  Static policies set every GPU's layout once before
the first pod and never plan.

Recorded: pending time per pod (arrival to first binding, plus waits after a disruption),
GPUs reconfigured, disruptions (a spec removing a device a pod holds: must stay 0), *theft*
(a slice made or reserved for one pod bound by another, leaving the node none to give it:
``_Engine._account_theft``), kubelet admission rejections (the scheduler acted on a stale
allocatable, or the device plugin's ``Allocate`` refused MPS slices of two daemons,
:class:`~simulations.replay.kube.Kubelet`; the pod's controller creates it again and its wait
goes on), scheduling attempts and refused API requests.  A pod the kubelet refuses is bound,
then ``Failed`` with the kubelet's admission reason (``OutOf<resource>``, or
``UnexpectedAdmissionError`` when the device plugin is gone or refuses), and replaced by its
controller ``recreate_delay_s`` plus the Job controller's backoff later (10 s doubling per
failed pod of the Job, at most 10 min: ``ReplaySettings.job_backoff_s``; the failed pod is
deleted then, since the replay reuses its name).

DRA mode
--------
Policy ``dra`` replays the DRA agent as it is built (docs/operations.md, "DRA mode"): no
partitioner; every node publishes every MIG placement of every GPU (the production
ResourceSlices); a pod's mapped request stands for a ResourceClaim, which kube-scheduler
allocates first-fit over the published devices and their counters when it schedules the pod
(:mod:`simulations.replay.dra`); the kubelet then prepares the claim and the agent creates the
instances, taking ``apply_delay_s`` (the time an applied spec takes in the other policies),
after which the pod runs; when it ends, unprepare destroys them.  Its pending time runs from
arrival to the end of prepare; each prepare and each unprepare counts as a reconfiguration of
the GPUs it touches; nothing is ever disrupted or stolen (an allocation is the pod's own).

Policy ``dra-shaped`` is DRA mode with planner-shaped publishing (issue 15 item 3): nodes are
labelled ``gpuslice.io/partitioning=dra``, each pod names a ResourceClaim of DeviceClass
``mig.gpuslice.io`` with a profile selector (no extended resources), and the partitioner is the
real decision step with reservations: the webhook gates pods naming claims, the index reads
their claims as demand (:mod:`partitioner.claims`), plans are written as specs of the DRA
nodes, the DRA agent creates the spec's instances, publishes them and reports the spec
applied ``apply_delay_s`` later (as the device-plugin agent applies a spec), and a released
pod's claim is allocated first-fit among the published placements of its node
(:mod:`simulations.replay.dra`, "Planner-shaped publishing").  Prepare adopts the instance
(no wait); one it must create (a device allocated from an older generation) takes
``apply_delay_s``.

Agent outages
-------------
``settings.outages`` (:class:`AgentOutage`; ``bench_replay --agent-outage NODE:START:END``) stop
a node's agent for a while, as a crash loop, an eviction or a failed rollout does, to ask what
an outage costs and to test that every promise still arrives or is re-planned.  While the agent
is down it applies nothing (a spec written before or during the outage waits; the agent applies
the spec it finds when it starts, ``apply_delay_s`` later) and reports no status (the partitioner
keeps reading the last one); its device plugin is gone, so the kubelet marks the plugin's
devices unhealthy at once (its ListAndWatch stream ended): allocatable 0 at the node's next
status sync (the capacity stays for the kubelet's five-minute ``endpointStopGracePeriod``, which
nothing here reads), and every Allocate fails, so a slice pod bound there before kube-scheduler
sees the new allocatable is rejected (``UnexpectedAdmissionError``; the pod's controller creates
it again, as for a stale allocatable).  Pods running there keep running and end on time.  When
the agent starts it reports at once and its plugin registers again (allocatable back at the
next status sync).  Nothing tells the partitioner the agent is down but what production shows
it: allocatable that lists none of the slices the agent's last status shows, a spec that is not
applied, a released pod that the kubelet refuses or that does not bind, and the agent's
heartbeat Lease.  A pod released there before the outage is pinned to the node: the partitioner
evicts it once it has been stranded ``recreate_stranded_s`` (every trace pod has a Job as its
controller), and the Job creates it again after ``recreate_delay_s`` and its backoff; its wait
goes on.

A DRA node's agent (policy ``dra-shaped``; ``dra``, publishing everything, has no partitioner
and refuses outages) is the node's DRA kubelet plugin, so while it is down the kubelet, as its
source does (shared/facts/dra.md; kuberuntime_manager ``SyncPod`` prepares a pod's claims
before it makes the sandbox, ``SyncTerminatingPod`` unprepares them before the pod may end):
deletes the node's ResourceSlices :data:`~simulations.replay.dra.DRA_SLICE_WIPE_S` after the
stop (nothing more is allocated there; allocated claims keep their devices); cannot prepare
the claim of a pod bound there meanwhile (bound in those 30 s, before the slices went): the
pod stays ``Pending`` with no sandbox, and the partitioner strands it once it finds the agent
silent and evicts it after ``recreate_stranded_s``; and cannot unprepare the claim of a pod
whose containers ended: the pod stays bound and holds its devices.  When the agent is back it
publishes what it published before (a spec written meanwhile is published by its own round),
the ended pods end and the bound ones are prepared and start.

``settings.partitioner_outages`` stop the partitioner itself: no decision step runs, and its
webhook is down with it, so pods created meanwhile are not gated (``failurePolicy: Ignore``):
kube-scheduler tries them as it does without gpuslice.  At the end of an outage the partitioner
restarts from the API objects alone (a fresh :class:`~partitioner.decide.ControllerState`:
batch window, Events, cool-downs forgotten; reservations are on the pods).

The replay stops when no arrival, departure, spec application or status sync is left and
nothing has progressed for longer than any retry, window or deadline could take (progress: a
bind, a partitioner write, an arrival, a departure, an applied spec, an agent or partitioner
restart: ``_Engine._quiet``).  Pods still pending then are *never scheduled*; with
``max_pending_s`` a pod gives up after waiting that long.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any

from partitioner.actions import (
    NODE_CONDITION,
    EmitEvent,
    EvictPod,
    MarkCooldown,
    PatchPod,
    SetNodeCondition,
    WriteReservations,
    WriteSpec,
)
from partitioner.batching import BatchPolicy, forget
from partitioner.claims import DRIVER, MIG_CLASS
from partitioner.decide import ControllerState, DecideConfig, decide
from partitioner.index import ClusterIndex
from partitioner.reservations import State
from partitioner.snapshot import COOLDOWN_ANNOTATION, DRA_VALUE, cooldown_annotation
from planner.catalog import Catalog, CatalogError, GpuModel, default_catalog
from planner.settings import PlannerSettings, Policy
from planner.snapshot import (
    Mode,
    Plan,
    PlannedGpu,
    PlannedSlice,
    Snapshot,
    mig_profile_of,
    mps_gb_of,
)
from simulations.inputs.cluster import Cluster
from simulations.inputs.mapping import MappingError, make_mapping
from simulations.inputs.workload import Pod, Workload
from simulations.inputs.workload_slices import SliceRequestError, direct_requests
from simulations.replay.dra import DRA_SLICE_WIPE_S, DraPools, PublishedDevice
from simulations.replay.fake_cluster import (
    ApplyResult,
    Device,
    FakeCluster,
    FakeClusterError,
    FakeGpu,
    FakeNode,
)
from simulations.replay.kube import Conflict, Invalid, Kubelet, Scheduler, SimApi
from simulations.replay.metrics import (
    LayoutChange,
    PlanRecord,
    PodRecord,
    ReplayResult,
    request_shape,
)
from simulations.replay.static_layouts import StaticPolicy, assign_static, static_policy

__all__ = [
    "NOS_WINDOW",
    "PlanFn",
    "ReplayError",
    "ReplayPod",
    "ReplayPolicy",
    "ReplaySettings",
    "build_fake_cluster",
    "cluster_kinds",
    "cluster_replay_pods",
    "default_mapping",
    "no_preemption_warning",
    "parse_policy",
    "reference_model",
    "replay_pods",
    "run_time_replay",
]

PlanFn = Callable[[Snapshot, PlannerSettings, Catalog], Plan]
NOS_WINDOW = (60.0, 10.0)
"""nos's batch window: 60 s timeout, 10 s idle."""
MIB_PER_GIB = 1024
HYBRID_THRESHOLD = 500
"""Default mapping threshold on clusters with hybrid (or mixed MIG and MPS) nodes: shares of
at least this many milli, and whole GPUs, get a MIG instance; smaller ones an MPS slice (the
partitioned saturation benchmark's default too)."""
NAMESPACE = "sim"
_EPSILON = 1e-6
"""Seconds added to retry wake-ups so ``now - planned_at >= retry`` holds despite rounding."""


class ReplayError(ValueError):
    """The replay's input is unusable; the message names the object and the fix."""


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """Knobs of one replay (every field has a documented default)."""

    batch_timeout_s: float = 60.0
    """Partitioner batch window timeout (a policy's own window overrides it)."""
    batch_idle_s: float = 10.0
    """Partitioner batch window idle time (a policy's own window overrides it)."""
    batch_retry_s: float = 60.0
    """A planned but still pending pod re-enters the window after this long."""
    apply_delay_s: float = 5.0
    """Seconds from a spec being written to the node agent having applied it (DRA mode: a
    prepare that creates a MIG instance takes as long; with planner-shaped publishing the
    agent creates the spec's instances, then publishes them, in this time)."""
    time_compression: float = 1.0
    """Trace times are divided by this factor."""
    copies: int = 1
    """Overlaid copies of the trace (see the module docstring)."""
    seed: int = 0
    """Seeds every random choice of the replay, each from its own stream: the copies' offsets,
    kube-scheduler's tie-breaks between equally scored nodes (as the real one picks at random)
    and the phase of each node's kubelet status sync.  A replay is deterministic for a seed."""
    mapping: str | None = None
    """A :func:`simulations.inputs.mapping.make_mapping` rule; ``None``: ``mig-compute`` on MIG and
    hybrid nodes, ``mps-memory`` on MPS nodes."""
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    max_pending_s: float | None = None
    """A pod pending this long gives up (never scheduled); ``None``: pods wait forever."""
    horizon_s: float | None = None
    """Stop at this simulated time (pods pending then count as never scheduled); ``None``: run
    until nothing can change.  A guard for planners that keep reconfiguring (livelock)."""
    max_planner_errors: int = 20
    """Stop once the planner has failed this many times in a row and no arrival, departure or
    spec application is left to change its input (it would fail forever); the pods still pending
    count as never scheduled and :attr:`ReplayResult.planner_errors` says why."""
    cycle_s: float = 1.0
    """The partitioner's cycle (``cycle_seconds``: without changes it decides once per cycle)."""
    react_s: float | None = 0.1
    """The partitioner's ``react_seconds``: a change it reads from elsewhere (an arrival, a
    node's status, a pod bound or gone) is acted on at ``max(t, last step + react_s)``, as the
    operator's loop does (:meth:`partitioner.operator.Controller._pause`); its own writes at
    its next regular cycle.  ``None``: the loop before reactions (changes seen at the next
    multiple of ``cycle_s``), to reproduce earlier figures."""
    agent_resync_s: float = 30.0
    """The node agent's resync: how often it reports ``used`` flags without a spec change."""
    apply_deadline_s: float = 300.0
    """Partitioner setting: a node must apply a spec within this long."""
    bind_deadline_s: float = 120.0
    """Partitioner setting: a released pod should be bound within this long."""
    cooldown_s: float = 300.0
    """Partitioner setting: a node that missed an apply deadline is left out this long."""
    drain_after_s: float = 900.0
    """Partitioner setting: a gated pod no plan can place gets a drain after this long."""
    drain_fraction: float = 0.1
    """Partitioner setting: at most this fraction of GPUs frozen for drains at once."""
    drain_overtaken: int = 0
    """Partitioner setting: drain only pods this many younger slice pods have overtaken."""
    drain_queue_limit: float = 0.1
    """Partitioner setting: drains start only while at most this many slice units wait per GPU."""
    warm_share: float = 0.0
    """Partitioner setting: warm slices for requests of at least this share of the bound
    one-slice pods (0: off; :attr:`partitioner.decide.DecideConfig.warm_share`)."""
    recreate_delay_s: float = 1.0
    """A pod the kubelet rejected (stale allocatable) is created again by its controller this
    long after (the controller's reaction, scheduling and admission round trip), plus the Job
    controller's backoff (:attr:`job_backoff_s`)."""
    job_backoff_s: float = 10.0
    """The Job controller's pod failure backoff: the k-th failed (rejected or evicted) pod of
    a Job is replaced ``job_backoff_s * 2**(k-1)`` later, at most :attr:`job_backoff_max_s`
    (the Job controller's, 10 s and ``MaxJobPodFailureBackOff`` 10 min; 0: none).  The replay runs every Job to the end
    (as if its backoffLimit were high enough): a trace pod ran, so it is not dropped."""
    job_backoff_max_s: float = 600.0
    pop_from_backoff: bool = True
    """kube-scheduler pops its backoff queue when the active queue is empty
    (SchedulerPopFromBackoffQ, on by default from Kubernetes 1.33); ``False``: the older queue,
    where a requeued pod waits out its backoff (:mod:`simulations.replay.kube`)."""
    record_changes: bool = False
    """Record every GPU layout an applied spec changed, with the waiting queue at that moment
    (:attr:`ReplayResult.layout_changes`; ``bench_replay --trace-log``).  Off by default: a
    full openb replay changes a few hundred GPUs, a long one many more."""
    epoch_s: float = 1_767_225_600.0
    """Wall-clock time of simulated time 0 (2026-01-01 UTC): pod timestamps and the partitioner's
    clock are ``epoch_s + t``."""
    outages: tuple[AgentOutage, ...] = ()
    """Node agents that stop and start again (module docstring, "Agent outages")."""
    plugin_lag_s: float = 60.0
    """The partitioner's ``plugin_lag_s`` (:class:`~partitioner.decide.DecideConfig`)."""
    recreate_stranded_s: float = 600.0
    """The partitioner's ``recreate_stranded_s``: a released pod stranded this long (here: its
    node's agent down) is evicted and created again by its controller (0: never)."""
    agent_lease_s: float = 40.0
    """The agents' heartbeat Lease duration (``agent.leaseSeconds``; 0: no Lease): a stopped
    agent is silent to the partitioner this long plus ``lease_poll_s`` after it stopped."""
    lease_poll_s: float = 10.0
    """How often the partitioner lists the Leases (``lease_poll_seconds``)."""
    partitioner_outages: tuple[tuple[float, float], ...] = ()
    """``(start, end)``: the partitioner is down, then restarts (module docstring, "Agent
    outages")."""

    def __post_init__(self) -> None:
        if self.time_compression <= 0 or self.copies < 1 or self.apply_delay_s < 0:
            raise ReplayError(
                "replay settings: time_compression must be > 0, copies >= 1, apply_delay_s >= 0"
            )
        if self.agent_lease_s < 0 or self.lease_poll_s <= 0:
            raise ReplayError("replay settings: agent_lease_s must be >= 0, lease_poll_s > 0")
        if self.job_backoff_s < 0 or self.job_backoff_max_s < 0:
            raise ReplayError("replay settings: job_backoff_s and job_backoff_max_s must be >= 0")
        if self.cycle_s <= 0 or self.agent_resync_s <= 0 or self.recreate_delay_s <= 0:
            raise ReplayError(
                "replay settings: cycle_s, agent_resync_s and recreate_delay_s must be > 0"
            )
        if self.react_s is not None and not 0 <= self.react_s <= self.cycle_s:
            raise ReplayError("replay settings: react_s must be in [0, cycle_s] (or None)")
        windows = sorted(self.partitioner_outages)
        if any(not 0 <= a < b <= MAX_OUTAGE_S for a, b in windows) or any(
            b[0] < a[1] for a, b in itertools.pairwise(windows)
        ):
            raise ReplayError(
                "replay settings: partitioner outages must be (start, end) with 0 <= start < "
                f"end <= {MAX_OUTAGE_S:g}, not overlapping"
            )
        by_node: dict[str, list[AgentOutage]] = {}
        for o in self.outages:
            by_node.setdefault(o.node, []).append(o)
        for node, spans in by_node.items():
            spans.sort(key=lambda o: o.start_s)
            for a, b in itertools.pairwise(spans):
                if b.start_s < a.end_s:
                    raise ReplayError(
                        f"replay settings: agent outages of node {node} overlap "
                        f"({a.start_s:g}-{a.end_s:g} and {b.start_s:g}-{b.end_s:g})"
                    )


MAX_OUTAGE_S = 1e8
"""The latest an outage may end (about three years of simulated time): a replay runs its
periodic events through an outage, so an endless one would never finish."""


@dataclass(frozen=True, slots=True)
class AgentOutage:
    """Node ``node``'s agent is down from ``start_s`` to ``end_s`` (simulated seconds)."""

    node: str
    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if not self.node or not 0 <= self.start_s < self.end_s <= MAX_OUTAGE_S:
            raise ReplayError(
                f"agent outage {self.node!r} {self.start_s:g}-{self.end_s:g}: give a node "
                f"name and 0 <= start < end <= {MAX_OUTAGE_S:g} (seconds)"
            )

    @classmethod
    def parse(cls, text: str) -> AgentOutage:
        """``NODE:START:END`` in simulated seconds (``bench_replay --agent-outage``)."""
        node, sep, rest = text.rpartition(":")
        node, sep2, start = node.rpartition(":")
        try:
            if not (sep and sep2):
                raise ValueError(text)
            begin, end = float(start), float(rest)
        except ValueError:
            raise ReplayError(
                f"agent outage {text!r}: expected NODE:START:END in seconds, e.g. n0:3600:7200"
            ) from None
        return cls(node, begin, end)


@dataclass(frozen=True, slots=True)
class ReplayPolicy:
    """How GPUs get partitioned: a static layout, or the partitioner with a planner."""

    name: str
    static: StaticPolicy | None = None
    planner_policy: Policy = Policy.CPSAT
    window: tuple[float, float] | None = None
    """(timeout, idle) of this policy's batch window; ``None``: the settings' window."""
    planner: PlanFn | None = None
    """Planner override (tests); default ``planner.api.plan``."""
    reservation: bool = True
    """Gate pods at admission, reserve and release them (``False``: nos's behaviour)."""
    dra: bool = False
    """DRA mode (module docstring, "DRA mode"): claims are allocated first-fit by
    kube-scheduler over the published devices and instances made at prepare."""
    shaped: bool = False
    """With ``dra``: planner-shaped publishing (the partitioner plans the claims, the agents
    publish the plan); without: publish-everything and no partitioner."""


_POLICIES = {
    "cpsat": ("cpsat", Policy.CPSAT, True, None),
    "greedy": ("greedy", Policy.GREEDY, False, NOS_WINDOW),
    "nos": ("greedy", Policy.GREEDY, False, NOS_WINDOW),
    "cpsat-unreserved": ("cpsat-unreserved", Policy.CPSAT, False, None),
    "greedy-reserved": ("greedy-reserved", Policy.GREEDY, True, NOS_WINDOW),
}


def parse_policy(text: str) -> ReplayPolicy:
    """A policy by name (see :data:`_POLICIES`) or ``static:<layout>``.

    ``cpsat``: gpuslice (CP-SAT, reservations); ``greedy``: the nos-like greedy planner with
    nos's 60 s / 10 s window and no reservations (nos has none); ``cpsat-unreserved`` and
    ``greedy-reserved`` swap the reservation setting, to separate the planner's effect from the
    reservations'.
    """
    t = text.strip().lower()
    if t == "dra":
        return ReplayPolicy("dra", reservation=False, dra=True)
    if t == "dra-shaped":
        return ReplayPolicy("dra-shaped", dra=True, shaped=True)
    if t in _POLICIES:
        name, planner, reservation, window = _POLICIES[t]
        return ReplayPolicy(name, planner_policy=planner, window=window, reservation=reservation)
    if t.startswith("static:"):
        sp = static_policy(t.split(":", 1)[1])
        return ReplayPolicy(f"static:{sp.name}", static=sp, reservation=False)
    raise ReplayError(
        f"unknown replay policy {text!r}; use {', '.join(sorted(_POLICIES))}, dra, dra-shaped or "
        "static:<layout> (all-1g, balanced, all-2g, all-3g, all-7g)"
    )


# --------------------------------------------------------------------------- pods


def no_preemption_warning(priorities: Sequence[int]) -> str:
    """The warning a replay of pods of several ``priorities`` carries
    (:attr:`ReplayResult.warnings`): its kube-scheduler has no DefaultPreemption."""
    shown = ", ".join(str(p) for p in sorted(set(priorities)))
    return (
        f"pods have different priorities ({shown}): the replay's kube-scheduler does not "
        "preempt, so a higher-priority pod waits for lower-priority pods to end where "
        "production kube-scheduler would preempt them; pending times are wrong for every policy"
    )


@dataclass(frozen=True, slots=True)
class ReplayPod:
    name: str
    requests: Mapping[str, int]
    arrival: float
    duration: float
    cpu_milli: int = 0
    memory_mib: int = 0
    priority: int = 0


def replay_pods(
    workload: Workload,
    model: GpuModel,
    mode: Mode,
    settings: ReplaySettings = ReplaySettings(),
) -> list[ReplayPod]:
    """The GPU pods of ``workload`` as timed requests (module docstring), by arrival, for a
    cluster of ``model`` GPUs in ``mode``."""
    base = _gpu_pods(workload)
    if mode is Mode.HYBRID:
        return _timed(base, _map_for_kinds(base, [(model, mode)], settings), settings)
    rule = settings.mapping or ("mps-memory" if mode is Mode.MPS else "mig-compute")
    try:  # pods that name their slices are replayed with exactly those (workload_slices)
        direct = direct_requests(
            (p for p, _, _ in base), model, mode, settings.planner.mps_reserve_mib
        )
        mapping = make_mapping(rule, model)
        requests = {pod.name: mapping.map(pod) for pod, _, _ in base if pod.name not in direct}
    except (MappingError, SliceRequestError) as e:
        raise ReplayError(str(e)) from None
    want = "mps" if mode is Mode.MPS else "mig"
    for name, req in requests.items():
        if req is None or req.kind != want:
            raise ReplayError(
                f"mapping {rule!r} gives pod {name!r} {req.resource if req else 'nothing'}; "
                f"the cluster's nodes are in {mode.value} mode, choose a {want} mapping"
            )
    out = dict(direct)
    for name, req in requests.items():
        if name not in out:
            out[name] = req.as_requests()  # type: ignore[union-attr]
    return _timed(base, out, settings)


def cluster_replay_pods(
    workload: Workload, fake: FakeCluster, settings: ReplaySettings = ReplaySettings()
) -> list[ReplayPod]:
    """The GPU pods of ``workload`` as timed requests for ``fake``'s nodes, which may mix GPU
    models and modes (module docstring, "Several GPU models and modes")."""
    kinds = cluster_kinds(fake)
    base = _gpu_pods(workload)
    if len(kinds) == 1 and kinds[0][1] is not Mode.HYBRID:
        return replay_pods(workload, kinds[0][0], kinds[0][1], settings)
    return _timed(base, _map_for_kinds(base, kinds, settings), settings)


def cluster_kinds(fake: FakeCluster) -> list[tuple[GpuModel, Mode]]:
    """The (GPU model, mode) pairs of ``fake``'s nodes, most GPUs first (then model name, mode)."""
    gpus: dict[tuple[str, Mode], int] = {}
    models: dict[str, GpuModel] = {}
    for n in fake.nodes.values():
        gpus[(n.model.name, n.mode)] = gpus.get((n.model.name, n.mode), 0) + len(n.gpus)
        models[n.model.name] = n.model
    order = sorted(gpus, key=lambda k: (-gpus[k], k[0], k[1].value))
    return [(models[m], mode) for m, mode in order]


def default_mapping(kinds: Sequence[tuple[GpuModel, Mode]]) -> str:
    """``mig-compute`` if every node is MIG, ``mps-memory`` if every node is MPS, else
    ``hybrid-threshold:<HYBRID_THRESHOLD>`` (hybrid nodes, or MIG and MPS nodes mixed)."""
    modes = {mode for _, mode in kinds}
    if modes == {Mode.MIG}:
        return "mig-compute"
    if modes == {Mode.MPS}:
        return "mps-memory"
    return f"hybrid-threshold:{HYBRID_THRESHOLD}"


def reference_model(kinds: Sequence[tuple[GpuModel, Mode]], rule: str) -> GpuModel:
    """The model a mixed cluster's pods are mapped for: the one with the most GPUs (ties: by
    name), among MIG-capable models in MIG/hybrid mode when the rule can give MIG profiles."""
    if not rule.startswith("mps-"):
        mig = [m for m, mode in kinds if mode is not Mode.MPS and m.mig_capable]
        if mig:
            return mig[0]
    return kinds[0][0]


def serves(model: GpuModel, mode: Mode, resource: str, mps_reserve_mib: int) -> str | None:
    """The advertised spelling of ``resource`` on a node of ``model`` in ``mode``, or ``None``
    if such a node never advertises it (the profile is not the model's, the slice does not fit
    a GPU, or the mode serves the other kind)."""
    profile = mig_profile_of(resource)
    if profile is not None:
        if mode is Mode.MPS:
            return None
        try:
            return model.profile(profile).resource
        except CatalogError:
            return None
    gb = mps_gb_of(resource)
    if gb is None or mode is Mode.MIG:
        return None
    if mode is Mode.MPS:
        room = model.memory_mib - mps_reserve_mib
    else:  # hybrid: inside the largest instance, minus the MPS server reserve
        room = max((p.memory_mib for p in model.profiles), default=0) - mps_reserve_mib
    return resource if gb * MIB_PER_GIB <= room else None


def _map_for_kinds(
    base: Sequence[tuple[Pod, float, float]],
    kinds: Sequence[tuple[GpuModel, Mode]],
    settings: ReplaySettings,
) -> dict[str, dict[str, int]]:
    """Requests per pod for a cluster of several (model, mode) kinds (module docstring): share
    pods mapped once, for the reference model; pods naming slices keep them.  Each request must
    be advertised by at least one kind, else :class:`ReplayError` naming the pods."""
    rule = settings.mapping or default_mapping(kinds)
    reserve = settings.planner.mps_reserve_mib
    ref = reference_model(kinds, rule)
    try:
        mapping = make_mapping(rule, ref, reserve)
    except MappingError as e:
        raise ReplayError(str(e)) from None
    out: dict[str, dict[str, int]] = {}
    problems: list[str] = []
    for pod, _, _ in base:
        if pod.slices:
            wanted: dict[str, int] = {}
            for resource, count in pod.slices:
                wanted[resource] = wanted.get(resource, 0) + count
        else:
            try:
                req = mapping.map(pod)
            except MappingError as e:
                raise ReplayError(str(e)) from None
            if req is None:  # pragma: no cover - CPU-only pods are left out before
                continue
            wanted = req.as_requests()
        spelled: dict[str, int] = {}
        for resource, count in wanted.items():
            name = next(
                (x for m, mode in kinds if (x := serves(m, mode, resource, reserve)) is not None),
                None,
            )
            if name is None:
                problems.append(f"pod {pod.name!r}: {resource}")
            spelled[name or resource] = spelled.get(name or resource, 0) + count
        out[pod.name] = spelled
    if problems:
        listed = "; ".join(problems[:10])
        more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
        kinds_txt = ", ".join(f"{m.name} ({mode.value})" for m, mode in kinds)
        raise ReplayError(
            f"mapping {rule!r} (for {ref.name}) asks for resources no node of the cluster "
            f"({kinds_txt}) advertises: {listed}{more}; choose another mapping or GPU model"
        )
    return out


def _gpu_pods(workload: Workload) -> list[tuple[Pod, float, float]]:
    """(pod, creation time, lifetime) of every GPU pod (CPU-only pods are left out)."""
    base: list[tuple[Pod, float, float]] = []
    for pod in workload.pods:
        if pod.is_cpu_only:
            continue
        if pod.creation_time is None:
            raise ReplayError(
                f"workload {workload.name!r}: pod {pod.name!r} has no creation_time; the time "
                "replay needs creation and deletion times (use the saturation protocol instead)"
            )
        end = pod.deletion_time if pod.deletion_time is not None else pod.creation_time + 3600
        base.append((pod, float(pod.creation_time), float(max(1, end - pod.creation_time))))
    if not base:
        raise ReplayError(f"workload {workload.name!r} has no GPU pods to replay")
    return base


def _timed(
    base: Sequence[tuple[Pod, float, float]],
    requests: Mapping[str, Mapping[str, int]],
    settings: ReplaySettings,
) -> list[ReplayPod]:
    """Arrival and duration of every pod (and of the overlaid copies), by arrival."""
    t0 = min(t for _, t, _ in base)
    span = max(t for _, t, _ in base) - t0 + 1.0
    rng = random.Random(settings.seed)
    offsets = [0.0] + [rng.uniform(0, span) for _ in range(settings.copies - 1)]
    c = settings.time_compression
    out: list[ReplayPod] = []
    for k, offset in enumerate(offsets):
        for pod, t, duration in base:
            arrival = (t - t0 + offset) % span
            out.append(
                ReplayPod(
                    name=pod.name if settings.copies == 1 else f"{pod.name}-c{k}",
                    requests=requests[pod.name],
                    arrival=arrival / c,
                    duration=max(duration / c, 1e-3),
                    cpu_milli=pod.cpu_milli,
                    memory_mib=pod.memory_mib,
                    priority=pod.priority,
                )
            )
    out.sort(key=lambda p: (p.arrival, p.name))
    return out


# --------------------------------------------------------------------------- cluster


def build_fake_cluster(
    cluster: Cluster, catalog: Catalog | None = None, mps_reserve_mib: int = 512
) -> FakeCluster:
    """A fake cluster of ``cluster``'s GPU nodes, each with its own catalog model and mode."""
    cat = catalog or default_catalog()
    gpu_nodes = [n for n in cluster.nodes if n.gpus > 0]
    if not gpu_nodes:
        raise ReplayError(f"cluster {cluster.name!r} has no GPU nodes")
    unknown = sorted({n.model for n in gpu_nodes if n.catalog_model is None})
    if unknown:
        raise ReplayError(
            f"cluster {cluster.name!r}: GPU model(s) {', '.join(map(repr, unknown))} not in the "
            "GPU catalog; add them with a catalog override file"
        )
    nodes = [
        FakeCluster.node(
            n.name,
            cat.model(n.catalog_model),  # type: ignore[arg-type]
            n.gpus,
            n.mode,
            cpu_milli=n.cpu_milli,
            memory_mib=n.memory_mib,
            label=n.model,
        )
        for n in gpu_nodes
    ]
    try:
        return FakeCluster(nodes, mps_reserve_mib=mps_reserve_mib)
    except FakeClusterError as e:
        raise ReplayError(f"cluster {cluster.name!r}: {e}") from None


# --------------------------------------------------------------------------- engine


def replacement_delay(settings: ReplaySettings, failures: int) -> float:
    """How long after its ``failures``-th failed pod a Job's replacement exists: the
    controller's round trip (:attr:`ReplaySettings.recreate_delay_s`) plus the Job controller's
    backoff, ``job_backoff_s`` doubling per failure up to ``job_backoff_max_s``."""
    backoff = settings.job_backoff_s * 2 ** min(max(failures, 1) - 1, 30)
    return settings.recreate_delay_s + min(settings.job_backoff_max_s, backoff)


class _Kind(IntEnum):
    DEPART = 0
    APPLY = 1
    SYNC = 2
    REPORT = 3
    ABANDON = 4
    ARRIVE = 5
    RECREATE = 6
    SCHEDULE = 7
    FLUSH = 8
    TICK = 9
    AGENT_DOWN = 10
    AGENT_UP = 11
    PARTITIONER_DOWN = 12
    PARTITIONER_UP = 13
    AGENT_SILENT = 14
    AGENT_HEARD = 15
    SLICES_WIPED = 16
    RECREATE_REFUSED = 17
    """A :attr:`RECREATE` after the device plugin's ``Allocate`` refused the pod's devices
    (:meth:`simulations.replay.kube.Kubelet.refusal`): not live, since the new pod is refused
    again unless something else changes the node's free devices first."""


_LIVE = frozenset(
    {
        _Kind.DEPART,
        _Kind.APPLY,
        _Kind.ARRIVE,
        _Kind.SYNC,
        _Kind.RECREATE,
        _Kind.AGENT_DOWN,
        _Kind.AGENT_UP,
        _Kind.PARTITIONER_DOWN,
        _Kind.PARTITIONER_UP,
        _Kind.AGENT_SILENT,
        _Kind.AGENT_HEARD,
        _Kind.SLICES_WIPED,
    }
)
"""Events that change the cluster on their own (the rest only react to it)."""


def _kubelet_status(prepared: bool) -> dict[str, Any]:
    """A bound DRA pod's status as its kubelet writes it: ``Pending`` without a sandbox while
    its claim cannot be prepared, ``Running`` with ``PodReadyToStartContainers`` once it was
    (a fresh object per pod: the API objects are mutable)."""
    conditions = [{"type": "PodScheduled", "status": "True"}]
    if prepared:
        conditions.append({"type": "PodReadyToStartContainers", "status": "True"})
    return {"phase": "Running" if prepared else "Pending", "conditions": conditions}


def _claim_name(pod: str) -> str:
    return f"{pod}-gpu"


def _claim_object(pod: ReplayPod) -> dict[str, Any]:
    """The ResourceClaim a pod's slice request stands for in DRA mode: one request per MIG
    profile, of DeviceClass ``mig.gpuslice.io`` with the profile selector the docs give."""
    requests = []
    for n, (resource, k) in enumerate(sorted(pod.requests.items())):
        profile = mig_profile_of(resource)
        if profile is None:
            raise ReplayError(f"pod {pod.name}: {resource} is not a MIG profile (DRA mode)")
        expr = f'device.attributes["{DRIVER}"].profile == "{profile}"'
        requests.append(
            {
                "name": "gpu" if n == 0 else f"gpu{n}",
                "exactly": {
                    "deviceClassName": MIG_CLASS,
                    "count": k,
                    "selectors": [{"cel": {"expression": expr}}],
                },
            }
        )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": _claim_name(pod.name), "namespace": NAMESPACE},
        "spec": {"devices": {"requests": requests}},
    }


def _pod_object(pod: ReplayPod, claim: bool = False) -> dict[str, Any]:
    """The pod; with ``claim`` its slices are asked for by its ResourceClaim instead."""
    slices = {} if claim else pod.requests
    requests: dict[str, str] = {r: str(k) for r, k in slices.items()}
    if pod.cpu_milli:
        requests["cpu"] = f"{pod.cpu_milli}m"
    if pod.memory_mib:
        requests["memory"] = f"{pod.memory_mib}Mi"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod.name,
            "namespace": NAMESPACE,
            "ownerReferences": [{"kind": "Job", "name": pod.name, "controller": True}],
        },
        "spec": {
            "priority": pod.priority,
            "containers": [
                {
                    "name": "main",
                    "resources": {
                        "requests": requests,
                        "limits": {r: str(k) for r, k in slices.items()},
                    },
                }
            ],
            **(
                {"resourceClaims": [{"name": "gpu", "resourceClaimName": _claim_name(pod.name)}]}
                if claim
                else {}
            ),
        },
        "status": {"phase": "Pending"},
    }


class _Engine:
    def __init__(
        self,
        pods: Sequence[ReplayPod],
        fake: FakeCluster,
        policy: ReplayPolicy,
        settings: ReplaySettings,
        catalog: Catalog,
    ) -> None:
        self.fake, self.policy, self.settings, self.catalog = fake, policy, settings, catalog
        self.pods = {p.name: p for p in pods}
        if len(self.pods) != len(pods):
            raise ReplayError("replay pods must have unique names")
        self.result = ReplayResult(
            policy=policy.name, pods=[], start=min((p.arrival for p in pods), default=0.0)
        )
        priorities = sorted({p.priority for p in pods})
        if len(priorities) > 1:
            self.result.warnings.append(no_preemption_warning(priorities))
        self.records: dict[str, PodRecord] = {}
        self.running: dict[str, int] = {}
        """pod -> token of its departure event."""
        self.heap: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.live = 0
        self.waiting = 0
        """Pods waiting to be bound (arrived or disrupted, not bound, not abandoned)."""
        self.waiting_one_gpu = 0
        """Of those, pods asking for one slice unit (one GPU's worth or less): any idle GPU
        could serve one of them, given a new layout."""
        self.epoch = settings.epoch_s
        rng = random.Random(settings.seed)
        self.index = ClusterIndex(catalog)
        reserve = policy.static is None and policy.reservation
        self.api = SimApi(self.index, webhook=reserve, gate_claims=policy.dra and policy.shaped)
        self.scheduler = Scheduler(
            self.api, random.Random(rng.random()), pop_from_backoff=settings.pop_from_backoff
        )
        self.kubelet = Kubelet.create(fake, self.api, random.Random(rng.random()))
        self.result.status_sync = dict(self.kubelet.phases)
        self.state = ControllerState()
        self.config: DecideConfig | None = None
        self._planner_ms = 0.0
        self.tick_at: float | None = None
        self.wake_due: float | None = None
        """The partitioner's next time-based decision (its last ``Decision.next_wakeup``)."""
        self.stepped_version = -1
        """The cluster index's version the partitioner last decided on."""
        self.stepped_at = -math.inf
        """Simulated time of the partitioner's last step."""
        self.flush_at: float | None = None
        self.schedule_at: float | None = None
        self.sync_at: dict[str, float] = {}
        self.report_at: dict[str, float] = {}
        self.apply_token: dict[str, int] = {}
        self.last_progress = self.result.start
        """When something last happened that a waiting pod may bind after (:meth:`_quiet`)."""
        self.error_streak = 0
        self.expected: dict[tuple[str, str], list[str]] = {}
        """(node, resource) -> pods a slice there was made or reserved for (theft accounting)."""
        self.expected_of: dict[str, list[tuple[str, str]]] = {}
        self.robbed_of: dict[str, list[tuple[str, str]]] = {}
        """Pod -> the slots (one per unit) whose expectation another pod's bind took from it
        (:meth:`_account_theft`)."""
        self.theft = 0
        self.job_failures: dict[str, int] = {}
        """Trace pod -> its pods that failed so far (rejected at admission, evicted)."""
        self.by_size: dict[str, str] = {}
        self.uniform = fake.uniform()
        self.shaped = policy.dra and policy.shaped
        for node in fake.nodes.values():
            self.api.add_node(node, DRA_VALUE if self.shaped else None)
            self.api.add_partitioning(node)
        self.publishing: dict[str, dict[int, list[tuple[str, int]]]] = {}
        """Planner-shaped: node -> the spec its agent publishes at its next round."""
        self.dra: DraPools | None = None
        if policy.dra:
            wrong = sorted(
                n.name
                for n in fake.nodes.values()
                if n.mode is not Mode.MIG or not n.model.mig_capable
            )
            if wrong:
                raise ReplayError(
                    f"policy dra serves MIG instances through DRA: nodes {', '.join(wrong[:5])} "
                    "are not MIG nodes of a MIG-capable model"
                )
            self.dra = DraPools(fake, shaped=self.shaped, draining=self.api.draining_gpus)
            self.scheduler.dra = self.dra
        if policy.static is not None:
            gpus = [
                (n.name, g.index, n.model)
                for n in sorted(fake.nodes.values(), key=lambda n: n.name)
                for g in n.gpus
            ]
            if any(n.mode is not Mode.MIG for n in fake.nodes.values()):
                raise ReplayError(
                    f"static policy {policy.name!r} sets MIG layouts (whole instances); the "
                    "cluster has mps or hybrid nodes: use a planner policy (cpsat, greedy)"
                )
            for pg in assign_static(policy.static, gpus):
                fake.set_layout(pg.node, pg.index, pg)
        elif self.dra is None or self.shaped:  # publish-everything has no partitioner
            timeout, idle = policy.window or (settings.batch_timeout_s, settings.batch_idle_s)
            planner = policy.planner or _default_plan()
            self.config = DecideConfig(
                catalog=catalog,
                policy=BatchPolicy(timeout=timeout, idle=idle, retry=settings.batch_retry_s),
                planner_settings=replace(settings.planner, policy=policy.planner_policy),
                planner=self._timed(planner),
                reservation=policy.reservation,
                apply_deadline_s=settings.apply_deadline_s,
                bind_deadline_s=settings.bind_deadline_s,
                cooldown_s=settings.cooldown_s,
                plugin_lag_s=settings.plugin_lag_s,
                recreate_stranded_s=settings.recreate_stranded_s,
                drain_after_s=settings.drain_after_s,
                drain_fraction=settings.drain_fraction,
                drain_overtaken=settings.drain_overtaken,
                drain_queue_limit=settings.drain_queue_limit,
                warm_share=settings.warm_share,
            )
        self.down = self.kubelet.down
        """Nodes whose agent is down (:attr:`ReplaySettings.outages`): the kubelet's set of
        nodes without their device plugin, which the agent is."""
        self.deferred_apply: set[str] = set()
        """Down nodes with a spec written before or during the outage, applied at restart."""
        for o in settings.outages:
            if o.node not in fake.nodes:
                names = sorted(fake.nodes)
                raise ReplayError(
                    f"agent outage: the cluster has no node {o.node} (its nodes: "
                    f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
                )
            if self.dra is not None and not self.shaped:
                raise ReplayError(
                    "agent outages are modelled for device-plugin nodes and planner-shaped DRA "
                    "(dra-shaped); publishing everything (dra) has no partitioner to act on one"
                )
            self._push(o.start_s, _Kind.AGENT_DOWN, o.node)
            self._push(o.end_s, _Kind.AGENT_UP, o.node)
        self.silent: set[str] = set()
        """Down nodes the partitioner has found silent (their Lease not renewed)."""
        self.wipe_token: dict[str, int] = {}
        """DRA: node -> the token of the kubelet's pending deletion of its slices."""
        self.unprepared: dict[str, dict[str, tuple[list[PublishedDevice], float]]] = {}
        """DRA: down node -> pods bound there whose claims wait for the agent to prepare them
        (their devices, when they were bound)."""
        self.deferred_departs: dict[str, list[str]] = {}
        """DRA: down node -> pods whose containers ended there; the kubelet unprepares their
        claims before they may end, so they hold their devices until the agent is back."""
        self.lease_token: dict[str, int] = {}
        """Node -> the event sequence number of its agent's last stop or start (a start cancels
        the silence a stop scheduled)."""
        self.partitioner_down = False
        """The partitioner is down (:attr:`ReplaySettings.partitioner_outages`)."""
        self.webhook = self.api.webhook
        for start, end in settings.partitioner_outages:
            if self.config is None:
                raise ReplayError("partitioner outages need a policy with a partitioner")
            self._push(start, _Kind.PARTITIONER_DOWN, "")
            self._push(end, _Kind.PARTITIONER_UP, "")
        for name in fake.nodes:
            self._report(name)
            self.kubelet.sync(name)
        for p in pods:
            self._push(p.arrival, _Kind.ARRIVE, p.name)

    # ------------------------------------------------------------------ plumbing

    def _push(self, t: float, kind: _Kind, payload: str) -> None:
        self.seq += 1
        if kind in _LIVE:
            self.live += 1
        heapq.heappush(self.heap, (t, int(kind), self.seq, payload))

    def _supersede(self, tokens: dict[str, int], key: str) -> int:
        """A new token for ``key`` in ``tokens``: events of ``key`` scheduled with an older one
        are stale (:meth:`_latest` ignores them)."""
        self.seq += 1
        tokens[key] = self.seq
        return self.seq

    def _push_latest(self, tokens: dict[str, int], t: float, kind: _Kind, key: str) -> None:
        """Schedule ``kind`` for ``key`` at ``t``, superseding every such event scheduled
        before (a new spec's apply, a pod's departure, an agent's silence or renewal)."""
        token = self._supersede(tokens, key)
        self._push(t, kind, f"{token}:{key}")

    @staticmethod
    def _latest(tokens: Mapping[str, int], payload: str) -> str | None:
        """The key of an event :meth:`_push_latest` scheduled, or ``None`` if superseded."""
        token, key = payload.split(":", 1)
        return key if tokens.get(key) == int(token) else None

    def _timed(self, planner: PlanFn) -> PlanFn:
        def run(snapshot: Snapshot, settings: PlannerSettings, catalog: Catalog) -> Plan:
            t0 = time.perf_counter()
            plan = planner(snapshot, settings, catalog)
            self._planner_ms = (time.perf_counter() - t0) * 1000
            return plan

        return run

    def _key(self, name: str) -> str:
        return f"{NAMESPACE}/{name}"

    def _wake(self, attr: str, t: float, kind: _Kind) -> None:
        """Schedule one event of ``kind`` at ``t`` unless one is due earlier."""
        at = getattr(self, attr)
        if at is not None and at <= t:
            return
        setattr(self, attr, t)
        self._push(t, kind, "")

    def _dirty(self, t: float, own: bool = False) -> None:
        """Something the partitioner reads changed: it acts on it ``react_s`` after its last
        step at the earliest (its own writes: at its next regular cycle, ``cycle_s``)."""
        if self.config is None or self.partitioner_down:
            return
        cycle, react = self.settings.cycle_s, self.settings.react_s
        if react is None:
            self._wake("tick_at", (math.floor(t / cycle + 1e-9) + 1) * cycle, _Kind.TICK)
        elif own:
            self._wake("tick_at", t + cycle, _Kind.TICK)
        else:
            self._wake("tick_at", max(t, self.stepped_at + react), _Kind.TICK)

    def _silence_later(self, node: str, t: float) -> None:
        """The partitioner finds the stopped agent of ``node`` silent at its first Lease listing
        after the Lease's duration has passed since it last saw it renewed: ``agent_lease_s``
        plus ``lease_poll_s`` after ``t`` at the latest, taken as the time (nothing found
        sooner than production would)."""
        if self.settings.agent_lease_s <= 0 or self.config is None or not self.config.reservation:
            return  # no Lease, or nos's behaviour: nothing reads it
        at = t + self.settings.agent_lease_s + self.settings.lease_poll_s
        self._push_latest(self.lease_token, at, _Kind.AGENT_SILENT, node)

    def _sync_soon(self, node: str, t: float) -> None:
        at = self.kubelet.next_sync(node, t + 1e-9)
        if self.sync_at.get(node, math.inf) <= at:
            return
        self.sync_at[node] = at
        self._push(at, _Kind.SYNC, node)

    def _report_soon(self, node: str, t: float) -> None:
        """The agent's next resync reports the used flags (every ``agent_resync_s``)."""
        period = self.settings.agent_resync_s
        phase = self.kubelet.phases.get(node, 0.0) * period / max(self.kubelet.period_s, 1e-9)
        at = phase + (math.floor((t - phase) / period) + 1) * period
        if self.report_at.get(node, math.inf) <= at:
            return
        self.report_at[node] = at
        self._push(at, _Kind.REPORT, node)

    def _report(self, node: str) -> None:
        """The fake agent writes the NodePartitioning status: observed spec and actual GPUs
        (nothing while it is down)."""
        if node in self.down:
            return
        n = self.fake.nodes[node]
        np = self.api.partitionings[node]
        generation = int(np["metadata"]["generation"])
        status = np.get("status") or {}
        observed = int(status.get("observedGeneration", 0))
        if n.spec is None and node not in self.publishing:
            observed = generation
        if self.dra is not None and self.shaped:
            gpus = self.dra.status_gpus(node, len(n.gpus))
        else:
            gpus = _agent_gpus(n)
        applied = observed == generation
        self.api.patch_np_status(
            node,
            {
                "observedGeneration": observed,
                "planId": np["spec"].get("planId", "") if applied else "",
                "gpus": gpus,
                "conditions": [
                    {
                        "type": "Applied",
                        "status": "True" if applied else "False",
                        "observedGeneration": observed,
                    }
                ],
            },
        )

    def _idle_gpus(self) -> int:
        """GPUs on which nothing is bound (DRA: no claim holds a device of theirs)."""
        if self.dra is not None:
            return self.fake.gpu_count() - self.dra.busy_gpus()
        return self.fake.idle_gpus()

    def _allocation(self) -> float:
        if self.dra is not None:
            total = self.fake.total_compute()
            return self.dra.used_compute() / total if total else 0.0
        if not self.uniform:
            return self.fake.gpu_fraction_used()
        total = self.fake.total_compute()
        if total:
            return self.fake.used_compute() / total
        mps = self.fake.total_mps_mib()
        return self.fake.used_mps_mib() / mps if mps else 0.0

    # ------------------------------------------------------------------ pods

    def _create(self, name: str, t: float) -> None:
        pod = self.pods[name]
        if self.shaped:  # the pod's request is a ResourceClaim (partitioner.claims)
            self.api.create_claim(_claim_object(pod))
            self.api.create_pod(_pod_object(pod, claim=True), self.epoch + t)
        else:
            self.api.create_pod(_pod_object(pod), self.epoch + t)
        self.scheduler.add(self._key(name), t)

    def _bind_dra(self, t: float, key: str, node: str) -> bool:
        """DRA: the claim gets the allocator's devices, the pod is bound, the kubelet prepares
        the claim (the agent creates the instances, ``apply_delay_s``), then the pod runs."""
        assert self.dra is not None
        name = key[len(NAMESPACE) + 1 :]
        devices = self.dra.fit(node, self.index.pods[key].slices)
        if devices is None:  # the filter found them a moment ago: nothing changed since
            return False
        self.dra.allocate(node, name, devices)
        if not self.shaped:
            self.api.bind(key, node)
            if devices:
                self.result.reconfigurations.append((t, len({d.gpu for d in devices})))
            self._started(name, t, t + self.settings.apply_delay_s)
            return True
        self.api.allocate_claim(
            f"{NAMESPACE}/{_claim_name(name)}", node, [d.name for d in devices], DRIVER
        )
        self.api.bind(key, node)
        if node in self.down:  # the kubelet prepares the claim once the agent is back
            self.api.set_pod_status(key, _kubelet_status(prepared=False))
            self.unprepared.setdefault(node, {})[name] = (devices, t)
        else:
            self._prepare(t, name, node, devices, t)
        self._account_theft(key, node)
        self._report_soon(node, t)
        self._dirty(t)
        return True

    def _prepare(
        self, t: float, name: str, node: str, devices: list[PublishedDevice], bound: float
    ) -> None:
        """DRA, planner-shaped: the kubelet prepares the claim of ``name`` (bound at ``bound``)
        at ``t``; the agent adopts the planned instances or creates them
        (``apply_delay_s``), then the pod runs."""
        assert self.dra is not None
        created = self.dra.prepare(node, devices)
        if created:
            self.result.reconfigurations.append((t, created))
        self._started(name, bound, t + (self.settings.apply_delay_s if created else 0.0))

    def _dra_agent_back(self, t: float, node: str) -> None:
        """DRA: the agent of ``node`` is back: its plugin registers, it publishes its pool again
        (:meth:`~simulations.replay.dra.DraPools.restore`), the kubelet unprepares the claims of
        the pods whose containers ended meanwhile (they end now) and prepares those of the pods
        bound meanwhile and not evicted (they start now)."""
        assert self.dra is not None
        self._supersede(self.wipe_token, node)
        grown = self.dra.restore(node)
        for name in self.deferred_departs.pop(node, []):
            self._depart(t, name)
        for name, (devices, bound) in sorted(self.unprepared.pop(node, {}).items()):
            self.api.set_pod_status(self._key(name), _kubelet_status(prepared=True))
            self._prepare(t, name, node, devices, bound)
        if grown:
            self.scheduler.devices_published(grown, t)

    def _depart(self, t: float, name: str) -> None:
        """Pod ``name`` ends: its devices are freed (DRA: its claim unprepared, which keeps the
        spec's instances under planner-shaped publishing and destroys the others) and the pod
        goes.  Progress (:meth:`_quiet`): the waiting pods may fit now."""
        self.last_progress = t
        if self.dra is not None and self.shaped:  # unprepare keeps spec placements
            node, devices = self.dra.release(name)
            destroyed = self.dra.unprepare(node, devices)
            if destroyed:
                self.result.reconfigurations.append((t, destroyed))
            self.api.delete_claim(f"{NAMESPACE}/{_claim_name(name)}")
            self._report_soon(node, t)
        elif self.dra is not None:  # unprepare destroys the claim's instances
            _, devices = self.dra.release(name)
            if devices:
                self.result.reconfigurations.append((t, len({d.gpu for d in devices})))
        else:
            node = self.fake.bindings[name].node
            self.fake.release(name)
            self._report_soon(node, t)
        self.api.delete_pod(self._key(name))
        self.scheduler.bound_pod_deleted(t)
        self._wake("schedule_at", t, _Kind.SCHEDULE)
        self._dirty(t)

    def _started(self, name: str, bound: float, started: float) -> None:
        """Pod ``name`` was bound at ``bound`` and runs from ``started``: its wait ends then,
        and its departure is due its trace lifetime later."""
        rec = self.records[name]
        if rec.first_bound is None:
            rec.first_bound = bound
        if rec.waiting_since is not None:
            rec.pending_s += started - rec.waiting_since
            rec.waiting_since = None
            self.waiting -= 1
            self.waiting_one_gpu -= _one_gpu(rec.requests)
        self._push_latest(self.running, started + self.pods[name].duration, _Kind.DEPART, name)
        self.last_progress = bound

    def _bind(self, t: float, key: str, node: str) -> bool:
        """kube-scheduler bound ``key`` to ``node``: kubelet admission, then the pod runs."""
        if self.dra is not None:
            return self._bind_dra(t, key, node)
        name = key[len(NAMESPACE) + 1 :]
        info = self.index.pods[key]
        picks = self.kubelet.admit(node, info)
        if picks is None:  # stale allocatable, no device plugin, or Allocate refused: it fails
            self.kubelet.rejected += 1
            self.result.admission_rejections += 1
            refused = self.kubelet.refusal(node, info) is not None
            self.api.bind(key, node)
            self.api.set_pod_status(key, self.kubelet.rejection(node, info))
            self._unexpect(key)
            again = _Kind.RECREATE_REFUSED if refused else _Kind.RECREATE
            self._push(t + self._replaced_after(name), again, name)
            self._dirty(t)
            return True
        pod = self.pods[name]
        self.fake.bind_devices(name, node, picks, pod.cpu_milli, pod.memory_mib)
        self.api.bind(key, node)
        self._started(name, t, t)
        self._account_theft(key, node)
        self._report_soon(node, t)
        self._dirty(t)
        return True

    def _expect(self, key: str, node: str, units: Mapping[str, int]) -> None:
        self._unexpect(key)
        slots = [(node, r) for r, k in sorted(units.items()) for _ in range(k)]
        for slot in slots:
            self.expected.setdefault(slot, []).append(key)
        self.expected_of[key] = slots

    def _unexpect(self, key: str) -> None:
        self.robbed_of.pop(key, None)
        for slot in self.expected_of.pop(key, ()):
            owners = self.expected.get(slot)
            if owners is not None and key in owners:
                owners.remove(key)

    def _account_theft(self, key: str, node: str) -> None:
        """Count the theft in pod ``key``'s bind on ``node``: *a slice made or reserved for
        one pod bound by another*, where the other pod is left without one.

        Devices of one resource on one node are interchangeable to the pods asking for it, so
        theft is counted per (node, resource) *slot*, after the bind: *demand* is the units
        expected there for the other pods (:meth:`_expect`: what a written spec was made for,
        or what is reserved), *supply* the devices of the resource there that are still to be
        had: free and advertised, plus those the node's spec in flight will create
        (:meth:`_theft_supply`).  The bind takes ``excess`` units beyond what was expected
        for ``key`` itself there (and beyond what was stolen from ``key`` there before); its
        theft is how far supply now falls short of demand, at most ``excess``.  A pod binding a
        pre-existing free device while the new one made for another pod still goes to that pod
        steals nothing.

        Which of the expecting pods goes without is only known later, so the shortfall's
        expectations are dropped, oldest first, and those pods marked *robbed* of the slot
        (:attr:`robbed_of`): a robbed pod binding there after all takes back what was stolen
        from it (no new theft; the shortfall passes to the next expecting pod), and one that
        binds elsewhere, is planned again or goes, leaves the theft counted once.  ``key``'s
        own expectations and marks are dropped."""
        mine = self.expected_of.get(key, [])
        robbed = self.robbed_of.get(key, [])
        info = self.index.pods[key]
        for resource, k in info.slices.items():
            slot = (node, resource)
            own = min(k, mine.count(slot))
            owed = min(k - own, robbed.count(slot))
            excess = k - own - owed
            owners = [o for o in self.expected.get(slot, ()) if o != key]
            if own == k or not owners:
                continue
            short = len(owners) - self._theft_supply(node, resource)
            if short <= 0:
                continue
            self.theft += min(excess, max(0, short - owed))
            for victim in owners[: min(short, owed + excess)]:
                self.expected[slot].remove(victim)
                self.expected_of[victim].remove(slot)
                self.robbed_of.setdefault(victim, []).append(slot)
        self._unexpect(key)

    def _theft_supply(self, node: str, resource: str) -> int:
        """Devices of ``resource`` on ``node`` still to be had by pods expecting them
        (:meth:`_account_theft`): device plugin, the free advertised ones plus those the spec
        in flight creates; DRA (planner-shaped), the placements of the node's spec (the one
        its agent publishes next, else the published one) that no claim holds and that fit
        beside the allocated devices and each other."""
        if self.dra is None:
            return self.fake.free_on(node, resource) + self.fake.to_create(node, resource)
        pool = self.dra.pools[node]
        pending = self.publishing.get(node)
        if pending is None:
            names = pool.spec
        else:
            names = {
                d.name
                for d in pool.devices
                if d.profile is not None and (d.profile, d.start) in pending.get(d.gpu, ())
            }
        used = dict(pool.used)
        supply = 0
        for d in pool.devices:
            if d.resource != resource or d.name not in names or d.name in pool.held:
                continue
            if all(used.get((d.gpu, c), 0) + v <= pool.capacity[(d.gpu, c)] for c, v in d.consumes):
                for c, v in d.consumes:
                    used[(d.gpu, c)] = used.get((d.gpu, c), 0) + v
                supply += 1
        return supply

    # ------------------------------------------------------------------ partitioner

    def _step(self, t: float) -> None:
        assert self.config is not None
        decision = decide(self.state, self.index, self.epoch + t, self.config)
        self.stepped_version = self.index.version
        self.stepped_at = t
        self.result.partitioner_steps += 1
        self.state = decision.state
        failed_specs: set[str] = set()
        progress = False
        for action in decision.actions:
            if isinstance(action, WriteSpec):
                if not self._write_spec(t, action):
                    failed_specs.add(action.node)
                    self.state = replace(
                        self.state, window=forget(self.state.window, action.planned_pods)
                    )
                else:
                    progress = True
            elif isinstance(action, PatchPod):
                if action.after_spec is not None and action.after_spec in failed_specs:
                    continue
                if self._patch_pod(t, action):
                    progress = True
            elif isinstance(action, WriteReservations):
                self.api.patch_np_status(
                    action.node,
                    {"reservations": [e.model_dump(mode="json") for e in action.reservations]},
                )
                if self.dra is not None:  # the DRA agent withholds draining GPUs' free devices
                    self.dra.pools[action.node].fits.clear()
            elif isinstance(action, MarkCooldown):
                self.api.annotate_np(
                    action.node,
                    COOLDOWN_ANNOTATION,
                    None
                    if action.until is None
                    else cooldown_annotation(action.until, action.reason),
                )
            elif isinstance(action, EmitEvent):
                self.result.events[action.reason] = self.result.events.get(action.reason, 0) + 1
            elif isinstance(action, EvictPod):
                self._evict(t, action)
            elif isinstance(action, SetNodeCondition):  # written, so asked for once per change
                key = f"NodeCondition/{action.reason}"
                self.result.events[key] = self.result.events.get(key, 0) + 1
                self.api.set_node_condition(
                    action.node,
                    {
                        "type": NODE_CONDITION,
                        "status": action.status,
                        "reason": action.reason,
                        "message": action.message,
                    },
                )
        if decision.error:
            self.result.planner_errors.append(f"t={t:.1f}: {decision.error}")
            self.error_streak += 1
        if decision.plan is not None:
            self.error_streak = 0
            plan = decision.plan
            if not self.config.reservation:
                written = {a.node for a in decision.actions if isinstance(a, WriteSpec)}
                for key, a in plan.assignments.items():
                    if a.node in written - failed_specs:
                        self._expect(key, a.node, {r: len(g) for r, g in a.gpus.items()})
            reused = bool(decision.counts.get("plans_reused"))
            self.result.plans.append(
                PlanRecord(
                    time=t,
                    batch=len(decision.batch),
                    planner_ms=0.0 if reused else self._planner_ms,
                    placed=len(plan.assignments),
                    unplaced=len(plan.unplaced),
                    gpus_reconfigured=decision.gpus_reconfigured,
                    reused=reused,
                )
            )
        if progress:
            self.last_progress = t
        self._schedule_next(t, decision.next_wakeup)
        if self.index.version != self.stepped_version:
            # The step's own writes changed what it reads (a reservation, a spec): the operator
            # sees them as watch events and steps again at its next cycle (a reservation made
            # by a plan on a free slice is released there).
            self._dirty(t, own=True)

    def _record_changes(self, t: float, res: ApplyResult) -> None:
        waiting = Counter(request_shape(p.slices) for p in self.index.waiting() if p.slices)
        queue = dict(sorted(waiting.items()))
        for c in res.changes:
            self.result.layout_changes.append(
                LayoutChange(t, res.node, c.gpu, c.before, c.after, queue)
            )

    def _write_spec(self, t: float, action: WriteSpec) -> bool:
        node = self.fake.nodes.get(action.node)
        if node is None or node.spec is not None:
            self.result.spec_conflicts += 1
            return False
        try:
            self.api.write_spec(
                action.node,
                action.spec.model_dump(mode="json"),
                action.resource_version,
                action.planned_pods,
                action.planned_at,
            )
        except Conflict:
            self.result.spec_conflicts += 1
            return False
        for ev in action.on_success:
            self.result.events[ev.reason] = self.result.events.get(ev.reason, 0) + 1
        if self.shaped:  # the DRA agent publishes it at its next round
            self.publishing[action.node] = {
                g.index: [(m.profile, m.start) for m in g.mig] for g in action.spec.gpus
            }
            at = t + self.settings.apply_delay_s
            self._push_latest(self.apply_token, at, _Kind.APPLY, action.node)
            return True
        apply_at = t + self.settings.apply_delay_s
        self.fake.write_spec(action.node, _planned(action.node, action.spec, node), apply_at)
        self._push_latest(self.apply_token, apply_at, _Kind.APPLY, action.node)
        self._report(action.node)  # the agent's first pass: observed, devices withdrawn
        self._sync_soon(action.node, t)
        return True

    def _patch_pod(self, t: float, action: PatchPod) -> bool:
        try:
            self.api.patch_pod(action.pod, action.patch)
        except (Conflict, Invalid, KeyError):
            return False
        for ev in action.on_success:
            self.result.events[ev.reason] = self.result.events.get(ev.reason, 0) + 1
        info = self.index.pods.get(action.pod)
        if (
            info is not None
            and info.reservation is not None
            and info.reservation.state
            in (
                State.PLANNED,
                State.RELEASED,
            )
        ):
            self._expect(action.pod, info.reservation.node, info.reservation.units())
        else:  # no promise left (an unreserve, or a patch that took one in), or a drain
            self._unexpect(action.pod)
        if action.purpose in ("release", "ungate"):
            self.scheduler.updated(action.pod, t)
            self._wake("schedule_at", t, _Kind.SCHEDULE)
        return action.purpose in ("release", "reserve")

    def _evict(self, t: float, action: EvictPod) -> None:
        """The partitioner evicted a stranded pod: it is deleted, and its controller (each
        trace pod stands for a Job's) creates it again after ``recreate_delay_s`` and its
        backoff (:meth:`_replaced_after`), gated and
        planned afresh; its wait goes on."""
        if not self.api.evict_pod(action.pod, action.ref.uid, action.resource_version):
            return
        for ev in action.on_success:
            self.result.events[ev.reason] = self.result.events.get(ev.reason, 0) + 1
        self.scheduler.forget(action.pod)
        self._unexpect(action.pod)
        name = action.pod[len(NAMESPACE) + 1 :]
        for pending in self.unprepared.values():  # bound, never prepared: its claim goes too
            if pending.pop(name, None) is not None and self.dra is not None:
                self.dra.release(name)
                self.api.delete_claim(f"{NAMESPACE}/{_claim_name(name)}")
                self.scheduler.bound_pod_deleted(t)
        self._push(t + self._replaced_after(name), _Kind.RECREATE, name)
        self._dirty(t)

    def _replaced_after(self, name: str) -> float:
        """One more pod of trace pod ``name``'s Job failed: how long until the Job controller's
        replacement exists (:attr:`ReplaySettings.job_backoff_s`)."""
        k = self.job_failures[name] = self.job_failures.get(name, 0) + 1
        return replacement_delay(self.settings, k)

    def _schedule_next(self, t: float, at: float | None) -> None:
        """Wake the partitioner at its next time-based decision (``Decision.next_wakeup``)."""
        if at is None:
            self.wake_due = None
            return
        cycle = self.settings.cycle_s
        when = max(math.ceil((at - self.epoch) / cycle - 1e-9) * cycle, t + cycle)
        self.wake_due = when
        self._wake("tick_at", when, _Kind.TICK)

    # ------------------------------------------------------------------ events

    def _handle(self, t: float, kind: _Kind, payload: str) -> None:
        if kind is _Kind.ARRIVE:
            pod = self.pods[payload]
            self.records[payload] = PodRecord(payload, t, dict(pod.requests), waiting_since=t)
            self.waiting += 1
            self.waiting_one_gpu += _one_gpu(pod.requests)
            self._create(payload, t)
            self.last_progress = t  # a new pod: it may fit
            if self.settings.max_pending_s is not None:
                self._push(t + self.settings.max_pending_s, _Kind.ABANDON, payload)
            self._wake("schedule_at", t, _Kind.SCHEDULE)
            self._dirty(t)
        elif kind in (_Kind.RECREATE, _Kind.RECREATE_REFUSED):
            # the failed (or evicted) pod goes (its name is reused)
            if self.records[payload].abandoned:
                return
            self.api.delete_pod(self._key(payload))
            self._create(payload, t)
            if kind is _Kind.RECREATE:  # a new pod: it may fit (a refused one is refused again)
                self.last_progress = t
            self._wake("schedule_at", t, _Kind.SCHEDULE)
            self._dirty(t)
        elif kind is _Kind.DEPART:
            name = self._latest(self.running, payload)
            if name is None:
                return
            del self.running[name]
            if self.dra is not None and self.shaped:
                node = self.dra.claims[name][0]
                if node in self.down:  # the kubelet unprepares before the pod may end
                    self.deferred_departs.setdefault(node, []).append(name)
                    return
            self._depart(t, name)
        elif kind is _Kind.APPLY:
            latest = self._latest(self.apply_token, payload)
            if latest is None:
                return
            node = latest
            if node in self.down:  # applied when the agent starts again
                self.deferred_apply.add(node)
                return
            self.last_progress = t  # new devices: the waiting pods may fit
            if self.dra is not None and self.shaped:
                destroyed, grown = self.dra.publish(node, self.publishing.pop(node))
                if destroyed:
                    self.result.reconfigurations.append((t, destroyed))
                self._report(node)
                self.scheduler.devices_published(grown, t)
                self._wake("schedule_at", t, _Kind.SCHEDULE)
                self._dirty(t)
                return
            res = self.fake.apply_spec(node)
            if res.gpus_changed:
                self.result.reconfigurations.append((t, res.gpus_changed))
                if self.settings.record_changes:
                    self._record_changes(t, res)
            for victim in res.disrupted:
                self.result.disruptions += 1
                self.records[victim].disruptions += 1
                self.records[victim].waiting_since = t
                self.waiting += 1
                self.waiting_one_gpu += _one_gpu(self.records[victim].requests)
                self.running.pop(victim, None)
                self.api.delete_pod(self._key(victim))
                self._create(victim, t)
            self._report(node)
            self._sync_soon(node, t)
            self._dirty(t)
        elif kind is _Kind.SYNC:
            if self.sync_at.get(payload) == t:
                del self.sync_at[payload]
            grew = self.kubelet.sync(payload)
            if grew:
                self.scheduler.allocatable_grew(payload, grew, t)
                self._wake("schedule_at", t, _Kind.SCHEDULE)
            self._dirty(t)
        elif kind is _Kind.REPORT:
            if self.report_at.get(payload) == t:
                del self.report_at[payload]
            self._report(payload)
            self._dirty(t)
        elif kind is _Kind.ABANDON:
            key = self._key(payload)
            info = self.index.pods.get(key)
            rec = self.records[payload]
            if info is not None and info.waiting and rec.waiting_since is not None:
                rec.pending_s += t - rec.waiting_since
                rec.waiting_since = None
                self.waiting -= 1
                self.waiting_one_gpu -= _one_gpu(rec.requests)
                rec.abandoned = True
                self.api.delete_pod(key)
                self.scheduler.forget(key)
                self._unexpect(key)
                self._dirty(t)
        elif kind is _Kind.SCHEDULE:
            if self.schedule_at is not None and self.schedule_at <= t:
                self.schedule_at = None
        elif kind is _Kind.FLUSH:
            if self.flush_at is not None and self.flush_at <= t:
                self.flush_at = None
            self.scheduler.flush(t)
        elif kind is _Kind.AGENT_DOWN:
            # The plugin's stream ends: its devices are unhealthy (allocatable 0 at the next
            # status sync) and every Allocate fails, so pods bound there meanwhile are rejected.
            self.down.add(payload)
            self._sync_soon(payload, t)
            self._silence_later(payload, t)
            if self.dra is not None:  # the kubelet deletes the slices of a plugin gone 30 s
                at = t + DRA_SLICE_WIPE_S
                self._push_latest(self.wipe_token, at, _Kind.SLICES_WIPED, payload)
        elif kind is _Kind.SLICES_WIPED:
            wiped = self._latest(self.wipe_token, payload)
            if wiped is not None and wiped in self.down and self.dra is not None:
                self.dra.wipe(wiped)
        elif kind in (_Kind.AGENT_SILENT, _Kind.AGENT_HEARD):
            latest = self._latest(self.lease_token, payload)
            silent = kind is _Kind.AGENT_SILENT
            if latest is not None and (latest in self.down if silent else latest in self.silent):
                (self.silent.add if silent else self.silent.discard)(latest)
                self.index.set_silent_agents(frozenset(self.silent))
                self._dirty(t)
        elif kind is _Kind.AGENT_UP:
            self.down.discard(payload)
            if payload in self.silent:  # seen renewing at the partitioner's next listing
                at = t + self.settings.lease_poll_s
                self._push_latest(self.lease_token, at, _Kind.AGENT_HEARD, payload)
            else:  # its first renewal: no silence pending
                self._supersede(self.lease_token, payload)
            if payload in self.deferred_apply:  # the agent applies the spec it finds
                self.deferred_apply.discard(payload)
                at = t + self.settings.apply_delay_s
                self._push_latest(self.apply_token, at, _Kind.APPLY, payload)
            if self.dra is not None:
                self._dra_agent_back(t, payload)
            self._report(payload)  # its first pass, and the plugin registers again
            self._sync_soon(payload, t)
            self.last_progress = t  # what waited may move now: the run is not over
            self._dirty(t)
        elif kind is _Kind.PARTITIONER_DOWN:  # its webhook too: failurePolicy Ignore
            self.partitioner_down = True
            self.api.webhook = False
        elif kind is _Kind.PARTITIONER_UP:  # a restart: nothing kept but the API objects
            self.partitioner_down = False
            self.api.webhook = self.webhook
            self.state = ControllerState()
            self.stepped_version = -1
            self.wake_due = None
            self.last_progress = t  # what waited may move now: the run is not over
            # a restarted partitioner has seen no Lease yet: a silent agent is found again a
            # whole Lease duration after its first listing
            self.silent.clear()
            self.index.set_silent_agents(frozenset())
            for node in sorted(self.down):
                self._silence_later(node, t)
            self._dirty(t)
        elif kind is _Kind.TICK and self.partitioner_down:
            self.tick_at = None
        elif kind is _Kind.TICK and self.tick_at is not None and self.tick_at <= t:
            self.tick_at = None
            due = self.wake_due is not None and self.wake_due <= t + _EPSILON
            if not due and self.index.version == self.stepped_version:
                # Nothing the partitioner reads changed since its last step and no time-based
                # decision is due: the step would decide exactly what it decided then.
                if self.wake_due is not None:
                    self._wake("tick_at", self.wake_due, _Kind.TICK)
                return
            self._step(t)

    def _run_scheduler(self, t: float) -> None:
        self.scheduler.run(t, lambda key, node: self._bind(t, key, node))
        nxt = self.scheduler.next_event()
        if nxt is not None:
            self._wake("schedule_at", max(nxt, t + _EPSILON), _Kind.SCHEDULE)
        flush = self.scheduler.next_flush(t)
        if flush is not None:
            self._wake("flush_at", max(flush, t + _EPSILON), _Kind.FLUSH)

    def _quiet(self, t: float) -> bool:
        """Nothing can change any more: no live event, and no pod waiting or no progress for a
        long while (longer than any retry, window or deadline of the partitioner could take).

        Progress (:attr:`last_progress`) is a bind, a spec written or a pod patched by the
        partitioner, and every event that may let a waiting pod in: an arrival or a
        re-created pod (not one the device plugin refused: it is refused again), a departure,
        an applied spec, an agent or the partitioner starting again.  What follows them (the
        agent's status report, the kubelet's sync, the partitioner's steps and the
        scheduler's retries) then has that long to bind a pod."""
        if self.live > 0:
            return False
        if self.waiting == 0 or self.config is None:
            return True
        if self.error_streak >= self.settings.max_planner_errors:
            return True
        settle = (
            self.config.policy.retry
            + self.config.policy.timeout
            + self.config.apply_deadline_s
            + self.config.bind_deadline_s
            + self.config.drain_after_s
            + 60.0
        )
        return t - self.last_progress > settle

    def run(self) -> ReplayResult:
        wall0 = time.perf_counter()
        self.result.allocation.append((self.result.start, self._allocation()))
        t = self.result.start
        idle = 0  # GPUs with nothing bound, counted only while some pod waits (below)
        while self.heap:
            t_next = self.heap[0][0]
            if self._quiet(t_next):
                break
            if self.settings.horizon_s is not None and t_next > self.settings.horizon_s:
                break
            if self.waiting > 0:  # the state since t held until t_next
                self.result.waiting_span_s += t_next - t
                self.result.idle_gpu_s_waiting += (t_next - t) * idle
                if self.waiting_one_gpu > 0:
                    self.result.one_gpu_waiting_span_s += t_next - t
                    self.result.idle_gpu_s_one_gpu_waiting += (t_next - t) * idle
            t = t_next
            tick = False
            while self.heap and self.heap[0][0] == t:
                _, kind, _, payload = heapq.heappop(self.heap)
                k = _Kind(kind)
                if k in _LIVE:
                    self.live -= 1
                if k is _Kind.TICK:
                    tick = True
                    continue
                self._handle(t, k, payload)
            self._run_scheduler(t)
            if tick:
                self._handle(t, _Kind.TICK, "")
                self._run_scheduler(t)
            alloc = self._allocation()
            if alloc != self.result.allocation[-1][1]:
                self.result.allocation.append((t, alloc))
            idle = self._idle_gpus() if self.waiting > 0 else 0
        self.result.end = max(t, self.result.start)
        for rec in self.records.values():
            if rec.waiting_since is not None:
                rec.pending_s += self.result.end - rec.waiting_since
                rec.waiting_since = None
        self.result.pods = list(self.records.values())
        self.result.theft = self.theft
        self.result.scheduling_attempts = self.scheduler.attempts
        self.result.api_refusals = dict(self.api.refused)
        self.result.wall_s = time.perf_counter() - wall0
        return self.result


def _one_gpu(requests: Mapping[str, int]) -> int:
    """1 if a pod with ``requests`` asks for one slice unit (any idle GPU could hold it), else 0."""
    return 1 if sum(requests.values()) == 1 else 0


def _agent_gpus(n: FakeNode) -> list[dict[str, Any]]:
    """The ``status.gpus`` the device-plugin agent reports for its node's actual devices."""
    gpus: list[dict[str, Any]] = []
    for g in n.gpus:
        if n.mode is Mode.MPS:
            gpus.append(
                {
                    "index": g.index,
                    "mps": [
                        {
                            "memoryMiB": d.memory_mib,
                            "activeThreadPercentage": d.thread_percentage,
                            "used": d.pod is not None,
                        }
                        for d in g.devices
                    ],
                }
            )
        elif n.mode is Mode.HYBRID:
            gpus.append({"index": g.index, "migEnabled": True, "mig": _hybrid_status(g)})
        else:
            gpus.append(
                {
                    "index": g.index,
                    "migEnabled": True,
                    "mig": [
                        {"profile": d.profile, "start": d.slot, "used": d.pod is not None}
                        for d in g.devices
                    ],
                }
            )
    return gpus


def _planned(node: str, spec: Any, fake: FakeNode) -> list[PlannedGpu]:
    out: list[PlannedGpu] = []
    for g in spec.gpus:
        if fake.mode is Mode.MPS:
            out.append(
                PlannedGpu(
                    node,
                    g.index,
                    mps=tuple(PlannedSlice(s.memoryMiB, s.activeThreadPercentage) for s in g.mps),
                )
            )
        else:
            hosted = tuple(
                (m.start, tuple(PlannedSlice(x.memoryMiB, x.activeThreadPercentage) for x in m.mps))
                for m in sorted(g.mig, key=lambda m: m.start)
                if m.mps
            )
            out.append(
                PlannedGpu(
                    node,
                    g.index,
                    mig=tuple((m.profile, m.start) for m in g.mig),
                    mig_mps=hosted,
                )
            )
    listed = {g.index for g in spec.gpus}
    out.extend(PlannedGpu(node, g.index) for g in fake.gpus if g.index not in listed)
    return out


def _hybrid_status(g: FakeGpu) -> list[dict[str, Any]]:
    """A hybrid GPU's instances as the agent reports them: a host lists its slices and is used
    while one of them is (a used slice pins its instance)."""
    slices: dict[int, list[Device]] = {}
    for d in g.devices:
        if d.host >= 0:
            slices.setdefault(d.host, []).append(d)
    out: list[dict[str, Any]] = []
    for d in g.devices:
        if d.host >= 0:
            continue
        entry: dict[str, Any] = {"profile": d.profile, "start": d.slot}
        hosted = slices.get(d.slot, [])
        if hosted:
            entry["used"] = any(x.pod is not None for x in hosted)
            entry["mps"] = [
                {
                    "memoryMiB": x.memory_mib,
                    "activeThreadPercentage": x.thread_percentage,
                    "used": x.pod is not None,
                }
                for x in hosted
            ]
        else:
            entry["used"] = d.pod is not None
        out.append(entry)
    return out


def _default_plan() -> PlanFn:
    from planner.api import plan

    fn: PlanFn = plan
    return fn


def run_time_replay(
    workload: Workload,
    cluster: Cluster | FakeCluster,
    policy: ReplayPolicy | str,
    settings: ReplaySettings = ReplaySettings(),
    catalog: Catalog | None = None,
    pods: Sequence[ReplayPod] | None = None,
) -> ReplayResult:
    """Replay ``workload`` on ``cluster`` under ``policy`` (module docstring).

    ``cluster`` is a :class:`~simulations.inputs.cluster.Cluster` (each GPU node with its own model and
    mode) or a ready :class:`FakeCluster` (used as is, and changed).  ``pods`` overrides the pods derived
    from ``workload`` (already mapped and timed).
    """
    cat = catalog or default_catalog()
    pol = parse_policy(policy) if isinstance(policy, str) else policy
    fake = (
        cluster
        if isinstance(cluster, FakeCluster)
        else build_fake_cluster(cluster, cat, settings.planner.mps_reserve_mib)
    )
    if pods is None:
        pods = cluster_replay_pods(workload, fake, settings)
    return _Engine(pods, fake, pol, settings, cat).run()
