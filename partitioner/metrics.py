"""Prometheus metrics of the partitioner (served on ``/metrics``, port ``metrics_port``).

Each :class:`Metrics` owns its registry, so several controllers (tests, restarts) never clash.

* ``gpuslice_pending_pods`` (gauge): batchable pods seen in the last cycle.
* ``gpuslice_batch_size`` (histogram): pods per planned batch.
* ``gpuslice_plan_duration_seconds`` (histogram): wall time of one planning step.
* ``gpuslice_pods_planned_total`` / ``gpuslice_pods_unplaceable_total`` (counters): placed pods
  count once their node's spec was written (or needed no change); a plan whose spec write
  failed is counted when it is written.  ``gpuslice_batch_size`` likewise observes a batch once
  one of its placements took effect.
* ``gpuslice_gpus_reconfigured_total`` (counter): GPUs whose written layout changed (specs
  actually written only).
* ``gpuslice_spec_to_applied_seconds`` (histogram): from a spec write until the node agent
  reports that generation applied.
* ``gpuslice_spec_conflicts_total`` (counter): spec writes refused with 409 (retried).
* ``gpuslice_write_failures_total{action,code}`` (counter): every write that failed, by action
  (``create_partitioning``, ``write_spec``, ``write_reservations``, ``set_node_condition``,
  ``patch_pod``, ``evict_pod``, ``emit_event`` ...) and answer (the status code, or
  ``unreachable`` / ``timeout``).  404 and 409 on pods are routine (a pod gone or changed); a
  steady 400/403/422 is a policy or RBAC refusing gpuslice (a ``WriteRefused`` or
  ``PatchRefused`` Event says which), 5xx an API server in trouble.
* ``gpuslice_oldest_pending_pod_seconds`` (gauge): age of the oldest pod waiting for a slice
  (unbound, asking for a slice), from its creation; 0 when none waits.
* ``gpuslice_reservations{state}`` (gauge): pods holding a reservation, by state: ``planned``
  (slice planned or free, pod still gated), ``released`` (ungated, pinned to the node, not
  bound yet), ``draining`` (GPUs being emptied for it).
* ``gpuslice_pods_stranded`` (gauge): pods pinned to a node that cannot serve them: released
  ones, and DRA pods bound to a silent agent's node before they started or whose claim the
  agent fails to prepare (their Event says when they are evicted, or to delete them).
* ``gpuslice_pods_evicted_total`` (counter): stranded pods evicted so that their controller
  creates them again (``recreateStrandedSeconds``).
* ``gpuslice_nodes_left_out{reason}`` (gauge): opted-in nodes left out of planning, by the reason
  of their ``GpusliceReady=False`` condition.
* ``gpuslice_planner_errors_total`` (counter): decision steps whose planner failed (the batch is
  retried; the error is logged and told to the pods).
* ``gpuslice_step_failures_total`` (counter): decision steps that raised (liveness counts them).
* ``gpuslice_leader`` (gauge): 1 while this replica leads (plans and writes), else 0; always 1
  without leader election.
* ``gpuslice_heap_frozen_cycles_total`` (counter): objects in reference cycles among frozen
  objects that the periodic heap reclaim freed (:mod:`partitioner.heap`): what the heap policy
  kept alive until then.  A rate that grows with time rather than with the cluster's churn is a
  leak worth reporting.
* ``gpuslice_heap_reclaim_seconds`` (gauge): how long the last heap reclaim paused the
  controller (one full collection of the whole heap).
* ``gpuslice_webhook_ca_bundle_restored_total`` (counter): times this replica found the
  MutatingWebhookConfiguration's caBundle missing or not trusting its certificate (replaced or
  re-created without it) and restored it (:mod:`partitioner.webhook_certs`); until then admission
  calls failed and slice pods were admitted ungated.

:meth:`Metrics.observe_waiting` sets the waiting gauges from one decision step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["RESERVATION_STATES", "Metrics"]

_BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
_LATENCY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600)

RESERVATION_STATES = {"planned": "held", "released": "released", "draining": "draining"}
"""``state`` label of ``gpuslice_reservations`` -> the decision step's count of it."""


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.pending_pods = Gauge("gpuslice_pending_pods", "Batchable pending pods", registry=r)
        self.batch_size = Histogram(
            "gpuslice_batch_size", "Pods per planned batch", buckets=_BATCH_BUCKETS, registry=r
        )
        self.plan_duration = Histogram(
            "gpuslice_plan_duration_seconds", "Wall time of one planning step", registry=r
        )
        self.pods_planned = Counter("gpuslice_pods_planned", "Pods given a placement", registry=r)
        self.pods_unplaceable = Counter(
            "gpuslice_pods_unplaceable", "Pods a plan could not place", registry=r
        )
        self.gpus_reconfigured = Counter(
            "gpuslice_gpus_reconfigured", "GPUs whose desired layout changed", registry=r
        )
        self.spec_to_applied = Histogram(
            "gpuslice_spec_to_applied_seconds",
            "Spec write to applied status",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.spec_conflicts = Counter(
            "gpuslice_spec_conflicts", "Spec writes refused with 409", registry=r
        )
        self.write_failures = Counter(
            "gpuslice_write_failures",
            "Writes that failed, by action and answer (status code, unreachable, timeout)",
            ["action", "code"],
            registry=r,
        )
        self.warm_slices = Counter(
            "gpuslice_warm_slices",
            "Specs written to keep a free slice ready while nothing waits (warmSliceShare)",
            registry=r,
        )
        self.oldest_pending = Gauge(
            "gpuslice_oldest_pending_pod_seconds",
            "Age of the oldest pod waiting for a slice (0: none waits)",
            registry=r,
        )
        self.reservations = Gauge(
            "gpuslice_reservations", "Pods holding a reservation, by state", ["state"], registry=r
        )
        for state in RESERVATION_STATES:
            self.reservations.labels(state).set(0)
        self.pods_stranded = Gauge(
            "gpuslice_pods_stranded", "Pods pinned to a node that cannot serve them", registry=r
        )
        self.pods_evicted = Counter(
            "gpuslice_pods_evicted",
            "Stranded pods evicted so that their controller creates them again",
            registry=r,
        )
        self.nodes_left_out = Gauge(
            "gpuslice_nodes_left_out",
            "Opted-in nodes left out of planning, by reason",
            ["reason"],
            registry=r,
        )
        self._left_out_reasons: set[str] = set()
        self.planner_errors = Counter(
            "gpuslice_planner_errors", "Decision steps whose planner failed", registry=r
        )
        self.step_failures = Counter(
            "gpuslice_step_failures", "Decision steps that raised", registry=r
        )
        self.leader = Gauge(
            "gpuslice_leader",
            "1 while this replica leads (plans and writes), else 0",
            registry=r,
        )
        self.heap_frozen_cycles = Counter(
            "gpuslice_heap_frozen_cycles",
            "Objects in reference cycles among frozen objects freed by the heap reclaim",
            registry=r,
        )
        self.heap_reclaim_seconds = Gauge(
            "gpuslice_heap_reclaim_seconds",
            "Duration of the last heap reclaim (a full collection of the whole heap)",
            registry=r,
        )
        self.webhook_ca_bundle_restored = Counter(
            "gpuslice_webhook_ca_bundle_restored",
            "Times the webhook configuration's caBundle was found wrong and restored",
            registry=r,
        )

    def observe_waiting(
        self,
        counts: Mapping[str, int],
        created: Iterable[float | None],
        left_out: Iterable[str],
        now: float,
    ) -> None:
        """Set the waiting gauges from one decision step.

        ``counts``: the step's counts (waiting, held, released, draining, stranded);
        ``created``: creation times (epoch seconds) of the pods waiting for a slice, ``None``
        where unknown; ``left_out``: the reason of each node left out of planning; ``now``: the
        step's clock, in the same epoch.
        """
        self.pending_pods.set(int(counts.get("waiting", 0)))
        known = [t for t in created if t is not None]
        self.oldest_pending.set(max(0.0, now - min(known)) if known else 0.0)
        for state, key in RESERVATION_STATES.items():
            self.reservations.labels(state).set(int(counts.get(key, 0)))
        self.pods_stranded.set(int(counts.get("stranded", 0)))
        reasons: dict[str, int] = {}
        for reason in left_out:
            reasons[reason] = reasons.get(reason, 0) + 1
        for gone in self._left_out_reasons - set(reasons):
            self.nodes_left_out.remove(gone)
        for reason, n in reasons.items():
            self.nodes_left_out.labels(reason).set(n)
        self._left_out_reasons = set(reasons)

    def not_leading(self) -> None:
        """This replica does not decide (a follower, or a leader that lost the Lease): the
        waiting gauges say nothing from it, so the dashboard's sums and the alerts over both
        replicas read the leader's figures only (a deposed leader kept exporting its last
        step's, and alerts kept firing after the problem was gone)."""
        self.pending_pods.set(0)
        self.oldest_pending.set(0.0)
        for state in RESERVATION_STATES:
            self.reservations.labels(state).set(0)
        self.pods_stranded.set(0)
        for gone in self._left_out_reasons:
            self.nodes_left_out.remove(gone)
        self._left_out_reasons = set()

    def serve(self, port: int) -> None:
        """Start the /metrics HTTP server in a daemon thread."""
        start_http_server(port, registry=self.registry)
