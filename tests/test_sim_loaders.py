"""Loaders: openb CSVs (pods, nodes), the cluster and workload YAML/JSON formats, the generator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openb_data import OPENB, needs_openb

from planner.snapshot import Mode
from simulations.inputs.cluster import (
    ClusterError,
    load_cluster,
    load_cluster_file,
    load_openb_nodes,
)
from simulations.inputs.openb import (
    OPENB_DIR_ENV,
    TraceError,
    load_openb_pods,
    openb_dir,
    resolve_trace,
)
from simulations.inputs.workload import (
    Pod,
    PodShape,
    SyntheticSpec,
    WorkloadError,
    load_workload,
    synthetic_workload,
)

POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ----------------------------------------------------------------------------- openb pods


def test_openb_pods_normalised_like_fgd(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "openb_pod_list_mini.csv",
        POD_HEADER
        + "p0,12000,16384,1,1000,,LS,Running,0,100,0\n"
        + "p1,6000,12288,1,1460,T4||P100,BE,Running,5,,\n"  # share clipped to 1000
        + "p2,4000,8192,1,0,T4,BE,Failed,7,9,\n"  # zero share -> CPU-only, spec dropped
        + "p3,8000,8192,0,0,nan,LS,Running,1,2,1\n"
        + "p4,88000,65536,8,1000,,LS,Running,3,4,3\n",
    )
    w = load_openb_pods(p)
    assert w.name == "mini"
    by = {pod.name: pod for pod in w.pods}
    assert by["p0"] == Pod("p0", 12000, 16384, 1, 1000, (), "LS", 0, 100, 0)
    assert (by["p1"].gpu_milli, by["p1"].gpu_spec, by["p1"].deletion_time) == (
        1000,
        ("T4", "P100"),
        None,
    )
    assert by["p2"].is_cpu_only and by["p2"].gpu_spec == () and by["p2"].gpu_milli == 0
    assert by["p3"].is_cpu_only
    assert by["p4"].total_gpu_milli == 8000 and not by["p4"].is_sharing
    assert w.total_gpu_milli == 1000 + 1000 + 8000


def test_openb_pods_multigpu20_layout_has_five_columns(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "m.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1000,10,1,500\nb,2000,10,0,0\n",
    )
    w = load_openb_pods(p)
    assert [(x.name, x.gpu_milli, x.qos, x.creation_time) for x in w.pods] == [
        ("a", 500, "", None),
        ("b", 0, "", None),
    ]


def test_openb_bad_rows_are_reported_with_line_numbers(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "bad.csv",
        POD_HEADER
        + "ok,1000,10,1,500,,LS,Running,0,1,0\n"  # line 2
        + "x,abc,10,1,500,,LS,Running,0,1,0\n"  # line 3: cpu not an integer
        + "ok,1000,10,1,500,,LS,Running,0,1,0\n"  # line 4: duplicate name
        + "y,-5,10,1,500,,LS,Running,0,1,0\n"  # line 5: negative CPU
        + "z,1000,10,1,500,,LS,Running,9,3,0\n",  # line 6: deleted before created
    )
    with pytest.raises(TraceError) as e:
        load_openb_pods(p)
    msg = str(e.value)
    assert "4 bad row(s)" in msg
    assert f"{p}:3: column 'cpu_milli': 'abc' is not an integer" in msg
    assert f"{p}:4: duplicate pod name 'ok' (first on line 2)" in msg
    assert f"{p}:5:" in msg and "must be >= 0" in msg
    assert f"{p}:6:" in msg and "deletion_time" in msg


def test_openb_ragged_row_and_missing_column(tmp_path: Path) -> None:
    ragged = write(
        tmp_path, "r.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1,1,0,0\nb,1,1\n"
    )
    with pytest.raises(TraceError, match=r"r\.csv:3: 3 cells, the header has 5"):
        load_openb_pods(ragged)
    nohdr = write(tmp_path, "h.csv", "name,cpu_milli,num_gpu\na,1,0\n")
    with pytest.raises(
        TraceError, match=r"h\.csv:1: header lacks column\(s\) memory_mib, gpu_milli"
    ):
        load_openb_pods(nohdr)
    with pytest.raises(TraceError, match="no pod rows"):
        load_openb_pods(write(tmp_path, "e.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"))


def test_openb_nodes_and_bad_node_rows(tmp_path: Path) -> None:
    good = write(
        tmp_path,
        "nodes.csv",
        "sn,cpu_milli,memory_mib,gpu,model\nn0,96000,393216,8,G2\nn1,104000,524288,2,T4\nn2,8000,100,0,\n",
    )
    c = load_openb_nodes(good)
    assert c.total_gpus == 10 and c.max_node_cpu_milli == 104000 and c.max_node_gpus == 8
    assert [(n.model, n.catalog_model, n.mode) for n in c.nodes] == [
        ("G2", None, Mode.MPS),
        ("T4", "T4", Mode.MPS),
        ("", None, Mode.MPS),
    ]
    bad = write(
        tmp_path,
        "bad.csv",
        "sn,cpu_milli,memory_mib,gpu,model\nn0,96000,1,8,G2\nn0,1,1,x,G2\nn2,1,1,2,\n",
    )
    with pytest.raises(TraceError) as e:
        load_openb_nodes(bad)
    assert f"{bad}:3: duplicate node 'n0'" in str(e.value)
    assert f"{bad}:3: column 'gpu': 'x' is not an integer" in str(e.value)
    assert f"{bad}:4: node 'n2' has 2 GPUs but no model" in str(e.value)


def test_openb_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "openb_pod_list_tiny.csv").write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1,1,0,0\n"
    )
    monkeypatch.setenv(OPENB_DIR_ENV, str(tmp_path))
    assert openb_dir() == tmp_path
    assert resolve_trace("tiny") == tmp_path / "openb_pod_list_tiny.csv"
    with pytest.raises(TraceError, match=r"no openb trace named 'nope'.*known: tiny"):
        resolve_trace("nope")
    monkeypatch.setenv(OPENB_DIR_ENV, str(tmp_path / "missing"))
    with pytest.raises(TraceError, match="--openb-dir"):
        openb_dir()


@needs_openb
def test_real_openb_files_load() -> None:
    c = load_openb_nodes(OPENB / "openb_node_list_gpu_node.csv")
    assert (len(c.nodes), c.total_gpus, c.max_node_cpu_milli, c.max_node_gpus) == (
        1213,
        6212,
        128000,
        8,
    )
    w = load_openb_pods(OPENB / "openb_pod_list_default.csv")
    assert len(w) == 8152 and w.total_gpu_milli == 6_086_800
    assert len(load_openb_pods(OPENB / "openb_pod_list_multigpu20.csv")) == 8324
    spec = load_openb_pods(OPENB / "openb_pod_list_gpuspec10.csv")
    assert any(p.gpu_spec == ("V100M16", "V100M32") for p in spec.pods)
    assert load_cluster("openb", OPENB).total_gpus == 6212


# ----------------------------------------------------------------------------- cluster YAML

CLUSTER_YAML = """
name: lab
pools:
  - {name: a100, count: 2, gpu_model: NVIDIA-A100-SXM4-80GB, gpus_per_node: 8, cpu_milli: 96000, memory_mib: 1000, mode: mig}
  - {name: t4, count: 1, gpu_model: t4, gpus_per_node: 2, cpu_milli: 104000, memory_mib: 1000}
  - {name: cpu, count: 1, gpus_per_node: 0, cpu_milli: 64000, memory_mib: 1000}
