"""Review 5 of the DRA agent (hunt5/dra5 findings 2 and 3).

Finding 2: a GPU whose MIG mode cannot be switched on (a pass-through VM with no reset, an
agent without nvidia-smi) was reported ``Applied`` with ``migEnabled: true`` and the planned
placements free, so the partitioner released pods to placements whose prepare always fails,
again and again.  Now the shaped round reports it ``Degraded``/``MIGModePending`` naming the
GPU and the remedy, the GPU ``unhealthy`` (nothing on it free), ``migEnabled`` as NVML reads it,
and withdraws the unmade placements; the partitioner, reading that status, promises nothing
there and plans the pod elsewhere.

Finding 3: the kubelet refusing the plugin (or never seeing it: a wrong registry directory)
left the agent publishing every device and healthy, so claims were allocated to a node whose
kubelet never calls the driver.  Now nothing is published until the kubelet registers the
plugin; once it refused it, or has not registered it within the grace, every free device is
withdrawn, ``/readyz`` fails naming the error and the sockets, and the shaped status says
``Degraded``/``DriverNotRegistered``.  The v1beta1 DRAPlugin service is served too.

Review diff36b finding 2: that problem used to fail ``/healthz``, the DRA DaemonSet's
livenessProbe, so the kubelet killed the agent again and again (CrashLoopBackOff) for a
configuration error no restart can fix, each new container waiting the grace from zero and
losing the logged explanation.  Now the wait and the problem fail readiness only (``/readyz``,
the readinessProbe); ``/healthz`` stays ``ok`` and the problem is logged once.
"""

from __future__ import annotations

import asyncio
import copy
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import grpc
import grpc.aio
import pytest
from fake_dra_kubelet import FakeDraKubelet
from test_partitioner_dra import DRA, claim, claim_pod, mig_request
from test_partitioner_promises import T0, Cluster, applied_np, reservation, status_gpu
from test_partitioner_snapshot import node

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.agent import InMemorySpecSource
from node_agent.dra_checkpoint import Checkpoint
from node_agent.dra_driver import DraDriver
from node_agent.dra_prepare import DraPreparer
from node_agent.dra_shape import claim_devices
from node_agent.dra_slices import DRIVER, DraGpu, device_name
from node_agent.draplugin import V1BETA1_SERVICE_NAME, DraKubeletPlugin
from node_agent.health import AgentHealth, MonitoringServer
from node_agent.nvml import NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from node_agent.proto import dra_v1_pb2 as dra
from partitioner.actions import PatchPod, WriteSpec
from planner.catalog import default_catalog

CAT = default_catalog()
A100 = CAT.model("A100-SXM4-80GB")
H100 = CAT.model("H100-80GB")
NODE = "d1"


def a100(profile: str, start: int, gpu: int = 0) -> str:
    return device_name(gpu, A100.profile(profile), start)


class _Claims:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    async def allocated(self) -> set[str]:
        return claim_devices(self.items, NODE)

    async def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        for c in self.items:
            if (c["metadata"]["namespace"], c["metadata"]["name"]) == (namespace, name):
                return c
        return None


class _Publisher:
    def __init__(self, gpus: list[DraGpu]) -> None:
        self.gpus, self.node, self.taints = gpus, NODE, True
        self.calls: list[set[str] | None] = []

    @property
    def last(self) -> set[str] | None:
        return self.calls[-1]

    async def publish(self, want: Any, taints: Any = None) -> bool:
        self.calls.append(None if want is None else set(want))
        return True


def _spec(*layout: tuple[str, int]) -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate(
        {
            "planId": "p1",
            "mode": "mig",
            "gpus": [{"index": 0, "mig": [{"profile": p, "start": s} for p, s in layout]}],
        }
    )


@pytest.fixture
def dirs() -> Iterator[tuple[str, str]]:
    with tempfile.TemporaryDirectory(prefix="gsr5-", dir="/tmp") as tmp:
        yield os.path.join(tmp, "r"), os.path.join(tmp, "p")


def _driver(
    nv: FakeNvml,
    model: Any,
    dirs: tuple[str, str],
    *,
    spec: NodePartitioningSpec | None = None,
    registered: bool = True,
    **kw: Any,
) -> tuple[DraDriver, InMemorySpecSource | None, _Publisher]:
    prep = DraPreparer(nv, CAT, node=NODE, checkpoint=Checkpoint(None))
    claims = _Claims()
    plugin = DraKubeletPlugin(prep, claims, registry_dir=dirs[0], plugin_dir=dirs[1])
    plugin.registered = registered
    pub = _Publisher([DraGpu(i, nv.gpu_uuid(i), m) for i, m in sorted(prep.models.items())])
    src = InMemorySpecSource(NODE, spec) if spec is not None else None
    drv = DraDriver(
        plugin,
        pub,  # type: ignore[arg-type]
        spec_source=src,
        claims=claims if spec is not None else None,
        **kw,
    )
    return drv, src, pub


