"""Priority preemption for gated pods: gpuslice must not take kube-scheduler's away.

A gated pod is invisible to kube-scheduler, so its preemption never acts for it.  Without
gpuslice (or under nos, which gates nothing) a high-priority pod whose slice lower-priority
pods hold gets them evicted at once; kept gated, it would wait for them to end.  The decision
step hands such a pod to kube-scheduler (step 7b), and keeps the slice a preemption frees for
the pod kube-scheduler nominated.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from test_partitioner_promises import (
    CONFIG,
    MIG,
    ONE_G,
    SEVEN_G,
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

from partitioner.actions import WriteSpec
from partitioner.gating import GATE
from partitioner.reservations import State
from partitioner.settings import PartitionerSettings

PLAN_AT = T0 + 61
"""After the test config's batch window (60 s): the batch is planned."""
HIGH = 1000


def with_priority(pod: dict[str, Any], priority: int) -> dict[str, Any]:
    pod["spec"]["priority"] = priority
    return pod


def full_of_7g(*pods: dict[str, Any], victims_priority: int = 0) -> Cluster:
    """Node n1: two GPUs, one ``7g`` instance each, both used by running pods of priority
    ``victims_priority``; plus ``pods``."""
    return Cluster(
        with_alloc(node("n1", MIG), **{"7g_80gb": 2}),
        applied_np("n1", status_gpu(0, ("7g.80gb", 0, True)), status_gpu(1, ("7g.80gb", 0, True))),
        with_priority(running("low0", "n1", SEVEN_G), victims_priority),
        with_priority(running("low1", "n1", SEVEN_G), victims_priority),
        *pods,
    )


def gates(c: Cluster, name: str) -> list[dict[str, str]]:
    return list(c.pod(name)["spec"].get("schedulingGates") or [])


def test_a_high_priority_pod_whose_slice_lower_priority_pods_hold_is_handed_to_preemption() -> None:
    c = full_of_7g(with_priority(gated("urgent", SEVEN_G), HIGH))
    c.step(T0 + 5)  # within the batch window: gpuslice may still find it a slice
    assert gates(c, "urgent") == [{"name": GATE}]
    d = c.step(PLAN_AT)
    assert d.plan is not None and "ns/urgent" in d.plan.unplaced
    assert gates(c, "urgent") == []
    assert reservation(c, "urgent") is None
    (message,) = events(d, "Preempting")
    assert message.startswith("no free slice fits it and no plan can make one")
    assert f"lower-priority pods hold {SEVEN_G} on node n1: " in message
    assert "kube-scheduler can preempt them" in message
    assert d.counts["preempting"] == 1
    # no longer gpuslice's to release: later steps neither gate, drain nor reserve it
    d = c.step(PLAN_AT + 3600)
    assert events(d, "Draining") == [] and reservation(c, "urgent") is None


def test_no_pod_is_handed_to_preemption_on_a_node_whose_kubelet_lists_none_of_its_slices() -> None:
    """n1's agent stopped: its kubelet lists no 7g though its low-priority victims hold two.
    Evicting them frees nothing kube-scheduler could bind there (allocatable 0), so the pod,
    which the plan could not place on n2 (full of pods it does not outrank), stays gated and
    gpuslice's to plan, instead of going to kube-scheduler for a preemption that cannot help."""
    c = full_of_7g(with_priority(gated("urgent", SEVEN_G), HIGH))
    for obj in (
        with_alloc(node("n2", MIG), **{"7g_80gb": 2}),
        applied_np("n2", status_gpu(0, ("7g.80gb", 0, True)), status_gpu(1, ("7g.80gb", 0, True))),
        with_priority(running("peer0", "n2", SEVEN_G), HIGH),
        with_priority(running("peer1", "n2", SEVEN_G), HIGH),
    ):
        c.put(obj)
    c.kubelet_lists_bound = False
    c.objs[("Node", "n1")]["status"]["allocatable"].pop(SEVEN_G)
    c.step(T0 + 5)  # the batch window opens
    d = c.step(PLAN_AT)
    assert d.plan is not None and "ns/urgent" in d.plan.unplaced
    assert events(d, "Preempting") == [] and "preempting" not in d.counts
    assert gates(c, "urgent") == [{"name": GATE}]
    c.objs[("Node", "n1")]["status"]["allocatable"][SEVEN_G] = "2"  # the plugin is back
    for t in range(int(PLAN_AT) + 1, int(PLAN_AT) + 120, 5):
        d = c.step(t)
        if events(d, "Preempting"):
            break
    assert "on node n1" in events(d, "Preempting")[0] and gates(c, "urgent") == []


