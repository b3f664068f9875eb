"""A node whose device plugin is gone gets no promise, and its planned pods go elsewhere.

When a node agent (the device plugin) stops, the kubelet marks its devices unhealthy and fails
every Allocate (``UnexpectedAdmissionError``); kube-scheduler sees allocatable 0 only after the
kubelet's next status sync, and a pod bound meanwhile is refused.  The node's last
NodePartitioning status still shows free slices.  A refusal of a pod gpuslice released cools the
node down (else the next pods released there could fail too: a Job fails for good after its
backoffLimit of such failures); a kubelet that lists none of what bound pods hold, or for
``plugin_lag_s`` none of the slices the agent reports, keeps promises off the node
(``DevicePluginGone``) and, once that has lasted the lag, gives its planned pods back (else they
would wait for the kubelet to list the slices until their apply deadline, again and again).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
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
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import node

from partitioner.actions import EmitEvent, PatchPod, SetNodeCondition
from partitioner.decide import ControllerState
from partitioner.index import admission_rejection
from partitioner.reservations import RESERVATION_ANNOTATION, State

PLUGIN_GONE = {
    "phase": "Failed",
    "reason": "UnexpectedAdmissionError",
    "message": "Allocate failed due to no healthy devices present; cannot allocate unhealthy "
    "devices nvidia.com/mig-1g.10gb, which is unexpected",
}


def _two_nodes() -> Cluster:
    """n1: two free 1g instances, allocatable; n2: an applied, empty node."""
    free = status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False))
    return Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 2}),
        node("n2", MIG),
        applied_np("n1", free, status_gpu(1)),
        applied_np("n2", status_gpu(0), status_gpu(1)),
        gated("a", ONE_G, created=T0),
    )


def _refuse(c: Cluster, name: str, status: dict[str, Any] = PLUGIN_GONE) -> None:
    """The kubelet of the pod's node refuses it: bound there, then Failed."""
    pod = c.pod(name)
    r = reservation(c, name)
    pod["spec"]["nodeName"] = r.node
    pod["status"] = dict(status)
    pod["metadata"]["resourceVersion"] = str(int(pod["metadata"]["resourceVersion"]) + 1)


def _planned_on(
    c: Cluster, name: str, node_name: str, plan: str = "7", resource: str = ONE_G
) -> None:
    c.pod(name)["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {
                "node": node_name,
                "state": "planned",
                "gpus": {resource: [1]},
                "plan": plan,
                "since": T0,
                "deadline": T0 + 300,
            }
        )
    }


def test_a_refused_release_cools_the_node_and_gives_its_planned_pods_back() -> None:
    c = _two_nodes()
    c.step(T0 + 1)
    assert reservation(c, "a").node == "n1" and reservation(c, "a").state is State.RELEASED
    _refuse(c, "a")
    c.put(gated("b", ONE_G, created=T0 + 2))  # would take n1's other free slice
    c.put(gated("planned", ONE_G, created=T0))
    _planned_on(c, "planned", "n1")
    d = c.step(T0 + 3)

    (pod_event,) = events(d, "AdmissionRejected")[:1]
    assert "kubelet of node n1 refused" in pod_event and "UnexpectedAdmissionError" in pod_event
    kinds = sorted(
        a.ref.kind
        for a in d.actions
        if isinstance(a, EmitEvent) and a.reason == "AdmissionRejected"
    )
    assert kinds == ["Node", "Pod"]
    assert d.state.cooldown["n1"] == T0 + 1 + 300  # from its release
    assert reservation(c, "planned") is None  # given back at once, not at its deadline
    (dropped,) = events(d, "ReservationDropped")
    assert "refused the pod released there" in dropped
    assert reservation(c, "b") is None  # n1's free slice is not promised again
    assert c.pod("b")["spec"]["schedulingGates"]

    d = c.step(T0 + 4)  # told once
    assert events(d, "AdmissionRejected") == []
    assert d.state.cooldown["n1"] == T0 + 1 + 300  # from its release


