"""A gated pod gpuslice can never place is given back to kube-scheduler, not held forever.

Clusters adopt gpuslice node by node: beside the opted-in nodes there are often MIG nodes where
NVIDIA's device plugin (``mixed`` strategy) advertises a static layout.  The webhook gates every
pod that asks for a MIG profile, whatever node it targets; a pod whose nodeSelector, affinity
or tolerations match no opted-in node (or only nodes that can never serve it) would otherwise
stay gated for good, and neither kube-scheduler nor the cluster autoscaler would ever see it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_partitioner_promises import (
    MIG,
    ONE_G,
    T0,
    Cluster,
    applied_np,
    events,
    gated,
    reservation,
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import A100, node

from partitioner.actions import PatchPod
from partitioner.gating import GATE

STATIC = {**A100, "nvidia.com/mig.strategy": "mixed", "pool": "static"}
"""A MIG node that is not opted in: NVIDIA's device plugin advertises its instances."""


def cluster(*pods: dict[str, Any], extra: tuple[dict[str, Any], ...] = ()) -> Cluster:
    return Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        with_alloc(node("s1", STATIC), **{"1g_10gb": 7}),
        *extra,
        *pods,
    )


def gates(c: Cluster, name: str) -> list[dict[str, str]]:
    return list(c.pod(name)["spec"].get("schedulingGates") or [])


GRACE = 60.0
"""The test config's batch window timeout: a pod is given back once it has existed this long."""


def test_a_pod_that_targets_a_node_not_opted_in_loses_the_gate() -> None:
    c = cluster(gated("p", ONE_G, nodeSelector={"pool": "static"}))
    d = c.step(T0 + 5)
    # within its first batch window: told why, still gated, and the controller wakes up then
    assert gates(c, "p") == [{"name": GATE}]
    (why,) = events(d, "Unplaceable")
    assert "no eligible node" in why
    assert d.next_wakeup is not None and d.next_wakeup <= T0 + GRACE
    d = c.step(T0 + GRACE)
    assert gates(c, "p") == []
    assert reservation(c, "p") is None
    (message,) = events(d, "Ungated")
    assert "no opted-in MIG node matches" in message and "kube-scheduler" in message
    # Ungated, it is no candidate of gpuslice's any more: later steps leave it alone.
    d = c.step(T0 + 400)
    assert not [a for a in d.actions if isinstance(a, PatchPod) and a.pod == "ns/p"]


def test_other_gates_stay_when_gpuslice_gives_a_pod_back() -> None:
    kueue = {"name": "kueue.x-k8s.io/admission"}
    p = gated("p", ONE_G, nodeSelector={"pool": "static"})
    p["spec"]["schedulingGates"] = [kueue, {"name": GATE}]
    p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"  # a request error
    c = cluster(p)
    c.step(T0 + GRACE)
    assert gates(c, "p") == [kueue]


def test_a_pod_asking_for_a_profile_no_opted_in_gpu_has_loses_the_gate() -> None:
    # 1g.5gb is an A100-40GB profile; the opted-in node is an 80 GB A100
    c = cluster(gated("p", "nvidia.com/mig-1g.5gb"))
    d = c.step(T0 + GRACE)
    assert gates(c, "p") == []
    (message,) = events(d, "Ungated")
    assert "1g.5gb" in message


def test_a_pod_an_opted_in_node_with_unreadable_gpus_matches_stays_gated() -> None:
    # The node is opted in but its GPU labels are not readable yet (no product label): once
    # they are, it may serve the pod, which keeps its gate and its place in the queue.
    unread = node("u1", {"gpuslice.io/partitioning": "mig", "pool": "static"})
    c = cluster(gated("p", ONE_G, nodeSelector={"pool": "static"}), extra=(unread,))
    d = c.step(T0 + 10 * GRACE)
    assert gates(c, "p") == [{"name": GATE}]
    assert events(d, "Ungated") == []


def test_a_pod_an_opted_in_node_can_serve_keeps_the_gate_and_gets_its_slice() -> None:
    c = cluster(gated("p", ONE_G))
    d = c.step(T0 + 5)
    assert events(d, "Ungated") == []
    r = reservation(c, "p")
    assert r is not None and r.node == "n1"


@pytest.mark.parametrize(
    ("pause", "told"),
    [
        ({"unschedulable": True}, "cordoned (spec.unschedulable)"),
        (
            {"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]},
            "tainted node.kubernetes.io/not-ready:NoSchedule",
        ),
        (
            {"taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]},
            "tainted node.kubernetes.io/unreachable:NoExecute",
        ),
    ],
)
def test_a_pod_kept_from_its_node_by_a_cordon_or_a_lifecycle_taint_keeps_the_gate(
    pause: dict[str, Any], told: str
) -> None:
    """A cordon (a driver upgrade behind ``kubectl drain``) or the node lifecycle controller's
    taints (a reboot) end: the pod is told, keeps its gate, and gets its slice once the node is
    back.  Given back, a gate never returns."""
    c = cluster(gated("p", ONE_G, nodeSelector={"gpuslice.io/partitioning": "mig"}))
    n1 = copy.deepcopy(c.objs[("Node", "n1")])
    paused = copy.deepcopy(n1)
    paused["spec"].update(pause)
    c.put(paused)
    d = c.step(T0 + 5)
    (why,) = events(d, "Unplaceable")
    assert f"node n1, which the pod would fit, is {told}" in why
    d = c.step(T0 + 10 * GRACE)
    assert gates(c, "p") == [{"name": GATE}]
    assert events(d, "Ungated") == []
    c.put(n1)  # back
    c.step(T0 + 11 * GRACE)
    r = reservation(c, "p")
    assert r is not None and r.node == "n1"


def test_a_cordoned_node_that_could_never_serve_the_pod_does_not_keep_it() -> None:
    # 1g.5gb is an A100-40GB profile: the cordoned 80 GB node is no reason to wait.
    c = cluster(gated("p", "nvidia.com/mig-1g.5gb"))
    paused = copy.deepcopy(c.objs[("Node", "n1")])
    paused["spec"]["unschedulable"] = True
    c.put(paused)
    d = c.step(T0 + GRACE)
    assert gates(c, "p") == []
    (message,) = events(d, "Ungated")
    assert "cordoned" not in message


@pytest.mark.parametrize(
    ("resource", "amount", "daemonset", "told"),
    [
        ("cpu", "1", False, "asks gpuslice for no slice"),
        ("nvidia.com/gpu", "1", False, "asks gpuslice for no slice"),
        ("nvidia.com/mig-1g.10gb", "0", False, "asks gpuslice for no slice"),
        ("nvidia.com/mig-1g.10gb", "1", True, "a DaemonSet's pod"),
    ],
)
def test_a_pod_created_with_the_gate_that_gpuslice_would_never_gate_loses_it_at_once(
    resource: str, amount: str, daemonset: bool, told: str
) -> None:
    """The webhook gates neither a pod asking for no slice nor a DaemonSet's pod, but a
    manifest copied from a gated pod carries the gate, and only gpuslice removes it."""
    p = gated("p", resource)
    p["spec"]["containers"][0]["resources"]["limits"] = {resource: amount}
    if daemonset:
        p["metadata"]["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "x"}
        ]
    c = cluster(p)
    d = c.step(T0 + 1)
    assert gates(c, "p") == []
    (message,) = events(d, "Ungated")
    assert told in message and "ResourceClaims" not in message
