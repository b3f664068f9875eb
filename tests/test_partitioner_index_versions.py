"""The index's version moves only when something the controller reads changes.

Kubelets post node status (heartbeats, other conditions) and pods change status fields the
controller never reads; each such event carries a newer resourceVersion.  If every one bumped
``ClusterIndex.version``, no cycle of a large cluster would ever be quiet
(:class:`partitioner.decide.Quiet`).  Such an update keeps the parsed object (and its caches)
and takes the new resourceVersion, so writes guarded by it still go through.
"""

from __future__ import annotations

import copy
from typing import Any

from test_partitioner_snapshot import A100, node, pod

from partitioner.decide import _rv_patch
from partitioner.index import ClusterIndex
from planner.catalog import default_catalog

MIG = {"gpuslice.io/partitioning": "mig", **A100, "nvidia.com/gpu.count": "1"}
ONE_G = {"nvidia.com/mig-1g.10gb": "1"}


def _with_rv(obj: dict[str, Any], rv: str) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["resourceVersion"] = rv
    return out


def test_a_node_heartbeat_is_not_a_change() -> None:
    index = ClusterIndex(default_catalog())
    n = _with_rv(node("n1", MIG), "1")
    index.upsert_node(n)
    version, info = index.version, index.nodes["n1"]

    beat = _with_rv(n, "2")
    beat["status"]["conditions"] = [
        {"type": "Ready", "status": "True", "lastHeartbeatTime": "2026-11-26T03:00:00Z"}
    ]
    index.upsert_node(beat)
    assert index.version == version and index.nodes["n1"] is info and info.rv == "2"

    relabelled = _with_rv(beat, "3")
    relabelled["metadata"]["labels"]["team"] = "a"
    index.upsert_node(relabelled)
    assert index.version == version + 1 and index.nodes["n1"] is not info

    index.upsert_node(_with_rv(relabelled, "2"))  # older: ignored
    assert index.nodes["n1"].rv == "3"


def test_a_pod_status_detail_is_not_a_change_but_the_patch_takes_the_new_version() -> None:
    index = ClusterIndex(default_catalog())
    p = _with_rv(pod("a", ONE_G, schedulingGates=[{"name": "gpuslice.io/slice"}]), "10")
    index.upsert_pod(p)
    version, info = index.version, index.pods["ns/a"]
    info.eligible_cache = (index.topology, frozenset({"n1"}))  # a cache the step filled

    detail = _with_rv(p, "11")
    detail["status"]["conditions"].append({"type": "Initialized", "status": "True"})
    index.upsert_pod(detail)
    assert index.version == version and index.pods["ns/a"] is info
    assert info.rv == "11" and info.eligible_cache is not None
    assert _rv_patch(info, {})["metadata"]["resourceVersion"] == "11"

    ungated = _with_rv(detail, "12")
    ungated["spec"]["schedulingGates"] = []
    index.upsert_pod(ungated)
    assert index.version == version + 1 and not index.pods["ns/a"].gated

    bound = _with_rv(ungated, "13")
    bound["spec"]["nodeName"] = "n1"
    index.upsert_pod(bound)
    assert index.version == version + 2 and index.pods["ns/a"].node == "n1"


def _with_uid(obj: dict[str, Any], uid: str, rv: str) -> dict[str, Any]:
    out = _with_rv(obj, rv)
    out["metadata"]["uid"] = uid
    return out


def test_a_late_deletion_of_a_replaced_object_keeps_its_successor() -> None:
    """kopf watches each object on its own, so the DELETED event of a pod or node that was
    replaced under the same name (a StatefulSet pod recreated, a node registered again, a
    NodePartitioning or claim recreated) can be folded in after its successor's ADDED: the
    successor stays (it was dropped by name: a gated pod lost for good, a live node's
    NodePartitioning deleted), and the deletion of the object held still drops it."""
    index = ClusterIndex(default_catalog())
    index.apply("nodes", None, _with_uid(node("n1", MIG), "node-old", "10"))
    index.apply("pods", None, _with_uid(pod("web-0", ONE_G), "pod-old", "20"))
    np_raw = {
        "apiVersion": "gpuslice.io/v1alpha1",
        "kind": "NodePartitioning",
        "metadata": {"name": "n1", "uid": "np-old", "resourceVersion": "21", "generation": 1},
        "spec": {"mode": "mig"},
    }
    index.apply("partitionings", None, np_raw)
    index.apply("pods", "ADDED", _with_uid(pod("web-0", ONE_G), "pod-new", "31"))
    index.apply("nodes", "ADDED", _with_uid(node("n1", MIG), "node-new", "33"))
    index.apply("partitionings", "ADDED", _with_uid(np_raw, "np-new", "34"))
    index.apply("pods", "DELETED", _with_uid(pod("web-0", ONE_G), "pod-old", "30"))
    index.apply("nodes", "DELETED", _with_uid(node("n1", MIG), "node-old", "32"))
    index.apply("partitionings", "DELETED", _with_uid(np_raw, "np-old", "35"))
    assert {k: p.uid for k, p in index.pods.items()} == {"ns/web-0": "pod-new"}
    assert {k: n.uid for k, n in index.nodes.items()} == {"n1": "node-new"}
    assert set(index.partitionings) == {"n1"}
    # the held objects' own deletions still drop them
    index.apply("pods", "DELETED", _with_uid(pod("web-0", ONE_G), "pod-new", "40"))
    index.apply("nodes", "DELETED", _with_uid(node("n1", MIG), "node-new", "41"))
    index.apply("partitionings", "DELETED", _with_uid(np_raw, "np-new", "42"))
    assert index.pods == {} and index.nodes == {} and index.partitionings == {}
