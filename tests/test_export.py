"""``gpuslice export``: kubectl dumps over time and kube-state-metrics series -> a workload in the
cluster's own resource names; its round trip into ``simulate``/``sweep``; bad input (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice.cli import main
from gpuslice.commands.export import sniff
from simulations.export.ksm import export_ksm
from simulations.export.kubectl import export_kubectl
from simulations.export.pods import ExportError, parse_time, split_at
from simulations.inputs.cluster import load_cluster_file
from simulations.inputs.workload import Pod, load_workload
from simulations.replay.engine import run_time_replay

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
T0 = "2026-11-23T09:50:00Z"
"""The earliest arrival of the kubectl scenario: second 0 of its workload."""


def at(hhmmss: str) -> str:
    return f"2026-11-23T{hhmmss}Z"


def sec(hhmmss: str) -> int:
    """Seconds from :data:`T0` to ``hhmmss``."""
    t, t0 = parse_time(at(hhmmss)), parse_time(T0)
    assert t is not None and t0 is not None
    return round(t - t0)


# --------------------------------------------------------------------------- kubectl objects


def container(name: str, requests: dict[str, str], *, limits_only: bool = False) -> dict[str, Any]:
    resources = {"limits": dict(requests)} if limits_only else {"requests": dict(requests)}
    return {"name": name, "image": "nvcr.io/nvidia/pytorch:24.10-py3", "resources": resources}


def pod(
    ns: str,
    name: str,
    uid: str,
    created: str,
    containers: list[dict[str, Any]],
    *,
    phase: str = "Running",
    scheduled: str | None = None,
    finished: list[str] | None = None,
    deletion: str | None = None,
    init: list[dict[str, Any]] | None = None,
    priority: int = 0,
    node: str = "gpu-0",
) -> dict[str, Any]:
    """A pod as ``kubectl get pods -A -o json`` has it: bound and running (``scheduled``),
    finished (``finished``: each container's finishedAt), or pending (neither)."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ns,
        "uid": uid,
        "creationTimestamp": at(created),
        "resourceVersion": "4821" + uid[-3:],
        "labels": {"app": name},
        "ownerReferences": [
            {"apiVersion": "batch/v1", "kind": "Job", "name": name, "controller": True}
        ],
    }
    if deletion:
        meta["deletionTimestamp"] = at(deletion)
        meta["deletionGracePeriodSeconds"] = 30
    spec: dict[str, Any] = {
        "containers": containers,
        "priority": priority,
        "restartPolicy": "Never",
        "schedulerName": "default-scheduler",
    }
    if init:
        spec["initContainers"] = init
    status: dict[str, Any] = {"phase": phase, "qosClass": "Burstable"}
    if scheduled:
        spec["nodeName"] = node
        status["startTime"] = at(scheduled)
        status["conditions"] = [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": at(scheduled)},
            {
                "type": "Ready",
                "status": str(phase == "Running"),
                "lastTransitionTime": at(scheduled),
            },
        ]
        states = [
            {"terminated": {"exitCode": 0, "startedAt": at(scheduled), "finishedAt": at(f)}}
            for f in finished or ()
        ] or [{"running": {"startedAt": at(scheduled)}} for _ in containers]
        status["containerStatuses"] = [
            {"name": c["name"], "ready": phase == "Running", "restartCount": 0, "state": s}
            for c, s in zip(containers, states, strict=True)
        ]
    else:
        status["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "lastTransitionTime": at(created),
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/mig-7g.80gb.",
            }
        ]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status}


def kube_list(*items: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "List",
        "metadata": {"resourceVersion": ""},
        "items": list(items),
    }


