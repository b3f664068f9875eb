"""The time-replay protocol: a discrete-event simulation of gpuslice on a trace over time.

Model
-----
Pods (:class:`ReplayPod`) arrive at their creation time and, once bound, run for their trace
lifetime ``deletion - creation`` (at least 1 s), then depart.  Times are divided by
``time_compression``; ``copies > 1`` overlays that many copies of the trace, copy ``i > 0``
shifted by a seeded uniform offset and wrapped around the trace span (so the load density is
multiplied, for clusters larger than the trace's).  CPU-only pods are left out.

Fractional GPU requests become slices with a :mod:`simulations.mapping` rule
(``settings.mapping``; default ``mig-compute`` on MIG/hybrid nodes: the smallest profile whose
compute covers ``gpu_milli * 7 / 1000``, and ``mps-memory`` on MPS nodes).  All GPU nodes of a
replay must share one GPU model and mode.

Per time step (events at one instant, in the order departures, spec applications,
abandonments, arrivals):

1. **Departures** free devices; an **application** makes the node's spec real
   (:meth:`FakeCluster.apply_spec <simulations.fake_cluster.FakeCluster.apply_spec>`); a pod
   whose device it removes is *disrupted*: counted, evicted and queued again.
2. **kube-scheduler**: pending pods, those with a plan nomination first, then by priority and
   arrival, are bound to a node whose free advertised devices and CPU/memory hold them (the
   nominated node first, else the first by name).  A pod that does not fit is marked
   ``PodScheduled=False/Unschedulable``.
3. **Partitioner** (policies with a planner): the real decision step
   :func:`partitioner.decide.decide` runs on the cluster rendered as API objects
   (:mod:`simulations.replay_objects`): its batch window (:mod:`partitioner.batching`: timeout,
   idle, retry) decides when to plan, the planner plans, and the specs it writes go to the
   fake agents, which apply them ``apply_delay_s`` later.  The engine wakes the step again at
   the window's deadline and at pods' retry times.  Planning takes no simulated time; its wall
   time is recorded.  A plan whose input equals the previous plan's input is reused (the
   planner is deterministic), and counted apart.
4. **Static policies** set every GPU's layout once before the first pod and never plan.

The replay stops when no arrival, departure or application is left and the last plan changed
nothing (so retrying cannot change anything either).  Pods still pending then are *never
scheduled*; with ``max_pending_s`` a pod gives up after waiting that long.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum

from partitioner.batching import BatchPolicy, next_deadline
from partitioner.decide import ControllerState, DecideConfig, decide
from planner.catalog import Catalog, GpuModel, default_catalog
from planner.settings import PlannerSettings, Policy
from planner.snapshot import Assignment, Mode, Plan, Snapshot
from simulations.cluster import Cluster
from simulations.fake_cluster import FakeCluster, FakeNode
from simulations.mapping import MappingError, make_mapping
from simulations.replay_metrics import PlanRecord, PodRecord, ReplayResult
from simulations.replay_objects import NAMESPACE, KubeObjects
from simulations.static_layouts import StaticPolicy, assign_static, static_policy
from simulations.workload import Pod, Workload

__all__ = [
    "NOS_WINDOW",
    "PlanFn",
    "ReplayError",
    "ReplayPod",
    "ReplayPolicy",
    "ReplaySettings",
    "build_fake_cluster",
    "parse_policy",
    "replay_pods",
    "run_time_replay",
]

PlanFn = Callable[[Snapshot, PlannerSettings, Catalog], Plan]
NOS_WINDOW = (60.0, 10.0)
"""nos's batch window: 60 s timeout, 10 s idle."""
MIB_PER_GIB = 1024
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
    """Seconds from a spec being written to the node agent having applied it."""
    time_compression: float = 1.0
    """Trace times are divided by this factor."""
    copies: int = 1
    """Overlaid copies of the trace (see the module docstring)."""
    seed: int = 0
    """Seeds the copies' offsets (and nothing else: the replay is deterministic)."""
    mapping: str | None = None
    """A :func:`simulations.mapping.make_mapping` rule; ``None``: ``mig-compute`` on MIG and
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
    reuse_identical_plans: bool = True
    """Reuse the previous plan when the planner input is identical (deterministic planner)."""

    def __post_init__(self) -> None:
        if self.time_compression <= 0 or self.copies < 1 or self.apply_delay_s < 0:
            raise ReplayError(
                "replay settings: time_compression must be > 0, copies >= 1, apply_delay_s >= 0"
            )


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


def parse_policy(text: str) -> ReplayPolicy:
    """``cpsat``, ``greedy`` (nos-like, 60 s / 10 s window) or ``static:<layout>``."""
    t = text.strip().lower()
    if t == "cpsat":
        return ReplayPolicy("cpsat", planner_policy=Policy.CPSAT)
    if t in ("greedy", "nos"):
        return ReplayPolicy("greedy", planner_policy=Policy.GREEDY, window=NOS_WINDOW)
    if t.startswith("static:"):
        sp = static_policy(t.split(":", 1)[1])
        return ReplayPolicy(f"static:{sp.name}", static=sp)
    raise ReplayError(
        f"unknown replay policy {text!r}; use cpsat, greedy or static:<layout> "
        "(all-1g, balanced, all-2g, all-3g, all-7g)"
    )


# --------------------------------------------------------------------------- pods


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
    """The GPU pods of ``workload`` as timed requests (module docstring), by arrival."""
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
    t0 = min(t for _, t, _ in base)
    span = max(t for _, t, _ in base) - t0 + 1.0
    rng = random.Random(settings.seed)
    offsets = [0.0] + [rng.uniform(0, span) for _ in range(settings.copies - 1)]
    rule = settings.mapping or ("mps-memory" if mode is Mode.MPS else "mig-compute")
    try:
        mapping = make_mapping(rule, model)
        requests = {pod.name: mapping.map(pod) for pod, _, _ in base}
    except MappingError as e:
        raise ReplayError(str(e)) from None
    want = "mps" if mode is Mode.MPS else "mig"
    for name, req in requests.items():
        if req is None or req.kind != want:
            raise ReplayError(
                f"mapping {rule!r} gives pod {name!r} {req.resource if req else 'nothing'}; "
                f"the cluster's nodes are in {mode.value} mode, choose a {want} mapping"
            )
    c = settings.time_compression
    out: list[ReplayPod] = []
    for k, offset in enumerate(offsets):
        for pod, t, duration in base:
            arrival = (t - t0 + offset) % span
            out.append(
                ReplayPod(
                    name=pod.name if settings.copies == 1 else f"{pod.name}-c{k}",
                    requests=requests[pod.name].as_requests(),  # type: ignore[union-attr]
                    arrival=arrival / c,
                    duration=max(duration / c, 1e-3),
                    cpu_milli=pod.cpu_milli,
                    memory_mib=pod.memory_mib,
                )
            )
    out.sort(key=lambda p: (p.arrival, p.name))
    return out


# --------------------------------------------------------------------------- cluster


def build_fake_cluster(
    cluster: Cluster, catalog: Catalog | None = None, mps_reserve_mib: int = 512
) -> FakeCluster:
    """A fake cluster of ``cluster``'s GPU nodes; they must share one catalog model and mode."""
    cat = catalog or default_catalog()
    gpu_nodes = [n for n in cluster.nodes if n.gpus > 0]
    if not gpu_nodes:
        raise ReplayError(f"cluster {cluster.name!r} has no GPU nodes")
    kinds = {(n.catalog_model, n.mode) for n in gpu_nodes}
    if len(kinds) != 1:
        raise ReplayError(
            f"cluster {cluster.name!r}: the time replay needs one GPU model and mode for all GPU "
            f"nodes, got {sorted((str(m), md.value) for m, md in kinds)}; split the cluster"
        )
    model_name, _mode = next(iter(kinds))
    if model_name is None:
        raise ReplayError(
            f"cluster {cluster.name!r}: GPU model {gpu_nodes[0].model!r} is not in the GPU "
            "catalog; add it with a catalog override file"
        )
    nodes = [
        FakeCluster.node(
            n.name,
            cat.model(model_name),
            n.gpus,
            n.mode,
            cpu_milli=n.cpu_milli,
            memory_mib=n.memory_mib,
            label=n.model,
        )
        for n in gpu_nodes
    ]
    return FakeCluster(nodes, mps_reserve_mib=mps_reserve_mib)


