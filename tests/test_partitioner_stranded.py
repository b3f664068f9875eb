"""A released pod that cannot bind where it is pinned is evicted for its controller to recreate.

A released pod's node affinity names one node, and Kubernetes forbids widening it, so when that
node is gone, stops accepting the pod (cordoned, tainted) or stays unserved (its agent silent,
its device plugin gone), only a new pod can be planned elsewhere.  The decision step reports it
``Stranded`` at once and, once that has lasted ``recreate_stranded_s`` by its own clock, evicts
it if a controller owns it (:class:`~partitioner.actions.EvictPod`, preconditions uid and
resourceVersion); a bare pod, or any pod with the setting 0, is only reported.
"""

from __future__ import annotations

import dataclasses
import json
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
    with_alloc,
)
from test_partitioner_snapshot import node

from partitioner.actions import EvictPod, PatchPod, WriteSpec
from partitioner.decide import ControllerState, Decision
from partitioner.gating import GATE
from partitioner.reservations import RESERVATION_ANNOTATION

AFTER = CONFIG.recreate_stranded_s
JOB = [{"apiVersion": "batch/v1", "kind": "Job", "name": "train", "controller": True}]


def released(
    name: str, node_name: str, owners: list[dict[str, Any]] | None = JOB
) -> dict[str, Any]:
    """A pod released to ``node_name`` at T0 (gate gone, affinity pinned there, not bound)."""
    pod = gated(name, ONE_G)
    pod["spec"].pop("schedulingGates")
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchFields": [
                            {"key": "metadata.name", "operator": "In", "values": [node_name]}
                        ]
                    }
                ]
            }
        }
    }
    if owners is not None:
        pod["metadata"]["ownerReferences"] = owners
    pod["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {
                "node": node_name,
                "state": "released",
                "gpus": {ONE_G: [0]},
                "since": T0,
                "deadline": T0 + 120,
            }
        )
    }
    return pod


def np_n2() -> dict[str, Any]:
    """n2's NodePartitioning: two empty MIG GPUs, applied."""
    return applied_np("n2", status_gpu(0), status_gpu(1))


def evictions(d: Decision) -> list[EvictPod]:
    return [a for a in d.actions if isinstance(a, EvictPod)]


def gone_node_cluster(pod: dict[str, Any]) -> Cluster:
    """``pod`` was released to n1, which is gone; n2 has room."""
    return Cluster(node("n2", MIG), applied_np("n2", status_gpu(0), status_gpu(1)), pod)


def test_a_stranded_pod_a_controller_owns_is_evicted_once_that_has_lasted_the_setting() -> None:
    c = gone_node_cluster(released("p", "n1"))
    d = c.step(T0 + 5)
    (msg,) = events(d, "Stranded")
    assert "node n1 is gone" in msg
    assert (
        f"evicted once it has been stranded for {AFTER:.0f} s, so that its controller (Job train)"
        in msg
    )
    assert not evictions(d) and d.counts["stranded"] == 1
    assert d.next_wakeup is not None and d.next_wakeup <= T0 + 5 + AFTER
    d = c.step(T0 + 5 + AFTER - 1)
    assert not evictions(d) and not events(d, "Stranded")  # told once
    d = c.step(T0 + 5 + AFTER)
    (ev,) = evictions(d)
    pod = c.pod("p")
    assert (ev.pod, ev.ref.uid, ev.resource_version) == (
        "ns/p",
        pod["metadata"]["uid"],
        pod["metadata"]["resourceVersion"],
    )
    (told,) = ev.on_success
    assert told.reason == "StrandedEvicted" and "Job train" in told.message
    assert d.counts["evicted"] == 1


def test_the_eviction_is_a_wakeup_so_a_caller_stepping_on_changes_only_gets_there() -> None:
    """The simulator steps only on changes and at ``next_wakeup``: the eviction must be one."""
    c = gone_node_cluster(released("p", "n1"))
    d = c.step(T0 + 5)
    seen = 0
    while not evictions(d):
        assert d.next_wakeup is not None and seen < 20
        d = c.step(d.next_wakeup)
        seen += 1
    assert d.next_wakeup is None or d.next_wakeup > T0 + 5 + AFTER - 1
    assert c.state.stranded_since  # still recorded until the pod is gone


