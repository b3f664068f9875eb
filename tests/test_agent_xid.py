"""NVML XID critical errors mark the devices they hit Unhealthy, within a second, for good.

The node is the fake one of ``tests/test_agent_lost_gpu.py`` (two GPUs, a kubelet that keeps
the last device list published); :meth:`~node_agent.nvml_fake.FakeNvml.emit_xid` plays the
driver reporting an XID.  The agent loop runs with a resync far beyond the test, so a publish
within a test was woken by the XID watcher.

Before the watcher existed, a GPU hit by a double-bit ECC error (XID 48), a fallen-off-the-bus
GPU (XID 79, until NVML reads fail) or a row-remap failure (XID 64) stayed advertised Healthy:
the agent had no XID event API at all.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import helm_python as helm
import pynvml
import pytest
from prometheus_client import CollectorRegistry

from contract.nodepartitioning import NodePartitioningStatus
from node_agent.agent import Agent, InMemorySpecSource
from node_agent.metrics import AgentMetrics, MeteredNvml
from node_agent.nvml import NvmlError, NvmlErrorCode, XidEvent
from node_agent.reconciler import Reconciler
from node_agent.settings import AgentSettings
from node_agent.xid import APPLICATION_XIDS, XidLedger, XidWatcher
from tests.fake_kubelet import eventually
from tests.test_agent_lost_gpu import CAT, MUTATING, OLD, Node, ids_on, spec
from tests.test_agent_mps_liveness import agent_running, settled
from tests.test_agent_pynvml import FakePynvml, make
from tests.test_chart import apply_env, chart, container, gpuslice_env, render  # noqa: F401

RESYNC = 60.0
"""Far beyond any test here: a pass within a test was woken by something else."""
WAIT_MS = 20
"""The watcher's NVML wait in the tests (how soon it sees ``stop``)."""
XID_METRIC = "gpuslice_agent_xid_errors_total"
SPEC = spec("mig", {0: OLD, 1: OLD})


class XidNode(Node):
    """Two MIG GPUs whose reconciler reads the XID ledger the watcher writes."""

    def __init__(self, *models: str, mig: bool = True, ignore: tuple[int, ...] = ()) -> None:
        super().__init__(*models, mig=mig)
        self.ledger = XidLedger()
        self.agent = Reconciler(
            self.nv,
            self.pods,
            self.sup,
            CAT,
            mps_pipe_root="/run/mps",
            publish=self.publish,
            xids=self.ledger,
        )
        self.watcher = XidWatcher(self.nv, self.ledger, ignore=ignore, wait_ms=WAIT_MS)

    def gi_at(self, gpu: int, start: int) -> tuple[int, str]:
        """GI id and MIG UUID of the instance at memory slot ``start`` of ``gpu``."""
        gi, _, _, uuids = next(t for t in self.nv.instances(gpu) if t[2] == start)
        return gi, uuids[0]

    def health(self) -> dict[str, bool]:
        return {d: a.healthy for d, a in self.kubelet().items()}


def loop_of(node: XidNode) -> tuple[Agent, InMemorySpecSource, AgentMetrics]:
    metrics = AgentMetrics(CollectorRegistry())
    source = InMemorySpecSource("gpu-node-1", SPEC)
    agent = Agent(
        node.agent,
        source,
        resync_seconds=RESYNC,
        retry_seconds=0.05,
        metrics=metrics,
        mps_liveness_seconds=0,
        xids=node.watcher,
    )
    return agent, source, metrics


def xid_count(metrics: AgentMetrics, gpu: str, xid: int) -> float:
    return metrics.registry.get_sample_value(XID_METRIC, {"gpu": gpu, "xid": str(xid)}) or 0.0


def degraded(status: NodePartitioningStatus | None) -> tuple[str, str, str]:
    assert status is not None
    c = next(c for c in status.conditions if c.type == "Degraded")
    return c.status, c.reason, c.message


