"""Prometheus metrics of the partitioner (served on ``/metrics``, port ``metrics_port``).

Each :class:`Metrics` owns its registry, so several controllers (tests, restarts) never clash.

* ``gpuslice_pending_pods`` (gauge): batchable pods seen in the last cycle.
* ``gpuslice_batch_size`` (histogram): pods per planned batch.
* ``gpuslice_plan_duration_seconds`` (histogram): wall time of one planning step.
* ``gpuslice_pods_planned_total`` / ``gpuslice_pods_unplaceable_total`` (counters).
* ``gpuslice_gpus_reconfigured_total`` (counter): GPUs whose written layout changed.
* ``gpuslice_spec_to_applied_seconds`` (histogram): from a spec write until the node agent
  reports that generation applied.
* ``gpuslice_spec_conflicts_total`` (counter): spec writes refused with 409 (retried).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["Metrics"]

_BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
_LATENCY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


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

    def serve(self, port: int) -> None:
        """Start the /metrics HTTP server in a daemon thread."""
        start_http_server(port, registry=self.registry)
