"""The real kopf operator against kmock (an HTTP Kubernetes API emulator), in looptime's fake time.

kmock stores objects but neither assigns ``uid``/``resourceVersion``/``generation`` nor checks
``resourceVersion`` preconditions: ``tests/fake_apiserver.py`` adds that, as the API server does.
Objects are created and changed through the HTTP API, so the operator's watches see every change.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import kmock
import kopf
import prometheus_client
import pytest
from fake_apiserver import NP_PATH, NP_RESOURCE, ApiServer, declare, declare_dra, stored

from partitioner.operator import Controller, run_operator
from partitioner.settings import PartitionerSettings
from partitioner.snapshot import PLANNED_PODS_ANNOTATION

NP = NP_RESOURCE
A100 = {
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
    "nvidia.com/gpu.count": "1",
    "nvidia.com/gpu.memory": "81920",
}
PROFILE_1G_STARTS = range(7)  # facts/mig.md: 1g starts 0..6


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


def node(name: str, labels: dict[str, str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}},
    }


def pod(name: str, resource: str, count: int = 1, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "resources": {"limits": {resource: str(count)}, "requests": {"cpu": "1"}},
                }
            ],
            **spec,
        },
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
        },
    }


async def create(api: kmock.KubernetesEmulator, path: str, obj: dict[str, Any]) -> dict[str, Any]:
    resp = await api.post(path, json=obj)
    assert resp.status in (200, 201), await resp.text()
    result: dict[str, Any] = await resp.json()
    return result


async def patch(api: kmock.KubernetesEmulator, path: str, body: dict[str, Any]) -> None:
    resp = await api.patch(path, json=body)
    assert resp.status == 200, await resp.text()


def partitioning(api: kmock.KubernetesEmulator, name: str) -> dict[str, Any] | None:
    return stored(api, NP, name)


def events(api: kmock.KubernetesEmulator, reason: str | None = None) -> list[dict[str, Any]]:
    out = []
    for (res, _ns, _name), obj in api.objects.items():
        if res == kmock.resource("v1/events") and not obj.deleted:
            ev = dict(obj)
            if reason is None or ev.get("reason") == reason:
                out.append(ev)
    return out


def spec_writes(api: kmock.KubernetesEmulator, name: str) -> list[dict[str, Any]]:
    return [
        r.data
        for r in list(api)
        if str(r.method).upper().endswith("PATCH")
        and r.url.path == f"{NP_PATH}/{name}"
        and isinstance(r.data, dict)
        and "spec" in r.data
    ]


async def eventually(check: Callable[[], Any], within: float, step: float = 0.5) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        result = check()
        if result:
            return result
        if loop.time() >= deadline:
            raise AssertionError(f"condition not met within {within}s of loop time")
        await asyncio.sleep(step)


def settings(**overrides: Any) -> PartitionerSettings:
    base: dict[str, Any] = {
        "batch_timeout_seconds": 60,
        "batch_idle_seconds": 10,
        "cycle_seconds": 1,
        "planner_time_limit_seconds": 0.5,
        "metrics_port": 0,
        "health_port": 0,
        "reservation": False,  # these tests cover the ungated path; gating: test_operator_gates
    }
    return PartitionerSettings(**(base | overrides))


@contextlib.asynccontextmanager
async def operator(api: kmock.KubernetesEmulator, **overrides: Any) -> AsyncIterator[Controller]:
    info = kopf.ConnectionInfo(server=str(api.url).rstrip("/"))
    clock = asyncio.get_running_loop().time  # looptime's fake clock, not the wall clock
    controller = Controller(settings(**overrides), connection=info, clock=clock)
    stop = asyncio.Event()
    task = asyncio.create_task(run_operator(controller, stop_flag=stop))
    try:
        await eventually(lambda: controller.last_cycle is not None, within=30, step=0.1)
        yield controller
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
    assert task.exception() is None


@pytest.mark.looptime
async def test_unschedulable_pod_gets_a_spec_within_the_batch_window(kmock: ApiServer) -> None:
    declare(kmock)
    await create(
        kmock, "/api/v1/nodes", node("n1", {"nos.nebuly.com/gpu-partitioning": "mig", **A100})
    )
    async with operator(kmock) as controller:
        np = await eventually(lambda: partitioning(kmock, "n1"), within=5)
        assert np["spec"] == {"planId": "", "mode": "mig", "gpus": []}
        assert np["metadata"]["ownerReferences"][0]["kind"] == "Node"

        loop = asyncio.get_running_loop()
        created_at = loop.time()
        await create(kmock, "/api/v1/namespaces/default/pods", pod("p1", "nvidia.com/mig-1g.10gb"))
        await asyncio.sleep(5)
        assert spec_writes(kmock, "n1") == []  # the window is still open (idle 10 s)

        await eventually(lambda: spec_writes(kmock, "n1"), within=10)
        assert loop.time() - created_at <= 10 + 2  # idle time + one cycle + slack
        spec = partitioning(kmock, "n1")
        assert spec is not None
        assert spec["spec"]["planId"] == "1"
        assert spec["spec"]["mode"] == "mig"
        (gpu,) = spec["spec"]["gpus"]
        assert gpu["index"] == 0 and gpu["mps"] == []
        (inst,) = gpu["mig"]
        assert inst["profile"] == "1g.10gb" and inst["start"] in PROFILE_1G_STARTS
        assert json.loads(spec["metadata"]["annotations"][PLANNED_PODS_ANNOTATION]) == [
            "default/p1"
        ]
        (planned,) = await eventually(lambda: events(kmock, "Planned"), within=5)
        assert planned["message"] == "planned nvidia.com/mig-1g.10gb on node n1 GPU 0, plan 1"
        assert planned["involvedObject"]["name"] == "p1"

        metrics = prometheus_client.generate_latest(controller.metrics.registry).decode()
        assert "gpuslice_pods_planned_total 1.0" in metrics
        assert "gpuslice_gpus_reconfigured_total 1.0" in metrics
        assert "gpuslice_batch_size_count 1.0" in metrics
        assert "gpuslice_plan_duration_seconds_count 1.0" in metrics

        await asyncio.sleep(90)  # the pod stays pending, the spec is not applied: no rewrite
        assert len(spec_writes(kmock, "n1")) == 1


@pytest.mark.looptime
async def test_node_with_unapplied_spec_is_skipped_while_another_is_planned(
    kmock: ApiServer,
) -> None:
    declare(kmock)
    await create(kmock, "/api/v1/nodes", node("busy", {"gpuslice.io/partitioning": "mig", **A100}))
    await create(kmock, "/api/v1/nodes", node("free", {"gpuslice.io/partitioning": "mig", **A100}))
    busy_spec = {
        "planId": "5",
        "mode": "mig",
        "gpus": [{"index": 0, "mig": [{"profile": "7g.80gb", "start": 0}], "mps": []}],
    }
    np = await create(
        kmock,
        NP_PATH,
        {
            "apiVersion": "gpuslice.io/v1alpha1",
            "kind": "NodePartitioning",
            "metadata": {"name": "busy", "generation": 2},
            "spec": busy_spec,
        },
    )
    assert np["metadata"]["generation"] == 2
    await patch(
        kmock,
        f"{NP_PATH}/busy/status",
        {
            "status": {
                "observedGeneration": 1,
                "conditions": [{"type": "Applied", "status": "False", "reason": "Pending"}],
            }
        },
    )
    await create(kmock, "/api/v1/namespaces/default/pods", pod("p1", "nvidia.com/mig-1g.10gb"))
    async with operator(kmock):
        await eventually(lambda: spec_writes(kmock, "free"), within=20)
        free = partitioning(kmock, "free")
        assert free is not None and free["spec"]["planId"] == "6"  # continues after plan 5
        assert [i["profile"] for i in free["spec"]["gpus"][0]["mig"]] == ["1g.10gb"]
        assert spec_writes(kmock, "busy") == []
        busy = partitioning(kmock, "busy")
        assert busy is not None and busy["spec"] == busy_spec


@pytest.mark.looptime
async def test_node_opting_out_is_cleaned_up(kmock: ApiServer) -> None:
    declare(kmock)
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mps", **A100}))
    async with operator(kmock):
        np = await eventually(lambda: partitioning(kmock, "n1"), within=5)
        assert np["spec"]["mode"] == "mps"
        await patch(
            kmock, "/api/v1/nodes/n1", {"metadata": {"labels": {"gpuslice.io/partitioning": None}}}
        )
        await eventually(lambda: partitioning(kmock, "n1") is None, within=5)
        await asyncio.sleep(10)
        assert partitioning(kmock, "n1") is None  # not re-created


@pytest.mark.looptime
async def test_restart_mid_batch_loses_nothing_and_duplicates_nothing(kmock: ApiServer) -> None:
    declare(kmock)
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mig", **A100}))
    async with operator(kmock):
        await eventually(lambda: partitioning(kmock, "n1"), within=5)
        await create(kmock, "/api/v1/namespaces/default/pods", pod("p1", "nvidia.com/mig-1g.10gb"))
        await asyncio.sleep(4)  # mid-batch: the window (idle 10 s) is open
    assert spec_writes(kmock, "n1") == []

    async with operator(kmock):  # a new process: nothing carried over but the API state
        await eventually(lambda: spec_writes(kmock, "n1"), within=15)
        await asyncio.sleep(5)
    assert len(spec_writes(kmock, "n1")) == 1
    assert len(events(kmock, "Planned")) == 1

    # Restart after the write, before the agent applied it, with a second free node: the pod
    # is in flight to n1 and must not be planned again onto n2.
    await create(kmock, "/api/v1/nodes", node("n2", {"gpuslice.io/partitioning": "mig", **A100}))
    async with operator(kmock):
        await asyncio.sleep(90)
        assert partitioning(kmock, "n2") is not None
    assert spec_writes(kmock, "n2") == []
    assert len(spec_writes(kmock, "n1")) == 1
    assert len(events(kmock, "Planned")) == 1
    np = partitioning(kmock, "n1")
    assert np is not None and np["spec"]["planId"] == "1"


@pytest.mark.looptime
async def test_malformed_labels_and_unknown_resources_get_events_no_crash(kmock: ApiServer) -> None:
    declare(kmock)
    await create(
        kmock,
        "/api/v1/nodes",
        node(
            "odd",
            {
                "gpuslice.io/partitioning": "mig",
                "nvidia.com/gpu.product": "NVIDIA-Z999",
                "nvidia.com/gpu.count": "1",
            },
        ),
    )
    await create(
        kmock,
        "/api/v1/nodes",
        node(
            "nocount",
            {
                "gpuslice.io/partitioning": "mig",
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                "nvidia.com/gpu.count": "two",
            },
        ),
    )
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mig", **A100}))
    await create(kmock, "/api/v1/namespaces/default/pods", pod("weird", "nvidia.com/mig-9g.99gb"))
    await create(kmock, "/api/v1/namespaces/default/pods", pod("good", "nvidia.com/mig-2g.20gb"))
    async with operator(kmock) as controller:
        unknown = await eventually(lambda: events(kmock, "UnknownGpuModel"), within=5)
        assert unknown[0]["involvedObject"] == {
            "apiVersion": "v1",
            "kind": "Node",
            "name": "odd",
            "uid": unknown[0]["involvedObject"]["uid"],
        }
        assert "NVIDIA-Z999" in unknown[0]["message"]
        bad = await eventually(lambda: events(kmock, "InvalidGpuLabels"), within=5)
        assert bad[0]["involvedObject"]["name"] == "nocount"
        cond = (dict(kmock.objects["v1/nodes", None, "odd"])["status"]["conditions"])[0]
        assert (cond["type"], cond["status"], cond["reason"]) == (
            "GpusliceReady",
            "False",
            "UnknownGpuModel",
        )
        assert partitioning(kmock, "odd") is None

        (weird,) = await eventually(lambda: events(kmock, "Unplaceable"), within=5)
        assert weird["involvedObject"]["name"] == "weird"
        assert weird["message"].startswith("cannot place: unknown resource nvidia.com/mig-9g.99gb")

        await eventually(lambda: spec_writes(kmock, "n1"), within=15)
        (planned,) = events(kmock, "Planned")
        assert planned["involvedObject"]["name"] == "good"
        await asyncio.sleep(30)
        assert len(events(kmock, "Unplaceable")) == 1  # reported once, not every cycle
        assert len(events(kmock, "UnknownGpuModel")) == 1
        assert controller.last_decision is not None and controller.last_decision.error == ""


@pytest.mark.looptime
async def test_conflicting_update_is_reported_and_retried(kmock: ApiServer) -> None:
    declare(kmock)
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mig", **A100}))
    async with operator(kmock) as controller:
        await eventually(lambda: partitioning(kmock, "n1"), within=5)
        await asyncio.sleep(2)
        # Someone else writes the object; its watch event has not reached the operator yet.
        # (resourceVersions only grow: the controller never lets an older one replace a newer)
        kmock.objects[kmock.resource(NP), None, "n1"].patch(
            {"metadata": {"resourceVersion": "999999"}}
        )
        await create(kmock, "/api/v1/namespaces/default/pods", pod("p1", "nvidia.com/mig-1g.10gb"))

        (conflict,) = await eventually(lambda: events(kmock, "SpecConflict"), within=15)
        assert conflict["involvedObject"]["kind"] == "NodePartitioning"
        assert "plan 1 not written" in conflict["message"]
        # the step records its metrics after all its writes (the Event is one of them)
        await eventually(lambda: controller.metrics.spec_conflicts._value.get() == 1, within=5)

        # Retried with the re-read resourceVersion in the next window: plan 2 lands.
        await eventually(
            lambda: (partitioning(kmock, "n1") or {}).get("spec", {}).get("planId") == "2",
            within=15,
        )
        assert len(events(kmock, "Planned")) == 1


# ----------------------------------------------------------- the initial listing (issue 11)


@contextlib.asynccontextmanager
async def listing_controller(
    api: ApiServer, page_size: int | None = None
) -> AsyncIterator[Controller]:
    """A controller whose loop runs without kopf (nothing else lists), logged in to ``api``."""
    info = kopf.ConnectionInfo(server=str(api.url).rstrip("/"))
    controller = Controller(settings(), connection=info, clock=asyncio.get_running_loop().time)
    if page_size is not None:
        controller.list_page_size = page_size
    controller.logged_in(info)
    controller.start()
    try:
        yield controller
    finally:
        await controller.stop()


@pytest.mark.looptime
async def test_initial_listing_reads_every_page(kmock: ApiServer) -> None:
    declare(kmock)
    for i in range(5):
        await create(
            kmock,
            "/api/v1/nodes",
            node(f"n{i}", {"nos.nebuly.com/gpu-partitioning": "mig", **A100}),
        )
    for i in range(3):
        await create(
            kmock, "/api/v1/namespaces/default/pods", pod(f"p{i}", "nvidia.com/mig-1g.10gb")
        )
    async with listing_controller(kmock, page_size=2) as controller:
        await eventually(lambda: controller.last_cycle is not None, within=10, step=0.1)
        assert sorted(controller.index.nodes) == [f"n{i}" for i in range(5)]
        assert sorted(controller.index.pods) == [f"default/p{i}" for i in range(3)]
    pages = [(c.path, c.limit, c.items) for c in kmock.lists if c.status == 200]
    assert pages[:6] == [
        ("/api/v1/nodes", 2, 2),
        ("/api/v1/nodes", 2, 2),
        ("/api/v1/nodes", 2, 1),
        ("/api/v1/pods", 2, 2),
        ("/api/v1/pods", 2, 1),
        (NP_PATH, 2, 0),
    ]


@pytest.mark.looptime
async def test_initial_listing_outage_backs_off_and_logs_once(
    kmock: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    declare(kmock)
    caplog.set_level(logging.DEBUG, logger="gpuslice.partitioner")
    kmock.fail_lists = 7  # the API server answers 503 to the first 7 list requests
    async with listing_controller(kmock) as controller:
        await eventually(lambda: controller.last_cycle is not None, within=120, step=0.1)
    failed = [c.at for c in kmock.lists if c.status == 503]
    assert len(failed) == 7
    first_ok = next(c.at for c in kmock.lists if c.status == 200)
    gaps = [b - a for a, b in itertools.pairwise([*failed, first_ok])]
    # exponential, 1 s doubling, capped at 30 s, jitter takes off up to half of each step
    steps = [min(30.0, 2.0**n) for n in range(7)]
    for gap, step in zip(gaps, steps, strict=True):
        assert step / 2 - 0.01 <= gap <= step + 0.5, (gaps, steps)
    assert max(gaps) <= 30.5 and sum(gaps) >= 31  # grew well past a fixed 1 s retry

    lines = [r for r in caplog.records if "initial listing" in r.getMessage()]
    warnings = [r for r in lines if r.levelno == logging.WARNING]
    infos = [r for r in lines if r.levelno == logging.INFO]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "503" in warnings[0].getMessage() and warnings[0].exc_info is None
    assert [r.getMessage() for r in infos] == [
        "initial listing of nodes, pods and NodePartitionings succeeded after 7 failed attempt(s)"
    ]
    assert sum(1 for r in lines if r.levelno == logging.DEBUG) == 6


@pytest.mark.looptime
async def test_with_dra_a_claim_pod_is_planned_on_the_dra_node_from_its_watched_claim(
    kmock: ApiServer,
) -> None:
    declare(kmock)
    declare_dra(kmock)
    await create(kmock, "/api/v1/nodes", node("d1", {"gpuslice.io/partitioning": "dra", **A100}))
    await create(kmock, "/api/v1/nodes", node("m1", {"gpuslice.io/partitioning": "mig", **A100}))
    selector = 'device.attributes["gpu.gpuslice.io"].profile == "3g.40gb"'
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c1", "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "mig.gpuslice.io",
                            "selectors": [{"cel": {"expression": selector}}],
                        },
                    }
                ]
            }
        },
    }
    p1 = pod("p1", "cpu", resourceClaims=[{"name": "gpu", "resourceClaimName": "c1"}])
    p1["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1"}}
    async with operator(kmock, dra_enabled=True) as controller:
        await create(kmock, "/api/v1/namespaces/default/pods", p1)
        await asyncio.sleep(5)
        # the claim is not known yet: nothing to plan
        assert controller.index.pods["default/p1"].claims_pending
        await create(kmock, "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims", claim)
        await eventually(lambda: spec_writes(kmock, "d1"), within=20)
        assert spec_writes(kmock, "m1") == []  # a claim pod never goes to a device-plugin node
        spec = partitioning(kmock, "d1")
        assert spec is not None and spec["spec"]["mode"] == "mig"
        (gpu,) = spec["spec"]["gpus"]
        assert [m["profile"] for m in gpu["mig"]] == ["3g.40gb"]
    assert any(c.path.endswith("/resourceclaims") for c in kmock.lists)


@pytest.mark.looptime
async def test_a_pod_deleted_while_kopfs_watch_was_gone_is_dropped_at_its_next_listing(
    kmock: ApiServer,
) -> None:
    """The pods' watch fails (``410 Gone``: its resourceVersion is too old) and a bound pod is
    deleted before kopf lists again: no ``DELETED`` event ever reaches the operator.  kopf's new
    listing only upserts; the controller notices it and lists pods itself, which drops the
    pod and frees the slice it held on the node."""
    declare(kmock)
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mig", **A100}))
    one_g = "nvidia.com/mig-1g.10gb"
    for name in ("done", "stays"):
        bound = pod(name, one_g, nodeName="n1")
        bound["status"] = {"phase": "Running"}
        await create(kmock, "/api/v1/namespaces/default/pods", bound)
    async with operator(kmock) as controller:
        await eventually(lambda: controller.index.usage("n1").slices == {one_g: 2}, within=5)
        await asyncio.sleep(5)
        pod_lists = [c for c in kmock.lists if c.path == "/api/v1/pods"]
        assert len(pod_lists) == 2  # kopf's and the controller's: kopf's first listing is no gap
        # deleted where no watch sees it, then the watch is told its version is gone
        kmock.objects[kmock.resource("v1/pods"), "default", "done"].delete()
        gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
        await kmock._buses[kmock.resource("v1/pods")].put({"type": "ERROR", "object": gone})
        await eventually(lambda: controller.index.usage("n1").slices == {one_g: 1}, within=10)
        assert sorted(controller.index.pods) == ["default/stays"]
        assert len([c for c in kmock.lists if c.path == "/api/v1/pods"]) == 4  # kopf's, ours


@pytest.mark.looptime
async def test_watch_events_are_folded_on_the_event_loop_thread(kmock: ApiServer) -> None:
    """The index has one writer: the event loop (a step reads it in a worker thread and the
    events meanwhile are buffered, then folded in). kopf runs a plain ``def`` handler in its
    thread pool, where a check-then-append on the buffer could race the loop's swap of it (an
    event lost, a gated pod never seen again) and per-node counts drift; the handlers are
    coroutines, so every event is folded on the loop."""
    import threading

    declare(kmock)
    await create(
        kmock, "/api/v1/nodes", node("n1", {"nos.nebuly.com/gpu-partitioning": "mig", **A100})
    )
    threads: set[int] = set()
    original = Controller.observe

    def observe(self: Controller, kind: str, event: Any) -> None:
        threads.add(threading.get_ident())
        original(self, kind, event)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Controller, "observe", observe)
        async with operator(kmock):
            await create(
                kmock, "/api/v1/namespaces/default/pods", pod("p1", "nvidia.com/mig-1g.10gb")
            )
            await eventually(lambda: len(threads) > 0, within=5)
            await asyncio.sleep(2)
    assert threads == {threading.get_ident()}
