"""Promises a review found broken (thirty-fifth session), each driven through the real
``decide()`` with the Cluster harness of tests/test_partitioner_promises.py."""

from __future__ import annotations

from typing import Any

from test_partitioner_promises import (
    MIG,
    ONE_G,
    SEVEN_G,
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

from partitioner.actions import EmitEvent, EvictPod, PatchPod, WriteSpec
from partitioner.decide import Decision
from partitioner.reservations import State

ONE_GPU = {**MIG, "nvidia.com/gpu.count": "1"}


def all_events(d: Decision) -> list[tuple[str, str, str]]:
    """(object name, reason, message) of every Event, standalone or on a write's success."""
    out = []
    for a in d.actions:
        if isinstance(a, EmitEvent):
            out.append((a.ref.name, a.reason, a.message))
        if isinstance(a, (PatchPod, WriteSpec, EvictPod)):
            out += [(e.ref.name, e.reason, e.message) for e in a.on_success]
    return out


def apply_specs(c: Cluster, d: Decision, refuse: str) -> None:
    """Play the agents: ``refuse``'s observes each spec and reports Degraded; the others
    create what the spec asks for and the kubelet lists it."""
    for a in d.actions:
        if not isinstance(a, WriteSpec):
            continue
        np = c.objs[("NodePartitioning", a.node)]
        np["spec"] = a.spec.model_dump(mode="json")
        gen = np["metadata"]["generation"] + 1
        np["metadata"]["generation"] = gen
        np["metadata"]["resourceVersion"] = str(int(np["metadata"]["resourceVersion"]) + 1)
        st: dict[str, Any] = np["status"]
        st["observedGeneration"] = gen
        if a.node == refuse:
            st["conditions"] = [
                {"type": "Applied", "status": "False", "reason": "Degraded"},
                {
                    "type": "Degraded",
                    "status": "True",
                    "reason": "CreateFailed",
                    "message": "GPU 0: creating 7g.80gb failed: Insufficient Resources",
                },
            ]
            continue
        st["gpus"] = [
            {
                "index": g["index"],
                "migEnabled": True,
                "mig": [
                    {"profile": m["profile"], "start": m["start"], "used": False} for m in g["mig"]
                ],
            }
            for g in np["spec"]["gpus"]
        ]
        st["conditions"] = [{"type": "Applied", "status": "True"}]
        c.objs[("Node", a.node)] = with_alloc(c.objs[("Node", a.node)], **{"7g_80gb": 1})


def test_a_degraded_node_cools_down_and_its_pod_is_planned_elsewhere() -> None:
    """n1's agent refuses the spec (Degraded).  The promise was dropped, and the next plan put
    the pod on n1 again and wrote the refused layout again, every batch window (206
    reserve/drop pairs in 4 h) while n2 stood empty."""
    c = Cluster(
        node("n1", ONE_GPU),
        applied_np("n1", status_gpu(0)),
        node("n2", ONE_GPU),
        applied_np("n2", status_gpu(0)),
        gated("p", SEVEN_G),
    )
    seen: list[tuple[str, str, str]] = []
    for t in range(0, 1800, 10):
        d = c.step(T0 + t)
        seen += all_events(d)
        apply_specs(c, d, refuse="n1")
        r = reservation(c, "p")
        if r is not None and r.state is State.RELEASED:
            break
    r = reservation(c, "p")
    assert r is not None and r.state is State.RELEASED and r.node == "n2", seen
    reserved_on_n1 = [m for n, why, m in seen if n == "p" and why == "Reserved" and "n1" in m]
    assert len(reserved_on_n1) <= 1, reserved_on_n1
    (cool,) = [m for n, why, m in seen if n == "n1" and why == "DegradedCooldown"]
    assert "CreateFailed" in cool and "Insufficient Resources" in cool


def _cpu_pod(name: str, node_name: str, cpu: str) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}],
        },
        "status": {"phase": "Running"},
    }


