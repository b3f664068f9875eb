"""XID critical errors and GPUs unreadable at start in DRA mode (node_agent.dra_driver).

The DRA agent watches NVML's XID events as the device-plugin agent does
(``tests/test_agent_xid.py``); :meth:`~node_agent.nvml_fake.FakeNvml.emit_xid` plays the
driver.  Checked, against kmock (tests/fake_apiserver.py) and the fake NVML:

* a critical XID scoped to a MIG instance wakes a round at once (the resync is an hour), which
  withdraws the free placements sharing a memory slot with the instance hit (the whole GPU
  device included) and keeps the allocated ones and the rest of the node published; the status
  says ``Degraded``/``GpuXid`` naming the GPU, the instance and the XID and marks the placement
  ``unhealthy``; the event is counted and logged once at WARNING; an XID not scoped to an
  instance withdraws every free device of its GPU and marks the GPU ``unhealthy``;
* nothing is created or destroyed where an XID hit: a spec that drops the hit instance or
  plans over it changes nothing there, a whole-GPU mark blocks every change on the GPU;
* NodePrepareResources (over gRPC, the fake kubelet) answers a new claim on an unhealthy
  device with an error naming the GPU and the XID, prepares claims elsewhere, answers a claim
  prepared before the XID with its devices, and unprepare releases that claim but keeps its
  instance;
* application XIDs change nothing and wake no round; mode ``all`` never withdraws a hit device
  alone: where the API server keeps device taints every device stays published, the hit ones
  with the ``NoSchedule`` unusable taint (``xid``); where it drops them every free device of
  the hit GPU is withdrawn, the prepared ones kept;
* a GPU unreadable when the agent starts is reported ``Degraded``/``GpuUnreadable`` (and
  listed ``unhealthy``) instead of only logged, the spec's placements on it are not reported
  invalid, and once it reads it is published and reported like the others, without a restart.

Before this change the DRA agent had no XID watch (a double-bit ECC error left the GPU's free
devices published) and a GPU unreadable at start was only logged at ERROR, never published
until a restart.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import ApiServer
from fake_kubelet import eventually
from prometheus_client import CollectorRegistry

from node_agent.dra_driver import DraDriver
from node_agent.dra_slices import DRIVER, DraGpu
from node_agent.metrics import AgentMetrics
from node_agent.nvml import NvmlErrorCode, XidEvent
from node_agent.nvml_fake import FakeNvml
from node_agent.xid import XidLedger, XidWatcher
from tests import test_agent_draplugin
from tests.test_agent_dra_lost_gpu import Lost
from tests.test_agent_dra_shaped import (
    H100,
    CountingNvml,
    alloc,
    assert_mode_all_hides,
    kmock_options,  # noqa: F401  (the fixture: kmock serves tests/fake_apiserver.ApiServer)
    layout,
    np_of,
    p,
    patch_spec,
    published,
    put_claim,
    put_np,
    ref,
    round_ok,
    setup,
    spec,
    tainted,
)
from tests.test_agent_draplugin import Node, placement

dirs = test_agent_draplugin.dirs
node = test_agent_draplugin.node
"""The kubelet-plugin fixtures: a plugin on two H100s behind a fake kubelet (gRPC)."""

HOUR = 3600.0
"""The resync and spec poll of the looping tests: a round within a test was woken otherwise."""
XID_METRIC = "gpuslice_agent_xid_errors_total"
PLAN = {0: [("3g.40gb", 0), ("3g.40gb", 4)], 1: [("3g.40gb", 0), ("3g.40gb", 4)]}
"""Both GPUs planned as two 3g.40gb instances (memory slots 0-3 and 4-7)."""


def gi_at(nv: FakeNvml, gpu: int, start: int) -> int:
    """The GPU instance id of the instance at memory slot ``start`` of ``gpu``."""
    return next(gi for gi, _, s, _ in nv.instances(gpu) if s == start)


def degraded(api: ApiServer) -> tuple[str, str, str]:
    (c,) = [c for c in np_of(api)["status"]["conditions"] if c["type"] == "Degraded"]
    return c["status"], c["reason"], c["message"]


def gpu_status(api: ApiServer, index: int) -> dict[str, Any]:
    (g,) = [g for g in np_of(api)["status"]["gpus"] if g["index"] == index]
    return dict(g)


def mig_of(api: ApiServer, index: int) -> list[tuple[str, int, bool, bool]]:
    """GPU ``index``'s reported instances as ``(profile, start, used, unhealthy)``."""
    return [
        (m["profile"], m["start"], m["used"], m.get("unhealthy", False))
        for m in gpu_status(api, index)["mig"]
    ]


