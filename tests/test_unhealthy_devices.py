"""Devices the agent advertises Unhealthy are reported ``unhealthy`` and never promised.

The kubelet gives an Unhealthy device to no pod (an XID critical error, a GPU NVML cannot
read).  Before the agent reported it, the partitioner counted such a free instance as free
capacity: the fast path promised it to a gated pod, whose release then waited for an
allocatable that never came, until the apply deadline dropped the promise and cooled the node
down for every other pod -- and the next pod got the same phantom slice.  Now the status marks
the instance (or the whole GPU) ``unhealthy``; the partitioner keeps it from every reservation
and from every plan (it is neither offered nor destroyed, and an unhealthy GPU's layout stays).
"""

from __future__ import annotations

from typing import Any

from test_partitioner_promises import (
    MIG,
    ONE_G,
    T0,
    Cluster,
    applied_np,
    events,
    gated,
    reservation,
    running,
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import node

from contract.nodepartitioning import ActualGpu, ActualMigInstance, NodePartitioningStatus
from node_agent.status import flag_unhealthy
from partitioner.actions import WriteSpec
from tests.fake_kubelet import eventually
from tests.test_agent_mps_liveness import agent_running, settled
from tests.test_agent_xid import XidNode, loop_of

# -- the contract ----------------------------------------------------------------------------


def test_unhealthy_is_written_only_when_true_so_older_readers_see_the_same_status() -> None:
    healthy = ActualGpu(index=0, mig=[ActualMigInstance(profile="1g.10gb", start=0)])
    assert "unhealthy" not in str(healthy.model_dump(mode="json"))
    same = flag_unhealthy([healthy], (), {"MIG-other"})  # names nothing here: unchanged
    assert same[0].model_dump(mode="json") == healthy.model_dump(mode="json")
    inst = ActualMigInstance(profile="1g.10gb", start=1, deviceId="MIG-a")
    flagged = flag_unhealthy([ActualGpu(index=0, mig=[inst])], (), {"MIG-a"})[0]
    dumped = flagged.model_dump(mode="json")
    assert dumped["mig"][0]["unhealthy"] is True and "unhealthy" not in dumped
    assert ActualGpu.model_validate(dumped).model_dump(mode="json") == dumped  # round trip
    whole = flag_unhealthy([ActualGpu(index=3)], {3}, ())[0].model_dump(mode="json")
    assert whole["unhealthy"] is True


# -- the agent -------------------------------------------------------------------------------


async def test_the_agent_reports_the_instance_an_xid_hit_unhealthy() -> None:
    node = XidNode("A100-SXM4-80GB", "A100-SXM4-80GB")
    agent, source, _ = loop_of(node)
    async with agent_running(agent):
        await settled(agent)
        gi, hit = node.gi_at(0, 4)
        assert node.nv.emit_xid(0, 48, gi=gi, ci=0)

        def flags() -> dict[str, bool] | None:
            status: NodePartitioningStatus | None = source.obj.status if source.obj else None
            if status is None:
                return None
            return {i.deviceId: i.unhealthy for g in status.gpus for i in g.mig}

        await eventually(lambda: (f := flags()) is not None and f.get(hit), timeout=2.0)
        others = {d: u for d, u in (flags() or {}).items() if d != hit}
        assert others and not any(others.values())
        assert not any(g.unhealthy for g in source.obj.status.gpus)  # type: ignore[union-attr]
        assert node.nv.emit_xid(1, 79)  # not MIG-scoped: GPU 1 as a whole
        await eventually(
            lambda: any(g.unhealthy for g in source.obj.status.gpus if g.index == 1),  # type: ignore[union-attr]
            timeout=2.0,
        )


# -- the partitioner -------------------------------------------------------------------------


def sick_instance(status_entry: dict[str, Any], start: int) -> dict[str, Any]:
    for m in status_entry["mig"]:
        if m["start"] == start:
            m["unhealthy"] = True
    return status_entry


def test_an_unhealthy_free_instance_is_promised_to_no_pod_and_kept_by_plans() -> None:
    """GPU 0: two free 1g instances, the one at slot 1 hit by an XID (the kubelet advertises
    one 1g: allocatable 1).  Two gated 1g pods: one gets the healthy slice, the other waits for
    a plan, which never destroys the unhealthy instance."""
    np = applied_np(
        "n1",
        sick_instance(status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False)), 1),
        status_gpu(1, ("7g.80gb", 0, True)),
    )
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1, "7g_80gb": 1}),
        np,
        running("busy", "n1", "nvidia.com/mig-7g.80gb"),
        gated("a", ONE_G, created=T0),
        gated("b", ONE_G, created=T0 + 1),
    )
    d = c.step(T0 + 2)
    assert reservation(c, "a") is not None and reservation(c, "b") is None
    assert len(events(d, "Reserved")) == 1
    for t in (T0 + 70, T0 + 140, T0 + 400):
        d = c.step(t)
        for w in (a for a in d.actions if isinstance(a, WriteSpec)):
            gpu0 = next(g for g in w.spec.gpus if g.index == 0)
            assert ("1g.10gb", 1) in [(m.profile, m.start) for m in gpu0.mig]


