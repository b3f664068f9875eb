"""Drains under priorities, lost GPUs, CPU taken since, bursts and deep queues.

Found by a review of fair waiting (issue 9 item 4): a lower-priority pod's drain kept a free
slice from a higher-priority pod; a drain on a GPU index the node no longer has, or whose
emptied GPUs its pod could no longer use (CPU taken since), froze GPUs for good; a burst that a
single plan serves ended a drain that had nearly emptied its GPU; a pod that alone makes the
queue deep was never drained and never told why.
"""

from __future__ import annotations

import dataclasses
import json
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

from partitioner.reservations import RESERVATION_ANNOTATION, State

THREE_G = "nvidia.com/mig-3g.40gb"
CFG = dataclasses.replace(CONFIG, drain_fraction=0.1, drain_queue_limit=0.1)


def _prio(obj: dict[str, Any], p: int) -> dict[str, Any]:
    obj["spec"]["priority"] = p
    return obj


def test_a_lower_priority_drain_yields_to_a_higher_priority_pod_that_may_use_the_node() -> None:
    """n01 GPU 0 holds a free 1g beside a used 3g; ``low`` (priority 0, 7g) drains it; ``high``
    (priority 1000, 1g) arrives: the drain ends and ``high`` gets the free 1g."""
    free0 = status_gpu(0, ("1g.10gb", 0, False), ("3g.40gb", 4, True))
    objs: list[dict[str, Any]] = [
        with_alloc(node("n01", MIG), **{"1g_10gb": 1}),
        applied_np("n01", free0, status_gpu(1, ("3g.40gb", 0, True), ("3g.40gb", 4, True))),
        _prio(gated("low", SEVEN_G, created=T0), 0),
        _prio(running("a", "n01", THREE_G), 1000),
        _prio(running("b", "n01", THREE_G, THREE_G), 1000),
    ]
    for i in range(2, 11):
        n = f"n{i:02d}"
        full = (status_gpu(g, ("3g.40gb", 0, True), ("3g.40gb", 4, True)) for g in (0, 1))
        objs += [
            node(n, MIG),
            applied_np(n, *full),
            _prio(running(f"r{i}", n, *[THREE_G] * 4), 1000),
        ]
    c = Cluster(*objs)
    for t in (600, 611, 650):
        c.step(T0 + t, CFG)
    r = reservation(c, "low")
    assert r is not None and r.state is State.DRAINING and r.node == "n01"
    c.put(_prio(gated("high", ONE_G, created=T0 + 700), 1000))
    d = c.step(T0 + 701, CFG)
    (dropped,) = events(d, "ReservationDropped")
    assert "higher priority (1000 > 0)" in dropped and "ns/high" in dropped
    for t in range(702, 1000, 20):
        c.step(T0 + t, CFG)
    got = reservation(c, "high")
    assert got is not None and got.node == "n01" and got.state is not State.DRAINING


def test_a_drain_on_a_gpu_the_node_no_longer_has_is_dropped() -> None:
    one_gpu = {**MIG, "nvidia.com/gpu.count": "1"}
    big = gated("big", SEVEN_G, created=T0)
    big["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {"node": "n1", "state": "draining", "gpus": {SEVEN_G: [1]}, "since": T0 + 650}
        )
    }
    c = Cluster(
        node("n1", one_gpu),
        applied_np("n1", status_gpu(0, ("3g.40gb", 4, True))),
        big,
        running("a", "n1", THREE_G),
    )
    d = c.step(T0 + 700)
    (why,) = events(d, "ReservationDropped")
    assert "no longer has GPU(s) 1 drained for it" in why
    r = reservation(c, "big")
    assert r is None or r.gpus != {SEVEN_G: (1,)}


def test_emptied_drained_gpus_the_pod_cannot_use_now_are_given_back() -> None:
    """``big`` asks 8 CPU; n01 GPU 0 was drained for it and has emptied, but a CPU-only pod
    took n01's CPU since: the drain ends (it froze the empty GPU for good)."""
    big = gated("big", SEVEN_G, created=T0)
    big["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "8"}
    big["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {"node": "n1", "state": "draining", "gpus": {SEVEN_G: [0]}, "since": T0 + 650}
        )
    }
    cpu = running("cpu-hog", "n1")
    cpu["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "60"}}
    c = Cluster(
        node("n1", {**MIG, "nvidia.com/gpu.count": "1"}),
        applied_np("n1", status_gpu(0)),
        big,
        cpu,
    )
    d = c.step(T0 + 700)
    (why,) = events(d, "ReservationDropped")
    assert "drained for it on node n1 are empty but" in why and "cpu" in why.lower()


def test_a_pod_that_alone_makes_the_queue_deep_is_told_it_is_not_drained() -> None:
    """One 2 x 7g pod on 8 busy GPUs: 2 units > the queue limit 1 (0.1 x 8, at least 1)."""
    pair = gated("pair", SEVEN_G, created=T0)
    pair["spec"]["containers"][0]["resources"]["limits"] = {SEVEN_G: "2"}
    objs: list[dict[str, Any]] = [pair]
    for i in range(1, 5):
        n = f"n{i:02d}"
        full = (status_gpu(g, ("3g.40gb", 0, True), ("3g.40gb", 4, True)) for g in (0, 1))
        objs += [
            node(n, {**MIG, "nvidia.com/gpu.count": "2"}),
            applied_np(n, *full),
            running(f"r{i}", n, *[THREE_G] * 4),
        ]
    c = Cluster(*objs)
    told: list[str] = []
    for t in range(0, 2000, 60):
        told += events(c.step(T0 + t, CFG), "NotDrained")
    (message,) = told
    assert (
        "drainQueueLimit 0.1" in message
        and "raise partitioner.reservations.drainQueueLimit" in message
    )
    assert reservation(c, "pair") is None


def test_a_deep_queue_ends_a_drain_only_once_it_has_lasted_a_batch_window() -> None:
    """A burst the next plan serves is no overload: the drain stays through it; a queue still
    deep a batch window later ends it, as before."""
    free0 = status_gpu(0, ("1g.10gb", 0, False), ("3g.40gb", 4, True))
    objs: list[dict[str, Any]] = [
        with_alloc(node("n01", MIG), **{"1g_10gb": 1}),
        applied_np("n01", free0, status_gpu(1, ("3g.40gb", 0, True), ("3g.40gb", 4, True))),
        gated("low", SEVEN_G, created=T0),
        running("a", "n01", THREE_G),
        running("b", "n01", THREE_G, THREE_G),
    ]
    for i in range(2, 11):
        n = f"n{i:02d}"
        full = (status_gpu(g, ("3g.40gb", 0, True), ("3g.40gb", 4, True)) for g in (0, 1))
        objs += [node(n, MIG), applied_np(n, *full), running(f"r{i}", n, *[THREE_G] * 4)]
    c = Cluster(*objs)
    for t in (600, 611, 650):
        c.step(T0 + t, CFG)
    assert (r := reservation(c, "low")) is not None and r.state is State.DRAINING
    for k in range(3):  # 4 units, 2.3 GPUs wait for 20 GPUs: deeper than the limit of 2
        c.put(gated(f"burst{k}", THREE_G, created=T0 + 700))
    window = CFG.policy.timeout
    d = c.step(T0 + 701, CFG)
    assert not events(d, "ReservationDropped")
    assert d.next_wakeup is not None and d.next_wakeup <= T0 + 701 + window
    d = c.step(T0 + 701 + window, CFG)  # nothing could serve the burst: still deep
    (dropped,) = events(d, "ReservationDropped")
    assert "a deep queue" in dropped