def test_without_the_rule_the_next_pod_is_released_to_the_same_node() -> None:
    """The failure the rule prevents, shown on the same cluster: a refusal that is not an
    admission failure (the pod ran and failed) leaves n1 in use."""
    c = _two_nodes()
    c.step(T0 + 1)
    _refuse(c, "a", {"phase": "Failed", "reason": "Error", "message": "exit code 1"})
    c.put(gated("b", ONE_G, created=T0 + 2))
    d = c.step(T0 + 3)
    assert events(d, "AdmissionRejected") == [] and "n1" not in d.state.cooldown
    assert reservation(c, "b").node == "n1" and reservation(c, "b").state is State.RELEASED


def test_an_ungated_pod_refused_there_cools_nothing() -> None:
    """Only a promise gpuslice made and the kubelet broke is evidence against the node: a pod
    kube-scheduler placed alone can be refused for a stale allocatable any day."""
    c = _two_nodes()
    stray = gated("stray", ONE_G)
    del stray["spec"]["schedulingGates"]
    stray["spec"]["nodeName"] = "n1"
    stray["status"] = {"phase": "Failed", "reason": f"OutOf{ONE_G}", "message": "no room"}
    c.put(stray)
    d = c.step(T0 + 1)
    assert events(d, "AdmissionRejected") == [] and "n1" not in d.state.cooldown
    assert reservation(c, "a").node == "n1"


def test_after_the_cooldown_the_node_is_used_again() -> None:
    c = _two_nodes()
    c.step(T0 + 1)
    _refuse(c, "a")
    c.step(T0 + 3)
    c.put(gated("b", ONE_G, created=T0 + 2))
    c.step(T0 + 200)
    assert reservation(c, "b") is None or reservation(c, "b").node != "n1"
    c.put(gated("c", ONE_G, created=T0 + 400))
    c.step(T0 + 304)
    promised = {reservation(c, p).node for p in ("b", "c") if reservation(c, p) is not None}
    assert "n1" in promised


def test_a_pod_of_the_same_name_refused_again_is_noticed_again() -> None:
    """A StatefulSet recreates a failed pod under the same name: its second refusal, after the
    cooldown, cools the node again."""
    c = _two_nodes()
    c.step(T0 + 1)
    _refuse(c, "a")
    d = c.step(T0 + 3)
    assert len(events(d, "AdmissionRejected")) == 2  # pod and node
    again = gated("a", ONE_G, created=T0 + 310)
    again["metadata"]["uid"] = "uid-a-2"
    c.put(again)
    c.step(T0 + 311)  # the cooldown is over: n1's free slice is promised again
    assert reservation(c, "a").node == "n1" and reservation(c, "a").state is State.RELEASED
    _refuse(c, "a")
    d = c.step(T0 + 312)
    assert len(events(d, "AdmissionRejected")) == 2
    assert d.state.cooldown["n1"] == T0 + 311 + 300  # from its release at T0 + 311


def test_after_a_restart_only_a_recent_refusal_counts() -> None:
    """Failed pods stay for days (a Job keeps them); a partitioner that restarts (its Events
    forgotten) must not cool a node for a refusal long past."""
    c = _two_nodes()
    c.step(T0 + 1)  # released at T0 + 1: bind deadline T0 + 121
    _refuse(c, "a")
    c.state = ControllerState()  # a restart
    d = c.step(T0 + 121 + 300 + 1)
    assert events(d, "AdmissionRejected") == [] and "n1" not in d.state.cooldown
    # a restart within the cooldown cools the node until the running controller would (the
    # refused pod's release + cooldownSeconds), not from its own clock
    c.state = ControllerState()
    d = c.step(T0 + 300)
    assert d.state.cooldown["n1"] == T0 + 301
    c.state = ControllerState()
    d = c.step(T0 + 301)
    assert events(d, "AdmissionRejected") == [] and "n1" not in d.state.cooldown


def _plugin_gone() -> Cluster:
    """n1's agent reported a used 7g (pod ``a``) and a free one; its kubelet lists no 7g (the
    device plugin is gone); n2 is empty.  A gated 7g pod ``p`` waits."""
    seven = "nvidia.com/mig-7g.80gb"
    used, free = status_gpu(0, ("7g.80gb", 0, True)), status_gpu(1, ("7g.80gb", 0, False))
    running = gated("a", seven)
    del running["spec"]["schedulingGates"]
    running["spec"]["nodeName"] = "n1"
    running["status"] = {"phase": "Running"}
    c = Cluster(
        node("n1", MIG),
        node("n2", MIG),
        applied_np("n1", used, free),
        applied_np("n2", status_gpu(0), status_gpu(1)),
        running,
        gated("p", seven, created=T0),
    )
    c.kubelet_lists_bound = False
    return c