def _conditions(src: InMemorySpecSource) -> dict[str, tuple[str, str, str]]:
    assert src.obj is not None and src.obj.status is not None
    return {c.type: (c.status, c.reason, c.message) for c in src.obj.status.conditions}


# -- finding 2: a MIG mode that cannot be switched on -------------------------------------------


async def test_a_mig_mode_that_cannot_be_switched_is_degraded_unhealthy_and_withdrawn(
    dirs: tuple[str, str],
) -> None:
    nv = FakeNvml([A100], passthrough=True, tool_present=False)
    spec = _spec(("3g.40gb", 0), ("3g.40gb", 4))
    drv, src, pub = _driver(nv, A100, dirs, spec=spec)
    assert src is not None
    assert await drv.publish_once()
    planned = {a100("3g.40gb", 0), a100("3g.40gb", 4)}
    assert not nv.gpus()[0].mig_enabled
    assert pub.last == set() and drv.unmade == planned  # nothing a prepare would fail on
    applied, degraded = _conditions(src)["Applied"], _conditions(src)["Degraded"]
    assert applied[:2] == ("False", "Degraded")
    assert degraded[:2] == ("True", "MIGModePending")
    assert "GPU 0: MIG mode enable" in degraded[2] and "nvidia-smi" in degraded[2]
    assert "GPUSLICE_NVIDIA_SMI" in degraded[2]  # the reconciler's remedy for NOT_SUPPORTED
    assert src.obj is not None and src.obj.status is not None
    (g,) = src.obj.status.gpus
    assert g.unhealthy and g.migEnabled is False  # as NVML reads it, not as the model allows
    assert [(m.profile, m.start, m.used) for m in g.mig] == [
        ("3g.40gb", 0, False),
        ("3g.40gb", 4, False),
    ]  # the layout stays (nothing is planned over it), none of it free: the GPU is unhealthy
    # the operator gives the agent nvidia-smi: the next round switches the mode and recovers
    nv.tool_present = True
    assert await drv.publish_once()
    assert nv.gpus()[0].mig_enabled and pub.last == planned and drv.unmade == frozenset()
    assert _conditions(src)["Applied"][:2] == ("True", "Applied")
    assert _conditions(src)["Degraded"][:2] == ("False", "AsExpected")
    (g,) = src.obj.status.gpus
    assert not g.unhealthy and g.migEnabled is True


async def test_an_instance_that_cannot_be_created_is_reported_unhealthy_and_withdrawn(
    dirs: tuple[str, str],
) -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    nv.inject("create_gpu_instance", NvmlErrorCode.UNKNOWN)
    spec = _spec(("3g.40gb", 0), ("3g.40gb", 4))
    drv, src, pub = _driver(nv, H100, dirs, spec=spec)
    assert src is not None and src.obj is not None
    assert await drv.publish_once()
    bad, good = (
        device_name(0, H100.profile("3g.40gb"), 0),
        device_name(0, H100.profile("3g.40gb"), 4),
    )
    assert pub.last == {good} and drv.unmade == {bad}
    assert _conditions(src)["Degraded"][:2] == ("True", "InstanceNotCreated")
    assert "GPU 0: the planned instance 3g.40gb at 0" in _conditions(src)["Degraded"][2]
    assert src.obj.status is not None
    (g,) = src.obj.status.gpus
    assert [(m.profile, m.start, m.used, m.unhealthy) for m in g.mig] == [
        ("3g.40gb", 0, False, True),
        ("3g.40gb", 4, False, False),
    ]
    assert await drv.publish_once()  # made now
    assert pub.last == {bad, good} and _conditions(src)["Degraded"][0] == "False"


def _as_listed(src: InMemorySpecSource) -> dict[str, Any]:
    """The NodePartitioning as the partitioner lists it."""
    assert src.obj is not None
    obj = src.obj.model_dump(mode="json", exclude_none=True)
    obj.update(apiVersion="gpuslice.io/v1alpha1", kind="NodePartitioning")
    obj["metadata"].update(resourceVersion="7", annotations={})
    return obj