async def test_a_critical_xid_on_a_mig_instance_marks_only_it_unhealthy_within_a_second(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB")
    agent, source, metrics = loop_of(node)
    caplog.set_level(logging.INFO, logger="gpuslice")
    async with agent_running(agent):
        await settled(agent)
        assert all(node.health().values()) and len(node.health()) == 4
        gi, hit = node.gi_at(0, 4)
        passes = agent.passes

        t0 = time.monotonic()
        assert node.nv.emit_xid(0, 48, gi=gi, ci=0)  # a double-bit ECC error on that instance
        await eventually(lambda: not node.health()[hit], timeout=1.0, what="Unhealthy")
        assert time.monotonic() - t0 < 1.0 < RESYNC  # woken by the XID, not by the resync
        assert agent.passes > passes

        others = {d: h for d, h in node.health().items() if d != hit}
        assert len(others) == 3 and all(others.values())  # GPU 1 and GPU 0's other instance
        await eventually(
            lambda: degraded(source.obj.status if source.obj else None)[0] == "True",
            timeout=1.0,
            what="the status",
        )
        _, reason, message = degraded(source.obj.status if source.obj else None)
        assert reason == "GpuXid"
        assert "GPU 0" in message and "XID 48" in message and hit in message
        assert "GPU 1" not in message
        assert xid_count(metrics, "0", 48) == 1
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "XID 48" in warned[0].getMessage()
        assert f"GPU instance {gi}" in warned[0].getMessage()


async def test_an_xid_not_scoped_to_an_instance_marks_every_device_of_its_gpu() -> None:
    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB")
    agent, _, metrics = loop_of(node)
    async with agent_running(agent):
        await settled(agent)
        gpu1 = {node.gi_at(1, 0)[1], node.gi_at(1, 4)[1]}
        node.nv.emit_xid(1, 79)  # fallen off the bus: the driver names no instance
        await eventually(
            lambda: not any(node.health()[d] for d in gpu1), timeout=1.0, what="GPU 1 Unhealthy"
        )
        assert all(h for d, h in node.health().items() if d not in gpu1)
        assert xid_count(metrics, "1", 79) == 1


async def test_application_xids_change_nothing(caplog: pytest.LogCaptureFixture) -> None:
    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB")
    agent, source, metrics = loop_of(node)
    caplog.set_level(logging.INFO, logger="gpuslice")
    async with agent_running(agent):
        await settled(agent)
        passes, published = agent.passes, len(node.published)
        gi, _ = node.gi_at(0, 0)
        for code in (13, 31, 43, 45, 68, 109):
            node.nv.emit_xid(0, code, gi=gi, ci=0)
        await eventually(
            lambda: xid_count(metrics, "0", 109) == 1, timeout=1.0, what="the events counted"
        )
        await asyncio.sleep(0.2)
        assert agent.passes == passes and len(node.published) == published  # no pass woken
        assert all(node.health().values())
        assert degraded(source.obj.status if source.obj else None)[0] == "False"
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert frozenset({13, 31, 43, 45, 68, 109}) == APPLICATION_XIDS  # NVIDIA's plugin's list


def test_the_setting_adds_ignored_xids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSLICE_XID_IGNORE", " 48, 94 ")
    settings = AgentSettings()  # type: ignore[call-arg]
    assert settings.xid_ignore == [48, 94]
    monkeypatch.setenv("GPUSLICE_XID_IGNORE", "")
    assert AgentSettings().xid_ignore == []  # type: ignore[call-arg]
    monkeypatch.setenv("GPUSLICE_XID_IGNORE", "48,ecc")
    with pytest.raises(ValueError):
        AgentSettings()  # type: ignore[call-arg]

    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB", ignore=tuple(settings.xid_ignore))
    node.run(SPEC)
    node.watcher.start()
    gi, hit = node.gi_at(0, 0)
    node.nv.emit_xid(0, 48, gi=gi, ci=0)
    node.nv.emit_xid(1, 94)
    node.nv.emit_xid(1, 13)  # still ignored: the setting adds to the defaults
    assert [e.xid for e in node.watcher.poll()] == [48, 94, 13]
    node.run(SPEC)
    assert all(node.health().values())
    node.nv.emit_xid(0, 64, gi=gi, ci=0)  # a row-remap failure is not ignored
    node.watcher.poll()
    node.run(SPEC)
    assert not node.health()[hit]


def test_the_chart_value_reaches_the_setting_and_the_schema_checks_it(
    chart: helm.Chart,  # noqa: F811 (the chart fixture of tests/test_chart.py)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = gpuslice_env(container(render(chart, {"agent": {"xidIgnore": "48, 94"}}), "DaemonSet"))
    assert env["GPUSLICE_XID_IGNORE"] == "48, 94"
    apply_env(monkeypatch, {**env, "GPUSLICE_NODE_NAME": "n1"})
    assert AgentSettings().xid_ignore == [48, 94]  # type: ignore[call-arg]
    with pytest.raises(helm.HelmValuesError, match="/agent/xidIgnore"):
        chart.validate_schema(chart.merge_values({"agent": {"xidIgnore": "48,ecc"}}))


def test_unhealthy_persists_across_passes_and_nothing_is_created_or_destroyed() -> None:
    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB")
    assert node.run(SPEC).applied
    node.watcher.start()
    gi, hit = node.gi_at(0, 4)
    node.pods.ids = {hit}  # a pod holds the instance the XID hit: it keeps it
    node.nv.emit_xid(0, 48, gi=gi, ci=0)
    node.nv.emit_xid(1, 79)
    node.watcher.poll()
    node.calls.clear()
    before = (node.layout(0), node.layout(1), node.nv.instances(0), node.nv.instances(1))
    for _ in range(4):
        res = node.run(SPEC)
        health = node.health()
        assert not health[hit] and health[node.gi_at(0, 0)[1]]
        assert not any(health[d] for d in ids_on(res, 1))
        assert res.degraded and res.blocks[0].reason == "GpuXid" and 1 in res.blocks
        assert "XID 79" in res.blocks[1].message and "restart" in res.blocks[1].message
    assert not [c for c in node.calls if c[0] in MUTATING]
    after = (node.layout(0), node.layout(1), node.nv.instances(0), node.nv.instances(1))
    assert after == before
    assert res.settled  # a permanent block: no retry loop


def test_xid_79_then_the_lost_gpu_stays_unhealthy_and_names_both() -> None:
    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB")
    node.run(SPEC)
    node.watcher.start()
    node.nv.emit_xid(1, 79)
    node.watcher.poll()
    node.lose(1)  # the next reads of GPU 1 fail: GPU_IS_LOST
    res = node.run(SPEC)
    assert not any(node.health()[d] for d in ids_on(res, 1))
    assert res.blocks[1].reason == "GpuUnreadable" and "XID 79" in res.blocks[1].message
    node.lost.clear()  # reads again (a reset) -- the XID mark stays until the agent restarts
    res = node.run(SPEC)
    assert res.blocks[1].reason == "GpuXid"
    assert not any(node.health()[d] for d in ids_on(res, 1))


def test_an_unknown_instance_marks_its_gpu_and_an_unknown_gpu_marks_every_gpu() -> None:
    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB")
    node.run(SPEC)
    node.ledger.add(XidEvent(0, 48, gi_id=13, ci_id=0))  # no such GPU instance (any more)
    res = node.run(SPEC)
    assert not any(node.health()[d] for d in ids_on(res, 0))
    assert all(node.health()[d] for d in ids_on(res, 1))
    assert "the whole GPU" in res.blocks[0].message
    node.ledger.add(XidEvent(None, 48))  # NVML could not say which GPU: all of them
    node.run(SPEC)
    assert not any(node.health().values())
    assert {m.gpu for m in node.agent.xid_marks} == {0, 1}


def test_an_mps_gpu_hit_by_an_xid_advertises_its_slices_unhealthy() -> None:
    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB", mig=False)
    mps = spec("mps", {0: [(20480, 50), (20480, 50)], 1: [(40960, 100)]})
    res = node.run(mps)
    assert res.applied
    node.watcher.start()
    node.nv.emit_xid(0, 48)
    node.watcher.poll()
    res = node.run(mps)
    health = node.health()
    assert not any(health[d] for d in ids_on(res, 0)) and len(ids_on(res, 0)) == 2
    assert all(health[d] for d in ids_on(res, 1))
    assert node.sup.running() == {"gpu0", "gpu1"}  # its daemon is left alone


def test_the_fake_reports_events_only_for_registered_gpus() -> None:
    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB", "V100-32GB")
    assert not node.nv.emit_xid(0, 48)  # nothing registered yet: the driver delivers nothing
    node.nv.xid_unsupported.add(2)
    reg = node.nv.watch_xids()
    assert reg.registered == (0, 1) and reg.unsupported == (2,)
    assert not node.nv.emit_xid(2, 48)
    assert node.nv.xid_events(0) == []
    assert node.nv.emit_xid(1, 48, gi=3, ci=0)
    assert node.nv.xid_events(0) == [XidEvent(1, 48, 3, 0)]
    t0 = time.monotonic()
    assert node.nv.xid_events(50) == []  # waits out its timeout
    assert time.monotonic() - t0 >= 0.04
    threading.Timer(0.05, node.nv.emit_xid, (0, 79)).start()
    assert node.nv.xid_events(2000) == [XidEvent(0, 79)]  # returns as soon as one comes


def test_a_gpu_that_cannot_report_xids_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB")
    node.nv.xid_unsupported.add(1)
    caplog.set_level(logging.INFO, logger="gpuslice")
    assert node.watcher.start()
    for _ in range(3):
        node.watcher.poll()
    said = [r.getMessage() for r in caplog.records if "GPU 1" in r.getMessage()]
    assert len(said) == 1 and "cannot report XID" in said[0]


# ---------------------------------------------------------------- the pynvml adapter


class EventPynvml(FakePynvml):
    """The fake pynvml with NVML's event API: ``waits`` scripts what each wait answers (an
    ``NVMLError`` code to raise, or ``(gpu, xid, gi, ci)`` of an event)."""

    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    nvmlEventTypeDoubleBitEccError = pynvml.nvmlEventTypeDoubleBitEccError

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.unsupported: set[int] = set()
        self.lost: set[int] = set()
        self.sets: list[str] = []
        self.registered: dict[int, tuple[int, str]] = {}
        self.waits: list[int | tuple[int, int, int, int]] = []
        self.timeouts: list[int] = []

    def nvmlEventSetCreate(self) -> str:
        name = f"set{len(self.sets)}"
        self.sets.append(name)
        self.log.append(f"create {name}")
        return name

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.log.append(f"free {event_set}")

    def nvmlDeviceRegisterEvents(self, h: Any, types: int, event_set: str) -> None:
        if h[1] in self.unsupported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if h[1] in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        self.registered[h[1]] = (types, event_set)

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        assert event_set == self.sets[-1], "waiting on a freed event set"
        self.timeouts.append(timeout_ms)
        what = self.waits.pop(0) if self.waits else pynvml.NVML_ERROR_TIMEOUT
        if isinstance(what, int):
            raise pynvml.NVMLError(what)
        gpu, xid, gi, ci = what
        data = pynvml.c_nvmlEventData_t()
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = xid
        data.gpuInstanceId = gi
        data.computeInstanceId = ci
        return _Event(("gpu", gpu), data)


class _Event:
    """An ``nvmlEventData_t`` whose ``device`` is the fake module's handle tuple."""

    def __init__(self, device: Any, data: Any) -> None:
        self.device = device
        self.eventType = data.eventType
        self.eventData = data.eventData
        self.gpuInstanceId = data.gpuInstanceId
        self.computeInstanceId = data.computeInstanceId


def event_adapter(*models: str) -> tuple[EventPynvml, Any]:
    nv, _, _ = make(*models)
    mod = EventPynvml(nv)
    from node_agent.gpu_reset import NvidiaSmi
    from node_agent.nvml_pynvml import PynvmlAdapter

    return mod, PynvmlAdapter(mod, NvidiaSmi(nv.nvidia_smi))  # type: ignore[arg-type]


NOT_SCOPED = 0xFFFFFFFF


def test_an_event_set_nvml_declares_undefined_is_made_again_without_that_gpu() -> None:
    """nvml.h, nvmlDeviceRegisterEvents: after UNKNOWN the "event set is in undefined state and
    should be freed".  The adapter listed the GPU failed and waited on that set for good; it
    frees it and registers the other GPUs in a new one (the GPU listed failed)."""
    mod, ad = event_adapter("A100-SXM4-80GB", "A100-SXM4-80GB", "A100-SXM4-80GB")
    register = mod.nvmlDeviceRegisterEvents

    def unknown_on_gpu1(h: Any, types: int, event_set: str) -> None:
        if h[1] == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        register(h, types, event_set)

    mod.nvmlDeviceRegisterEvents = unknown_on_gpu1  # type: ignore[method-assign]
    reg = ad.watch_xids()
    assert reg.registered == (0, 2) and [g for g, _ in reg.failed] == [1]
    assert mod.sets == ["set0", "set1"] and "free set0" in mod.log
    assert {g: s for g, (_, s) in mod.registered.items()} == {0: "set1", 2: "set1"}
    assert ad.xid_events(10) == []  # waits on the new set (the stub refuses a freed one)


def test_the_pynvml_adapter_registers_xid_critical_errors_and_skips_unsupported_gpus() -> None:
    mod, ad = event_adapter("A100-SXM4-80GB", "A100-SXM4-80GB", "V100-32GB")
    mod.unsupported.add(2)
    reg = ad.watch_xids()
    assert reg.registered == (0, 1) and reg.unsupported == (2,) and not reg.failed
    assert {g: t for g, (t, _) in mod.registered.items()} == {
        0: pynvml.nvmlEventTypeXidCriticalError,
        1: pynvml.nvmlEventTypeXidCriticalError,
    }
    mod.lost.add(1)
    reg = ad.watch_xids()  # again: a fresh event set; a lost GPU is reported, not raised
    assert reg.registered == (0,) and [g for g, _ in reg.failed] == [1]
    assert reg.failed[0][1].code == NvmlErrorCode.GPU_IS_LOST
    assert "free set0" in mod.log


def test_the_pynvml_adapter_event_wait_handles_timeout_scope_and_errors() -> None:
    mod, ad = event_adapter("A100-SXM4-80GB", "A100-SXM4-80GB")
    ad.watch_xids()
    mod.waits = [
        pynvml.NVML_ERROR_TIMEOUT,
        (1, 48, 2, 0),
        (0, 79, NOT_SCOPED, NOT_SCOPED),
        pynvml.NVML_ERROR_UNKNOWN,
    ]
    assert ad.xid_events(250) == []  # TIMEOUT: no event
    assert mod.timeouts == [250]
    assert ad.xid_events(250) == [XidEvent(1, 48, 2, 0)]
    assert ad.xid_events(250) == [XidEvent(0, 79, None, None)]
    with pytest.raises(NvmlError) as e:
        ad.xid_events(250)
    assert e.value.code == NvmlErrorCode.UNKNOWN


def test_the_pynvml_adapter_rebuilds_its_event_set_around_a_gpu_reset() -> None:
    mod, ad = event_adapter("A100-SXM4-80GB")
    with pytest.raises(NvmlError) as e:
        ad.xid_events(10)  # nothing watched yet
    assert e.value.code == NvmlErrorCode.UNINITIALIZED
    ad.watch_xids()
    ad.reset_gpu(0)  # NVML is shut down and initialised again around the reset
    log = mod.log
    assert log.index("free set0") < log.index("shutdown") < log.index("init", 1)
    mod.waits = [(0, 48, NOT_SCOPED, NOT_SCOPED)]
    assert ad.xid_events(10) == [XidEvent(0, 48)]
    assert mod.sets == ["set0", "set1"] and mod.registered[0][1] == "set1"
    ad.close()
    assert log.index("free set1") < len(log) - 1 and log[-1] == "shutdown"


def test_metered_nvml_passes_the_event_api_through() -> None:
    node = XidNode("A100-SXM4-80GB")
    metrics = AgentMetrics(CollectorRegistry())
    nv = MeteredNvml(node.nv, metrics)
    assert nv.watch_xids().registered == (0,)
    node.nv.emit_xid(0, 48)
    assert nv.xid_events(0) == [XidEvent(0, 48)]
