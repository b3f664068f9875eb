"""A Kubernetes API outage must not fail the agent's liveness (review 4, finding 1).

Every pass reads the NodePartitioning and writes its status; both raised while the API server
was unreachable, so after ``failure_resyncs`` resyncs ``/healthz`` answered 503 and the kubelet
restarted the agent on every GPU node at once, ending every MPS daemon -- a restart cannot
bring the API back.  Once a spec was read, the agent now goes on with it (node_agent.agent,
"Kubernetes API unavailable"); NVML failures and other errors still fail liveness.
"""

from __future__ import annotations

import aiohttp
import pytest
from manual_clock import ManualClock
from prometheus_client import CollectorRegistry

from contract.nodepartitioning import (
    NodePartitioning,
    NodePartitioningSpec,
    NodePartitioningStatus,
)
from node_agent.agent import Agent, InMemorySpecSource, KubeApiError
from node_agent.health import AgentHealth
from node_agent.metrics import AgentMetrics
from node_agent.mps import FakeSupervisor
from node_agent.nvml import NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from node_agent.reconciler import Reconciler
from planner.catalog import default_catalog

CAT = default_catalog()


class NoPods:
    async def in_use_device_ids(self) -> set[str]:
        return set()


class FlakyApi(InMemorySpecSource):
    """The API server: ``read_error`` / ``write_error`` make reads / status writes fail."""

    read_error: Exception | None = None
    write_error: Exception | None = None

    async def get(self) -> NodePartitioning | None:
        if self.read_error is not None:
            raise self.read_error
        return await super().get()

    async def write_status(self, status: NodePartitioningStatus) -> None:
        if self.write_error is not None:
            raise self.write_error
        await super().write_status(status)


MPS_SPEC = NodePartitioningSpec.model_validate(
    {"mode": "mps", "gpus": [{"index": 0, "mps": [{"memoryMiB": 10240, "activeThreadPercentage": 50}] * 2}]}
)  # fmt: skip


def sample(metrics: AgentMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels or None)
    return 0.0 if value is None else value


def mps_node() -> tuple[FakeNvml, FakeSupervisor, FlakyApi, Agent, AgentHealth, ManualClock]:
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")])
    sup = FakeSupervisor(nvml=nv)
    rec = Reconciler(nv, NoPods(), sup, CAT, publish=lambda d: None)
    clock = ManualClock(0.0)
    health = AgentHealth(resync_seconds=30, failure_resyncs=3, clock=clock)
    src = FlakyApi("n", MPS_SPEC)
    agent = Agent(rec, src, health=health, metrics=AgentMetrics(CollectorRegistry()))
    return nv, sup, src, agent, health, clock


async def test_an_api_outage_keeps_the_agent_live_and_reconciling_with_the_last_spec() -> None:
    _nv, sup, src, agent, health, clock = mps_node()
    assert (await agent.run_once()).applied
    assert "gpu0" in sup.daemons
    metrics = agent.metrics
    assert metrics is not None
    src.read_error = ConnectionError("Cannot connect to host 10.96.0.1:443")
    for t in range(2, 200, 2):  # 200 s of outage, a pass every 2 s (retry_seconds)
        clock.now = t
        if t == 50:
            sup.kill("gpu0")  # the daemon crashes meanwhile: the passes still repair it
        res = await agent.run_once()
        assert res.applied and agent.spec_stale
    assert health.check() == (True, "ok")
    assert "gpu0" in sup.daemons
    assert sample(metrics, "gpuslice_agent_kube_api_errors_total", call="read") == 99
    assert sample(metrics, "gpuslice_agent_spec_stale") == 1
    # the API answers again: a fresh read, the status written, the gauge back to 0
    src.read_error = None
    writes = src.status_writes
    clock.now += 2
    res = await agent.run_once()
    assert res.applied and not agent.spec_stale and agent.api_failures == 0
    assert sample(metrics, "gpuslice_agent_spec_stale") == 0
    assert src.status_writes >= writes