async def test_the_partitioner_promises_nothing_on_the_gpu_whose_mode_cannot_switch(
    dirs: tuple[str, str],
) -> None:
    """The status the agent writes for finding 2, read by decide(): the pod is not released to
    the placements the GPU cannot make, and is planned on the other node."""
    nv = FakeNvml([A100], passthrough=True, tool_present=False)
    drv, src, _ = _driver(nv, A100, dirs, spec=_spec(("3g.40gb", 0), ("3g.40gb", 4)))
    assert src is not None
    assert await drv.publish_once()
    one_gpu = {**DRA, "nvidia.com/gpu.count": "1"}
    c = Cluster(
        node(NODE, one_gpu),
        _as_listed(src),
        node("d2", one_gpu),
        applied_np("d2", status_gpu(0)),
        claim_pod("p", "cl"),
        claim("cl", mig_request()),
    )
    d = c.step(T0)
    # before: released at once to d1's "free" 3g.40gb@0, whose prepare can never succeed
    assert not [a for a in d.actions if isinstance(a, PatchPod) and a.purpose == "release"]
    d = c.step(T0 + 61)
    specs = [a for a in d.actions if isinstance(a, WriteSpec)]
    assert [s.node for s in specs] == ["d2"]
    r = reservation(c, "p")
    assert r is not None and r.node == "d2"


# -- finding 3: the kubelet's registration ------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_nothing_is_published_before_the_kubelet_registers_the_plugin(
    dirs: tuple[str, str],
) -> None:
    nv = FakeNvml([H100])
    drv, _, pub = _driver(nv, H100, dirs, registered=False, resync_s=3600)
    await drv.plugin.start()
    try:
        assert await drv.publish_once()
        assert pub.calls == []  # not a slice written: claims here would never be prepared
        kubelet = FakeDraKubelet(dirs[0])
        await kubelet.scan()
        assert drv.plugin.registered
        assert await drv.publish_once()
        assert pub.calls == [None]  # every placement (mode all)
        await kubelet.close()
    finally:
        await drv.plugin.stop()


@pytest.mark.parametrize("shaped", [False, True])
async def test_a_refused_plugin_withdraws_every_free_device_and_fails_readiness(
    dirs: tuple[str, str], shaped: bool
) -> None:
    clock = _Clock()
    health = AgentHealth(30, clock=clock)
    nv = FakeNvml([H100, H100])
    spec = _spec(("3g.40gb", 0), ("3g.40gb", 4)) if shaped else None
    drv, src, pub = _driver(nv, H100, dirs, spec=spec, registered=False, health=health)
    woken = drv._wake
    await drv.plugin.start()
    try:
        # a kubelet that knows neither DRA service gpuslice serves
        kubelet = FakeDraKubelet(dirs[0], known_services=("v1alpha4.DRAPlugin",))
        await kubelet.scan()
        assert kubelet.refused and woken.is_set()  # the refusal wakes a round
        assert await drv.publish_once()
        assert pub.last == set()  # nothing free published; nothing was allocated
        clock.now += 91  # the health check's limit (3 resyncs of 30 s)
        assert await drv.publish_once()
        assert health.check() == (True, "ok")  # liveness: a restart cannot fix the kubelet
        ok, why = health.ready()
        assert not ok
        assert why.startswith("not ready: the kubelet refused DRA driver gpu.gpuslice.io")
        assert "supported versions" in why  # the kubelet's own error
        assert drv.plugin.registration_socket in why
        if shaped:
            assert src is not None and src.obj is not None and src.obj.status is not None
            degraded = _conditions(src)["Degraded"]
            assert degraded[:2] == ("True", "DriverNotRegistered")
            assert drv.plugin.registration_socket in degraded[2]
            assert all(g.unhealthy for g in src.obj.status.gpus)  # nothing promised here
            writes = src.status_writes
            assert await drv.publish_once()
            assert src.status_writes == writes  # settled: no rewrite every round
        await kubelet.close()
        # a kubelet that knows v1 registers the plugin (the socket served anew): healthy
        good = FakeDraKubelet(dirs[0])
        await good.scan()
        assert drv.plugin.registered and await drv.publish_once()
        assert health.check() == (True, "ok") and health.ready() == (True, "ok")
        if shaped:
            assert src is not None
            assert _conditions(src)["Degraded"][:2] == ("False", "AsExpected")
            assert pub.last == {
                device_name(0, H100.profile("3g.40gb"), 0),
                device_name(0, H100.profile("3g.40gb"), 4),
                "gpu1",
            }
        else:
            assert pub.last is None
        await good.close()
    finally:
        await drv.plugin.stop()