def test_no_promise_goes_where_the_kubelet_lists_none_of_what_bound_pods_hold() -> None:
    """An agent that stopped leaves this once the kubelet synced: its last status shows a
    free 7g, but the kubelet lists no 7g though pod ``a`` holds one.  The free 7g is not
    promised (it could never be released), the node says why, and the pod is planned on n2."""
    c = _plugin_gone()
    d = c.step(T0 + 1)
    assert reservation(c, "p") is None  # no fast path onto n1's free 7g
    (cond,) = [a for a in d.actions if isinstance(a, SetNodeCondition)]
    assert (cond.node, cond.status, cond.reason) == ("n1", "False", "DevicePluginGone")
    assert "hold nvidia.com/mig-7g.80gb but its kubelet lists none" in cond.message
    assert d.counts["nodes_unserved"] == 1
    d = c.step(T0 + 12)  # the window closes: planned, on n2 only
    assert d.plan is not None and reservation(c, "p").node == "n2"


def test_when_the_kubelet_lists_the_devices_again_the_node_is_served() -> None:
    c = _plugin_gone()
    c.step(T0 + 1)
    n1 = c.objs[("Node", "n1")]
    n1["status"]["allocatable"]["nvidia.com/mig-7g.80gb"] = "2"  # the plugin registered
    d = c.step(T0 + 2)
    assert reservation(c, "p").node == "n1" and reservation(c, "p").state is State.RELEASED
    assert "nodes_unserved" not in d.counts


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (PLUGIN_GONE, "UnexpectedAdmissionError: Allocate failed"),
        (
            {"phase": "Failed", "reason": f"OutOf{ONE_G}", "message": "Node didn't have enough"},
            f"OutOf{ONE_G}: Node didn't have enough",
        ),
        ({"phase": "Failed", "reason": "OutOfcpu"}, "OutOfcpu"),
        ({"phase": "Failed", "reason": "Evicted", "message": "memory pressure"}, ""),
        ({"phase": "Running", "reason": "UnexpectedAdmissionError"}, ""),
        ({"phase": "Failed"}, ""),
    ],
)
def test_admission_rejection_reads_the_kubelets_reasons(
    status: dict[str, Any], expected: str
) -> None:
    assert admission_rejection(status).startswith(expected)
    assert bool(admission_rejection(status)) == bool(expected)


def _stale_free_slices() -> Cluster:
    """n1's agent reported two free 1g instances, nothing is bound there, and its kubelet lists
    none (its device plugin stopped after the status was written); n2 is applied and empty."""
    free = status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False))
    c = Cluster(
        node("n1", MIG),
        node("n2", MIG),
        applied_np("n1", free, status_gpu(1)),
        applied_np("n2", status_gpu(0), status_gpu(1)),
        gated("a", ONE_G, created=T0),
    )
    return c


def _conditions(d: Any) -> dict[str, SetNodeCondition]:
    return {a.node: a for a in d.actions if isinstance(a, SetNodeCondition)}