def test_a_gated_pod_whose_cpu_was_taken_is_planned_elsewhere_not_pinned() -> None:
    """p is promised n1's free 1g while n1's kubelet has not listed it yet; a CPU-only pod
    then binds on n1 and takes every CPU.  p was released (pinned) to n1 all the same, where
    kube-scheduler can never bind it, though n2 had a free 1g and CPU."""
    p = gated("p", ONE_G)
    p["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "4"
    free = status_gpu(0, *(("1g.10gb", s, False) for s in range(7)))
    busy = status_gpu(0, *(("1g.10gb", s, True) for s in range(7)))
    c = Cluster(
        with_alloc(node("n1", ONE_GPU), **{"1g_10gb": 0}),
        applied_np("n1", free),
        with_alloc(node("n2", ONE_GPU), **{"1g_10gb": 7}),
        applied_np("n2", busy),
        p,
    )
    for i in range(7):
        c.put(running(f"r{i}", "n2", ONE_G))
    c.step(T0)
    r = reservation(c, "p")
    assert r is not None and r.node == "n1" and r.state is State.PLANNED
    c.put(_cpu_pod("hog", "n1", "16"))  # n1 has 16 CPUs (test_partitioner_snapshot.node)
    del c.objs[("Pod", "ns/r0")]  # one n2 pod ends: its 1g is free
    c.objs[("NodePartitioning", "n2")] = applied_np(
        "n2", status_gpu(0, *(("1g.10gb", s, s != 0) for s in range(7)))
    )
    c.objs[("Node", "n1")] = with_alloc(node("n1", ONE_GPU), **{"1g_10gb": 7})
    d = c.step(T0 + 20)
    r = reservation(c, "p")
    assert r is not None and r.node == "n2", r
    (why,) = [m for n, e, m in all_events(d) if n == "p" and e == "ReservationDropped"]
    assert "no longer has the CPU (4000m)" in why


def test_a_released_mig_pod_keeps_every_free_instance_it_may_be_given() -> None:
    """The ledger expects a released 1g pod on the busiest GPU (GPU 0), but the agent's
    preferred allocation gives it the GPU that alone covers it with the fewest free devices
    (GPU 1's 1g@4), and the kubelet may give any free device.  A plan in the same step made
    GPU 1 a 3g for q, destroying 1g@4 under r: one promise broken either way."""
    from node_agent.deviceplugin import preferred_allocation

    g0 = status_gpu(
        0, ("4g.40gb", 0, True), ("1g.10gb", 4, False), ("1g.10gb", 5, False), ("1g.10gb", 6, False)
    )
    g1 = status_gpu(1, ("2g.20gb", 0, True), ("1g.10gb", 4, False))
    n1 = with_alloc(node("n1", MIG), **{"1g_10gb": 4, "4g_40gb": 1, "2g_20gb": 1})
    c = Cluster(n1, applied_np("n1", g0, g1), gated("q", "nvidia.com/mig-3g.40gb", created=T0 - 60))
    c.put(running("a", "n1", "nvidia.com/mig-4g.40gb"))
    c.put(running("b", "n1", "nvidia.com/mig-2g.20gb"))
    c.step(T0 - 10)
    c.put(gated("r", ONE_G, created=T0 - 1))
    d = c.step(T0)
    r = reservation(c, "r")
    assert r is not None and r.state is State.RELEASED
    free = ["gpu0-1g-4", "gpu0-1g-5", "gpu0-1g-6", "gpu1-1g-4"]
    assert preferred_allocation(free, [], 1, lambda dev: dev.split("-")[0]) == ["gpu1-1g-4"]
    for a in d.actions:
        if isinstance(a, WriteSpec):
            for g in a.spec.gpus:
                if g.index == 1:  # whatever the plan does, the 1g r may get stays
                    assert ("1g.10gb", 4) in [(m.profile, m.start) for m in g.mig], a.spec


def test_reserved_is_told_only_with_the_patch_that_reserves() -> None:
    """A free slice the kubelet lists: one patch reserves and releases the pod.  ``Reserved``
    was a standalone Event, posted even when that patch was refused (409, 404)."""
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        gated("p", ONE_G),
    )
    d = c.step(T0 + 5)
    standalone = [a.reason for a in d.actions if isinstance(a, EmitEvent)]
    assert "Reserved" not in standalone
    (patch,) = [a for a in d.actions if isinstance(a, PatchPod) and a.pod == "ns/p"]
    assert [e.reason for e in patch.on_success] == ["Reserved", "Released"]


def test_a_pod_whose_only_node_cannot_be_planned_is_told_why() -> None:
    """The only node p may use holds a spec its agent never applies (no pod planned there):
    p's only Event was ``Gated``, and the node had no condition (a review's c6)."""
    np1 = applied_np("n1", status_gpu(0))
    np1["spec"]["planId"] = "5"
    np1["metadata"]["generation"] = 3
    np1["metadata"]["annotations"]["gpuslice.io/planned-at"] = f"{T0 - 10:.3f}"
    c = Cluster(node("n1", ONE_GPU), np1, gated("p", SEVEN_G))
    told: list[tuple[int, str]] = []
    problems = {}
    for t in range(0, 900, 30):
        d = c.step(T0 + t)
        told += [(t, m) for n, e, m in all_events(d) if n == "p" and e == "Waiting"]
        problems = dict(d.problems)
    assert told and "n1 (applying a previous plan)" in told[0][1]
    assert "n1 (ApplyStuck)" in told[-1][1] and told[-1][0] >= 300 - 10  # past the deadline
    assert len(told) == 2  # told when the reason changes, not every step
    assert problems["n1"].reason == "ApplyStuck" and "plan 5" in problems["n1"].message


