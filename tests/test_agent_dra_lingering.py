"""A device published only for a claim that is gone: withdrawn within the poll, not a resync.

The DRA agent keeps every allocated device published, also one an XID hit or a foreign process
uses (node_agent.dra_shape, node_agent.dra_foreign).  The kubelet unprepares a claim before the
claim controller deallocates it, and nothing tells the plugin of the deallocation, so the round
that unprepare wakes still sees the claim allocated; before this change the next round came only
with the resync, and meanwhile the freed device was published and free: kube-scheduler could
allocate it and the new pod's prepare failed (tests/test_partitioner_promise_soundness_dra.py
counts it as ``lingering_unusable``).  Now, while some published device is there only for an
allocation not prepared on this node, the loop runs again after ``spec_poll_s``
(node_agent.dra_driver, "Lingering devices").  Checked against kmock and the fake NVML, with the
kubelet played over gRPC (tests/fake_dra_kubelet.py) and the resync an hour:

* a claim's device hit by an XID under its pod: from the XID's round on it is published with the
  ``NoSchedule`` unusable taint (kube-scheduler allocates it to no other claim), after unprepare
  it stays published (the claim is still allocated) and lingers; once the claim is deallocated
  it leaves the slices within a few polls, and the polling stops;
* a claim allocated on an instance a process outside any claim uses, never prepared (its prepare
  refused): tainted from the round that found the process; once the claim is deallocated the
  device leaves the slices within a few polls;
* a claim allocated on an XID-hit device whose pod never comes: the poll slows down (doubling up
  to the resync), it does not read the API every ``spec_poll_s`` for hours;
* mode ``all`` (no claims listed) never withdraws a hit device alone (it may be allocated to a
  claim not prepared yet): where the API server keeps device taints every device stays
  published, those the XID hit with the ``NoSchedule`` taint, the prepared hit device too, and
  so after its unprepare; where it drops them GPU 0 publishes only the prepared hit device, and
  unprepare wakes a round, which withdraws it at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import ApiServer
from fake_dra_kubelet import FakeDraKubelet
from fake_kubelet import eventually

from node_agent.dra_driver import DraDriver
from node_agent.dra_foreign import ForeignUse, foreign_devices
from node_agent.dra_slices import DRIVER
from node_agent.nvml_fake import FakeNvml
from tests.test_agent_dra_shaped import (
    H100,
    drop_claim,
    kmock_options,  # noqa: F401  (the fixture: kmock serves tests/fake_apiserver.ApiServer)
    p,
    published,
    put_claim,
    put_np,
    setup,
    spec,
    tainted,
)
from tests.test_agent_dra_xid import HOUR, gi_at, looping, mig_of, watcher

POLL = 0.2
"""``spec_poll_s`` of these tests (the resync is an hour)."""
SOON = 10 * POLL
"""Within a few polls (a round against kmock takes some tens of milliseconds)."""
HIT, BESIDE = p(0, "3g.40gb", 4), p(0, "3g.40gb", 0)
"""GPU 0 planned as two 3g.40gb instances; the claim holds the one at memory slot 4."""


def make_driver(
    kmock: ApiServer, connect: Callable[[str], Any], nv: FakeNvml, tmp: Path, **kw: Any
) -> DraDriver:
    driver = setup(kmock, connect, nv, str(tmp), spec_poll_s=POLL, **kw)
    driver.resync_s = HOUR
    return driver


@asynccontextmanager
async def kubelet(tmp: Path) -> AsyncIterator[FakeDraKubelet]:
    """The fake kubelet, the running driver's plugin registered with it."""
    k = FakeDraKubelet(str(tmp / "r"))
    try:
        await eventually(lambda: (tmp / "r").exists(), what="the registration dir", timeout=10)
        await k.scan()
        yield k
    finally:
        await k.close()


async def settled(driver: DraDriver) -> int:
    """Wait out the round in flight (and the narrowed set's re-poll); return the rounds."""
    await asyncio.sleep(3 * POLL)
    return driver.rounds


