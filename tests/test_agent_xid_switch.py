"""The switch that turns the XID watch off, and the one walk of a GPU's device ids.

``xid_watch`` (``GPUSLICE_XID_WATCH``, chart ``agent.xidWatch``, default true): false starts no
watcher thread in either agent mode -- for a driver whose NVML event sets misbehave, as NVIDIA's
device plugin offers ``DP_DISABLE_HEALTHCHECKS``.  Checked: the setting and its environment
variable, the chart rendering it for both agents' DaemonSets (and the DRA agent now getting
``agent.xidIgnore`` too) and its schema refusing a non-boolean, and in both agents' loops that a
watcher switched off never runs, registers no GPU (an XID then reaches nobody: the fake NVML
drops events of unregistered GPUs) and says so once in the log, while one switched on does.

Also: :func:`node_agent.xid.device_ids` is the one walk of a GPU's device ids, used by the XID
marks and by the reconciler's lost GPUs (before, each had its own copy).
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from fake_apiserver import ApiServer
from fake_kubelet import eventually

from contract.nodepartitioning import ActualGpu, ActualMigInstance, ActualMpsSlice
from node_agent import reconciler, xid
from node_agent.nvml_fake import FakeNvml
from node_agent.settings import AgentSettings
from node_agent.xid import XidLedger, XidMark, XidWatcher, device_ids, unhealthy_ids
from tests.test_agent_dra_shaped import (
    H100,
    kmock_options,  # noqa: F401  (the fixture: kmock serves tests/fake_apiserver.ApiServer)
    setup,
)
from tests.test_agent_dra_xid import looping
from tests.test_agent_mps_liveness import agent_running, settled
from tests.test_agent_xid import XidNode, loop_of
from tests.test_chart import apply_env, chart, container, gpuslice_env, render  # noqa: F401
from tests.test_chart_dra import DRA, dra_agent

OFF_SAYS = "XID errors are not watched (GPUSLICE_XID_WATCH=false)"


class Spy:
    """Wraps a watcher's ``run`` to record whether (and on which thread) it ran."""

    def __init__(self, watcher: XidWatcher) -> None:
        self.threads: list[str] = []
        run = watcher.run

        def spied(stop: threading.Event, report: Any) -> None:
            self.threads.append(threading.current_thread().name)
            run(stop, report)

        watcher.run = spied  # type: ignore[method-assign]


# -- the setting and the chart -------------------------------------------------------------------


def test_the_setting_defaults_to_on_and_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    apply_env(monkeypatch, {})
    assert AgentSettings().xid_watch is True  # type: ignore[call-arg]
    monkeypatch.setenv("GPUSLICE_XID_WATCH", "false")
    assert AgentSettings().xid_watch is False  # type: ignore[call-arg]
    monkeypatch.setenv("GPUSLICE_XID_WATCH", "sometimes")
    with pytest.raises(ValueError, match="xid_watch"):
        AgentSettings()  # type: ignore[call-arg]


@pytest.mark.parametrize("dra", [False, True], ids=["device-plugin agent", "DRA agent"])
def test_the_chart_renders_the_switch_for_both_agents_and_the_schema_checks_it(
    chart: helm.Chart,  # noqa: F811 (the chart fixture of tests/test_chart.py)
    monkeypatch: pytest.MonkeyPatch,
    dra: bool,
) -> None:
    def env(values: dict[str, Any]) -> dict[str, str]:
        if dra:
            (c,) = dra_agent(render(chart, {**DRA, **values}))["spec"]["template"]["spec"][
                "containers"
            ]
            return gpuslice_env(c)
        return gpuslice_env(container(render(chart, values), "DaemonSet"))

    assert env({})["GPUSLICE_XID_WATCH"] == "true"
    off = env({"agent": {"xidWatch": False, "xidIgnore": "94"}})
    assert off["GPUSLICE_XID_WATCH"] == "false" and off["GPUSLICE_XID_IGNORE"] == "94"
    apply_env(monkeypatch, {**off, "GPUSLICE_NODE_NAME": "n1"})
    settings = AgentSettings()  # type: ignore[call-arg]
    assert settings.xid_watch is False and settings.xid_ignore == [94]
    with pytest.raises(helm.HelmValuesError, match="/agent/xidWatch"):
        chart.validate_schema(chart.merge_values({"agent": {"xidWatch": "no"}}))


