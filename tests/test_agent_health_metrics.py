"""The agent's /healthz rule, its HTTP endpoint (real HTTP on a free port) and its metrics."""

from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from manual_clock import ManualClock
from prometheus_client import CollectorRegistry

from contract.nodepartitioning import NodePartitioning, NodePartitioningSpec
from node_agent.agent import Agent, InMemorySpecSource
from node_agent.health import AgentHealth, MonitoringServer
from node_agent.metrics import AgentMetrics, MeteredNvml
from node_agent.mps import FakeSupervisor
from node_agent.nvml import ComputeMode, NvmlError, NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from node_agent.reconciler import Reconciler
from planner.catalog import default_catalog

CAT = default_catalog()


class NoPods:
    async def in_use_device_ids(self) -> set[str]:
        return set()


def mig_spec(*instances: tuple[str, int]) -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate(
        {"mode": "mig", "gpus": [{"index": 0, "mig": [{"profile": p, "start": s} for p, s in instances]}]}
    )  # fmt: skip


def sample(metrics: AgentMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


# -- the health rule ---------------------------------------------------------------------------


def test_unhealthy_only_after_failing_longer_than_n_resyncs() -> None:
    clock = ManualClock(1000.0)
    health = AgentHealth(resync_seconds=10, failure_resyncs=3, clock=clock)
    assert health.check() == (True, "ok")
    health.record(False, "reading GPUs: NVML_ERROR_GPU_IS_LOST")
    clock.now += 25
    health.record(False, "reading GPUs: NVML_ERROR_GPU_IS_LOST")
    assert health.check()[0]  # failing for 25 s < 3 x 10 s
    clock.now += 6
    health.record(False, "reading GPUs: NVML_ERROR_GPU_IS_LOST")
    ok, reason = health.check()
    assert not ok and "failing for 31s" in reason and "GPU_IS_LOST" in reason
    health.record(True)  # one good pass heals
    assert health.check() == (True, "ok")


def test_unhealthy_when_no_pass_finishes() -> None:
    clock = ManualClock(1000.0)
    health = AgentHealth(resync_seconds=10, failure_resyncs=2, clock=clock)
    clock.now += 20
    assert health.check()[0]
    clock.now += 1  # a stuck loop (e.g. a hung driver call): no pass for > 2 x 10 s since start
    ok, reason = health.check()
    assert not ok and "no reconcile pass finished for 21s" in reason
    health.record(True)
    assert health.check()[0]


def test_health_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError, match="failure_resyncs"):
        AgentHealth(resync_seconds=10, failure_resyncs=0)


# -- the HTTP endpoint -------------------------------------------------------------------------


@pytest.fixture
def served() -> Iterator[tuple[ManualClock, AgentHealth, AgentMetrics, str]]:
    clock = ManualClock(1000.0)
    health = AgentHealth(resync_seconds=1, failure_resyncs=2, clock=clock)
    metrics = AgentMetrics(CollectorRegistry())
    server = MonitoringServer(health, metrics.registry, port=0, host="127.0.0.1")
    server.start()
    try:
        yield clock, health, metrics, f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_healthz_and_metrics_over_http(
    served: tuple[ManualClock, AgentHealth, AgentMetrics, str],
) -> None:
    clock, health, metrics, base = served
    assert get(f"{base}/healthz")[::2] == (200, "ok\n")
    health.record(False, "kubelet PodResources unavailable")
    clock.now += 2.5
    code, _, body = get(f"{base}/healthz")
    assert code == 503 and body.startswith("unhealthy: reconcile failing for 2s")

    metrics.passes.inc()
    code, ctype, body = get(f"{base}/metrics")
    assert code == 200 and ctype.startswith("text/plain")
    assert "gpuslice_agent_reconcile_passes_total 1.0" in body
    for name in (
        "gpuslice_agent_reconcile_failures_total",
        "gpuslice_agent_reconcile_duration_seconds_bucket",
        "gpuslice_agent_nvml_operations_total",
        "gpuslice_agent_apply_latency_seconds_bucket",
        "gpuslice_agent_spec_applied",
        "gpuslice_agent_spec_degraded",
    ):
        assert name in body
    assert get(f"{base}/")[0] == 404


# -- metrics from real passes ------------------------------------------------------------------