def test_a_pod_that_never_preempts_keeps_waiting_gated_and_may_be_drained() -> None:
    c = full_of_7g(with_priority(gated("polite", SEVEN_G, preemptionPolicy="Never"), HIGH))
    drains: list[str] = []
    for t in range(int(PLAN_AT), int(T0) + 800, 10):
        d = c.step(t)
        assert events(d, "Preempting") == []
        drains += events(d, "Draining")
    assert gates(c, "polite") == [{"name": GATE}]
    assert len(drains) == 1  # it waits the drain wait, as before, and gets a drain
    assert reservation(c, "polite").state is State.DRAINING


def test_equal_priority_is_no_reason_to_preempt() -> None:
    c = full_of_7g(with_priority(gated("same", SEVEN_G), 5), victims_priority=5)
    d = c.step(PLAN_AT)
    assert gates(c, "same") == [{"name": GATE}]
    assert events(d, "Preempting") == []


def test_only_exact_slices_count_as_kube_scheduler_counts_them() -> None:
    """Lower-priority pods hold ``1g`` instances on the only GPU: evicting them would not give
    kube-scheduler a ``7g`` device (the GPU would have to be repartitioned), so the pod waits."""
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 7}),
        applied_np("n1", status_gpu(0, *[("1g.10gb", s, True) for s in range(7)])),
        *[running(f"small{s}", "n1", ONE_G) for s in range(7)],
        with_priority(gated("urgent", SEVEN_G), HIGH),
    )
    d = c.step(PLAN_AT)
    assert gates(c, "urgent") == [{"name": GATE}]
    assert events(d, "Preempting") == []


def test_a_free_slice_or_a_plan_comes_before_any_preemption() -> None:
    """With a free ``7g`` instance on a third GPU nobody is evicted: the pod is reserved it."""
    c = Cluster(
        with_alloc(node("n1", {**MIG, "nvidia.com/gpu.count": "3"}), **{"7g_80gb": 3}),
        applied_np(
            "n1",
            status_gpu(0, ("7g.80gb", 0, True)),
            status_gpu(1, ("7g.80gb", 0, True)),
            status_gpu(2, ("7g.80gb", 0, False)),
        ),
        running("low0", "n1", SEVEN_G),
        running("low1", "n1", SEVEN_G),
        with_priority(gated("urgent", SEVEN_G), HIGH),
    )
    d = c.step(T0 + 1)
    assert events(d, "Preempting") == []
    assert reservation(c, "urgent").state is State.RELEASED


def test_preemption_off_keeps_the_pod_gated() -> None:
    c = full_of_7g(with_priority(gated("urgent", SEVEN_G), HIGH))
    d = c.step(PLAN_AT, replace(CONFIG, preemption=False))
    assert gates(c, "urgent") == [{"name": GATE}]
    assert events(d, "Preempting") == []


def test_the_slice_a_preemption_frees_stays_for_the_nominated_pod() -> None:
    """kube-scheduler evicted ``low0`` for ``urgent`` and nominated n1: the ``7g`` instance on
    GPU 0 is free now, and an older gated pod of lower priority waits for a ``7g``.  Promised
    to it, the slice would be fought over (kube-scheduler keeps it for the nominated pod, so the
    released pod would not bind); repartitioned, the nominated pod would never bind."""
    urgent = with_priority(gated("urgent", SEVEN_G), HIGH)
    urgent["spec"]["schedulingGates"] = []
    urgent["status"] = {
        "phase": "Pending",
        "nominatedNodeName": "n1",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
    }
    c = Cluster(
        with_alloc(node("n1", MIG), **{"7g_80gb": 2}),
        applied_np("n1", status_gpu(0, ("7g.80gb", 0, False)), status_gpu(1, ("7g.80gb", 0, True))),
        running("low1", "n1", SEVEN_G),
        urgent,
        gated("older", SEVEN_G, created=T0 - 600),
    )
    for t in (T0, PLAN_AT, PLAN_AT + 120, PLAN_AT + 600):
        d = c.step(t)
        r = reservation(c, "older")  # a drain may start (a wait), never a promise
        assert r is None or r.state is State.DRAINING, (t, r)
        assert events(d, "Reserved") == []
        assert not [a for a in d.actions if isinstance(a, WriteSpec)]  # GPU 0's 7g is kept
    assert gates(c, "older") == [{"name": GATE}]
    # once the nominated pod is bound the node is full and nothing is held for it any more
    urgent_bound = c.pod("urgent")
    urgent_bound["spec"]["nodeName"] = "n1"
    urgent_bound["status"] = {"phase": "Running"}
    del c.objs[("Pod", "ns/low1")]
    c.put(
        applied_np("n1", status_gpu(0, ("7g.80gb", 0, True)), status_gpu(1, ("7g.80gb", 0, False)))
    )
    c.step(PLAN_AT + 200)
    r = reservation(c, "older")
    assert r is not None and r.node == "n1" and dict(r.gpus) == {SEVEN_G: (1,)}


