"""A restarted partitioner cools a node for a refused pod until the running one does.

A pod released to a node whose kubelet then refused it at admission cools the node down
(:meth:`partitioner.decide._Step.notice_rejections`).  The cooldown lives in the running
controller's :class:`~partitioner.decide.ControllerState`; a restarted controller starts with
none and reads the refusal again from the failed pod.  Were the cooldown counted from the step
that noticed the refusal, the restart would cool the node from *its* now, after the running
controller's cooldown had ended, and give back the pods the running controller had planned
there since: a restart must reach the decisions the running controller makes from the same API
objects (tests/test_partitioner_promise_soundness.py, property 3).  So the cooldown is anchored
on the refused pod's release (its reservation's ``since``), which both read from the pod.
"""

from __future__ import annotations

import pytest
from test_partitioner_admission_rejected import PLUGIN_GONE
from test_partitioner_promises import (
    CONFIG,
    GATE,
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

from partitioner.actions import PatchPod, WriteSpec
from partitioner.decide import ControllerState, Decision, decide
from partitioner.reservations import State

RELEASED_AT = T0 + 1
NOTICED_AT = T0 + 3
"""The running controller's first step after the kubelet refused ``a`` (released at T0 + 1)."""


def _refused() -> Cluster:
    """n1 (the only node): GPU 0 with two free 1g instances, GPU 1 empty.  Pod ``a`` is
    released to n1 at T0 + 1 and refused there by its kubelet; the running controller notices
    it at T0 + 3 and cools n1 down."""
    n1 = with_alloc(node("n1", MIG), **{"1g_10gb": 2})
    free = status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False))
    c = Cluster(n1, applied_np("n1", free, status_gpu(1)), gated("a", ONE_G, created=T0))
    c.step(RELEASED_AT)
    r = reservation(c, "a")
    assert (r.node, r.state, r.since) == ("n1", State.RELEASED, RELEASED_AT)
    pod = c.pod("a")
    pod["spec"]["nodeName"] = "n1"
    pod["status"] = dict(PLUGIN_GONE)
    pod["metadata"]["resourceVersion"] = str(int(pod["metadata"]["resourceVersion"]) + 1)
    d = c.step(NOTICED_AT)
    assert len(events(d, "AdmissionRejected")) == 2  # the pod and the node
    assert "n1" in d.state.cooldown
    return c


def _restarted(c: Cluster, now: float) -> Decision:
    """What a controller restarted just before ``now`` decides on the same objects."""
    return decide(ControllerState(), c.index(), now, CONFIG)


def _unreserved(d: Decision) -> set[str]:
    return {a.pod for a in d.actions if isinstance(a, PatchPod) and a.purpose == "unreserve"}


def test_a_pod_planned_after_the_cooldown_is_kept_by_a_restarted_controller() -> None:
    """The running controller's cooldown ends; it plans ``b`` on n1 (a spec for its 7g); a
    restart while n1 applies it must not cool n1 again and give ``b`` back."""
    c = _refused()
    until = c.state.cooldown["n1"]
    assert NOTICED_AT < until <= NOTICED_AT + CONFIG.cooldown_s
    c.put(gated("b", SEVEN_G, created=until + 1))
    c.step(until + 1)  # opens the batch window
    d = c.step(until + 12)  # the window closes: planned on n1, which gets a spec
    (spec,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    r = reservation(c, "b")
    assert (spec.node, r.node, r.state) == ("n1", "n1", State.PLANNED)
    np_obj = c.objs[("NodePartitioning", "n1")]  # the spec landed; the agent is applying it
    np_obj["metadata"]["generation"] = 3
    np_obj["spec"] = spec.spec.model_dump(mode="json")

    now = until + 20  # both stepped at the same time, on the same objects
    running = decide(c.state, c.index(), now, CONFIG)
    restarted = _restarted(c, now)
    assert _unreserved(running) == set() and "n1" not in running.state.cooldown
    assert _unreserved(restarted) == _unreserved(running)  # b keeps its promise on n1
    assert reservation(c, "b").node == "n1"
    assert "n1" not in restarted.state.cooldown
    assert events(restarted, "AdmissionRejected") == []  # an old refusal: told no more
    assert c.pod("b")["spec"]["schedulingGates"] == [{"name": GATE}]  # still waits for n1


@pytest.mark.parametrize("after", [0, 1, 50, 117, 118, 119, 200, 297, 298, 299, 300, 301, 400])
def test_a_restart_cools_the_node_until_the_running_controller_does(after: float) -> None:
    """At any time after the refusal was noticed, a restart cools n1 exactly as long as the
    running controller does (or not at all once its cooldown has ended)."""
    c = _refused()
    now = NOTICED_AT + after
    running = decide(c.state, c.index(), now, CONFIG)
    restarted = _restarted(c, now)
    assert restarted.state.cooldown.get("n1") == running.state.cooldown.get("n1")


def test_the_cooldown_is_counted_from_the_refused_pods_release() -> None:
    """The one time both controllers read the same: the refused pod's reservation ``since``
    (its release; the kubelet refuses a pod when it is bound, right after its release)."""
    c = _refused()
    assert c.state.cooldown["n1"] == RELEASED_AT + CONFIG.cooldown_s
    d = c.step(RELEASED_AT + CONFIG.cooldown_s - 1)  # told once, cooled as before
    assert events(d, "AdmissionRejected") == []
    assert d.state.cooldown["n1"] == RELEASED_AT + CONFIG.cooldown_s
    d = c.step(RELEASED_AT + CONFIG.cooldown_s)
    assert "n1" not in d.state.cooldown