async def test_a_device_an_xid_hit_leaves_the_slices_within_the_poll_after_its_claim_goes(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path
) -> None:
    nv = FakeNvml([H100])
    driver = make_driver(kmock, connect, nv, tmp_path, xids=watcher(nv))
    await put_np(kmock, spec("p1", {0: [("3g.40gb", 0), ("3g.40gb", 4)]}))
    uid = await put_claim(kmock, "train", [HIT])
    claim = ("team", "train", uid)
    async with looping(driver), kubelet(tmp_path) as k:
        assert (await k.prepare(DRIVER, claim))[uid].error == ""
        await eventually(lambda: driver.rounds >= 2, what="the round prepare woke", timeout=5)
        assert published(kmock) == {BESIDE, HIT} and driver.lingering == frozenset()

        assert nv.emit_xid(0, 48, gi=gi_at(nv, 0, 4), ci=0)  # a double-bit ECC under the pod
        await eventually(
            lambda: mig_of(kmock, 0)[1] == ("3g.40gb", 4, True, True), what="the XID", timeout=5
        )
        rounds = await settled(driver)  # the XID's round done, no other in flight
        assert published(kmock) == {BESIDE, HIT}  # allocated: stays
        assert tainted(kmock) == {HIT: "xid"}  # and no other claim is allocated it
        assert driver.lingering == frozenset()  # prepared here: unprepare will wake a round

        assert (await k.unprepare(DRIVER, claim))[uid].error == ""  # the pod is gone
        await eventually(lambda: driver.rounds > rounds, what="the round unprepare woke", timeout=5)
        assert published(kmock) == {BESIDE, HIT}  # the claim is still allocated
        assert driver.lingering == {HIT}

        t0 = time.monotonic()
        await drop_claim(kmock, "train")  # the claim controller deallocates it
        await eventually(
            lambda: HIT not in published(kmock), what="the freed hit device", timeout=SOON
        )
        assert time.monotonic() - t0 < SOON < HOUR  # a poll, not the resync
        assert published(kmock) == {BESIDE} and tainted(kmock) == {}
        await eventually(lambda: driver.lingering == frozenset(), what="nothing lingers", timeout=5)
        # nothing lingers: the loop waits for the resync again
        rounds = await settled(driver)
        await asyncio.sleep(5 * POLL)
        assert driver.rounds == rounds and driver.failures == 0


async def test_a_device_a_foreign_process_uses_leaves_the_slices_within_the_poll_once_freed(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path
) -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    prof = H100.profile("3g.40gb")
    gi = nv.create_gpu_instance(0, prof.profile_id, 4, prof.memory_slices)
    nv.create_compute_instance(0, gi)
    driver = make_driver(kmock, connect, nv, tmp_path)
    await put_np(kmock, spec("p1", {0: [("3g.40gb", 0), ("3g.40gb", 4)]}))
    uid = await put_claim(kmock, "infer", [HIT])  # allocated, its pod not started yet
    async with looping(driver), kubelet(tmp_path) as k:
        assert published(kmock) == {BESIDE, HIT} and driver.lingering == frozenset()
        pid = nv.start_process(0, gi, 0)  # a CUDA job started by hand on the instance
        reply = await k.prepare(DRIVER, ("team", "infer", uid))
        assert reply[uid].error, "prepare accepted a placement a foreign process uses"
        await eventually(
            lambda: [u.pids for u in driver.foreign] == [(pid,)], what="the foreign use", timeout=5
        )
        await asyncio.sleep(POLL)  # the round that found it done
        assert published(kmock) == {BESIDE, HIT}  # allocated: stays
        assert tainted(kmock) == {HIT: "foreign"}
        assert driver.lingering == {HIT}

        t0 = time.monotonic()
        await drop_claim(kmock, "infer")  # its pod deleted: deallocated, no unprepare
        await eventually(
            lambda: HIT not in published(kmock), what="the freed busy device", timeout=SOON
        )
        assert time.monotonic() - t0 < SOON < HOUR
        assert published(kmock) == {BESIDE}
        assert driver.failures == 0