def xid_count(metrics: AgentMetrics, gpu: str, xid: int) -> float:
    return metrics.registry.get_sample_value(XID_METRIC, {"gpu": gpu, "xid": str(xid)}) or 0.0


def watcher(nv: FakeNvml, ignore: tuple[int, ...] = ()) -> XidWatcher:
    return XidWatcher(nv, XidLedger(), ignore=ignore, wait_ms=20)


@asynccontextmanager
async def looping(driver: DraDriver) -> AsyncIterator[None]:
    """``driver.run`` in a task until the body ends; its first round done on entry."""
    stop = asyncio.Event()
    task = asyncio.create_task(driver.run(stop))
    try:
        await eventually(lambda: driver.rounds >= 1, what="the first round", timeout=20)
        assert driver.failures == 0
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


# -- the publish loop --------------------------------------------------------------------------


async def test_an_xid_on_a_mig_instance_withdraws_what_shares_its_slots_within_a_second(
    kmock: ApiServer, connect: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    nv = FakeNvml([H100, H100])
    metrics = AgentMetrics(CollectorRegistry())
    caplog.set_level(logging.INFO, logger="node_agent")
    caplog.set_level(logging.INFO, logger="gpuslice")
    with tempfile.TemporaryDirectory(prefix="gsxid-", dir="/tmp") as tmp:
        driver = setup(kmock, connect, nv, tmp, xids=watcher(nv), metrics=metrics, spec_poll_s=HOUR)
        driver.resync_s = HOUR
        await put_np(kmock, spec("p1", PLAN))
        await put_claim(kmock, "train", [p(0, "3g.40gb", 4)])
        driver.preparer.prepare(ref(1), alloc(p(0, "3g.40gb", 4)))
        async with looping(driver):
            everything = {p(g, "3g.40gb", s) for g in (0, 1) for s in (0, 4)}
            assert published(kmock) == everything
            assert degraded(kmock)[0] == "False"
            lost = Lost(nv)  # records every NVML call from here on
            before = (layout(nv, 0), layout(nv, 1))
            rounds = driver.rounds

            t0 = time.monotonic()
            assert nv.emit_xid(0, 48, gi=gi_at(nv, 0, 0), ci=0)  # double-bit ECC on 3g@0
            await eventually(
                lambda: p(0, "3g.40gb", 0) not in published(kmock),
                timeout=1.0,
                what="the hit placement withdrawn",
            )
            assert time.monotonic() - t0 < 1.0 < HOUR  # woken by the XID, not a resync
            # a round counts once it returns, after its status write
            await eventually(lambda: driver.rounds > rounds, timeout=1.0, what="the round")
            # the allocated 3g@4 and GPU 1 stay published
            assert published(kmock) == everything - {p(0, "3g.40gb", 0)}
            await eventually(lambda: degraded(kmock)[0] == "True", timeout=1.0, what="status")
            _, reason, message = degraded(kmock)
            assert reason == "GpuXid", message
            assert "GPU 0" in message and "XID 48" in message and "3g.40gb" in message
            assert "GPU 1" not in message
            assert mig_of(kmock, 0) == [("3g.40gb", 0, False, True), ("3g.40gb", 4, True, False)]
            assert "unhealthy" not in gpu_status(kmock, 0)
            assert xid_count(metrics, "0", 48) == 1
            warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warned) == 1 and "XID 48" in warned[0] and "withdrawn" in warned[0]

            nv.emit_xid(1, 79)  # GPU 1 fell off the bus: no instance named
            await eventually(
                lambda: not any(d.startswith("gpu1") for d in published(kmock)),
                timeout=1.0,
                what="GPU 1's free devices withdrawn",
            )
            assert published(kmock) == {p(0, "3g.40gb", 4)}
            await eventually(
                lambda: gpu_status(kmock, 1).get("unhealthy") is True, timeout=1.0, what="GPU 1"
            )
            assert "XID 79" in degraded(kmock)[2]
            assert (layout(nv, 0), layout(nv, 1)) == before
            assert not lost.mutations(0) and not lost.mutations(1)


