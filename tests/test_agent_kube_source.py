"""KubeSpecSource (the agent's Kubernetes port) over real HTTP against kmock (tests/fake_apiserver.py).

The official asyncio client (kubernetes_asyncio) talks to the emulator, which assigns uid,
resourceVersion and generation and serves the status subresource like the API server.  Checked:
reading the spec, writing status through ``/status`` only, and a watch that wakes the agent for
spec changes, deletion and creation -- but not for its own status writes nor for the ADDED
replay at the start of every watch (which would spin the agent loop); a watch that ends at its
timeout (kmock ignores ``timeoutSeconds``) or on cancellation with no task or connection left.
A scripted server (:class:`Scripted`: plain aiohttp, every request recorded) checks what kmock
cannot send: BOOKMARK events, ``410 Gone``, and an outage logged as one warning and one
recovery line.  Real time; each wait is short.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import kmock
import pytest
from fake_apiserver import NP_PATH, NP_RESOURCE, ApiServer, declare, stored

from contract.kube_retry import Backoff
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


@pytest.fixture
def source(connect: Callable[[str], Any]) -> Callable[..., KubeSpecSource]:
    def make(api: kmock.KubernetesEmulator, name: str = "n1") -> KubeSpecSource:
        return KubeSpecSource(name, connect(str(api.url)), request_timeout_s=5)

    return make


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


async def test_get_reads_the_spec_and_404_is_none(
    kmock: ApiServer, source: Callable[..., KubeSpecSource]
) -> None:
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


async def test_write_status_goes_through_the_status_subresource(
    kmock: ApiServer, source: Callable[..., KubeSpecSource]
) -> None:
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
    kmock: ApiServer, source: Callable[..., KubeSpecSource]
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


async def test_wait_change_wakes_on_delete_and_on_create(
    kmock: ApiServer, source: Callable[..., KubeSpecSource]
) -> None:
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


async def test_without_an_api_it_connects_with_the_kubeconfig_and_closes_what_it_opened(
    kmock: ApiServer, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    declare(kmock)
    await create_np(kmock, "n1", SPEC_1G)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1", "kind": "Config", "current-context": "k",
                "clusters": [{"name": "k", "cluster": {"server": str(kmock.url).rstrip("/")}}],
                "users": [{"name": "u", "user": {"token": "agent-token"}}],
                "contexts": [{"name": "k", "context": {"cluster": "k", "user": "u"}}],
            }
        )
    )  # fmt: skip
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: kubeconfig
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    src = KubeSpecSource("n1")
    obj = await src.get()
    assert obj is not None and obj.spec.planId == "1"
    (read,) = [r for r in list(kmock) if r.url.path == f"{NP_PATH}/n1"]
    assert read.headers.get("Authorization") == "Bearer agent-token"
    api = await src.connect()
    await src.close()
    assert api.api_client.rest_client.pool_manager.closed  # its connection pool is closed

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(Exception, match=r"kubeconfig .*missing unusable .*set KUBECONFIG"):
        await KubeSpecSource("n1").get()


async def test_wait_change_on_an_unreachable_api_server_waits_out_its_timeout(
    connect: Callable[[str], Any],
) -> None:
    src = KubeSpecSource("n1", connect("http://127.0.0.1:9"))  # discard port: refused
    t0 = time.monotonic()
    await src.wait_change(0.5)  # no exception, and no busy loop for the caller
    assert time.monotonic() - t0 >= 0.45
    assert src.outage.failures >= 1  # the refusals were counted (logged once, below)


async def test_agent_loop_over_kube_source_applies_each_generation_once(
    kmock: ApiServer, source: Callable[..., KubeSpecSource]
) -> None:
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
            deadline = time.monotonic() + 20
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
    kmock: ApiServer, source: Callable[..., KubeSpecSource]
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


# -- a scripted API server: bookmarks, 410 Gone, outages, connections -----------------------


class Scripted:
    """One NodePartitioning (``n1``) served over plain aiohttp, with scripted watches.

    ``GET`` of the object answers :attr:`obj`; a list request is a watch: its query is recorded
    in :attr:`watches`, it streams the next script of :attr:`scripts` (none left: no event) and
    then holds the stream open, ignoring ``timeoutSeconds``, until the client closes it
    (:attr:`open_watches` counts the streams still open).  While :attr:`fail_with` is set every
    request answers that HTTP status with a Kubernetes ``Status`` body.
    """

    def __init__(self) -> None:
        self.obj: dict[str, Any] = {
            "apiVersion": "gpuslice.io/v1alpha1", "kind": "NodePartitioning",
            "metadata": {"name": "n1", "uid": "u1", "generation": 1, "resourceVersion": "10"},
            "spec": SPEC_1G,
        }  # fmt: skip
        self.scripts: list[list[dict[str, Any]]] = []
        self.watches: list[dict[str, str]] = []
        self.open_watches = 0
        self.fail_with: int | None = None
        self.url = ""
        self._runner: aiohttp.web.AppRunner | None = None

    def _failure(self) -> aiohttp.web.Response:
        status = {"kind": "Status", "status": "Failure", "code": self.fail_with,
                  "reason": "ServiceUnavailable", "message": "etcd is down"}  # fmt: skip
        return aiohttp.web.json_response(status, status=self.fail_with or 500)

    async def _get(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        if self.fail_with:
            return self._failure()
        return aiohttp.web.json_response(self.obj)

    async def _watch(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        if self.fail_with:
            return self._failure()
        self.watches.append(dict(request.query))
        script = self.scripts.pop(0) if self.scripts else []
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        self.open_watches += 1
        try:
            for event in script:
                await resp.write(json.dumps(event).encode() + b"\n")
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.02)
        finally:
            self.open_watches -= 1
        return resp

    async def start(self) -> None:
        app = aiohttp.web.Application()
        app.router.add_get(NP_PATH, self._watch)
        app.router.add_get(NP_PATH + "/{name}", self._get)
        app.router.add_patch(NP_PATH + "/{name}/status", self._get)  # answers the object
        self._runner = aiohttp.web.AppRunner(app)
        await self._runner.setup()
        await aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    server = Scripted()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def event(kind: str, version: str, generation: int = 1) -> dict[str, Any]:
    meta = {"name": "n1", "uid": "u1", "generation": generation, "resourceVersion": version}
    if kind == "BOOKMARK":
        meta = {"resourceVersion": version}
    return {"type": kind, "object": {"kind": "NodePartitioning", "metadata": meta, "spec": SPEC_1G}}


def client_tasks() -> set[asyncio.Task[Any]]:
    """The loop's tasks but the scripted server's (one per connection it serves)."""
    return {
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "") != "RequestHandler.start"
    }


async def until(condition: Callable[[], bool], within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_a_bookmark_only_advances_the_resource_version_the_next_watch_starts_from(
    scripted: Scripted, connect: Callable[[str], Any]
) -> None:
    src = KubeSpecSource("n1", connect(scripted.url), request_timeout_s=5)
    await src.get()
    scripted.scripts = [[event("BOOKMARK", "15")], [event("MODIFIED", "17")], []]
    t0 = time.monotonic()
    await src.wait_change(0.5)
    assert time.monotonic() - t0 >= 0.45  # a bookmark is no change: the wait lasts its timeout
    assert src.watch_events == 1 and src.resource_version == "15"
    await src.wait_change(0.3)  # the agent's own status write (same generation): no change
    assert src.resource_version == "17"
    deadline = time.monotonic() + 30  # on a loaded machine the third watch may take many waits
    while len(scripted.watches) < 3:
        assert time.monotonic() < deadline, "no third watch"
        await src.wait_change(0.1)
    first, second, third = scripted.watches[:3]
    assert first["resourceVersion"] == "10"  # from the read
    assert first["allowWatchBookmarks"].lower() == "true"
    assert first["fieldSelector"] == "metadata.name=n1"
    assert second["resourceVersion"] == "15"  # after the bookmark, not from the read again
    assert third["resourceVersion"] == "17"
    await src.get()  # a read starts over from the object's own version
    assert src.resource_version == "10"


async def test_410_gone_returns_at_once_and_the_next_watch_starts_from_now(
    scripted: Scripted, connect: Callable[[str], Any]
) -> None:
    src = KubeSpecSource("n1", connect(scripted.url), request_timeout_s=5)
    await src.get()
    gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    scripted.scripts = [[{"type": "ERROR", "object": gone}]]
    t0 = time.monotonic()
    await src.wait_change(10.0)
    assert time.monotonic() - t0 < 2  # the caller re-reads at once
    assert src.resource_version == "" and src.outage.failures == 0  # 410 is no outage
    deadline = time.monotonic() + 30  # a loaded machine may take many short waits
    while len(scripted.watches) < 2:
        assert time.monotonic() < deadline, "no second watch"
        await src.wait_change(0.1)
    assert "resourceVersion" not in scripted.watches[1]
    # a new generation in the replay of the fresh watch wakes the agent
    scripted.scripts = [[event("ADDED", "20", generation=2)]]
    await asyncio.wait_for(src.wait_change(10.0), 2)


async def test_a_watch_ends_at_its_timeout_or_on_cancel_leaving_no_task_or_connection(
    scripted: Scripted, connect: Callable[[str], Any]
) -> None:
    src = KubeSpecSource("n1", connect(scripted.url), request_timeout_s=5)
    await src.get()
    tasks = client_tasks()
    t0 = time.monotonic()
    await src.wait_change(0.5)  # the server ignores timeoutSeconds and keeps the stream open
    assert 0.45 <= time.monotonic() - t0 < 1.5
    await until(lambda: scripted.open_watches == 0)  # the client closed the connection
    await asyncio.sleep(0.05)
    assert client_tasks() == tasks  # the source started none

    waiter = asyncio.create_task(src.wait_change(10.0))
    await until(lambda: scripted.open_watches == 1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await until(lambda: scripted.open_watches == 0)
    await asyncio.sleep(0.05)
    assert client_tasks() == tasks  # the source started none


async def test_an_outage_logs_one_warning_and_one_recovery_line(
    scripted: Scripted, connect: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="gpuslice.agent")
    src = KubeSpecSource(
        "n1",
        connect(scripted.url),
        request_timeout_s=5,
        backoff=Backoff(initial_s=0.05, cap_s=0.1),
    )
    await src.get()
    scripted.fail_with = 503
    with pytest.raises(Exception, match="reading NodePartitioning n1: HTTP 503: etcd is down"):
        await src.get()
    t0 = time.monotonic()
    await src.wait_change(0.6)  # the watch is retried with backoff, and fails each time
    assert time.monotonic() - t0 >= 0.55
    deadline = time.monotonic() + 30  # a loaded machine may retry less often within 0.6 s
    while src.outage.failures < 4:  # the get and at least three watches
        assert time.monotonic() < deadline, "the watch was not retried"
        await src.wait_change(0.2)
    with pytest.raises(Exception, match="status of NodePartitioning n1: HTTP 503"):
        await src.write_status(NodePartitioningStatus.model_validate({"observedGeneration": 1}))
    failures = src.outage.failures
    assert failures >= 5  # get, at least three watches, the status write
    scripted.fail_with = None
    assert await src.get() is not None
    await src.write_status(NodePartitioningStatus.model_validate({"observedGeneration": 1}))

    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "gpuslice.agent"]
    warnings = [m for lvl, m in lines if lvl == logging.WARNING]
    infos = [m for lvl, m in lines if lvl == logging.INFO]
    assert len(warnings) == 1 and "NodePartitioning n1" in warnings[0]
    assert "HTTP 503: etcd is down" in warnings[0] and "\n" not in warnings[0]
    assert infos == [
        f"Kubernetes API for NodePartitioning n1 succeeded after {failures} failed attempt(s)"
    ]
    assert len([lvl for lvl, _ in lines if lvl == logging.DEBUG]) >= failures - 1
    assert not any(r.exc_info for r in caplog.records if r.name == "gpuslice.agent")


async def test_a_status_field_the_api_server_drops_is_told_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CRD older than the agent (Helm never upgrades CRDs) makes the API server prune the
    status fields it does not know, silently: the partitioner never reads them (an XID-hit
    instance it keeps promising).  The answer to the status patch is the object as stored:
    a field sent and missing there is told in one warning naming it and the fix."""

    class Pruning:
        def __init__(self) -> None:
            self.calls = 0

        async def patch_cluster_custom_object_status(
            self, group: str, version: str, plural: str, name: str, body: Any, **_: Any
        ) -> dict[str, Any]:
            self.calls += 1
            stored = json.loads(json.dumps(body))
            for gpu in stored["status"].get("gpus") or ():
                for m in gpu.get("mig") or ():
                    m.pop("unhealthy", None)  # what a CRD without the field does
            return stored

    status = NodePartitioningStatus.model_validate(
        {
            "observedGeneration": 1,
            "gpus": [{"index": 0, "mig": [{"profile": "1g.10gb", "start": 0, "unhealthy": True}]}],
        }
    )
    src = KubeSpecSource("n1", Pruning())
    with caplog.at_level(logging.WARNING, logger="node_agent.agent"):
        await src.write_status(status)
        await src.write_status(status)
    told = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(told) == 1 and src.crd_stale
    assert "status.gpus[0].mig[0].unhealthy" in told[0] and "kubectl apply -f" in told[0]
    fresh = KubeSpecSource("n1", type("Keeping", (), {
        "patch_cluster_custom_object_status": staticmethod(
            lambda *a, **k: asyncio.sleep(0, result=a[4])
        )
    })())  # fmt: skip
    await fresh.write_status(status)
    assert not fresh.crd_stale
