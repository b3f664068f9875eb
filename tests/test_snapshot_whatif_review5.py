"""``gpuslice plan --snapshot`` reads a dump as the controller reads the cluster (review 5).

* a pod gated by gpuslice (``gpuslice.io/slice``; PodScheduled reason ``SchedulingGated``), as
  every waiting slice pod is once gpuslice is installed, is planned; one gpuslice promised
  slices (reservation ``planned``/``released``) is in flight and its slice held, not planned
  again; one another controller also gates waits for that controller;
* a NodePartitioning naming a GPU index beyond ``nvidia.com/gpu.count`` (a node that lost a
  GPU; a second GPU model GFD does not count) no longer refuses the whole dump;
* a pod asking for other extended resources (``rdma/...``) may only use nodes that have them;
* nos's stale MPS status on a node now opted in as MIG, and ``TimeSlicedBeforeAgent`` under
  NVIDIA's MPS sharing, name their fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_partitioner_gpu_operator_reading import (
    H100,
    gfd_node,
    pod,
    read,
    running,
)

from gpuslice.cli import main
from gpuslice.snapshot_file import read_snapshot_file
from partitioner.adoption import _nos_status
from partitioner.index import ClusterIndex
from partitioner.node_labels import LabelProblem
from partitioner.snapshot import is_batchable
from planner.catalog import default_catalog

CAT = default_catalog()
GATE = "gpuslice.io/slice"
RDMA = "rdma/rdma_shared_device_a"


def mixed(name: str, count: int = 2, **kw: Any) -> dict[str, Any]:
    return gfd_node(name, strategy="mixed", count=count, mig_config="all-disabled", **kw)


def gated(name: str, requests: dict[str, str], *gates: str) -> dict[str, Any]:
    p = pod(name, requests)
    p["spec"]["schedulingGates"] = [{"name": g} for g in (gates or (GATE,))]
    p["status"]["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "SchedulingGated",
            "message": "Scheduling is blocked due to non-empty scheduling gates",
        }
    ]
    return p


def reserve(p: dict[str, Any], node: str, state: str, gpus: dict[str, list[int]]) -> None:
    doc = {"node": node, "state": state, "gpus": gpus, "since": 1.8e9, "pod": p["metadata"]["uid"]}
    if state == "released":
        doc["deadline"] = 1.8e9 + 120
        p["spec"]["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                }
            }
        }
    p["metadata"]["annotations"] = {"gpuslice.io/reservation": json.dumps(doc)}


def reported(name: str, gpus: list[dict[str, Any]], mode: str = "mig") -> dict[str, Any]:
    """A NodePartitioning whose agent applied its plan and reports ``gpus``."""
    return {
        "apiVersion": "gpuslice.io/v1alpha1",
        "kind": "NodePartitioning",
        "metadata": {"name": name, "generation": 2},
        "spec": {"mode": mode, "planId": "7", "gpus": []},
        "status": {
            "observedGeneration": 2,
            "planId": "7",
            "conditions": [
                {
                    "type": "Applied",
                    "status": "True",
                    "reason": "Applied",
                    "message": "",
                    "lastTransitionTime": "2026-12-07T10:00:00Z",
                }
            ],
            "gpus": gpus,
        },
    }


def one_7g(name: str) -> dict[str, Any]:
    """Node ``name`` (1 x H100) holding one free 7g.80gb, as its agent reports."""
    gpu = {
        "index": 0,
        "uuid": "GPU-0",
        "model": "H100-80GB",
        "migEnabled": True,
        "mig": [{"profile": "7g.80gb", "start": 0, "deviceId": "MIG-0", "used": False}],
    }
    return reported(name, [gpu])


def plan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str], *items: Any) -> dict[str, Any]:
    path = tmp_path / "dump.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": list(items)}))
    rc = main(["plan", "--snapshot", str(path), "-o", "json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    doc: dict[str, Any] = json.loads(out.out)
    return doc


# --------------------------------------------------------------------------- 2. gated pods


def test_a_pod_gated_by_gpuslice_is_batchable() -> None:
    assert is_batchable(gated("g", {"nvidia.com/mig-1g.10gb": "1"}))
    # still not: bound, a DaemonSet's, asking for nothing
    bound = gated("b", {"nvidia.com/mig-1g.10gb": "1"})
    bound["spec"]["nodeName"] = "n"
    assert not is_batchable(bound)
    zero = gated("z", {"nvidia.com/mig-1g.10gb": "0"})
    assert not is_batchable(zero)
    ds = gated("d", {"nvidia.com/mig-1g.10gb": "1"})
    ds["metadata"]["ownerReferences"] = [{"kind": "DaemonSet", "name": "x"}]
    assert not is_batchable(ds)
    # another controller's gate only: kube-scheduler (not gpuslice) is held back
    assert not is_batchable(gated("k", {"nvidia.com/mig-1g.10gb": "1"}, "kueue.x-k8s.io/admission"))


def test_plan_snapshot_plans_the_pods_gpuslice_gated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = plan_json(
        tmp_path, capsys, mixed("h100-a"), gated("want-1g", {"nvidia.com/mig-1g.10gb": "1"})
    )
    assert doc["assignments"]["default/want-1g"]["node"] == "h100-a"
    assert doc["unplaced"] == {}


def test_a_pod_another_controller_also_gates_waits_for_it() -> None:
    r = read(mixed("h100-a"), gated("q", {"nvidia.com/mig-1g.10gb": "1"}, GATE, "kueue/admit"))
    assert "default/q" not in r.candidates
    assert r.waiting["default/q"] == (
        "waiting for other scheduling gates to be removed: kueue/admit"
    )


@pytest.mark.parametrize("state", ["released", "planned"])
def test_a_promised_pod_is_in_flight_and_its_slice_held(state: str) -> None:
    """A released pod (gate gone, pinned to n1, not bound yet) or a planned one (still gated)
    holds the free 7g.80gb it was promised: not planned again, and no other pod gets it."""
    n1 = mixed("n1", count=1)
    promised = (
        pod("promised", {"nvidia.com/mig-7g.80gb": "1"})
        if state == "released"
        else gated("promised", {"nvidia.com/mig-7g.80gb": "1"})
    )
    reserve(promised, "n1", state, {"nvidia.com/mig-7g.80gb": [0]})
    other = gated("other", {"nvidia.com/mig-7g.80gb": "1"})
    r = read(n1, one_7g("n1"), promised, other)
    assert "default/promised" not in r.candidates
    why = r.waiting["default/promised"]
    assert why.startswith("in flight:") and "node n1" in why and state in why, why
    (node,) = r.nodes
    assert [i.used for i in node.gpus[0].mig] == [True]
    assert any("default/promised" in note for note in r.adopted["n1"].notes)
    assert "default/other" in r.candidates  # planned, but finds no free 7g.80gb


def test_plan_snapshot_does_not_plan_a_promised_slice_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    promised = pod("released", {"nvidia.com/mig-7g.80gb": "1"})
    reserve(promised, "n1", "released", {"nvidia.com/mig-7g.80gb": [0]})
    other = gated("gated-7g", {"nvidia.com/mig-7g.80gb": "1"})
    doc = plan_json(tmp_path, capsys, mixed("n1", count=1), one_7g("n1"), promised, other)
    assert doc["assignments"] == {}
    assert "in flight" in doc["unplaced"]["default/released"]
    assert "no room" in doc["unplaced"]["default/gated-7g"]


def test_a_promised_mps_slice_is_held() -> None:
    node = mixed("m", count=1)
    node["metadata"]["labels"]["gpuslice.io/partitioning"] = "mps"
    gpu = {
        "index": 0,
        "uuid": "GPU-0",
        "model": "H100-80GB",
        "migEnabled": False,
        "mps": [
            {"memoryMiB": 10240, "activeThreadPercentage": 25, "deviceId": "s0", "used": False},
            {"memoryMiB": 20480, "activeThreadPercentage": 25, "deviceId": "s1", "used": False},
        ],
    }
    promised = gated("p", {"nvidia.com/gpu-10gb": "1"})
    reserve(promised, "m", "planned", {"nvidia.com/gpu-10gb": [0]})
    r = read(node, reported("m", [gpu], mode="mps"), promised)
    assert r.waiting["default/p"].startswith("in flight:")
    assert [(s.memory_mib, s.used) for s in r.nodes[0].gpus[0].mps] == [
        (10240, True),
        (20480, False),
    ]


def test_reservations_the_controller_ignores_are_planned_again() -> None:
    """A reservation copied from another pod (uid) holds nothing; a gated pod whose node is gone
    is planned again: candidates, nothing held.  (A draining one freezes its GPUs:
    ``test_the_what_if_plans_no_pod_onto_a_gpu_being_drained``.)"""
    copied = gated("copied", {"nvidia.com/mig-7g.80gb": "1"})
    reserve(copied, "n1", "planned", {"nvidia.com/mig-7g.80gb": [0]})
    copied["metadata"]["uid"] = "u-someone-else"
    gone = gated("gone", {"nvidia.com/mig-7g.80gb": "1"})
    reserve(gone, "n9", "planned", {"nvidia.com/mig-7g.80gb": [0]})
    r = read(mixed("n1", count=1), one_7g("n1"), copied, gone)
    assert {"default/copied", "default/gone"} <= r.candidates.keys()
    assert not r.waiting
    assert [i.used for i in r.nodes[0].gpus[0].mig] == [False]


# --------------------------------------------------------------------------- 3. lost GPU


def lost_gpu_dump() -> dict[str, Any]:
    """h100-lost lost GPU 7 (Xid 79): GFD relabelled gpu.count=7, the agent reports 0..6, the
    spec written before still names GPU 7 (the agent refuses it: Degraded)."""
    lost = mixed("h100-lost", count=7)
    gpus = [
        {
            "index": i,
            "uuid": f"GPU-{i}",
            "model": "H100-80GB",
            "migEnabled": True,
            "mig": [{"profile": "7g.80gb", "start": 0, "deviceId": f"MIG-{i}", "used": True}],
        }
        for i in range(7)
    ]
    np = reported("h100-lost", gpus)
    np["spec"]["gpus"] = [
        {"index": i, "mig": [{"profile": "7g.80gb", "start": 0}]} for i in range(8)
    ]
    np["status"]["conditions"] = [
        {
            "type": "Degraded",
            "status": "True",
            "reason": "NoSuchGpu",
            "message": "GPU 7 not found",
            "lastTransitionTime": "2026-12-07T10:00:00Z",
        }
    ]
    items = [lost, np, mixed("h100-ok"), pod("want-1g", {"nvidia.com/mig-1g.10gb": "1"})]
    return {"apiVersion": "v1", "kind": "List", "items": items}


def test_a_spec_naming_a_lost_gpu_does_not_refuse_the_dump(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(lost_gpu_dump()))
    read_snapshot_file(str(path))  # no SnapshotFileError
    rc = main(["plan", "--snapshot", str(path), "-o", "json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert json.loads(out.out)["assignments"]["default/want-1g"]["node"] == "h100-ok"


def test_a_status_naming_more_gpus_than_the_label_is_read_as_the_controller_does(
    tmp_path: Path,
) -> None:
    """The agent reports 5 GPUs, GFD counts 4 (a display GPU of another model, or a stale
    label): the agent's report wins, the mismatch is the reader's to name, not a file error."""
    node = mixed("station", count=4)
    gpus = [
        {"index": i, "uuid": f"GPU-{i}", "model": "H100-80GB", "migEnabled": True, "mig": []}
        for i in range(5)
    ]
    doc = {"apiVersion": "v1", "kind": "List", "items": [node, reported("station", gpus)]}
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(doc))
    read_snapshot_file(str(path))
    assert read(*doc["items"]).adopted["station"].gpu_count == 5


# --------------------------------------------------------------------------- 4. other resources


def test_a_pod_asking_for_rdma_is_planned_only_where_it_is_allocatable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = mixed("gpu-a", count=1), mixed("gpu-b", count=1)
    b["status"]["allocatable"][RDMA] = "63"
    pods = [pod(n, {"nvidia.com/mig-7g.80gb": "1", RDMA: "1"}) for n in ("trainer", "trainer2")]
    r = read(a, b, *pods)
    assert {k: set(p.eligible_nodes or ()) for k, p in r.candidates.items()} == {
        "default/trainer": {"gpu-b"},
        "default/trainer2": {"gpu-b"},
    }
    # the controller's eligibility agrees
    index = ClusterIndex.from_objects(CAT, [a, b], pods, [])
    assert {k: set(index.eligible(i, index.gpu_nodes())) for k, i in index.pods.items()} == {
        k: set(p.eligible_nodes or ()) for k, p in r.candidates.items()
    }
    doc = plan_json(tmp_path, capsys, a, b, *pods)
    assert [x["node"] for x in doc["assignments"].values()] == ["gpu-b"]
    assert len(doc["unplaced"]) == 1


def test_no_node_with_the_resource_says_so() -> None:
    r = read(mixed("gpu-a", count=1), pod("t", {"nvidia.com/mig-7g.80gb": "1", RDMA: "1"}))
    why = r.rejected["default/t"]
    assert why.startswith("no eligible node")
    assert f"advertises what else it asks for ({RDMA}: 1)" in why


# --------------------------------------------------------------------------- minor


def test_nos_mps_status_on_a_mig_node_names_the_fix() -> None:
    got = _nos_status(
        {
            "nos.nebuly.com/status-gpu-0-10gb-free": "2",
            "nos.nebuly.com/status-gpu-0-10gb-used": "1",
        },
        CAT.model("A100-SXM4-40GB"),
        1,
    )
    assert isinstance(got, LabelProblem) and got.reason == "UnreadableNosStatus"
    assert "remove the stale nos annotations" in got.message
    assert "'Migrate from nos'" in got.message


def test_time_sliced_by_mps_names_the_mps_sharing_config() -> None:
    node = gfd_node("s", strategy=None, product=f"{H100}-SHARED", count=8)
    node["metadata"]["labels"] |= {
        "nvidia.com/gpu.replicas": "4",
        "nvidia.com/gpu.sharing-strategy": "mps",
    }
    problem = read(node, running("x", "s", {"nvidia.com/gpu": "1"})).problems["s"]
    assert problem.reason == "TimeSlicedBeforeAgent"
    assert "MPS sharing config" in problem.message
    assert "time-slicing config" not in problem.message
    node["metadata"]["labels"]["nvidia.com/gpu.sharing-strategy"] = "time-slicing"
    problem = read(node, running("x", "s", {"nvidia.com/gpu": "1"})).problems["s"]
    assert "time-slicing config" in problem.message


def test_the_what_if_plans_no_pod_onto_a_gpu_being_drained() -> None:
    """A GPU frozen for a drain (reservation ``state: draining``) takes no other pod in the
    controller; the what-if put a younger 1g pod on its free 1g (a review of this session)."""
    import json as _json

    from test_partitioner_promises import (
        CAT,
        MIG,
        ONE_G,
        SEVEN_G,
        T0,
        applied_np,
        gated,
        running,
        status_gpu,
        with_alloc,
    )
    from test_partitioner_snapshot import node as _node

    from partitioner.reservations import RESERVATION_ANNOTATION
    from partitioner.snapshot import read_kubectl_list
    from planner.greedy import plan_greedy

    free_1g = status_gpu(0, ("1g.10gb", 0, False), ("3g.40gb", 4, True))
    objs = [
        with_alloc(_node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", free_1g, status_gpu(1, ("7g.80gb", 0, True))),
        gated("big", SEVEN_G, created=T0),
        gated("small", ONE_G, created=T0 + 700),
        running("a", "n1", "nvidia.com/mig-3g.40gb"),
        running("b", "n1", SEVEN_G),
    ]
    objs[2]["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: _json.dumps(
            {"node": "n1", "state": "draining", "gpus": {SEVEN_G: [0]}, "since": T0 + 650}
        )
    }
    for o in objs:
        if o["kind"] == "NodePartitioning":
            o.setdefault("apiVersion", "gpuslice.io/v1alpha1")
    reading = read_kubectl_list({"apiVersion": "v1", "kind": "List", "items": objs}, CAT)
    assert reading.waiting["ns/big"].startswith("draining: gpuslice empties node n1 GPU 0")
    assert plan_greedy(reading.snapshot()).assignments == {}  # the free 1g is frozen
    assert any("drained for ns/big" in note for note in reading.adopted["n1"].notes)
