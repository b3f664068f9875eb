"""Numbers in free text the partitioner reads: one bad value is reported, never an exception.

Annotations are free text (a reservation's JSON, ``gpuslice.io/gpu-count``, nos's
``status-gpu-*`` counts, ``gpuslice.io/planned-pods``), and so is a hand-edited
``spec.planId``.  Python's ``str.isdigit``
takes ``²`` (which ``int`` refuses), ``int`` takes other scripts' digits and refuses more than
4300 digits, and ``math.isnan`` of a huge integer overflows: each of those used to escape as an
exception out of the index (the operator's listing failed forever) or out of ``decide`` (every
step failed, for every node and pod).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
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
from test_partitioner_snapshot import node, np

from contract.nodepartitioning import NodePartitioning
from gpuslice.cli import EXIT_BAD_INPUT, main
from partitioner.index import ClusterIndex
from partitioner.node_labels import GpuLabels, LabelProblem, read_gpu_labels
from partitioner.reservations import (
    RESERVATION_ANNOTATION,
    ReservationError,
    State,
    parse_reservation,
)
from partitioner.snapshot import PLANNED_PODS_ANNOTATION, planned_pods
from planner.catalog import default_catalog
from simulations.inputs.workload import WorkloadError, parse_gpu_requests

CAT = default_catalog()
A40_SINGLE = {
    "nvidia.com/mig.strategy": "single",
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
    "nvidia.com/gpu.count": "14",
}


def _reservation(**fields: Any) -> str:
    doc = {"node": "n1", "state": "planned", "gpus": {ONE_G: [0]}, **fields}
    return json.dumps(doc)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"node":"n1","state":"planned","since":1' + "0" * 400 + "}", "'since' must be a finite"),
        ('{"node":"n1","state":"planned","deadline":' + "9" * 320 + "}", "'deadline' must be"),
        ('{"node":"n1","state":"planned","since":1' + "0" * 5000 + "}", "more than 4300 digits"),
        ('{"node":"n1","state":"planned","deadline":Infinity}', "'deadline' must be a finite"),
        ('{"node":"n1","state":"planned","since":-Infinity}', "'since' must be a finite"),
        ('{"node":"n1","state":"planned","since":1e300}', "at most 1e+12 seconds"),
    ],
)
def test_a_reservation_with_an_absurd_number_is_a_reservation_error(
    text: str, fragment: str
) -> None:
    with pytest.raises(ReservationError) as e:
        parse_reservation(text)
    assert fragment in str(e.value) and len(str(e.value)) < 300


def _bad_pod(cluster_objs: list[dict[str, Any]]) -> str:
    pod = gated("bad", ONE_G)
    pod["metadata"]["annotations"] = {RESERVATION_ANNOTATION: _reservation(since=10**400)}
    cluster_objs.append(pod)
    return "pod ns/bad: InvalidReservation"


def _bad_pod_5000_digits(cluster_objs: list[dict[str, Any]]) -> str:
    pod = gated("bad", ONE_G)
    text = _reservation(since=0).replace('"since": 0', '"since": 1' + "0" * 5000)
    pod["metadata"]["annotations"] = {RESERVATION_ANNOTATION: text}
    cluster_objs.append(pod)
    return "pod ns/bad: InvalidReservation"


def _bad_gpu_count(cluster_objs: list[dict[str, Any]]) -> str:
    n3 = node("n3", {"gpuslice.io/partitioning": "mig", **A40_SINGLE})
    n3["metadata"]["annotations"] = {"gpuslice.io/gpu-count": "\u00b2"}
    cluster_objs.append(n3)
    return "node n3: InvalidGpuLabels"


def _bad_nos_count(cluster_objs: list[dict[str, Any]]) -> str:
    n3 = node("n3", MIG)  # its agent has not reported: its GPUs are adopted from nos
    n3["metadata"]["annotations"] = {"nos.nebuly.com/status-gpu-0-1g.10gb-free": "\u00b2"}
    cluster_objs += [n3, np("n3")]
    return "node n3: UnreadableNosStatus"


def _bad_plan_id(cluster_objs: list[dict[str, Any]]) -> str:
    n3 = applied_np("n3", status_gpu(0), status_gpu(1))
    n3["spec"]["planId"] = "\u00b2"  # edited by hand
    cluster_objs += [node("n3", MIG), n3, gated("big", SEVEN_G)]  # big needs a plan
    return ""


@pytest.mark.parametrize(
    "add_bad", [_bad_pod, _bad_pod_5000_digits, _bad_gpu_count, _bad_nos_count, _bad_plan_id]
)
def test_one_bad_number_is_reported_and_the_rest_of_the_cluster_is_served(add_bad: Any) -> None:
    objs = [
        with_alloc(node("n2", MIG), **{"1g_10gb": 2}),
        applied_np("n2", status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False))),
        gated("good", ONE_G),
    ]
    told = add_bad(objs)
    c = Cluster(*objs)
    index = c.index()  # ClusterIndex.from_objects: the operator's initial listing
    relisted = ClusterIndex(CAT)
    for kind, key in (("Node", "nodes"), ("Pod", "pods"), ("NodePartitioning", "partitionings")):
        for o in (o for (k, _), o in c.objs.items() if k == kind):
            relisted.apply(key, "ADDED", copy.deepcopy(o))  # the watch handler
    assert set(relisted.pods) == set(index.pods) and set(relisted.nodes) == set(index.nodes)
    d = c.step(T0 + 5)
    assert not d.error
    got = reservation(c, "good")
    assert got is not None and (got.node, got.state) == ("n2", State.RELEASED)
    assert "schedulingGates" not in c.pod("good")["spec"]
    if told.startswith("pod"):
        (message,) = events(d, "InvalidReservation")
        assert f"annotation {RESERVATION_ANNOTATION} is malformed" in message
        assert reservation(c, "bad").node == "n2"  # planned again, with a reservation it wrote
    elif told.startswith("node"):
        assert d.problems["n3"].reason == told.rsplit(": ", 1)[1]
        assert "\u00b2" in d.problems["n3"].message
    else:  # the next plan id follows n2's planId 1
        d = c.step(T0 + 16)
        assert not d.error and d.plan_id == "2"
        assert reservation(c, "big").plan == "2"


@pytest.mark.parametrize("raw", ["[1" + "0" * 5000 + "]", "[" * 100_000 + "]" * 100_000])
def test_a_malformed_planned_pods_annotation_reads_as_no_pods(raw: str) -> None:
    # Without reservations a plan in flight holds back the pods in gpuslice.io/planned-pods
    # (partitioner.snapshot.planned_pods): json.loads' ValueError or RecursionError escaped
    # out of decide, every step.
    busy = np("n1", plan="3", generation=3, observed=2, applied=True, gpus=[status_gpu(0)])
    busy["metadata"]["annotations"][PLANNED_PODS_ANNOTATION] = raw
    c = Cluster(
        node("n1", MIG),
        busy,
        with_alloc(node("n2", MIG), **{"1g_10gb": 1}),
        applied_np("n2", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        gated("good", ONE_G),
    )
    d = c.step(T0 + 5, dataclasses.replace(CONFIG, reservation=False))
    assert not d.error
    assert "schedulingGates" not in c.pod("good")["spec"]  # served the legacy way: ungated
    assert planned_pods(NodePartitioning.model_validate(busy)) == []


@pytest.mark.parametrize(
    ("labels", "annotations", "where"),
    [
        (A40_SINGLE, {"gpuslice.io/gpu-count": "\u00b2"}, "annotation gpuslice.io/gpu-count"),
        (A40_SINGLE, {"gpuslice.io/gpu-count": "1" * 5000}, "annotation gpuslice.io/gpu-count"),
        ({**A40_SINGLE, "nvidia.com/gpu.count": "\u00b2"}, {}, "label nvidia.com/gpu.count"),
        (
            {
                "nvidia.com/mig.strategy": "mixed",
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
                "nvidia.com/gpu.count": "1",
                "nvidia.com/mig-1g.5gb.count": "\u00b2",
            },
            {},
            "label nvidia.com/mig-1g.5gb.count",
        ),
        (
            {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "nvidia.com/gpu.count": "\u00b2"},
            {},
            "label nvidia.com/gpu.count",
        ),
    ],
)
def test_a_count_that_is_not_ascii_digits_is_a_label_problem(
    labels: dict[str, str], annotations: dict[str, str], where: str
) -> None:
    got = read_gpu_labels(labels, annotations, CAT, "n1")
    assert isinstance(got, LabelProblem) and got.reason == "InvalidGpuLabels", got
    assert where in got.message


def test_counts_in_other_scripts_digits_are_not_read() -> None:
    # int() reads Arabic-Indic digits; a count written that way is no count gpuslice trusts
    got = read_gpu_labels(A40_SINGLE, {"gpuslice.io/gpu-count": "\u0662"}, CAT, "n1")
    assert isinstance(got, LabelProblem) and "gpuslice.io/gpu-count" in got.message
    ok = read_gpu_labels(A40_SINGLE, {"gpuslice.io/gpu-count": " 2 "}, CAT, "n1")
    assert isinstance(ok, GpuLabels) and ok.gpu_count == 2


def test_a_snapshot_whose_gpu_count_label_is_not_ascii_exits_2_naming_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    n1 = node("gpu-1", {"gpuslice.io/partitioning": "mig", **A40_SINGLE})
    n1["metadata"]["labels"]["nvidia.com/gpu.count"] = "\u00b2"
    path = tmp_path / "dump.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [n1]}))
    rc = main(["plan", "--snapshot", str(path)])
    err = capsys.readouterr().err
    assert rc == EXIT_BAD_INPUT
    assert str(path) in err and "Node gpu-1" in err
    assert "metadata.labels['nvidia.com/gpu.count']" in err


@pytest.mark.parametrize("value", ["\u00b2", "1" * 5000])
def test_a_trace_request_count_that_is_not_ascii_digits_is_a_workload_error(value: str) -> None:
    with pytest.raises(WorkloadError, match="must be a whole number of devices"):
        parse_gpu_requests({"nvidia.com/mig-1g.10gb": value}, "w.yaml: pods[0] (a)")
