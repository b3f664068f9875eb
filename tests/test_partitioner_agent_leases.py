"""A node whose agent stopped renewing its heartbeat Lease gets no promise; its planned pods go.

The operator lists the agents' Leases (:mod:`partitioner.agent_leases`): an agent is silent once
the partitioner has seen its Lease's ``renewTime`` unchanged for longer than the Lease's
duration, by the partitioner's own clock.  The decision step then treats the node as unserved
(``AgentSilent``) whatever its status and allocatable still show, busy or not.
"""

from __future__ import annotations

import json
from typing import Any

from test_partitioner_promises import (
    MIG,
    ONE_G,
    T0,
    Cluster,
    applied_np,
    events,
    gated,
    np,
    reservation,
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import node

from partitioner.actions import SetNodeCondition
from partitioner.agent_leases import LEASE_SELECTOR, AgentLeases
from partitioner.reservations import RESERVATION_ANNOTATION, State


def lease(
    node_name: str, renew: str, duration: Any = 40, labelled: bool = True
) -> dict[str, Any]:
    labels = {"app.kubernetes.io/component": "agent-lease"} if labelled else {}
    return {
        "metadata": {"name": f"gpuslice-agent-{node_name}", "labels": labels},
        "spec": {
            "holderIdentity": node_name,
            "leaseDurationSeconds": duration,
            "renewTime": renew,
        },
    }


def test_an_agent_is_silent_once_its_renew_time_stood_still_for_its_duration() -> None:
    leases = AgentLeases()
    assert leases.observe([lease("n1", "a"), lease("n2", "a")], 100.0) == frozenset()
    assert leases.observe([lease("n1", "b"), lease("n2", "a")], 130.0) == frozenset()
    assert leases.observe([lease("n1", "c"), lease("n2", "a")], 140.0) == frozenset()  # 40 s
    assert leases.observe([lease("n1", "d"), lease("n2", "a")], 141.0) == {"n2"}
    assert leases.observe([lease("n1", "d"), lease("n2", "b")], 150.0) == frozenset()  # renewed


def test_the_partitioners_clock_counts_not_the_agents() -> None:
    """A renewTime far in the past or future means nothing: only whether it changes."""
    leases = AgentLeases()
    leases.observe([lease("n1", "1999-01-01T00:00:00.000000Z")], 0.0)
    assert leases.observe([lease("n1", "2099-01-01T00:00:00.000000Z")], 35.0) == frozenset()
    assert leases.observe([lease("n1", "2099-01-01T00:00:00.000000Z")], 76.0) == {"n1"}


def test_a_first_sight_counts_as_renewed_and_a_gone_lease_as_no_information() -> None:
    leases = AgentLeases()
    assert leases.observe([lease("n1", "old")], 1000.0) == frozenset()  # a restart: wait
    assert leases.observe([lease("n1", "old")], 1041.0) == {"n1"}
    assert leases.observe([], 1042.0) == frozenset()  # the Lease was deleted: not judged


def test_objects_that_are_not_agent_leases_are_ignored() -> None:
    leases = AgentLeases()
    odd = [
        lease("n1", "a", labelled=False),  # another Lease (a node's, the leader's)
        lease("n2", "a", duration=0),
        lease("n3", "a", duration="40"),
        lease("n4", "a", duration=True),
        {"metadata": {"labels": {"app.kubernetes.io/component": "agent-lease"}}, "spec": {}},
    ]
    leases.observe(odd, 0.0)
    assert leases.observe(odd, 1000.0) == frozenset()
    assert LEASE_SELECTOR == "app.kubernetes.io/component=agent-lease"


def _silent_cluster() -> Cluster:
    """n1 applied two free 1g instances its kubelet lists; n2 is empty.  Pod ``planned`` was
    planned on n1 (a new spec, generation 3, not applied yet); pod ``a`` waits."""
    free = status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False))
    busy = applied_np("n1", free, status_gpu(1))
    busy["metadata"]["generation"] = 3  # a spec written, not observed yet
    planned = gated("planned", ONE_G, created=T0)
    planned["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {
                "node": "n1",
                "state": "planned",
                "gpus": {ONE_G: [1]},
                "plan": "7",
                "since": T0,
                "deadline": T0 + 300,
            }
        )
    }
    return Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 2}),
        node("n2", MIG),
        busy,
        np("n2", plan="1", generation=2, observed=2, applied=True, gpus=[status_gpu(0)]),
        planned,
        gated("a", ONE_G, created=T0),
    )


def test_a_silent_agents_node_gives_its_planned_pods_back_before_the_apply_deadline() -> None:
    c = _silent_cluster()
    c.step(T0 + 1)
    assert reservation(c, "planned").node == "n1"  # the agent may still apply
    c.silent_agents = frozenset({"n1"})
    d = c.step(T0 + 60)
    r = reservation(c, "planned")
    assert r is None or r.node != "n1"
    assert any("has stopped renewing its Lease" in m for m in events(d, "ReservationDropped"))
    (cond,) = [a for a in d.actions if isinstance(a, SetNodeCondition) and a.node == "n1"]
    assert (cond.status, cond.reason) == ("False", "AgentSilent")
    assert "gpuslice-agent-<node>" in cond.message
    assert d.counts["nodes_unserved"] == 1
    c.step(T0 + 61)  # the batch window closes: both planned on n2, none on n1's free slice
    assert (reservation(c, "a").node, reservation(c, "planned").node) == ("n2", "n2")

    c.silent_agents = frozenset()  # it renews again
    d = c.step(T0 + 131)
    assert "nodes_unserved" not in d.counts


def test_without_a_silent_agent_the_planned_pod_waits_for_the_apply_deadline() -> None:
    """The same cluster with the agent renewing: the pod stays planned on n1 until its
    deadline (what a stopped agent costs without the Lease)."""
    c = _silent_cluster()
    c.step(T0 + 1)
    c.step(T0 + 200)
    r = reservation(c, "planned")
    assert (r.node, r.state) == ("n1", State.PLANNED)