@pytest.mark.parametrize(
    "error",
    [
        KubeApiError("writing the status of NodePartitioning n", 503, "etcdserver: leader changed"),
        KubeApiError("writing the status of NodePartitioning n", 429, "too many requests"),
        TimeoutError(),
    ],
    ids=["503", "429", "timeout"],
)
async def test_a_status_write_the_api_cannot_take_is_retried_not_a_liveness_failure(
    error: Exception,
) -> None:
    _nv, _sup, src, agent, health, clock = mps_node()
    src.write_error = error
    for t in range(0, 200, 2):
        clock.now = t
        res = await agent.run_once()  # does not raise
        assert res.applied
    assert health.check() == (True, "ok")
    assert agent.metrics is not None
    assert sample(agent.metrics, "gpuslice_agent_kube_api_errors_total", call="write_status") > 0
    assert src.status_writes == 0
    src.write_error = None
    await agent.run_once()
    assert src.status_writes == 1  # the status nobody could write is written at once
    assert src.obj is not None and src.obj.status is not None
    assert src.obj.status.conditions[0].status == "True"


async def test_nvml_down_during_an_api_outage_still_fails_liveness() -> None:
    nv, _sup, src, agent, health, clock = mps_node()
    await agent.run_once()
    src.read_error = ConnectionError("API server unreachable")
    nv.inject("gpus", NvmlErrorCode.UNINITIALIZED, times=None)
    for t in range(2, 200, 2):
        clock.now = t
        assert (await agent.run_once()).nvml_failed
    ok, reason = health.check()
    assert not ok and "reading GPUs" in reason


async def test_an_api_error_a_restart_may_fix_still_fails_the_pass() -> None:
    _nv, _sup, src, agent, health, clock = mps_node()
    await agent.run_once()
    src.read_error = KubeApiError("reading NodePartitioning n", 403, "forbidden")
    for t in range(2, 200, 2):
        clock.now = t
        with pytest.raises(KubeApiError):
            await agent.run_once()
    assert not health.check()[0]


async def test_an_outage_before_the_first_read_fails_as_before() -> None:
    """No spec to go on with, and this container started no MPS daemon yet."""
    _nv, sup, src, agent, health, clock = mps_node()
    src.read_error = ConnectionError("API server unreachable")
    for t in range(0, 200, 2):
        clock.now = t
        with pytest.raises(ConnectionError):
            await agent.run_once()
    assert not health.check()[0]
    assert not sup.daemons


def test_which_api_errors_are_an_unavailable_api_server() -> None:
    from node_agent.agent import api_unavailable

    def connector_error() -> Exception:
        return aiohttp.ClientConnectorError(
            aiohttp.client_reqrep.ConnectionKey("10.96.0.1", 443, True, None, None, None, None),
            OSError(111, "Connection refused"),
        )

    assert api_unavailable(connector_error())
    assert api_unavailable(aiohttp.ServerDisconnectedError())
    assert api_unavailable(TimeoutError())
    assert api_unavailable(ConnectionResetError())
    for status in (500, 502, 503, 504, 429):
        assert api_unavailable(KubeApiError("x", status, "m"))
    for status in (400, 401, 403, 404, 409, 422):
        assert not api_unavailable(KubeApiError("x", status, "m"))
    assert not api_unavailable(ValueError("a spec the agent cannot parse"))


def test_a_tls_failure_is_not_an_outage_a_restart_reloads_the_ca() -> None:
    """After a cluster CA rotation every call fails verification until the client is built
    again: counted as an outage, the agent stayed alive on a stale spec for good."""
    import ssl

    from node_agent.agent import api_unavailable

    key = aiohttp.client_reqrep.ConnectionKey("10.96.0.1", 443, True, None, None, None, None)
    verify = ssl.SSLCertVerificationError(
        1, "certificate verify failed: unable to get local issuer"
    )
    assert not api_unavailable(aiohttp.ClientConnectorCertificateError(key, verify))
    assert not api_unavailable(aiohttp.ClientConnectorSSLError(key, ssl.SSLError(1, "bad")))
    assert not api_unavailable(aiohttp.ServerFingerprintMismatch(b"a", b"b", "h", 443))
    assert not api_unavailable(verify)