async def test_a_plugin_the_kubelet_never_registers_is_reported_after_the_grace(
    dirs: tuple[str, str],
) -> None:
    """A registry directory the kubelet does not watch: no GetInfo ever comes."""
    clock = _Clock()
    health = AgentHealth(30, clock=clock)
    nv = FakeNvml([H100])
    drv, _, pub = _driver(nv, H100, dirs, registered=False, health=health, resync_s=30)
    assert drv.registration_grace_s == 90
    await drv.plugin.start()
    try:
        assert await drv.publish_once()
        assert pub.calls == [] and drv.kubelet_problem is None
        assert health.check() == (True, "ok")
        ok, why = health.ready()
        assert not ok and why.startswith("not ready: waiting for the kubelet to register")
        assert drv._until_problem() is not None  # the loop wakes when the grace ends
        assert drv.plugin.waiting_since is not None
        drv.plugin.waiting_since -= 91
        clock.now += 91
        assert await drv.publish_once()
        assert pub.calls == [set()]
        problem = drv.kubelet_problem
        clock.now += 30
        assert await drv.publish_once()
        assert drv.kubelet_problem == problem  # one message (a status is not rewritten)
        assert health.check() == (True, "ok")
        ok, why = health.ready()
        assert not ok and "has not registered DRA driver gpu.gpuslice.io" in why
        assert dirs[0] in why and "dra.hostPaths.registryDir" in why
    finally:
        await drv.plugin.stop()


async def test_an_allocated_device_stays_published_while_the_kubelet_refuses(
    dirs: tuple[str, str],
) -> None:
    """Withdrawing an allocated device would stop its counters counting."""
    nv = FakeNvml([H100])
    drv, _, pub = _driver(nv, H100, dirs, spec=_spec(("3g.40gb", 0), ("3g.40gb", 4)))
    claims = drv.claims
    assert isinstance(claims, _Claims)
    held = device_name(0, H100.profile("3g.40gb"), 4)
    claims.items.append(
        {
            "metadata": {"namespace": "t", "name": "c", "uid": "u"},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": "g", "driver": DRIVER, "pool": NODE, "device": held}
                        ]
                    }
                }
            },
        }
    )
    drv.plugin.registered, drv.plugin.error = False, "refused for the test"
    assert await drv.publish_once()
    assert pub.last == {held}


async def test_a_v1beta1_kubelet_registers_the_plugin_and_prepares_over_v1beta1(
    dirs: tuple[str, str],
) -> None:
    nv = FakeNvml([H100])
    prep = DraPreparer(nv, CAT, node=NODE, checkpoint=Checkpoint(None))
    claims = _Claims()
    dev = device_name(0, H100.profile("1g.10gb"), 0)
    claims.items.append(
        {
            "metadata": {"namespace": "t", "name": "c", "uid": "u1"},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": dev}
                        ]
                    }
                }
            },
        }
    )
    plugin = DraKubeletPlugin(prep, claims, registry_dir=dirs[0], plugin_dir=dirs[1])
    await plugin.start()
    kubelet = FakeDraKubelet(dirs[0], known_services=("v1beta1.DRAPlugin",))
    try:
        await kubelet.scan()
        assert plugin.registered and kubelet.plugins[DRIVER].service == "v1beta1.DRAPlugin"
        async with grpc.aio.insecure_channel(f"unix:{plugin.dra_socket}") as ch:
            call = ch.unary_unary(
                f"/{V1BETA1_SERVICE_NAME}/NodePrepareResources",
                request_serializer=dra.NodePrepareResourcesRequest.SerializeToString,
                response_deserializer=dra.NodePrepareResourcesResponse.FromString,
            )
            req = dra.NodePrepareResourcesRequest(
                claims=[dra.Claim(namespace="t", name="c", uid="u1")]
            )
            reply = await asyncio.wait_for(call(req), 30)
            assert reply.claims["u1"].error == ""
            assert [d.device_name for d in reply.claims["u1"].devices] == [dev]
            undo = ch.unary_unary(
                f"/{V1BETA1_SERVICE_NAME}/NodeUnprepareResources",
                request_serializer=dra.NodeUnprepareResourcesRequest.SerializeToString,
                response_deserializer=dra.NodeUnprepareResourcesResponse.FromString,
            )
            gone = await asyncio.wait_for(
                undo(dra.NodeUnprepareResourcesRequest(claims=copy.deepcopy(req.claims))), 30
            )
            assert gone.claims["u1"].error == ""
        assert not prep.prepared()
    finally:
        await kubelet.close()
        await plugin.stop()


