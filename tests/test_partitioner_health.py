"""The partitioner's liveness (``/healthz``) and readiness (``/readyz``): partitioner/health.py.

The rules on a fake clock first, then the HTTP endpoint, then the real kopf operator against
kmock in looptime's fake time: steps that keep raising, a step that hangs, and an API server
that refuses the initial listing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
import kmock
import kopf
import pytest
from fake_apiserver import ApiServer, declare
from manual_clock import ManualClock
from test_partitioner_operator import A100, create, eventually, node, pod, settings

from partitioner.decide import Decision
from partitioner.health import ControllerHealth, HealthServer
from partitioner.heap import HeapKeeper
from partitioner.operator import Controller, run_operator
from partitioner.settings import PartitionerSettings


# -- the rules ---------------------------------------------------------------------------------
def test_steps_raising_in_a_row_fail_liveness_until_one_completes() -> None:
    clock = ManualClock(1000.0)
    health = ControllerHealth(stale_seconds=120, failed_steps=3, clock=clock)
    health.step_done()
    for _ in range(2):
        health.step_done("RuntimeError: boom")
    assert health.liveness().ok  # two in a row: below the limit
    health.step_done("RuntimeError: boom")
    report = health.liveness()
    assert not report.ok and report.failed_steps == 3
    assert report.reason == "the last 3 decision steps failed (limit 3): RuntimeError: boom"
    health.step_done()
    assert health.liveness().ok and health.liveness().failed_steps == 0


def test_no_completed_step_for_stale_seconds_fails_liveness() -> None:
    clock = ManualClock(1000.0)
    health = ControllerHealth(stale_seconds=60, failed_steps=0, clock=clock)
    health.started()
    clock.now += 60
    assert health.liveness().ok  # exactly the limit is still live
    clock.now += 1
    assert health.liveness().reason == "no decision step yet for 61.0s (limit 60s)"
    health.step_done()
    assert health.liveness().ok and health.liveness().last_step_age_s == 0
    clock.now += 30
    for _ in range(100):  # failing steps do not refresh the loop; N = 0: never by count
        health.step_done("ApiError: 500")
    assert health.liveness().ok
    clock.now += 31
    report = health.liveness()
    assert not report.ok and report.last_step_age_s == 61
    assert report.reason == "no decision step completed for 61.0s (limit 60s)"


def test_zero_turns_both_rules_off_and_readiness_follows_the_listing() -> None:
    clock = ManualClock(1000.0)
    health = ControllerHealth(stale_seconds=0, failed_steps=0, clock=clock)
    clock.now += 1e6
    for _ in range(1000):
        health.step_done("boom")
    assert health.liveness().ok
    assert not health.readiness().ok and not health.readiness().synced
    health.synced()
    assert health.readiness().ok and health.readiness().synced
    with pytest.raises(ValueError, match="must be >= 0"):
        ControllerHealth(stale_seconds=-1, failed_steps=1)


def test_a_replica_serving_the_webhook_is_ready_only_while_it_is_served() -> None:
    """The webhook's Service routes admission calls to ready pods: a replica whose webhook is
    not served must not be ready (the reason says why), leader or follower alike."""
    clock = ManualClock(1000.0)
    health = ControllerHealth(stale_seconds=60, failed_steps=3, clock=clock)
    problem = ["the admission webhook is not served: no certificate yet (ApiError: 403)"]
    health.webhook(lambda: problem[0])
    report = health.readiness()
    assert not report.ok  # the listing first: its reason wins
    assert report.reason.startswith("the initial listing of nodes")
    health.synced()
    health.leadership(False, "other-replica")
    report = health.readiness()
    assert (report.ok, report.reason, report.synced) == (False, problem[0], True)
    assert (report.leader, report.holder) == (False, "other-replica")
    assert health.liveness().ok  # a restart would not serve it either
    problem[0] = ""
    report = health.readiness()
    assert (report.ok, report.reason, report.leader) == (True, "ok", False)  # a ready follower


def test_stale_limit_must_exceed_a_cycle_plus_planning() -> None:
    with pytest.raises(ValueError, match=r"must exceed cycle_seconds \+ planner_time_limit"):
        PartitionerSettings(
            cycle_seconds=5, planner_time_limit_seconds=10, liveness_stale_seconds=15
        )
    s = PartitionerSettings(
        cycle_seconds=5, planner_time_limit_seconds=10, liveness_stale_seconds=0
    )
    assert s.liveness_stale_seconds == 0


# -- the endpoint ------------------------------------------------------------------------------
def get(port: int, path: str) -> tuple[int, dict[str, Any] | str]:
    """GET ``path``; blocking on purpose (the server runs in its own thread, and the fake loop
    time must not move while the test waits for the answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read().decode()
        return e.code, json.loads(
            body
        ) if e.headers.get_content_type() == "application/json" else body


@contextlib.contextmanager
def serving(health: ControllerHealth) -> Any:
    server = HealthServer(health, port=0, host="127.0.0.1")
    server.start()
    try:
        yield server.port
    finally:
        server.stop()


def test_the_reaction_time_is_at_most_a_cycle() -> None:
    with pytest.raises(ValueError, match=r"react_seconds \(2\) must be at most cycle_seconds"):
        PartitionerSettings(cycle_seconds=1, react_seconds=2)
    assert PartitionerSettings(cycle_seconds=1, react_seconds=1).react_seconds == 1
    assert PartitionerSettings().react_seconds == 0.1


def test_endpoint_answers_503_with_the_reason_and_200_when_well() -> None:
    clock = ManualClock(1000.0)
    health = ControllerHealth(stale_seconds=60, failed_steps=2, clock=clock)
    with serving(health) as port:
        assert get(port, "/readyz") == (
            503,
            {
                "ok": False,
                "reason": "the initial listing of nodes, pods and NodePartitionings has not "
                "completed",
                "synced": False,
                "last_step_age_s": None,
                "failed_steps": 0,
                "leader": True,  # no election: it leads
                "holder": "",
            },
        )
        health.synced()
        health.step_done()
        clock.now += 5
        assert get(port, "/readyz")[0] == 200
        assert get(port, "/healthz") == (
            200,
            {
                "ok": True,
                "reason": "ok",
                "synced": True,
                "last_step_age_s": 5.0,
                "failed_steps": 0,
                "leader": True,
                "holder": "",
            },
        )
        health.step_done("KeyError: 'x'")
        health.step_done("KeyError: 'y'")
        code, body = get(port, "/healthz")
        assert code == 503 and isinstance(body, dict)
        assert body["reason"] == "the last 2 decision steps failed (limit 2): KeyError: 'y'"
        assert get(port, "/readyz")[0] == 200  # readiness is the listing's, not the loop's
        assert get(port, "/metrics") == (404, "not found: /healthz, /readyz\n")


# -- the real operator -------------------------------------------------------------------------
@attrs.define(kw_only=True)
class RefusingApiServer(ApiServer):
    """The fake API server, answering 503 to every LIST of a resource (not discovery) while
    ``refuse_lists`` is set."""

    refuse_lists: bool = attrs.field(default=False, init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        if self.refuse_lists and request.action == kmock.action.LIST and request.resource:
            status = {"kind": "Status", "status": "Failure", "reason": "ServiceUnavailable"}
            return aiohttp.web.json_response(status | {"code": 503}, status=503)
        return await super()._handle(request)


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": RefusingApiServer}


@contextlib.asynccontextmanager
async def running(
    api: kmock.KubernetesEmulator, **overrides: Any
) -> AsyncIterator[tuple[Controller, int]]:
    """The operator with its health endpoint; health runs on the loop's fake clock."""
    info = kopf.ConnectionInfo(server=str(api.url).rstrip("/"))
    clock = asyncio.get_running_loop().time
    controller = Controller(settings(**overrides), connection=info, clock=clock, monotonic=clock)
    server = HealthServer(controller.health, port=0, host="127.0.0.1")
    server.start()
    stop = asyncio.Event()
    task = asyncio.create_task(run_operator(controller, stop_flag=stop))
    try:
        yield controller, server.port
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
        server.stop()
    assert task.exception() is None


def live(port: int) -> int:
    return get(port, "/healthz")[0]


def ready(port: int) -> int:
    return get(port, "/readyz")[0]


@pytest.mark.looptime
async def test_steps_that_keep_raising_fail_liveness_and_recovery_restores_it(
    kmock: RefusingApiServer,
) -> None:
    declare(kmock)
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mig", **A100}))
    async with running(kmock, liveness_failed_steps=5) as (controller, port):
        await eventually(lambda: controller.last_cycle is not None, within=30, step=0.1)
        assert (ready(port), live(port)) == (200, 200)

        real_step = controller.step
        calls = 0

        async def broken(now: float | None = None) -> Decision:
            nonlocal calls
            calls += 1
            raise RuntimeError(f"step bug #{calls}")

        controller.step = broken  # type: ignore[method-assign]
        await eventually(lambda: calls >= 4, within=10, step=0.1)
        assert live(port) == 200  # 4 failed steps in a row: below the limit of 5
        await eventually(lambda: live(port) == 503, within=3, step=0.1)
        code, body = get(port, "/healthz")
        assert code == 503 and isinstance(body, dict)
        assert body["reason"].startswith("the last ")
        assert "decision steps failed (limit 5): RuntimeError: step bug #" in body["reason"]
        assert ready(port) == 200

        controller.step = real_step  # type: ignore[method-assign]
        await eventually(lambda: live(port) == 200, within=3, step=0.1)
        code, body = get(port, "/healthz")
        assert isinstance(body, dict) and body["failed_steps"] == 0


@pytest.mark.looptime
async def test_a_hung_step_fails_liveness_after_the_stale_limit(kmock: RefusingApiServer) -> None:
    declare(kmock)
    async with running(kmock, liveness_stale_seconds=30) as (controller, port):
        await eventually(lambda: controller.last_cycle is not None, within=30, step=0.1)
        real_step = controller.step
        release = asyncio.Event()

        async def hung(now: float | None = None) -> Decision:
            await release.wait()  # e.g. an API call that never answers
            return await real_step(now)

        controller.step = hung  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        hung_at = loop.time()
        await eventually(lambda: live(port) == 503, within=40, step=0.5)
        assert 30 <= loop.time() - hung_at <= 30 + 1 + 0.5  # the limit, a cycle, a poll step
        body = get(port, "/healthz")[1]
        assert isinstance(body, dict)
        assert body["reason"].startswith("no decision step completed for")

        controller.step = real_step  # type: ignore[method-assign]
        release.set()
        await eventually(lambda: live(port) == 200, within=3, step=0.1)


@pytest.mark.looptime
async def test_not_ready_until_the_initial_listing_completes(kmock: RefusingApiServer) -> None:
    declare(kmock)
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mig", **A100}))
    kmock.refuse_lists = True  # for less than kopf's own retries of its watch lists (54 s)
    async with running(kmock, liveness_stale_seconds=10) as (controller, port):
        await asyncio.sleep(5)  # the listing is refused and retried every cycle
        assert controller.last_cycle is None
        assert (ready(port), live(port)) == (503, 200)
        body = get(port, "/readyz")[1]
        assert isinstance(body, dict) and not body["synced"]
        await asyncio.sleep(6)  # no step for longer than the stale limit: restart me
        code, body = get(port, "/healthz")
        assert code == 503 and isinstance(body, dict)
        assert body["reason"].startswith("no decision step yet for")

        kmock.refuse_lists = False
        # the listing is retried with exponential backoff (1 s doubling, jittered, 30 s cap):
        # after 11 s of refusals the next attempt may be up to 16 s away (fake loop time)
        await eventually(lambda: ready(port) == 200, within=31, step=0.1)
        await eventually(lambda: live(port) == 200, within=5, step=0.1)
        assert "n1" in controller.index.nodes


@pytest.mark.looptime
async def test_the_running_operator_reclaims_its_heap_on_time_and_finds_few_frozen_cycles(
    kmock: RefusingApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """kopf, the HTTP client and asyncio do make reference cycles among objects the heap
    policy froze (partitioner.heap): the reclaim every ``heap_reclaim_seconds`` frees them.
    With pods coming and going (10 every 15 s) it found 14-42 objects per minute in a
    five-minute probe; a leak that grew with the pods would show here by thousands."""
    declare(kmock)
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mig", **A100}))
    caplog.set_level(logging.INFO, logger="partitioner.heap")
    async with running(kmock, heap_reclaim_seconds=30) as (controller, port):
        await eventually(lambda: ready(port) == 200, within=10, step=0.1)
        for r in range(8):
            for i in range(10):
                body = pod(f"p{r}-{i}", "nvidia.com/mig-1g.10gb")
                await create(kmock, "/api/v1/namespaces/default/pods", body)
            await asyncio.sleep(5)
            for i in range(10):
                await kmock.delete(f"/api/v1/namespaces/default/pods/p{r}-{i}")
            await asyncio.sleep(10)
        last = controller.heap.last_reclaim
        registry = controller.metrics.registry
        counted = registry.get_sample_value("gpuslice_heap_frozen_cycles_total")
        paused = registry.get_sample_value("gpuslice_heap_reclaim_seconds")
    found = [r.getMessage() for r in caplog.records if r.name == "partitioner.heap"]
    assert 3 <= len(found) <= 5  # 120 s of loop time, one every 30 s
    freed = [int(m.split()[2]) for m in found]  # "heap reclaim: N objects in cycles among ..."
    assert all("objects in cycles among frozen objects freed" in m for m in found)
    assert last is not None and 0 <= last.unreachable < 2000 and last.frozen > 0
    assert counted == sum(freed) and paused == last.seconds > 0


@pytest.mark.looptime
async def test_the_heap_is_frozen_after_the_initial_listing_and_settled_after_every_cycle(
    kmock: RefusingApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its initial listing the controller moves its long-lived objects out of the cyclic
    collector's reach (partitioner.heap.HeapKeeper.start), once, not before it has synced;
    after every cycle it settles the heap (refreeze, or the periodic reclaim)."""
    declare(kmock)
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mig", **A100}))
    calls: list[tuple[str, bool]] = []
    box: dict[str, Controller] = {}
    monkeypatch.setattr(
        HeapKeeper, "start", lambda self: calls.append(("start", "n1" in box["c"].index.nodes))
    )
    monkeypatch.setattr(
        HeapKeeper, "settle", lambda self: calls.append(("settle", box["c"].last_cycle is not None))
    )
    async with running(kmock) as (controller, port):
        box["c"] = controller
        await eventually(lambda: ready(port) == 200, within=10, step=0.1)
        await asyncio.sleep(3)  # several cycles
        assert controller.heap.reclaim_s == controller.settings.heap_reclaim_seconds
    assert calls[0] == ("start", True)
    settles = calls[1:]
    assert len(settles) >= 3 and all(c == ("settle", True) for c in settles)