"""


def test_cluster_yaml(tmp_path: Path) -> None:
    c = load_cluster_file(write(tmp_path, "c.yaml", CLUSTER_YAML))
    assert c.name == "lab" and c.total_gpus == 18
    assert [(n.name, n.model, n.mode) for n in c.nodes] == [
        ("a100-000", "A100-SXM4-80GB", Mode.MIG),
        ("a100-001", "A100-SXM4-80GB", Mode.MIG),
        ("t4-000", "T4", Mode.MPS),
        ("cpu-000", "", Mode.MPS),
    ]
    same = load_cluster(
        str(
            write(
                tmp_path,
                "c.json",
                json.dumps(
                    {
                        "pools": [
                            {
                                "name": "x",
                                "count": 1,
                                "gpus_per_node": 0,
                                "cpu_milli": 1,
                                "memory_mib": 1,
                            }
                        ]
                    }
                ),
            )
        )
    )
    assert same.name == "c" and same.total_gpus == 0


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        (
            "{name: a, count: 1, gpu_model: Z9000, gpus_per_node: 1, cpu_milli: 1, memory_mib: 1}",
            r"pools\[0\] \(a\): unknown GPU model 'Z9000'; the simulator knows the built-in "
            r"catalog's models \(.*A100-SXM4-80GB.*\): use one of them",
        ),
        (
            "{name: a, count: 1, gpu_model: T4, gpus_per_node: 1, cpu_milli: 1, memory_mib: 1, mode: mig}",
            r"pools\[0\] \(a\): mode mig needs a MIG-capable GPU; T4 is not",
        ),
        (
            "{name: a, count: 1, gpu_model: T4, gpus_per_node: 1, memory_mib: 1}",
            r"pools\[0\] \(a\): missing required field 'cpu_milli'",
        ),
        (
            "{name: a, count: 1, gpus_per_node: 1, cpu_milli: 1, memory_mib: 1}",
            r"'gpu_model' is required",
        ),
        (
            "{name: a, count: 1, gpus: 1, cpu_milli: 1, memory_mib: 1}",
            r"unknown field\(s\) \['gpus'\]",
        ),
        (
            "{name: a, count: -1, gpus_per_node: 0, cpu_milli: 1, memory_mib: 1}",
            r"'count' must be a non-negative integer",
        ),
        (
            "{name: a, count: 1, gpus_per_node: 0, cpu_milli: 1, memory_mib: 1, mode: vgpu}",
            r"mode 'vgpu' is not one of mig, mps, hybrid",
        ),
    ],
)
def test_cluster_yaml_errors_name_pool_and_field(tmp_path: Path, pool: str, message: str) -> None:
    p = write(tmp_path, "bad.yaml", f"pools:\n  - {pool}\n")
    with pytest.raises(ClusterError, match=message):
        load_cluster_file(p)


def test_cluster_duplicate_pool_names(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "d.yaml",
        "pools:\n  - {name: a, count: 1, gpus_per_node: 0, cpu_milli: 1, memory_mib: 1}\n  - {name: a, count: 1, gpus_per_node: 0, cpu_milli: 1, memory_mib: 1}\n",
    )
    with pytest.raises(ClusterError, match="duplicate node name 'a-000'"):
        load_cluster_file(p)


# ----------------------------------------------------------------------------- workload file

WORKLOAD_YAML = """
name: wl
pods:
  - {name: train, cpu_milli: 8000, memory_mib: 16384, num_gpu: 1, gpu_milli: 500, gpu_spec: [T4, P100], qos: LS, replicas: 2}
  - {name: big, cpu_milli: 64000, num_gpu: 8, gpu_milli: 1000, gpu_spec: "A100-SXM4-80GB|"}
  - {name: cpu, cpu_milli: 12500, creation_time: 5, deletion_time: 50}
