"""``gpuslice plan`` and ``gpuslice bench``: demo output, JSON, kubectl snapshots, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_tables import table

from gpuslice.cli import EXIT_BAD_INPUT, main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_demo_text_shows_layouts_assignments_and_reasons(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, _ = run_cli(capsys, "plan", "--demo", "--policy", "greedy")
    assert rc == 0
    layouts = {(r["NODE"], r["GPU"]): r for r in table(out, "NODE")}
    # The greedy takes the first GPU in index order for the 1g pod and destroys the free 3g.
    assert layouts["node-a", "0"] == {
        "NODE": "node-a",
        "GPU": "0",
        "MODE": "mig",
        "BEFORE": "3g.40gb@0 (used), 3g.40gb@4",
        "AFTER": "3g.40gb@0 (used), 2g.20gb@4, 1g.10gb@6",
    }
    assert (layouts["node-d", "1"]["MODE"], layouts["node-d", "1"]["BEFORE"]) == ("mps", "-")
    assert layouts["node-d", "1"]["AFTER"] == "16gb/50%"  # 16384 of 32256 MiB, rounded down
    assert layouts["node-d", "0"]["AFTER"] == "8gb/25% (used), 8gb/25%, 8gb/25%"
    assignments = {r["POD"]: r for r in table(out.split("Assignments (10):")[1], "POD")}
    assert assignments["ml/h100-only"] == {
        "POD": "ml/h100-only",
        "NODE": "node-c",
        "SLICES": "mig-2g.20gb on GPU 0",
    }
    (unplaced,) = table(out.split("Unplaced (1):")[1], "POD")
    assert unplaced["POD"] == "infer/too-big"
    assert unplaced["REASON"].startswith("exceeds any GPU of model V100-32GB")


@pytest.mark.parametrize("policy", ["cpsat", "greedy"])
def test_demo_json_keeps_used_instances(capsys: pytest.CaptureFixture[str], policy: str) -> None:
    rc, out, _ = run_cli(capsys, "plan", "--demo", "--json", "--policy", policy, "--seed", "1")
    assert rc == 0
    doc = json.loads(out)
    assert doc["policy"] == policy
    assert set(doc["unplaced"]) == {"infer/too-big"}
    assert len(doc["assignments"]) == 10
    assert doc["layouts"], "the demo batch needs repartitioning"
    for gpu in doc["layouts"]:
        used = [s for s in gpu["before"] if s.endswith("(used)")]
        assert all(s in gpu["after"] for s in used), gpu
        assert gpu["before"] != gpu["after"]


def kubectl_doc() -> dict[str, Any]:
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": "gpu-1",
            "uid": "n1",
            "labels": {
                "nos.nebuly.com/gpu-partitioning": "mig",
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                "nvidia.com/gpu.count": "1",
            },
        },
        "status": {"allocatable": {"cpu": "32", "memory": "128Gi"}},
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "job", "namespace": "ml", "uid": "p1"},
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/mig-3g.40gb": "2"}}}]
        },
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}],
        },
    }
    return {"apiVersion": "v1", "kind": "List", "items": [node, pod]}


def test_snapshot_file_is_planned(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(kubectl_doc()))
    rc, out, _ = run_cli(capsys, "plan", "--snapshot", str(path), "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["assignments"] == {
        "ml/job": {"node": "gpu-1", "gpus": {"nvidia.com/mig-3g.40gb": [0, 0]}}
    }
    assert doc["layouts"] == [
        {
            "node": "gpu-1",
            "gpu": 0,
            "mode": "mig",
            "model": "A100-SXM4-80GB",
            "before": [],
            "after": ["3g.40gb@0", "3g.40gb@4"],
        }
    ]


def test_pods_refused_before_planning_are_unplaced_pods_with_their_reason(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A pending pod refused before the planner sees it (a name no GPU advertises) is a pod of
    the batch the plan cannot place: counted pending, listed Unplaced with why (it was a note
    on stderr only, and the table said "Unplaced (0)")."""
    doc = kubectl_doc()
    misspelt = json.loads(json.dumps(doc["items"][1]))
    misspelt["metadata"] |= {"name": "typo", "uid": "p2"}
    misspelt["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/mig-3G.40GB": "1"}
    doc["items"].append(misspelt)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(doc))
    rc, out, _ = run_cli(capsys, "plan", "--snapshot", str(path), "--json")
    assert rc == 0
    plan = json.loads(out)
    assert plan["pending_pods"] == 2 and list(plan["assignments"]) == ["ml/job"]
    assert list(plan["unplaced"]) == ["ml/typo"]
    assert "did you mean nvidia.com/mig-3g.40gb" in plan["unplaced"]["ml/typo"]
    rc, out, _ = run_cli(capsys, "plan", "--snapshot", str(path))
    assert rc == 0 and "Unplaced (1):" in out and "ml/typo" in out


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot read snapshot file"),
        ("{not json", "not valid JSON"),
        ('{"kind": "Node"}', "expected a Kubernetes List"),
    ],
)
def test_bad_snapshot_file_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str | None, expected: str
) -> None:
    path = tmp_path / "dump.json"
    if content is not None:
        path.write_text(content)
    rc, _, err = run_cli(capsys, "plan", "--snapshot", str(path))
    assert rc == EXIT_BAD_INPUT
    assert expected in err
    assert str(path) in err


