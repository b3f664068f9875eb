"""``gpuslice plan`` and ``gpuslice bench``: demo output, JSON, kubectl snapshots, bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

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
    # The greedy takes the first GPU in index order for the 1g pod and destroys the free 3g.
    assert (
        "node-a GPU 0: [3g.40gb@0 (used), 3g.40gb@4] -> [3g.40gb@0 (used), 2g.20gb@4, 1g.10gb@6]"
        in out
    )
    assert "node-d GPU 1 (MPS): [] -> [8gb/25%, 8gb/25%]" in out
    assert "ml/h100-only     -> node-c: mig-2g.20gb on GPU 0" in out
    assert "infer/too-big: exceeds any GPU of model V100-32GB" in out


@pytest.mark.parametrize("policy", ["cpsat", "greedy"])
def test_demo_json_keeps_used_instances(capsys: pytest.CaptureFixture[str], policy: str) -> None:
    rc, out, _ = run_cli(capsys, "plan", "--demo", "--json", "--policy", policy, "--seed", "1")
    assert rc == 0
    doc = json.loads(out)
    assert doc["policy"] == policy
    assert set(doc["unplaced"]) == {"infer/too-big"}
    assert len(doc["assignments"]) == 9
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


def test_bench_planner_command_writes_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_file = tmp_path / "bench.json"
    rc, out, err = run_cli(
        capsys,
        "bench",
        "planner",
        "--sizes",
        "2",
        "--instances",
        "1",
        "--time-limit",
        "0.5",
        "--out",
        str(out_file),
    )
    assert rc == 0 and out == ""
    assert "2 nodes, instance 1/1" in err
    doc = json.loads(out_file.read_text())
    assert [s["nodes"] for s in doc["sizes"]] == [2]
