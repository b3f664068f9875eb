"""End to end: a pending pod -> partitioner -> NodePartitioning -> node agent -> kubelet device.

Everything real except the hardware and the kubelet: the kopf partitioner operator and the node
agent's loop share one emulated API server (kmock, tests/fake_apiserver.py); the agent drives a
fake NVML (an A100 80GB with MIG mode off), reads in-use devices over gRPC from a fake
PodResources server, and its device plugins register with a fake kubelet over gRPC on unix
sockets (tests/fake_kubelet.py).  Real time, with short batch windows (timeout 2 s, idle 0.5 s):
looptime's fake clock cannot drive the agent's worker threads and gRPC.

The flow checked: the node opts in -> the partitioner creates its NodePartitioning -> the agent
applies the empty spec -> an unschedulable pod asks for ``nvidia.com/mig-1g.10gb`` -> the
partitioner writes a spec with a 1g.10gb instance at some start -> the agent enables MIG and
creates exactly that instance on the fake NVML -> status Applied for that generation -> the
kubelet sees the MIG device advertised through ListAndWatch, and Allocate hands out its UUID ->
the partitioner records the spec as applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import kmock
import kopf
import pytest
from fake_apiserver import NP_PATH, NP_RESOURCE, ApiServer, declare, stored
from fake_kubelet import FakeKubelet, FakePodResources
from kubernetes_asyncio import client as kclient

from node_agent.agent import Agent, KubeSpecSource
from node_agent.deviceplugin import DevicePluginManager
from node_agent.mps import FakeSupervisor
from node_agent.nvml_fake import FakeNvml
from node_agent.podresources import PodResourcesClient
from node_agent.reconciler import Reconciler
from partitioner.operator import Controller, run_operator
from partitioner.settings import PartitionerSettings
from planner.catalog import default_catalog

CAT = default_catalog()
MIG_1G = "nvidia.com/mig-1g.10gb"
A100_NODE = {
    "nos.nebuly.com/gpu-partitioning": "mig",
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
    "nvidia.com/gpu.count": "1",
    "nvidia.com/gpu.memory": "81920",
}


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


@pytest.fixture
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="gse2e-", dir="/tmp")  # unix socket paths: <= 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def until(check: Callable[[], Any], within: float, what: str) -> Any:
    deadline = time.monotonic() + within
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.05)


async def create(api: kmock.KubernetesEmulator, path: str, obj: dict[str, Any]) -> None:
    resp = await api.post(path, json=obj)
    assert resp.status in (200, 201), await resp.text()


def applied_generation(api: kmock.KubernetesEmulator, node: str) -> int | None:
    """The generation the agent reports Applied, if it is the object's current one."""
    np = stored(api, NP_RESOURCE, node)
    if np is None:
        return None
    status = np.get("status") or {}
    conds = {c["type"]: c for c in status.get("conditions") or ()}
    gen = np["metadata"].get("generation")
    ok = conds.get("Applied", {}).get("status") == "True"
    return gen if ok and status.get("observedGeneration") == gen else None


@contextlib.asynccontextmanager
async def partitioner(api: kmock.KubernetesEmulator) -> AsyncIterator[Controller]:
    settings = PartitionerSettings(
        batch_timeout_seconds=2,
        batch_idle_seconds=0.5,
        cycle_seconds=0.2,
        planner_time_limit_seconds=0.5,
        metrics_port=0,
        health_port=0,
    )
    controller = Controller(
        settings,
        connection=kopf.ConnectionInfo(server=str(api.url)),
        clock=asyncio.get_running_loop().time,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(run_operator(controller, stop_flag=stop))
    try:
        yield controller
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=15)
    assert task.exception() is None