def test_a_gpu_unhealthy_as_a_whole_is_neither_offered_nor_repartitioned() -> None:
    np = applied_np("n1", status_gpu(0, ("7g.80gb", 0, False)), status_gpu(1))
    np["status"]["gpus"][0]["unhealthy"] = True  # lost, or a non-MIG-scoped XID
    c = Cluster(
        with_alloc(node("n1", MIG)),
        np,
        gated("big", "nvidia.com/mig-7g.80gb", created=T0),
    )
    d = c.step(T0 + 2)
    assert events(d, "Reserved") == []  # its free 7g is not offered
    d = c.step(T0 + 70)
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    by_index = {g.index: [(m.profile, m.start) for m in g.mig] for g in w.spec.gpus}
    assert by_index.get(0, [("7g.80gb", 0)]) == [("7g.80gb", 0)]  # left as it is
    assert by_index[1] == [("7g.80gb", 0)]  # the healthy empty GPU serves the pod
    r = reservation(c, "big")
    assert r is not None and dict(r.gpus) == {"nvidia.com/mig-7g.80gb": (1,)}


def _beside_a_sick_1g(foreign: bool) -> None:
    """GPU 0: 1g@0 unhealthy and shown used, 1g@1 free (and, with ``foreign``, 1g@2 healthy
    and used by processes of no pod); GPU 1: a 7g ``big`` uses; GPU 2 empty.  The 1g pod
    ``busy`` is bound.  A gated 1g pod ``a`` is promised nothing on n1 at once; the plan
    keeps every 1g instance and makes ``a`` a new one."""
    one_gs = [("1g.10gb", 0, True), ("1g.10gb", 1, False)]
    if foreign:
        one_gs.append(("1g.10gb", 2, True))
    np = applied_np(
        "n1",
        sick_instance(status_gpu(0, *one_gs), 0),
        status_gpu(1, ("7g.80gb", 0, True)),
        status_gpu(2),
    )
    if foreign:
        np["status"]["gpus"][0]["mig"][2]["foreign"] = True
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": len(one_gs) - 1, "7g_80gb": 1}),
        running("busy", "n1", ONE_G),
        running("big", "n1", "nvidia.com/mig-7g.80gb"),
        np,  # written after ``busy`` bound: its flags look current
        gated("a", ONE_G, created=T0),
    )
    index = c.index()
    assert index.partitionings["n1"].pods_seen == index.node_pods.get("n1", 0)
    d = c.step(T0 + 2)
    assert reservation(c, "a") is None and events(d, "Reserved") == []
    d = c.step(T0 + 70)
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    by_index = {g.index: [(m.profile, m.start) for m in g.mig] for g in w.spec.gpus}
    assert {(p, s) for p, s, _ in one_gs} <= set(by_index[0])
    made = sum(p == "1g.10gb" for mig in by_index.values() for p, _ in mig)
    assert made == len(one_gs) + 1  # one new 1g for ``a``
    r = reservation(c, "a")
    assert r is not None and r.plan and r.units() == {ONE_G: 1}


