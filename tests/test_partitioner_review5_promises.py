"""Promises a review found broken (thirty-sixth session), driven through the real ``decide()``
with the Cluster harness of tests/test_partitioner_promises.py.

1. A gated pod promised a slice that exists was not released while its node applied a spec
   for *another* GPU: a slow agent there made it miss its deadline with its slice listed free
   the whole time (its node cooled down, "did not apply plan -").
2. A pod handed to kube-scheduler's preemption (``Preempting``) or to the autoscaler
   (``ReleasedForScaleUp``) loses its gate without a pin: where allocatable shows room only
   because slices are promised to other pods, kube-scheduler binds it there at once, onto
   another pod's promise, and nobody is preempted."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

from test_partitioner_promises import (
    CONFIG,
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
)
from test_partitioner_snapshot import node

from partitioner.gating import release_patch
from partitioner.reservations import RESERVATION_ANNOTATION, Reservation, State
from simulations.replay.kube_rules import merge_patch

ONE_GPU = {**MIG, "nvidia.com/gpu.count": "1"}
TWO_GPUS = {**MIG, "nvidia.com/gpu.count": "2"}
FOUR_G = "nvidia.com/mig-4g.40gb"


def prio(pod: dict[str, Any], value: int) -> dict[str, Any]:
    pod["spec"]["priority"] = value
    return pod


def busy_n2(gpu1_spec: list[dict[str, Any]], gpu0_spec: list[dict[str, Any]] | None = None):
    """n2: GPU 0 holds 4g@0, 1g@4, 1g@5 used and 1g@6 free (the kubelet lists it); plan 5, in
    flight (written 20 s ago, not observed), asks GPU 1 for ``gpu1_spec`` (GPU 0 as it is, or
    ``gpu0_spec``)."""
    np2 = applied_np(
        "n2",
        status_gpu(
            0,
            ("4g.40gb", 0, True),
            ("1g.10gb", 4, True),
            ("1g.10gb", 5, True),
            ("1g.10gb", 6, False),
        ),
        status_gpu(1),
    )
    np2["spec"]["planId"] = "5"
    if gpu0_spec is not None:
        np2["spec"]["gpus"][0] = {"index": 0, "mig": gpu0_spec}
    np2["spec"]["gpus"][1] = {"index": 1, "mig": gpu1_spec}
    np2["metadata"]["generation"] = 3  # the agent observed 2
    np2["metadata"]["annotations"] = {"gpuslice.io/planned-at": f"{T0 - 20:.3f}"}
    n2 = node("n2", TWO_GPUS)
    n2["status"]["allocatable"].update({FOUR_G: "1", ONE_G: "3"})
    bound = [running("w0", "n2", FOUR_G), running("w1", "n2", ONE_G), running("w2", "n2", ONE_G)]
    return n2, np2, bound


def held(pod: dict[str, Any], node_name: str, since: float) -> dict[str, Any]:
    pod["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {
                "node": node_name,
                "state": "planned",
                "gpus": {ONE_G: [0]},
                "since": since,
                "deadline": since + 300,
                "pod": pod["metadata"]["uid"],
            }
        )
    }
    return pod


def test_a_slice_that_exists_is_released_while_its_node_applies_a_spec_for_another_gpu() -> None:
    n2, np2, bound = busy_n2([{"profile": "7g.80gb", "start": 0}])
    c = Cluster(n2, np2, *bound, held(gated("L", ONE_G, created=T0 - 60), "n2", T0 - 15))
    d = c.step(T0)
    r = reservation(c, "L")
    assert r is not None and r.state is State.RELEASED and r.node == "n2", events(d, "Released")
    assert "schedulingGates" not in c.pod("L")["spec"]


def test_not_while_the_spec_in_flight_changes_a_gpu_holding_its_resource() -> None:
    """The kubelet may hand the pod any free 1g of the node: with the spec in flight
    repartitioning GPU 0 (its 1g@6 becomes part of a new layout), it waits for that spec."""
    gpu0 = [
        {"profile": "4g.40gb", "start": 0},
        {"profile": "1g.10gb", "start": 4},
        {"profile": "1g.10gb", "start": 5},
    ]  # 1g@6 destroyed by plan 5
    n2, np2, bound = busy_n2([{"profile": "7g.80gb", "start": 0}], gpu0)
    c = Cluster(n2, np2, *bound, held(gated("L", ONE_G, created=T0 - 60), "n2", T0 - 15))
    c.step(T0)
    r = reservation(c, "L")
    assert r is not None and r.state is State.PLANNED
    assert c.pod("L")["spec"]["schedulingGates"]


def test_a_missed_deadline_names_the_plan_in_flight() -> None:
    gpu0 = [
        {"profile": "4g.40gb", "start": 0},
        {"profile": "1g.10gb", "start": 4},
        {"profile": "1g.10gb", "start": 5},
    ]
    n2, np2, bound = busy_n2([{"profile": "7g.80gb", "start": 0}], gpu0)
    c = Cluster(n2, np2, *bound, held(gated("L", ONE_G, created=T0 - 400), "n2", T0 - 301))
    d = c.step(T0)
    (dropped,) = events(d, "ReservationDropped")
    assert "did not apply plan 5 " in dropped and "plan -" not in dropped


def released(pod: dict[str, Any], node_name: str, since: float) -> dict[str, Any]:
    r = Reservation(node_name, State.RELEASED, {ONE_G: (0,)}, "", since, since + 120)
    patch = release_patch(pod, node_name, {RESERVATION_ANNOTATION: r.to_json()})
    return merge_patch(copy.deepcopy(pod), patch)


def preemption_cluster(l_bound: bool) -> Cluster:
    """n1: seven 1g, all held by priority-0 pods (victims).  n2: its one free 1g released to L
    (priority 1000), bound or not yet.  H (priority 500, 1g) waits."""
    n1 = node("n1", ONE_GPU)
    n1["status"]["allocatable"][ONE_G] = "7"
    np1 = applied_np("n1", status_gpu(0, *(("1g.10gb", s, True) for s in range(7))))
    victims = [prio(running(f"v{s}", "n1", ONE_G), 0) for s in range(7)]
    n2 = node("n2", ONE_GPU)
    n2["status"]["allocatable"].update({FOUR_G: "1", ONE_G: "3"})
    np2 = applied_np(
        "n2",
        status_gpu(
            0,
            ("4g.40gb", 0, True),
            ("1g.10gb", 4, True),
            ("1g.10gb", 5, True),
            ("1g.10gb", 6, l_bound),
        ),
    )
    w = [
        prio(running("w0", "n2", FOUR_G), 2000),
        prio(running("w1", "n2", ONE_G), 2000),
        prio(running("w2", "n2", ONE_G), 2000),
    ]
    lpod = released(prio(gated("L", ONE_G, created=T0 - 60), 1000), "n2", T0 - 5)
    if l_bound:
        lpod["spec"]["nodeName"] = "n2"
        lpod["status"] = {"phase": "Running"}
    h = prio(gated("H", ONE_G, created=T0 - 5), 500)
    return Cluster(n1, np1, *victims, n2, np2, *w, lpod, h)


def first_preempting(c: Cluster) -> list[str]:
    out: list[str] = []
    for t in range(0, 200, 10):
        d = c.step(T0 + t)
        out += events(d, "Preempting")
        if out:
            break
    return out


def test_no_pod_is_handed_over_while_kube_scheduler_would_bind_it_onto_a_promise() -> None:
    """L's released, unbound 1g on n2 is what kube-scheduler would give H, ungated, before
    preempting anyone: H keeps its gate until L binds."""
    c = preemption_cluster(l_bound=False)
    assert first_preempting(c) == []
    assert c.pod("H")["spec"]["schedulingGates"]


def test_once_the_promised_pod_bound_it_is_handed_over_for_preemption() -> None:
    """The same cluster with L bound: no room but the victims' slices, so H is handed over
    (the check above is what held it back, not the rest of the preemption rule)."""
    c = preemption_cluster(l_bound=True)
    (message,) = first_preempting(c)
    assert "node n1" in message
    assert "schedulingGates" not in c.pod("H")["spec"]


def test_scale_up_waits_too_while_a_promise_is_visible_room() -> None:
    cfg = replace(CONFIG, scale_up_after_s=1.0, preemption=False)
    c = preemption_cluster(l_bound=False)
    told: list[str] = []
    for t in range(0, 200, 10):
        told += events(c.step(T0 + t, cfg), "ReleasedForScaleUp")
    assert told == [] and c.pod("H")["spec"]["schedulingGates"]
    c = preemption_cluster(l_bound=True)
    for t in range(0, 200, 10):
        told += events(c.step(T0 + t, cfg), "ReleasedForScaleUp")
    assert len(told) == 1


def test_a_status_written_for_an_earlier_object_of_the_name_is_not_applied() -> None:
    """The NodePartitioning was deleted and created again (generation 1, a new plan) while the
    agent's pass ran; the agent's status patch goes by name and lands on the new object with
    the old object's observedGeneration 7 and Applied=True.  That is not this spec applied:
    the pod planned for it keeps its promise until the agent reports on the new object (before,
    the plan read as applied, the pod's slice as missing, and its promise was dropped)."""
    n1 = node("n1", ONE_GPU)
    np1 = applied_np("n1", status_gpu(0), generation=7)
    np1["metadata"]["generation"] = 1
    np1["spec"]["planId"] = "9"
    np1["spec"]["gpus"] = [{"index": 0, "mig": [{"profile": "1g.10gb", "start": 0}]}]
    np1["metadata"]["annotations"] = {"gpuslice.io/planned-at": f"{T0 - 5:.3f}"}
    pod = gated("p", ONE_G, created=T0 - 30)
    pod["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {
                "node": "n1",
                "state": "planned",
                "gpus": {ONE_G: [0]},
                "plan": "9",
                "since": T0 - 5,
                "deadline": T0 + 295,
                "pod": "uid-p",
            }
        )
    }
    c = Cluster(n1, np1, pod)
    d = c.step(T0)
    assert not events(d, "ReservationDropped")
    r = reservation(c, "p")
    assert r is not None and r.node == "n1" and r.state is State.PLANNED