def test_the_setting_reaches_the_decision_step() -> None:
    settings = PartitionerSettings(metrics_port=0, health_port=0, preemption=False)
    assert settings.decide_config(CONFIG.catalog).preemption is False
    assert (
        PartitionerSettings(metrics_port=0, health_port=0).decide_config(CONFIG.catalog).preemption
    )


def test_no_more_pods_are_handed_over_than_the_victims_can_make_room_for() -> None:
    """Three high-priority pods, one lower-priority victim (the other GPU's pod outranks them):
    one pod is handed to kube-scheduler; the others stay gated, with gpuslice's promises, since
    a removed gate cannot come back."""
    c = Cluster(
        with_alloc(node("n1", MIG), **{"7g_80gb": 2}),
        applied_np("n1", status_gpu(0, ("7g.80gb", 0, True)), status_gpu(1, ("7g.80gb", 0, True))),
        with_priority(running("low", "n1", SEVEN_G), 0),
        with_priority(running("vip", "n1", SEVEN_G), 5000),
        *[with_priority(gated(f"u{i}", SEVEN_G, created=T0 + i), HIGH) for i in range(3)],
    )
    c.step(T0 + 5)
    d = c.step(PLAN_AT)
    assert len(events(d, "Preempting")) == 1
    assert [gates(c, f"u{i}") for i in range(3)] == [[], [{"name": GATE}], [{"name": GATE}]]


def test_the_index_keeps_the_lowest_priority_of_the_pods_holding_slices() -> None:
    """What the preemption pass stops at (a candidate at or below it outranks no slice pod):
    bound, unfinished pods with slices count; it follows binds, finishes, replacements and
    deletions."""
    c = full_of_7g(victims_priority=7)
    index = c.index()
    assert index.lowest_slice_priority() == 7
    cpu_only = running("cpu", "n1")
    index.upsert_pod(with_priority(cpu_only, -50))  # holds no slice: not counted
    index.upsert_pod(with_priority(gated("waiting", SEVEN_G), -40))  # not bound: not counted
    assert index.lowest_slice_priority() == 7
    low = with_priority(running("low2", "n1", SEVEN_G), 3)
    index.upsert_pod(low)
    assert index.lowest_slice_priority() == 3
    done = dict(low, status={"phase": "Succeeded"})
    done["metadata"] = dict(low["metadata"], resourceVersion="2")
    index.upsert_pod(done)  # finished: it holds nothing any more
    assert index.lowest_slice_priority() == 7
    index.apply("pods", "DELETED", c.pod("low0"))
    index.apply("pods", "DELETED", c.pod("low1"))
    assert index.lowest_slice_priority() == 0  # none left


def test_the_pass_stops_at_the_first_candidate_outranking_no_slice_pod() -> None:
    """Candidates of priority 5 and 1 beside victims of priority 3: the higher one is handed
    to preemption, the lower one stays gated (the pass stops before it)."""
    c = full_of_7g(
        with_priority(gated("high", SEVEN_G), 5),
        with_priority(gated("low", SEVEN_G), 1),
        victims_priority=3,
    )
    c.step(T0 + 5)  # the batch window opens
    d = c.step(PLAN_AT)
    assert gates(c, "high") == [] and gates(c, "low") == [{"name": GATE}]
    assert d.counts["preempting"] == 1