def test_bad_catalog_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "cat.yaml"
    path.write_text("models: [{name: X}]\n")
    rc, _, err = run_cli(capsys, "plan", "--demo", "--catalog", str(path))
    assert rc == EXIT_BAD_INPUT
    assert str(path) in err and "memory_mib" in err


def test_catalog_override_file_is_used(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Override V100-32GB as a 48 GB board: the demo's 40 GB MPS pod now fits.
    path = tmp_path / "cat.yaml"
    path.write_text(
        "models:\n  - {name: V100-32GB, memory_mib: 49152, product_aliases: [V100-32GB]}\n"
    )
    rc, out, _ = run_cli(
        capsys, "plan", "--demo", "--policy", "greedy", "--json", "--catalog", str(path)
    )
    assert rc == 0
    assert "infer/too-big" in json.loads(out)["assignments"]


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "planner", "--sizes", "2", "--instances", "1,2"],
        ["bench", "planner", "--sizes", "2", "--time-limit", "0"],
        ["plan", "--demo", "--time-limit", "-1"],
    ],
)
def test_bad_options_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    rc, _, err = run_cli(capsys, *argv)
    assert rc == EXIT_BAD_INPUT
    assert "must be positive" in err or "--instances has 2 values" in err


def test_bench_planner_prints_the_table_and_keeps_the_json_under_out(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = ("bench", "planner", "--sizes", "2,3", "--instances", "1", "--time-limit", "0.5")
    rc, out, err = run_cli(capsys, *bench, "--out", str(tmp_path / "b"))
    assert rc == 0
    assert "2 nodes, instance 1/1" in err and f"wrote {tmp_path / 'b' / 'planner.json'}" in err
    doc = json.loads((tmp_path / "b" / "planner.json").read_text())
    rows = table(out, "NODES (GPUS)")
    assert [r["NODES (GPUS)"] for r in rows] == ["2 (16)", "3 (24)"]
    for row, size in zip(rows, doc["sizes"], strict=True):
        cpsat, greedy = size["cpsat"], size["greedy"]
        assert row["CP-SAT P50 / P99 S"] == (
            f"{cpsat['solve_s']['p50']:.3f} / {cpsat['solve_s']['p99']:.3f}"
        )
        assert row["PLACED, CP-SAT VS GREEDY"] == f"{cpsat['placed'][0]} vs {greedy['placed'][0]}"
        assert row["CP-SAT >= GREEDY"] == ("yes" if size["cpsat_ge_greedy"] else "no")
    # the first releases' --out FILE still writes that file, with a note
    rc, out, err = run_cli(capsys, *bench, "--out", str(tmp_path / "bench.json"), "-o", "json")
    assert rc == 0 and "--out FILE is deprecated" in err
    assert json.loads(out)["sizes"][0]["nodes"] == 2
    assert json.loads((tmp_path / "bench.json").read_text())["sizes"][1]["nodes"] == 3


def test_a_node_left_out_for_its_labels_is_named_as_the_controller_names_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The only MPS node has a label problem: the pod's reason blamed its own nodeSelector,
    affinity and tolerations (it has none); now it names the node it would fit and the
    problem, in the words of the controller's ``Unplaceable`` Event."""
    from test_partitioner_promises import Cluster

    from partitioner.actions import EmitEvent

    doc = kubectl_doc()
    broken = json.loads(json.dumps(doc["items"][0]))
    broken["metadata"] |= {"name": "gpu-2", "uid": "n2"}
    broken["metadata"]["labels"] = {
        "gpuslice.io/partitioning": "mps",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "nvidia.com/gpu.count": "two",
    }
    mps = json.loads(json.dumps(doc["items"][1]))
    mps["metadata"] |= {"name": "mps", "uid": "p2", "creationTimestamp": "2027-01-15T08:00:00Z"}
    mps["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu-10gb": "1"}
    mps["spec"]["schedulingGates"] = [{"name": "gpuslice.io/partitioner"}]
    doc["items"] += [broken, mps]
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(doc))
    rc, out, _ = run_cli(capsys, "plan", "--snapshot", str(path), "--json")
    assert rc == 0
    reason = json.loads(out)["unplaced"]["ml/mps"]
    assert reason.startswith("cannot place: no eligible node: no opted-in MPS node matches")
    assert "; node gpu-2, which the pod would fit, is left out: " in reason
    d = Cluster(*doc["items"]).step(1_800_000_000.0 + 10)  # the pod exists for 10 s
    (told,) = [
        a.message
        for a in d.actions
        if isinstance(a, EmitEvent) and a.reason == "Unplaceable" and a.ref.name == "mps"
    ]
    assert reason == told