def _free_slice_without_cpu(h: dict[str, Any]) -> Cluster:
    """n1: seven 1g held by priority-0 pods.  n2: one free, unpromised 1g, but a CPU-only pod
    holds its CPU; ``h`` asks for a 1g and 4 CPUs."""
    n2 = node("n2", ONE_GPU)
    n2["status"]["allocatable"][ONE_G] = "7"
    np2 = applied_np("n2", status_gpu(0, *(("1g.10gb", s, s < 6) for s in range(7))))
    bound = [running(f"w{s}", "n2", ONE_G) for s in range(6)]
    hog = running("cpuhog", "n2")
    hog["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "15"}}
    h["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "4", ONE_G: "1"}
    n1 = node("n1", ONE_GPU)
    n1["status"]["allocatable"][ONE_G] = "7"
    np1 = applied_np("n1", status_gpu(0, *(("1g.10gb", s, True) for s in range(7))))
    full = [prio(running(f"v{s}", "n1", ONE_G), 0) for s in range(7)]
    return Cluster(n1, np1, *full, n2, np2, *bound, hog, h)


def test_a_free_slice_on_a_node_without_the_pods_cpu_does_not_hold_back_a_hand_over() -> None:
    """kube-scheduler cannot bind the pod where its CPU does not fit, so that slice is no
    reason to keep it gated (a review of the rule above: it kept a priority pod from
    preemption and the autoscaler for good)."""
    c = _free_slice_without_cpu(prio(gated("H", ONE_G, created=T0 - 5), 1000))
    (message,) = first_preempting(c)
    assert "node n1" in message
    cfg = replace(CONFIG, scale_up_after_s=30.0, preemption=False)
    c = _free_slice_without_cpu(gated("H", ONE_G, created=T0 - 5))
    told: list[str] = []
    for t in range(0, 200, 10):
        told += events(c.step(T0 + t, cfg), "ReleasedForScaleUp")
    assert len(told) == 1


def test_claim_pods_gated_before_dra_planning_was_turned_off_are_given_back_at_once() -> None:
    """helm upgrade to dra.publish=all: the partitioner no longer lists ResourceClaims, so a
    claim pod gated before was told its (existing) claim "does not exist" and held a batch
    window; it is given back at once, told why."""
    from test_partitioner_dra import DRA, claim_pod
    from test_partitioner_snapshot import np as np_obj

    c = Cluster(node("d1", DRA), np_obj("d1"), claim_pod("p", "cl"))
    d = c.step(T0, replace(CONFIG, claims_watched=False))
    assert not events(d, "WaitingForClaims")
    (told,) = events(d, "Ungated")
    assert "does not plan ResourceClaims" in told and "dra.publish=all" in told
    assert "schedulingGates" not in c.pod("p")["spec"]
    c = Cluster(node("d1", DRA), np_obj("d1"), claim_pod("p", "cl"))
    d = c.step(T0)  # planning claims: an unknown claim is waited for, as before
    assert events(d, "WaitingForClaims") and c.pod("p")["spec"]["schedulingGates"]