def test_a_bare_pod_is_never_evicted_and_the_event_asks_for_a_delete() -> None:
    c = gone_node_cluster(released("p", "n1", owners=None))
    (msg,) = events(c.step(T0 + 5), "Stranded")
    assert "delete the pod so its controller recreates it" in msg and "evicted" not in msg
    assert not evictions(c.step(T0 + 5 + 10 * AFTER))


def test_daemonset_pods_and_non_controller_owners_are_not_evicted() -> None:
    for owners in (
        [{"kind": "DaemonSet", "name": "ds", "controller": True}],
        [{"kind": "ConfigMap", "name": "cm"}],  # an owner that does not control it
    ):
        c = gone_node_cluster(released("p", "n1", owners=owners))
        c.step(T0 + 5)
        assert not evictions(c.step(T0 + 5 + 2 * AFTER))


def test_with_the_setting_zero_nothing_is_evicted() -> None:
    config = dataclasses.replace(CONFIG, recreate_stranded_s=0)
    c = gone_node_cluster(released("p", "n1"))
    (msg,) = events(c.step(T0 + 5, config), "Stranded")
    assert "delete the pod" in msg
    assert not evictions(c.step(T0 + 5 + 10 * AFTER, config))


def test_a_restart_starts_the_wait_over() -> None:
    c = gone_node_cluster(released("p", "n1"))
    c.step(T0 + 5)
    c.step(T0 + 5 + AFTER - 10)
    c.state = ControllerState()  # the partitioner restarted: nothing remembered
    assert not evictions(c.step(T0 + 5 + AFTER))  # its wait starts now
    assert not evictions(c.step(T0 + 5 + 2 * AFTER - 1))
    assert evictions(c.step(T0 + 5 + 2 * AFTER))


def silent_cluster() -> Cluster:
    """``p`` was released to n1's free 1g (its kubelet lists it); n2 has room."""
    free = status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False))
    return Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 2}),
        applied_np("n1", free, status_gpu(1)),
        node("n2", MIG),
        applied_np("n2", status_gpu(0), status_gpu(1)),
        released("p", "n1"),
    )


def test_a_pod_released_to_a_node_whose_agent_went_silent_is_evicted_if_it_stays_silent() -> None:
    c = silent_cluster()
    d = c.step(T0 + 5)
    assert not events(d, "Stranded")  # the agent renews: it may still bind
    c.silent_agents = frozenset({"n1"})
    d = c.step(T0 + 10)
    (msg,) = events(d, "Stranded")
    assert "has stopped renewing its Lease" in msg
    assert "unless it binds there first (the node serves again)" in msg
    assert not evictions(d)
    assert evictions(c.step(T0 + 10 + AFTER))


def test_a_pod_whose_node_serves_again_in_time_is_kept_and_its_clock_forgotten() -> None:
    c = silent_cluster()
    c.silent_agents = frozenset({"n1"})
    c.step(T0 + 10)
    c.silent_agents = frozenset()  # the agent is back before the eviction
    d = c.step(T0 + 10 + AFTER / 2)
    assert not evictions(d) and "stranded" not in d.counts
    assert not c.state.stranded_since
    c.silent_agents = frozenset({"n1"})  # silent again: a new wait, not the old one's rest
    c.step(T0 + 20 + AFTER / 2)
    assert not evictions(c.step(T0 + 10 + AFTER + 5))
    assert evictions(c.step(T0 + 20 + AFTER / 2 + AFTER))


def test_a_pod_released_to_a_node_that_was_cordoned_is_evicted_after_the_setting() -> None:
    c = silent_cluster()
    n1 = c.objs[("Node", "n1")]
    n1["spec"] = {"unschedulable": True}
    n1["spec"]["taints"] = [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]
    d = c.step(T0 + 5)  # before its bind deadline: it cannot bind there, no need to wait
    (msg,) = events(d, "Stranded")
    assert "no longer accepts it" in msg
    assert not evictions(d)
    assert not evictions(c.step(T0 + 5 + AFTER - 1))
    assert evictions(c.step(T0 + 5 + AFTER))