"""


def test_workload_yaml_and_json(tmp_path: Path) -> None:
    w = load_workload(write(tmp_path, "w.yaml", WORKLOAD_YAML))
    assert w.name == "wl"
    assert [p.name for p in w.pods] == ["train-0", "train-1", "big", "cpu"]
    assert w.pods[0].gpu_spec == ("T4", "P100") and w.pods[0].qos == "LS"
    assert w.pods[2].gpu_spec == ("A100-SXM4-80GB",) and w.pods[2].total_gpu_milli == 8000
    assert w.pods[3].is_cpu_only and (w.pods[3].creation_time, w.pods[3].deletion_time) == (5, 50)
    j = load_workload(
        write(tmp_path, "w.json", json.dumps({"pods": [{"name": "a", "cpu_milli": 1}]}))
    )
    assert j.name == "w" and j.pods == (Pod("a", 1),)


@pytest.mark.parametrize(
    ("pods", "message"),
    [
        ("[{name: a}]", r"pods\[0\] \(a\): missing required field 'cpu_milli'"),
        (
            "[{name: a, cpu_milli: 1}, {name: b, cpu_milli: 1, num_gpu: 1}]",
            r"pods\[1\] \(b\): num_gpu is 1, so 'gpu_milli' \(1..1000\) is required",
        ),
        (
            "[{name: a, cpu_milli: 1, num_gpu: 1, gpu_milli: 1500}]",
            r"pods\[0\] \(a\):.*gpu_milli must be 1..1000",
        ),
        ("[{name: a, cpu_milli: 1.5}]", r"field 'cpu_milli' must be an integer"),
        ("[{name: a, cpu_milli: 1, gpu: 1}]", r"unknown field\(s\) \['gpu'\]"),
        ("[{name: a, cpu_milli: 1}, {name: a, cpu_milli: 2}]", r"duplicate pod name 'a'"),
        ("[]", r"'pods' must be a non-empty list"),
    ],
)
def test_workload_errors_name_entry_and_field(tmp_path: Path, pods: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message):
        load_workload(write(tmp_path, "bad.yaml", f"pods: {pods}\n"))


def test_workload_file_errors(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="cannot read workload file"):
        load_workload(tmp_path / "nope.yaml")
    with pytest.raises(WorkloadError, match="not valid JSON"):
        load_workload(write(tmp_path, "x.json", "{"))


# ----------------------------------------------------------------------------- generator

MIX = (
    PodShape(weight=3, cpu_milli=4000, num_gpu=1, gpu_milli=500),
    PodShape(weight=1, cpu_milli=8000),
    PodShape(weight=1, cpu_milli=16000, num_gpu=2, gpu_milli=1000),
)


def test_synthetic_is_seeded_and_follows_the_spec() -> None:
    spec = SyntheticSpec(count=400, mix=MIX, arrival_rate_per_s=2.0, mean_duration_s=100.0, seed=3)
    a, b = synthetic_workload(spec), synthetic_workload(spec)
    assert a == b and len(a) == 400
    other = synthetic_workload(
        SyntheticSpec(count=400, mix=MIX, arrival_rate_per_s=2.0, mean_duration_s=100.0, seed=4)
    )
    assert other.pods != a.pods
    times = [p.creation_time for p in a.pods]
    assert all(t is not None for t in times) and times == sorted(times)  # type: ignore[type-var]
    assert all(
        p.deletion_time is not None
        and p.creation_time is not None
        and p.deletion_time > p.creation_time
        for p in a.pods
    )
    shares = sum(1 for p in a.pods if p.gpu_milli == 500) / len(a)
    assert 0.5 < shares < 0.7  # weight 3 of 5
    last = a.pods[-1].creation_time
    assert last is not None and 150 < last < 250  # 400 arrivals at 2/s
    durations = [
        p.deletion_time - p.creation_time
        for p in a.pods
        if p.deletion_time is not None and p.creation_time is not None
    ]
    assert 70 < sum(durations) / len(durations) < 130


def test_synthetic_spec_from_file_and_errors(tmp_path: Path) -> None:
    w = load_workload(
        write(
            tmp_path,
            "s.yaml",
            "synthetic:\n  count: 5\n  seed: 1\n  mix:\n    - {weight: 1, cpu_milli: 100, num_gpu: 1, gpu_milli: 250}\n",
        )
    )
    assert w.name == "s" and len(w) == 5 and all(p.gpu_milli == 250 for p in w.pods)
    with pytest.raises(WorkloadError, match=r"mix\[0\]: each shape needs 'weight' and 'cpu_milli'"):
        load_workload(write(tmp_path, "b.yaml", "synthetic:\n  mix:\n    - {cpu_milli: 1}\n"))
    with pytest.raises(WorkloadError, match="count must be >= 1"):
        SyntheticSpec(count=0, mix=MIX)