# -- the device-plugin agent -----------------------------------------------------------------------


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
async def test_the_device_plugin_agent_starts_no_watcher_when_switched_off(
    caplog: pytest.LogCaptureFixture, on: bool
) -> None:
    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB")
    node.watcher.enabled = on
    spy = Spy(node.watcher)
    agent, _, _ = loop_of(node)
    caplog.set_level(logging.INFO, logger="gpuslice")
    async with agent_running(agent):
        await settled(agent)
        assert node.nv.emit_xid(0, 48) is on  # registered only by a running watcher
        assert bool(spy.threads) is on
        if on:
            await eventually(lambda: not all(node.health().values()), timeout=1.0, what="hit")
        else:
            passes = agent.passes
            assert all(node.health().values()) and agent.passes == passes
    assert (OFF_SAYS in caplog.text) is not on
    assert node.watcher.watched == ((0, 1) if on else ())


# -- the DRA agent ---------------------------------------------------------------------------------


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
async def test_the_dra_agent_starts_no_watcher_when_switched_off(
    kmock: ApiServer,
    connect: Callable[[str], Any],
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    on: bool,
) -> None:
    nv = FakeNvml([H100])
    watcher = XidWatcher(nv, XidLedger(), wait_ms=20, enabled=on)
    spy = Spy(watcher)
    caplog.set_level(logging.INFO, logger="gpuslice")
    with tempfile.TemporaryDirectory(prefix="gsxsw-", dir="/tmp") as tmp:
        driver = setup(kmock, connect, nv, tmp, xids=watcher, spec_poll_s=3600)
        driver.resync_s = 3600
        async with looping(driver):
            assert nv.emit_xid(0, 48) is on
            assert bool(spy.threads) is on
            if on:
                await eventually(lambda: bool(driver.preparer.xid_marks), timeout=1.0, what="mark")
            else:
                assert driver.preparer.xid_marks == () and watcher.ledger.take() == []
    assert (OFF_SAYS in caplog.text) is not on


# -- one walk of a GPU's device ids ----------------------------------------------------------------


def _hybrid_gpu() -> ActualGpu:
    """A hybrid GPU: one MIG instance advertised itself, one hosting two MPS slices."""
    return ActualGpu(
        index=0,
        uuid="GPU-0",
        mig=[
            ActualMigInstance(profile="3g.40gb", start=0, deviceId="MIG-a"),
            ActualMigInstance(
                profile="4g.40gb",
                start=4,
                deviceId="MIG-b",
                mps=[
                    ActualMpsSlice(memoryMiB=10240, activeThreadPercentage=50, deviceId="s1"),
                    ActualMpsSlice(memoryMiB=10240, activeThreadPercentage=50, deviceId="s2"),
                ],
            ),
        ],
        mps=[ActualMpsSlice(memoryMiB=1024, activeThreadPercentage=10, deviceId="g1")],
    )


def test_one_walk_of_a_gpus_device_ids_serves_xid_marks_and_lost_gpus() -> None:
    g = _hybrid_gpu()
    assert device_ids(g) == {"MIG-a", "MIG-b", "s1", "s2", "g1"}
    assert device_ids(g, {"MIG-b"}) == {"MIG-b", "s1", "s2"}
    assert device_ids(g, set()) == set()
    assert reconciler.device_ids is xid.device_ids  # the reconciler imports the one walk
    assert reconciler._device_ids([g]) == device_ids(g)
    whole = XidMark(0, 48, "GPU-0")
    one = XidMark(0, 48, "GPU-0", device="MIG-b")
    assert unhealthy_ids([whole], [g]) == device_ids(g)
    assert unhealthy_ids([one], [g]) == {"MIG-b", "s1", "s2"}