def test_a_healthy_free_instance_beside_a_pod_on_an_unhealthy_one_is_promised_to_nobody() -> None:
    """``busy`` runs on GPU 0's 1g@0, which an XID hit; 1g@1 is healthy and free.  The
    kubelet's allocatable lists the healthy 1g only (1), and kube-scheduler counts ``busy``'s
    request against it: it admits no other 1g pod.  A gated 1g pod is therefore not promised
    that slice (it would wait out its apply deadline unreleased, be given the same slice
    again, and so on): a plan makes it a new one, and keeps the unadmitted instance as it is.

    The same objects also read as the device-plugin side of DRA promise harness seed
    100001597: the pod on 1g@0 left (the agent still shows it used) and ``busy`` bound since,
    the kubelet giving it 1g@1, which the status, written after the bind but before
    ``Allocate``, shows free.  The flags cannot tell the two apart, and need not: what
    kube-scheduler admits gives the same answer (1g@1 kept: a plan that replaced it would
    destroy ``busy``'s device)."""
    _beside_a_sick_1g(foreign=False)


def test_beside_a_foreign_device_the_flags_decide_nothing_and_nothing_is_promised() -> None:
    """The same node with a third 1g, healthy and ``foreign`` (a job started by hand runs on
    it).  The kubelet advertises it, so kube-scheduler admits one more 1g pod, which would get
    that instance if ``busy`` holds 1g@1; only the flags say whether ``busy`` holds 1g@1 or
    the unhealthy 1g@0, and they may predate its ``Allocate``.  The ledger does not trust them
    there (``partitioner.ledger._flags_decide``): nothing is promised on n1, whichever it is,
    and plans keep every 1g."""
    _beside_a_sick_1g(foreign=True)


def test_once_the_pod_on_the_unhealthy_instance_leaves_its_healthy_neighbour_serves() -> None:
    """The same node after ``busy`` ended: kube-scheduler admits a 1g pod again (allocatable 1,
    nothing requested), so the healthy free instance is promised and released at once."""
    np = applied_np(
        "n1",
        sick_instance(status_gpu(0, ("1g.10gb", 0, True), ("1g.10gb", 1, False)), 0),
        status_gpu(1, ("7g.80gb", 0, True)),
    )
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1, "7g_80gb": 1}),
        np,
        running("big", "n1", "nvidia.com/mig-7g.80gb"),
        gated("a", ONE_G, created=T0),
    )
    d = c.step(T0 + 2)
    r = reservation(c, "a")
    assert r is not None and dict(r.gpus) == {ONE_G: (0,)}
    assert len(events(d, "Released")) == 1


def test_a_released_pod_whose_slice_turned_unhealthy_is_told_so_and_replanned() -> None:
    """A pod released to GPU 0's free 1g, which an XID hits before it binds: the ``SliceTaken``
    Event names the unhealthy device, not a pod that took it, and a new slice is planned on
    the pod's node."""
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        gated("p", ONE_G),
    )
    c.step(T0)
    r = reservation(c, "p")
    assert r is not None and r.state.value == "released"
    np = c.objs[("NodePartitioning", "n1")]
    sick_instance(np["status"]["gpus"][0], 0)
    d = c.step(T0 + 2)
    assert events(d, "SliceTaken") == [
        "its slice on node n1 is gone: 1 of its devices there turned unhealthy; the pod is "
        "pinned to node n1, so a new slice is planned there"
    ]
