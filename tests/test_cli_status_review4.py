"""``gpuslice status`` says what the controller says (a review's findings): a pod whose every
node is left out of plans showed as ``queued`` while its Events said ``Waiting``, and a gated
pod naming a ResourceClaim that does not exist was not listed at all."""

from __future__ import annotations

from typing import Any

from test_partitioner_dra import DRA, claim, claim_pod, mig_request
from test_partitioner_promises import MIG, SEVEN_G, T0, Cluster, applied_np, gated, status_gpu
from test_partitioner_snapshot import node
from test_partitioner_snapshot import np as np_obj

from gpuslice.commands.status import status_document
from partitioner.actions import SetNodeCondition

ONE_GPU = {**MIG, "nvidia.com/gpu.count": "1"}


def document(c: Cluster, now: float, **kw: Any) -> dict[str, Any]:
    objs = c.objs
    return status_document(
        [o for (k, _), o in objs.items() if k == "Node"],
        [o for (k, _), o in objs.items() if k == "Pod"],
        [o for (k, _), o in objs.items() if k == "NodePartitioning"],
        now,
        claims=[o for (k, _), o in objs.items() if k == "ResourceClaim"],
        **kw,
    )


def test_a_pod_whose_only_node_is_stuck_is_waiting_with_the_nodes_reason() -> None:
    np1 = applied_np("n1", status_gpu(0))
    np1["spec"]["planId"] = "5"
    np1["metadata"]["generation"] = 3
    np1["metadata"]["annotations"]["gpuslice.io/planned-at"] = f"{T0 - 1000:.3f}"
    c = Cluster(node("n1", ONE_GPU), np1, gated("p", SEVEN_G, created=T0 - 5))
    d = c.step(T0)
    for a in d.actions:  # the condition the controller sets, as the API then shows it
        if isinstance(a, SetNodeCondition):
            conds = [{"type": "GpusliceReady", "status": a.status, "reason": a.reason}]
            c.objs[("Node", a.node)]["status"]["conditions"] = conds
    (row,) = document(c, T0)["pods"]
    assert row["state"] == "waiting" and row["ahead"] is None
    assert "n1 (ApplyStuck)" in row["detail"]


def test_a_pod_waiting_for_a_missing_claim_is_listed() -> None:
    c = Cluster(
        node("d1", DRA),
        np_obj("d1"),
        claim_pod("typo", "gpu-claim-tpyo"),
        claim("gpu-claim", mig_request()),
    )
    for only in ((), ("ns/typo",)):
        (row,) = document(c, T0 + 10, only=only)["pods"]
        assert row["pod"] == "ns/typo" and row["state"] == "waiting for claims"
        assert "ResourceClaim ns/gpu-claim-tpyo, which does not exist" in row["detail"]


def test_a_released_pod_whose_node_no_longer_accepts_it_is_stranded() -> None:
    """Released to n1, which was then cordoned: the controller reports it ``Stranded``;
    ``status`` said it waited for kube-scheduler."""
    from test_partitioner_promises import ONE_G, reservation, status_gpu, with_alloc

    n1 = with_alloc(node("n1", ONE_GPU), **{"1g_10gb": 1})
    c = Cluster(n1, applied_np("n1", status_gpu(0, ("1g.10gb", 0, False))), gated("p", ONE_G))
    c.step(T0)
    r = reservation(c, "p")
    assert r is not None and r.state.value == "released"
    taint = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    c.objs[("Node", "n1")]["spec"] = {"unschedulable": True, "taints": [taint]}
    (row,) = document(c, T0 + 5)["pods"]
    assert row["state"] == "stranded" and "node n1 no longer accepts it" in row["detail"]
    assert "delete the pod so its controller recreates it" in row["detail"]
