"""Kubernetes objects -> planner snapshot: node opt-in and labels, pods, status, busy nodes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from partitioner.snapshot import (
    PLANNED_PODS_ANNOTATION,
    ClusterView,
    GpuNode,
    NodeProblem,
    is_batchable,
    read_cluster,
    read_node,
    snapshot_from_kubectl_list,
)
from planner.catalog import default_catalog
from planner.snapshot import GpuState, MigInstance, Mode, MpsSlice

CAT = default_catalog()
A100 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB", "nvidia.com/gpu.count": "2"}


def node(name: str, labels: dict[str, str], **spec: Any) -> dict[str, Any]:
    return {
        "kind": "Node",
        "metadata": {"name": name, "uid": f"uid-{name}", "labels": labels},
        "spec": spec,
        "status": {"allocatable": {"cpu": "16", "memory": "64Gi"}},
    }


def pod(
    name: str, requests: dict[str, str], *, node_name: str = "", phase: str = "Pending", **spec: Any
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if not node_name:
        status["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
        ]
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {
            "containers": [{"name": "c", "resources": {"requests": requests, "limits": {}}}],
            "nodeName": node_name or None,
            **spec,
        },
        "status": status,
    }


def np(
    name: str,
    *,
    plan: str = "",
    generation: int = 1,
    observed: int | None = None,
    applied: bool = False,
    gpus: list[dict[str, Any]] | None = None,
    pods: list[str] | None = None,
    mode: str = "mig",
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "gpuslice.io/v1alpha1",
        "kind": "NodePartitioning",
        "metadata": {
            "name": name,
            "generation": generation,
            "resourceVersion": "7",
            "annotations": {},
        },
        "spec": {"planId": plan, "mode": mode, "gpus": []},
    }
    if pods is not None:
        obj["metadata"]["annotations"][PLANNED_PODS_ANNOTATION] = json.dumps(pods)
    if observed is not None:
        obj["status"] = {
            "observedGeneration": observed,
            "gpus": gpus or [],
            "conditions": [{"type": "Applied", "status": "True" if applied else "False"}],
        }
    return obj


def view(*objs: dict[str, Any]) -> ClusterView:
    nodes = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Node"}
    pods = {f"ns/{o['metadata']['name']}": o for o in objs if o["kind"] == "Pod"}
    nps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "NodePartitioning"}
    return ClusterView(nodes, pods, nps)


class TestReadNode:
    def test_opt_in_labels(self) -> None:
        assert read_node(node("n", A100), CAT) is None
        got = read_node(node("n", {"nos.nebuly.com/gpu-partitioning": "mps", **A100}), CAT)
        assert isinstance(got, GpuNode) and got.mode is Mode.MPS and got.gpu_count == 2
        assert (
            got.model.name == "A100-SXM4-80GB"
            and got.cpu_milli == 16000
            and got.memory_mib == 65536
        )
        both = {
            "nos.nebuly.com/gpu-partitioning": "mps",
            "gpuslice.io/partitioning": "hybrid",
            **A100,
        }
        # labels that disagree: a node problem naming the fix (removing gpuslice's label
        # alone would leave the node opted in as mps through nos's)
        conflict = read_node(node("n", both), CAT)
        assert isinstance(conflict, NodeProblem)
        assert conflict.reason == "ConflictingPartitioningLabels"
        same = {**both, "gpuslice.io/partitioning": "mps"}
        assert read_node(node("n", same), CAT).mode is Mode.MPS  # type: ignore[union-attr]

    @pytest.mark.parametrize(
        ("labels", "reason", "fragment"),
        [
            (
                {"gpuslice.io/partitioning": "yes", **A100},
                "InvalidPartitioningLabel",
                "not one of mig, mps, hybrid",
            ),
            (
                {"nos.nebuly.com/gpu-partitioning": "hybrid", **A100},
                "InvalidPartitioningLabel",
                "mig, mps",
            ),
            (
                {"gpuslice.io/partitioning": "mig", "nvidia.com/gpu.count": "1"},
                "MissingGpuLabels",
                "nvidia.com/gpu.product",
            ),
            (
                {
                    "gpuslice.io/partitioning": "mig",
                    "nvidia.com/gpu.product": "Z999",
                    "nvidia.com/gpu.count": "1",
                },
                "UnknownGpuModel",
                "Z999",
            ),
            (
                {
                    "gpuslice.io/partitioning": "mig",
                    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                },
                "InvalidGpuLabels",
                "gpu.count",
            ),
            (
                {"gpuslice.io/partitioning": "mig", **A100, "nvidia.com/gpu.count": "0"},
                "InvalidGpuLabels",
                "positive",
            ),
            (
                {"gpuslice.io/partitioning": "mig", **A100, "nvidia.com/gpu.memory": "lots"},
                "InvalidGpuLabels",
                "gpu.memory",
            ),
            (
                {
                    "gpuslice.io/partitioning": "mig",
                    "nvidia.com/gpu.product": "Tesla-T4",
                    "nvidia.com/gpu.count": "1",
                },
                "MigNotSupported",
                "use mode mps",
            ),
        ],
    )
    def test_problems_name_the_fix(
        self, labels: dict[str, str], reason: str, fragment: str
    ) -> None:
        got = read_node(node("n", labels), CAT)
        assert isinstance(got, NodeProblem) and got.reason == reason
        assert fragment in got.message

    def test_gfd_memory_label_is_kept(self) -> None:
        got = read_node(
            node(
                "n", {"gpuslice.io/partitioning": "mps", **A100, "nvidia.com/gpu.memory": "81559"}
            ),
            CAT,
        )
        assert isinstance(got, GpuNode) and got.gpu_memory_mib == 81559


class TestBatchable:
    def test_unschedulable_pending_pod_with_a_slice(self) -> None:
        assert is_batchable(pod("p", {"nvidia.com/mig-1g.10gb": "1"}))

    @pytest.mark.parametrize(
        "change",
        [
            lambda p: p["status"].update(phase="Running"),
            lambda p: p["spec"].update(nodeName="n1"),
            lambda p: p["status"].update(nominatedNodeName="n1"),
            lambda p: p["metadata"].update(ownerReferences=[{"kind": "DaemonSet", "name": "ds"}]),
            lambda p: p["metadata"].update(deletionTimestamp="2024-01-01T00:00:00Z"),
            lambda p: p["status"]["conditions"][0].update(reason="SchedulerError"),
            lambda p: p["status"].update(conditions=[]),
            lambda p: p["spec"]["containers"][0]["resources"].update(
                requests={"nvidia.com/gpu": "1"}
            ),
        ],
    )
    def test_everything_else_is_not(self, change: Any) -> None:
        p = pod("p", {"nvidia.com/mig-1g.10gb": "1"})
        change(p)
        assert not is_batchable(p)


def test_status_gives_current_instances_and_running_pods_use_cpu() -> None:
    gpus = [
        {
            "index": 1,
            "mig": [
                {"profile": "3g.40gb", "start": 4, "used": True},
                {"profile": "1g.10gb", "start": 0},
            ],
        }
    ]
    r = read_cluster(
        view(
            node("n1", {"gpuslice.io/partitioning": "mig", **A100}),
            np("n1", observed=1, applied=True, gpus=gpus),
            pod("running", {"cpu": "1500m", "memory": "1Gi"}, node_name="n1", phase="Running"),
            pod("done", {"cpu": "8"}, node_name="n1", phase="Succeeded"),
            pod("p", {"nvidia.com/mig-1g.10gb": "2", "cpu": "250m", "memory": "100Mi"}, priority=5),
        ),
        CAT,
    )
    (n1,) = r.nodes
    assert n1.gpus == (
        GpuState(0),
        GpuState(1, mig=(MigInstance("3g.40gb", 4, True), MigInstance("1g.10gb", 0, False))),
    )
    assert (n1.cpu_milli_free, n1.memory_mib_free) == (14500, 64 * 1024 - 1024)
    p = r.candidates["ns/p"]
    assert p.requests == {"nvidia.com/mig-1g.10gb": 2} and (
        p.cpu_milli,
        p.memory_mib,
        p.priority,
    ) == (250, 100, 5)
    assert p.eligible_nodes == {"n1"}
    snap = r.snapshot()
    assert snap.nodes == r.nodes and [x.name for x in snap.pods] == ["ns/p"]


def test_mps_status_slices() -> None:
    gpus = [{"index": 0, "mps": [{"memoryMiB": 10240, "activeThreadPercentage": 25, "used": True}]}]
    r = read_cluster(
        view(
            node("m", {"gpuslice.io/partitioning": "mps", **A100}),
            np("m", mode="mps", observed=1, applied=True, gpus=gpus),
        ),
        CAT,
    )
    assert r.nodes[0].gpus[0].mps == (MpsSlice(10240, True, 25),)


def test_busy_node_is_excluded_and_its_pods_are_in_flight() -> None:
    r = read_cluster(
        view(
            node("busy", {"gpuslice.io/partitioning": "mig", **A100}),
            node("free", {"gpuslice.io/partitioning": "mig", **A100}),
            node("only", {"gpuslice.io/partitioning": "mig", **A100}),
            np("busy", plan="3", generation=2, observed=1, pods=["ns/flying"]),
            np("free", plan="2", generation=2, observed=2, applied=True),
            np("only", plan="3", generation=3),
            pod("flying", {"nvidia.com/mig-1g.10gb": "1"}),
            pod("any", {"nvidia.com/mig-1g.10gb": "1"}),
            pod(
                "pinned",
                {"nvidia.com/mig-1g.10gb": "1"},
                nodeSelector={"kubernetes.io/hostname": "only"},
            ),
        ),
        CAT,
    )
    assert r.busy == {"busy", "only"}
    assert [n.name for n in r.nodes] == ["free"]
    assert "in flight" in r.waiting["ns/flying"] and "plan 3" in r.waiting["ns/flying"]
    assert r.candidates["ns/any"].eligible_nodes == {"free"}
    assert "ns/pinned" not in r.candidates  # selector label absent everywhere -> rejected
    assert r.rejected["ns/pinned"].startswith("no eligible node")


def test_pod_whose_eligible_nodes_are_all_busy_waits() -> None:
    labels = {"gpuslice.io/partitioning": "mig", "pool": "a", **A100}
    r = read_cluster(
        view(
            node("n1", labels),
            np("n1", plan="1", generation=2, observed=1),
            pod("p", {"nvidia.com/mig-1g.10gb": "1"}, nodeSelector={"pool": "a"}),
        ),
        CAT,
    )
    assert r.waiting["ns/p"] == "no eligible node can be planned now: n1 (applying a previous plan)"


def test_a_pod_whose_eligible_nodes_cannot_be_planned_is_told_each_nodes_reason() -> None:
    # Before, every such node was "applying a previous plan", whatever kept it out.
    mig = {"gpuslice.io/partitioning": "mig", "pool": "a", **A100}
    bad = np("n2")
    bad["status"] = {"gpus": [{"index": 0, "mig": [{"profile": "1g.10gb", "start": -1}]}]}
    r = read_cluster(
        view(
            node("n1", mig),
            np("n1", plan="1", generation=2, observed=1),
            node("n2", mig),
            bad,
            node("n3", {**mig, "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
                        "nvidia.com/mig.strategy": "single"}),
            pod("p", {"nvidia.com/mig-1g.10gb": "1"}, nodeSelector={"pool": "a"}),
        ),
        CAT,
    )  # fmt: skip
    assert r.waiting["ns/p"] == (
        "no eligible node can be planned now: n1 (applying a previous plan), "
        f"n2 (its NodePartitioning is invalid), n3 ({r.problems['n3'].reason})"
    )


def test_degraded_node_that_gave_up_is_planned_again() -> None:
    obj = np("n1", plan="4", generation=2, observed=2)
    obj["status"]["conditions"].append({"type": "Degraded", "status": "True", "reason": "InUse"})
    r = read_cluster(view(node("n1", {"gpuslice.io/partitioning": "mig", **A100}), obj), CAT)
    assert r.busy == set() and [n.name for n in r.nodes] == ["n1"]


def test_unknown_and_mismatched_resources_are_rejected_with_a_reason() -> None:
    r = read_cluster(
        view(
            node("n1", {"gpuslice.io/partitioning": "mig", **A100}),
            pod("nine", {"nvidia.com/mig-9g.99gb": "1"}),
            pod("mps", {"nvidia.com/gpu-10gb": "1"}),
            pod("zero", {"nvidia.com/gpu-0gb": "1"}),
            pod("half", {"nvidia.com/mig-1g.10gb": "500m"}),
            pod("ok", {"nvidia.com/mig-1g.10gb": "1"}),
        ),
        CAT,
    )
    assert r.rejected["ns/nine"].startswith(
        "unknown resource nvidia.com/mig-9g.99gb: no eligible GPU (A100-SXM4-80GB)"
    )
    assert "1g.10gb" in r.rejected["ns/nine"]
    assert r.rejected["ns/mps"].startswith("no eligible node: no opted-in MPS node")
    assert r.rejected["ns/zero"].startswith("no eligible node")  # no MPS node at all
    assert "whole number" in r.rejected["ns/half"]
    assert set(r.candidates) == {"ns/ok"}


def test_invalid_partitioning_is_reported_and_keeps_the_node_out() -> None:
    bad = np("n1")
    bad["spec"]["gpus"] = [{"index": -1}]
    r = read_cluster(view(node("n1", {"gpuslice.io/partitioning": "mig", **A100}), bad), CAT)
    assert "n1" in r.invalid_partitionings and r.busy == {"n1"} and r.nodes == ()


def test_snapshot_from_kubectl_list() -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            node("n1", {"gpuslice.io/partitioning": "mig", **A100}),
            node(
                "n2",
                {
                    "gpuslice.io/partitioning": "mig",
                    "nvidia.com/gpu.product": "Z1",
                    "nvidia.com/gpu.count": "1",
                },
            ),
            np("n1", observed=1, applied=True),
            pod("p", {"nvidia.com/mig-2g.20gb": "1"}),
            pod("q", {"nvidia.com/mig-9g.99gb": "1"}),
        ],
    }
    snap, notes = snapshot_from_kubectl_list(doc, CAT)
    assert [n.name for n in snap.nodes] == ["n1"] and [p.name for p in snap.pods] == ["ns/p"]
    assert any(n.startswith("node n2: UnknownGpuModel") for n in notes)
    assert any(n.startswith("pod ns/q: cannot place: unknown resource") for n in notes)
    with pytest.raises(ValueError, match="'items' array"):
        snapshot_from_kubectl_list({"kind": "Node"}, CAT)
    _, notes = snapshot_from_kubectl_list({"items": []}, CAT)
    assert notes and "no node is opted in" in notes[0]