# -- review diff36b finding 2: the registration problem fails readiness, never liveness ---------


async def test_a_kubelet_that_never_registers_the_plugin_never_fails_liveness(
    dirs: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong registry directory: ten minutes of rounds (the chart's livenessProbe would have
    killed the agent after about three) -- ``/healthz`` stays ``ok`` throughout, ``/readyz``
    names the problem, every free device stays withdrawn and the ERROR is logged once."""
    clock = _Clock()
    health = AgentHealth(30, clock=clock)
    nv = FakeNvml([H100, H100])
    spec = _spec(("3g.40gb", 0), ("3g.40gb", 4))
    drv, src, pub = _driver(nv, H100, dirs, spec=spec, registered=False, health=health)
    caplog.set_level("INFO", logger="node_agent.dra_driver")
    await drv.plugin.start()
    try:
        for _ in range(20):  # one round per resync, 30 s each
            assert await drv.publish_once()
            assert health.check() == (True, "ok")
            clock.now += 30
            assert drv.plugin.waiting_since is not None
            drv.plugin.waiting_since -= 30
        assert health.check() == (True, "ok")
        ok, why = health.ready()
        assert not ok and why.startswith("not ready: the kubelet has not registered DRA driver")
        assert dirs[0] in why and "dra.hostPaths.registryDir" in why
        assert pub.calls and all(c == set() for c in pub.calls)  # nothing free, ever
        assert src is not None
        degraded = _conditions(src)["Degraded"]
        assert degraded[:2] == ("True", "DriverNotRegistered")
        errors = [r for r in caplog.records if "has not registered DRA driver" in r.getMessage()]
        assert [r.levelname for r in errors] == ["ERROR"]  # once, not every round
    finally:
        await drv.plugin.stop()


async def test_healthz_stays_ok_and_readyz_fails_over_http_until_the_kubelet_registers(
    dirs: tuple[str, str],
) -> None:
    import urllib.error
    import urllib.request

    def get(url: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    clock = _Clock()
    health = AgentHealth(30, clock=clock)
    nv = FakeNvml([H100])
    drv, _, _ = _driver(nv, H100, dirs, registered=False, health=health)
    from prometheus_client import CollectorRegistry

    server = MonitoringServer(health, CollectorRegistry(), 0, "127.0.0.1")
    server.start()
    base = f"http://127.0.0.1:{server.port}"
    await drv.plugin.start()
    try:
        assert await drv.publish_once()  # waiting for the first registration
        code, body = await asyncio.to_thread(get, f"{base}/readyz")
        assert code == 503 and body.startswith("not ready: waiting for the kubelet to register")
        assert drv.plugin.waiting_since is not None
        drv.plugin.waiting_since -= 300
        for _ in range(10):
            clock.now += 30
            assert await drv.publish_once()
        assert await asyncio.to_thread(get, f"{base}/healthz") == (200, "ok\n")
        code, body = await asyncio.to_thread(get, f"{base}/readyz")
        assert code == 503
        assert body.startswith("not ready: the kubelet has not registered DRA driver")
        kubelet = FakeDraKubelet(dirs[0])
        await kubelet.scan()
        assert drv.plugin.registered and await drv.publish_once()
        assert await asyncio.to_thread(get, f"{base}/readyz") == (200, "ok\n")
        assert await asyncio.to_thread(get, f"{base}/healthz") == (200, "ok\n")
        await kubelet.close()
        # a failing liveness shows on /readyz too, as such
        health.record(False, "NVML down")
        clock.now += 91
        code, body = await asyncio.to_thread(get, f"{base}/readyz")
        assert code == 503 and body.startswith("unhealthy: reconcile failing")
    finally:
        await drv.plugin.stop()
        server.stop()


def test_the_dra_agents_readiness_probe_is_readyz_and_its_liveness_probe_healthz() -> None:
    import helm_python as helm
    from test_chart import CHART, render
    from test_chart_dra import DRA as DRA_VALUES
    from test_chart_dra import dra_agent

    with helm.Chart.load(CHART) as chart:
        docs = render(chart, DRA_VALUES)
    (c,) = [
        c for c in dra_agent(docs)["spec"]["template"]["spec"]["containers"] if "livenessProbe" in c
    ]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