async def test_agent_passes_feed_metrics_and_health() -> None:
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")])
    metrics = AgentMetrics(CollectorRegistry())
    clock = ManualClock(1000.0)
    health = AgentHealth(resync_seconds=1, failure_resyncs=1, clock=clock)
    reconciler = Reconciler(MeteredNvml(nv, metrics), NoPods(), FakeSupervisor(nvml=nv), CAT)
    source = InMemorySpecSource("n1", mig_spec(("3g.40gb", 4), ("1g.10gb", 0), ("1g.10gb", 1)))
    agent = Agent(reconciler, source, metrics=metrics, health=health)

    nv.inject("create_gpu_instance", NvmlErrorCode.INSUFFICIENT_RESOURCES)
    res = await agent.run_once()
    assert not res.applied and res.errors
    assert sample(
        metrics, "gpuslice_agent_nvml_errors_total",
        op="create_gpu_instance", code="INSUFFICIENT_RESOURCES",
    ) == 1  # fmt: skip
    assert sample(metrics, "gpuslice_agent_reconcile_failures_total") == 1
    assert sample(metrics, "gpuslice_agent_spec_applied") == 0
    assert sample(metrics, "gpuslice_agent_apply_latency_seconds_count") == 0
    # (an error about one GPU goes to the status and metrics, not to liveness: next test)

    res = await agent.run_once()
    assert res.applied and health.check()[0]
    assert sample(metrics, "gpuslice_agent_reconcile_passes_total") == 2
    assert sample(metrics, "gpuslice_agent_reconcile_failures_total") == 1
    assert sample(metrics, "gpuslice_agent_spec_applied") == 1
    assert sample(metrics, "gpuslice_agent_apply_latency_seconds_count") == 1
    assert sample(metrics, "gpuslice_agent_apply_latency_seconds_sum") > 0
    assert sample(metrics, "gpuslice_agent_nvml_operations_total") >= 1 + 3 * 2  # MIG on, 3 GI+CI
    devices = "gpuslice_agent_devices_advertised"
    assert sample(metrics, devices, resource="nvidia.com/mig-1g.10gb", health="Healthy") == 2
    assert sample(metrics, devices, resource="nvidia.com/mig-3g.40gb", health="Healthy") == 1

    await agent.run_once()  # the same generation again: no second latency sample
    assert sample(metrics, "gpuslice_agent_apply_latency_seconds_count") == 1

    source.set_spec(mig_spec(("7g.80gb", 0)))  # resources that vanish leave the gauge
    assert (await agent.run_once()).applied
    assert sample(metrics, "gpuslice_agent_apply_latency_seconds_count") == 2
    gone = {"resource": "nvidia.com/mig-1g.10gb", "health": "Healthy"}
    assert metrics.registry.get_sample_value(devices, gone) is None
    assert sample(metrics, devices, resource="nvidia.com/mig-7g.80gb", health="Healthy") == 1


class FailingPods:
    def __init__(self) -> None:
        self.down = False

    async def in_use_device_ids(self) -> set[str]:
        if self.down:
            raise ConnectionError("PodResources List: the kubelet does not answer")
        return set()


async def test_liveness_fails_for_nvml_not_for_one_gpu_or_podresources() -> None:
    """A restart ends the MPS daemons of every GPU of the node: a pass's errors about one GPU
    (its MPS daemon cannot start beside a process outside any pod) or about PodResources
    (the kubelet does not answer) must not fail liveness however long they last -- the
    restart fixes neither and takes every MPS pod of the node down with it -- while NVML that
    cannot be read at all does (a restart initialises it anew)."""
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")] * 2)
    clock = ManualClock(1000.0)
    health = AgentHealth(resync_seconds=30, failure_resyncs=3, clock=clock)
    supervisor = FakeSupervisor(nvml=nv)
    pods = FailingPods()
    reconciler = Reconciler(nv, pods, supervisor, CAT)
    mps = {"memoryMiB": 10240, "activeThreadPercentage": 50}
    spec = NodePartitioningSpec.model_validate(
        {"mode": "mps", "gpus": [{"index": 0, "mps": [mps]}, {"index": 1, "mps": [mps]}]}
    )
    agent = Agent(reconciler, InMemorySpecSource("n1", spec), health=health)
    assert (await agent.run_once()).applied
    supervisor.kill("gpu1")
    nv.set_compute_mode(1, ComputeMode.DEFAULT)
    nv.start_process(1, name="host-app")  # outside any pod: GPU 1's daemon cannot start
    pods.down = True
    for _ in range(5):
        clock.now += 30
        res = await agent.run_once()
        assert res.errors and not res.nvml_failed
    assert any("PodResources" in e for e in res.errors)
    assert health.check() == (True, "ok")
    assert "gpu0" in supervisor.daemons  # GPU 0's MPS pods keep their server
    nv.inject("gpus", NvmlErrorCode.UNKNOWN, times=None)
    for _ in range(5):
        clock.now += 30
        res = await agent.run_once()
        assert res.nvml_failed
    ok, reason = health.check()
    assert not ok and "reading GPUs" in reason