def test_a_pod_asking_for_zero_slices_is_not_gpuslices(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A pod whose every slice amount is zero (kube-scheduler places it like any pod; the
    webhook leaves it ungated) was listed Unplaced, "unknown resource: the pod requests no MIG
    or MPS resource"; it is not in the batch at all."""
    doc = kubectl_doc()
    zero = json.loads(json.dumps(doc["items"][1]))
    zero["metadata"] |= {"name": "zero", "uid": "p2"}
    zero["spec"]["containers"][0]["resources"]["limits"] = {
        "nvidia.com/mig-1g.10gb": "0",
        "nvidia.com/gpu-10gb": "0",
    }
    doc["items"].append(zero)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(doc))
    rc, out, err = run_cli(capsys, "plan", "--snapshot", str(path), "--json")
    assert rc == 0
    plan = json.loads(out)
    assert (plan["pending_pods"], plan["unplaced"], list(plan["assignments"])) == (
        1,
        {},
        ["ml/job"],
    )
    assert "ml/zero" not in err


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ({"mode": "MIG", "gpus": []}, "at spec.mode"),
        (None, "at spec"),
        (
            {"mode": "mig", "gpus": [{"index": 0, "mig": []}, {"index": 0, "mig": []}]},
            "GPU 0: listed twice in spec.gpus; list it once",
        ),
    ],
    ids=["mode wrong", "spec null", "spec lists GPU 0 twice"],
)
def test_a_hand_edited_invalid_partitioning_leaves_its_node_out_with_the_controllers_words(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, spec: Any, error: str
) -> None:
    """A NodePartitioning a hand edit made invalid was noted as "skipped, its last spec is not
    applied yet" (a wrong cause), and a spec listing a GPU twice -- which the API server and
    the controller admit -- refused the whole dump (exit 2).  Now the note is the
    controller's ``InvalidPartitioning`` text with the fix, the node is left out, and the
    reason of a pod that could have used it names it."""
    doc = kubectl_doc()
    mps = json.loads(json.dumps(doc["items"][0]))
    mps["metadata"] |= {"name": "gpu-2", "uid": "n2"}
    mps["metadata"]["labels"]["nos.nebuly.com/gpu-partitioning"] = "mps"
    doc["items"].append(mps)  # the pod may use it, but it serves no MIG profile
    doc["items"].append(
        {
            "apiVersion": "gpuslice.io/v1alpha1",
            "kind": "NodePartitioning",
            "metadata": {"name": "gpu-1", "generation": 1},
            "spec": spec,
        }
    )
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(doc))
    rc, out, err = run_cli(capsys, "plan", "--snapshot", str(path), "--json")
    assert rc == 0
    plan = json.loads(out)
    assert plan["assignments"] == {} and plan["layouts"] == []
    assert plan["unplaced"]["ml/job"].endswith(
        "left out of this plan, though the pod may use them: gpu-1 (its NodePartitioning is "
        "invalid)"
    )
    (note,) = [n for n in plan["warnings"] if "gpu-1" in n]
    assert note.startswith("node gpu-1: InvalidPartitioning: NodePartitioning gpu-1 is invalid: ")
    assert error in note and "undo the hand edit (kubectl edit nodepartitioning gpu-1)" in note
    assert "not applied yet" not in err


def test_pods_whose_nodes_are_all_left_out_are_unplaced_with_why(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The only node holds a spec its agent has not applied: the pod is not in the planner's
    batch, and it was dropped ("Planned 0 pending pod(s)", "Unplaced (0)")."""
    doc = kubectl_doc()
    doc["items"].append(
        {
            "apiVersion": "gpuslice.io/v1alpha1",
            "kind": "NodePartitioning",
            "metadata": {"name": "gpu-1", "generation": 3, "annotations": {}},
            "spec": {"planId": "5", "mode": "mig", "gpus": []},
            "status": {"observedGeneration": 2, "gpus": [{"index": 0, "mig": []}]},
        }
    )
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(doc))
    rc, out, _ = run_cli(capsys, "plan", "--snapshot", str(path), "--json")
    assert rc == 0
    plan = json.loads(out)
    assert plan["pending_pods"] == 1 and plan["assignments"] == {}
    assert list(plan["unplaced"]) == ["ml/job"]
    assert plan["unplaced"]["ml/job"].startswith("waiting: ")
    assert "gpu-1" in plan["unplaced"]["ml/job"]