def test_a_pod_stranded_for_two_reasons_is_told_once_and_evicted_once() -> None:
    """Silent agent and cordoned node, past the bind deadline: one reason is reported (the
    first found), not one Event per reason per step, and one eviction."""
    c = silent_cluster()
    c.silent_agents = frozenset({"n1"})
    c.objs[("Node", "n1")]["spec"] = {
        "unschedulable": True,
        "taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}],
    }
    d = c.step(T0 + 121)
    assert len(events(d, "Stranded")) == 1 and not events(d, "NotBound")
    assert d.counts["stranded"] == 1
    d = c.step(T0 + 122)
    assert not events(d, "Stranded") and not events(d, "NotBound")
    d = c.step(T0 + 121 + AFTER)
    assert len(evictions(d)) == 1


def test_a_claim_pod_bound_to_a_dra_node_whose_agent_went_silent_is_evicted_unless_started() -> (
    None
):
    """DRA mode: the kubelet prepares a bound pod's ResourceClaims through the agent, so a pod
    bound to a node whose agent went silent cannot start.  One that had started runs on, and so
    does one whose sandbox is made (``PodReadyToStartContainers``: its claims were prepared,
    it is pulling its images); in device-plugin mode a bound pod was admitted with its device
    and is left alone too."""
    from test_partitioner_dra import DRA, claim, claim_pod, mig_request

    def bound(name: str, node_name: str, phase: str, claims: bool = True) -> dict[str, Any]:
        pod = claim_pod(name, f"cl-{name}", gate=False) if claims else gated(name, ONE_G)
        pod["spec"].pop("schedulingGates", None)
        pod["spec"]["nodeName"] = node_name
        pod["metadata"]["ownerReferences"] = JOB
        pod["status"] = {"phase": phase}
        return pod

    pulling = bound("pulling", "d1", "Pending")  # its claims prepared: it starts without
    pulling["status"]["conditions"] = [{"type": "PodReadyToStartContainers", "status": "True"}]
    c = Cluster(
        node("d1", DRA),
        applied_np("d1", status_gpu(0, ("3g.40gb", 0, True), ("3g.40gb", 4, True))),
        bound("waiting", "d1", "Pending"),
        claim("cl-waiting", mig_request(), allocated=True),
        bound("running", "d1", "Running"),
        claim("cl-running", mig_request(), allocated=True),
        pulling,
        claim("cl-pulling", mig_request(), allocated=True),
        with_alloc(node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, True)), status_gpu(1)),
        bound("plugin-pod", "n1", "Pending", claims=False),
    )
    assert not events(c.step(T0), "Stranded")  # the agents renew
    c.silent_agents = frozenset({"d1", "n1"})
    d = c.step(T0 + 10)
    (msg,) = events(d, "Stranded")
    assert msg.startswith("bound to node d1 but the gpuslice agent of node d1 has stopped")
    assert "unless the agent is back first, it is evicted" in msg
    assert d.counts["stranded"] == 1
    assert not events(c.step(T0 + 11), "Stranded")  # told once, though it is bound
    (ev,) = evictions(c.step(T0 + 10 + AFTER))
    assert ev.pod == "ns/waiting"