async def test_a_claim_that_lingers_for_long_is_read_ever_less_often(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path
) -> None:
    nv = FakeNvml([H100])
    driver = make_driver(kmock, connect, nv, tmp_path, xids=watcher(nv))
    driver.spec_poll_s = 0.05
    await put_np(kmock, spec("p1", {0: [("3g.40gb", 0), ("3g.40gb", 4)]}))
    async with looping(driver):
        assert nv.emit_xid(0, 48, gi=gi_at(nv, 0, 4), ci=0)
        await eventually(lambda: HIT not in published(kmock), what="the XID", timeout=5)
        await put_claim(kmock, "stuck", [HIT])  # allocated before the XID; its pod never runs
        # the narrowed set's re-poll (every spec_poll_s) reads the claim
        await eventually(lambda: driver.lingering == {HIT}, what="the lingering claim", timeout=5)
        rounds = driver.rounds
        await asyncio.sleep(3.0)
        # 0.05 s doubling: about 6 rounds in 3 s, not 60
        assert 2 <= driver.rounds - rounds <= 8, driver.rounds - rounds
        assert HIT in published(kmock) and driver.failures == 0


@pytest.mark.parametrize("taints_kept", [True, False], ids=["taints-kept", "taints-dropped"])
async def test_mode_all_keeps_a_hit_device_tainted_or_withdraws_it_at_its_unprepare(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path, taints_kept: bool
) -> None:
    kmock.drop_taints = not taints_kept
    nv = FakeNvml([H100, H100])
    driver = make_driver(kmock, connect, nv, tmp_path, shaped=False, xids=watcher(nv))
    uid = await put_claim(kmock, "train", [HIT])
    claim = ("team", "train", uid)
    async with looping(driver), kubelet(tmp_path) as k:
        targets = driver.preparer.targets
        every = set(targets)
        gpu0 = {n for n, t in targets.items() if t.gpu == 0}
        assert published(kmock) == every and tainted(kmock) == {}
        assert (await k.prepare(DRIVER, claim))[uid].error == ""
        assert nv.emit_xid(0, 48, gi=gi_at(nv, 0, 4), ci=0)
        shares_4_7 = foreign_devices(targets, [ForeignUse(0, HIT, (1,))])
        assert {HIT, "gpu0"} <= shares_4_7 and BESIDE not in shares_4_7
        if taints_kept:
            # whether this round began before or after the XID's, it ends with every device
            # published, those the XID hit tainted, the prepared HIT among them
            await eventually(
                lambda: tainted(kmock) == dict.fromkeys(shares_4_7, "xid"),
                what="the XID",
                timeout=5,
            )
            assert published(kmock) == every and driver.publisher.taints
        else:
            # the round that learns taints are dropped withdraws GPU 0 but the prepared HIT
            await eventually(
                lambda: published(kmock) == (every - gpu0) | {HIT}, what="the XID", timeout=5
            )
            assert tainted(kmock) == {} and not driver.publisher.taints
        rounds = await settled(driver)
        t0 = time.monotonic()
        assert (await k.unprepare(DRIVER, claim))[uid].error == ""
        if taints_kept:
            # its claim may still be allocated (this mode lists none): HIT stays, tainted, so
            # no other claim is allocated it and nothing overlapping it either
            await eventually(lambda: driver.rounds > rounds, what="the round unprepare woke")
            await settled(driver)
            assert published(kmock) == every
            assert tainted(kmock) == dict.fromkeys(shares_4_7, "xid")
        else:
            await eventually(
                lambda: HIT not in published(kmock), what="the released device", timeout=1
            )
            assert time.monotonic() - t0 < 1.0 < HOUR  # the round unprepare woke
            assert published(kmock) == every - gpu0 and tainted(kmock) == {}
        assert driver.failures == 0
