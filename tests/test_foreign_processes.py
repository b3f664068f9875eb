"""Processes that no pod or claim holds a slice for (``foreign`` in the status).

A CUDA job started by hand on a free MIG instance (or on a GPU with MIG off) makes, in DRA
mode, every claim allocated there fail its prepare for as long as the job runs
(node_agent.dra_foreign), and in device-plugin mode shares the instance with whichever pod the
kubelet gives it to.  Checked, against kmock (tests/fake_apiserver.py) and the fake NVML, in
DRA mode:

* a planned instance that runs such a process leaves the ResourceSlices (with every device
  sharing a memory slot with it) and is reported ``used`` while the rest of the node is
  published as before; once the process ends it is published and reported free again; the
  change is logged once at WARNING naming the placement and the pid;
* a spec that plans over it creates nothing there, and the instance is not destroyed;
* a GPU with MIG off running a process is reported used whole and publishes nothing free, and
  no MIG mode switch is tried on it;
* a claim's own processes are not foreign; an allocated device stays published;
* mode ``all`` never withdraws a device a foreign process blocks alone (it may be allocated to
  a claim not prepared yet): where the API server keeps device taints they stay published with
  the ``NoSchedule`` unusable taint (``foreign``), where it drops them every free device of
  their GPU is withdrawn, the prepared ones kept; all is published again once the process ends.

And in both modes: the agent reports such an instance ``used`` and ``foreign`` (written only
when true), and the partitioner promises it to no pod -- its free count leaves it out, like an
unhealthy device -- and plans no layout over it.

Before this change the DRA agent published such an instance and reported it free, so the
partitioner promised it again and again and each pod planned there was stranded by its
failing prepare; in device-plugin mode the partitioner counted it free (a pod promised it
could get the busy instance or wait for the other pod's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import ApiServer
from prometheus_client import CollectorRegistry
from test_partitioner_promises import (
    MIG,
    ONE_G,
    T0,
    Cluster,
    applied_np,
    gated,
    reservation,
    running,
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import node

from node_agent.dra_claims import device_targets
from node_agent.dra_foreign import ForeignUse, foreign_devices, whole_gpus
from node_agent.metrics import AgentMetrics
from node_agent.nvml_fake import FakeNvml
from partitioner.actions import WriteSpec
from tests.test_agent_dra_prepare import preparer
from tests.test_agent_dra_shaped import (
    H100,
    CountingNvml,
    alloc,
    assert_mode_all_hides,
    kmock_options,  # noqa: F401  (the fixture: kmock serves tests/fake_apiserver.ApiServer)
    layout,
    mig_status,
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
from tests.test_agent_dra_xid import PLAN, gi_at
from tests.test_agent_lost_gpu import OLD, Node
from tests.test_agent_lost_gpu import spec as node_spec

FOUR = {p(g, "3g.40gb", s) for g in (0, 1) for s in (0, 4)}
"""What PLAN publishes: two 3g.40gb placements on each of the two H100s."""


def foreign_gauge(metrics: AgentMetrics) -> float | None:
    return metrics.registry.get_sample_value("gpuslice_agent_foreign_slices")


def foreign_flags(api: ApiServer, gpu: int) -> list[bool]:
    """GPU ``gpu``'s reported instances' ``foreign`` flags (absent: false), by start."""
    (g,) = [g for g in np_of(api)["status"]["gpus"] if g["index"] == gpu]
    return [m.get("foreign", False) for m in g["mig"]]


def test_the_devices_a_foreign_use_blocks_share_a_memory_slot_with_it() -> None:
    targets = device_targets({0: H100, 1: H100})
    on_0_3 = ForeignUse(0, p(0, "3g.40gb", 0), (7,))
    blocked = foreign_devices(targets, [on_0_3])
    assert {targets[n].gpu for n in blocked} == {0}
    assert "gpu0" in blocked  # the whole GPU shares every slot
    assert p(0, "1g.10gb", 3) in blocked and p(0, "7g.80gb", 0) in blocked
    assert p(0, "3g.40gb", 4) not in blocked and p(0, "1g.10gb", 4) not in blocked
    for name in set(targets) - blocked:  # nothing else is withdrawn
        t = targets[name]
        assert t.gpu == 1 or (t.profile is not None and min(t.profile.span(t.start)) >= 4)
    whole = ForeignUse(1, "", (8,))
    assert whole_gpus(targets, [on_0_3, whole]) == {1}
    both = foreign_devices(targets, [on_0_3, whole])
    assert both == blocked | {n for n, t in targets.items() if t.gpu == 1}
    assert foreign_devices(targets, []) == set()
    assert str(whole) == "GPU 1 (whole): pids 8"
    many = ForeignUse(0, p(0, "3g.40gb", 0), tuple(range(10)))
    assert str(many).endswith("pids 0, 1, 2, 3, 4, 5, 6, 7 and 2 more")


async def test_a_planned_instance_running_a_foreign_process_is_withdrawn_and_reported_used(
    kmock: ApiServer,
    connect: Callable[[str], Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    nv = CountingNvml([H100, H100])
    metrics = AgentMetrics(CollectorRegistry())
    driver = setup(kmock, connect, nv, str(tmp_path), metrics=metrics)
    await put_np(kmock, spec("p1", PLAN))
    await round_ok(driver)
    assert published(kmock) == FOUR
    assert mig_status(kmock)[0] == [("3g.40gb", 0, False), ("3g.40gb", 4, False)]
    assert foreign_gauge(metrics) == 0

    caplog.set_level(logging.INFO, logger="node_agent")
    pid = nv.start_process(0, gi_at(nv, 0, 0), 0)  # a CUDA job started by hand on 3g@0
    await round_ok(driver)
    await round_ok(driver)  # the same set again: no second WARNING
    assert published(kmock) == FOUR - {p(0, "3g.40gb", 0)}
    assert mig_status(kmock)[0] == [("3g.40gb", 0, True), ("3g.40gb", 4, False)]
    assert mig_status(kmock)[1] == [("3g.40gb", 0, False), ("3g.40gb", 4, False)]
    assert driver.foreign == [ForeignUse(0, p(0, "3g.40gb", 0), (pid,))]
    assert foreign_flags(kmock, 0) == [True, False]
    assert foreign_gauge(metrics) == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert p(0, "3g.40gb", 0) in warned[0] and f"pids {pid}" in warned[0]

    # a spec planned over it (before the partitioner saw the report) creates nothing there
    creates = nv.creates
    await patch_spec(kmock, spec("p2", {0: [("1g.10gb", 0), ("1g.10gb", 1), ("3g.40gb", 4)]}))
    await round_ok(driver)
    assert layout(nv, 0) == {("3g.40gb", 0), ("3g.40gb", 4)}  # kept, nothing made over it
    assert nv.creates == creates
    assert published(kmock) == {p(0, "3g.40gb", 4), "gpu1"}
    assert mig_status(kmock)[0] == [("3g.40gb", 0, True), ("3g.40gb", 4, False)]

    nv.stop_process(pid)
    await round_ok(driver)  # the idle unplanned 3g@0 goes, the planned 1g instances come
    assert driver.foreign == [] and foreign_gauge(metrics) == 0
    assert layout(nv, 0) == {("1g.10gb", 0), ("1g.10gb", 1), ("3g.40gb", 4)}
    assert published(kmock) == {
        p(0, "1g.10gb", 0),
        p(0, "1g.10gb", 1),
        p(0, "3g.40gb", 4),
        "gpu1",
    }
    assert all(not used for _, _, used in mig_status(kmock)[0])


async def test_a_gpu_with_mig_off_running_a_process_is_reported_used_whole(
    kmock: ApiServer,
    connect: Callable[[str], Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    nv = CountingNvml([H100, H100])  # MIG off on both
    pid = nv.start_process(1)
    driver = setup(kmock, connect, nv, str(tmp_path))
    await put_np(kmock, spec("p1", PLAN))
    caplog.set_level(logging.WARNING, logger="node_agent")
    await round_ok(driver)
    assert driver.foreign == [ForeignUse(1, "", (pid,))]
    assert published(kmock) == {p(0, "3g.40gb", 0), p(0, "3g.40gb", 4)}
    assert mig_status(kmock)[1] == [("7g.80gb", 0, True)]
    assert foreign_flags(kmock, 1) == [True]
    assert not nv.mig_enabled(1) and layout(nv, 1) == set()
    # no MIG mode switch was tried there (it would fail, and warn, every round)
    assert not [r for r in caplog.records if "not created now" in r.getMessage()]

    nv.stop_process(pid)
    await round_ok(driver)
    assert published(kmock) == FOUR
    assert mig_status(kmock)[1] == [("3g.40gb", 0, False), ("3g.40gb", 4, False)]


async def test_a_claims_own_processes_are_not_foreign(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path
) -> None:
    nv = CountingNvml([H100, H100])
    driver = setup(kmock, connect, nv, str(tmp_path))
    await put_np(kmock, spec("p1", PLAN))
    await put_claim(kmock, "train", [p(0, "3g.40gb", 4)])
    (dev,) = driver.preparer.prepare(ref(1), alloc(p(0, "3g.40gb", 4)))
    nv.start_process(0, gi_at(nv, 0, 4), 0)  # the pod's container
    await round_ok(driver)
    assert driver.foreign == []
    assert published(kmock) == FOUR
    assert mig_status(kmock)[0] == [("3g.40gb", 0, False), ("3g.40gb", 4, True)]
    assert foreign_flags(kmock, 0) == [False, False]  # held by a claim: not foreign
    assert dev.uuid


def test_a_claim_holding_a_gpu_whole_owns_the_processes_on_it() -> None:
    nv = FakeNvml([H100, H100])
    prep = preparer(nv)
    prep.prepare(ref(2), alloc("gpu0"))
    nv.start_process(0)
    assert prep.foreign_use() == []
    stray = nv.start_process(1)
    assert prep.foreign_use() == [ForeignUse(1, "", (stray,))]
    assert prep.foreign_use(skip={1}) == []


def test_a_round_lists_the_gpus_once_however_many_there_are() -> None:
    """``foreign_use`` and the sweep of shaped publishing run every round: one NVML listing
    each (a listing reads every GPU's entry), not one per GPU (8 GPUs: 64 entries a round)."""
    nv = FakeNvml([H100] * 8)
    prep = preparer(nv)
    listings: list[str] = []
    nv.hooks.append(lambda op, _args: listings.append(op) if op == "gpus" else None)
    assert prep.foreign_use() == []
    assert listings == ["gpus"]
    listings.clear()
    prep.destroy_idle(keep=())
    assert listings == ["gpus"]


@pytest.mark.parametrize("taints_kept", [True, False], ids=["taints-kept", "taints-dropped"])
async def test_mode_all_taints_what_a_foreign_process_blocks_or_withdraws_its_gpu_until_it_ends(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Path, taints_kept: bool
) -> None:
    """Mode ``all`` never withdraws a blocked device alone (it may be allocated to a claim not
    prepared yet): tainted ``foreign`` where the API server keeps taints, else every free device
    of its GPU withdrawn in the round that learns taints are dropped; the prepared device stays
    published and untainted throughout, and everything is published again once the process
    ends."""
    kmock.drop_taints = not taints_kept
    nv = CountingNvml([H100, H100])
    driver = setup(kmock, connect, nv, str(tmp_path), shaped=False)
    held = p(0, "3g.40gb", 4)
    driver.preparer.prepare(ref(1), alloc(held))
    gi = nv.create_gpu_instance(0, H100.profile("3g.40gb").profile_id, 0, 4)
    nv.create_compute_instance(0, gi)
    await round_ok(driver)
    targets = driver.preparer.targets
    every = set(targets)
    assert published(kmock) == every  # an idle instance no claim owns blocks nothing
    assert tainted(kmock) == {}
    pid = nv.start_process(0, gi, 0)
    await round_ok(driver)  # one round, also where it learns that taints are dropped
    shares_0_3 = {
        n for n, t in targets.items() if t.gpu == 0 and (t.profile is None or t.start < 4)
    }
    gpu0 = {n for n, t in targets.items() if t.gpu == 0}
    assert {p(0, "3g.40gb", 0), "gpu0", p(0, "7g.80gb", 0)} <= shares_0_3 and held not in shares_0_3
    await assert_mode_all_hides(  # the prepared one is not among them (other slots)
        kmock,
        driver,
        every=every,
        gpu0=gpu0,
        held=held,
        hit=shares_0_3,
        reason="foreign",
        taints_kept=taints_kept,
    )
    nv.stop_process(pid)
    await round_ok(driver)
    assert published(kmock) == every and tainted(kmock) == {}  # all back, as before


# -- device-plugin mode ----------------------------------------------------------------------


def test_the_device_plugin_agent_reports_an_instance_running_processes_of_no_pod_foreign() -> None:
    node = Node("A100-SXM4-80GB", "A100-SXM4-80GB", mig=True)
    node.run(node_spec("mig", {0: OLD, 1: OLD}))
    (gi0, _, _, _), (gi4, _, _, (at4,)) = sorted(node.nv.instances(0), key=lambda t: t[2])
    node.pods.ids = {at4}  # a pod holds 3g@4 and runs on it
    node.nv.start_process(0, gi4, 0)
    stray = node.nv.start_process(0, gi0, 0)  # nothing holds 3g@0: a job started by hand
    res = node.run(node_spec("mig", {0: OLD, 1: OLD}), gen=2)
    metrics = AgentMetrics(CollectorRegistry())
    metrics.observe_pass(2, res, 0.1, 1.0)
    assert foreign_gauge(metrics) == 1
    flags = {(m.profile, m.start): (m.used, m.foreign) for m in res.status.gpus[0].mig}
    assert flags == {("3g.40gb", 0): (True, True), ("3g.40gb", 4): (True, False)}
    dumped = res.status.model_dump(mode="json")
    assert dumped["gpus"][0]["mig"][0]["foreign"] is True
    assert "foreign" not in str(dumped["gpus"][1])  # written only when true
    node.nv.stop_process(stray)
    res = node.run(node_spec("mig", {0: OLD, 1: OLD}), gen=2)
    assert not any(m.foreign for g in res.status.gpus for m in g.mig)


def test_a_foreign_instance_is_promised_to_no_pod_and_kept_by_plans() -> None:
    """Device-plugin mode: GPU 0's two free 1g instances, the one at slot 1 running a job of
    no pod (the kubelet lists both: its device plugin advertises every instance).  Two gated
    1g pods: one gets the free slice, the other waits for a plan, which keeps the busy one."""
    gpu0 = status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, True))
    gpu0["mig"][1]["foreign"] = True
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 2, "7g_80gb": 1}),
        applied_np("n1", gpu0, status_gpu(1, ("7g.80gb", 0, True))),
        running("busy", "n1", "nvidia.com/mig-7g.80gb"),
        gated("a", ONE_G, created=T0),
        gated("b", ONE_G, created=T0 + 1),
    )
    c.step(T0 + 2)
    assert reservation(c, "a") is not None and reservation(c, "b") is None
    for t in (T0 + 70, T0 + 140):
        d = c.step(t)
        for w in (a for a in d.actions if isinstance(a, WriteSpec)):
            mig0 = next(g for g in w.spec.gpus if g.index == 0).mig
            assert ("1g.10gb", 1) in [(m.profile, m.start) for m in mig0]
