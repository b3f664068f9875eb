"""What a time replay records, and the metrics computed from it.

Records (:class:`ReplayResult`)
-------------------------------
* per pod (:class:`PodRecord`): arrival time, the time it was first bound (``None`` if never),
  its total pending time so far, and how often it was disrupted;
* per plan (:class:`PlanRecord`): when, how many pods the batch had, the planner's wall-clock
  milliseconds, pods placed and unplaced, GPUs the written specs reconfigure;
* per applied spec: ``(time, GPUs whose layout changed)`` in :attr:`ReplayResult.reconfigurations`;
* the allocation step function ``(time, fraction)`` in :attr:`ReplayResult.allocation`: after
  every change, the allocated fraction of the cluster (MIG: compute slices of bound instances /
  all compute slices; MPS: memory of bound slices / usable memory; hybrid: as MIG, a bound MPS
  slice counting its host's compute slices times its share of the host's usable memory; a
  cluster of several models or modes: the mean over GPUs of each GPU's fraction);
* ``start``/``end``: the first arrival and the time the replay stopped.

Metric definitions (:func:`summarize`)
--------------------------------------
* **pending time** of a pod: the time from its arrival to its first binding, plus any later
  wait after a disruption.  A pod that is never scheduled counts with the time it waited
  (until it was abandoned, or until the end): a *censored* value, a lower bound.  Percentiles
  are nearest-rank over all pods: ``p_q`` = the ``ceil(q/100 * n)``-th smallest value.
  The mean is over all pods too: with the same pods and the same capacity kept busy, two
  policies have about the same mean and differ in percentiles only by whom they serve first.
* **never scheduled**: pods not bound when the replay ends (abandoned ones included).
* **GPU reconfigurations per hour**: the GPUs changed by all applied specs, divided by the
  replayed span ``(end - start) / 3600`` (simulated, i.e. compressed, hours).
* **pods disrupted**: bound pods whose device an applied spec removed (must be 0).
* **planner time per batch**: p50/p95/max/mean of the planner's wall-clock milliseconds over
  the plans actually computed (plans reused for an identical input are counted apart).
* **allocation**: the time-weighted mean and the maximum of the allocation step function over
  ``[start, end]``.
* **idle GPUs while pods wait**: over the time at least one pod is not bound
  (``waiting_span_s``; in DRA mode a pod whose claim is allocated and being prepared is
  bound), the time-weighted mean number of GPUs on which nothing is bound (no pod holds any of
  their devices).  It separates capacity lost (GPUs idle while work waits: batch windows, applies,
  holds, drains, or pods no idle GPU can serve, such as a whole-node pod while every node
  runs something) from the order in which pods are served.
* **overtakes**: pods first bound while an older pod with the same requests (arrived earlier)
  was not bound yet: how far the order of service is from first come, first served within a
  request (pods that arrived at the same instant do not overtake each other).
* **idle GPUs while one-GPU pods wait**: the same mean, over the time at least one pod asking
  for one slice unit (one MIG instance, one MPS slice) is not bound.  Any idle GPU could serve
  such a pod after a repartition, so this is the capacity the partitioner itself leaves unused
  while work it could place waits: batch windows, applies, kubelet syncs, holds and drains,
  or CPU/memory a node lacks.  Pods no idle GPU can serve (multi-GPU pods) do not count here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from operator import attrgetter
from typing import Any

__all__ = [
    "LayoutChange",
    "PlanRecord",
    "PodRecord",
    "ReplayResult",
    "ReplaySummary",
    "change_log",
    "layout_shape",
    "nearest_rank",
    "pending_by_size",
    "request_shape",
    "summarize",
    "time_weighted_mean",
    "transitions",
]


@dataclass(slots=True)
class PodRecord:
    name: str
    arrival: float
    requests: dict[str, int]
    first_bound: float | None = None
    pending_s: float = 0.0
    """Completed waits (arrival -> bind, disruption -> re-bind)."""
    waiting_since: float | None = None
    """Start of the current wait, while the pod is pending."""
    disruptions: int = 0
    abandoned: bool = False

    def pending_at(self, end: float) -> float:
        """Total pending time, counting a wait still open at ``end`` up to ``end``."""
        open_wait = end - self.waiting_since if self.waiting_since is not None else 0.0
        return self.pending_s + max(0.0, open_wait)


@dataclass(frozen=True, slots=True)
class PlanRecord:
    time: float
    batch: int
    planner_ms: float
    placed: int
    unplaced: int
    gpus_reconfigured: int
    reused: bool = False
    """True when an identical input was planned before and its plan was reused."""


@dataclass(frozen=True, slots=True)
class LayoutChange:
    """One GPU whose layout an applied spec changed (``ReplaySettings.record_changes``)."""

    time: float
    node: str
    gpu: int
    before: tuple[str, ...]
    after: tuple[str, ...]
    """Device names, :class:`simulations.replay.fake_cluster.GpuChange`'s."""
    waiting: dict[str, int]
    """Pods waiting to be bound at that moment, per request (:func:`request_shape`): what the
    change was made for, or around."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "node": self.node,
            "gpu": self.gpu,
            "before": list(self.before),
            "after": list(self.after),
            "waiting": self.waiting,
        }


@dataclass(slots=True)
class ReplayResult:
    policy: str
    pods: list[PodRecord]
    plans: list[PlanRecord] = field(default_factory=list)
    reconfigurations: list[tuple[float, int]] = field(default_factory=list)
    allocation: list[tuple[float, float]] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    disruptions: int = 0
    """Bound pods whose device an applied spec removed."""
    planner_errors: list[str] = field(default_factory=list)
    spec_conflicts: int = 0
    events: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What makes this replay unlike production for every policy (e.g. pods of several
    priorities, which the replay's kube-scheduler never preempts); reports print them."""
    theft: int = 0
    """Slices made or reserved for one pod that another pod bound."""
    admission_rejections: int = 0
    """Pods the kubelet rejected: the allocatable the scheduler saw was stale, the device
    plugin was gone, or its ``Allocate`` refused the devices picked (MPS slices of two
    daemons; such a pod is refused again at each re-creation while the free devices stay)."""
    scheduling_attempts: int = 0
    partitioner_steps: int = 0
    api_refusals: dict[str, int] = field(default_factory=dict)
    status_sync: dict[str, float] = field(default_factory=dict)
    """Node -> phase (s) of its kubelet's node-status sync: syncs at ``phase + k * 10 s``."""
    waiting_span_s: float = 0.0
    """Time during which at least one pod waited."""
    idle_gpu_s_waiting: float = 0.0
    """GPU-seconds of GPUs with nothing bound, during :attr:`waiting_span_s`."""
    one_gpu_waiting_span_s: float = 0.0
    """Time during which at least one pod asking for one slice unit waited."""
    idle_gpu_s_one_gpu_waiting: float = 0.0
    """GPU-seconds of GPUs with nothing bound, during :attr:`one_gpu_waiting_span_s`."""
    layout_changes: list[LayoutChange] = field(default_factory=list)
    """Every GPU an applied spec changed, with the waiting queue then (only with
    ``ReplaySettings.record_changes``; DRA prepares and static layouts are not specs)."""

    def pending_times(self) -> list[float]:
        return [p.pending_at(self.end) for p in self.pods]


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100); NaN for no values."""
    if not 0 < q <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def time_weighted_mean(steps: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Mean of a right-continuous step function over ``[start, end]`` (0 before the first step)."""
    if end <= start:
        return steps[-1][1] if steps else 0.0
    total = 0.0
    value = 0.0
    t_prev = start
    for t, v in steps:
        if t > end:
            break
        if t > t_prev:
            total += value * (t - t_prev)
            t_prev = t
        value = v
    total += value * (end - t_prev)
    return total / (end - start)


