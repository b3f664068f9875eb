"""The partitioner's waiting and failure metrics (partitioner/metrics.py), which the dashboard's
"Reservations and waiting pods" row and the alerts read.

First :meth:`Metrics.observe_waiting` on its own, then the real kopf operator against kmock in
looptime's fake time: a gated pod's reservation moving planned -> released -> bound, a planner
that raises, and decision steps that raise.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kopf
import pytest
from fake_apiserver import NP_RESOURCE, ApiServer, bind_like_scheduler, declare, stored
from prometheus_client import CollectorRegistry
from test_operator_gates import (
    PODS,
    SEVEN_G,
    agent_applies,
    gating_operator,
    get_pod,
    kubelet_advertises,
    reservation,
    setup,
)
from test_operator_gates import pod as gated_pod
from test_partitioner_operator import A100, create, eventually, node, pod, settings

from partitioner.decide import Decision
from partitioner.metrics import RESERVATION_STATES, Metrics
from partitioner.operator import Controller, run_operator
from partitioner.reservations import State


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels or None)


def reservations(m: Metrics) -> dict[str, float | None]:
    return {s: value(m, "gpuslice_reservations", state=s) for s in RESERVATION_STATES}


# -- observe_waiting ---------------------------------------------------------------------------


def test_observe_waiting_sets_the_gauges_from_one_step() -> None:
    m = Metrics(CollectorRegistry())
    assert reservations(m) == {"planned": 0, "released": 0, "draining": 0}  # series from start
    assert value(m, "gpuslice_oldest_pending_pod_seconds") == 0
    counts = {"waiting": 3, "held": 2, "released": 1, "draining": 1, "stranded": 1}
    m.observe_waiting(counts, [1000.0, None, 400.0], ["UnknownGpuModel"] * 2, now=1300.0)
    assert value(m, "gpuslice_pending_pods") == 3
    assert value(m, "gpuslice_oldest_pending_pod_seconds") == 900  # the oldest known pod
    assert reservations(m) == {"planned": 2, "released": 1, "draining": 1}
    assert value(m, "gpuslice_pods_stranded") == 1
    assert value(m, "gpuslice_nodes_left_out", reason="UnknownGpuModel") == 2

    m.observe_waiting({"waiting": 0}, [], ["GpuCountUnknown"], now=1400.0)
    assert value(m, "gpuslice_pending_pods") == 0
    assert value(m, "gpuslice_oldest_pending_pod_seconds") == 0
    assert reservations(m) == {"planned": 0, "released": 0, "draining": 0}
    assert value(m, "gpuslice_nodes_left_out", reason="UnknownGpuModel") is None  # gone
    assert value(m, "gpuslice_nodes_left_out", reason="GpuCountUnknown") == 1


def test_a_pod_created_after_the_step_clock_is_not_a_negative_age() -> None:
    m = Metrics(CollectorRegistry())
    m.observe_waiting({"waiting": 1}, [2000.0], [], now=1990.0)
    assert value(m, "gpuslice_oldest_pending_pod_seconds") == 0


# -- the operator ------------------------------------------------------------------------------


@pytest.mark.looptime
async def test_reservation_gauges_follow_a_gated_pod_from_planned_to_bound(
    kmock: ApiServer, tmp_path: Path
) -> None:
    await setup(kmock, "n1")
    async with gating_operator(kmock, tmp_path) as controller:
        m = controller.metrics
        await eventually(lambda: stored(kmock, NP_RESOURCE, "n1"), within=10)
        body = gated_pod("p1")
        body["metadata"]["creationTimestamp"] = "1970-01-01T00:00:00Z"  # the fake clock's zero
        resp = await kmock.post(PODS, json=body)
        assert resp.status in (200, 201), await resp.text()
        r = await eventually(lambda: reservation(kmock, "p1"), within=40)
        assert r.state is State.PLANNED
        await eventually(lambda: reservations(m)["planned"] == 1, within=5)
        assert value(m, "gpuslice_pending_pods") == 1
        loop_now = asyncio.get_running_loop().time()
        oldest = value(m, "gpuslice_oldest_pending_pod_seconds")
        assert oldest is not None and 0 < oldest <= loop_now

        await agent_applies(kmock, r.node)
        await kubelet_advertises(kmock, r.node, {SEVEN_G: 1})
        await eventually(lambda: not get_pod(kmock, "p1")["spec"].get("schedulingGates"), 10)
        await eventually(lambda: reservations(m)["released"] == 1, within=5)
        assert reservations(m)["planned"] == 0

        await bind_like_scheduler(kmock, "default", "p1", r.node)
        await eventually(lambda: reservations(m)["released"] == 0, within=10)
        assert value(m, "gpuslice_pending_pods") == 0
        assert value(m, "gpuslice_oldest_pending_pod_seconds") == 0


def boom(*_: Any) -> Any:
    raise RuntimeError("solver exploded")


@contextlib.asynccontextmanager
async def running(controller: Controller) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(run_operator(controller, stop_flag=stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


@pytest.mark.looptime
async def test_planner_errors_are_counted_and_logged_with_the_plan(
    kmock: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    declare(kmock)
    await create(kmock, "/api/v1/nodes", node("n1", {"gpuslice.io/partitioning": "mig", **A100}))
    await create(kmock, "/api/v1/namespaces/default/pods", pod("p1", "nvidia.com/mig-1g.10gb"))
    info = kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"))
    loop = asyncio.get_running_loop()
    controller = Controller(settings(), planner=boom, connection=info, clock=loop.time)
    errors = "gpuslice_planner_errors_total"
    with caplog.at_level("ERROR", logger="gpuslice.partitioner"):
        async with running(controller):
            await eventually(lambda: (value(controller.metrics, errors) or 0) >= 1, within=60)
    logged = [r for r in caplog.records if r.name == "gpuslice.partitioner"]
    assert logged and "solver exploded" in logged[0].getMessage()
    assert getattr(logged[0], "plan", None)  # the failed plan's id, as a log field
    assert value(controller.metrics, "gpuslice_step_failures_total") == 0  # the step completed


class RaisingController(Controller):
    """Its first ``failures`` steps raise."""

    failures = 2

    async def step(self, now: float | None = None) -> Decision:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("step broke")
        return await super().step(now)


@pytest.mark.looptime
async def test_decision_steps_that_raise_are_counted(kmock: ApiServer) -> None:
    declare(kmock)
    info = kopf.ConnectionInfo(server=str(kmock.url).rstrip("/"))
    loop = asyncio.get_running_loop()
    controller = RaisingController(settings(), connection=info, clock=loop.time)
    async with running(controller):
        await eventually(lambda: controller.last_cycle is not None, within=30)
    assert value(controller.metrics, "gpuslice_step_failures_total") == 2
    assert value(controller.metrics, "gpuslice_planner_errors_total") == 0