async def test_a_pass_that_raises_counts_as_a_failure() -> None:
    class Broken(InMemorySpecSource):
        async def get(self) -> NodePartitioning | None:
            raise ConnectionError("API server unreachable")

    nv = FakeNvml([CAT.model("A30")])
    metrics = AgentMetrics(CollectorRegistry())
    clock = ManualClock(1000.0)
    health = AgentHealth(resync_seconds=1, failure_resyncs=1, clock=clock)
    reconciler = Reconciler(nv, NoPods(), FakeSupervisor(nvml=nv), CAT)
    agent = Agent(reconciler, Broken("n1"), metrics=metrics, health=health, retry_seconds=0.01)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if sample(metrics, "gpuslice_agent_reconcile_failures_total") >= 2:
            break
    stop.set()
    await asyncio.wait_for(task, 2)  # the loop survived the failing passes
    assert sample(metrics, "gpuslice_agent_reconcile_failures_total") >= 2
    assert sample(metrics, "gpuslice_agent_reconcile_passes_total") >= 2
    clock.now += 1.5
    ok, reason = health.check()
    assert not ok and "ConnectionError: API server unreachable" in reason


def test_metered_nvml_passes_the_activation_status_and_counts_reset_errors() -> None:
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")], passthrough=True)  # RESET_REQUIRED: a VM
    metrics = AgentMetrics(CollectorRegistry())
    metered = MeteredNvml(nv, metrics)
    assert metered.set_mig_mode(0, True) == NvmlErrorCode.RESET_REQUIRED
    nv.inject("reset_gpu", NvmlErrorCode.NOT_SUPPORTED)
    with pytest.raises(NvmlError):
        metered.reset_gpu(0)
    assert sample(
        metrics, "gpuslice_agent_nvml_errors_total", op="reset_gpu", code="NOT_SUPPORTED"
    ) == 1  # fmt: skip
    metered.reset_gpu(0)
    assert nv.mig_enabled(0) and not nv.mig_pending(0)


async def test_an_outage_logs_one_traceback_and_one_recovery_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Failing passes: the first is logged with its traceback, the rest at DEBUG, and one INFO
    line when passes succeed again -- not an ERROR every ``retry_seconds``."""

    class Flaky(InMemorySpecSource):
        failures = 5

        async def get(self) -> NodePartitioning | None:
            if self.failures > 0:
                self.failures -= 1
                raise ConnectionError("API server unreachable")
            return await super().get()

    nv = FakeNvml([CAT.model("A30")])
    metrics = AgentMetrics(CollectorRegistry())
    reconciler = Reconciler(nv, NoPods(), FakeSupervisor(nvml=nv), CAT)
    source = Flaky("n1")
    agent = Agent(reconciler, source, metrics=metrics, retry_seconds=0.01)
    stop = asyncio.Event()
    caplog.set_level(logging.DEBUG, logger="gpuslice.agent")
    task = asyncio.create_task(agent.run(stop))
    for _ in range(300):
        await asyncio.sleep(0.01)
        if source.failures == 0 and sample(metrics, "gpuslice_agent_reconcile_passes_total") >= 7:
            break
    stop.set()
    await asyncio.wait_for(task, 2)
    assert sample(metrics, "gpuslice_agent_reconcile_failures_total") >= 5
    failed = [r for r in caplog.records if "reconcile pass failed" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.ERROR] + [logging.DEBUG] * 4
    assert failed[0].exc_info is not None and all(r.exc_info is None for r in failed[1:])
    recovered = [r for r in caplog.records if "succeed again" in r.getMessage()]
    assert [(r.levelno, "5 failure" in r.getMessage()) for r in recovered] == [
        (logging.INFO, True)
    ]