@dataclass(frozen=True, slots=True)
class ReplaySummary:
    policy: str
    pods: int
    pending_p50_s: float
    pending_p95_s: float
    pending_p99_s: float
    never_scheduled: int
    reconfigurations_per_hour: float
    gpus_reconfigured: int
    pods_disrupted: int
    plans: int
    plans_reused: int
    planner_ms_p50: float
    planner_ms_p95: float
    planner_ms_max: float
    planner_ms_mean: float
    allocation_mean: float
    allocation_max: float
    span_s: float
    planner_errors: int
    wall_s: float
    theft: int = 0
    admission_rejections: int = 0
    pending_by_size: dict[str, dict[str, float]] = field(default_factory=dict)
    """``resource xunits`` -> pods, p50, p95, p99 of their pending time (s)."""
    waiting_span_s: float = 0.0
    idle_gpus_while_waiting: float = 0.0
    """Mean GPUs with nothing bound while at least one pod waits (module docstring)."""
    one_gpu_waiting_span_s: float = 0.0
    idle_gpus_while_one_gpu_pods_wait: float = 0.0
    """Mean GPUs with nothing bound while at least one one-unit pod waits (module docstring)."""
    pending_mean_s: float = 0.0
    """Mean pending time over all pods (module docstring, "pending time")."""
    overtakes: int = 0
    """First bindings that went to a pod while an older pod with the same requests had not
    been bound yet (module docstring)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in ((f, getattr(self, f)) for f in self.__slots__)
        }


def request_shape(requests: Mapping[str, int]) -> str:
    """A pod's request as one label: ``nvidia.com/mig-7g.80gb x2`` (several resources joined
    by `` + ``, by name)."""
    return " + ".join(f"{r} x{k}" for r, k in sorted(requests.items()))


def layout_shape(devices: Sequence[str]) -> str:
    """A GPU layout without positions: ``4g.40gb+3g.40gb`` (device order), ``-`` if empty."""
    return "+".join(d.split("@", 1)[0] for d in devices) or "-"


def transitions(result: ReplayResult) -> dict[str, int]:
    """How often each GPU layout became each other one (``7g.80gb -> 4g.40gb``), most
    frequent first (ties by name), over :attr:`ReplayResult.layout_changes`."""
    counts: dict[str, int] = {}
    for c in result.layout_changes:
        key = f"{layout_shape(c.before)} -> {layout_shape(c.after)}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def change_log(result: ReplayResult) -> dict[str, Any]:
    """A replay's layout changes for a JSON file: :func:`transitions` and every
    :class:`LayoutChange` (``bench_replay --trace-log``, the time-replay report's
    ``layout_changes.json``)."""
    return {
        "transitions": transitions(result),
        "layout_changes": [c.as_dict() for c in result.layout_changes],
    }


def pending_by_size(result: ReplayResult) -> dict[str, dict[str, float]]:
    """Pending-time percentiles per request shape (:func:`request_shape`)."""
    groups: dict[str, list[float]] = {}
    for p in result.pods:
        groups.setdefault(request_shape(p.requests), []).append(p.pending_at(result.end))
    return {
        shape: {
            "pods": float(len(v)),
            "p50": nearest_rank(v, 50),
            "p95": nearest_rank(v, 95),
            "p99": nearest_rank(v, 99),
        }
        for shape, v in sorted(groups.items())
    }


def overtakes(pods: Sequence[PodRecord]) -> int:
    """Pods first bound while an older pod with the same requests (:func:`request_shape`) was
    still unbound (a pod never bound counts as unbound to the end)."""
    by_request: dict[str, list[PodRecord]] = {}
    for p in pods:
        by_request.setdefault(request_shape(p.requests), []).append(p)
    count = 0
    for group in by_request.values():
        latest = -math.inf  # the latest first binding among the pods that arrived earlier
        arrival = attrgetter("arrival")
        for _, same in groupby(sorted(group, key=arrival), key=arrival):
            bounds = [math.inf if p.first_bound is None else p.first_bound for p in same]
            count += sum(1 for b in bounds if b < latest)
            latest = max(latest, *bounds)
    return count


def summarize(result: ReplayResult) -> ReplaySummary:
    """The metrics of the module docstring."""
    pending = result.pending_times()
    span = max(0.0, result.end - result.start)
    reconfigured = sum(n for _, n in result.reconfigurations)
    computed = [p.planner_ms for p in result.plans if not p.reused]
    return ReplaySummary(
        policy=result.policy,
        pods=len(result.pods),
        pending_p50_s=nearest_rank(pending, 50),
        pending_p95_s=nearest_rank(pending, 95),
        pending_p99_s=nearest_rank(pending, 99),
        never_scheduled=sum(1 for p in result.pods if p.first_bound is None),
        reconfigurations_per_hour=reconfigured / (span / 3600) if span > 0 else 0.0,
        gpus_reconfigured=reconfigured,
        pods_disrupted=result.disruptions,
        plans=len(computed),
        plans_reused=len(result.plans) - len(computed),
        planner_ms_p50=nearest_rank(computed, 50),
        planner_ms_p95=nearest_rank(computed, 95),
        planner_ms_max=max(computed) if computed else math.nan,
        planner_ms_mean=sum(computed) / len(computed) if computed else math.nan,
        allocation_mean=time_weighted_mean(result.allocation, result.start, result.end),
        allocation_max=max((v for _, v in result.allocation), default=0.0),
        span_s=span,
        planner_errors=len(result.planner_errors),
        wall_s=result.wall_s,
        theft=result.theft,
        admission_rejections=result.admission_rejections,
        pending_by_size=pending_by_size(result),
        waiting_span_s=result.waiting_span_s,
        idle_gpus_while_waiting=(
            result.idle_gpu_s_waiting / result.waiting_span_s if result.waiting_span_s else 0.0
        ),
        one_gpu_waiting_span_s=result.one_gpu_waiting_span_s,
        pending_mean_s=sum(pending) / len(pending) if pending else 0.0,
        overtakes=overtakes(result.pods),
        idle_gpus_while_one_gpu_pods_wait=(
            result.idle_gpu_s_one_gpu_waiting / result.one_gpu_waiting_span_s
            if result.one_gpu_waiting_span_s
            else 0.0
        ),
    )