def test_free_slices_the_kubelet_never_lists_are_given_up_after_the_lag() -> None:
    """Nothing bound shows the plugin is gone, so at first the free slice is promised (a new
    layout is listed only at the kubelet's next sync); once the kubelet has listed none of the
    agent's slices for ``plugin_lag_s`` the node is unserved and the pod is planned on n2, long
    before its apply deadline."""
    c = _stale_free_slices()
    d = c.step(T0 + 1)
    r = reservation(c, "a")
    assert (r.node, r.state) == ("n1", State.PLANNED)  # waiting for the node to advertise it
    assert d.state.unlisted_since == {"n1": T0 + 1}
    assert d.next_wakeup is not None and d.next_wakeup <= T0 + 61
    assert "nodes_unserved" not in d.counts and "n1" not in _conditions(d)

    d = c.step(T0 + 30)  # within the lag: kept, the start remembered
    assert reservation(c, "a").node == "n1" and d.state.unlisted_since == {"n1": T0 + 1}

    d = c.step(T0 + 61)
    assert reservation(c, "a") is None
    (dropped,) = events(d, "ReservationDropped")
    assert "kubelet has listed none of its slices for over 60 s" in dropped
    cond = _conditions(d)["n1"]
    assert (cond.status, cond.reason) == ("False", "DevicePluginGone")
    assert "reports nvidia.com/mig-1g.10gb but its kubelet has listed none" in cond.message
    assert d.counts["nodes_unserved"] == 1

    d = c.step(T0 + 62)
    assert reservation(c, "a") is None  # not promised n1's free slice again
    d = c.step(T0 + 75)  # the batch window closes: planned on n2
    assert d.plan is not None and reservation(c, "a").node == "n2"


def test_without_the_lag_rule_the_pod_waits_for_its_apply_deadline() -> None:
    """The failure the rule prevents, on the same cluster: with a lag longer than the apply
    deadline the pod is still promised n1's slice 200 s on."""
    c = _stale_free_slices()
    patient = replace(CONFIG, plugin_lag_s=10_000)
    c.step(T0 + 1, patient)
    c.step(T0 + 200, patient)
    assert reservation(c, "a").node == "n1"


def test_a_layout_the_kubelet_lists_within_the_lag_is_served() -> None:
    """A new layout is listed at the kubelet's next status sync: within the lag nothing is
    given up, and once listed the node is served and the start forgotten."""
    c = _stale_free_slices()
    c.step(T0 + 1)
    c.objs[("Node", "n1")]["status"]["allocatable"][ONE_G] = "2"  # the kubelet synced
    d = c.step(T0 + 11)
    r = reservation(c, "a")
    assert (r.node, r.state) == ("n1", State.RELEASED)
    assert d.state.unlisted_since == {} and "nodes_unserved" not in d.counts


def test_devices_the_agent_reports_unhealthy_are_not_a_lost_plugin() -> None:
    """The kubelet lists none of a node's devices when the agent advertises them all
    Unhealthy (an XID): that is the agent working, not its plugin gone."""
    sick = status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False))
    for m in sick["mig"]:
        m["unhealthy"] = True
    c = Cluster(
        node("n1", MIG),
        applied_np("n1", sick),
        gated("a", ONE_G, created=T0),
    )
    d = c.step(T0 + 1)
    d = c.step(T0 + 100)
    assert d.state.unlisted_since == {} and "n1" not in _conditions(d)


def test_planned_pods_on_a_node_whose_kubelet_lists_none_of_what_is_bound_go_elsewhere() -> None:
    """The bound-pod sign keeps new promises off at once; a pod planned there before is given
    back once it has lasted the lag (a kubelet restart's seconds give nothing back)."""
    c = _plugin_gone()
    c.put(gated("planned", SEVEN_G, created=T0))
    _planned_on(c, "planned", "n1", resource=SEVEN_G)  # n1's free 7g
    d = c.step(T0 + 1)
    assert reservation(c, "planned").node == "n1"
    assert _conditions(d)["n1"].reason == "DevicePluginGone"
    d = c.step(T0 + 61)  # given back and, the window being closed, planned on n2 at once
    assert reservation(c, "planned").node == "n2"
    (dropped,) = events(d, "ReservationDropped")
    assert "listed none of its slices" in dropped
    # one patch per pod: the drop and the new reservation carry the same resourceVersion
    patches = [a.pod for a in d.actions if isinstance(a, PatchPod)]
    assert sorted(patches) == sorted(set(patches))


def test_a_restarted_partitioner_starts_the_lag_over() -> None:
    """The start is this controller's own observation (not the agent's clock): a restart
    forgets it and waits the lag again before giving anything back."""
    c = _stale_free_slices()
    c.step(T0 + 1)
    c.state = ControllerState()
    d = c.step(T0 + 61)
    assert reservation(c, "a").node == "n1" and d.state.unlisted_since == {"n1": T0 + 61}
    c.step(T0 + 121)
    assert reservation(c, "a") is None