def test_a_pod_asking_for_another_resource_goes_only_where_a_node_offers_it() -> None:
    """p asks for a 1g and ``rdma/hca``.  Only the slice, CPU and memory were checked, so p was
    released (pinned) to n1, which has no ``rdma/hca``, where kube-scheduler can never bind it,
    holding n1's only free 1g for good; n2 offers both."""
    p = gated("p", ONE_G)
    p["spec"]["containers"][0]["resources"]["limits"]["rdma/hca"] = "1"
    n1 = with_alloc(node("n1", ONE_GPU), **{"1g_10gb": 2})  # busier: the packing choice
    n2 = with_alloc(node("n2", ONE_GPU), **{"1g_10gb": 1})
    n2["status"]["allocatable"]["rdma/hca"] = "1000"
    busy = status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, True))
    c = Cluster(
        n1,
        applied_np("n1", busy),
        n2,
        applied_np("n2", status_gpu(0, ("1g.10gb", 0, False))),
        running("r", "n1", ONE_G),
        p,
    )
    c.step(T0 + 5)
    r = reservation(c, "p")
    assert r is not None and r.node == "n2" and r.state is State.RELEASED


def test_a_pod_asking_for_what_no_node_offers_is_told_and_given_back() -> None:
    p = gated("p", ONE_G)
    p["spec"]["containers"][0]["resources"]["limits"]["example.com/nic"] = "1"
    n1 = with_alloc(node("n1", ONE_GPU), **{"1g_10gb": 1})
    c = Cluster(n1, applied_np("n1", status_gpu(0, ("1g.10gb", 0, False))), p)
    d = c.step(T0 + 5)
    assert reservation(c, "p") is None
    (why,) = [m for n, e, m in all_events(d) if n == "p" and e == "Unplaceable"]
    assert "advertises what else it asks for (example.com/nic: 1)" in why
    c.step(T0 + 70)  # a batch window later: kube-scheduler's to place (or to report)
    assert "schedulingGates" not in c.pod("p")["spec"] and reservation(c, "p") is None


def test_a_degraded_node_cools_down_only_for_the_plan_it_refused() -> None:
    """n1 is Degraded about GPU 1 (an XID); p's hold on a free 1g of GPU 0 breaks because a
    pod kube-scheduler bound took it.  That is churn, not the refusal: the node stays open."""
    two = {**MIG, "nvidia.com/gpu.count": "2"}
    np1 = applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1))
    np1["status"]["conditions"] = [
        {"type": "Applied", "status": "False", "reason": "Degraded"},
        {
            "type": "Degraded",
            "status": "True",
            "reason": "XidError",
            "message": "GPU 1: Xid 79 (fallen off the bus); its layout is not applied",
        },
    ]
    c = Cluster(with_alloc(node("n1", two), **{"1g_10gb": 0}), np1, gated("p", ONE_G))
    c.step(T0 + 5)
    assert reservation(c, "p") is not None
    c.put(running("other", "n1", ONE_G))
    np1["status"]["gpus"][0]["mig"][0]["used"] = True
    d = c.step(T0 + 15)
    seen = all_events(d)
    assert [e for n, e, _ in seen if n == "p"] == ["ReservationDropped"]
    assert not [e for _, e, _ in seen if e == "DegradedCooldown"]


def test_a_node_switching_mode_is_not_reported_stuck() -> None:
    """A node relabelled MIG -> MPS: the switch carried no planned-at, so the last plan's time
    (an hour ago) was read as its age and the node was ``ApplyStuck`` at once."""
    from simulations.replay.kube_rules import merge_patch

    np1 = applied_np("n1", status_gpu(0, ("1g.10gb", 0, True)), status_gpu(1))
    np1["metadata"]["annotations"]["gpuslice.io/planned-at"] = f"{T0 - 3600:.3f}"
    n1 = node("n1", {**MIG, "gpuslice.io/partitioning": "mps"})
    c = Cluster(n1, np1, running("busy", "n1", ONE_G))
    d = c.step(T0)
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    assert w.planned_at == T0
    ann = {"gpuslice.io/planned-pods": "[]", "gpuslice.io/planned-at": f"{w.planned_at:.3f}"}
    spec = w.spec.model_dump(mode="json")
    obj = merge_patch(np1, {"metadata": {"annotations": ann}, "spec": spec})
    obj["metadata"]["generation"] += 1
    c.put(obj)
    d = c.step(T0 + 20)
    assert "n1" not in d.problems
