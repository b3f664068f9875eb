"""Bad input to ``gpuslice simulate`` and ``gpuslice export`` found by probing: each case exits 2
with one line naming the file (or object) and the fix -- never a traceback, never a hang.

* the saturation protocol with no pod asking for a GPU share (it used to draw clones forever),
  with every pod larger than 130 % of the cluster (it used to crash on an empty run), or with
  pods so small that tuning would take millions of copies;
* trace times whose replay timestamps (the replay's epoch plus the time) pass the year 9999;
* kubectl dumps with status fields of the wrong shape, and quantities that are not strings or
  numbers or beyond 2^63-1 (:mod:`partitioner.quantities` raises its own ``QuantityError``);
* kube-state-metrics times no timestamp can name (``1e12`` s, ``1e300``);
* messages: one location prefix, the file of a synthetic mix, long names cut, an
  ``--openb-dir`` that is a file or holds no trace.
"""

from __future__ import annotations

import datetime
import json
import math
import random
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from gpuslice.cli import main
from partitioner.quantities import QuantityError, cpu_milli, memory_mib, parse_quantity
from simulations.inputs.limits import MAX_PODS, MAX_TIME_S
from simulations.inputs.workload import Pod, WorkloadError, load_workload
from simulations.replay.engine import ReplaySettings
from simulations.saturation.protocol import build_arrivals
from tests.test_bad_input_cli_options import CLUSTER  # two one-GPU MIG nodes of the probe


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging) when the body runs past ``seconds``."""

    def expire(signum: int, frame: object) -> None:
        raise AssertionError(f"still running after {seconds} s (a hang)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def write(path: Path, doc: Any) -> str:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def run(argv: list[str], capsys: pytest.CaptureFixture[str], seconds: int = 60) -> tuple[int, str]:
    """(exit code, stderr) of one gpuslice command, which must end within ``seconds``."""
    with deadline(seconds):
        rc = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def simulate(trace: str, cluster: str, *more: str) -> list[str]:
    return ["simulate", "--trace", trace, "--cluster", cluster, "--repeats", "1", "--quiet", *more]


# --------------------------------------------------------------------------- saturation protocol


@pytest.mark.parametrize(
    ("name", "trace"),
    [
        ("w.json", {"pods": [{"name": "a", "cpu_milli": 1}]}),
        (
            "w.csv",
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1,1,-1,500\nb,1,1,1,-500\n",
        ),
        ("w.yaml", {"synthetic": {"count": 5, "mix": [{"weight": 1, "cpu_milli": 100}]}}),
    ],
)
@pytest.mark.parametrize("policy", ["bestfit", "gpuslice"])
def test_saturation_without_gpu_pods_is_refused_not_hung(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, trace: Any, policy: str
) -> None:
    w = write(tmp_path / name, trace)
    c = write(tmp_path / "c.json", CLUSTER)
    rc, err = run(simulate(w, c, "--policy", policy), capsys, seconds=20)
    assert rc == 2
    assert err.count("\n") == 1 and "asks for a GPU share" in err and "num_gpu" in err
    if policy == "bestfit":  # the scheduler protocol's rows name the file
        assert w in err


@pytest.mark.parametrize("policy", ["bestfit", "mps:fgd"])
def test_saturation_with_every_pod_too_large_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], policy: str
) -> None:
    w = write(
        tmp_path / "w.json",
        {"pods": [{"name": "a", "cpu_milli": 1, "num_gpu": 64, "gpu_milli": 1000}]},
    )
    c = write(tmp_path / "c.json", CLUSTER)
    rc, err = run(simulate(w, c, "--policy", policy), capsys)
    assert rc == 2
    assert "pod 'a' asks for 64 GPUs" in err and "larger cluster" in err


def test_tuning_refuses_more_copies_than_a_workload_may_hold() -> None:
    tiny = [Pod("a", 1, 0, 1, 1)] + [Pod(f"c{i}", 1) for i in range(9)]
    with deadline(30), pytest.raises(ValueError, match=f"more than {MAX_PODS:,} copies"):
        build_arrivals(tiny, 10**6 * 1000, random.Random(1))


def test_tuning_still_fills_to_the_target() -> None:
    pods = [Pod("a", 1, 0, 1, 500), Pod("b", 1)]
    arrivals = build_arrivals(pods, 4000, random.Random(3))
    assert sum(p.total_gpu_milli for p in arrivals) + 500 > 1.3 * 4000


# --------------------------------------------------------------------------- trace times


def test_the_time_limit_keeps_replay_timestamps_valid() -> None:
    """The replay stamps pods at its epoch plus a time below 4 x MAX_TIME_S (either sign)."""
    epoch = ReplaySettings().epoch_s
    for t in (epoch + 4 * MAX_TIME_S, epoch - 4 * MAX_TIME_S):
        datetime.datetime.fromtimestamp(t, datetime.UTC)  # no "year out of range"


@pytest.mark.parametrize("field", ["creation_time", "deletion_time", "scheduled_time"])
def test_times_past_the_limit_are_refused_naming_field_and_limit(
    tmp_path: Path, field: str
) -> None:
    pod = {"name": "a", "cpu_milli": 1, "num_gpu": 1, "gpu_milli": 500, "creation_time": 0}
    pod[field] = 10**12
    if field == "creation_time":
        pod["deletion_time"] = 10**12
    w = write(tmp_path / "w.json", {"pods": [pod]})
    with pytest.raises(WorkloadError, match=f"'{field}' is 1,000,000,000,000; the limit is 10,"):
        load_workload(w)


def test_csv_times_past_the_limit_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = write(
        tmp_path / "w.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time\n"
        "a,1,1,1,500,0,1000000000000\n",
    )
    c = write(tmp_path / "c.json", CLUSTER)
    rc, err = run(simulate(w, c, "--protocol", "time-replay"), capsys)
    assert rc == 2 and f"{w}:2" in err and "deletion_time" in err and "10,000,000,000" in err


def test_times_at_the_limit_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ask = {"nvidia.com/mig-1g.10gb": 1}
    pods = [
        {"name": "a", "cpu_milli": 1, "requests": ask, "creation_time": -MAX_TIME_S},
        {"name": "b", "cpu_milli": 1, "requests": ask, "creation_time": MAX_TIME_S},
    ]
    pods[0]["deletion_time"] = pods[1]["deletion_time"] = MAX_TIME_S
    w = write(tmp_path / "w.json", {"pods": pods})
    c = write(tmp_path / "c.json", {"pools": [{**CLUSTER["pools"][0], "cpu_milli": 1000}]})
    rc, err = run(simulate(w, c, "--protocol", "time-replay", "--policy", "greedy"), capsys)
    assert rc == 0, err


def test_synthetic_times_past_the_limit_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shape = {"weight": 1, "cpu_milli": 1, "num_gpu": 1, "gpu_milli": 500}
    w = write(
        tmp_path / "w.json",
        {"synthetic": {"count": 50, "arrival_rate_per_s": 1e-9, "mix": [shape]}},
    )
    c = write(tmp_path / "c.json", CLUSTER)
    rc, err = run(simulate(w, c, "--protocol", "time-replay"), capsys)
    assert rc == 2 and w in err and "past the time limit 10,000,000,000 s" in err


# --------------------------------------------------------------------------- kubectl dumps


def kube_pod(**status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u1",
            "creationTimestamp": "2026-11-23T08:00:00Z",
        },
        "spec": {
            "containers": [
                {"name": "main", "resources": {"requests": {"cpu": "1", "nvidia.com/gpu": "1"}}}
            ]
        },
        "status": {"phase": "Running", **status},
    }


def with_cpu(value: Any) -> dict[str, Any]:
    pod = kube_pod()
    pod["spec"]["containers"][0]["resources"]["requests"]["cpu"] = value
    return pod


@pytest.mark.parametrize(
    ("pod", "words"),
    [
        (kube_pod(conditions=5), "status.conditions must be a list"),
        (kube_pod(conditions="PodScheduled"), "status.conditions must be a list"),
        (
            kube_pod(phase="Succeeded", containerStatuses=[{"name": "main", "state": [1]}]),
            "status.containerStatuses[0] must be an object whose 'state' is an object",
        ),
        (kube_pod(containerStatuses={"main": {}}), "status.containerStatuses must be a list"),
        (kube_pod(initContainerStatuses=[5]), "status.initContainerStatuses[0] must be"),
        (with_cpu(False), "False is not a string or a number"),
        (with_cpu([1]), "[1] is not a string or a number"),
        (with_cpu("1e999999"), "'1e999999' is beyond 2^63-1"),
        (with_cpu("1e999999Ei"), "'1e999999Ei' is beyond 2^63-1"),
    ],
)
def test_malformed_kubectl_dumps_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pod: dict[str, Any], words: str
) -> None:
    dump = write(tmp_path / "pods.json", {"apiVersion": "v1", "kind": "List", "items": [pod]})
    rc, err = run(["export", dump, "--quiet"], capsys)
    assert rc == 2
    assert err.count("\n") == 1 and f"{dump}: object 1 (ns/p)" in err and words in err


def test_a_dump_time_no_timestamp_can_name_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dump = write(tmp_path / "pods.json", {"kind": "List", "items": [kube_pod()]})
    rc, err = run(["export", f"{dump}@1e300", "--quiet"], capsys)
    assert rc == 2 and f"{dump}@1e300" in err and "between years 1 and 9999" in err


def test_an_export_the_simulator_could_not_read_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    late = kube_pod()
    late["metadata"].update(name="q", uid="u2", creationTimestamp="2500-01-01T00:00:00Z")
    dump = write(tmp_path / "pods.json", {"kind": "List", "items": [kube_pod(), late]})
    rc, err = run(["export", f"{dump}@2500-01-02T00:00:00Z", "--quiet"], capsys)
    assert rc == 2 and "pod ns/q" in err and "past the simulator's limit of 10,000,000,000 s" in err


def test_long_names_are_cut_in_export_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pod = kube_pod(conditions=5)
    pod["metadata"]["name"] = "x" * 100_000
    dump = write(tmp_path / "pods.json", {"kind": "List", "items": [pod]})
    rc, err = run(["export", dump, "--quiet"], capsys)
    assert rc == 2 and len(err) < 1000 and "xxx..." in err


# --------------------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    "value",
    [False, True, None, [1], {"a": 1}, "1e999999", "1e9999999", "1e999999Ei", "8Ei", 2**63],
)
def test_quantities_raise_quantity_error_only(value: Any) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(value)
    with pytest.raises(QuantityError):
        cpu_milli(value)
    with pytest.raises(QuantityError):
        memory_mib(value)


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, -math.inf, 1e300, 10**5000],
    ids=["nan", "inf", "-inf", "1e300", "10**5000"],
)
def test_numbers_that_are_no_quantity_raise_quantity_error(value: Any) -> None:
    with pytest.raises(QuantityError) as e:
        parse_quantity(value)
    assert len(str(e.value)) < 120


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("100m", Decimal("0.1")),
        ("1Gi", Decimal(2**30)),
        ("1e3", Decimal(1000)),
        (" 2 ", Decimal(2)),
        (".5", Decimal("0.5")),
        ("-5", Decimal(-5)),
        ("7Ei", Decimal(7 * 2**60)),
        (2, Decimal(2)),
        (2.5, Decimal("2.5")),
        (2**63 - 1, Decimal(2**63 - 1)),
        ("9223372036854775807", Decimal(2**63 - 1)),
        (Decimal("0.1"), Decimal("0.1")),
    ],
)
def test_valid_quantities_parse_as_before(value: Any, expected: Decimal) -> None:
    assert parse_quantity(value) == expected


def test_cpu_and_memory_round_up_as_before() -> None:
    assert cpu_milli("100m") == 100 and cpu_milli(Decimal("0.0001")) == 1
    assert memory_mib("1Gi") == 1024 and memory_mib("1") == 1


# --------------------------------------------------------------------------- kube-state-metrics


def ksm(created_at: Any = 1795424400, created: str = "1795421402") -> dict[str, Any]:
    labels = {"namespace": "ns", "pod": "p", "uid": "u1"}
    requests = {
        "__name__": "kube_pod_container_resource_requests",
        "container": "main",
        "resource": "nvidia_com_gpu",
        "unit": "integer",
        **labels,
    }
    return {
        "status": "success",
        "data": {
            "resultType": "matrix",
            "result": [
                {
                    "metric": {"__name__": "kube_pod_created", **labels},
                    "values": [[created_at, created]],
                },
                {"metric": requests, "values": [[1795424400, "1"]]},
            ],
        },
    }


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        (ksm(created_at=1e12), "the sample time of kube_pod_created is 1e+12"),
        (ksm(created_at=1e300), "the sample time of kube_pod_created is 1e+300"),
        (ksm(created_at=-1e12), "the sample time of kube_pod_created is -1e+12"),
        (ksm(created="1e300"), "(ns/p): kube_pod_created is 1e+300"),
    ],
)
def test_ksm_times_no_timestamp_can_name_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: dict[str, Any], words: str
) -> None:
    path = write(tmp_path / "ksm.json", doc)
    rc, err = run(["export", path, "--quiet"], capsys)
    assert rc == 2 and err.count("\n") == 1 and path in err and words in err


def test_ksm_text_with_a_huge_created_value_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        'kube_pod_created{namespace="ns",pod="p",uid="u1"} 1e300\n'
        'kube_pod_container_resource_requests{namespace="ns",pod="p",uid="u1",container="m",'
        'resource="nvidia_com_gpu",unit="integer"} 1\n'
    )
    path = write(tmp_path / "metrics.txt", text)
    rc, err = run(["export", f"{path}@2026-11-23T10:00:00Z", "--quiet"], capsys)
    assert rc == 2 and "kube_pod_created is 1e+300" in err


def test_ksm_valid_still_exports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "ksm.json", ksm())
    rc, err = run(["export", path, "--quiet"], capsys)
    assert rc == 0, err


# --------------------------------------------------------------------------- messages


def test_a_field_error_names_its_place_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = write(tmp_path / "w.json", {"pods": [{"name": "a", "cpu_milli": 1, "qos": 5}]})
    rc, err = run(simulate(w, write(tmp_path / "c.json", CLUSTER)), capsys)
    assert rc == 2 and err.count(f"{w}: pods[0] (a):") == 1 and "'qos' must be a string" in err


def test_a_synthetic_mix_error_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = write(
        tmp_path / "w.json", {"synthetic": {"count": 5, "mix": [{"weight": 0, "cpu_milli": 1}]}}
    )
    rc, err = run(simulate(w, write(tmp_path / "c.json", CLUSTER)), capsys)
    assert rc == 2 and f"{w}: synthetic: 'mix' needs at least one shape with weight > 0" in err


@pytest.mark.parametrize(
    "pods",
    [
        [{"name": "x" * 100_000, "cpu_milli": -1}],
        [{"name": "x" * 100_000, "cpu_milli": 1, "num_gpu": 1, "gpu_milli": 5000}],
        [{"name": "x" * 100_000, "cpu_milli": 1}] * 2,
    ],
)
def test_long_pod_names_are_cut_in_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pods: list[dict[str, Any]]
) -> None:
    w = write(tmp_path / "w.json", {"pods": pods})
    rc, err = run(simulate(w, write(tmp_path / "c.json", CLUSTER)), capsys)
    assert rc == 2 and len(err) < 1000 and "xxx..." in err


def test_long_pod_names_are_cut_in_csv_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = "x" * 100_000 + ",1,1,1,5\n"
    w = write(tmp_path / "w.csv", "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + row * 2)
    rc, err = run(simulate(w, write(tmp_path / "c.json", CLUSTER)), capsys)
    assert rc == 2 and len(err) < 1000 and "duplicate pod name 'xxx" in err


def test_openb_dir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path / "afile", "x")
    c = write(tmp_path / "c.json", CLUSTER)
    rc, err = run(simulate("default", c, "--openb-dir", f), capsys)
    assert rc == 2 and f"{f} is not a folder" in err and "does not exist" not in err


def test_openb_dir_without_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    c = write(tmp_path / "c.json", CLUSTER)
    rc, err = run(simulate("default", c, "--openb-dir", str(tmp_path / "empty")), capsys)
    assert rc == 2 and "holds no openb_pod_list_*.csv" in err and "known: \n" not in err