def node(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


MIG3 = {"cpu": "2", "memory": "8Gi", "nvidia.com/mig-3g.40gb": "1"}
CPU = {"cpu": "100m", "memory": "70Mi"}


def llm() -> dict[str, Any]:
    return pod(
        "serving",
        "llm-0",
        "u-llm",
        "09:50:00",
        [container("main", MIG3)],
        scheduled="09:50:02",
        priority=1000,
    )


def train(phase: str = "Running", finished: list[str] | None = None) -> dict[str, Any]:
    return pod(
        "research",
        "train-0",
        "u-train",
        "09:55:00",
        [
            container("a", {"cpu": "500m", "memory": "4Gi", "nvidia.com/mig-1g.10gb": "2"}),
            container("b", {"cpu": "500m", "memory": "4Gi", "nvidia.com/mig-1g.10gb": "1"}),
        ],
        init=[container("fetch", {"cpu": "1", "nvidia.com/mig-1g.10gb": "1"})],
        phase=phase,
        scheduled="09:55:10",
        finished=finished,
    )


def notebook() -> dict[str, Any]:  # MPS, limits only (the API copies them to requests)
    c = container("nb", {"nvidia.com/gpu-10gb": "1", "cpu": "1", "memory": "2Gi"}, limits_only=True)
    return pod("research", "nb", "u-nb", "10:01:00", [c], scheduled="10:01:03")


def sweep(deletion: str | None = None) -> dict[str, Any]:
    return pod(
        "research",
        "sweep",
        "u-sweep",
        "10:05:00",
        [container("m", {"cpu": "4", "nvidia.com/gpu": "2"})],
        scheduled="10:05:01",
        deletion=deletion,
    )


def worker(uid: str, created: str, **kw: Any) -> dict[str, Any]:
    return pod(
        "research",
        "worker",
        uid,
        created,
        [container("w", {"cpu": "1", "nvidia.com/mig-2g.20gb": "1"})],
        **kw,
    )


def others() -> list[dict[str, Any]]:
    return [
        pod(
            "kube-system",
            "coredns-x",
            "u-dns",
            "08:00:00",
            [container("dns", CPU)],
            scheduled="08:00:01",
        ),
        pod(
            "infra",
            "fpga-job",
            "u-fpga",
            "08:30:00",
            [container("f", {"cpu": "1", "example.com/fpga": "1"})],
            scheduled="08:30:01",
        ),
    ]


def write(path: Path, doc: Any) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture
def dumps(tmp_path: Path) -> list[str]:
    """Three dumps 10 minutes apart: a running pod, a job that finishes, a notebook that
    vanishes, a whole-GPU job being deleted, a pending pod, a name reused by a new uid, and pods
    without a GPU request (CPU only, another domain's resource) beside a Node."""
    d1 = kube_list(
        llm(),
        train(),
        worker("u-w1", "09:58:00", phase="Failed", scheduled="09:58:05", finished=["09:59:00"]),
        node("gpu-0", {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}),
        *others(),
    )
    d2 = kube_list(
        llm(), train("Succeeded", ["10:07:30", "10:08:00"]), notebook(), sweep(), *others()
    )
    d3 = kube_list(
        llm(),
        train("Succeeded", ["10:07:30", "10:08:00"]),
        sweep(deletion="10:19:00"),
        pod(
            "research",
            "pretrain",
            "u-pre",
            "10:15:00",
            [container("p", {"cpu": "8", "nvidia.com/mig-7g.80gb": "1"})],
            phase="Pending",
        ),
        worker("u-w2", "10:12:00", scheduled="10:12:02"),
        *others(),
    )
    return [
        write(tmp_path / "b.json", d2) + "@" + at("10:10:00"),
        write(tmp_path / "a.json", d1)
        + "@"
        + at("10:00:00"),  # order of arguments is not time order
        write(tmp_path / "c.json", d3) + "@" + at("10:20:00"),
    ]


# --------------------------------------------------------------------------- kubectl


def test_kubectl_dumps_give_arrival_requests_and_end_of_every_gpu_pod(dumps: list[str]) -> None:
    workload, report = export_kubectl(dumps, name="team")
    assert workload.name == "team"
    assert [p.name for p in workload.pods] == [
        "serving/llm-0",
        "research/train-0",
        "research/worker",
        "research/nb",
        "research/sweep",
        "research/worker#2",
        "research/pretrain",
    ]
    got = {p.name: p for p in workload.pods}
    end = sec("10:20:00")
    assert got["serving/llm-0"] == Pod(
        "serving/llm-0", 2000, 8192, qos="Burstable", creation_time=0, scheduled_time=2,
        deletion_time=end, slices=(("nvidia.com/mig-3g.40gb", 1),), priority=1000, running=True,
    )  # fmt: skip
    train_pod = got["research/train-0"]  # containers summed (2 + 1); the init container's 1 is less
    assert train_pod.slices == (("nvidia.com/mig-1g.10gb", 3),)
    assert (train_pod.cpu_milli, train_pod.memory_mib) == (1000, 8192)  # max(0.5 + 0.5, init 1)
    assert (train_pod.creation_time, train_pod.deletion_time) == (sec("09:55:00"), sec("10:08:00"))
    assert got["research/worker"].deletion_time == sec("09:59:00")  # Failed: its finishedAt
    nb = got["research/nb"]  # limits only; vanished from the 10:20 dump: ends when last seen
    assert nb.slices == (("nvidia.com/gpu-10gb", 1),) and nb.deletion_time == sec("10:10:00")
    sw = got["research/sweep"]
    assert (sw.num_gpu, sw.gpu_milli, sw.slices) == (2, 1000, ())
    assert sw.deletion_time == sec("10:19:00") and not sw.running
    pending = got["research/pretrain"]
    assert pending.scheduled_time is None and pending.running and pending.deletion_time == end
    assert got["research/worker#2"].creation_time == sec("10:12:00")
    assert dict(report.ends) == {"running": 3, "finished": 2, "vanished": 1, "deleted": 1}
    assert (report.exported, report.skipped_no_gpu, report.other_objects) == (7, 2, 1)
    assert report.files == [s.split("@")[0] for s in dumps]
    assert any("1 pod(s) request nvidia.com/gpu (whole GPUs)" in n for n in report.notes)


def test_dump_times_come_from_names_or_contents(tmp_path: Path) -> None:
    first = kube_list(llm(), notebook())
    second = kube_list(llm())
    named = [
        write(tmp_path / "pods-20261123T100500Z.json", first),
        write(tmp_path / "pods-20261123T101500Z.json", second),
    ]
    wl, report = export_kubectl(named)
    nb = next(p for p in wl.pods if p.name == "research/nb")
    assert nb.deletion_time == sec("10:05:00") and report.observation_end == parse_time(
        at("10:15:00")
    )
    assert not any("lower bound" in n for n in report.notes)
    # no names: the latest timestamp inside each dump stands for its time, and the report says so
    plain = [
        write(tmp_path / "x.json", first),
        write(tmp_path / "y.json", kube_list(llm(), sweep())),
    ]
    wl, report = export_kubectl(plain)
    assert next(p for p in wl.pods if p.name == "research/nb").deletion_time == sec("10:01:03")
    assert any("latest timestamp inside each dump (a lower bound)" in n for n in report.notes)
    with pytest.raises(ExportError, match="were taken at the same time"):
        export_kubectl([write(tmp_path / "x.json", second), write(tmp_path / "y.json", second)])
    assert split_at("d@x.json") == ("d@x.json", None)


def test_watch_streams_and_yaml_documents(tmp_path: Path) -> None:
    """``kubectl get pods -A -o json --watch --output-watch-events``: concatenated events; a
    DELETED event ends its pod.  YAML documents separated by --- read the same."""
    events = [
        {"type": "ADDED", "object": llm()},
        {"type": "ADDED", "object": notebook()},
        {"type": "MODIFIED", "object": sweep()},
        {"type": "DELETED", "object": sweep(deletion="10:09:00")},
    ]
    stream = tmp_path / "watch.json"
    stream.write_text("\n".join(json.dumps(e, indent=1) for e in events))
    wl, report = export_kubectl([str(stream) + "@" + at("10:30:00")])
    got = {p.name: p for p in wl.pods}
    assert (
        got["research/sweep"].deletion_time == sec("10:09:00") and not got["research/sweep"].running
    )
    assert got["research/nb"].running and report.ends == {"running": 2, "deleted": 1}
    docs = tmp_path / "pods.yaml"
    docs.write_text("---\n".join(yaml.safe_dump(o) for o in (llm(), sweep())))
    wl2, _ = export_kubectl([str(docs) + "@" + at("10:30:00")])
    assert [p.name for p in wl2.pods] == ["serving/llm-0", "research/sweep"]


@pytest.mark.parametrize("shared", ["", "-SHARED"])  # GFD's suffix for time-sliced devices
def test_gfd_single_strategy_nodes_turn_whole_gpus_into_their_mig_profile(
    tmp_path: Path, shared: str
) -> None:
    single = node(
        "gpu-0",
        {
            "nvidia.com/mig.strategy": "single",
            "nvidia.com/gpu.product": f"NVIDIA-A100-SXM4-40GB-MIG-1g.5gb{shared}",
        },
    )
    bound = pod(
        "ml",
        "nb",
        "u1",
        "10:00:00",
        [container("c", {"nvidia.com/gpu": "1"})],
        scheduled="10:00:01",
    )
    pending = pod("ml", "wait", "u2", "10:00:00", [container("c", {"nvidia.com/gpu": "1"})])
    wl, report = export_kubectl([write(tmp_path / "s.json", kube_list(single, bound, pending))])
    got = {p.name: p for p in wl.pods}
    assert got["ml/nb"].slices == (("nvidia.com/mig-1g.5gb", 1),)
    assert got["ml/wait"].num_gpu == 1  # not bound: no node says what nvidia.com/gpu is
    assert report.renamed == {
        "nvidia.com/gpu -> nvidia.com/mig-1g.5gb (GFD single MIG strategy)": 1
    }


def test_real_fixture_dumps_export() -> None:
    """The adoption tests' dumps (kubectl get nodes,pods): every pod asks for a GPU."""
    fixtures = ROOT / "tests" / "fixtures" / "clusters"
    wl, report = export_kubectl([str(fixtures / "gpu-operator-mixed.json")])
    assert len(wl) == 9 and report.other_objects == 3
    assert {r for p in wl.pods for r, _ in p.slices} >= {
        "nvidia.com/mig-3g.47gb",
        "nvidia.com/mig-7g.80gb",
    }
    nos = fixtures / "nos-mps.json"
    wl, report = export_kubectl([str(nos)])
    asked = {
        r
        for item in json.loads(nos.read_text())["items"]
        if item["kind"] == "Pod"
        for c in item["spec"]["containers"]
        for r in c["resources"].get("limits", {})
        if r.startswith("nvidia.com/gpu-")
    }
    assert "nvidia.com/gpu-10gb" in asked and {r for p in wl.pods for r, _ in p.slices} == asked


# --------------------------------------------------------------------------- kube-state-metrics


def series(name: str, labels: dict[str, str], value: float, times: range) -> dict[str, Any]:
    return {"metric": {"__name__": name, **labels}, "values": [[t, str(value)] for t in times]}


BASE = 1_800_000_000
STEPS = range(BASE, BASE + 3601, 600)  # an hour in 10-minute steps


def ksm_pod(
    ns: str,
    name: str,
    created: float | None,
    requests: dict[str, tuple[float, str]],
    times: range,
    **extra: Any,
) -> list[dict[str, Any]]:
    ids = {"namespace": ns, "pod": name, "uid": f"uid-{name}", "job": "kube-state-metrics"}
    out = [] if created is None else [series("kube_pod_created", ids, created, times)]
    for resource, (value, unit) in requests.items():
        container_labels = {
            **ids,
            "container": "main",
            "node": "gpu-0",
            "resource": resource,
            "unit": unit,
        }
        out.append(series("kube_pod_container_resource_requests", container_labels, value, times))
    for metric, (value, labels) in extra.items():
        out.append(series(metric, {**ids, **labels}, value, times))
    return out


def ksm_answer(*pods: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "status": "success",
        "data": {"resultType": "matrix", "result": [s for p in pods for s in p]},
    }


def test_ksm_range_query_gives_pods_in_kubernetes_names(tmp_path: Path) -> None:
    gpu = (1, "integer")
    doc = ksm_answer(
        # running to the end; sanitised names mapped back, a +me variant included
        ksm_pod(
            "serving",
            "llm",
            BASE - 100,
            {
                "nvidia_com_mig_1g_10gb_me": (2, "integer"),
                "cpu": (0.25, "core"),
                "memory": (1.5 * 2**30, "byte"),
            },
            STEPS,
            kube_pod_info=(1, {"priority_class": "serving-high"}),
            kube_pod_status_scheduled_time=(BASE - 90, {}),
            kube_pod_status_qos_class=(1, {"qos_class": "Guaranteed"}),
        ),
        # finished (completion time); an init container asks for more GPUs than the containers
        [
            *ksm_pod(
                "ml",
                "train",
                BASE,
                {"nvidia_com_gpu_20gb": gpu},
                STEPS,
                kube_pod_completion_time=(BASE + 1500, {}),
            ),
            series(
                "kube_pod_init_container_resource_requests",
                {
                    "namespace": "ml",
                    "pod": "train",
                    "uid": "uid-train",
                    "container": "init",
                    "resource": "nvidia_com_gpu_20gb",
                    "unit": "integer",
                },
                2,
                STEPS,
            ),
        ],
        # deleted (deletion timestamp), whole GPUs
        ksm_pod(
            "ml",
            "sweep",
            BASE + 60,
            {"nvidia_com_gpu": (2, "integer")},
            range(BASE + 600, BASE + 3001, 600),
            kube_pod_deletion_timestamp=(BASE + 2950, {}),
        ),
        # vanished after 20 minutes; no kube_pod_created: arrives at its first sample
        ksm_pod(
            "ml",
            "nb",
            None,
            {"nvidia_com_mig_3g_40gb": gpu},
            range(BASE + 600, BASE + 1201, 600),
            kube_pod_info=(1, {"priority_class": "batch-low"}),
        ),
        # a container crash-loops: a completion time, but the pod is Running (it holds its GPU)
        [
            *ksm_pod(
                "ml",
                "crashy",
                BASE + 10,
                {"nvidia_com_mig_2g_20gb": gpu},
                STEPS,
                kube_pod_completion_time=(BASE + 700, {}),
            ),
            series(
                "kube_pod_status_phase",
                {"namespace": "ml", "pod": "crashy", "uid": "uid-crashy", "phase": "Running"},
                1,
                STEPS,
            ),
            series(
                "kube_pod_status_phase",
                {"namespace": "ml", "pod": "crashy", "uid": "uid-crashy", "phase": "Succeeded"},
                0,
                STEPS,
            ),
        ],
        # no GPU request: skipped and counted
        ksm_pod(
            "kube-system",
            "dns",
            BASE - 9999,
            {"cpu": (0.1, "core")},
            STEPS,
            kube_pod_info=(1, {"priority_class": "system-cluster-critical"}),
        ),
    )
    path = write(tmp_path / "ksm.json", doc)
    wl, report = export_ksm([path], priority_classes={"serving-high": 1000})
    got = {p.name: p for p in wl.pods}
    t0 = BASE - 100
    assert got["serving/llm"] == Pod(
        "serving/llm", 250, 1536, qos="Guaranteed", creation_time=0, scheduled_time=10,
        deletion_time=BASE + 3600 - t0, slices=(("nvidia.com/mig-1g.10gb.me", 2),), priority=1000, running=True,
    )  # fmt: skip
    assert got["ml/train"].slices == (("nvidia.com/gpu-20gb", 2),)  # max(containers 1, init 2)
    assert got["ml/train"].deletion_time == BASE + 1500 - t0
    assert (got["ml/sweep"].num_gpu, got["ml/sweep"].deletion_time) == (2, BASE + 2950 - t0)
    assert (got["ml/nb"].creation_time, got["ml/nb"].deletion_time) == (700, 1300)
    assert got["ml/crashy"].running and got["ml/crashy"].deletion_time == BASE + 3600 - t0
    assert dict(report.ends) == {"running": 2, "finished": 1, "deleted": 1, "vanished": 1}
    assert report.skipped_no_gpu == 1 and report.arrival_first_seen == 1
    # the unknown class of a GPU pod is named; the CPU pod's class is not a GPU pod's concern
    assert any("batch-low (1 pods) get priority 0" in n for n in report.notes)
    assert not any("system-cluster-critical" in n for n in report.notes)


def test_ksm_text_scrapes_over_time(tmp_path: Path) -> None:
    """Two scrapes of /metrics without sample timestamps (times from FILE@TIME); label values
    with escapes; a pod gone from the second scrape vanished at the first."""
    first = tmp_path / "m1.txt"
    first.write_text(
        "# HELP kube_pod_created Unix creation timestamp\n# TYPE kube_pod_created gauge\n"
        f'kube_pod_created{{namespace="ml",pod="a",uid="u-a"}} {BASE}\n'
        f'kube_pod_created{{namespace="ml",pod="b",uid="u-b"}} {BASE + 30}\n'
        'kube_pod_container_resource_requests{namespace="ml",pod="a",uid="u-a",container="c",node="n",resource="nvidia_com_mig_2g_20gb",unit="integer"} 1\n'
        'kube_pod_container_resource_requests{namespace="ml",pod="b",uid="u-b",container="c \\"x\\"",node="n",resource="nvidia_com_gpu_5gb",unit="integer"} 1\n'
    )
    second = tmp_path / "m2.txt"  # sample timestamps in milliseconds this time
    second.write_text(
        f'kube_pod_created{{namespace="ml",pod="a",uid="u-a"}} {BASE} {(BASE + 600) * 1000}\n'
        f'kube_pod_container_resource_requests{{namespace="ml",pod="a",uid="u-a",container="c",node="n",resource="nvidia_com_mig_2g_20gb",unit="integer"}} 1 {(BASE + 600) * 1000}\n'
    )
    wl, report = export_ksm([f"{first}@{BASE + 60}", str(second)])
    got = {p.name: p for p in wl.pods}
    assert got["ml/a"].running and got["ml/a"].deletion_time == 600
    assert got["ml/b"].slices == (("nvidia.com/gpu-5gb", 1),) and got["ml/b"].deletion_time == 60
    assert report.ends == {"running": 1, "vanished": 1}


# --------------------------------------------------------------------------- the command


def test_cli_prints_yaml_that_loads_back_and_writes_json(
    dumps: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", *dumps, "--name", "team"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("# Workload exported by `gpuslice export`")
    assert "exported 7 GPU pod(s) from 3 kubectl file(s)" in err
    assert "ends: 1 deleted, 2 finished, 3 running, 1 vanished" in err
    assert "skipped 2 pod(s) without a GPU request and 1 object(s) that are not pods" in err
    doc = yaml.safe_load(out)
    assert doc["time_zero"] == T0 and doc["export"]["ends"]["vanished"] == 1
    printed = tmp_path / "printed.yaml"
    printed.write_text(out)
    expected, _ = export_kubectl(dumps, name="team")
    assert load_workload(printed).pods == expected.pods
    target = tmp_path / "w.json"
    assert main(["export", *dumps, "--name", "team", "--out", str(target), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert json.loads(target.read_text())["pods"][0]["requests"] == {"nvidia.com/mig-3g.40gb": 1}
    assert load_workload(target).pods == expected.pods


def test_round_trip_into_the_time_replay_and_sweep(
    dumps: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Export (dropping the MPS request: the cluster is MIG), then replay on 4 A100-80GB in MIG
    mode: every pod is bound with exactly the slices it asked for in the dumps."""
    out = tmp_path / "w.yaml"
    rc = main(
        ["export", *dumps, "--map-resource", "nvidia.com/gpu-10gb=", "--out", str(out), "--quiet"]
    )
    assert rc == 0
    wl = load_workload(out)
    assert "research/nb" not in {p.name for p in wl.pods}  # its only GPU request was dropped
    assert yaml.safe_load(out.read_text())["export"]["dropped"] == {"nvidia.com/gpu-10gb": 1}
    cluster_file = tmp_path / "c.yaml"
    cluster_file.write_text(
        "pools:\n  - {name: g, count: 1, gpu_model: A100-SXM4-80GB, gpus_per_node: 4, cpu_milli: 64000, memory_mib: 524288, mode: mig}\n"
    )
    result = run_time_replay(wl, load_cluster_file(cluster_file), "cpsat")
    replayed = {p.name: dict(p.requests) for p in result.pods}
    assert replayed == {
        p.name: (p.slice_requests or {"nvidia.com/mig-7g.80gb": p.num_gpu}) for p in wl.pods
    }
    assert result.disruptions == 0 and all(p.first_bound is not None for p in result.pods)
    capsys.readouterr()
    assert (
        main(
            [
                "simulate",
                "--trace",
                str(out),
                "--cluster",
                str(cluster_file),
                "--policy",
                "cpsat",
                "--quiet",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith(
        f"time replay: b ({len(wl)} pods)"
    )  # the first file names it
    monkeypatch.chdir(tmp_path)
    sweep_args = ["--timeouts", "30", "--idles", "10", "--weights", "default", "--quiet"]
    assert main(["sweep", "--trace", str(out), "--cluster", str(cluster_file), *sweep_args]) == 0
    assert "recommended: batch timeout 30 s" in capsys.readouterr().out


def test_example_files_export_and_replay(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/examples: the kubectl dumps (times from their names) and the KSM answer tell the
    same story; docs/workloads.md quotes these figures."""
    dumps = sorted(str(p) for p in EXAMPLES.glob("pods-*.json"))
    wl, report = export_kubectl(dumps)
    assert len(wl) == 8 and dict(report.ends) == {
        "deleted": 1,
        "finished": 2,
        "running": 4,
        "vanished": 1,
    }
    docs = (ROOT / "docs" / "workloads.md").read_text()
    assert (
        "exported 8 GPU pod(s) from 3 kubectl file(s), 2026-11-23T08:10:02Z .. 2026-11-23T09:30:00Z"
        in docs
    )
    ksm, ksm_report = export_ksm(
        [str(EXAMPLES / "ksm-query-range.json")], priority_classes={"serving-high": 1000}
    )
    by_name = {p.name: p for p in wl.pods}
    for p in ksm.pods:  # the KSM series were drawn from the same pods (5 of them)
        assert (
            by_name[p.name].slices == p.slices and by_name[p.name].creation_time == p.creation_time
        )
    assert dict(ksm_report.ends) == {"deleted": 1, "finished": 1, "running": 2, "vanished": 1}
    assert by_name["serving/embed-5b2d8-0"].priority == 1000 == ksm.pods[2].priority
    assert sniff(str(EXAMPLES / "ksm-query-range.json")) == "ksm" and sniff(dumps[0]) == "kubectl"
    mps = load_workload(EXAMPLES / "workload-mps.yaml")
    assert len(mps) == 9 and len(mps.slice_pods) == 8
    for cluster in ("cluster-a100-mig.yaml", "cluster-a100-mps.yaml"):
        assert load_cluster_file(EXAMPLES / cluster).total_gpus == 8


def test_export_needs_no_sim_extra(dumps: list[str]) -> None:
    """The command runs where only gpuslice's own dependencies are (the container image)."""
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from gpuslice.cli import main\n"
        f"sys.exit(main(['export', '--quiet', *{dumps!r}]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "serving/llm-0" in done.stdout


# --------------------------------------------------------------------------- bad input


def bad_pod(requests: dict[str, str]) -> dict[str, Any]:
    return pod("ml", "odd", "u-odd", "10:00:00", [container("c", requests)], scheduled="10:00:01")


@pytest.mark.parametrize(
    ("files", "extra", "messages"),
    [
        (
            [kube_list(llm(), bad_pod({"nvidia.com/gpu.shared": "1"}))],
            [],
            [
                "1 problem(s): pod ml/odd",
                "requests nvidia.com/gpu.shared, a GPU resource the simulator cannot replay",
                "--map-resource nvidia.com/gpu.shared=TO",
                "drop it with --map-resource nvidia.com/gpu.shared=",
            ],
        ),
        (
            [kube_list(bad_pod({"nvidia.com/gpu": "500m"}))],
            [],
            ["requests 0.500 of nvidia.com/gpu", "whole number"],
        ),
        (
            [kube_list(bad_pod({"nvidia.com/gpu": "1", "nvidia.com/mig-1g.10gb": "1"}))],
            [],
            ["whole GPUs (nvidia.com/gpu: 1) and slices"],
        ),
        (
            [kube_list(bad_pod({"cpu": "lots"}))],
            [],
            ["ml/odd", "unreadable resource requests", "malformed resource quantity 'lots'"],
        ),
        (
            [kube_list(others()[0])],
            [],
            ["no pod in", "requests an NVIDIA GPU resource", "nothing to export"],
        ),
        (
            [
                {
                    "apiVersion": "v1",
                    "kind": "List",
                    "items": [
                        {
                            "kind": "Pod",
                            "metadata": {"name": "m", "namespace": "x"},
                            "spec": {"containers": []},
                        }
                    ],
                }
            ],
            ["--map-resource", "nvidia.com/gpu=nvidia.com/gpu-10gb"],
            [
                "metadata.creationTimestamp is missing",
                "not manifests",
                "kubectl get pods -A -o json",
            ],
        ),
        (
            [{"foo": 1}],
            [],
            ["not a kubectl List, Pod or watch event", "kubectl get pods -A -o json"],
        ),
        (
            [kube_list(llm())],
            ["--map-resource", "nvidia.com/gpu"],
            ["--map-resource 'nvidia.com/gpu': expected FROM=TO"],
        ),
        (
            [kube_list(llm())],
            ["--map-resource", "a=nvidia.com/gpu.shared"],
            ["'nvidia.com/gpu.shared' is not one of"],
        ),
        (
            [kube_list(llm())],
            ["--priority-class", "high=1"],
            ["--priority-class is for kube-state-metrics data"],
        ),
        (
            [
                kube_list(llm()),
                ksm_answer(ksm_pod("ml", "a", BASE, {"nvidia_com_gpu": (1, "integer")}, STEPS)),
            ],
            [],
            ["the files are of different kinds", "--from"],
        ),
        (
            [
                {
                    "status": "success",
                    "data": {
                        "resultType": "matrix",
                        "result": [{"metric": {"pod": "a"}, "values": [[1, "1"]]}],
                    },
                }
            ],
            [],
            ["data.result[0]: a series without __name__", "export the series with their names"],
        ),
        (
            [{"status": "error", "errorType": "bad_data", "error": "parse error at char 3"}],
            ["--from", "ksm"],
            ["the query failed: bad_data parse error at char 3"],
        ),
        (
            [
                ksm_answer(
                    ksm_pod("ml", "a", BASE, {"nvidia_com_mig_1g_10gb": (1, "integer")}, STEPS)
                )
            ],
            ["--from", "ksm", "--priority-class", "high"],
            ["--priority-class 'high': expected NAME=VALUE"],
        ),
    ],
)
def test_bad_input_exits_2_naming_the_object_and_the_fix(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    files: list[Any],
    extra: list[str],
    messages: list[str],
) -> None:
    paths = [
        write(tmp_path / f"f{i}.json", doc) + f"@{at(f'10:3{i}:00')}" for i, doc in enumerate(files)
    ]
    assert main(["export", *paths, *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("gpuslice export: error: ")
    for message in messages:
        assert message in err


def test_unreadable_and_untimed_files_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path / "missing.json")]) == 2
    assert "cannot read kubectl dump file" in capsys.readouterr().err
    text = tmp_path / "metrics.txt"
    text.write_text(
        'kube_pod_container_resource_requests{namespace="a",pod="b",resource="nvidia_com_gpu"} 1\n'
    )
    assert main(["export", str(text)]) == 2
    assert f"name the time: {text}@2026-11-23T10:00:00Z" in capsys.readouterr().err
    text.write_text("kube_pod_created{namespace=a} 1\n")
    assert main(["export", f"{text}@{BASE}"]) == 2
    assert f"{text}:1: malformed labels" in capsys.readouterr().err
    empty = write(tmp_path / "empty.json", kube_list())
    assert main(["export", empty]) == 2
    assert "holds no pod with a timestamp" in capsys.readouterr().err


def test_a_terminating_pod_ends_when_it_is_gone_not_at_its_future_deletion_time(
    tmp_path: Path,
) -> None:
    """The API server sets deletionTimestamp to the delete request plus the grace period, in
    the future: a pod terminating in the 10:00 dump with an hour's grace, gone by 10:05, ended
    at 11:00, past the observation (the replay held its slice up to 55 minutes too long)."""

    def gpu_pod(name: str, created: str, **meta: str) -> dict[str, Any]:
        return {
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}",
                         "creationTimestamp": created, **meta},
            "spec": {"priority": 0, "nodeName": "n1", "containers": [
                {"name": "c", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}]},
            "status": {"phase": "Running", "startTime": created},
        }  # fmt: skip

    leaving = gpu_pod("leaving", "2026-11-23T09:00:00Z", deletionTimestamp="2026-11-23T11:00:00Z")
    stays = gpu_pod("stays", "2026-11-23T09:30:00Z")
    first = tmp_path / "pods-20261123T100000Z.json"
    first.write_text(json.dumps({"kind": "List", "items": [leaving, stays]}))
    second = tmp_path / "pods-20261123T100500Z.json"
    second.write_text(json.dumps({"kind": "List", "items": [stays]}))
    workload, _ = export_kubectl([str(first), str(second)])
    ends = {p.name: p.deletion_time for p in workload.pods}
    assert ends["ns/leaving"] == 3900  # gone by the 10:05 dump (09:00 is time zero)
    workload, _ = export_kubectl([str(first)])
    assert {p.name: p.deletion_time for p in workload.pods}["ns/leaving"] == 3600  # the end