@contextlib.asynccontextmanager
async def node_agent(
    api: kmock.KubernetesEmulator, socket_dir: str, nv: FakeNvml
) -> AsyncIterator[tuple[Agent, FakeKubelet]]:
    plugin_dir = os.path.join(socket_dir, "dp")
    os.mkdir(plugin_dir)
    kubelet = FakeKubelet(plugin_dir)
    pod_resources = FakePodResources(os.path.join(socket_dir, "podres.sock"))
    await kubelet.start()
    await pod_resources.start()
    plugins = DevicePluginManager(plugin_dir, poll_interval_s=0.1, register_timeout_s=5)
    await plugins.start()
    in_use = PodResourcesClient(pod_resources.socket_path, timeout_s=5)
    api_client = kclient.ApiClient(kclient.Configuration(host=str(api.url).rstrip("/")))
    source = KubeSpecSource("n1", kclient.CustomObjectsApi(api_client), request_timeout_s=5)
    reconciler = Reconciler(nv, in_use, FakeSupervisor(nvml=nv), CAT, publish=plugins.set_devices)
    agent = Agent(reconciler, source, resync_seconds=5, retry_seconds=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        yield agent, kubelet
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        await api_client.close()
        await plugins.stop()
        await in_use.close()
        await pod_resources.stop()
        await kubelet.stop()


async def test_pending_pod_becomes_a_mig_device_the_kubelet_can_allocate(
    kmock: ApiServer, socket_dir: str
) -> None:
    t0 = time.monotonic()
    declare(kmock)
    await create(kmock, "/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "n1", "labels": A100_NODE},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}},
    })  # fmt: skip
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")], mig_enabled=False)
    async with partitioner(kmock) as controller, node_agent(kmock, socket_dir, nv) as (_, kubelet):
        # the partitioner creates the node's object; the agent applies its empty spec
        await until(lambda: applied_generation(kmock, "n1") == 1, 10, "the empty spec applied")
        assert not nv.mig_enabled(0) and kubelet.registrations == []

        await create(kmock, "/api/v1/namespaces/default/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p1", "namespace": "default"},
            "spec": {"containers": [{"name": "main", "resources": {
                "limits": {MIG_1G: "1"}, "requests": {"cpu": "1"}}}]},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
        })  # fmt: skip

        # the kubelet sees the new device through ListAndWatch of a fresh registration
        def advertised() -> dict[str, str]:
            conn = kubelet.registered(MIG_1G)
            return conn.devices if conn is not None else {}

        devices = await until(advertised, 15, f"{MIG_1G} advertised to the kubelet")
        (device_id, health) = next(iter(devices.items()))
        assert len(devices) == 1 and health == "Healthy"

        # the spec the partitioner wrote is exactly what the fake hardware now has
        np = stored(kmock, NP_RESOURCE, "n1")
        assert np is not None
        (gpu,) = np["spec"]["gpus"]
        (wanted,) = gpu["mig"]
        assert wanted["profile"] == "1g.10gb" and np["spec"]["planId"] == "1"
        assert nv.mig_enabled(0)
        assert [(p.name, start, has_ci) for p, start, has_ci in nv.layout(0)] == [
            ("1g.10gb", wanted["start"], True)
        ]
        (mig_uuid,) = nv.mig_uuids()
        assert device_id == mig_uuid

        # status Applied for the new generation, naming the device
        await until(lambda: applied_generation(kmock, "n1") == 2, 5, "generation 2 applied")
        np = stored(kmock, NP_RESOURCE, "n1")
        assert np is not None
        (actual,) = np["status"]["gpus"]
        assert actual["migEnabled"] is True
        assert [(i["profile"], i["start"], i["deviceId"]) for i in actual["mig"]] == [
            ("1g.10gb", wanted["start"], mig_uuid)
        ]

        # the kubelet can allocate it: the container sees that MIG device
        conn = kubelet.registered(MIG_1G)
        assert conn is not None
        reply = await conn.allocate([device_id])
        assert dict(reply.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": mig_uuid}

        # the partitioner closes the loop: it saw its spec applied
        registry = controller.metrics.registry
        await until(
            lambda: registry.get_sample_value("gpuslice_spec_to_applied_seconds_count") == 1,
            5,
            "the partitioner to observe the spec applied",
        )
    spec_writes = [
        r for r in list(kmock)
        if str(r.method).upper().endswith("PATCH") and r.url.path == f"{NP_PATH}/n1"
    ]  # fmt: skip
    assert len(spec_writes) == 1  # one plan, written once
    assert time.monotonic() - t0 < 20