def test_a_claim_pod_whose_claim_the_agent_fails_to_prepare_is_evicted_unless_a_retry_succeeds() -> (
    None
):
    """DRA mode: the agent reports the claims whose last prepare failed
    (``status.prepareFailures``); a pod bound there that has not started and names such a claim
    cannot start until a retry succeeds.  It is stranded at once and evicted after the setting;
    a pod whose claim succeeds meanwhile is kept and its clock forgotten, and a started pod or
    another node's pod naming a claim of the same name is left alone."""
    from test_partitioner_dra import DRA, claim, claim_pod, mig_request

    def bound(name: str, node_name: str, phase: str) -> dict[str, Any]:
        pod = claim_pod(name, f"cl-{name}", gate=False)
        pod["spec"].pop("schedulingGates", None)
        pod["spec"]["nodeName"] = node_name
        pod["metadata"]["ownerReferences"] = JOB
        pod["status"] = {"phase": phase}
        return pod

    def d1(*failed: str) -> dict[str, Any]:
        obj = applied_np("d1", status_gpu(0, ("3g.40gb", 0, True), ("3g.40gb", 4, True)))
        obj["status"]["prepareFailures"] = [
            {
                "claim": f"ns/cl-{n}",
                "uid": f"uid-{n}",
                "message": f"device gpu0-3g.40gb-{n} is unhealthy: XID 79",
                "since": "2026-12-06T18:00:00Z",
            }
            for n in failed
        ]
        return obj

    c = Cluster(
        node("d1", DRA),
        d1(),
        bound("waiting", "d1", "Pending"),
        claim("cl-waiting", mig_request(), allocated=True),
        bound("running", "d1", "Running"),
        claim("cl-running", mig_request(), allocated=True),
        node("d2", DRA),
        applied_np("d2", status_gpu(0, ("3g.40gb", 0, True))),
        bound("elsewhere", "d2", "Pending"),
        claim("cl-elsewhere", mig_request(), allocated=True),
    )
    assert not events(c.step(T0), "Stranded")
    c.put(d1("waiting", "running"))
    d = c.step(T0 + 10)
    (msg,) = events(d, "Stranded")
    assert msg.startswith(
        "bound to node d1 but its agent has failed to prepare ResourceClaim ns/cl-waiting since "
        "2026-12-06T18:00:00Z (device gpu0-3g.40gb-waiting is unhealthy: XID 79): the kubelet "
        "retries the prepare, so it cannot start"
    ), msg
    assert "unless a retry succeeds first, it is evicted" in msg
    assert d.counts["stranded"] == 1
    assert not evictions(c.step(T0 + 9 + AFTER))
    (ev,) = evictions(c.step(T0 + 10 + AFTER))
    assert ev.pod == "ns/waiting"

    # A retry succeeds before the eviction: kept, and a later failure starts a new wait.
    c2 = Cluster(*[o for (k, _), o in c.objs.items() if k != "NodePartitioning"], d1("waiting"))
    c2.put(applied_np("d2", status_gpu(0, ("3g.40gb", 0, True))))
    assert events(c2.step(T0), "Stranded")
    c2.put(d1())
    assert not evictions(c2.step(T0 + AFTER))
    assert not c2.state.stranded_since
    c2.put(d1("waiting"))
    assert not evictions(c2.step(T0 + AFTER + 1))
    assert evictions(c2.step(T0 + 2 * AFTER + 1))

    # A failure reported for an earlier claim of that name (another uid) is not this claim's.
    c3 = Cluster(*[o for (k, _), o in c.objs.items() if k != "NodePartitioning"], d1("waiting"))
    c3.put(applied_np("d2", status_gpu(0, ("3g.40gb", 0, True))))
    recreated = claim("cl-waiting", mig_request(), allocated=True)
    recreated["metadata"]["uid"] = "uid-of-the-new-claim"
    c3.put(recreated)
    assert not events(c3.step(T0), "Stranded")
    recreated["metadata"]["uid"] = "uid-waiting"  # the claim the agent reported
    c3.put(recreated)
    assert events(c3.step(T0 + 1), "Stranded")


def test_a_planned_pod_whose_node_was_cordoned_is_planned_elsewhere_not_released_there() -> None:
    """Released to a cordoned node, the pod would be stranded there (its affinity pinned);
    still gated, it is given back and planned on a node that accepts it."""
    free = status_gpu(0, ("1g.10gb", 0, False))
    pod = gated("p", ONE_G)
    pod["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {
                "node": "n1",
                "state": "planned",
                "gpus": {ONE_G: [0]},
                "plan": "1",
                "since": T0,
                "deadline": T0 + 300,
            }
        )
    }
    n1 = with_alloc(node("n1", MIG), **{"1g_10gb": 1})
    c = Cluster(n1, applied_np("n1", free, status_gpu(1)), node("n2", MIG), np_n2(), pod)
    n1["spec"] = {
        "unschedulable": True,
        "taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}],
    }
    d = c.step(T0 + 5)
    (msg,) = events(d, "ReservationDropped")
    assert "node n1 no longer accepts it (cordoned, tainted or relabelled)" in msg
    assert not [a for a in d.actions if isinstance(a, PatchPod) and a.purpose == "release"]
    c.step(T0 + 6)
    d = c.step(T0 + 70)  # the batch window closes: planned on n2
    (spec,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    assert spec.node == "n2" and reservation(c, "p").node == "n2"
    assert GATE in json.dumps(c.pod("p")["spec"])  # never released to n1


def test_a_pod_released_to_a_node_cordoned_while_it_applies_a_spec_is_stranded_too() -> None:
    """The node is busy (a new spec, not applied yet) when it is cordoned: the released pod's
    check does not wait for the node to finish applying."""
    c = silent_cluster()
    c.objs[("NodePartitioning", "n1")]["metadata"]["generation"] = 3  # applying a new spec
    c.objs[("Node", "n1")]["spec"] = {
        "unschedulable": True,
        "taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}],
    }
    (msg,) = events(c.step(T0 + 5), "Stranded")
    assert "no longer accepts it" in msg


def unschedulable(pod: dict[str, Any]) -> None:
    """kube-scheduler tried ``pod`` and a filter refused its one node (e.g. pod anti-affinity)."""
    pod["status"] = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/2 nodes are available: 1 node(s) didn't match pod anti-affinity "
                "rules, 1 node(s) didn't match Pod's node affinity/selector.",
            }
        ],
    }


