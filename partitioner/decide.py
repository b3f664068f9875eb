"""THE decision step: ``decide(state, cluster, now, config) -> Decision``. Pure and synchronous.

The kopf operator calls it every cycle with its :class:`~partitioner.index.ClusterIndex`; the
simulator calls it with the index of its in-memory cluster.  It reads nothing else and changes
nothing: every effect is an :mod:`action <partitioner.actions>` in the returned
:class:`Decision`, with the next :class:`ControllerState`.  ``now`` is seconds since the epoch
(reservation deadlines are stored on the pods in that clock).

Plans are promises (``config.reservation``, the default)
---------------------------------------------------------
Pods that ask for a slice are created *gated* (:mod:`partitioner.gating`): kube-scheduler
ignores them until gpuslice releases them, so nothing else can give their slice away.  One
step:

1. **Housekeeping** and **node conditions**: a NodePartitioning for every valid opted-in node,
   none for others; ``GpusliceReady`` on opted-in nodes (as before).
2. **Read the waiting pods** (slice pods not bound): gated pods without a reservation are
   *candidates*; gated pods with a ``planned`` reservation and released pods not bound yet
   *hold* slices on their node (:class:`~partitioner.ledger.Hold`); ``draining`` pods are
   candidates that freeze GPUs; ungated pods kube-scheduler could not place
   (``PodScheduled=False/Unschedulable``: created while the webhook was down, or opted out) are
   candidates too, planned as before but never released (they have no gate).  A gated pod
   gpuslice can never place on its nodes as they are (no opted-in node of the right kind
   matches it, no such node's GPU has its profile, or it asks for what gpuslice nodes never
   advertise) loses the gate with an ``Ungated`` Event once it has existed for a batch
   window, unless an opted-in node whose GPU labels cannot be read yet matches it
   (:meth:`_Step._give_back`).
3. **Deadlines.**  A ``planned`` reservation on a node that has not applied its spec by the
   reservation's deadline (``apply_deadline_s``), or whose node is gone, is dropped: the pod
   goes back to the batch, the node cools down for ``cooldown_s`` (left out of plans) and both
   get an Event.  A node that applied less than promised (``Degraded``, or a slice taken by a
   pod gpuslice did not gate) keeps the holds that still fit (released first, then priority,
   then age) and gives the others back at once (:meth:`~partitioner.ledger.NodeLedger.settle`);
   a released pod whose slice was taken is re-planned on its node (its node affinity is pinned
   there).  A ``planned`` pod whose node no longer accepts it (cordoned, tainted, relabelled)
   is given back before it is released there, and planned elsewhere.  A released pod that
   cannot bind where it is pinned (its node is gone or no longer accepts it; or is unserved,
   below) is ``Stranded``: a pod a controller owns is evicted once that has lasted
   ``recreate_stranded_s``, so its controller creates it again and the new pod is planned
   afresh (:meth:`_Step._stranded`); the Event names the controller and when.  In DRA mode so
   is a claim pod bound to a silent agent's node before it started, or bound where the agent
   reports that its claim's prepare fails (:meth:`_Step.strand_unprepared`).  A pod
   released to a node whose kubelet then refused it at admission (``UnexpectedAdmissionError``:
   the device plugin is gone or its devices unhealthy; ``OutOf<resource>``) shows the node
   cannot give what its status promises: the node cools down at once (``AdmissionRejected`` on
   the failed pod and the node) and its ``planned`` pods are planned elsewhere, instead of more
   pods being released there to fail in turn (:meth:`_Step.notice_rejections`).  A node whose
   kubelet lists none of a slice resource bound pods hold, or for ``plugin_lag_s`` none of the
   slices its agent reports, has lost its device plugin: no new promise there while it lasts
   (``DevicePluginGone``), and once it has lasted ``plugin_lag_s`` its ``planned`` pods are
   planned elsewhere and its released ones are stranded (:meth:`_Step.notice_unserved`).  A
   pod given back and reserved, released or ungated again in the same step gets one patch
   (:meth:`_Step._patch`).
4. **Release.**  A ``planned`` pod whose slice exists (the node applied) is released once the
   node's ``status.allocatable`` shows room for it beyond the bound and released pods (else
   kube-scheduler would fail it): one patch narrows its node affinity to the node, removes the
   gate and marks the reservation ``released`` with a bind deadline (``bind_deadline_s``).
5. **Free slices first.**  A candidate for which a free, unpromised slice exists on an eligible
   node is reserved there at once and released in the same patch when the scheduler can see
   it (no batch, no plan); the busiest GPU's slice is taken, so lightly used GPUs stay whole.
   In a shallow queue, oldest first across shapes: once a one-GPU pod that has waited past
   the first waiting tier finds no free slice, the free slices of its eligible nodes are kept
   from younger pods this step, so the next plan can repartition them for it (else every freed
   7g instance would go to the next 7g pod and a waiting 4g pod would get a GPU only from a
   drain).  In a deep queue (more slice units waiting than ``drain_queue_limit`` per GPU, as
   for drains, step 8) throughput comes first: smallest pods first (fewest units, then
   oldest), and a kept slice idles until the next plan, so only pods past the last waiting
   tier (8 h by default) go ahead of the others (oldest first), and the oldest such one-GPU
   pod per request keeps the free slices of one node (the most idle compute) for the next
   plan; in a queue that lasts, no shape starves behind the rest (README design notes, "Deep
   queue: throughput first, then age").
6. **Drain completion.**  A ``draining`` pod whose frozen GPUs are empty is planned onto them
   (a one-pod plan on those GPUs only) and reserved.
7. **Batch and plan** the remaining candidates (:mod:`partitioner.batching`): the planner sees
   the nodes that are not applying a spec and not cooling down, with every slice a hold or an
   unreported bound pod may use pinned and frozen GPUs left out (:mod:`partitioner.ledger`),
   and each pod's waiting time (the objective's waiting-time level).  Changed nodes get a spec
   (resourceVersion-guarded); each placed pod gets a ``planned`` reservation written after its
   node's spec; unplaced pods get ``cannot place: <reason>``.  A batch no pod of which could
   get its units on any plannable node (the batch's bound, :class:`_UnitBounds`: a full
   cluster with free slices nobody waiting can use) goes to the planner's greedy pass, not to
   CP-SAT: the plan places nothing and changes nothing either way, with the same reasons.
7b. **Preemption.**  A gated pod the plan could not place for lack of capacity, for which
   bound pods of lower priority hold the slices it asks for on a node it may use, loses its
   gate (``Preempting`` Event) so that kube-scheduler preempts them, as it would for the pod
   without gpuslice; a pod kube-scheduler nominated for a node keeps its units there from
   every reservation and plan until it binds (:meth:`_Step.preempt`).
7c. **Scale-up** (``scale_up_after_s``, off by default).  A gated pod without a reservation
   that the plan could not place for lack of capacity and that has waited that long loses its
   gate (``ReleasedForScaleUp`` Event), so kube-scheduler marks it unschedulable and the
   cluster autoscaler can add a node for it (:meth:`_Step.scale_up`).
8. **Drain.**  A gated pod the plan could not place for lack of capacity that has waited
   ``drain_after_s`` gets a drain (:mod:`partitioner.drain`) while the cluster's drain budget
   (``drain_fraction`` of the GPUs) has room, unless freezing its GPUs would take devices
   that holds on the node count on (it waits until they are bound or given back); with
   ``drain_overtaken`` = K > 0 only once K younger slice pods are bound (it is being
   overtaken, not merely waiting in a queue that everyone waits in: in deep overload drains
   were most of the reconfigurations).  No drain
   starts while more slice units wait than ``drain_queue_limit`` per GPU of the cluster (and
   more than one): that queue is overload, where pods are served smallest-first as capacity
   frees, those past ``aged_after_s`` (8 h) first (step 5), and a frozen GPU's free slices
   would idle while younger pods could use them (openb replays, README design notes, "No
   drain in a deep queue").  A deep queue that has lasted a batch window, counted beyond what
   the free slices serve, also *ends* the drains in progress (the pods stay candidates, each
   gets a ``ReservationDropped`` Event, and may be drained again once the queue is short): a
   frozen GPU that has emptied idles until the rest of its set does (in the openb default
   replay at 5 nodes one 4-GPU pod's drain kept 2-4 emptied GPUs idle for about 50 hours
   while up to 42 whole-GPU pods waited); a burst the next plan serves does not.  A drain
   yields to a waiting pod of higher priority that may use its node, and one whose GPUs the
   node no longer has, or whose emptied GPUs its pod cannot use now, is dropped.  A pod that
   alone makes the queue deep is told ``NotDrained``.
9. **Status view.**  Each node's ``status.reservations`` is rewritten when the promises on it
   changed.
10. **Warm slices** (``warm_share`` > 0, off by default).  When no pod is a candidate, no
    batch was planned and no node is applying a spec, a request that at least ``warm_share``
    of the bound one-slice pods hold and of which no free, unpromised slice is left gets one:
    a one-node plan for a stand-in pod on the busiest node that could hold it, with every
    device on that node kept (a warm slice never replaces a free one), never on a node where
    nothing is in use; at most one spec per step (:meth:`_Step.warm_slices`; measured in
    ``simulations/results/warm-2026-11-28/``).

Without reservations (``config.reservation=False``; nos's behaviour, the baseline) pods are
not gated (a gated pod, e.g. one gated while reservations were on, is ungated at once, also
one gpuslice cannot place: :meth:`_Step._give_back`), the partitioner plans the pods kube-scheduler
reported ``Unschedulable``, and kube-scheduler binds whichever pending pod it tries first to
new slices.  A node applying a spec keeps the pods planned for it (annotation
``gpuslice.io/planned-pods``) out of new batches until it applies, or until
``apply_deadline_s`` after the spec was written (annotation ``gpuslice.io/planned-at``); then
they are planned again elsewhere and the node cools down.

Plan ids are consecutive integers, continuing after the largest ``spec.planId`` in the cluster.
A planner exception is reported in ``Decision.error`` and closes the window (its pods are
retried after ``retry`` seconds), so a bad input cannot make the controller spin.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from contract.dra_devices import placement_device_name
from contract.nodepartitioning import (
    DesiredGpu,
    DesiredMigInstance,
    DesiredMpsSlice,
    NodePartitioning,
    NodePartitioningSpec,
    ReservationEntry,
)
from contract.quantity import ascii_count
from partitioner.actions import (
    NODE_CONDITION,
    Action,
    CreatePartitioning,
    DeletePartitioning,
    EmitEvent,
    EvictPod,
    MarkCooldown,
    ObjectRef,
    PatchPod,
    SetNodeCondition,
    WriteReservations,
    WriteSpec,
)
from partitioner.batching import BatchPolicy, BatchWindow, due, next_deadline, observe, planned
from partitioner.claims import failed_claims
from partitioner.drain import choose_drain, drain_budget
from partitioner.eligibility import paused_why, pod_fits_node
from partitioner.gating import release_patch, ungate_patch
from partitioner.index import ClusterIndex, NodeInfo, PodInfo
from partitioner.ledger import GpuSlots, Hold, NodeLedger, build_ledgers
from partitioner.mps_target import learned_mps_shapes
from partitioner.optout import node_lifecycle
from partitioner.rejection import PausedNode, paused_fit, reject_reason
from partitioner.reservations import RESERVATION_ANNOTATION, Reservation, State
from partitioner.snapshot import (
    COOLDOWN_ANNOTATION,
    PLANNED_AT_ANNOTATION,
    ClusterView,
    NodeProblem,
    cooldown_of,
    invalid_partitioning_message,
    no_eligible_notes,
    opted_in,
    planned_pods,
)
from planner.catalog import Catalog, CatalogError, GpuModel
from planner.settings import PlannerSettings, Policy
from planner.snapshot import (
    Assignment,
    Mode,
    NodeState,
    PendingPod,
    Plan,
    PlannedGpu,
    Snapshot,
    Unplaced,
    mig_profile_of,
    mps_gb_of,
)

__all__ = [
    "ControllerState",
    "DecideConfig",
    "Decision",
    "PlanFn",
    "decide",
    "default_planner",
    "is_busy",
    "is_degraded",
    "left_out_words",
    "missing_claims",
]

PlanFn = Callable[[Any, PlannerSettings, Catalog], Plan]
"""``plan(snapshot, settings, catalog) -> Plan``."""

MIB_PER_GIB = 1024

WARM_PREFIX = "gpuslice.io/warm:"
"""Name prefix of the stand-in pod a warm slice is planned for (never a real pod key)."""


def default_planner() -> PlanFn:
    """``planner.api.plan``: CP-SAT within the time limit, greedy as the fallback."""
    from planner.api import plan

    return plan


@dataclass(frozen=True, slots=True)
class DecideConfig:
    catalog: Catalog
    policy: BatchPolicy = field(default_factory=BatchPolicy)
    planner_settings: PlannerSettings = field(default_factory=PlannerSettings)
    planner: PlanFn = field(default_factory=default_planner)
    reservation: bool = True
    """Gate, reserve and release (module docstring); False: nos's unreserved behaviour."""
    apply_deadline_s: float = 300.0
    """A node must apply a spec within this long, else its planned pods are planned elsewhere."""
    bind_deadline_s: float = 120.0
    """A released pod should be bound within this long; then gpuslice checks why not."""
    cooldown_s: float = 300.0
    """A node that missed an apply deadline is left out of plans this long; one whose kubelet
    refused a pod released there, this long from that pod's release."""
    plugin_lag_s: float = 60.0
    """A node whose kubelet lists none of the slices its agent reports for this long has lost
    its device plugin: no promise there, its planned pods go elsewhere (:meth:`_Step.
    notice_unserved`).  Longer than the kubelet takes to list a new layout (one status sync,
    10 s by default)."""
    recreate_stranded_s: float = 600.0
    """A released pod that has been stranded this long (module docstring, step 3: its node is
    gone, no longer accepts it, or has been unserved since) is evicted if a controller owns
    it, so that the controller creates it again, gated and planned afresh.  0: never (the
    ``Stranded`` Event asks a person to delete it)."""
    drain_after_s: float = 900.0
    """A gated pod no plan can place gets a drain after waiting this long."""
    drain_fraction: float = 0.1
    """At most this fraction of the GPUs may be frozen for drains at once."""
    drain_queue_limit: float = 0.1
    """Drains start only while the slice units waiting (gated candidates) are at most this many
    per GPU of the cluster, or one unit (a lone starving pod on a small cluster).  A deeper
    queue is overload, where throughput rules: a drain idles the free slices of its GPUs until
    their last pod ends while younger pods could use them.  The same limit switches the fast
    path to smallest pods first, with only pods past ``aged_after_s`` served oldest first
    and one node's free slices kept per request (module docstring, step 5).  ``inf``: no limit
    (oldest first always)."""
    aged_after_s: float = 28800.0
    """In a deep queue (``drain_queue_limit``) a pod that has waited this long is served
    oldest first, ahead of the smaller pods, and a one-GPU one keeps one node's free slices
    for the next plan (module docstring, step 5).  8 h, the planner's fourth waiting tier
    (until 2026-12-02 its last); the tiers beyond it only order plans.  Planner tiers that end
    sooner cap it at their last one; with no tiers no pod ages."""
    drain_overtaken: int = 0
    """Drain only for a pod that at least this many younger slice pods have overtaken (bound
    now, created after it): starvation relative to the queue rather than waiting alone.  0
    (the default): every pod past ``drain_after_s`` may be drained (module docstring, step 8)."""
    preemption: bool = True
    """A gated pod that no free slice and no plan can serve, for which lower-priority pods hold
    the slices it asks for on a node it may use, loses its gate so kube-scheduler preempts
    them, as it would without gpuslice (module docstring, step 7b).  False: it waits."""
    scale_up_after_s: float = 0.0
    """A gated pod the cluster has no room for loses its gate after waiting this long, so the
    cluster autoscaler sees it unschedulable (module docstring, step 7c).  0: never."""
    claims_watched: bool = True
    """The controller lists ResourceClaims (DRA planning on: ``dra_enabled``).  Off
    (``dra.enabled=false``, or ``dra.publish=all``), a gated pod naming claims (gated before
    the switch) is given back at once: no claim is ever known, so it is no typo to wait for."""
    warm_share: float = 0.0
    """Warm slices (module docstring, step 10): while no slice pod waits and no node is applying
    a spec, keep one free slice of each request that at least this share of the bound
    one-slice pods hold, made on the busiest node with room, so the next such pod is released
    at once instead of waiting for a batch, a plan and the agent.  0: off."""
    node_lifecycle: bool = False
    """Also emit the opt-in/opt-out node writes (:func:`partitioner.optout.node_lifecycle`:
    the ``gpuslice.io/managed`` label, the ``Draining`` condition, their removal once drained).
    The controller turns this on; the replay and the planning tests, whose nodes never carry
    the label, leave it off."""

    def __post_init__(self) -> None:
        for name in (
            "apply_deadline_s",
            "bind_deadline_s",
            "cooldown_s",
            "recreate_stranded_s",
            "drain_after_s",
            "aged_after_s",
            "scale_up_after_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.drain_fraction <= 1:
            raise ValueError(f"drain_fraction must be in [0, 1], got {self.drain_fraction}")
        if not self.drain_queue_limit > 0:
            raise ValueError(f"drain_queue_limit must be > 0, got {self.drain_queue_limit}")
        if not self.drain_overtaken >= 0:
            raise ValueError(f"drain_overtaken must be >= 0, got {self.drain_overtaken}")
        if not 0 <= self.warm_share <= 1:
            raise ValueError(f"warm_share must be in [0, 1], got {self.warm_share}")


@dataclass(frozen=True, slots=True)
class ControllerState:
    window: BatchWindow = field(default_factory=BatchWindow)
    reported: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Pod -> Reason -> the last message of that reason emitted for it (emit once per change),
    with the uid of the pod told under ``#uid``; pods no longer waiting are forgotten."""
    last_plan_id: int = 0
    cooldown: Mapping[str, float] = field(default_factory=dict)
    """Node -> until when it is left out of plans (it missed an apply deadline, or its kubelet
    refused a pod released there: that end is read again from the pod on every step,
    :meth:`_Step.notice_rejections`).  Also written on the node's NodePartitioning
    (:meth:`_Step.write_cooldowns`), from which every step reads it back: a restarted
    controller or a new leader keeps it."""
    cooldown_why: Mapping[str, str] = field(default_factory=dict)
    """Node -> the Event reason that started its cool-down (written beside its end)."""
    last_plan: tuple[object, Plan] | None = None
    """The last planner input (as :attr:`_Step.plan_key`) and its plan: an identical input (nothing
    changed since, e.g. a retry of pods no GPU can hold) reuses the plan instead of solving
    again (the planner is deterministic for an input)."""
    plan_version: tuple[int, int] | None = None
    """``(identity, version)`` of the :class:`~partitioner.index.ClusterIndex` when the last
    batch was planned: while it is unchanged and ``replan_at`` has not come, planned pods are not
    retried (their plan would be the same; :mod:`partitioner.batching`)."""
    replan_at: float = math.inf
    """The earliest time at which time alone can change the last batch's plan or what follows
    it: a waiting-time tier or ``drain_after_s`` crossed by a candidate, a cooldown ending."""
    unlisted_since: Mapping[str, float] = field(default_factory=dict)
    """Node -> since when (this controller's clock) its kubelet has listed none of what its
    agent or its bound pods say it has (:meth:`_Step.notice_unserved`); a restart starts over."""
    stranded_since: Mapping[str, float] = field(default_factory=dict)
    """``<pod key>#<uid>`` -> since when (this controller's clock) that released pod has been
    stranded (:meth:`_Step._stranded`); a pod no longer stranded is forgotten, and a restart
    starts over."""
    quiet: Quiet | None = None
    """Set when the step that returned this state was a fixed point (:class:`Quiet`)."""
    deep_since: float | None = None
    """Since when (this controller's clock) the queue has been deep while drains were under
    way (:meth:`_Step._end_drains` waits a batch window of it); ``None``: it is not."""


@dataclass(frozen=True, slots=True)
class Quiet:
    """A step that changed nothing in the cluster: no action but Events, no plan, no error.
    The state it returned is then a fixed point: until the index changes or ``until`` (that
    step's ``next_wakeup``) comes, every step from it returns it unchanged and acts on nothing,
    so :func:`decide` returns it without recomputing.

    Why that holds: such a step changes only the batch window (pods seen arrive; seen again,
    they are members, not arrivals), the Events it emitted (each recorded in the state, so
    never emitted twice: :meth:`_Step.once`) and forgets Events of pods no longer waiting; a
    second step with the same index finds nothing more to change.  A step is
    a function of the index, the state, ``now`` and the configuration; with the first two
    unchanged, ``now`` matters only through the time-based
    decisions that :attr:`Decision.next_wakeup` lists (reservation deadlines, the drain wait,
    the batch window and its retries, cool-downs ending, a node's ``plugin_lag_s`` running
    out, a stranded pod's eviction), and through two that only grow
    stricter with time and so cannot turn "no action" into an action: the fast path's
    protection of free slices for pods past the first waiting tier, and a released pod past
    its bind deadline (its Event names the deadline, not the seconds since).  Without
    reservations (nos's behaviour) an apply deadline is read from the NodePartitioning's
    annotation and is not a wake-up, so that mode never goes quiet."""

    index: tuple[int, int]
    """``(identity, version)`` of the index the step read."""
    config: int
    """``id`` of the configuration it ran with."""
    until: float
    counts: Mapping[str, int]
    problems: Mapping[str, NodeProblem]


@dataclass(frozen=True, slots=True)
class Decision:
    state: ControllerState
    actions: tuple[Action, ...]
    plan: Plan | None = None
    plan_id: str = ""
    batch: tuple[str, ...] = ()
    gpus_reconfigured: int = 0
    error: str = ""
    counts: Mapping[str, int] = field(default_factory=dict)
    """waiting, candidates, held, released, draining, rejected, fast (reserved from free slices),
    releases (this step)."""
    problems: Mapping[str, NodeProblem] = field(default_factory=dict)
    """Opted-in nodes left out of planning, and why (labels, or GPUs not readable yet)."""
    snapshot: Snapshot | None = None
    """The planner's input when this step planned a batch."""
    next_wakeup: float | None = None
    """The earliest future time a time-based decision falls due with no other change (a
    deadline, a drain threshold, the batch window, a retry, a cool-down's end, a plugin lag
    running out, a stranded pod's eviction): a caller that steps on changes only (the
    simulator) steps again then."""
    warm_error: str = ""
    """A planner exception while planning a warm slice (step 10), as text.  Unlike ``error`` it
    closes no window and keeps the step quiet: warm slices are tried again once the cluster
    changes, not every cycle."""

    @property
    def waiting(self) -> int:
        return int(self.counts.get("waiting", 0))


# --------------------------------------------------------------------------- node status


def is_busy(np: NodePartitioning) -> bool:
    """The partitioner wrote a plan the agent has not applied (nor given up on) yet."""
    if not np.spec.planId or np.applied:
        return False
    generation = np.metadata.generation or 0
    observed = np.status.observedGeneration if np.status else 0
    if observed >= generation:
        return not is_degraded(np)
    return True


def is_degraded(np: NodePartitioning) -> bool:
    """The agent observed the current spec and reports it cannot apply (all of) it (an
    ``observedGeneration`` above the generation is about an earlier object of that name:
    :attr:`~contract.nodepartitioning.NodePartitioning.applied`)."""
    if np.status is None or np.status.observedGeneration != (np.metadata.generation or 0):
        return False
    degraded = np.condition("Degraded")
    return degraded is not None and degraded.status == "True"


def _spec_plan(np: NodePartitioning | None) -> str:
    """The plan id of the node's spec ("" if none)."""
    return np.spec.planId if np is not None else ""


_COOLING = {
    "ApplyDeadlineMissed": "cooling down: it did not apply its last plan in time",
    "DegradedCooldown": "cooling down: its agent refused its last plan (Degraded)",
    "AdmissionRejected": "cooling down: its kubelet refused a pod released there",
    "WriteRefused": "cooling down: the API server refused its spec (WriteRefused on its "
    "NodePartitioning: RBAC, a webhook or an admission policy)",
}
"""Why a cooling node is left out, by the reason that started its cool-down (the
``Waiting`` Event names it, so the operator looks where the cause is)."""


def _planned_at(np: NodePartitioning) -> float | None:
    raw = np.metadata.annotations.get(PLANNED_AT_ANNOTATION)
    try:
        value = float(raw) if raw is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


# --------------------------------------------------------------------------- helpers


def _pod_ref(pod: PodInfo) -> ObjectRef:
    return ObjectRef("Pod", pod.name, pod.namespace, pod.uid)


_REFUSES = "cordoned, tainted or relabelled"
"""Why a node no longer accepts a pod it accepted when the pod was planned there."""
_UNSCHEDULABLE = (
    "kube-scheduler found it unschedulable there past its bind deadline (a filter gpuslice "
    "does not model: required pod anti-affinity or affinity, topology spread, host ports, a "
    "volume's node affinity, or CPU/memory taken since its release)"
)
"""Why a released pod kube-scheduler could not bind to its one node is stranded (:meth:`_Step._hold`)."""
_ROOM = "kube-scheduler finds room for it there"
_MAX_UNITS_PER_GPU = 7
"""The most units one GPU serves one pod: seven MIG instances (an MPS pod asks for one slice)."""


@dataclass(frozen=True, slots=True)
class _CannotStart:
    """Why a pod bound to a DRA node cannot start, and what would let it (Event phrases)."""

    how: str
    recovers: str
    unless: str


_AGENT_GONE = _CannotStart(
    "the kubelet prepares its ResourceClaims through that agent",
    "it starts once the agent is back, or ",
    "unless the agent is back first, ",
)
_PREPARE_FAILS = _CannotStart(
    "the kubelet retries the prepare",
    "it starts once a retry succeeds, or ",
    "unless a retry succeeds first, ",
)


def _mark(pod: PodInfo) -> str:
    """``<pod key>#<uid>``: one pod, not a later pod of the same name (a StatefulSet's)."""
    return f"{pod.key}#{pod.uid}"


def _controller_of(pod: PodInfo) -> str | None:
    """``"<kind> <name>"`` of the controller that owns ``pod`` (the ``ownerReference`` with
    ``controller: true``), which creates it again if it is deleted; None for a pod nothing
    controls, and for a DaemonSet's (:attr:`PodInfo.daemonset`; one per node: it cannot be
    planned elsewhere)."""
    if pod.daemonset:
        return None
    for o in (pod.obj.get("metadata") or {}).get("ownerReferences") or ():
        if isinstance(o, Mapping) and o.get("controller") is True:
            return f"{o.get('kind') or ''} {o.get('name') or ''}".strip()
    return None


def _node_ref(info: NodeInfo) -> ObjectRef:
    return ObjectRef("Node", info.name, "", info.uid)


_TOLD_UID = "#uid"
"""The key under which :attr:`ControllerState.reported` keeps the uid of the pod told (no Event
reason starts with ``#``)."""


def _units(units: Mapping[str, int]) -> str:
    return ", ".join(f"{r} x{k}" if k != 1 else r for r, k in sorted(units.items()))


def _where(node: str, gpus: Mapping[str, tuple[int, ...]]) -> str:
    indices = sorted({i for g in gpus.values() for i in g})
    return f"node {node} GPU {', '.join(str(i) for i in indices)}" if indices else f"node {node}"


def _annotation(r: Reservation | None) -> dict[str, str | None]:
    return {RESERVATION_ANNOTATION: r.to_json() if r is not None else None}


def _compose(first: Mapping[str, Any], then: Mapping[str, Any]) -> dict[str, Any]:
    """One JSON merge patch doing ``first`` then ``then`` (objects merge, ``then`` wins)."""
    out = dict(first)
    for key, value in then.items():
        before = out.get(key)
        if isinstance(before, Mapping) and isinstance(value, Mapping):
            out[key] = _compose(before, value)
        else:
            out[key] = value
    return out


def _rv_patch(pod: PodInfo, annotations: Mapping[str, str | None]) -> dict[str, Any]:
    meta: dict[str, Any] = {"annotations": dict(annotations)}
    if pod.rv is not None:
        meta["resourceVersion"] = pod.rv
    return {"metadata": meta}


def left_out_words(names: Sequence[str], why: Callable[[str], str], most: int = 5) -> str:
    """``n1 (ApplyStuck), n2 (applying a previous plan) and 3 more``: the first ``most`` of
    ``names``, each with ``why`` it is left out of plans (the ``Waiting`` Event's words, and
    ``gpuslice status``'s)."""
    words = ", ".join(f"{n} ({why(n)})" for n in names[:most])
    return words + (f" and {len(names) - most} more" if len(names) > most else "")


def missing_claims(pod: Mapping[str, Any], known: Container[str]) -> str:
    """The ResourceClaims ``pod`` names that are not among the ``known`` claim keys, in words
    (the ``WaitingForClaims`` Event's, and ``gpuslice status``'s)."""
    spec = pod.get("spec") or {}
    namespace = str((pod.get("metadata") or {}).get("namespace", ""))
    made = {
        str(s.get("name"))
        for s in (pod.get("status") or {}).get("resourceClaimStatuses") or ()
        if isinstance(s, Mapping) and s.get("resourceClaimName")
    }
    words: list[str] = []
    for e in spec.get("resourceClaims") or ():
        if not isinstance(e, Mapping):
            continue
        name = e.get("resourceClaimName")
        template = e.get("resourceClaimTemplateName")
        if name and f"{namespace}/{name}" not in known:
            words.append(f"ResourceClaim {namespace}/{name}, which does not exist")
        elif template and not name and str(e.get("name")) not in made:
            words.append(
                f"the claim of ResourceClaimTemplate {namespace}/{template} (not created yet: "
                f"does the template exist?)"
            )
    return "; ".join(words) or "its ResourceClaims"


def _held_whole(ledger: NodeLedger, index: int) -> DesiredGpu | None:
    """A DRA node's GPU a claim holds whole (device ``gpu<i>`` allocated), which the plan does
    not change: no instance.  The agent reports it as one used full-size placement so that
    plans take it as used; copied into the spec, that placement became a real instance once
    the claim ended (MIG switched on, the GPU no longer published whole), and whole-GPU
    claims, which no plan serves, lost the GPU.  ``None`` elsewhere."""
    if ledger.gpu.dra and placement_device_name(index) in ledger.allocated:
        return DesiredGpu(index=index)
    return None


def _desired_now(
    np: NodePartitioning | None,
    index: int,
    mode: Mode,
    held_foreign: AbstractSet[int] = frozenset(),
) -> DesiredGpu | None:
    """The layout a GPU the plan does not change keeps: what the agent reports, else the spec.
    Devices of the other mode than the node's (left from before it was relabelled,
    :func:`~partitioner.adoption.gpus_from_status`) are not asked for: free, they are left out
    (the agent removes them); with one in use (the GPU in ``held_foreign``,
    :attr:`~partitioner.ledger.NodeLedger.foreign`) the GPU is left out of the spec (``None``:
    the agent leaves it be until its pod leaves)."""
    if np is not None and np.status is not None:
        for g in np.status.gpus:
            if g.index == index:
                hosts = mode is Mode.MIG and any(m.mps for m in g.mig)
                if (g.mig if mode is Mode.MPS else g.mps) or hosts:
                    if index in held_foreign:
                        return None
                    if mode is Mode.MPS:
                        g = g.model_copy(update={"mig": []})
                    else:  # a free host stays, as a plain instance
                        plain = [m.model_copy(update={"mps": []}) for m in g.mig]
                        g = g.model_copy(update={"mps": [], "mig": plain if hosts else g.mig})
                return DesiredGpu(
                    index=index,
                    mig=[
                        DesiredMigInstance(
                            profile=m.profile,
                            start=m.start,
                            mps=[  # hybrid: the slices the instance hosts stay
                                DesiredMpsSlice(
                                    memoryMiB=s.memoryMiB,
                                    activeThreadPercentage=s.activeThreadPercentage,
                                )
                                for s in m.mps
                            ],
                        )
                        for m in g.mig
                    ],
                    mps=[
                        DesiredMpsSlice(
                            memoryMiB=s.memoryMiB, activeThreadPercentage=s.activeThreadPercentage
                        )
                        for s in g.mps
                    ],
                )
    if np is not None:
        for d in np.spec.gpus:
            if d.index == index:
                return d
    return DesiredGpu(index=index)


def _desired_adopted(ledger: NodeLedger, index: int) -> DesiredGpu | None:
    """The spec entry of an unchanged GPU on a node whose agent has not reported: its adopted
    layout, or ``None`` when it is locked (left out of the spec, so the agent leaves it be)."""
    gpu = next((g for g in ledger.gpus if g.index == index), None)
    if gpu is None or gpu.locked:
        return None
    return DesiredGpu(
        index=index,
        mig=[
            DesiredMigInstance(profile=d.mig_profile, start=d.key)
            for d in gpu.devices
            if d.mig_profile
        ],
    )


def _desired_planned(planned_gpu: PlannedGpu) -> DesiredGpu:
    hosted = dict(planned_gpu.mig_mps)  # hybrid: the MPS slices inside each instance
    return DesiredGpu(
        index=planned_gpu.index,
        mig=[
            DesiredMigInstance(
                profile=p,
                start=s,
                mps=[
                    DesiredMpsSlice(
                        memoryMiB=x.memory_mib, activeThreadPercentage=x.thread_percentage
                    )
                    for x in hosted.get(s, ())
                ],
            )
            for p, s in sorted(planned_gpu.mig, key=lambda x: x[1])
        ],
        mps=[
            DesiredMpsSlice(memoryMiB=s.memory_mib, activeThreadPercentage=s.thread_percentage)
            for s in planned_gpu.mps
        ],
    )


def _layout_key(gpus: Iterable[DesiredGpu]) -> dict[int, tuple[Any, ...]]:
    out: dict[int, tuple[Any, ...]] = {}
    for g in gpus:
        mig = tuple(
            sorted(
                (
                    m.start,
                    m.profile,
                    *sorted((s.memoryMiB, s.activeThreadPercentage) for s in m.mps),
                )
                for m in g.mig
            )
        )
        mps = tuple(sorted((s.memoryMiB, s.activeThreadPercentage) for s in g.mps))
        if mig or mps:
            out[g.index] = (mig, mps)
    return out


def _reject_reason(
    pod: PodInfo, eligible: frozenset[str], gpu_nodes: Mapping[str, NodeInfo]
) -> str | None:
    """Why the pod can never be placed on the current nodes, or ``None``."""
    gpus = [(g.mode, g.model) for n in sorted(eligible) if (g := gpu_nodes[n].gpu) is not None]
    reason = reject_reason(pod.slices, gpus)
    if reason is not None and pod.other_requests and reason.startswith("no eligible node"):
        asked = ", ".join(f"{r}: {v}" for r, v in pod.other_requests)
        reason = reason.replace(
            "affinity and tolerations",
            f"affinity and tolerations and advertises what else it asks for ({asked})",
            1,
        )
    return reason


_COMPUTE_SLICES = 7
"""Compute slices of a whole GPU of the common MIG models (A100, H100, H200, B200)."""
_MPS_GPU_GIB = 80
"""Memory of a whole GPU of the common models, for an MPS slice's share of it."""


def _gpu_equivalents(units: Mapping[str, int]) -> float:
    """About how many whole GPUs ``units`` (resource -> units) fill: a MIG unit its compute
    slices of seven (``3g.40gb``: 3/7), an MPS unit its memory of 80 GiB, at most a GPU
    each.  A measure of queue depth, not of any node's room."""
    total = 0.0
    for resource, k in units.items():
        if k <= 0:
            continue
        profile = mig_profile_of(resource)
        if profile is not None:
            head = profile.split("g.", 1)[0]
            share = int(head) / _COMPUTE_SLICES if head.isdigit() else 1.0
        else:
            gb = mps_gb_of(resource)
            share = gb / _MPS_GPU_GIB if gb is not None else 1.0
        total += k * min(1.0, share)
    return total


def _order(pod: PodInfo) -> tuple[object, ...]:
    created = pod.created if pod.created is not None else math.inf
    return (-pod.priority, created, pod.key)


# --------------------------------------------------------------------------- the step


class _Step:
    """One decision step's working state (see the module docstring for the order)."""

    def __init__(
        self, index: ClusterIndex, state: ControllerState, now: float, config: DecideConfig
    ) -> None:
        self.index, self.state, self.now, self.config = index, state, now, config
        self.actions: list[Action] = []
        self.reported: Mapping[str, Mapping[str, str]] = state.reported
        """Pod -> reason -> last message; copied on the first change (copy on write)."""
        self._reported_own = False
        self.cooldown = {n: t for n, t in state.cooldown.items() if t > now}
        self.cooldown_why = {n: w for n, w in state.cooldown_why.items() if n in self.cooldown}
        self._recorded_cooldowns()
        self.rejecting: dict[str, str] = {}
        """Nodes whose kubelet refused a pod released there, noticed this step -> why."""
        self.rejection_marks: set[str] = set()
        """``<pod key>#<uid>`` of the refused pods still counted (:meth:`notice_rejections`):
        their ``reported`` entries are kept while they are."""
        self.gpu_nodes = index.gpu_nodes()
        self.last_id = max(state.last_plan_id, self._plan_id_floor())
        self.busy: set[str] = set()
        self.degraded: set[str] = set()
        self.invalid: dict[str, NodeProblem] = {}
        self.stuck: dict[str, NodeProblem] = {}
        """Nodes whose agent has not applied a spec past ``apply_deadline_s`` (``ApplyStuck``):
        a condition says so even when no pod was planned there (a warm slice, a mode switch)."""
        """Nodes whose NodePartitioning fails validation: left out of plans (busy), told on
        the node's condition and in an Event (:meth:`conditions`)."""
        self.candidates: dict[str, PodInfo] = {}
        self.candidate_resources: Counter[str] = Counter()
        """Units per resource the candidates ask for (kept with :attr:`candidates`)."""
        self.plannable: frozenset[str] = frozenset()
        """Nodes the batch may be planned on (set by :meth:`planning_input`)."""
        self.batched: AbstractSet[str] = frozenset()
        """Candidates the last batch held (set by :meth:`planning_input`)."""
        self.drain_room = False
        """The drain budget had room left after this step's drains (:meth:`start_drains`)."""
        self.restricted: dict[str, frozenset[str]] = {}
        """Candidate -> the only node it may be planned on (a released pod to re-plan)."""
        self.managed: set[str] = set()
        """Candidates that are gated (gpuslice releases them)."""
        self.drains: dict[str, Reservation] = {}
        self.rejected: dict[str, str] = {}
        self.write_error = ""
        """Why a node's part of this step's plan was not written (:meth:`_write_plan`)."""
        self.waiting: dict[str, str] = {}
        self.seen: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.view: dict[str, dict[str, ReservationEntry]] = {}
        self.switching: set[str] = set()
        self.ledgers: dict[str, NodeLedger] = {}
        self.unreadable: dict[str, NodeProblem] = {}
        """GPU nodes whose GPUs cannot be read yet (:mod:`partitioner.adoption`)."""
        self.unserved: dict[str, NodeProblem] = {}
        """Nodes whose kubelet lists none of a slice resource pods bound there hold, or for
        ``plugin_lag_s`` none of the slices their agent reports (their device plugin is gone,
        or registering again): no new promise there while it lasts (:meth:`notice_unserved`)."""
        self.unlisted_since: dict[str, float] = {}
        """The next :attr:`ControllerState.unlisted_since`."""
        self.stranded_since: dict[str, float] = {}
        """The next :attr:`ControllerState.stranded_since`."""
        self.plugin_lost: dict[str, str] = {}
        """Unserved nodes whose agent is silent, or whose kubelet has listed none of their
        slices for ``plugin_lag_s`` or longer -> why: their ``planned`` pods are given back
        (:meth:`_hold`)."""
        self._problem_nodes: list[dict[str, Any]] | None = None
        """Opted-in nodes whose GPU labels cannot be read (:meth:`_give_back`), once read."""
        self._paused_nodes: list[PausedNode] | None = None
        """GPU nodes cordoned or under a lifecycle taint (:meth:`_paused`), once read."""
        self._opted_in_objs: list[Mapping[str, Any]] | None = None
        """Node objects of every opted-in node, by name (:meth:`_reject`'s product hint), once
        read."""
        self.deep_since: float | None = None
        """The next :attr:`ControllerState.deep_since`."""
        self.handed_over: set[str] = set()
        """Candidates whose gate this step removed for kube-scheduler: its preemption
        (:meth:`preempt`) or the cluster autoscaler (:meth:`scale_up`)."""
        self.window: BatchWindow = state.window
        self.plan_version, self.replan_at = state.plan_version, state.replan_at
        self.last_plan = state.last_plan
        self.pods_now = [index.pods[k] for k in index.waiting_by_age()]
        """Waiting slice pods, highest priority first, then oldest (candidates keep this order)."""
        self.planned_snapshot: Snapshot | None = None
        self.plan_key: object = None
        """What the plan of :attr:`planned_snapshot` depends on (:meth:`planning_input`)."""
        self.unit_bound: _UnitBounds | None = None
        """The batch's bound on what the plannable nodes could offer (:meth:`planning_input`)."""
        self.next_wakeup: float | None = None
        self.warm_error = ""
        self._unreserving: dict[str, int] = {}
        """Pod -> where in :attr:`actions` this step's ``unreserve`` of it stands."""
        self._superseded: set[int] = set()
        """Positions in :attr:`actions` of patches a later one of the same pod took in."""
        self._rejects: dict[tuple[frozenset[str], tuple[tuple[str, int], ...]], str | None] = {}
        """(eligible nodes, slices) -> :func:`_reject_reason` (this step's nodes)."""

    # ------------------------------------------------------------------ small helpers

    def _plan_id_floor(self) -> int:
        """The largest ``spec.planId`` of ASCII digits (0 if none).  Any other id (edited by
        hand: ``²``, other scripts' digits, more than 18 digits) is left out: the next ids are
        of another form or far below it."""
        ids = [0]
        for info in self.index.partitionings.values():
            pid = ascii_count(str(((info.raw.get("spec") or {}).get("planId")) or ""))
            if pid is not None:
                ids.append(pid)
        return max(ids)

    def next_id(self) -> str:
        self.last_id += 1
        return str(self.last_id)

    def once(
        self,
        pod: PodInfo,
        reason: str,
        message: str,
        type_: Literal["Normal", "Warning"] = "Normal",
    ) -> None:
        """Emit an Event on the pod unless the same reason and message were emitted last (to
        this pod: one recreated under the same name, another uid, is told anew)."""
        have = self.told(pod)
        if have.get(reason) == message:
            return
        reported = self._own_reported()
        reported[pod.key] = {**have, reason: message, _TOLD_UID: pod.uid}
        self.actions.append(EmitEvent(_pod_ref(pod), type_, reason, message))

    def told(self, pod: PodInfo) -> Mapping[str, str]:
        """Reason -> the message last emitted to this pod (by uid; empty if none)."""
        have = self.reported.get(pod.key)
        return have if have is not None and have.get(_TOLD_UID) == pod.uid else {}

    def _own_reported(self) -> dict[str, Mapping[str, str]]:
        if not self._reported_own:
            self.reported = dict(self.reported)
            self._reported_own = True
        return self.reported  # type: ignore[return-value]  # the copy made above

    def _patch(self, action: PatchPod) -> None:
        """Queue a pod patch.  One that follows this step's ``unreserve`` of the same pod (a
        reservation given back, then the pod reserved, released or ungated again in the same
        step) takes that patch in: both carry the resourceVersion the step read, so the API
        server would refuse the second (409) and the pod would wait a cycle for nothing.  The
        merged patch keeps both Events and stands where the later one would."""
        if action.purpose == "unreserve":
            self._unreserving[action.pod] = len(self.actions)
        else:
            at = self._unreserving.pop(action.pod, None)
            if at is not None:
                first = self.actions[at]
                assert isinstance(first, PatchPod)
                self._superseded.add(at)
                action = replace(
                    action,
                    patch=_compose(first.patch, action.patch),
                    on_success=first.on_success + action.on_success,
                )
        self.actions.append(action)

    def node_event(self, node: str, reason: str, message: str) -> None:
        info = self.index.nodes.get(node)
        ref = _node_ref(info) if info is not None else ObjectRef("Node", node)
        self.actions.append(EmitEvent(ref, "Warning", reason, message))

    def note(self, pod: PodInfo, r: Reservation | None) -> None:
        """Record the pod's promise (or its absence) in the status view of its node."""
        for entries in self.view.values():
            entries.pop(pod.key, None)
        if r is not None and r.node in self.view:
            gpus = {k: list(v) for k, v in sorted(r.gpus.items())}
            self.view[r.node][pod.key] = ReservationEntry(
                pod=pod.key, state=r.state.value, gpus=gpus, plan=r.plan
            )

    def _label_problems(self) -> dict[str, NodeProblem]:
        return {
            name: info.reading
            for name, info in self.index.nodes.items()
            if isinstance(info.reading, NodeProblem)
        }

    def wake(self, at: float) -> None:
        """Note a future time-based decision (see :attr:`Decision.next_wakeup`)."""
        if self.now < at < math.inf and (self.next_wakeup is None or at < self.next_wakeup):
            self.next_wakeup = at

    def candidate(self, pod: PodInfo, managed: bool) -> None:
        if pod.key not in self.candidates:  # a dropped drain's pod is one already
            reason = self._reject(pod)
            if reason is not None:
                self.rejected[pod.key] = reason
                return
            self.candidates[pod.key] = pod
            counts = self.candidate_resources
            for resource, k in pod.slices.items():  # Counter.update costs 5x this per call
                counts[resource] += k
        if managed:
            self.managed.add(pod.key)

    def _drop_candidate(self, pod: PodInfo) -> None:
        del self.candidates[pod.key]
        counts = self.candidate_resources
        for resource, k in pod.slices.items():
            counts[resource] -= k

    def _reject(self, pod: PodInfo) -> str | None:
        cached = pod.reject_cache
        if cached is not None and cached[0] == self.index.topology:
            return cached[1]
        eligible = self.index.eligible(pod, self.gpu_nodes)
        # Pods of one shape share their eligible set (ClusterIndex.eligible): one check each.
        key = (eligible, tuple(sorted(pod.slices.items())))
        if key in self._rejects:
            reason = self._rejects[key]
        else:
            reason = self._rejects[key] = _reject_reason(pod, eligible, self.gpu_nodes)
        if reason is not None and reason.startswith("no eligible node"):
            if self._opted_in_objs is None:  # once per step: this runs for every rejected pod
                self._opted_in_objs = [
                    i.obj for _, i in sorted(self.index.nodes.items()) if i.reading
                ]
            problems = self._label_problems()
            reason += no_eligible_notes(
                pod.obj,
                pod.slices,
                pod.dra,
                ((self.index.nodes[n].obj, problems[n]) for n in sorted(problems)),
                self._opted_in_objs,
                self._paused(),
            )
        pod.reject_cache = (self.index.topology, reason)
        return reason

    def _paused(self) -> list[PausedNode]:
        """GPU nodes cordoned or under a ``node.kubernetes.io/*`` taint, once per step: such a
        node is back after a reboot or a driver upgrade, so a pod it would fit once back is
        not given back for it (:meth:`_give_back`, :func:`partitioner.rejection.paused_fit`)."""
        if self._paused_nodes is None:
            self._paused_nodes = [
                (name, info.obj, info.gpu.mode, info.gpu.model, info.gpu.dra)
                for name, info in sorted(self.gpu_nodes.items())
                if info.gpu is not None and paused_why(info.obj) is not None
            ]
        return self._paused_nodes

    # ------------------------------------------------------------------ 1. housekeeping

    def housekeeping(self) -> None:
        for name, info in self.gpu_nodes.items():
            gpu = info.gpu
            assert gpu is not None
            np_info = self.index.partitionings.get(name)
            if np_info is None:
                spec = NodePartitioningSpec(mode=gpu.mode.value)
                self.actions.append(CreatePartitioning(name, info.uid, spec))
                continue
            np = np_info.np
            if np is not None and np.spec.mode != gpu.mode.value:
                spec = NodePartitioningSpec(planId=self.next_id(), mode=gpu.mode.value)
                self.actions.append(
                    WriteSpec(name, spec, np.metadata.resourceVersion, planned_at=self.now)
                )
                self.switching.add(name)
        for name in sorted(self.index.partitionings):
            node = self.index.nodes.get(name)
            if node is None or not opted_in(node.obj):
                self.actions.append(DeletePartitioning(name))

    def conditions(self) -> None:
        for name, info in sorted(self.index.nodes.items()):
            if info.reading is None:
                continue
            conditions = (info.obj.get("status") or {}).get("conditions") or ()
            have: Mapping[str, Any] = next(
                (c for c in conditions if c.get("type") == NODE_CONDITION), {}
            )
            problem = info.reading if info.gpu is None else self._node_problem(name)
            if problem is None:
                if have.get("status") == "False":
                    self.actions.append(
                        SetNodeCondition(name, "True", "Configured", "GPU labels are valid")
                    )
                continue
            assert isinstance(problem, NodeProblem)
            wanted = ("False", problem.reason, problem.message)
            if (have.get("status"), have.get("reason"), have.get("message")) == wanted:
                continue
            self.actions.append(SetNodeCondition(name, "False", problem.reason, problem.message))
            self.actions.append(
                EmitEvent(_node_ref(info), "Warning", problem.reason, problem.message)
            )

    def node_sets(self) -> None:
        for name in self.gpu_nodes:
            np_info = self.index.partitionings.get(name)
            if np_info is None:
                continue
            if np_info.np is None:
                self.invalid[name] = NodeProblem(
                    name, "InvalidPartitioning", invalid_partitioning_message(name, np_info.error)
                )
                self.busy.add(name)
                continue
            np = np_info.np
            if is_busy(np):
                self.busy.add(name)
                at = _planned_at(np)
                observed = np.status.observedGeneration if np.status is not None else 0
                if (
                    at is not None
                    and self.now - at > self.config.apply_deadline_s
                    and observed < (np.metadata.generation or 0)
                    and name not in self.switching
                ):
                    # not even observed: an agent that observed it reports why it waits (a
                    # mode switch waiting for pods to leave) in its own conditions
                    applied = np.condition("Applied")
                    said = f" (Applied: {applied.reason})" if applied and applied.reason else ""
                    self.stuck[name] = NodeProblem(
                        name,
                        "ApplyStuck",
                        f"the agent has not applied plan {np.spec.planId or '-'} within "
                        f"{self.config.apply_deadline_s:.0f} s{said}; no plan goes to this node "
                        f"until it does, and pods that can only use it wait: check the gpuslice "
                        f"agent on it (kubectl describe nodepartitioning {name}, its logs)",
                    )
            if is_degraded(np):
                self.degraded.add(name)
        self.busy |= self.switching

    # ------------------------------------------------------------------ 2-3. read, deadlines

    def frozen(self) -> dict[str, frozenset[int]]:
        out: dict[str, set[int]] = {}
        if not self.config.reservation:
            return {}
        for pod in self.pods_now:
            r = pod.reservation
            if r is None or r.state is not State.DRAINING or not pod.gated:
                continue
            info = self.gpu_nodes.get(r.node)
            if info is None or info.gpu is None:
                continue
            count = info.gpu.gpu_count
            out.setdefault(r.node, set()).update(
                i for g in r.gpus.values() for i in g if 0 <= i < count
            )
        return {n: frozenset(g) for n, g in out.items()}

    def read_pods(self) -> None:
        legacy_in_flight = self._legacy_in_flight() if not self.config.reservation else {}
        # The next reservation deadline.  A pod reaching ``drain_after_s`` is no wake-up of its
        # own: drains start only after a plan, and that plan's ``replan_at`` covers it.
        soonest = math.inf
        reservation, topology = self.config.reservation, self.index.topology
        candidates, counts, managed = self.candidates, self.candidate_resources, self.managed
        seen = self.seen
        shapes: dict[int, tuple[Mapping[str, int], list[int]]] = {}
        """Short-path candidates per request object (pods asking the same share one in the
        index): their units are added to ``counts`` once per request, after the loop."""
        for pod in self.pods_now:
            if pod.plain and (pod.gated if reservation else not pod.gated):
                # The short path (the outcome of the general one below for such a pod): a
                # gated pod is a managed candidate (reservations on), an ungated one a
                # candidate if kube-scheduler could not place it and no plan is in flight
                # for it (reservations off).
                key = pod.key
                seen.add(key)
                if not reservation:
                    if not pod.unschedulable:
                        continue
                    if key in legacy_in_flight:
                        self.waiting[key] = legacy_in_flight[key]
                        continue
                cached = pod.reject_cache
                reason = (
                    cached[1] if cached is not None and cached[0] == topology else self._reject(pod)
                )
                if reason is not None:
                    self.rejected[key] = reason
                    continue
                candidates[key] = pod
                tally = shapes.get(id(pod.slices))
                if tally is None:
                    shapes[id(pod.slices)] = (pod.slices, [1])
                else:
                    tally[1][0] += 1
                if reservation:
                    managed.add(key)
                    if "Gated" not in self.told(pod):
                        self.once(
                            pod,
                            "Gated",
                            f"waiting for a slice ({_units(pod.slices)}): gated by gpuslice "
                            f"until its slice is ready",
                        )
                continue
            if pod.daemonset:
                continue
            if pod.nominated:  # kube-scheduler preempted for it: it binds where it nominated
                ledger = self.ledgers.get(pod.nominated_node)
                if ledger is not None:
                    ledger.add_nominated(pod)
                continue
            key = pod.key
            self.seen.add(key)
            r = pod.reservation
            if r is not None and r.state is not State.DRAINING:
                r = self._bounded(r)
            if r is not None and r.deadline < soonest:
                soonest = r.deadline
            if pod.request_error:
                self.rejected[key] = pod.request_error
                continue
            if pod.reservation_error:
                self.once(
                    pod,
                    "InvalidReservation",
                    f"{pod.reservation_error}; ignored, the pod is planned again",
                    "Warning",
                )
                r = None
            if not self.config.reservation:
                self._read_legacy(pod, legacy_in_flight)
                continue
            if pod.gated:
                if pod.other_gates:
                    self.waiting[key] = (
                        "waiting for other scheduling gates to be removed: "
                        + ", ".join(pod.other_gates)
                    )
                    continue
                if r is None or r.state is State.DRAINING:
                    self.candidate(pod, managed=True)
                    if r is not None:
                        self._read_drain(pod, r)
                    elif "Gated" not in self.told(pod):
                        self.once(
                            pod,
                            "Gated",
                            f"waiting for a slice ({_units(pod.slices)}): gated by gpuslice "
                            f"until its slice is ready",
                        )
                    continue
                self._hold(pod, r)
            elif r is not None and r.state in (State.PLANNED, State.RELEASED):
                self._hold(pod, r)
            elif pod.unschedulable:
                self.candidate(pod, managed=False)
        for slices, (n,) in shapes.values():
            for resource, k in slices.items():
                counts[resource] += k * n
        self.counts["waiting"] = len(self.seen)
        if math.isfinite(soonest):
            self.wake(soonest)
        if self.drains:
            self._yield_drains()
        if self.drains and self.deep_queue() and self._deep_beyond_free():
            # a burst the next plan serves is no overload: a drain ends once the queue has
            # stayed deep for a batch window (it started over from nothing each time before)
            since = self.state.deep_since if self.state.deep_since is not None else self.now
            self.deep_since = since
            due = since + self.config.policy.timeout
            if self.now >= due:
                self._end_drains()
            else:
                self.wake(due)

    def _bounded(self, r: Reservation) -> Reservation:
        """Every wait has a deadline: a planned or released reservation is held to at most
        ``apply_deadline_s + bind_deadline_s`` past the time it entered its state (the latest
        gpuslice writes, for a released pod planned again).  An annotation without a deadline
        or with a later one (edited by hand, or written under longer settings), or whose
        ``since`` lies ahead of this clock, gets that bound, counted from now at the latest."""
        limit = min(r.since, self.now) + self.config.apply_deadline_s + self.config.bind_deadline_s
        return r if r.deadline <= limit else replace(r, deadline=limit)

    def _deep_beyond_free(self) -> bool:
        """The queue stays deep once the free slices of the open nodes serve what they can:
        the slice units asked for beyond the free units of their resource exceed the deep-queue
        limit.  Pods that arrive to free slices are served by the fast path in this very step;
        counted, a pair of them in a short queue ended a drain that had nearly emptied its GPU,
        again and again (the drain started over from nothing each time), and the pod it was
        for was never served."""
        free: Counter[str] = Counter()
        for ledger in self.ledgers.values():
            if not ledger.busy and self._open(ledger.name):
                free.update(ledger.free())
        beyond = {r: max(0, k - free[r]) for r, k in self.candidate_resources.items()}
        limit = self.queue_limit()
        return sum(beyond.values()) > limit and _gpu_equivalents(beyond) > limit

    def _yield_drains(self) -> None:
        """A drain yields to a waiting pod of higher priority that may use the drained node:
        frozen GPUs take no pod, so a lower-priority pod's drain kept the free slices there
        from it (kube-scheduler would have bound it at once), and the emptied GPUs went to the
        lower-priority pod.  The candidates are in priority order, highest first."""
        ranked = list(self.candidates.values())
        for key, r in sorted(self.drains.items()):
            mine = self.index.pods[key].priority
            first: PodInfo | None = None
            for p in ranked:
                if p.priority <= mine:
                    break
                if (
                    p.key in self.managed
                    and p.key not in self.drains
                    and r.node in self.index.eligible(p, self.gpu_nodes)
                ):
                    first = p
                    break
            if first is None:
                continue
            self.counts["drains_yielded"] += 1
            self._end_drain(
                key,
                f"drain of node {r.node} ended: pod {first.key} of higher priority "
                f"({first.priority} > {mine}) waits and may use that node",
            )

    def _end_drain(self, key: str, why: str) -> None:
        """Give the drain of pod ``key`` back (``why``, in its ``ReservationDropped`` Event):
        its GPUs stay frozen for this step only (the ledgers are built); the pod is a candidate
        as before."""
        self._drop(self.index.pods[key], self.drains.pop(key), why)

    def _end_drains(self) -> None:
        """A deep queue that lasts a batch window ends every drain (module docstring, step 8;
        counted beyond what the free slices serve: :meth:`_deep_beyond_free`): a frozen GPU that has
        emptied idles until the rest of its set does, while the queue's pods could run on it.
        The GPUs stay frozen for this step only (the ledgers are built); the pods are
        candidates as before and may be drained again once the queue is short."""
        cluster_gpus = self.cluster_gpus()
        queue = self.candidate_resources.total()
        for key, r in sorted(self.drains.items()):
            self.counts["drains_ended_deep_queue"] += 1
            self._end_drain(
                key,
                f"drain of node {r.node} ended: {queue} slice unit(s) wait for {cluster_gpus} "
                f"GPU(s), a deep queue, in which frozen GPUs would idle while waiting pods "
                f"could use them; it may be drained again once the queue is short",
            )

    def _read_drain(self, pod: PodInfo, r: Reservation) -> None:
        if (
            r.node not in self.gpu_nodes
            or r.node in self.cooldown
            or r.node in self.plugin_lost
            or r.node not in self.index.eligible(pod, self.gpu_nodes)
        ):
            self._drop(pod, r, f"node {r.node} can no longer be drained for it")
            return
        self.drains[pod.key] = r
        self.note(pod, r)
        self.counts["draining"] += 1

    def _hold(self, pod: PodInfo, r: Reservation) -> None:
        if pod.gated and r.state is State.RELEASED:  # the release patch did not land: again
            r = replace(r, state=State.PLANNED)
        ledger = self.ledgers.get(r.node)
        if ledger is None:
            if r.state is State.RELEASED and not pod.gated:
                self._stranded(pod, r.node, f"node {r.node} is gone or no longer a gpuslice node")
            else:
                self._drop(pod, r, f"node {r.node} is gone or no longer a gpuslice node")
            return
        accepts = r.node in self.index.eligible(pod, self.gpu_nodes)
        if pod.gated and not accepts:
            # cordoned, tainted or relabelled since it was planned: released there, it would be
            # pinned to a node that refuses it (stranded); still gated, it can go elsewhere
            self._drop(pod, r, f"node {r.node} no longer accepts it ({_REFUSES})")
            return
        if r.state is State.PLANNED and ledger.busy and self.now >= r.deadline:
            self._missed(pod, r)
            return
        # a node whose kubelet refused a released pod, or that lost its plugin or agent
        lost = self.plugin_lost.get(r.node)
        given_up = self.rejecting.get(r.node) or lost
        if r.state is State.PLANNED and given_up:
            self._drop(pod, r, given_up)
            return
        if r.state is State.RELEASED and not pod.gated:  # pinned there: can it still bind?
            if lost:  # it could once the node serves again
                self._stranded(pod, r.node, lost, waits=True)
            elif not accepts:  # busy or not, waiting for its bind deadline would change nothing
                self._stranded(pod, r.node, f"the node no longer accepts it ({_REFUSES})")
            elif pod.unschedulable and self.now >= r.deadline:
                # kube-scheduler tried it since its release (the gate kept it from trying
                # before) and a filter gpuslice does not model refused the one node it may use
                self._stranded(pod, r.node, _UNSCHEDULABLE, waits=True, waits_for=_ROOM)
        ledger.add_hold(Hold(pod, r))
        self.note(pod, r)
        self.counts["released" if r.state is State.RELEASED else "held"] += 1

    def notice_rejections(self) -> None:
        """A pod released to a node that its kubelet refused at admission cools the node down.

        gpuslice releases a pod only once the node's allocatable shows its slice, so a refusal
        means the node cannot serve what its status reports: its device plugin stopped (the
        agent crashed or was evicted: the kubelet marks its devices unhealthy and fails every
        Allocate, but kube-scheduler sees allocatable 0 only after the kubelet's next status
        sync) or its devices went bad.  Left alone, the free slices the agent's last status
        shows would be promised again, and pods planned there wait for a spec nobody applies
        until their deadline.  The node cools down (no reservation, release or plan there)
        until ``cooldown_s`` past the refused pod's release (its reservation's ``since``: the
        kubelet refuses a pod when it is bound, right after its release), and once per refused
        pod (its Event is the record) its ``planned`` pods are given back at once
        (:meth:`_hold`).  The refused pod itself is finished; its controller creates a new one,
        which is gated and planned as any other.

        The cooldown's end is read from the pod, not counted from the step that noticed the
        refusal: a controller that restarts (its :class:`ControllerState` and Events forgotten)
        reads the refusal again and cools the node until the same time the running controller
        does, and once that has passed ignores it (failed pods stay for days).  Counted from
        its own now, it would cool the node again after the running controller's cooldown had
        ended and give back the pods planned there since.
        """
        for key in sorted(self.index.rejections):
            pod = self.index.pods[key]
            r = pod.reservation
            assert r is not None
            until = r.since + self.config.cooldown_s
            if self.now >= until:
                # An old refusal: its cooldown is over (the running controller's too).
                continue
            self._cool(r.node, until, "AdmissionRejected")
            message = (
                f"the kubelet of node {r.node} refused the pod released there ({pod.rejected}); "
                f"no pod is promised a slice there for {self.config.cooldown_s:.0f} s from its "
                f"release and the pods planned there are planned elsewhere"
            )
            # recorded by uid: a pod of the same name (a StatefulSet's) refused later is news
            mark = f"{key}#{pod.uid}"
            self.rejection_marks.add(mark)
            if (self.reported.get(mark) or {}).get("AdmissionRejected") == message:
                continue
            self._own_reported()[mark] = {"AdmissionRejected": message}
            self.actions.append(EmitEvent(_pod_ref(pod), "Warning", "AdmissionRejected", message))
            self.counts["admission_rejected"] += 1
            if r.node not in self.rejecting:
                self.node_event(r.node, "AdmissionRejected", f"{message} (pod {key})")
            self.rejecting[r.node] = message

    def notice_unserved(self) -> None:
        """Nodes whose kubelet lists none of the slices the node should have get no new promise
        while that lasts: no free slice of theirs is reserved, no plan or drain goes there, and
        their node condition says why (``DevicePluginGone``).  Two signs, both of a device
        plugin that is gone (the agent stopped: the kubelet marks its devices unhealthy at
        once, allocatable 0 from its next status sync) or has not registered again yet:

        * pods bound there hold a slice resource the kubelet lists none of
          (:meth:`~partitioner.ledger.NodeLedger.plugin_gone`): at once, since a bound pod was
          admitted with the device;
        * the agent's applied status shows healthy slices and the kubelet lists none of them
          (:meth:`~partitioner.ledger.NodeLedger.unlisted`): once that has lasted
          ``plugin_lag_s``, since a new layout is listed only at the kubelet's next sync.
          Without it a node with nothing bound had its last status's free slices promised,
          and the pod waited for the kubelet to list them until its apply deadline, again and
          again while the agent was down.

        Once either has lasted ``plugin_lag_s`` the node's ``planned`` pods are given back and
        planned elsewhere (:meth:`_hold`); released ones are pinned to the node: they bind
        if the plugin is back in time, else they are evicted as stranded (:meth:`_stranded`).
        A kubelet restart shows the same for the seconds its plugins take to register again,
        less than the lag, so nothing is given back then.  The
        start of each is kept in :attr:`ControllerState.unlisted_since` (this controller's
        clock, not the agent's); nothing else is remembered.

        A node whose agent has stopped renewing its heartbeat Lease
        (:attr:`~partitioner.index.ClusterIndex.silent_agents`, :mod:`partitioner.agent_leases`:
        silent for the Lease's whole duration already) is unserved at once (``AgentSilent``)
        and its planned pods are given back, in both agent modes and whatever its status and
        allocatable still show: a silent agent applies no spec and reports nothing, so
        without this its pods waited for the apply deadline."""
        lag = self.config.plugin_lag_s
        for name, ledger in sorted(self.ledgers.items()):
            if name in self.index.silent_agents:
                self.unserved[name] = NodeProblem(
                    name,
                    "AgentSilent",
                    f"the gpuslice agent of node {name} has stopped renewing its Lease "
                    "(gpuslice-agent-<node>): it stopped, hangs, or cannot reach the API "
                    "server; no slice is promised there and the pods planned there are planned "
                    "elsewhere until it renews again (check the agent pod on the node and its "
                    "log)",
                )
                self.plugin_lost[name] = (
                    f"the gpuslice agent of node {name} has stopped renewing its Lease"
                )
                continue
            held = ledger.plugin_gone()
            resource = held or ledger.unlisted()
            if not resource:
                continue
            since = self.state.unlisted_since.get(name, self.now)
            self.unlisted_since[name] = since
            lasted = self.now - since
            if lasted < lag:
                self.wake(since + lag)
                if not held:
                    continue
            if held:
                message = f"pods bound to node {name} hold {resource} but its kubelet lists none"
            else:
                message = (
                    f"the gpuslice agent of node {name} reports {resource} but its kubelet "
                    f"has listed none of its slices for over {lag:.0f} s"
                )
            message += (
                ": the agent's device plugin is gone, registering again after a kubelet "
                "restart, or reports every such device unhealthy; no new slice is promised "
                "there until the kubelet lists it again (check the agent pod and the node's "
                "GPUs)"
            )
            self.unserved[name] = NodeProblem(name, "DevicePluginGone", message)
            if lasted >= lag:
                self.plugin_lost[name] = (
                    f"node {name}'s kubelet has listed none of its slices for over "
                    f"{lag:.0f} s (its gpuslice device plugin is gone)"
                )
        if self.unserved:
            self.counts["nodes_unserved"] = len(self.unserved)

    def strand_unprepared(self) -> None:
        """DRA nodes whose agent is silent: a claim pod bound there that has not started
        (phase ``Pending``) cannot start, since the kubelet prepares its ResourceClaims through
        the agent's DRA plugin and retries until it is back (the pod shows
        ``ContainerCreating``; the kubelet also wipes the agent's ResourceSlices 30 s after its
        plugin went away, so nothing new is allocated there).  Such a pod is stranded as a
        released one is (:meth:`_stranded`): evicted once that has lasted
        ``recreate_stranded_s`` if a controller owns it, so its controller's new pod is planned
        on a node that serves.  Not a pod whose condition ``PodReadyToStartContainers`` is
        ``True``: the kubelet makes the sandbox only after it prepared the claims, so such a pod
        (pulling its images, say) starts without the agent.  A pod bound in device-plugin mode
        is not either: the kubelet admitted it with its device, so it starts whatever the agent
        does.  Likewise a claim pod bound to a DRA node whose agent reports that the last
        prepare of one of its claims failed (``status.prepareFailures``: an XID hit the device
        after allocation, a process outside any claim holds the placement, MIG mode cannot be
        switched, the GPU is unreadable): the kubelet retries, and it starts if a retry
        succeeds before the eviction.  Cost: one pass over the pods per silent DRA node and per
        DRA node reporting failures, only while one does."""
        for name, why in sorted(self.plugin_lost.items()):
            ledger = self.ledgers.get(name)
            if ledger is None or not ledger.gpu.dra:
                continue
            for pod in self._unstarted(name):
                self.seen.add(pod.key)  # its Events are kept while it is stranded
                self._stranded(pod, name, why, waits=True, bound=_AGENT_GONE)
        for name, ledger in sorted(self.ledgers.items()):
            np = self.index.partitioning(name) if ledger.gpu.dra else None
            failures = np.status.prepareFailures if np is not None and np.status else ()
            if not failures or name in self.plugin_lost:
                continue
            failed = failed_claims(failures, self.index.claims)
            for pod in self._unstarted(name):
                hit = [failed[c] for c in pod.claims if c in failed]
                if hit:
                    f = hit[0]
                    self.seen.add(pod.key)
                    why = (
                        f"its agent has failed to prepare ResourceClaim {f.claim} since "
                        f"{f.since or 'its last report'} ({f.message or 'no message'})"
                    )
                    self._stranded(pod, name, why, waits=True, bound=_PREPARE_FAILS)

    def _unstarted(self, node: str) -> list[PodInfo]:
        """Claim pods bound to ``node`` that have not started and whose claims the kubelet has
        not prepared (no sandbox yet: ``PodReadyToStartContainers`` is not ``True``)."""
        return [
            p
            for p in self.index.bound_pods(node)
            if p.dra and p.phase == "Pending" and not p.deleting and not p.sandbox_ready
        ]

    def _node_problem(self, name: str) -> NodeProblem | None:
        """The problem that keeps GPU node ``name`` out of plans, as its condition says it:
        an invalid NodePartitioning, then an unreadable or unserved node, then a spec its
        agent does not apply (``ApplyStuck``)."""
        return (
            self.invalid.get(name)
            or self.unreadable.get(name)
            or self.unserved.get(name)
            or self.stuck.get(name)
        )

    def _unplannable(self, eligible: Iterable[str]) -> str:
        """Why a pod whose eligible nodes are all left out of plans waits, node by node (no
        times in it: :meth:`once` tells it again only when a reason changes)."""

        def why(name: str) -> str:
            problem = self._node_problem(name)
            if problem is not None:
                return problem.reason
            if name in self.cooldown:
                return _COOLING.get(
                    self.cooldown_why.get(name, ""), "cooling down after a promise it did not keep"
                )
            if name in self.switching:
                return "switching its partitioning mode"
            return "applying a previous plan"

        return (
            f"waiting: every node it may use is left out of plans now: "
            f"{left_out_words(sorted(eligible), why)}; it is planned once one of them can be "
            f"(see the node's {NODE_CONDITION} condition and Events)"
        )

    def _open(self, node: str) -> bool:
        """New promises may go to ``node``: it is neither cooling down nor unserved."""
        return node not in self.cooldown and node not in self.unserved

    def _missed(self, pod: PodInfo, r: Reservation) -> None:
        waited = self.now - r.since
        # the plan the node has not applied: the one in flight there (a reservation of a slice
        # that existed already has no plan of its own: it waited for that one all the same)
        plan = _spec_plan(self.index.partitioning(r.node)) or r.plan or "-"
        message = (
            f"node {r.node} did not apply plan {plan} within "
            f"{self.config.apply_deadline_s:.0f} s (waited {waited:.0f} s)"
        )
        if r.node not in self.cooldown:
            self._cool(r.node, self.now + self.config.cooldown_s, "ApplyDeadlineMissed")
            self.node_event(
                r.node,
                "ApplyDeadlineMissed",
                f"{message}; its pods are planned elsewhere and the node is left out of plans "
                f"for {self.config.cooldown_s:.0f} s",
            )
        self._drop(pod, r, message)

    def _drop(self, pod: PodInfo, r: Reservation, why: str) -> None:
        """Give a reservation back: the pod is a candidate again (gated) or re-planned."""
        self.note(pod, None)
        if pod.gated or r.state is not State.RELEASED:
            patch = _rv_patch(pod, _annotation(None))
            event = EmitEvent(
                _pod_ref(pod), "Warning", "ReservationDropped", f"{why}; planning it again"
            )
            self._patch(PatchPod(pod.key, _pod_ref(pod), patch, "unreserve", None, (event,)))
            self.candidate(pod, managed=pod.gated)
        else:
            self._replan_on_node(pod, r, why)

    def _replan_on_node(self, pod: PodInfo, r: Reservation, why: str) -> None:
        """A released pod's slice is gone (taken by a pod gpuslice did not gate, or the node
        lost it): the pod is pinned to the node, so a new slice is planned there.  A node with
        no room for one may keep it waiting for as long as its pods run: once its bind
        deadline has passed it is stranded too (and, owned by a controller, evicted after
        ``recreate_stranded_s`` to be planned afresh), unless a slice is made for it first
        (that plan gives it a new deadline)."""
        self.once(
            pod,
            "SliceTaken",
            f"{why}; the pod is pinned to node {r.node}, so a new slice is planned there",
            "Warning",
        )
        self.candidate(pod, managed=False)
        self.restricted[pod.key] = frozenset({r.node})
        if self.now >= r.deadline:
            self._stranded(
                pod,
                r.node,
                f"{why}, and no new slice was made for it there by its bind deadline",
                waits=True,
                waits_for="a slice is made for it there",
            )

    def _stranded(
        self,
        pod: PodInfo,
        node: str,
        why: str,
        waits: bool = False,
        bound: _CannotStart | None = None,
        waits_for: str = "the node serves again",
    ) -> None:
        """``pod`` was released to ``node`` and cannot bind there: the node is gone or no
        longer accepts it, or (``waits``) it is unserved, so it would bind only once the node
        serves again (``waits_for`` says what it waits for).  Its node affinity is pinned to the
        node and Kubernetes forbids widening
        it, so only a new pod can be planned elsewhere.  With ``bound`` it is bound there and
        cannot start, for the reason and with the way out that ``bound`` names
        (:meth:`strand_unprepared`).  A pod a controller owns (an
        ``ownerReference`` with ``controller: true``: Job, ReplicaSet, StatefulSet, ...) that
        has been stranded for ``recreate_stranded_s`` is evicted (:class:`~partitioner.actions.
        EvictPod`); its controller creates it again and the new pod is gated and planned like
        any other.  Until then, and for pods nothing owns, the ``Stranded`` Event says what
        happens next.  Stranded since: :attr:`ControllerState.stranded_since` (this
        controller's clock: a restart starts the wait over, never shortens it)."""
        mark = _mark(pod)
        if mark in self.stranded_since:  # found stranded already this step, for another reason
            return
        self.counts["stranded"] += 1
        since = self.state.stranded_since.get(mark, self.now)
        self.stranded_since[mark] = since
        after = self.config.recreate_stranded_s
        owner = _controller_of(pod) if after > 0 else None
        if bound is not None:
            head = f"bound to node {node} but {why}: {bound.how}, so it cannot start"
            recovers, unless = bound.recovers, bound.unless
        else:
            head = (
                f"released to node {node} but {why}: its node affinity is pinned there and "
                f"cannot be widened"
            )
            recovers = f"it binds there once {waits_for}, or "
            unless = f"unless it binds there first ({waits_for}), "
        if not waits:
            recovers = unless = ""
        if owner is None:
            self.once(
                pod,
                "Stranded",
                f"{head}; {recovers}delete the pod so its controller recreates it (it is gated "
                f"and planned again)",
                "Warning",
            )
            return
        due = since + after
        if self.now < due:
            self.wake(due)
            self.once(
                pod,
                "Stranded",
                f"{head}; {unless}it is evicted once it has been stranded for {after:.0f} s, so "
                f"that its controller ({owner}) creates it again, gated and planned afresh",
                "Warning",
            )
            return
        self.counts["evicted"] += 1
        event = EmitEvent(
            _pod_ref(pod),
            "Warning",
            "StrandedEvicted",
            f"stranded for {after:.0f} s ({head}): evicted so that its controller ({owner}) "
            f"creates it again, gated and planned afresh",
        )
        self.actions.append(EvictPod(pod.key, _pod_ref(pod), pod.rv, (event,)))

    def _legacy_in_flight(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name in sorted(self.busy):
            np = self.index.partitioning(name)
            if np is None:
                continue
            at = _planned_at(np)
            if at is not None and self.now - at > self.config.apply_deadline_s:
                if name not in self.cooldown:
                    self._cool(name, self.now + self.config.cooldown_s, "ApplyDeadlineMissed")
                    self.node_event(
                        name,
                        "ApplyDeadlineMissed",
                        f"plan {np.spec.planId} not applied within "
                        f"{self.config.apply_deadline_s:.0f} s; its pods are planned elsewhere "
                        f"and the node is left out of plans for {self.config.cooldown_s:.0f} s",
                    )
                continue
            for p in planned_pods(np):
                out[p] = f"in flight: waiting for node {name} to apply plan {np.spec.planId}"
        return out

    def ungate_strays(self) -> None:
        """Pods that carry gpuslice's gate and ask it for nothing lose the gate at once: pods
        gated at admission for naming ResourceClaims whose claims, all known, ask gpuslice for
        nothing new (another driver's devices, or claims allocated already, which it shares
        with the pods they were allocated for: kube-scheduler sends such a pod where its claims
        are allocated, no affinity to narrow), and pods created with the gate that ask for no
        slice at all or belong to a DaemonSet (a manifest copied from a gated pod: the webhook
        gates neither, and only gpuslice removes its gate)."""
        for key in sorted(self.index.strays):
            pod = self.index.pods[key]
            shared = [c for c in pod.claims if (d := self.index.claims.get(c)) and d.units]
            if pod.daemonset:
                message = (
                    "a DaemonSet's pod is placed by its controller and never gated by gpuslice "
                    "(was the gate copied from another pod's manifest?): gpuslice removed its gate"
                )
            elif not pod.claims:
                message = (
                    "it asks gpuslice for no slice (no nvidia.com/mig-<profile> or "
                    "nvidia.com/gpu-<N>gb amount above 0, no ResourceClaim; was the gate copied "
                    "from another pod's manifest?): gpuslice removed its gate"
                )
            elif shared:
                where = sorted({pool for c in shared for pool, _ in self.index.claims[c].devices})
                message = (
                    f"its ResourceClaims ({', '.join(shared)}) are allocated already"
                    + (f" on node {', '.join(where)}" if where else "")
                    + ": it shares them with the pods they were allocated for and needs no new "
                    "slice; gpuslice removed its gate"
                )
            else:
                message = "its ResourceClaims ask gpuslice for no slice: gpuslice removed its gate"
            self._ungate(pod, message)

    def give_back_unclaimed(self) -> None:
        """Gated pods naming a ResourceClaim gpuslice does not know (a typo in
        ``resourceClaimName``, a template whose claim the ResourceClaim controller never made)
        asked for nothing readable, so no step ever looked at them again: gated for good, with
        no Event, and kube-scheduler, which would say the claim is missing, never saw them.
        Told at once what is missing (``WaitingForClaims``); once that has lasted a batch
        window (the claim controller makes a template's claim within seconds) the pod loses
        the gate, so kube-scheduler reports the missing claim on it, and it is planned like an
        ungated pod once its claims exist."""
        for key in sorted(self.index.unclaimed):
            pod = self.index.pods[key]
            if not self.config.claims_watched:
                self._ungate(
                    pod,
                    "gpuslice does not plan ResourceClaims in this installation (DRA planning "
                    "is off: dra.enabled=false, or dra.publish=all, where the DRA agents publish "
                    "every placement), so it removed its scheduling gate; kube-scheduler "
                    "allocates its claims",
                )
                continue
            missing = missing_claims(pod.obj, self.index.claims)
            self.seen.add(key)  # its Events are kept while it waits (told once)
            self.once(pod, "WaitingForClaims", f"cannot be planned yet: {missing}")
            due = (
                pod.created if pod.created is not None else self.now
            ) + self.config.policy.timeout
            if self.now < due:
                self.wake(due)
                continue
            self._ungate(
                pod,
                f"{missing} after a batch window ({self.config.policy.timeout:.0f} s): "
                f"gpuslice cannot read what it asks for, so it removed its scheduling gate; "
                f"kube-scheduler reports the missing claim on the pod until it exists (check "
                f"its spec.resourceClaims names)",
            )

    def release_sharers(self) -> None:
        """Pods that share an unallocated ResourceClaim with the pod carrying its units
        (:attr:`~partitioner.index.PodInfo.follower`: the claim's units count once, with its
        carrier) are released with their carriers: once every carrier is released to one node
        (this step or before), the pod loses its gate with its node affinity narrowed to that
        node, as its carrier's (unpinned, kube-scheduler could allocate the claim elsewhere,
        taking a device promised to another pod), and no reservation of its own: it holds
        nothing the claim does not.  Until then it waits gated (Normal Event ``Gated`` naming
        the carriers); a carrier that is never released (ungated, planned elsewhere) lets it go
        once the claim is allocated (it is a stray then).  Without reservations it is ungated
        at once, as every gated pod is."""
        followers = self.index.followers
        if not followers:
            return
        released: dict[str, str] = {}
        for name, entries in self.view.items():
            for key, entry in entries.items():
                if entry.state == State.RELEASED.value:
                    released[key] = name
        for key in sorted(followers):
            pod = self.index.pods[key]
            if not self.config.reservation:
                self._ungate(pod, "it shares ResourceClaims with pods gpuslice does not gate")
                continue
            self.seen.add(key)  # its Events are kept while it waits (told once)
            carriers = ", ".join(pod.claim_carriers)
            nodes = {released.get(c) for c in pod.claim_carriers}
            node = nodes.pop() if len(nodes) == 1 else None
            if node is None:
                self.once(
                    pod,
                    "Gated",
                    f"waiting for pod(s) {carriers}: they carry the ResourceClaims it shares "
                    f"and it is released with them, to their node",
                )
                continue
            elsewhere = sorted(
                pool
                for c in pod.claims
                if (d := self.index.claims.get(c)) is not None and d.allocated
                for pool, _ in d.devices
                if pool != node
            )
            if elsewhere or node not in self.index.eligible(pod, self.gpu_nodes):
                self.once(
                    pod,
                    "Unplaceable",
                    f"cannot place: it shares ResourceClaims with pod(s) {carriers}, released to "
                    f"node {node}, but "
                    + (
                        f"its other claims are allocated on node {', '.join(elsewhere)}"
                        if elsewhere
                        else "that node does not accept it (nodeSelector, affinity, taints)"
                    )
                    + "; it stays gated until its claims are allocated",
                    "Warning",
                )
                continue
            event = EmitEvent(
                _pod_ref(pod),
                "Normal",
                "Released",
                f"released to node {node} with pod(s) {carriers}, which carry the "
                f"ResourceClaims it shares",
            )
            patch = release_patch(pod.obj, node)
            self._patch(PatchPod(pod.key, _pod_ref(pod), patch, "release", None, (event,)))

    def _ungate(self, pod: PodInfo, message: str, reason: str = "Ungated") -> None:
        """Remove gpuslice's gate from ``pod`` (if it has it), with a Normal Event ``reason``."""
        patch = ungate_patch(pod.obj)
        if patch is None:
            return
        event = EmitEvent(_pod_ref(pod), "Normal", reason, message)
        self._patch(PatchPod(pod.key, _pod_ref(pod), patch, "ungate", None, (event,)))

    def _give_back(self, pod: PodInfo, reason: str) -> bool:
        """A gated pod gpuslice can never place on its nodes as they are (``reason``: no
        opted-in node of the right kind matches its nodeSelector, affinity and tolerations, no
        such node's GPU has its profile, or it asks for something gpuslice nodes never offer)
        loses the gate, unless an opted-in node whose GPU labels cannot be read yet matches it
        (that node may still serve it), or a GPU node that could serve it is only cordoned or
        under a ``node.kubernetes.io/*`` taint (:meth:`_paused`: a reboot or a driver
        upgrade ends).  Kept gated, it would wait forever; ungated,
        kube-scheduler places it like any pod, e.g. on a node that is not opted in, whose own
        device plugin advertises the slice (clusters adopt gpuslice node by node), and the
        cluster autoscaler can act on it (a gated pod is never tried, so never unschedulable).
        A gate removed cannot come back, so a pod is given back only once it has existed for
        a batch window (``policy.timeout``): a node the partitioner has not read yet, or one
        being opted in, has that long to appear.  Returns whether the gate is being removed.

        A pod asking for more than one MPS slice keeps its gate (its ``Unplaceable`` Event
        names what to ask for instead; ``gpuslice ungate`` releases it by hand): gpuslice nodes
        advertise what it asks for, so kube-scheduler would bind it there, beside promises it
        knows nothing of, and its container would be refused slices of two MPS daemons
        (:func:`planner.demand.one_mps_slice`).

        Without reservations (``config.reservation=False``) nothing ever releases a gated pod,
        so every gated pod loses the gate at once, whatever kept it from being planned: one
        whose requests cannot be read as a slice request (``request_error``, e.g. a slice plus
        ``nvidia.com/gpu``), one no node can take, one asking for several MPS slices (the other
        gated pods lose it in :meth:`_read_legacy`)."""
        if not pod.gated:
            return False
        if not self.config.reservation:
            self._ungate(
                pod,
                f"reservations are off and gpuslice cannot place it ({reason}): gpuslice removed "
                f"its scheduling gate, so kube-scheduler places it like any pod",
            )
            return True
        if reason.startswith(Unplaced.MPS_SLICES.value):
            return False
        due = (pod.created if pod.created is not None else self.now) + self.config.policy.timeout
        if self.now < due:
            self.wake(due)
            return False
        if self._problem_nodes is None:  # once per step: this runs for every rejected pod
            self._problem_nodes = [self.index.nodes[n].obj for n in self._label_problems()]
        if any(pod_fits_node(pod.obj, node) for node in self._problem_nodes):
            return False
        if paused_fit(pod.obj, pod.slices, pod.dra, self._paused()) is not None:
            return False
        self._ungate(
            pod,
            f"gpuslice cannot place it ({reason}): gpuslice removed its scheduling gate, so "
            f"kube-scheduler places it like any pod, on a node whose own device plugin offers "
            f"what it asks for",
        )
        return True

    def _read_legacy(self, pod: PodInfo, in_flight: Mapping[str, str]) -> None:
        if pod.gated:
            self._ungate(pod, "reservations are off: gpuslice removed its scheduling gate")
            return
        if not pod.unschedulable:
            return
        if pod.key in in_flight:
            self.waiting[pod.key] = in_flight[pod.key]
            return
        self.candidate(pod, managed=False)

    # ------------------------------------------------------------------ settle and release

    def settle(self) -> None:
        for ledger in self.ledgers.values():
            if ledger.busy:
                continue
            for h in ledger.settle():
                r = h.reservation
                if h.released and not h.pod.gated:
                    self.note(h.pod, None)
                    why = ledger.shortfall(r.units())
                    self._replan_on_node(h.pod, r, f"its slice on node {r.node} is gone: {why}")
                elif ledger.fits(r.units(), 0, 0):  # the slices are there: CPU or memory not
                    self._drop(
                        h.pod,
                        r,
                        f"node {r.node} no longer has the CPU ({h.pod.cpu_milli}m) and memory "
                        f"({h.pod.memory_mib} MiB) it asks for beside its slice (pods bound there "
                        f"since the plan took them)",
                    )
                else:
                    why = f"node {r.node} has no {_units(r.units())} free for it" + (
                        " (it reports Degraded)" if ledger.degraded else ""
                    )
                    if ledger.degraded and r.plan and r.plan == _spec_plan(ledger.np):
                        # the agent refused the very plan this promise was made with (a
                        # Degraded condition about another GPU, and a free slice a bound pod
                        # took, are no reason to leave the node out)
                        self._cool_degraded(ledger.name)
                    self._drop(h.pod, r, why)
        for ledger in self.ledgers.values():
            ledger.pin()

    def _cool_degraded(self, node: str) -> None:
        """A node whose agent refused (part of) its spec, so that a promise there cannot be
        kept, cools down like one that missed its apply deadline: its pods are planned
        elsewhere.  Before, the next plan put the same pod on the same node and wrote the
        refused layout again, every batch window, while another node stood empty."""
        if node in self.cooldown:
            return
        self._cool(node, self.now + self.config.cooldown_s, "DegradedCooldown")
        np = self.index.partitioning(node)
        cond = np.condition("Degraded") if np is not None else None
        said = ""
        if cond is not None:
            said = f" ({cond.reason}: {' '.join(str(cond.message or '').split())[:300]})"
        self.node_event(
            node,
            "DegradedCooldown",
            f"the agent reports Degraded{said}: promises here cannot be kept; its pods are "
            f"planned elsewhere and the node is left out of plans for "
            f"{self.config.cooldown_s:.0f} s",
        )

    def release(self) -> None:
        for ledger in self.ledgers.values():
            if ledger.busy:
                self._release_while_busy(ledger)
                continue
            for h in sorted(ledger.holds, key=Hold.order):
                r = h.reservation
                if h.released:
                    self._check_bound(h)
                    continue
                if not h.pod.gated:  # ungated and planned: kube-scheduler binds it on its own
                    if self.now >= r.deadline:
                        ledger.holds.remove(h)
                        ledger.held.subtract(r.units())
                        self._drop(h.pod, r, f"not bound on node {r.node} by its deadline")
                    continue
                units = r.units()
                if all(ledger.scheduler_room(res) >= k for res, k in units.items()):
                    self._release(ledger, h.pod, r)
                elif self.now >= r.deadline:
                    ledger.holds.remove(h)
                    ledger.held.subtract(units)
                    self._drop(
                        h.pod,
                        r,
                        f"node {r.node} applied its plan but kube-scheduler does not see the "
                        f"slice (node allocatable) after {self.now - r.since:.0f} s",
                    )

    def _release_while_busy(self, ledger: NodeLedger) -> None:
        """A node applying a spec releases a gated pod whose slice exists already and that spec
        does not touch: its reservation is of a free slice (no plan) or of the plan the agent
        applied last, and every GPU with a device of its resources (the kubelet may hand it
        any free one) keeps its layout in the spec in flight.  Before, it waited for the whole spec, and an agent slow on another GPU made it
        miss its deadline with its slice listed free the whole time (a review's finding: its
        node then cooled down and a full GPU elsewhere was drained for it).  Nothing else is
        decided on a busy node until it applies (released pods, deadlines: :meth:`_hold`)."""
        np = ledger.np
        if np is None:
            return
        unchanged: set[int] | None = None
        applied = np.status.planId if np.status is not None else ""
        for h in sorted(ledger.holds, key=Hold.order):
            r = h.reservation
            if h.released or not h.pod.gated or r.plan not in ("", applied):
                continue
            if unchanged is None:
                unchanged = self._unchanged_gpus(ledger, np)
            units = r.units()
            touched = {g.index for g in ledger.gpus for d in g.devices if d.resource in units}
            touched.update(i for idx in r.gpus.values() for i in idx)
            if not touched <= unchanged:
                continue
            if all(ledger.scheduler_room(res) >= k for res, k in units.items()):
                self._release(ledger, h.pod, r)

    def _unchanged_gpus(self, ledger: NodeLedger, np: NodePartitioning) -> set[int]:
        """The GPUs of ``ledger``'s node whose layout its spec keeps as the agent reports it."""
        mode, foreign = ledger.gpu.mode, ledger.foreign
        count = ledger.gpu.gpu_count
        spec = _layout_key(np.spec.gpus)
        now = _layout_key(
            d for i in range(count) if (d := _desired_now(np, i, mode, foreign)) is not None
        )
        return {i for i in range(count) if spec.get(i) == now.get(i)}

    def _release(
        self,
        ledger: NodeLedger,
        pod: PodInfo,
        r: Reservation,
        before: tuple[EmitEvent, ...] = (),
    ) -> None:
        released = replace(
            r, state=State.RELEASED, since=self.now, deadline=self.now + self.config.bind_deadline_s
        )
        patch = release_patch(pod.obj, ledger.name, _annotation(released))
        message = (
            f"released to {_where(ledger.name, r.gpus)}: its slice ({_units(r.units())}) is ready"
        )
        event = EmitEvent(_pod_ref(pod), "Normal", "Released", message)
        self._patch(PatchPod(pod.key, _pod_ref(pod), patch, "release", None, (*before, event)))
        ledger.released_unbound.update(r.units())
        for resource in r.units():  # the kubelet may give it any free slice of that size
            ledger.pin_slices(resource)
        self.note(pod, released)
        self.counts["releases"] += 1

    def _check_bound(self, h: Hold) -> None:
        r = h.reservation
        if self.now < r.deadline or _mark(h.pod) in self.stranded_since:
            return  # a pod that cannot bind there is stranded already (:meth:`_hold`)
        self.once(  # no elapsed time in the text: one Event, not one per step
            h.pod,
            "NotBound",
            f"released to node {r.node} and not bound within {r.deadline - r.since:.0f} s; "
            f"its slice is still held for it",
            "Warning",
        )

    # ------------------------------------------------------------------ free slices

    def fast_path(self) -> None:
        kept = self._keep_for_pinned()
        usable = [
            ledger
            for ledger in self.ledgers.values()
            if not ledger.busy and self._open(ledger.name)
        ]
        free_nodes: dict[str, list[NodeLedger]] = {}
        for ledger in usable:
            keep = kept.get(ledger.name)
            for resource, k in ledger.free().items():
                if k > 0 and (keep is None or k > keep[resource]):
                    free_nodes.setdefault(resource, []).append(ledger)
        if not free_nodes:
            return
        offered = frozenset(free_nodes)
        tiers = self.config.planner_settings.wait_tiers_s
        deep = self.deep_queue()
        if not tiers:
            starving_after = math.inf
        elif deep:
            starving_after = min(self.config.aged_after_s, tiers[-1])
        else:
            starving_after = tiers[0]
        now, managed, restricted = self.now, self.managed, self.restricted
        # Only the pods the loop below would not skip take part, and only they are ranked:
        # those a free slice could serve (``offered`` only shrinks), and those old enough to
        # keep slices; in a deep queue only a one-unit pod keeps, the first of its request.
        order: list[str] = []
        keeping: set[str] = set()
        for name, pod in self.candidates.items():  # highest priority, then oldest first
            if name not in managed or name in restricted or not pod.slices:
                continue
            if not pod.resources <= offered:
                if now - (pod.created if pod.created is not None else now) < starving_after:
                    continue
                if deep:
                    if sum(pod.slices.values()) != 1:
                        continue
                    (request,) = pod.slices
                    if request in keeping:
                        continue
                    keeping.add(request)
            order.append(name)
        kept_for: set[str] = set()
        if deep:
            # Overload: throughput rules.  Smaller pods first (fewest units; oldest first among
            # equals), as the plan's objective counts pods placed: free slices that would serve
            # several one-GPU pods do not go to one whole-node pod ahead of them.  Only a pod
            # past ``aged_after_s`` is served oldest first and may keep free slices from
            # younger ones (below; a kept slice idles until the next plan): in a queue that
            # lasts, no shape starves behind the others.
            candidates, aged_before = self.candidates, now - starving_after

            def rank(key: str) -> tuple[int, bool, int]:
                pod = candidates[key]
                aged = pod.created is not None and pod.created <= aged_before
                return (-pod.priority, not aged, 0 if aged else sum(pod.slices.values()))

            order.sort(key=rank)
        protected: set[str] = set()
        unserved: set[tuple[int, int, int, int]] = set()
        """(request, eligible set, CPU, memory) of pods that found no free slice this step: free
        slices only go and kept nodes only grow during the loop, so a later pod asking the
        same finds none either (requests and eligible sets are shared objects in the index)."""
        for key in order:  # managed, not restricted, asking for slices (above)
            pod = self.candidates[key]
            waited = now - (pod.created if pod.created is not None else now)
            if waited < starving_after and not pod.resources <= offered:
                continue  # no free slice can serve it and it keeps none (below)
            options: list[NodeLedger] = []
            eligible = self.index.eligible(pod, self.gpu_nodes)
            ask = (id(pod.slices), id(eligible), pod.cpu_milli, pod.memory_mib)
            if pod.resources <= offered and ask not in unserved:
                first = min(pod.slices, key=lambda r: len(free_nodes[r]))
                options = [
                    ledger
                    for ledger in free_nodes[first]
                    if ledger.name in eligible
                    and ledger.name not in protected
                    and ledger.fits(
                        pod.slices, pod.cpu_milli, pod.memory_mib, kept.get(ledger.name)
                    )
                ]
            if not options:
                unserved.add(ask)
                # Oldest first across shapes: a one-GPU pod that has waited past the first tier
                # (the last in a deep queue) and that no free slice serves keeps the free slices
                # of its nodes from younger pods, so the next plan can repartition them for it
                # (a free 7g becomes its 4g).
                if waited >= starving_after and sum(pod.slices.values()) == 1:
                    if deep:
                        # one node per request (the oldest pod's): the rest keep serving
                        (request,) = pod.slices  # its one resource, one unit
                        if request in kept_for:
                            continue
                        kept_for.add(request)
                        room = [
                            led
                            for led in usable
                            if led.name in eligible and led.name not in protected
                        ]
                        if room:
                            protected.add(max(room, key=_idle_compute).name)
                    else:
                        protected |= eligible
                    if all(led.name in protected for led in usable):
                        return
                continue
            ledger = max(options, key=lambda led: (_packing(led, pod.slices), led.name))
            self._reserve_free(ledger, pod)
            keep = kept.get(ledger.name)
            for resource in pod.slices:
                left = ledger.free()[resource] - (keep[resource] if keep is not None else 0)
                if left <= 0 and ledger in free_nodes.get(resource, ()):
                    free_nodes[resource].remove(ledger)
                    if not free_nodes[resource]:
                        del free_nodes[resource]
            if not free_nodes:
                return
            offered = frozenset(free_nodes)

    def _keep_for_pinned(self) -> dict[str, Counter[str]]:
        """Per node, the free units kept from the fast path for released pods whose promise
        broke (:meth:`settle`: a pod gpuslice did not gate took one unit of two, a device
        turned unhealthy).  Such a pod stays pinned to its node (its affinity was narrowed
        there and cannot be widened) and is re-planned there by the next batch; the free units
        of its request there (highest priority, then oldest first) wait for that plan, which
        adds what it misses to them.  Before, the fast path gave them to newer pods, and the
        plan had to make the pinned pod's whole request anew."""
        kept: dict[str, Counter[str]] = {}
        if not self.restricted:
            return kept
        for key in [k for k in self.candidates if k in self.restricted]:  # priority, age
            pod = self.candidates[key]
            (node,) = self.restricted[key]
            ledger = self.ledgers.get(node)
            if ledger is None or ledger.busy or not self._open(node):
                continue
            keep = kept.setdefault(node, Counter())
            free = ledger.free()
            for r, k in pod.slices.items():
                keep[r] += max(0, min(k, free[r] - keep[r]))
        return kept

    def _reserve_free(self, ledger: NodeLedger, pod: PodInfo) -> None:
        gpus = ledger.choose_gpus(pod.slices)
        r = Reservation(
            ledger.name,
            State.PLANNED,
            gpus,
            "",
            self.now,
            self.now + self.config.apply_deadline_s,
            pod.uid,
        )
        ledger.add_hold(Hold(pod, r))
        self._drop_candidate(pod)
        self.managed.discard(pod.key)
        self.drains.pop(pod.key, None)
        self.counts["fast"] += 1
        if all(ledger.scheduler_room(res) >= k for res, k in pod.slices.items()):
            # one patch reserves and releases: its Events only once it is written (a 409 or
            # 404 left a pod showing a reservation it did not have)
            self._release(ledger, pod, r, (self._reserve_event(pod, r, "a free slice", False),))
            return
        self._reserve(pod, r, None, "a free slice; waiting for the node to advertise it")

    def _reserve(self, pod: PodInfo, r: Reservation, after: str | None, how: str) -> None:
        event = self._reserve_event(pod, r, how, emit=False)
        patch = _rv_patch(pod, _annotation(r))
        self._patch(PatchPod(pod.key, _pod_ref(pod), patch, "reserve", after, (event,)))
        self.note(pod, r)

    def _reserve_event(
        self, pod: PodInfo, r: Reservation, how: str, emit: bool = True
    ) -> EmitEvent:
        message = f"reserved {_units(r.units())} on {_where(r.node, r.gpus)}" + (
            f" (plan {r.plan}, {how})" if r.plan else f" ({how})"
        )
        event = EmitEvent(_pod_ref(pod), "Normal", "Reserved", message)
        if emit:
            self.actions.append(event)
        return event

    # ------------------------------------------------------------------ drains

    def complete_drains(self) -> None:
        for key in sorted(self.drains, key=lambda k: _order(self.candidates[k])):
            if key not in self.candidates:
                continue
            r = self.drains[key]
            ledger = self.ledgers.get(r.node)
            if ledger is None or ledger.busy or not self._open(r.node):
                continue
            frozen = {i for g in r.gpus.values() for i in g}
            gpus = [g for g in ledger.gpus if g.index in frozen]
            if len(gpus) < len(frozen):  # the node no longer has them all: it never empties
                self._end_drain(
                    key,
                    f"node {r.node} no longer has GPU(s) "
                    f"{', '.join(str(i) for i in sorted(frozen - {g.index for g in gpus}))} "
                    f"drained for it",
                )
                continue
            if any(d.used or d.pinned for g in gpus for d in g.devices):
                continue
            self._plan_drained(ledger, self.candidates[key], frozen, r)

    def _with_mps_target(self, settings: PlannerSettings) -> PlannerSettings:
        """``settings`` with the MPS packing target learned from the cluster's pods
        (:mod:`partitioner.mps_target`), unless one is given or the polish is off."""
        if (
            not settings.mps_polish
            or settings.free_capacity_mps_shapes is not None
            or settings.free_capacity_mps_sizes is not None
        ):
            return settings
        mps_nodes = frozenset(
            n
            for n, info in self.gpu_nodes.items()
            if info.gpu is not None and info.gpu.mode is Mode.MPS
        )
        if not mps_nodes:
            return settings
        shapes = learned_mps_shapes(self.index.pods.values(), self.candidates.values(), mps_nodes)
        return settings if shapes is None else replace(settings, free_capacity_mps_shapes=shapes)

    def _plan_drained(
        self, ledger: NodeLedger, pod: PodInfo, frozen: set[int], r: Reservation
    ) -> None:
        for g in ledger.gpus:
            g.frozen = g.index not in frozen  # the planner sees only the drained GPUs
        node_state = ledger.node_state()
        for g in ledger.gpus:
            g.frozen = g.index in frozen
        pending = self._pending(pod, frozenset({ledger.name}))
        plan_id = self.next_id()
        try:
            plan = self.config.planner(
                Snapshot(nodes=(node_state,), pods=(pending,)),
                self.config.planner_settings,
                self.config.catalog,
            )
        except Exception:  # planning errors are reported by the batch plan
            return
        assignment = plan.assignments.get(pod.key)
        if assignment is None:  # emptied, yet it cannot go there (CPU/memory taken since)
            why = plan.unplaced.get(pod.key, "the node cannot take it now")
            self._end_drain(
                pod.key, f"the GPUs drained for it on node {r.node} are empty but {why}"
            )
            return
        self._write_plan(plan, plan_id, {pod.key: pod})
        self.counts["drained"] += 1
        self._drop_candidate(pod)
        self.managed.discard(pod.key)
        self.drains.pop(pod.key, None)

    def cluster_gpus(self) -> int:
        """GPUs of every node with a ledger (the deep-queue limit is per GPU of these)."""
        return sum(len(ledger.gpus) for ledger in self.ledgers.values())

    def deep_queue(self) -> bool:
        """More slice units wait (gated candidates) than ``drain_queue_limit`` per GPU of the
        cluster, and more than one, and they would fill more GPUs than that too
        (:func:`_gpu_equivalents`): overload, where no drain starts and the fast path serves
        the smallest pods first, those past ``aged_after_s`` first (module docstring).  Counted
        in units alone, two 1g pods and one 7g pod made a queue deep on 20 GPUs (limit 2),
        so pairs of small pods arriving every half hour ended the 7g pod's drain each time and
        it was never served (a review's s5); as GPUs, that queue is 1.3 of them."""
        limit = self.queue_limit()
        counts = self.candidate_resources
        return counts.total() > limit and _gpu_equivalents(counts) > limit

    def queue_limit(self) -> float:
        """Slice units that may wait before the queue is deep: ``drain_queue_limit`` per GPU of
        the cluster, at least 1."""
        return max(1.0, self.config.drain_queue_limit * self.cluster_gpus())

    def preempt(self, plan: Plan) -> None:
        """Step 7b: hand kube-scheduler the gated pods only its preemption can serve now.

        A gated pod is invisible to kube-scheduler, so its preemption never acts for it: a
        high-priority pod whose slices lower-priority pods hold would wait for them to end (or
        for a drain), where without gpuslice kube-scheduler evicts them at once.  A candidate
        the plan left unplaced for capacity that may preempt (``preemptionPolicy`` is not
        ``Never``), has no reservation (not draining) and asks through extended resources has
        a node it may use where its free slices plus those of bound pods of lower priority
        cover every unit it asks for, its CPU and its memory, less what pods handed over
        before it in this step (highest priority first) need there: it loses the gate with a
        ``Preempting`` Event naming that node.  kube-scheduler then preempts as it does for any
        pod (its own choice of node and victims, PodDisruptionBudgets and graceful termination
        included) and nominates a node; the nominated pod's units are kept there from every
        reservation and plan (:meth:`~partitioner.ledger.NodeLedger.add_nominated`) until it
        binds.  Only exact slices count, as for kube-scheduler: a pod asking for a ``7g``
        instance cannot preempt ``1g`` pods (the GPU would have to be repartitioned; it waits,
        or gets a drain).  If kube-scheduler does not preempt after all, the pod is an ungated
        pod like one created while the webhook was down: planned, never released, bound when
        its slice exists.  No pod is handed over while a node it may use shows kube-scheduler
        room for it (:meth:`_binds_without_preempting`: that room is promised to other pods,
        which kube-scheduler would give it instead of preempting).

        Cost: the candidates that outrank the lowest-priority slice pod (the index keeps that
        priority; none where all share one), one pass over the pods when one of them may
        preempt, then per candidate the first node that serves it (nodes in name order, each
        node's free slices and freed units computed once); candidates alike in priority,
        request and eligible nodes that found no node are not searched again (what is handed
        over only shrinks the room)."""
        if not (self.config.reservation and self.config.preemption):
            return
        room: _PreemptionRoom | None = None
        misses: set[tuple[int, int, frozenset[str]]] = set()
        lowest = self.index.lowest_slice_priority()  # at most the room's (any node counts)
        for key, pod in self.candidates.items():  # highest priority first
            if pod.priority <= lowest:
                # no later candidate outranks a bound slice pod either; without this the loop
                # read every candidate each step (one priority for all: it stops at the first)
                break
            if key not in self.managed or pod.reservation is not None or not pod.preempts:
                continue
            if pod.dra:  # a claim's devices: not modelled here (it waits, or gets a drain)
                continue
            if not self._short_of_capacity(key, pod, plan):
                continue
            if self._binds_without_preempting(pod):
                continue
            if room is None:  # once per step, and only when some pod could preempt
                room = _PreemptionRoom(self.index, self.ledgers)
            if pod.priority <= room.lowest:
                break  # candidates are in priority order: no later one outranks a bound pod
            eligible = self.index.eligible(pod, self.gpu_nodes)
            sig = (pod.priority, id(pod.slices), eligible)
            if sig in misses:
                continue
            node = room.take(pod, room.order(eligible), self._open)
            if node is None:
                misses.add(sig)
                continue
            message = (
                f"no free slice fits it and no plan can make one without moving pods, but "
                f"lower-priority pods hold {_units(pod.slices)} on node {node}: gpuslice "
                f"removed its scheduling gate so kube-scheduler can preempt them, as it would "
                f"without gpuslice (preemptionPolicy: Never keeps a pod waiting instead)"
            )
            self._hand_over(key, pod, message, "Preempting", "preempting")

    def scale_up(self, plan: Plan) -> None:
        """Step 7c: with ``scale_up_after_s``, hand the cluster autoscaler the gated pods the
        cluster has no room for.

        The cluster autoscaler adds nodes for pods kube-scheduler found unschedulable; a gated
        pod is never tried, so behind gpuslice's gate a full cluster never grows.  A gated
        candidate without a reservation that the plan could not place for lack of capacity
        (:meth:`_short_of_capacity`) and that has waited ``scale_up_after_s`` loses its gate
        with a ``ReleasedForScaleUp`` Event: kube-scheduler tries it, marks it unschedulable,
        and the autoscaler may add a node whose template advertises what it asks for.  From
        then on it is served like a pod created while the webhook was down: planned (a new
        opted-in node included), never released, bound by kube-scheduler once its slice exists,
        without a reservation.  Off (0) by default: without an autoscaler it only gives up the
        promise."""
        after = self.config.scale_up_after_s
        if not (self.config.reservation and after > 0):
            return
        for key, pod in self.candidates.items():
            if key not in self.managed or key in self.handed_over or pod.reservation is not None:
                continue
            waited = self.now - (pod.created if pod.created is not None else self.now)
            if waited < after or not self._short_of_capacity(key, pod, plan):
                continue
            if self._binds_without_preempting(pod):
                continue
            message = (
                f"waited {waited:.0f} s and no node has room for {_units(pod.slices)}: gpuslice "
                f"removed its scheduling gate (scaleUpAfterSeconds {after:g}) so kube-scheduler "
                f"marks it unschedulable and the cluster autoscaler can add a node for it; it "
                f"is still planned, without a reservation"
            )
            self._hand_over(key, pod, message, "ReleasedForScaleUp", "scale_up")

    def _binds_without_preempting(self, pod: PodInfo) -> bool:
        """kube-scheduler would bind ``pod`` at once, ungated, on a node it may use: that
        node's allocatable minus its bound (and nominated) pods' units covers its slices.  Such
        room is slices gpuslice promised to other pods (held for gated ones, or released ones
        not bound yet) or keeps for an older pod: kube-scheduler knows nothing of promises and
        would give one away (a review's finding: a ``Preempting`` pod bound onto the slice
        promised to a pod of higher priority, and nobody was preempted).  It is not handed
        over while that lasts: the promised pods bind, and then it is.  kube-scheduler's view
        of the node's CPU and memory counts bound and nominated pods, not the held ones: a node
        where the pod does not fit them is no such room (it would preempt elsewhere)."""
        for name in self.index.eligible(pod, self.gpu_nodes):
            ledger = self.ledgers.get(name)
            if ledger is None:
                continue
            if not all(
                ledger.scheduler_room(r) + ledger.released_unbound[r] >= k
                for r, k in pod.slices.items()
            ):
                continue
            cpu = ledger.cpu_free + sum(h.pod.cpu_milli for h in ledger.holds)
            memory = ledger.memory_free + sum(h.pod.memory_mib for h in ledger.holds)
            if pod.cpu_milli <= cpu and pod.memory_mib <= memory:
                self.counts["handover_deferred"] += 1
                return True
        return False

    def _hand_over(self, key: str, pod: PodInfo, message: str, reason: str, count: str) -> None:
        """Remove gpuslice's gate from candidate ``key`` (Event ``reason``: ``message``) so
        kube-scheduler takes it from here (:attr:`handed_over`); counted as ``count``."""
        self._ungate(pod, message, reason)
        self.handed_over.add(key)
        self.counts[count] += 1

    def start_drains(self, plan: Plan) -> None:
        if not self.config.reservation or self.config.drain_fraction <= 0:
            return
        if self.deep_queue():
            self.counts["drains_deep_queue"] += 1
            self._tell_too_big_to_drain()
            return  # overload: no new drain (the ones started stay until they complete)
        frozen_now = sum(1 for ledger in self.ledgers.values() for g in ledger.gpus if g.frozen)
        full = drain_budget(self.ledgers.values(), self.config.drain_fraction)
        budget = full - frozen_now
        self.drain_room = budget > 0
        if budget <= 0:  # every pod below would stop at ``need > budget`` or be skipped
            return
        for pod in self._starving(plan):
            need = sum(pod.slices.values())
            if need > full:
                # More GPUs than the whole budget (a whole-node pod on a small cluster): never
                # drained, and it does not hold the younger ones back. Freezing a whole node
                # until its longest pod ends costs every other pod far more than it saves.
                # Its owner is told once why it waits and what changes that.
                self.once(
                    pod,
                    "NotDrained",
                    f"waits for {need} GPU(s) on one node, more than the drain budget of {full} "
                    f"GPU(s) (drainFraction {self.config.drain_fraction:g} of the cluster's "
                    f"GPUs): no GPU is emptied for it, it starts when a node frees enough by "
                    f"itself; raise partitioner.reservations.drainFraction, or give such jobs "
                    f"a node pool of their own (docs/operations.md, 'Whole-node jobs')",
                )
                continue
            if need > budget:  # in age order: no younger pod overtakes an older starving one
                break
            eligible = self.index.eligible(pod, self.gpu_nodes)
            options = [
                self.ledgers[n] for n in sorted(eligible) if n in self.ledgers and self._open(n)
            ]
            choice = choose_drain(pod.slices, pod.cpu_milli, pod.memory_mib, options)
            if choice is None:
                continue
            if self.ledgers[choice.node].breaks_holds(choice.gpus):
                # A frozen GPU's devices leave the ledger: the next step would break the holds
                # that counted on them (a released pod's slice "taken", then planned over by
                # the drain).  Not now: held slices are bound or given back within a deadline.
                self.counts["drains_deferred_for_holds"] += 1
                continue
            gpus: dict[str, tuple[int, ...]] = {}
            left = list(choice.gpus)
            for resource in sorted(pod.slices):
                k = pod.slices[resource]
                gpus[resource], left = tuple(left[:k]), left[k:]
            r = Reservation(choice.node, State.DRAINING, gpus, "", self.now, pod=pod.uid)
            for g in self.ledgers[choice.node].gpus:
                if g.index in choice.gpus:
                    g.frozen = True
            budget -= need
            self.drain_room = budget > 0
            waited = self.now - (pod.created or self.now)
            message = (
                f"waited {waited:.0f} s and no GPU can host it without moving pods: draining "
                f"{_where(choice.node, gpus)} for it (no new pod goes there until it is free)"
            )
            event = EmitEvent(_pod_ref(pod), "Normal", "Draining", message)
            patch = _rv_patch(pod, _annotation(r))
            self._patch(PatchPod(pod.key, _pod_ref(pod), patch, "reserve", None, (event,)))
            self.note(pod, r)
            self.counts["drains_started"] += 1

    def _tell_too_big_to_drain(self) -> None:
        """A starving pod that alone makes the queue deep (its own units exceed
        ``drain_queue_limit`` per GPU, with what else waits within it) is never drained: told
        once (``NotDrained``) which setting decides, as a pod larger than the drain budget is.
        Otherwise it waited without a word, and the budget the docs name changed nothing."""
        limit = self.queue_limit()
        total = self.candidate_resources.total()
        widest = max((len(ledger.gpus) for ledger in self.ledgers.values()), default=0)
        if total - limit > _MAX_UNITS_PER_GPU * widest:
            return  # no pod can need that much of one node: the queue is deep without any one
        for pod in self.candidates.values():
            need = sum(pod.slices.values())
            if (
                need <= limit
                or total - need > limit
                or pod.key not in self.managed
                or self.now - (pod.created if pod.created is not None else self.now)
                < self.config.drain_after_s
            ):
                continue
            self.once(
                pod,
                "NotDrained",
                f"waits for {need} GPU(s) on one node, more slice units than the drain queue "
                f"limit lets wait while GPUs are drained ({limit:g}: drainQueueLimit "
                f"{self.config.drain_queue_limit:g} per GPU of the cluster's "
                f"{self.cluster_gpus()}): no GPU is emptied for it, it starts when a node frees "
                f"enough by itself; raise partitioner.reservations.drainQueueLimit, or give "
                f"such jobs a node pool of their own (docs/operations.md, 'Whole-node jobs')",
            )

    def _starving(self, plan: Plan) -> Iterable[PodInfo]:
        """Gated candidates that waited ``drain_after_s`` and that no plan could place for lack
        of capacity, in :func:`_order`: the plan left them unplaced for capacity, or the batch
        left them out at their resource's bound (:meth:`planning_input`) although a plannable
        node is eligible for them."""
        need = self.config.drain_overtaken
        younger: list[float] | None = None
        """Creation times of the slice pods bound now, sorted (read once, if ``need``)."""
        for key, pod in self.candidates.items():  # in _order already
            if key not in self.managed or key in self.drains or key in self.handed_over:
                continue
            if self.now - (pod.created or self.now) < self.config.drain_after_s:
                continue
            if need:
                if younger is None:
                    younger = sorted(
                        b.created
                        for b in self.index.pods.values()
                        if b.node in self.gpu_nodes
                        and b.slices
                        and b.created is not None
                        and not b.finished
                    )
                created = pod.created if pod.created is not None else self.now
                if len(younger) - bisect.bisect_right(younger, created) < need:
                    continue  # not overtaken often enough: served in turn, no drain
            if self._short_of_capacity(key, pod, plan):
                yield pod

    def _short_of_capacity(self, key: str, pod: PodInfo, plan: Plan) -> bool:
        """The plan could not place candidate ``key`` for lack of capacity: it left it unplaced
        for capacity, or the batch left it out at its resource's bound
        (:meth:`planning_input`) although a plannable node is eligible for it."""
        why = plan.unplaced.get(key)
        if why is not None:
            return why.startswith(Unplaced.CAPACITY.value)
        return bool(
            key not in plan.assignments
            and key not in self.batched
            and self.index.eligible(pod, self.gpu_nodes) & self.plannable
        )

    # ------------------------------------------------------------------ planning

    def _pending(self, pod: PodInfo, eligible: frozenset[str]) -> PendingPod:
        """The planner's view of ``pod``, built positionally (a third cheaper than by keyword:
        :meth:`planning_input` builds thousands a step)."""
        created, now = pod.created, self.now
        waited = now - created if created is not None and created < now else 0.0
        return PendingPod(
            pod.key, dict(pod.slices), pod.cpu_milli, pod.memory_mib, pod.priority, eligible, waited
        )

    def planning_input(self) -> tuple[Snapshot, dict[str, PodInfo]]:
        """The planner's snapshot: plannable nodes and the candidates that could be placed.

        Per resource the batch holds at most as many units as the plannable GPUs could still
        offer without moving a pinned device (:class:`_UnitBounds`), the longest-waiting pods of
        the highest priority first: a plan cannot place more, so the rest would only cost
        planning time (with thousands of pods waiting for a few GPUs).  They stay candidates
        for the next batch; once every resource is at its bound the scan stops, so a step's
        cost does not grow with the pods that cannot be placed anyway.
        The first pod of a resource always enters (the planner says why it cannot be placed).

        Also sets :attr:`plan_key`: what the plan of this snapshot depends on — its nodes and,
        per pod, its requests, CPU, memory, priority, eligible nodes and waiting time only
        through the waiting tiers it has passed — so an unchanged input reuses the last plan.
        """
        plannable = {
            name: ledger
            for name, ledger in self.ledgers.items()
            if not ledger.busy and self._open(name)
        }
        nodes = tuple(plannable[n].node_state() for n in sorted(plannable))
        bound = self.unit_bound = _UnitBounds(
            plannable.values(), self.config.planner_settings.mps_reserve_mib
        )
        taken: dict[str, int] = {}
        pods: list[PendingPod] = []
        rows: list[tuple[str, tuple[object, ...], frozenset[str], int]] = []
        # a pod's tier: how many thresholds it has passed (``waited >= t``), in any order
        tiers = sorted(self.config.planner_settings.wait_tiers_s)
        by_key: dict[str, PodInfo] = {}
        plannable_names = self.plannable = frozenset(plannable)
        limits = {r: bound(r) for r, n in self.candidate_resources.items() if n > 0}
        too_big: set[tuple[tuple[str, int], ...]] = set()
        """Requests of the pods no node can hold now that entered the batch (one pod each)."""
        too_big_of: dict[int, bool] = {}
        """id(request) -> whether no node could hold it now (the pods keep the objects alive)."""
        unsaturated = set(limits)
        usable_of: dict[int, tuple[frozenset[str], frozenset[str]]] = {}
        """id(eligible set) -> (that set, its plannable part): pods sharing an eligible set
        (:meth:`ClusterIndex.eligible`) share one intersection, and one set in the snapshot."""
        topology, restricted = self.index.topology, self.restricted
        for i, (key, pod) in enumerate(list(self.candidates.items())):  # oldest first
            if not unsaturated:  # every resource is at its bound: the rest are capped
                self.counts["capped"] += len(self.candidates) - i
                break
            cached = pod.eligible_cache
            eligible = (
                cached[1]
                if cached is not None and cached[0] == topology
                else self.index.eligible(pod, self.gpu_nodes)
            )
            if key in restricted:
                eligible = eligible & self.restricted[key]
                usable = eligible & plannable_names
            else:
                hit = usable_of.get(id(eligible))
                if hit is None or hit[0] is not eligible:
                    usable = eligible & plannable_names
                    usable = eligible if usable == eligible else usable
                    usable_of[id(eligible)] = (eligible, usable)
                else:
                    usable = hit[1]
            if not usable:
                self.waiting[key] = (
                    "no eligible node can be planned now (applying a previous plan, cooling "
                    "down after a missed deadline, or left out for a problem: see the node's "
                    f"{NODE_CONDITION} condition): " + ", ".join(sorted(eligible))
                )
                if key in self.managed:  # gated: nothing else tells it why it waits
                    self.once(pod, "Waiting", self._unplannable(eligible))
                continue
            slices = pod.slices
            big = too_big_of.get(id(slices))  # one answer per request object (shared by pods)
            if big is None:
                big = too_big_of[id(slices)] = any(
                    k > 1 and k > bound.node_max(r) for r, k in slices.items()
                )
            if big:
                # All of a pod's units go to one node: a pod that no node could hold now cannot
                # be placed by this plan, and counting its units against the resource's bound
                # would crowd out pods that can (a burst of one-GPU pods behind whole-node pods
                # waited 48,000 s on a cluster with 21 free GPUs).  The oldest such pod of each
                # request still enters the batch, taking none of the bound: the plan tells it
                # why it waits (its Event), and drains see it; the younger ones of the same
                # request wait outside it, so the batch stays small however many wait.
                self.counts["too_big_now"] += 1
                request = tuple(sorted(slices.items()))
                if request in too_big:
                    self.waiting[key] = (
                        "no node can hold its request now (slices in use on every node), "
                        "nor an older pod's of the same request"
                    )
                    continue
                too_big.add(request)
            else:
                over = False
                for r, k in slices.items():
                    have = taken.get(r, 0)
                    if have and have + k > limits[r]:
                        over = True
                        break
                if over:
                    self.waiting[key] = "more pods wait for this resource than the GPUs can hold"
                    self.counts["capped"] += 1
                    continue
                for r, k in slices.items():
                    have = taken[r] = taken.get(r, 0) + k
                    if have >= limits[r]:
                        unsaturated.discard(r)
            pending = self._pending(pod, usable)
            pods.append(pending)
            by_key[key] = pod
            rows.append((key, pod.plan_sig, usable, bisect.bisect_right(tiers, pending.waited_s)))
        pods.sort(key=lambda p: p.name)
        rows.sort(key=lambda row: row[0])  # the pod key: the order of ``pods``
        self.batched = by_key.keys()
        self.plan_key = (nodes, tuple(rows))
        return Snapshot(nodes=nodes, pods=tuple(pods)), by_key

    def _write_plan(self, plan: Plan, plan_id: str, pods: Mapping[str, PodInfo]) -> int:
        """Specs for changed nodes and reservations (or Events) for placed pods."""
        reconfigured = 0
        by_node: dict[str, list[str]] = {}
        for key, a in sorted(plan.assignments.items()):
            by_node.setdefault(a.node, []).append(key)
        written: set[str] = set()
        failed: set[str] = set()
        for node in sorted({n for n, _ in plan.layouts}):
            ledger = self.ledgers.get(node)
            if ledger is None:
                continue
            np = ledger.np
            try:
                gpus = [
                    g
                    for i in range(ledger.gpu.gpu_count)
                    if (
                        g := _desired_planned(plan.layouts[(node, i)])
                        if (node, i) in plan.layouts
                        else _held_whole(ledger, i)
                        or (
                            _desired_now(np, i, ledger.gpu.mode, ledger.foreign)
                            if ledger.reported
                            else _desired_adopted(ledger, i)
                        )
                    )
                    is not None
                ]
                spec = NodePartitioningSpec(planId=plan_id, mode=ledger.gpu.mode.value, gpus=gpus)
            except ValueError as e:
                # A layout no spec can hold (a bug between the planner and the spec's
                # rules): this node's part of the plan is dropped, its pods wait for the
                # next batch, and every other node's spec is still written -- one bad node
                # raised out of the whole step before, every step, for the whole cluster.
                failed.add(node)
                why = " ".join(str(e).split())[:400]
                self.write_error = self.write_error or (
                    f"plan {plan_id} for node {node} not written: {why}"
                )
                info = self.index.nodes.get(node)
                self.actions.append(
                    EmitEvent(
                        _node_ref(info) if info is not None else ObjectRef("Node", node),
                        "Warning",
                        "PlanNotWritten",
                        f"plan {plan_id} not written: its layout for this node is not a valid "
                        f"spec ({why}); the node's pods are planned again next batch. Please "
                        "report this with the NodePartitioning's status",
                    )
                )
                continue
            old = _layout_key(np.spec.gpus if np is not None else ())
            new = _layout_key(gpus)
            if old == new and ledger.reported and np is not None:
                # The spec asks for this layout already, but only the status says what exists:
                # a Degraded agent refused (part of) that spec, and a plan that asks for it
                # again would otherwise promise its pods slices that are not there ("slice
                # free on the node"), dropped at the next step, again every batch.  Write it
                # again (a new plan id: the agent retries, the pods wait for it as planned).
                old = _layout_key(
                    d
                    for i in range(ledger.gpu.gpu_count)
                    if (
                        d := _held_whole(ledger, i)
                        or _desired_now(np, i, ledger.gpu.mode, ledger.foreign)
                    )
                    is not None
                )
            if old == new:
                continue
            reconfigured += sum(1 for i in set(old) | set(new) if old.get(i) != new.get(i))
            keys = tuple(by_node.get(node, ()))
            events: tuple[EmitEvent, ...] = ()
            if not self.config.reservation:
                events = tuple(
                    EmitEvent(_pod_ref(pods[k]), "Normal", "Planned", _planned(plan, k, plan_id))
                    for k in keys
                    if k in pods
                )
            rv = np.metadata.resourceVersion if np is not None else None
            self.actions.append(WriteSpec(node, spec, rv, keys, events, planned_at=self.now))
            ledger.busy = True
            written.add(node)
        for key, a in sorted(plan.assignments.items()):
            pod = pods.get(key)
            if pod is None or a.node in failed:
                continue
            if not self.config.reservation:
                if a.node not in written:
                    message = _planned(plan, key, plan_id) + " (no repartitioning needed)"
                    self.actions.append(EmitEvent(_pod_ref(pod), "Normal", "Planned", message))
                continue
            self._reserve_planned(pod, a, plan_id if a.node in written else "", a.node in written)
        return reconfigured

    def _reserve_planned(self, pod: PodInfo, a: Assignment, plan_id: str, written: bool) -> None:
        released = (
            not pod.gated
            and pod.reservation is not None
            and pod.reservation.state is State.RELEASED
        )
        deadline = self.now + self.config.apply_deadline_s
        if released:  # a released pod re-planned on its node: already ungated
            deadline += self.config.bind_deadline_s
        state = State.RELEASED if released else State.PLANNED
        r = Reservation(a.node, state, dict(a.gpus), plan_id, self.now, deadline, pod.uid)
        how = "node applying its new layout" if written else "slice free on the node"
        self._reserve(pod, r, a.node if written else None, how)
        ledger = self.ledgers.get(a.node)
        if ledger is not None:
            ledger.add_hold(Hold(pod, r))

    def plan_batch(self) -> tuple[Plan | None, str, tuple[str, ...], int, str]:
        topology, switching = self.index.topology, self.switching
        candidates: list[str] = []
        for k, pod in self.candidates.items():
            cached = pod.eligible_cache  # ClusterIndex.eligible's cache, read inline (hot loop)
            eligible = (
                cached[1]
                if cached is not None and cached[0] == topology
                else self.index.eligible(pod, self.gpu_nodes)
            )
            if not eligible <= switching:
                candidates.append(k)
        retry = self._version() != self.state.plan_version or self.now >= self.state.replan_at
        window = observe(self.state.window, candidates, self.now, self.config.policy, retry)
        if not due(window, self.now, self.config.policy):
            self.window = window
            return None, "", (), 0, ""
        snapshot, pods = self.planning_input()
        self.planned_snapshot = snapshot
        batch = tuple(sorted(candidates))
        self.window = planned(window, batch, self.now)
        self.plan_version = self._version()
        if not snapshot.pods:
            return None, "", batch, 0, ""
        if not any(
            self.ledgers[n.name].has_room() for n in snapshot.nodes if n.name in self.ledgers
        ):  # every GPU is full: nothing to solve
            reason = f"{Unplaced.CAPACITY.value}: every GPU of its eligible nodes is in use"
            plan = Plan({}, {}, {p.name: reason for p in snapshot.pods}, status="FULL")
            self.counts["plans_skipped_full"] += 1
            for key_, why in sorted(plan.unplaced.items()):
                self.once(pods[key_], "Unplaceable", f"cannot place: {why}", "Warning")
            self.preempt(plan)
            self.scale_up(plan)
            self.start_drains(plan)
            return plan, "", batch, 0, ""
        plan_id = self.next_id()
        key = self.plan_key
        try:
            if self.last_plan is not None and self.last_plan[0] == key:
                plan = self.last_plan[1]
                self.counts["plans_reused"] += 1
            else:
                settings = self._with_mps_target(self.config.planner_settings)
                if settings.policy is not Policy.GREEDY and not self._may_place(snapshot):
                    # No pod can get its units on any plannable node: the plan places nothing
                    # and changes no layout (churn costs, placing gains nothing), so a solve
                    # would only confirm it.  The greedy pass the planner starts with gives
                    # the same plan and the same reasons at a fraction of the cost (a full
                    # cluster with free slices nobody waiting can use: most batches in
                    # overload, tests/test_partitioner_no_room.py).
                    settings = replace(settings, policy=Policy.GREEDY)
                    self.counts["plans_without_solve"] += 1
                plan = self.config.planner(snapshot, settings, self.config.catalog)
                self.last_plan = (key, plan)
        except Exception as e:  # a planner bug must not stop the controller
            error = (
                f"planner failed on a batch of {len(snapshot.pods)} pod(s): {type(e).__name__}: {e}"
            )
            return None, plan_id, batch, 0, error
        reconfigured = self._write_plan(plan, plan_id, pods)
        for key, reason in sorted(plan.unplaced.items()):
            if key in pods:
                self.once(pods[key], "Unplaceable", f"cannot place: {reason}", "Warning")
        self.preempt(plan)
        self.scale_up(plan)
        self.start_drains(plan)
        return plan, plan_id, batch, reconfigured, self.write_error

    def warm_slices(self) -> None:
        """Step 10: make one warm slice if a common one-slice request has no free slice left.

        Runs only when nothing waits (no candidate, no batch planned) and no node is applying a
        spec written less than ``apply_deadline_s`` ago, so every slice a spec will create is
        already in the ledgers (a spec in flight would hide its slice, and the next step would
        make another on the next node); a node past that deadline (its agent down, say) stops
        blocking them, and the step wakes when it gets there.  The mix
        is the bound pods holding one unit of one resource; a request of at least
        ``warm_share`` of them with no free, unpromised slice on a plannable node gets one, on
        the node with the most compute in use that could hold it (never on a node where
        nothing is in use: nodes that empty in lulls stay empty for whole-node pods), laid out
        by the planner as for a pod of that request (a one-node plan), at most one per step.
        """
        usable = [
            led
            for led in self.ledgers.values()
            if self._open(led.name) and not led.degraded and not led.busy
        ]
        if not usable:
            return
        for led in self.ledgers.values():
            if not led.busy:
                continue
            at = _planned_at(led.np) if led.np is not None else None
            if at is None:
                return
            overdue = at + self.config.apply_deadline_s
            if self.now < overdue:  # in flight: its slices are not in the ledgers yet
                self.wake(overdue)
                return
            # past its apply deadline (agent down?): its pods were given back; it blocks no more
        mix: Counter[str] = Counter()
        for led in usable:
            mix.update(self.index.usage(led.name).single)
        total = sum(mix.values())
        if not total:
            return
        free: Counter[str] = Counter()
        for led in usable:
            free.update(led.free())
        wanted = [
            r
            for r, n in sorted(mix.items(), key=lambda rn: (-rn[1], rn[0]))
            if n >= self.config.warm_share * total and free[r] <= 0
        ]
        if not wanted:
            return
        busiest = sorted(  # most compute in use first; node names are unique, so ties end there
            (-used, led.name, led)
            for led in usable
            if (used := sum(g.used_compute for g in led.gpus if not g.frozen)) > 0
        )
        reserve = self.config.planner_settings.mps_reserve_mib
        tries = _WARM_TRIES
        for r in wanted:
            for _, name, led in busiest:
                if _units_of(r, *_node_bounds(led, reserve)) < 1:
                    continue
                if tries <= 0:
                    return
                tries -= 1
                pod = PendingPod(
                    name=f"{WARM_PREFIX}{r}",
                    requests={r: 1},
                    eligible_nodes=frozenset({name}),
                )
                try:
                    plan = self.config.planner(
                        Snapshot(nodes=(_all_kept(led.node_state()),), pods=(pod,)),
                        self.config.planner_settings,
                        self.config.catalog,
                    )
                except Exception as e:  # a planner bug must not stop the controller
                    self.counts["warm_errors"] += 1  # counted as a planner error, logged
                    self.warm_error = (
                        f"planner failed on warm slice {r} for node {name}: {type(e).__name__}: {e}"
                    )
                    return
                if pod.name not in plan.assignments:
                    continue
                layouts = Plan(plan.layouts, {}, {}, plan.policy, plan.status)
                if self._write_plan(layouts, self.next_id(), {}):
                    self.counts["warm"] += 1
                    return

    def _may_place(self, snapshot: Snapshot) -> bool:
        """Whether some pod of ``snapshot`` could be placed, by the batch's bound
        (:class:`_UnitBounds`): ``False`` only if every pod asks for more units of some
        resource than any plannable node could offer without moving a pinned device."""
        bound = self.unit_bound
        if bound is None:
            return True
        return any(
            all(k <= bound.node_max(r) for r, k in p.requests.items() if k > 0)
            for p in snapshot.pods
        )

    def _version(self) -> tuple[int, int]:
        return (self.index.identity, self.index.version)

    def _replan_at(self) -> float:
        """When time alone can next change this step's plan or what follows it
        (:attr:`ControllerState.replan_at`): a batch pod crossing a waiting-time tier (the plan
        key changes), a candidate reaching ``drain_after_s`` while the drain budget has room,
        a cooldown ending (the node becomes plannable)."""
        soonest = math.inf
        tiers = self.config.planner_settings.wait_tiers_s
        for p in self.planned_snapshot.pods if self.planned_snapshot is not None else ():
            created = self.now - p.waited_s
            for t in tiers:
                if self.now < created + t < soonest:
                    soonest = created + t
        if self.drain_room:
            after = self.config.drain_after_s
            for key in self.managed:
                pod = self.candidates.get(key)
                if pod is None or key in self.drains:
                    continue
                at = (pod.created if pod.created is not None else self.now) + after
                if self.now < at < soonest:
                    soonest = at
        for until in self.cooldown.values():
            soonest = min(soonest, until)
        return soonest

    def _window_wakeups(self) -> None:
        policy = self.config.policy
        deadline = next_deadline(self.window, policy)
        if deadline is not None:
            self.wake(deadline)
        if self.window.planned_at:  # a planned pod arrives again after the retry time
            unchanged = self._version() == self.plan_version
            members = self.window.members
            # the earliest of these wake-ups that :meth:`wake` would take, in one call
            candidates, now, retry, replan_at = (
                self.candidates,
                self.now,
                policy.retry,
                self.replan_at,
            )
            best = math.inf
            for key, at in self.window.planned_at.items():
                if key in candidates and key not in members:
                    due = at + retry
                    if unchanged and due < replan_at:
                        due = replan_at
                    if now < due < best:
                        best = due
            self.wake(best)
        for until in self.cooldown.values():
            self.wake(until)

    # ------------------------------------------------------------------ status view

    def write_views(self) -> None:
        if not self.config.reservation:
            return
        for name, entries in sorted(self.view.items()):
            np_info = self.index.partitionings.get(name)
            np = np_info.np if np_info is not None else None
            if np is None:
                continue
            want = tuple(entries[k] for k in sorted(entries))
            have = tuple(np.status.reservations) if np.status is not None else ()
            if want != have:
                self.actions.append(WriteReservations(name, want))

    def _cool(self, node: str, until: float, reason: str) -> None:
        """Leave ``node`` out of new promises until ``until`` (a cool-down already ending later
        stays, with its reason)."""
        if until > self.cooldown.get(node, -math.inf):
            self.cooldown[node] = until
            self.cooldown_why[node] = reason

    def _recorded_cooldowns(self) -> None:
        """Cool-downs that a NodePartitioning records and this controller's state lacks (or ends
        sooner: by more than the millisecond the record is floored to) are taken up: a
        restarted controller or a new leader keeps the cool-downs the previous one started.
        Each annotation is read once a step (:attr:`recorded`, for :meth:`write_cooldowns`)."""
        self.recorded: dict[str, tuple[float, str] | None] = {}
        """Node -> its record (``None``: an annotation that cannot be read), for the
        NodePartitionings that carry the annotation."""
        for name, info in self.index.partitionings.items():
            np = info.np
            if np is None or COOLDOWN_ANNOTATION not in np.metadata.annotations:
                continue
            recorded = self.recorded[name] = cooldown_of(np)
            if recorded is None:
                continue
            until, reason = recorded
            # at most one cool-down from now: a record written by a replica whose clock ran
            # ahead, or under a longer cooldownSeconds, cannot keep a node out for longer
            until = min(until, self.now + self.config.cooldown_s)
            if until > self.now and until > self.cooldown.get(name, -math.inf) + 0.001:
                self.cooldown[name] = until
                self.cooldown_why[name] = reason

    def write_cooldowns(self) -> None:
        """Record each node's cool-down on its NodePartitioning, and remove a record whose
        cool-down is over (:data:`partitioner.snapshot.COOLDOWN_ANNOTATION`).  A node that
        has none (never planned) keeps its cool-down in memory only."""
        for name in sorted(self.recorded.keys() | self.cooldown.keys()):
            info = self.index.partitionings.get(name)
            if info is None or info.np is None:
                continue
            until = self.cooldown.get(name)
            if until is None or until <= self.now:
                if name in self.recorded:
                    self.actions.append(MarkCooldown(name, None))
                continue
            recorded = self.recorded.get(name)
            why = self.cooldown_why.get(name, "")
            if recorded is None or abs(recorded[0] - until) > 0.001 or recorded[1] != why:
                self.actions.append(MarkCooldown(name, until, why))

    # ------------------------------------------------------------------ the whole step

    def run(self) -> Decision:
        self.housekeeping()
        self.node_sets()
        self.ledgers, self.unreadable = build_ledgers(
            self.index, self.busy, self.degraded, self.frozen()
        )
        if self.config.reservation:
            self.notice_unserved()
        self.conditions()
        if self.config.node_lifecycle:
            self.actions.extend(node_lifecycle(self.index))
        self.view = {name: {} for name in self.ledgers}
        self.ungate_strays()
        self.give_back_unclaimed()
        if self.config.reservation:
            self.notice_rejections()
        self.read_pods()
        if self.config.reservation:
            self.strand_unprepared()
            self.settle()
            self.release()
            self.fast_path()
            self.complete_drains()
        else:
            for ledger in self.ledgers.values():
                ledger.pin()
        self.release_sharers()
        plan, plan_id, batch, reconfigured, error = self.plan_batch()
        if (
            self.config.reservation
            and self.config.warm_share > 0
            and plan is None
            and not error
            and not self.candidates
        ):
            self.warm_slices()
        if error:  # a failed plan may succeed on retry (e.g. out of time): no suppression
            self.plan_version = None
        elif self.planned_snapshot is not None:
            self.replan_at = self._replan_at()
        for key, reason in sorted(self.rejected.items()):
            if key in self.index.pods and not self._give_back(self.index.pods[key], reason):
                self.once(self.index.pods[key], "Unplaceable", f"cannot place: {reason}", "Warning")
        self.write_views()
        self.write_cooldowns()
        self._window_wakeups()
        gone = self.reported.keys() - self.seen - self.rejection_marks
        if gone:
            own = self._own_reported()
            for key in gone:
                del own[key]
        reported = self.reported
        self.counts["candidates"] = len(self.candidates)
        self.counts["rejected"] = len(self.rejected)
        state = ControllerState(
            self.window,
            reported,
            self.last_id,
            self.cooldown,
            self.cooldown_why,
            self.last_plan,
            self.plan_version,
            self.replan_at,
            self.unlisted_since,
            self.stranded_since,
            deep_since=self.deep_since,
        )
        actions = (
            tuple(a for i, a in enumerate(self.actions) if i not in self._superseded)
            if self._superseded
            else tuple(self.actions)
        )
        return Decision(
            state,
            actions,
            plan,
            plan_id,
            batch,
            reconfigured,
            error,
            dict(self.counts),
            {
                **self.stuck,
                **self._label_problems(),
                **self.unserved,
                **self.unreadable,
                **self.invalid,
            },
            self.planned_snapshot,
            self.next_wakeup,
            self.warm_error,
        )


class _PreemptionRoom:
    """What kube-scheduler's preemption could free for gated pods in one step (:meth:`_Step.
    preempt`): per GPU node its free slices, CPU and memory (read once), the slice pods bound
    there (the possible victims, lowest priority first), and what pods handed over this step
    take."""

    def __init__(self, index: ClusterIndex, ledgers: Mapping[str, NodeLedger]) -> None:
        self.ledgers = ledgers
        bound: dict[str, list[PodInfo]] = {}
        for pod in index.pods.values():
            if pod.node in ledgers and pod.slices and not pod.finished:
                bound.setdefault(pod.node, []).append(pod)
        self.bound = {n: sorted(pods, key=lambda p: p.priority) for n, pods in bound.items()}
        self.lowest = min((pods[0].priority for pods in self.bound.values()), default=0)
        """The lowest priority of a bound slice pod (a pod at or below it preempts nothing)."""
        self._free: dict[str, Counter[str]] = {}
        self._freed: dict[tuple[str, int], tuple[Counter[str], int, int]] = {}
        self._taken: dict[str, tuple[Counter[str], list[int]]] = {}
        self._orders: dict[frozenset[str], list[str]] = {}

    def order(self, eligible: frozenset[str]) -> list[str]:
        """``eligible``'s nodes with victims, in name order (kept per node set)."""
        out = self._orders.get(eligible)
        if out is None:
            out = self._orders[eligible] = sorted(n for n in eligible if n in self.bound)
        return out

    def take(
        self, pod: PodInfo, nodes: Iterable[str], is_open: Callable[[str], bool]
    ) -> str | None:
        """The first of ``nodes`` where preemption makes room for ``pod`` (module docstring of
        :meth:`_Step.preempt`); what it needs there is taken.  ``None``: no such node.  Nodes
        not ``is_open`` (cooling down, or whose kubelet lists none of their slices: preemption
        frees nothing kube-scheduler could bind there) are passed over."""
        for n in nodes:
            if not is_open(n):
                continue
            ledger = self.ledgers[n]
            free = self._free.get(n)
            if free is None:
                free = self._free[n] = ledger.free()
            freed = self._freed.get((n, pod.priority))
            if freed is None:
                units: Counter[str] = Counter()
                cpu = memory = 0
                for v in self.bound[n]:
                    if v.priority >= pod.priority:
                        break
                    units.update(v.slices)
                    cpu += v.cpu_milli
                    memory += v.memory_mib
                freed = self._freed[(n, pod.priority)] = (units, cpu, memory)
            units, cpu, memory = freed
            if not units:
                continue
            taken, taken_cm = self._taken.get(n) or (Counter(), [0, 0])
            if any(free[r] + units[r] - taken[r] < k for r, k in pod.slices.items()):
                continue
            if pod.cpu_milli > ledger.cpu_free + cpu - taken_cm[0]:
                continue
            if pod.memory_mib > ledger.memory_free + memory - taken_cm[1]:
                continue
            taken.update(pod.slices)
            taken_cm[0] += pod.cpu_milli
            taken_cm[1] += pod.memory_mib
            self._taken[n] = (taken, taken_cm)
            return n
        return None


def _planned(plan: Plan, key: str, plan_id: str) -> str:
    a = plan.assignments[key]
    parts = []
    for resource in sorted(a.gpus):
        indices = sorted(set(a.gpus[resource]))
        parts.append(f"{resource} on node {a.node} GPU " + ", ".join(str(i) for i in indices))
    return f"planned {'; '.join(parts)}, plan {plan_id}"


class _UnitBounds:
    """Per resource, an upper bound on the units a plan could give out on some nodes' GPUs.

    A plan never moves a pinned device (used, held or possibly used: :mod:`partitioner.ledger`)
    and never touches a frozen GPU, so per GPU that is not frozen:

    * MIG, unlocked: the most pairwise disjoint placements of the profile that overlap no pinned
      instance's memory slots, at most the profile's per-GPU maximum and the compute slices no
      pinned instance uses over the profile's compute;
    * MIG or MPS, locked (the layout must stay): the free devices of the resource;
    * MPS, unlocked: the memory no pinned slice holds (less the MPS server reserve) over the
      slice size.

    Summed over GPUs this is never below what any plan can place, and on a full cluster it is
    about zero: the batch stays small however many pods wait (:meth:`_Step.planning_input`).
    Per node (:meth:`node_max`) it bounds what one pod can get, since all of a pod's units go
    to one node: a pod asking for more than any node's share takes none of the batch's bound.
    Unknown profiles on a GPU are ignored (the bound only grows).
    """

    def __init__(self, ledgers: Iterable[NodeLedger], mps_reserve_mib: int) -> None:
        self.mig: Counter[str] = Counter()
        self.locked: Counter[str] = Counter()
        self.mps_mib: list[int] = []
        self.parts: list[tuple[Counter[str], Counter[str], tuple[int, ...]]] = []
        """Each node's share: a pod's units of one resource must all fit on one node."""
        self._node_max: dict[str, int] = {}
        for ledger in ledgers:
            reading = ledger.reading
            if ledger.base_pins and reading is not None and not any(g.frozen for g in ledger.gpus):
                # Pins are the reading's own: so is the node's share (memo on the reading).
                key = (ledger.stale_used, mps_reserve_mib)
                part = reading.bounds.get(key)
                if part is None:
                    if len(reading.bounds) >= 8:
                        reading.bounds.clear()
                    part = reading.bounds[key] = _node_bounds(ledger, mps_reserve_mib)
            else:
                part = _node_bounds(ledger, mps_reserve_mib)
            self.mig.update(part[0])
            self.locked.update(part[1])
            self.mps_mib.extend(part[2])
            self.parts.append(part)

    def __call__(self, resource: str) -> int:
        return _units_of(resource, self.mig, self.locked, self.mps_mib)

    def node_max(self, resource: str) -> int:
        """The most units of ``resource`` one node could offer (the bound, per node)."""
        cached = self._node_max.get(resource)
        if cached is None:
            cached = self._node_max[resource] = max(
                (_units_of(resource, *part) for part in self.parts), default=0
            )
        return cached


def _units_of(
    resource: str, mig: Counter[str], locked: Counter[str], mps_mib: Iterable[int]
) -> int:
    """Units of ``resource`` a share of GPUs could offer (:class:`_UnitBounds`): MIG instance
    places plus locked free devices, or locked devices plus MPS slices of its size."""
    gb = mps_gb_of(resource)
    if gb is None:
        return mig[resource] + locked[resource]
    if gb <= 0:
        return locked[resource]
    return locked[resource] + sum(max(0, m) // (gb * MIB_PER_GIB) for m in mps_mib)


def _node_bounds(
    ledger: NodeLedger, mps_reserve_mib: int
) -> tuple[Counter[str], Counter[str], tuple[int, ...]]:
    """One node's share of :class:`_UnitBounds`: (MIG units per resource, free devices of
    locked GPUs per resource, free MiB per unlocked MPS GPU)."""
    mig: Counter[str] = Counter()
    locked: Counter[str] = Counter()
    mps_mib: list[int] = []
    model = ledger.gpu.model
    mps = ledger.gpu.mode is Mode.MPS
    usable = (ledger.gpu.gpu_memory_mib or model.memory_mib) - mps_reserve_mib
    shares: dict[int, list[Any]] = {}
    """id(a GPU's memoised bound) -> [that bound, GPUs of the node with it]: GPUs of a node
    share a few pinned sets, so each distinct bound is added once, times its GPUs."""
    for g in ledger.gpus:
        if g.frozen:
            continue
        if g.locked:
            locked.update(d.resource for d in g.devices if not d.kept)
        elif mps:
            mps_mib.append(usable - sum(d.memory_mib for d in g.devices if d.kept))
        else:
            bound = _mig_gpu_bounds(model, g)
            share = shares.get(id(bound))
            if share is None:
                shares[id(bound)] = [bound, 1]
            else:
                share[1] += 1
            if ledger.gpu.mode is Mode.HYBRID:  # MPS slices inside instances: at most this
                mps_mib.append(usable - sum(d.memory_mib for d in g.devices if d.kept))
    for bound, gpus in shares.values():
        for resource, k in bound:
            mig[resource] += k * gpus
    return mig, locked, tuple(mps_mib)


def _mig_gpu_bounds(model: GpuModel, g: GpuSlots) -> tuple[tuple[str, int], ...]:
    """:func:`_mig_gpu_bound` of a GPU's pinned instances, memoised per (model, pins)."""
    pinned = tuple(
        sorted((d.mig_profile, d.key, d.compute) for d in g.devices if d.kept and d.mig_profile)
    )
    key = (id(model), pinned)
    cached = _MIG_GPU_BOUNDS.get(key)
    if cached is None or cached[0] is not model:
        if len(_MIG_GPU_BOUNDS) >= _MIG_GPU_BOUNDS_MAX:
            _MIG_GPU_BOUNDS.clear()
        cached = (model, _mig_gpu_bound(model, pinned))
        _MIG_GPU_BOUNDS[key] = cached
    return cached[1]


_Pinned = tuple[tuple[str, int, int], ...]
"""Pinned MIG instances of a GPU as sorted (profile, start slot, compute)."""
_MIG_GPU_BOUNDS: dict[tuple[int, _Pinned], tuple[GpuModel, tuple[tuple[str, int], ...]]] = {}
""":func:`_mig_gpu_bound` per (model, pinned instances): a cluster has few distinct pinned sets,
so a step's bound costs a lookup per GPU.  The model is kept beside its id (ids are reused)."""
_MIG_GPU_BOUNDS_MAX = 4096


def _mig_gpu_bound(model: GpuModel, pinned: _Pinned) -> tuple[tuple[str, int], ...]:
    """Per profile of ``model``, the most instances a layout keeping the ``pinned``
    (profile, placement key, compute) instances can add (:class:`_UnitBounds`)."""
    taken: set[int] = set()
    compute_used = 0
    same: Counter[str] = Counter()
    media = False
    for name, key, compute in pinned:
        compute_used += compute
        try:
            profile = model.profile(name)
        except CatalogError:
            continue
        taken.update(profile.span(key))
        same[profile.name] += 1
        media = media or profile.has_media_extensions
    compute_free = max(0, model.compute_slices - compute_used)
    out: list[tuple[str, int]] = []
    for profile in model.profiles:
        if media and profile.has_media_extensions:
            continue  # one media-extension instance per GPU
        spans = sorted(
            (profile.span(s) for s in profile.starts if taken.isdisjoint(profile.span(s))),
            key=lambda r: (r.stop, r.start),
        )
        count, end = 0, -1
        for span in spans:  # earliest end first: the most disjoint intervals
            if span.start >= end:
                count += 1
                end = span.stop
        limit = (
            compute_free // profile.compute
            if profile.compute > 0 and model.compute_slices > 0
            else count
        )
        most = max(0, min(count, profile.max_count - same[profile.name], limit))
        out.append((profile.resource, most))
    return tuple(out)


_WARM_TRIES = 3
"""One-node plans a step may try for warm slices (a node the bound admits may still not hold
the slice beside every device it keeps)."""


def _all_kept(node: NodeState) -> NodeState:
    """``node`` with every instance and slice marked used (a hybrid host through its slices,
    so a warm slice may still join it): a warm slice is added beside what exists and never
    replaces a free device (else two requests' warm slices that do not fit
    together on the busiest node would replace each other at every step)."""
    gpus = tuple(
        replace(
            g,
            mig=tuple(
                replace(
                    m, used=m.used or not m.mps, mps=tuple(replace(s, used=True) for s in m.mps)
                )
                for m in g.mig
            ),
            mps=tuple(replace(s, used=True) for s in g.mps),
        )
        for g in node.gpus
    )
    return replace(node, gpus=gpus)


def _idle_compute(ledger: NodeLedger) -> tuple[int, str]:
    """Compute slices of the node's free devices (GPUs not frozen), then its name: the node a
    starving pod's next plan can most likely repartition for it."""
    idle = sum(
        d.compute for g in ledger.gpus if not g.frozen for d in g.devices if not (d.used or d.kept)
    )
    return (idle, ledger.name)


def _packing(ledger: NodeLedger, units: Mapping[str, int]) -> int:
    """How busy the GPUs are whose free slices a reservation would take (higher packs better)."""
    score = 0
    for resource in units:
        best = -1
        for g in ledger.gpus:
            if g.frozen:
                continue
            if any(d.resource == resource and not d.pinned for d in g.devices):
                best = max(best, g.used_compute)
        score += best
    return score


def decide(
    state: ControllerState,
    cluster: ClusterIndex | ClusterView,
    now: float,
    config: DecideConfig,
) -> Decision:
    """One controller step at time ``now`` (seconds since the epoch)."""
    index = (
        cluster
        if isinstance(cluster, ClusterIndex)
        else ClusterIndex.from_objects(
            config.catalog,
            cluster.nodes.values(),
            cluster.pods.values(),
            cluster.partitionings.values(),
        )
    )
    quiet = state.quiet
    if (
        quiet is not None
        and now < quiet.until
        and quiet.index == (index.identity, index.version)
        and quiet.config == id(config)
    ):
        return Decision(
            state,
            (),
            counts=quiet.counts,
            problems=quiet.problems,
            next_wakeup=quiet.until if math.isfinite(quiet.until) else None,
        )
    decision = _Step(index, state, now, config).run()
    if (
        any(not isinstance(a, EmitEvent) for a in decision.actions)
        or not config.reservation
        or decision.snapshot is not None
        or decision.error
    ):
        return decision
    until = decision.next_wakeup if decision.next_wakeup is not None else math.inf
    mark = Quiet(
        (index.identity, index.version), id(config), until, decision.counts, decision.problems
    )
    return replace(decision, state=replace(decision.state, quiet=mark))


def _same_state(a: ControllerState, b: ControllerState) -> bool:
    """The parts of two states a step reads are equal (``quiet`` aside; the last plan by
    identity: it is only ever carried over or replaced)."""
    return (
        a.last_plan is b.last_plan
        and a.last_plan_id == b.last_plan_id
        and a.plan_version == b.plan_version
        and a.replan_at == b.replan_at
        and a.cooldown == b.cooldown
        and a.cooldown_why == b.cooldown_why
        and (a.reported is b.reported or a.reported == b.reported)
        and a.window == b.window
    )
