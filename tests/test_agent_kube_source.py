"""KubeSpecSource (the agent's Kubernetes port) over real HTTP against kmock (tests/fake_apiserver.py).

The official ``kubernetes`` client talks to the emulator, which assigns uid, resourceVersion and
generation and serves the status subresource like the API server.  Checked: reading the spec,
writing status through ``/status`` only, and a watch that wakes the agent for spec changes,
deletion and creation -- but not for its own status writes nor for the ADDED replay at the
start of every watch (which would spin the agent loop).  Real time; each wait is short.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import kmock
import kubernetes
import pytest
from fake_apiserver import NP_PATH, NP_RESOURCE, ApiServer, declare, stored

from contract.nodepartitioning import NodePartitioningSpec, NodePartitioningStatus
from node_agent.agent import Agent, KubeSpecSource, draining_gpus
from node_agent.mps import FakeSupervisor
from node_agent.nvml_fake import FakeNvml
from node_agent.reconciler import Reconciler
from planner.catalog import default_catalog

CAT = default_catalog()
SPEC_1G = {"planId": "1", "mode": "mig", "gpus": [{"index": 0, "mig": [{"profile": "1g.10gb", "start": 2}]}]}  # fmt: skip
SPEC_7G = {"planId": "2", "mode": "mig", "gpus": [{"index": 0, "mig": [{"profile": "7g.80gb", "start": 0}]}]}  # fmt: skip


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


def custom_objects(api: kmock.KubernetesEmulator) -> Any:
    cfg = kubernetes.client.Configuration(host=str(api.url).rstrip("/"))
    return kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(cfg))


def source(api: kmock.KubernetesEmulator, name: str = "n1") -> KubeSpecSource:
    return KubeSpecSource(name, custom_objects(api), request_timeout_s=5)


async def create_np(api: kmock.KubernetesEmulator, name: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": "gpuslice.io/v1alpha1", "kind": "NodePartitioning",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip
    resp = await api.post(NP_PATH, json=body)
    assert resp.status in (200, 201), await resp.text()


async def patch_np(api: kmock.KubernetesEmulator, name: str, body: dict[str, Any]) -> None:
    resp = await api.patch(f"{NP_PATH}/{name}", json=body)
    assert resp.status == 200, await resp.text()


def status_writes(api: kmock.KubernetesEmulator, name: str) -> list[dict[str, Any]]:
    return [
        r.data
        for r in list(api)
        if str(r.method).upper().endswith("PATCH") and r.url.path == f"{NP_PATH}/{name}/status"
    ]


async def test_get_reads_the_spec_and_404_is_none(kmock: ApiServer) -> None:
    declare(kmock)
    src = source(kmock)
    assert await src.get() is None
    await create_np(kmock, "n1", SPEC_1G)
    await create_np(kmock, "other", SPEC_7G)
    obj = await src.get()
    assert obj is not None and obj.metadata.name == "n1" and obj.metadata.generation == 1
    assert obj.spec == NodePartitioningSpec.model_validate(SPEC_1G)
    await patch_np(kmock, "n1", {"spec": SPEC_7G})
    obj = await src.get()
    assert obj is not None and obj.metadata.generation == 2 and obj.spec.planId == "2"


async def test_write_status_goes_through_the_status_subresource(kmock: ApiServer) -> None:
    declare(kmock)
    await create_np(kmock, "n1", SPEC_1G)
    src = source(kmock)
    status = NodePartitioningStatus.model_validate(
        {"observedGeneration": 1, "planId": "1", "lastError": "",
         "conditions": [{"type": "Applied", "status": "True", "reason": "Applied"}]}
    )  # fmt: skip
    await src.write_status(status)
    (written,) = status_writes(kmock, "n1")
    assert written["status"]["observedGeneration"] == 1
    np = stored(kmock, NP_RESOURCE, "n1")
    assert np is not None and np["status"]["conditions"][0]["reason"] == "Applied"
    assert np["spec"] == SPEC_1G and np["metadata"]["generation"] == 1
    obj = await src.get()
    assert obj is not None and obj.applied  # the status reads back as Applied for generation 1


async def test_wait_change_ignores_replays_and_own_status_but_wakes_on_spec(
    kmock: ApiServer,
) -> None:
    declare(kmock)
    await create_np(kmock, "n1", SPEC_1G)
    await create_np(kmock, "n2", SPEC_1G)  # another node's object: none of our business
    src = source(kmock)
    await src.get()

    # nothing changes: kmock replays the object as ADDED, yet the wait lasts its timeout
    t0 = time.monotonic()
    await src.wait_change(1.0)
    assert time.monotonic() - t0 >= 0.95
    assert src.watch_events >= 1  # the replay did arrive and was ignored

    waiter = asyncio.create_task(src.wait_change(10.0))
    await asyncio.sleep(0.3)
    await src.write_status(NodePartitioningStatus.model_validate({"observedGeneration": 1}))
    await patch_np(kmock, "n2", {"spec": SPEC_7G})
    await asyncio.sleep(0.5)
    assert not waiter.done()  # our own status write and n2's change did not wake us
    t0 = time.monotonic()
    await patch_np(kmock, "n1", {"spec": SPEC_7G})
    await asyncio.wait_for(waiter, 3)
    assert time.monotonic() - t0 < 2
    obj = await src.get()
    assert obj is not None and obj.metadata.generation == 2


async def test_wait_change_wakes_on_delete_and_on_create(kmock: ApiServer) -> None:
    declare(kmock)
    await create_np(kmock, "n1", SPEC_1G)
    src = source(kmock)
    await src.get()
    waiter = asyncio.create_task(src.wait_change(10.0))
    await asyncio.sleep(0.3)
    resp = await kmock.delete(f"{NP_PATH}/n1")
    assert resp.status == 200
    await asyncio.wait_for(waiter, 3)
    assert await src.get() is None

    waiter = asyncio.create_task(src.wait_change(10.0))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    await create_np(kmock, "n1", SPEC_7G)
    await asyncio.wait_for(waiter, 3)
    obj = await src.get()
    assert obj is not None and obj.spec.planId == "2"


async def test_wait_change_on_an_unreachable_api_server_waits_out_its_timeout() -> None:
    cfg = kubernetes.client.Configuration(host="http://127.0.0.1:9")  # discard port: refused
    src = KubeSpecSource("n1", kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(cfg)))
    t0 = time.monotonic()
    await src.wait_change(0.5)  # no exception, and no busy loop for the caller
    assert time.monotonic() - t0 >= 0.45


async def test_agent_loop_over_kube_source_applies_each_generation_once(kmock: ApiServer) -> None:
    declare(kmock)
    await create_np(kmock, "n1", SPEC_1G)
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")])

    class NoPods:
        async def in_use_device_ids(self) -> set[str]:
            return set()

    reconciler = Reconciler(nv, NoPods(), FakeSupervisor(nvml=nv), CAT)
    agent = Agent(reconciler, source(kmock), resync_seconds=30, retry_seconds=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        for spec, gen in ((SPEC_1G, 1), (SPEC_7G, 2)):
            if gen == 2:
                await patch_np(kmock, "n1", {"spec": spec})
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                np = stored(kmock, NP_RESOURCE, "n1")
                status = (np or {}).get("status") or {}
                if (
                    status.get("observedGeneration") == gen
                    and status["conditions"][0]["status"] == "True"
                ):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(
                    f"generation {gen} not applied: {stored(kmock, NP_RESOURCE, 'n1')}"
                )
        passes = agent.passes
        await asyncio.sleep(1.0)
        assert agent.passes == passes  # settled: the loop sleeps, its status writes wake nothing
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    assert [(p.name, s) for p, s, _ in nv.layout(0)] == [("7g.80gb", 0)]
    assert [w["status"]["observedGeneration"] for w in status_writes(kmock, "n1")] == [1, 2]


async def test_the_agent_keeps_its_status_fields_apart_and_wakes_on_drains(
    kmock: ApiServer,
) -> None:
    declare(kmock)
    await create_np(kmock, "n1", SPEC_1G)
    promised = {"pod": "ns/p", "state": "draining", "gpus": {"nvidia.com/mig-7g.80gb": [0]}}
    resp = await kmock.patch(f"{NP_PATH}/n1/status", json={"status": {"reservations": [promised]}})
    assert resp.status == 200, await resp.text()
    src = source(kmock)
    await src.get()
    status = NodePartitioningStatus.model_validate(
        {"observedGeneration": 1, "gpus": [{"index": 0, "uuid": "GPU-a"}]}
    )
    await src.write_status(status)  # a merge patch of the agent's fields only
    _partitioner, written = status_writes(kmock, "n1")
    assert "reservations" not in written["status"]
    np = stored(kmock, NP_RESOURCE, "n1")
    assert np is not None and np["status"]["reservations"] == [promised]

    # the partitioner starts draining GPU 0: the agent wakes (its preferred allocation changes)
    obj = await src.get()
    assert obj is not None and draining_gpus(obj.status.model_dump(mode="json")) == {0}
    moved = {**promised, "gpus": {"nvidia.com/mig-7g.80gb": [1]}}
    t0 = time.monotonic()
    waiter = asyncio.create_task(src.wait_change(10.0))
    await asyncio.sleep(0.3)
    resp = await kmock.patch(f"{NP_PATH}/n1/status", json={"status": {"reservations": [moved]}})
    assert resp.status == 200
    await asyncio.wait_for(waiter, 10)
    assert time.monotonic() - t0 < 5