def test_a_released_pod_kube_scheduler_cannot_bind_there_is_stranded_after_its_bind_deadline() -> (
    None
):
    """A filter gpuslice does not model (required pod anti-affinity, topology spread, host
    ports, a volume's node affinity) refuses the one node the pod is pinned to: past its bind
    deadline it is stranded and, owned by a controller, evicted to be planned afresh."""
    c = silent_cluster()
    unschedulable(c.pod("p"))
    d = c.step(T0 + 60)  # within the bind deadline (T0 + 120): kube-scheduler may still bind it
    assert not events(d, "Stranded")
    d = c.step(T0 + 125)
    (msg,) = events(d, "Stranded")
    assert "kube-scheduler found it unschedulable there past its bind deadline" in msg
    assert "pod anti-affinity" in msg and "Job train" in msg
    assert not events(d, "NotBound")  # the Stranded Event says it
    assert not evictions(c.step(T0 + 125 + AFTER - 1))
    (ev,) = evictions(c.step(T0 + 125 + AFTER))
    assert ev.pod == "ns/p"


def test_a_released_pod_not_yet_tried_by_kube_scheduler_is_only_told_not_bound() -> None:
    c = silent_cluster()
    d = c.step(T0 + 125)
    assert events(d, "NotBound") and not events(d, "Stranded")
    assert not evictions(c.step(T0 + 125 + 2 * AFTER))


def test_a_released_pod_whose_slice_was_taken_on_a_full_node_is_stranded_after_its_deadline() -> (
    None
):
    """An ungated pod took the slice released to ``p`` on n1, which has no room for another:
    re-planned on n1 alone, it would wait there for as long as n1's pods run, while n2 is
    free.  Past its bind deadline it is stranded, and evicted for its Job to recreate."""
    one_gpu = {**MIG, "nvidia.com/gpu.count": "1"}
    full = status_gpu(0, *(("1g.10gb", s, s != 0) for s in range(7)))  # slot 0 free: p's
    free = status_gpu(0, *(("1g.10gb", s, False) for s in range(7)))
    c = Cluster(
        with_alloc(node("n1", one_gpu), **{"1g_10gb": 7}),
        applied_np("n1", full),
        with_alloc(node("n2", one_gpu), **{"1g_10gb": 7}),
        applied_np("n2", free),
        released("p", "n1"),
        *(running(f"run{i}", "n1", ONE_G) for i in range(1, 7)),
    )
    c.put(running("thief", "n1", ONE_G))  # not gated: kube-scheduler gave it p's slice
    d = c.step(T0 + 5)
    (taken,) = events(d, "SliceTaken")
    assert "pinned to node n1" in taken and not events(d, "Stranded")
    d = c.step(T0 + 125)  # past the bind deadline (T0 + 120), no slice made on the full n1
    (msg,) = events(d, "Stranded")
    assert "no new slice was made for it there by its bind deadline" in msg and "Job train" in msg
    assert not evictions(c.step(T0 + 125 + AFTER - 1))
    (ev,) = evictions(c.step(T0 + 125 + AFTER))
    assert ev.pod == "ns/p"