async def test_application_xids_change_nothing_and_wake_no_round(
    kmock: ApiServer, connect: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    nv = FakeNvml([H100])
    metrics = AgentMetrics(CollectorRegistry())
    caplog.set_level(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="gsxid-", dir="/tmp") as tmp:
        driver = setup(
            kmock, connect, nv, tmp, xids=watcher(nv, ignore=(94,)), metrics=metrics,
            spec_poll_s=HOUR,
        )  # fmt: skip
        driver.resync_s = HOUR
        await put_np(kmock, spec("p1", {0: PLAN[0]}))
        async with looping(driver):
            rounds, before = driver.rounds, published(kmock)
            gi = gi_at(nv, 0, 0)
            for code in (13, 31, 43, 45, 68, 109, 94):  # 94: ignored by the setting
                nv.emit_xid(0, code, gi=gi, ci=0)
            await eventually(lambda: xid_count(metrics, "0", 94) == 1, timeout=1.0, what="count")
            await asyncio.sleep(0.2)
            assert driver.rounds == rounds and published(kmock) == before
            assert driver.preparer.xid_marks == ()
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_nothing_is_created_or_destroyed_where_an_xid_hit(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path
) -> None:
    nv = CountingNvml([H100, H100])
    driver = setup(kmock, connect, nv, str(tmp_path))
    await put_np(kmock, spec("p1", PLAN))
    await round_ok(driver)
    driver.preparer.mark_xids([XidEvent(0, 48, gi_id=gi_at(nv, 0, 0), ci_id=0), XidEvent(1, 79)])
    creates = nv.creates
    # the new spec drops the hit 3g@0 for a 1g@0 over it and a 4g@0 on the marked GPU 1
    await patch_spec(kmock, spec("p2", {0: [("1g.10gb", 0), ("3g.40gb", 4)], 1: [("4g.40gb", 0)]}))
    await round_ok(driver)
    assert layout(nv, 0) == {("3g.40gb", 0), ("3g.40gb", 4)}  # the idle hit instance kept
    assert layout(nv, 1) == {("3g.40gb", 0), ("3g.40gb", 4)}  # nothing changed on GPU 1
    assert nv.creates == creates and driver.idle_destroyed == 0
    assert published(kmock) == {p(0, "3g.40gb", 4)}  # 1g@0 shares slot 0 with the hit
    assert mig_of(kmock, 0) == [("3g.40gb", 0, False, True), ("3g.40gb", 4, False, False)]
    assert gpu_status(kmock, 1)["unhealthy"] is True


@pytest.mark.parametrize("taints_kept", [True, False], ids=["taints-kept", "taints-dropped"])
async def test_mode_all_taints_the_hit_devices_or_withdraws_their_gpu_but_the_prepared_ones(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path, taints_kept: bool
) -> None:
    """Mode ``all`` never withdraws a hit device alone (it may be allocated to a claim not
    prepared yet, whose counters would stop counting): where the API server keeps taints every
    device stays published, those the XID hit tainted; where it drops them the hit GPU's free
    devices are all withdrawn in the very round that learns it, the prepared one kept."""
    kmock.drop_taints = not taints_kept
    nv = FakeNvml([H100, H100])
    driver = setup(kmock, connect, nv, str(tmp_path), shaped=False)
    held = p(0, "3g.40gb", 0)
    driver.preparer.prepare(ref(1), alloc(held))
    await round_ok(driver)
    targets = driver.preparer.targets
    every = set(targets)
    assert published(kmock) == every and tainted(kmock) == {}
    assert driver.publisher.taints  # nothing tainted yet: nothing learnt about the server
    driver.preparer.mark_xids([XidEvent(0, 48, gi_id=gi_at(nv, 0, 0), ci_id=0)])
    await round_ok(driver)  # one round, also where it learns that taints are dropped
    shares_0_3 = {
        n for n, t in targets.items() if t.gpu == 0 and (t.profile is None or t.start < 4)
    }
    gpu0 = {n for n, t in targets.items() if t.gpu == 0}
    assert {held, "gpu0", p(0, "7g.80gb", 0), p(0, "1g.10gb", 3)} <= shares_0_3
    assert p(0, "3g.40gb", 4) not in shares_0_3
    await assert_mode_all_hides(  # the prepared one is tainted too: it shares the slots
        kmock,
        driver,
        every=every,
        gpu0=gpu0,
        held=held,
        hit=shares_0_3,
        reason="xid",
        taints_kept=taints_kept,
    )
    # the claim released: the hit stays (an XID lasts until the agent restarts)
    driver.preparer.unprepare("uid-1")
    await round_ok(driver)
    if taints_kept:
        assert published(kmock) == every
        assert tainted(kmock) == dict.fromkeys(shares_0_3, "xid")
    else:
        assert published(kmock) == every - gpu0 and tainted(kmock) == {}


# -- NodePrepareResources ----------------------------------------------------------------------


async def test_prepare_refuses_new_claims_on_what_an_xid_hit_naming_the_gpu_and_the_xid(
    node: Node,
) -> None:
    prep = node.plugin.preparer
    held = node.claims.put("held", "uid-h", ("gpu", placement(0, "3g.40gb", 0)))
    assert (await node.kubelet.prepare(DRIVER, held))["uid-h"].error == ""
    first = (await node.kubelet.prepare(DRIVER, held))["uid-h"]
    gi = gi_at(node.nv, 0, 0)
    assert prep.mark_xids([XidEvent(0, 48, gi_id=gi, ci_id=0)]) == []

    over = node.claims.put("over", "uid-o", ("gpu", placement(0, "1g.10gb", 1)))
    whole = node.claims.put("whole", "uid-w", ("gpu", "gpu0"))
    beside = node.claims.put("beside", "uid-b", ("gpu", placement(0, "3g.40gb", 4)))
    other = node.claims.put("other", "uid-x", ("gpu", placement(1, "7g.80gb", 0)))
    reply = await node.kubelet.prepare(DRIVER, over, whole, beside, other)
    for uid in ("uid-o", "uid-w"):
        error = reply[uid].error
        assert "GPU 0" in error and "XID 48" in error and "restart" in error, error
        assert not reply[uid].devices and prep.checkpoint.get(uid) is None
    assert reply["uid-b"].error == "" and reply["uid-x"].error == ""
    # a kubelet restart prepares the held claim again: its pod keeps what it had
    assert (await node.kubelet.prepare(DRIVER, held))["uid-h"] == first
    mig = node.nv.mig_uuids_of(0)
    gone = await node.kubelet.unprepare(DRIVER, held)
    assert gone["uid-h"].error == "" and prep.checkpoint.get("uid-h") is None
    assert node.nv.mig_uuids_of(0) == mig  # released, but the hit instance is not destroyed


def test_an_xid_naming_no_instance_the_gpu_has_marks_the_whole_gpu() -> None:
    nv = FakeNvml([H100, H100], mig_enabled=True)
    from tests.test_agent_dra_prepare import preparer

    prep = preparer(nv)
    prep.mark_xids([XidEvent(0, 48, gi_id=13, ci_id=0)])  # no such GPU instance
    assert [(m.gpu, m.device) for m in prep.xid_marks] == [(0, "")]
    assert {prep.targets[n].gpu for n in prep.xid_devices()} == {0}
    assert len(prep.xid_devices()) == len([t for t in prep.targets.values() if t.gpu == 0])
    prep.mark_xids([XidEvent(None, 79)])  # NVML could not tell which GPU: every GPU
    assert {m.gpu for m in prep.xid_marks} == {0, 1}
    assert prep.xid_devices() == set(prep.targets)


def test_an_xid_on_a_gpu_not_served_yet_is_kept_until_it_reads() -> None:
    from tests.test_agent_dra_prepare import preparer

    nv = FakeNvml([H100, H100])
    nv.inject("*", NvmlErrorCode.GPU_IS_LOST, gpu=1, times=None)
    prep = preparer(nv)
    waiting = XidEvent(1, 48)
    assert prep.mark_xids([waiting, XidEvent(7, 48)]) == [waiting]  # GPU 7: none, dropped
    assert prep.xid_marks == ()
    nv.clear_faults()
    assert [g.index for g in prep.read_pending()] == [1]
    assert prep.mark_xids([waiting]) == []
    assert [(m.gpu, m.xid, m.device) for m in prep.xid_marks] == [(1, 48, "")]


# -- a GPU unreadable when the agent starts ------------------------------------------------------


@pytest.mark.parametrize("shaped", [True, False])
async def test_a_gpu_unreadable_at_start_is_reported_and_published_once_it_reads(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path, shaped: bool
) -> None:
    nv = FakeNvml([H100, H100])
    nv.inject("*", NvmlErrorCode.GPU_IS_LOST, gpu=1, times=None)
    driver = setup(kmock, connect, nv, str(tmp_path), shaped=shaped)
    assert [g.index for g in driver.publisher.gpus] == [0]  # as the command builds it
    assert set(driver.preparer.pending) == {1}
    if shaped:
        await put_np(kmock, spec("p1", {0: [("7g.80gb", 0)], 1: [("3g.40gb", 0)]}))
    await round_ok(driver)
    gpu0 = {n for n, t in driver.preparer.targets.items() if t.gpu == 0}
    assert published(kmock) == ({p(0, "7g.80gb", 0)} if shaped else gpu0)
    assert driver.unreadable.keys() == {1}
    if shaped:
        status, reason, message = degraded(kmock)
        assert (status, reason) == ("True", "GpuUnreadable"), message
        assert "GPU 1" in message and "GPU_IS_LOST" in message
        assert "skipped" not in message and "no such GPU" not in message
        g1 = gpu_status(kmock, 1)  # nothing known of it but its index: locked, empty
        assert g1["unhealthy"] is True and g1["mig"] == [] and g1["uuid"] == ""

    nv.clear_faults()  # the GPU reads again (a reset, a driver hiccup over)
    await round_ok(driver)
    assert [g.index for g in driver.publisher.gpus] == [0, 1]
    assert driver.publisher.gpus[1] == DraGpu(1, nv.gpu_uuid(1), H100)
    assert driver.preparer.pending == {} and driver.unreadable == {}
    if shaped:
        assert published(kmock) == {p(0, "7g.80gb", 0), p(1, "3g.40gb", 0)}
        assert degraded(kmock) == ("False", "AsExpected", "")
        g1 = gpu_status(kmock, 1)
        assert g1["uuid"] == nv.gpu_uuid(1) and "unhealthy" not in g1
        assert mig_of(kmock, 1) == [("3g.40gb", 0, False, False)]
    else:
        assert published(kmock) == set(driver.preparer.targets)
        assert {t.gpu for t in driver.preparer.targets.values()} == {0, 1}