# --------------------------------------------------------------------------- engine


class _Kind(IntEnum):
    DEPART = 0
    APPLY = 1
    ABANDON = 2
    ARRIVE = 3
    WAKE = 4


class _Engine:
    def __init__(
        self,
        pods: Sequence[ReplayPod],
        fake: FakeCluster,
        policy: ReplayPolicy,
        settings: ReplaySettings,
        catalog: Catalog,
    ) -> None:
        self.fake = fake
        self.policy = policy
        self.settings = settings
        self.catalog = catalog
        self.pods = {p.name: p for p in pods}
        if len(self.pods) != len(pods):
            raise ReplayError("replay pods must have unique names")
        self.result = ReplayResult(
            policy=policy.name,
            pods=[],
            start=min((p.arrival for p in pods), default=0.0),
        )
        self.records: dict[str, PodRecord] = {}
        self.pending: dict[str, ReplayPod] = {}
        self.unschedulable: set[str] = set()
        self.running: dict[str, tuple[str, int]] = {}
        """pod -> (node, token of its departure event)."""
        self.nominated: dict[str, Assignment] = {}
        self.heap: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.live = 0
        """Arrivals, departures, applications and abandonments still in the heap."""
        self.node_order = sorted(fake.nodes)
        self.objects: KubeObjects | None = None
        self.state = ControllerState()
        self.config: DecideConfig | None = None
        self.changes_since_plan = True
        self.last_input: str | None = None
        self.last_plan: Plan | None = None
        self._reused = False
        self._planner_ms = 0.0
        self.wake_at: float | None = None
        self.error_streak = 0
        """Consecutive partitioner steps whose planner call failed."""
        if policy.static is not None:
            gpus = [
                (n.name, g.index, n.model)
                for n in sorted(fake.nodes.values(), key=lambda n: n.name)
                for g in n.gpus
            ]
            if any(n.mode is Mode.MPS for n in fake.nodes.values()):
                raise ReplayError(
                    f"static policy {policy.name!r} sets MIG layouts; the cluster is in mps mode"
                )
            for pg in assign_static(policy.static, gpus):
                fake.set_layout(pg.node, pg.index, pg)
        else:
            timeout, idle = policy.window or (settings.batch_timeout_s, settings.batch_idle_s)
            planner = policy.planner or _default_plan()
            self.config = DecideConfig(
                catalog=catalog,
                policy=BatchPolicy(timeout=timeout, idle=idle, retry=settings.batch_retry_s),
                planner_settings=replace(settings.planner, policy=policy.planner_policy),
                planner=self._timed(planner),
            )
            self.objects = KubeObjects(fake)
        for p in pods:
            self._push(p.arrival, _Kind.ARRIVE, p.name)

    # ------------------------------------------------------------------ helpers

    def _push(self, t: float, kind: _Kind, payload: str) -> None:
        self.seq += 1
        if kind is not _Kind.WAKE:
            self.live += 1
        heapq.heappush(self.heap, (t, int(kind), self.seq, payload))

    def _timed(self, planner: PlanFn) -> PlanFn:
        def run(snapshot: Snapshot, settings: PlannerSettings, catalog: Catalog) -> Plan:
            key = repr(snapshot) if self.settings.reuse_identical_plans else None
            if key is not None and key == self.last_input and self.last_plan is not None:
                self._reused = True
                self._planner_ms = 0.0
                return self.last_plan
            t0 = time.perf_counter()
            plan = planner(snapshot, settings, catalog)
            self._planner_ms = (time.perf_counter() - t0) * 1000
            self._reused = False
            self.last_input, self.last_plan = key, plan
            return plan

        return run

    def _allocation(self) -> float:
        total = self.fake.total_compute()
        if total:
            return self.fake.used_compute() / total
        mps = self.fake.total_mps_mib()
        return self.fake.used_mps_mib() / mps if mps else 0.0

    # ------------------------------------------------------------------ scheduler

    def _schedule(self, t: float, names: Iterable[str]) -> None:
        def order(n: str) -> tuple[int, int, float, str]:
            p = self.pending[n]
            return (0 if n in self.nominated else 1, -p.priority, self.records[n].arrival, n)

        for name in sorted(names, key=order):
            if name not in self.pending:
                continue
            pod = self.pending[name]
            node = self._choose(pod)
            if node is None:
                if name not in self.unschedulable:
                    self.unschedulable.add(name)
                    if self.objects is not None:
                        self.objects.add_pending(
                            name, pod.requests, pod.cpu_milli, pod.memory_mib, pod.priority
                        )
                continue
            self._bind(t, pod, node)

    def _choose(self, pod: ReplayPod) -> str | None:
        free = self.fake.free_total
        if any(free[r] < k for r, k in pod.requests.items()):
            return None
        nominated = self.nominated.get(pod.name)
        if nominated is not None and self.fake.fits(
            nominated.node, pod.requests, pod.cpu_milli, pod.memory_mib
        ):
            return nominated.node
        for node in self.node_order:
            if self.fake.fits(node, pod.requests, pod.cpu_milli, pod.memory_mib):
                return node
        return None

    def _bind(self, t: float, pod: ReplayPod, node: str) -> None:
        nominated = self.nominated.pop(pod.name, None)
        preferred = nominated.gpus if nominated is not None and nominated.node == node else None
        self.fake.bind(pod.name, node, pod.requests, pod.cpu_milli, pod.memory_mib, preferred)
        del self.pending[pod.name]
        rec = self.records[pod.name]
        if rec.first_bound is None:
            rec.first_bound = t
        if rec.waiting_since is not None:
            rec.pending_s += t - rec.waiting_since
            rec.waiting_since = None
        self.seq += 1
        token = self.seq
        self.running[pod.name] = (node, token)
        self._push(t + pod.duration, _Kind.DEPART, f"{token}:{pod.name}")
        if self.objects is not None:
            if pod.name in self.unschedulable:
                self.objects.bound(pod.name, node)
            else:  # bound at once: the API server never saw it pending
                self.objects.add_pending(
                    pod.name, pod.requests, pod.cpu_milli, pod.memory_mib, pod.priority
                )
                self.objects.bound(pod.name, node)
        self.unschedulable.discard(pod.name)

    def _requeue(self, t: float, name: str) -> None:
        pod = self.pods[name]
        self.running.pop(name, None)
        self.pending[name] = pod
        self.records[name].waiting_since = t
        if self.objects is not None:
            self.objects.gone(name, None)
        self.unschedulable.discard(name)

    # ------------------------------------------------------------------ partitioner

    def _step(self, t: float) -> None:
        if self.config is None or self.objects is None:
            return
        if not self.unschedulable and not self.state.window.is_open:
            return
        decision = decide(self.state, self.objects.view, t, self.config)
        self.state = decision.state
        written = self.objects.carry_out(decision.actions, t + self.settings.apply_delay_s)
        for ws in written:
            self._push(t + self.settings.apply_delay_s, _Kind.APPLY, ws.node)
        if decision.error:
            self.result.planner_errors.append(f"t={t:.1f}: {decision.error}")
            self.error_streak += 1
        if decision.plan is not None:
            self.error_streak = 0
            plan = decision.plan
            prefix = f"{NAMESPACE}/"
            for key, a in plan.assignments.items():
                name = key[len(prefix) :] if key.startswith(prefix) else key
                if name in self.pending:
                    self.nominated[name] = a
            self.result.plans.append(
                PlanRecord(
                    time=t,
                    batch=len(decision.batch),
                    planner_ms=self._planner_ms,
                    placed=len(plan.assignments),
                    unplaced=len(plan.unplaced),
                    gpus_reconfigured=decision.gpus_reconfigured,
                    reused=self._reused,
                )
            )
            self.changes_since_plan = bool(written)
        self._schedule_wake(t)

    def _schedule_wake(self, t: float) -> None:
        assert self.config is not None
        policy = self.config.policy
        window = self.state.window
        nxt = next_deadline(window, policy)
        if nxt is None:
            retries = [
                at + policy.retry + _EPSILON
                for p, at in window.planned_at.items()
                if p[len(NAMESPACE) + 1 :] in self.unschedulable
            ]
            nxt = min(retries, default=None)
        if nxt is None:
            return
        if nxt <= t:  # never wake twice at the same instant (float rounding)
            nxt = t + _EPSILON
        if self.wake_at is not None and t < self.wake_at <= nxt:
            return
        self.wake_at = nxt
        self._push(nxt, _Kind.WAKE, "")

    # ------------------------------------------------------------------ loop

    def run(self) -> ReplayResult:
        wall0 = time.perf_counter()
        self.result.allocation.append((self.result.start, self._allocation()))
        t = self.result.start
        while self.heap:
            if self.live == 0 and not self.changes_since_plan and self._quiet():
                break
            if self.live == 0 and self.error_streak >= self.settings.max_planner_errors:
                break  # only planner retries are left, and the planner keeps failing
            if self.settings.horizon_s is not None and self.heap[0][0] > self.settings.horizon_s:
                break
            t = self.heap[0][0]
            changed = False
            arrivals: list[str] = []
            while self.heap and self.heap[0][0] == t:
                _, kind, _, payload = heapq.heappop(self.heap)
                if kind != _Kind.WAKE:
                    self.live -= 1
                changed |= self._handle(t, _Kind(kind), payload, arrivals)
            if self.wake_at is not None and self.wake_at <= t:
                self.wake_at = None
            if changed:
                self.changes_since_plan = True
                self._schedule(t, list(self.pending))
            elif arrivals:
                self._schedule(t, arrivals)
            if changed or arrivals:
                alloc = self._allocation()
                if alloc != self.result.allocation[-1][1]:
                    self.result.allocation.append((t, alloc))
            self._step(t)
        self.result.end = max(t, self.result.start)
        for name, rec in self.records.items():
            if name in self.pending and rec.waiting_since is not None:
                rec.pending_s += self.result.end - rec.waiting_since
                rec.waiting_since = None
        self.result.pods = list(self.records.values())
        if self.objects is not None:
            self.result.spec_conflicts = self.objects.conflicts
            self.result.events = dict(self.objects.events)
        self.result.wall_s = time.perf_counter() - wall0
        return self.result

    def _quiet(self) -> bool:
        """No spec in flight (an application would change the cluster)."""
        return all(n.spec is None for n in self.fake.nodes.values())

    def _handle(self, t: float, kind: _Kind, payload: str, arrivals: list[str]) -> bool:
        if kind is _Kind.ARRIVE:
            pod = self.pods[payload]
            self.records[payload] = PodRecord(payload, t, dict(pod.requests), waiting_since=t)
            self.pending[payload] = pod
            arrivals.append(payload)
            if self.settings.max_pending_s is not None:
                self._push(t + self.settings.max_pending_s, _Kind.ABANDON, payload)
            return False
        if kind is _Kind.DEPART:
            token_s, name = payload.split(":", 1)
            node_token = self.running.get(name)
            if node_token is None or node_token[1] != int(token_s):
                return False
            del self.running[name]
            self.fake.release(name)
            if self.objects is not None:
                self.objects.gone(name, node_token[0])
            return True
        if kind is _Kind.APPLY:
            res = self.fake.apply_spec(payload)
            if self.objects is not None:
                self.objects.applied(payload)
            if res.gpus_changed:
                self.result.reconfigurations.append((t, res.gpus_changed))
            for victim in res.disrupted:
                self.result.disruptions += 1
                self.records[victim].disruptions += 1
                self._requeue(t, victim)
            return True
        if kind is _Kind.ABANDON:
            if payload in self.pending:
                rec = self.records[payload]
                if rec.waiting_since is not None and t - rec.waiting_since >= (
                    self.settings.max_pending_s or 0
                ):
                    rec.pending_s += t - rec.waiting_since
                    rec.waiting_since = None
                    rec.abandoned = True
                    del self.pending[payload]
                    self.unschedulable.discard(payload)
                    self.nominated.pop(payload, None)
                    if self.objects is not None:
                        self.objects.gone(payload, None)
            return False
        return False


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

    ``cluster`` is a :class:`~simulations.cluster.Cluster` (GPU nodes: one model and mode) or a
    ready :class:`FakeCluster` (used as is, and changed).  ``pods`` overrides the pods derived
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
        first: FakeNode = next(iter(fake.nodes.values()))
        pods = replay_pods(workload, first.model, first.mode, settings)
    return _Engine(pods, fake, pol, settings, cat).run()
