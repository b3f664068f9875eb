"""Prometheus metrics of the node agent (served on ``/metrics`` of ``metrics_port``).

Model
-----
Each :class:`AgentMetrics` owns its registry, so several agents in one process (tests) never
clash.  The agent loop calls :meth:`AgentMetrics.observe_pass` after every reconcile pass and
:meth:`AgentMetrics.observe_failure` when a pass raised; :class:`MeteredNvml` wraps the NVML
port and counts every driver error on its way to the reconciler.

========================================================  =========  ================================
metric                                                    type       meaning
========================================================  =========  ================================
``gpuslice_agent_reconcile_passes_total``                 counter    reconcile passes run (ok or not)
``gpuslice_agent_reconcile_failures_total``               counter    passes that raised or reported
                                                                     errors (``status.lastError``)
``gpuslice_agent_reconcile_duration_seconds``             histogram  wall time of one pass
``gpuslice_agent_nvml_operations_total``                  counter    mutating NVML calls made
``gpuslice_agent_nvml_errors_total{op,code}``             counter    NVML errors by port operation
                                                                     and code (``IN_USE``, ...)
``gpuslice_agent_devices_advertised{resource,health}``    gauge      devices advertised to the
                                                                     kubelet (``Healthy``/
                                                                     ``Unhealthy``)
``gpuslice_agent_apply_latency_seconds``                  histogram  from the first pass that saw a
                                                                     spec generation until the pass
                                                                     that applied it
``gpuslice_agent_spec_applied``                           gauge      1 if the last pass reported the
                                                                     spec Applied, else 0
``gpuslice_agent_spec_degraded``                          gauge      1 if the last pass reported
                                                                     Degraded, else 0
``gpuslice_agent_draining``                               gauge      1 if the last pass found no
                                                                     NodePartitioning (draining: only
                                                                     devices pods hold stay
                                                                     advertised), else 0
``gpuslice_agent_mps_daemon_deaths_total{daemon}``        counter    MPS control daemons found dead
                                                                     after they ran, by daemon key
                                                                     (``gpu0``, ``gpu0-mig4``); a
                                                                     steady rise is a crash loop
``gpuslice_agent_xid_errors_total{gpu,xid}``              counter    XID events NVML reported, by GPU
                                                                     index (``unknown`` if NVML could
                                                                     not tell) and XID code, ignored
                                                                     application errors included
``gpuslice_agent_kube_api_errors_total{call}``            counter    NodePartitioning reads (``read``)
                                                                     and status writes
                                                                     (``write_status``) that failed
                                                                     for lack of an API server
                                                                     (connection, timeout, 5xx, 429);
                                                                     not liveness failures
``gpuslice_agent_spec_stale``                             gauge      1 if the last pass went on with
                                                                     the spec last read (the API did
                                                                     not answer), else 0
========================================================  =========  ================================

The agent calls :meth:`AgentMetrics.observe_daemon_deaths` with the deaths its liveness check
reports (:meth:`node_agent.mps.ProcessSupervisor.check`) and :meth:`AgentMetrics.observe_xid`
with every XID event its watcher reports (:mod:`node_agent.xid`).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from node_agent.deviceplugin import HEALTHY, UNHEALTHY
from node_agent.nvml import (
    ComputeMode,
    GpuInfo,
    GpuInstanceInfo,
    MigDevice,
    Nvml,
    NvmlError,
    NvmlErrorCode,
    XidEvent,
    XidRegistration,
)
from node_agent.reconciler import ReconcileResult, instances_with_ci_slices

__all__ = ["AgentMetrics", "MeteredNvml"]

_PASS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
_APPLY_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.passes = Counter("gpuslice_agent_reconcile_passes", "Reconcile passes", registry=r)
        self.failures = Counter(
            "gpuslice_agent_reconcile_failures",
            "Reconcile passes that raised or reported errors",
            registry=r,
        )
        self.duration = Histogram(
            "gpuslice_agent_reconcile_duration_seconds",
            "Wall time of one reconcile pass",
            buckets=_PASS_BUCKETS,
            registry=r,
        )
        self.nvml_operations = Counter(
            "gpuslice_agent_nvml_operations", "Mutating NVML calls made", registry=r
        )
        self.nvml_errors = Counter(
            "gpuslice_agent_nvml_errors",
            "NVML errors by operation and code",
            ["op", "code"],
            registry=r,
        )
        self.devices = Gauge(
            "gpuslice_agent_devices_advertised",
            "Devices advertised to the kubelet",
            ["resource", "health"],
            registry=r,
        )
        self.apply_latency = Histogram(
            "gpuslice_agent_apply_latency_seconds",
            "First pass seeing a spec generation to the pass applying it",
            buckets=_APPLY_BUCKETS,
            registry=r,
        )
        self.applied = Gauge(
            "gpuslice_agent_spec_applied", "1 if the last pass reported Applied", registry=r
        )
        self.degraded = Gauge(
            "gpuslice_agent_spec_degraded", "1 if the last pass reported Degraded", registry=r
        )
        self.draining = Gauge(
            "gpuslice_agent_draining",
            "1 if the last pass found no NodePartitioning (draining the node)",
            registry=r,
        )
        self.mps_daemon_deaths = Counter(
            "gpuslice_agent_mps_daemon_deaths",
            "MPS control daemons found dead after they ran, by daemon key",
            ["daemon"],
            registry=r,
        )
        self.xid_errors = Counter(
            "gpuslice_agent_xid_errors",
            "XID events NVML reported, by GPU index and XID code",
            ["gpu", "xid"],
            registry=r,
        )
        self.dra_prepares = Counter(
            "gpuslice_agent_dra_prepares",
            "DRA mode: claims the kubelet asked to prepare, by result (prepared, failed)",
            ["result"],
            registry=r,
        )
        self.dra_unprepares = Counter(
            "gpuslice_agent_dra_unprepares",
            "DRA mode: claims the kubelet asked to unprepare, by result (released, failed)",
            ["result"],
            registry=r,
        )
        self.dra_prepare_failures = Gauge(
            "gpuslice_agent_dra_prepare_failures",
            "DRA mode: claims whose last prepare failed (status.prepareFailures)",
            registry=r,
        )
        self.foreign_slices = Gauge(
            "gpuslice_agent_foreign_slices",
            "MIG instances (in DRA mode also GPUs with MIG off) running processes that no pod or "
            "claim holds them for; withheld from every pod until those end",
            registry=r,
        )
        self.kube_api_errors = Counter(
            "gpuslice_agent_kube_api_errors",
            "NodePartitioning reads and status writes that failed for lack of an API server",
            ["call"],
            registry=r,
        )
        self.spec_stale = Gauge(
            "gpuslice_agent_spec_stale",
            "1 if the last pass went on with the spec last read (the API did not answer)",
            registry=r,
        )
        self._device_labels: set[tuple[str, str]] = set()
        self._generation: int | None = None
        self._generation_seen_at = 0.0
        self._generation_applied = False

    def observe_pass(
        self, generation: int, result: ReconcileResult, duration_s: float, now: float
    ) -> None:
        """Record one finished pass (``now``: a monotonic clock reading at its end)."""
        self.passes.inc()
        self.duration.observe(duration_s)
        self.nvml_operations.inc(result.operations)
        if result.errors:
            self.failures.inc()
        self.applied.set(1 if result.applied else 0)
        self.degraded.set(1 if result.degraded else 0)
        self.draining.set(1 if result.draining else 0)
        if generation != self._generation:
            self._generation = generation
            self._generation_seen_at = now - duration_s
            self._generation_applied = False
        if result.applied and not self._generation_applied:
            self._generation_applied = True
            self.apply_latency.observe(max(0.0, now - self._generation_seen_at))
        if result.fresh:
            self._set_devices(result)
            self.foreign_slices.set(sum(m.foreign for g in result.status.gpus for m in g.mig))

    def observe_foreign(self, count: int) -> None:
        """DRA mode: the placements (or whole GPUs) a round found running processes outside
        any claim (:mod:`node_agent.dra_foreign`)."""
        self.foreign_slices.set(count)

    def observe_daemon_deaths(self, keys: list[str]) -> None:
        """Record MPS daemons found dead (one count per key listed)."""
        for key in keys:
            self.mps_daemon_deaths.labels(key).inc()

    def observe_xid(self, event: XidEvent) -> None:
        """Record one XID event (critical or ignored)."""
        gpu = "unknown" if event.gpu is None else str(event.gpu)
        self.xid_errors.labels(gpu, str(event.xid)).inc()

    def observe_api_error(self, call: str) -> None:
        """Record a NodePartitioning read (``read``) or status write (``write_status``) that
        failed for lack of an API server (:func:`node_agent.agent.api_unavailable`)."""
        self.kube_api_errors.labels(call).inc()

    def observe_spec_stale(self, stale: bool) -> None:
        """Record whether the last pass went on with the spec last read."""
        self.spec_stale.set(1 if stale else 0)

    def observe_failure(self, duration_s: float) -> None:
        """Record a pass that raised."""
        self.passes.inc()
        self.failures.inc()
        self.duration.observe(duration_s)

    def _set_devices(self, result: ReconcileResult) -> None:
        counts: dict[tuple[str, str], int] = {}
        for resource, devices in result.devices.items():
            for d in devices:
                key = (resource, HEALTHY if d.healthy else UNHEALTHY)
                counts[key] = counts.get(key, 0) + 1
        for gone in self._device_labels - set(counts):
            self.devices.remove(*gone)
        for key, n in counts.items():
            self.devices.labels(*key).set(n)
        self._device_labels = set(counts)


class MeteredNvml:
    """An :class:`~node_agent.nvml.Nvml` that counts the errors of the one it wraps."""

    def __init__(self, inner: Nvml, metrics: AgentMetrics) -> None:
        self._inner = inner
        self._errors = metrics.nvml_errors

    def _count(self, op: str, err: NvmlError) -> None:
        self._errors.labels(op, err.code.name).inc()

    def gpus(self, *, isolate: bool = False) -> list[GpuInfo]:
        try:
            out = self._inner.gpus(isolate=isolate)
        except NvmlError as e:
            self._count("gpus", e)
            raise
        for info in out:
            if info.read_error is not None:  # one GPU unreadable (isolate=True)
                self._count("gpus", info.read_error)
        return out

    def set_mig_mode(self, gpu: int, enabled: bool) -> NvmlErrorCode | None:
        try:
            return self._inner.set_mig_mode(gpu, enabled)
        except NvmlError as e:
            self._count("set_mig_mode", e)
            raise

    def reset_gpu(self, gpu: int) -> None:
        try:
            self._inner.reset_gpu(gpu)
        except NvmlError as e:
            self._count("reset_gpu", e)
            raise

    def set_compute_mode(self, gpu: int, mode: ComputeMode) -> None:
        try:
            self._inner.set_compute_mode(gpu, mode)
        except NvmlError as e:
            self._count("set_compute_mode", e)
            raise

    def gpu_instances(self, gpu: int) -> list[GpuInstanceInfo]:
        try:
            return self._inner.gpu_instances(gpu)
        except NvmlError as e:
            self._count("gpu_instances", e)
            raise

    def gpu_instances_with_ci_slices(
        self, gpu: int
    ) -> list[tuple[GpuInstanceInfo, Mapping[int, int]]]:
        """The wrapped adapter's GIs with their CIs' compute slices
        (:func:`node_agent.reconciler.instances_with_ci_slices`)."""
        try:
            return instances_with_ci_slices(self._inner, gpu)
        except NvmlError as e:
            self._count("gpu_instances", e)
            raise

    def create_gpu_instance(self, gpu: int, profile_id: int, start: int, size: int) -> int:
        try:
            return self._inner.create_gpu_instance(gpu, profile_id, start, size)
        except NvmlError as e:
            self._count("create_gpu_instance", e)
            raise

    def create_compute_instance(self, gpu: int, gi_id: int) -> int:
        try:
            return self._inner.create_compute_instance(gpu, gi_id)
        except NvmlError as e:
            self._count("create_compute_instance", e)
            raise

    def destroy_compute_instance(self, gpu: int, gi_id: int, ci_id: int) -> None:
        try:
            self._inner.destroy_compute_instance(gpu, gi_id, ci_id)
        except NvmlError as e:
            self._count("destroy_compute_instance", e)
            raise

    def destroy_gpu_instance(self, gpu: int, gi_id: int) -> None:
        try:
            self._inner.destroy_gpu_instance(gpu, gi_id)
        except NvmlError as e:
            self._count("destroy_gpu_instance", e)
            raise

    def mig_devices(self, gpu: int) -> list[MigDevice]:
        try:
            return self._inner.mig_devices(gpu)
        except NvmlError as e:
            self._count("mig_devices", e)
            raise

    def running_processes(self, gpu: int, gi_id: int | None = None) -> list[int]:
        try:
            return self._inner.running_processes(gpu, gi_id)
        except NvmlError as e:
            self._count("running_processes", e)
            raise

    def process_name(self, pid: int) -> str:
        return self._inner.process_name(pid)

    def watch_xids(self) -> XidRegistration:
        try:
            return self._inner.watch_xids()
        except NvmlError as e:
            self._count("watch_xids", e)
            raise

    def xid_events(self, timeout_ms: int) -> list[XidEvent]:
        try:
            return self._inner.xid_events(timeout_ms)
        except NvmlError as e:
            self._count("xid_events", e)
            raise
