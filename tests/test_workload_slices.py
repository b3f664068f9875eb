"""Workloads that name their slices (``requests: {nvidia.com/mig-1g.10gb: 1}``): the file format,
the checks against the replayed cluster, the time replay of exactly those requests, and
``gpuslice simulate`` choosing and refusing protocols for them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuslice.cli import main
from planner.catalog import default_catalog
from planner.snapshot import Mode
from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.gpu_resources import classify, from_ksm_label, ksm_label_of
from simulations.inputs.workload import Pod, Workload, WorkloadError, parse_workload, pod_entry
from simulations.inputs.workload_slices import (
    MAX_LISTED,
    SliceRequestError,
    direct_requests,
    require_shares,
)
from simulations.replay.engine import ReplayError, ReplaySettings, replay_pods, run_time_replay

A100 = "A100-SXM4-80GB"
CATALOG = default_catalog()


def one_pod(**fields: object) -> Pod:
    doc = {"pods": [{"name": "p", "cpu_milli": 1000, **fields}]}
    return parse_workload(doc, "w.yaml").pods[0]


# --------------------------------------------------------------------------- file format


def test_requests_give_slices_whole_gpus_priority_and_times() -> None:
    pod = one_pod(
        requests={"nvidia.com/mig-1g.10gb": 2, "nvidia.com/gpu-10gb": "1"},
        priority=1000,
        creation_time=5,
        scheduled_time=9,
        deletion_time=60,
        running=True,
    )
    assert pod.slices == (("nvidia.com/gpu-10gb", 1), ("nvidia.com/mig-1g.10gb", 2))
    assert pod.num_gpu == 0 and not pod.is_cpu_only and pod.total_gpu_milli == 0
    assert (pod.priority, pod.scheduled_time, pod.running) == (1000, 9, True)
    whole = one_pod(requests={"nvidia.com/gpu": 2})
    assert (whole.num_gpu, whole.gpu_milli, whole.slices) == (2, 1000, ())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"requests": {"nvidia_com_mig_1g_10gb": 1}}, "the resource is 'nvidia.com/mig-1g.10gb'"),
        ({"requests": {"mig-1g.10gb": 1}}, "add the domain: 'nvidia.com/mig-1g.10gb'"),
        ({"requests": {"cpu": 1}}, "CPU and memory go into cpu_milli"),
        ({"requests": {"nvidia.com/mig-1g": 1}}, "spelled like 1g.10gb"),
        ({"requests": {"nvidia.com/gpu.shared": 1}}, "not a GPU resource the simulator replays"),
        ({"requests": {"nvidia.com/gpu-10gb": 0}}, "it must be 1..1024"),
        ({"requests": {"nvidia.com/gpu-10gb": 1.5}}, "whole number of devices"),
        ({"requests": {}}, "must map GPU resource names to counts"),
        ({"requests": {"nvidia.com/gpu": 1, "nvidia.com/mig-1g.10gb": 1}}, "both whole GPUs"),
        ({"requests": {"nvidia.com/gpu": 1}, "num_gpu": 1}, "not both"),
        ({"creation_time": 10, "scheduled_time": 5}, "scheduled_time 5 needs a creation_time"),
        ({"running": "yes"}, "'running' must be true or false"),
        ({"priority": 2**31}, "'priority'"),
    ],
)
def test_bad_pod_entries_name_the_pod_and_the_fix(fields: dict[str, object], message: str) -> None:
    with pytest.raises(WorkloadError, match=re.escape("w.yaml: pods[0] (p)")) as e:
        one_pod(**fields)
    assert message in str(e.value)


def test_pod_invariants_hold_outside_files_too() -> None:
    with pytest.raises(WorkloadError, match="sorted"):
        Pod("x", 0, slices=(("nvidia.com/mig-2g.20gb", 1), ("nvidia.com/mig-1g.10gb", 1)))
    with pytest.raises(WorkloadError, match="not a MIG or MPS resource"):
        Pod("x", 0, slices=(("nvidia.com/gpu", 1),))
    with pytest.raises(WorkloadError, match="count must be"):
        Pod("x", 0, slices=(("nvidia.com/mig-1g.10gb", 0),))


_RESOURCES = st.sampled_from(
    ["nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb", "nvidia.com/mig-1g.10gb.me"]
    + [f"nvidia.com/gpu-{n}gb" for n in (1, 10, 79)]
)


@st.composite
def pods(draw: st.DrawFn) -> Pod:
    kind = draw(st.sampled_from(["slices", "whole", "share", "cpu"]))
    creation = draw(st.integers(0, 10**6))
    fields: dict[str, object] = {
        "creation_time": creation,
        "deletion_time": creation + draw(st.integers(0, 10**5)),
        "priority": draw(st.integers(-(2**31) + 1, 2**31 - 1)),
        "running": draw(st.booleans()),
        "qos": draw(st.sampled_from(["", "Guaranteed", "BE"])),
    }
    if draw(st.booleans()):
        fields["scheduled_time"] = creation + draw(st.integers(0, 100))
    if kind == "slices":
        names = draw(st.lists(_RESOURCES, min_size=1, max_size=3, unique=True))
        fields["slices"] = tuple(sorted((n, draw(st.integers(1, 1024))) for n in names))
    elif kind == "whole":
        fields.update(num_gpu=draw(st.integers(1, 8)), gpu_milli=1000)
    elif kind == "share":
        fields.update(num_gpu=1, gpu_milli=draw(st.integers(1, 999)))
    return Pod("ns/p", draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6)), **fields)  # type: ignore[arg-type]


@given(pods())
def test_pod_entry_round_trips_through_the_parser(pod: Pod) -> None:
    assert parse_workload({"pods": [pod_entry(pod)]}, "w").pods[0] == pod


def test_ksm_labels_map_back_for_every_catalog_profile_and_mps_size() -> None:
    names = {p.resource for m in CATALOG.models for p in m.profiles}
    names |= {f"nvidia.com/gpu-{n}gb" for n in (1, 10, 47, 180)} | {"nvidia.com/gpu"}
    assert len(names) > 40
    for name in names:
        label = ksm_label_of(name)
        assert "." not in label and "/" not in label and "-" not in label
        assert from_ksm_label(label) == name, label
        assert classify(name) is not None
    assert from_ksm_label("nvidia_com_gpu_shared") == "nvidia_com_gpu_shared"  # unknown: kept


# --------------------------------------------------------------------------- against the cluster


def test_direct_requests_pass_servable_names_through() -> None:
    model = CATALOG.model(A100)
    pods = [
        Pod("a", 0, slices=(("nvidia.com/mig-1g.10gb", 2), ("nvidia.com/mig-3g.40gb", 1))),
        Pod("b", 0, 0, 1, 500),  # a share pod: not this module's
    ]
    assert direct_requests(pods, model, Mode.MIG, 512) == {
        "a": {"nvidia.com/mig-1g.10gb": 2, "nvidia.com/mig-3g.40gb": 1}
    }
    mps = [Pod("m", 0, slices=(("nvidia.com/gpu-79gb", 1),))]
    assert direct_requests(mps, model, Mode.MPS, 512) == {"m": {"nvidia.com/gpu-79gb": 1}}


def test_direct_requests_list_every_pod_the_cluster_cannot_serve() -> None:
    a100, a100_40 = CATALOG.model(A100), CATALOG.model("A100-SXM4-40GB")
    wrong_model = Pod("nvl", 0, slices=(("nvidia.com/mig-3g.47gb", 1),))
    with pytest.raises(SliceRequestError) as e:
        direct_requests([wrong_model], a100, Mode.MIG, 512)
    assert (
        "'nvl' asks for nvidia.com/mig-3g.47gb, which is not a MIG profile of A100-SXM4-80GB"
        in str(e.value)
    )
    assert "1g.10gb, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb" in str(e.value)
    assert "--map-resource nvidia.com/mig-3g.47gb=" in str(e.value)
    # the exact catalog name decides: 1g.5gb is an A100-40GB profile, not an A100-80GB one
    small = [Pod("x", 0, slices=(("nvidia.com/mig-1g.5gb", 1),))]
    assert direct_requests(small, a100_40, Mode.MIG, 512) == {"x": {"nvidia.com/mig-1g.5gb": 1}}
    with pytest.raises(SliceRequestError, match="not a MIG profile of A100-SXM4-80GB"):
        direct_requests(small, a100, Mode.MIG, 512)
    with pytest.raises(
        SliceRequestError, match="in mps mode: replay it on a cluster file whose pool has mode: mig"
    ):
        direct_requests([Pod("x", 0, slices=(("nvidia.com/mig-1g.10gb", 1),))], a100, Mode.MPS, 512)
    with pytest.raises(
        SliceRequestError, match="in mig mode: replay it on a cluster file whose pool has mode: mps"
    ):
        direct_requests([Pod("x", 0, slices=(("nvidia.com/gpu-10gb", 1),))], a100, Mode.MIG, 512)
    # (81920 - 512) MiB = 79.5 GiB offered to MPS slices: 80 GiB does not fit
    with pytest.raises(SliceRequestError, match="more than the 79 GiB one A100-SXM4-80GB offers"):
        direct_requests([Pod("x", 0, slices=(("nvidia.com/gpu-80gb", 1),))], a100, Mode.MPS, 512)
    many = [Pod(f"p{i}", 0, slices=(("nvidia.com/gpu-10gb", 1),)) for i in range(MAX_LISTED + 3)]
    with pytest.raises(SliceRequestError) as e:
        direct_requests(many, a100, Mode.MIG, 512)
    text = str(e.value)
    assert text.startswith(f"{MAX_LISTED + 3} slice request(s)") and text.endswith("and 3 more")
    assert text.count("asks for") == MAX_LISTED


def test_saturation_refuses_slice_pods() -> None:
    w = Workload("w", (Pod("a", 0, slices=(("nvidia.com/mig-1g.10gb", 1),)), Pod("b", 0, 0, 1, 10)))
    with pytest.raises(
        SliceRequestError, match=r"1 pod\(s\) ask for slices by name .*'a'.*--protocol time-replay"
    ):
        require_shares(w, "saturation")
    require_shares(Workload("w", (Pod("b", 0, 0, 1, 10),)), "saturation")  # shares are fine


# --------------------------------------------------------------------------- the replay


def test_replay_pods_keep_named_requests_and_map_the_rest() -> None:
    wl = Workload(
        "w",
        (
            Pod(
                "ns/a",
                500,
                slices=(("nvidia.com/mig-4g.40gb", 1),),
                creation_time=0,
                deletion_time=90,
                priority=7,
            ),
            Pod("ns/b", 500, 0, 1, 100, creation_time=10, deletion_time=20),
            Pod("ns/c", 500, 0, 2, 1000, creation_time=20, deletion_time=30),
        ),
    )
    got = replay_pods(wl, CATALOG.model(A100), Mode.MIG)
    assert [(p.name, dict(p.requests), p.priority, p.duration) for p in got] == [
        ("ns/a", {"nvidia.com/mig-4g.40gb": 1}, 7, 90.0),
        ("ns/b", {"nvidia.com/mig-1g.10gb": 1}, 0, 10.0),  # mig-compute: 100 milli -> 1g
        ("ns/c", {"nvidia.com/mig-7g.80gb": 2}, 0, 10.0),  # whole GPUs -> the largest profile
    ]
    # a mapping rule chooses for share pods only: named slices stay as named
    memory = replay_pods(wl, CATALOG.model(A100), Mode.MIG, ReplaySettings(mapping="mig-memory"))
    assert dict(memory[0].requests) == {"nvidia.com/mig-4g.40gb": 1}
    with pytest.raises(
        ReplayError, match=re.escape("'ns/a' asks for nvidia.com/mig-4g.40gb, a MIG instance")
    ):
        replay_pods(wl, CATALOG.model(A100), Mode.MPS)


def test_time_replay_binds_exactly_the_named_slices_by_priority() -> None:
    """One A100 in MIG mode; two whole-GPU (7g) pods arrive together.  The higher-priority one,
    whose name sorts last, must be bound first: priority reaches the scheduler and the planner."""
    cluster = Cluster("one", (Node("n0", 64000, 1 << 20, 1, A100, Mode.MIG, A100),))
    seven = (("nvidia.com/mig-7g.80gb", 1),)
    wl = Workload(
        "w",
        (
            Pod("ns/a-low", 1000, slices=seven, creation_time=0, deletion_time=300),
            Pod("ns/b-high", 1000, slices=seven, creation_time=0, deletion_time=300, priority=1000),
            Pod(
                "ns/c",
                1000,
                slices=(("nvidia.com/mig-1g.10gb", 1),),
                creation_time=900,
                deletion_time=960,
            ),
        ),
    )
    r = run_time_replay(wl, cluster, "cpsat")
    by_name = {p.name: p for p in r.pods}
    assert {n: dict(p.requests) for n, p in by_name.items()} == {
        "ns/a-low": {"nvidia.com/mig-7g.80gb": 1},
        "ns/b-high": {"nvidia.com/mig-7g.80gb": 1},
        "ns/c": {"nvidia.com/mig-1g.10gb": 1},
    }
    high, low = by_name["ns/b-high"].first_bound, by_name["ns/a-low"].first_bound
    assert high is not None and low is not None
    assert high < low and low >= high + 300  # the low one waits for the high one to leave
    assert r.disruptions == 0 and all(p.first_bound is not None for p in r.pods)


# --------------------------------------------------------------------------- simulate


def _files(tmp_path: Path) -> tuple[Path, Path]:
    wl = tmp_path / "w.yaml"
    wl.write_text(
        "pods:\n"
        "  - {name: ns/a, cpu_milli: 1000, requests: {nvidia.com/mig-3g.40gb: 1}, creation_time: 0, deletion_time: 120}\n"
        "  - {name: ns/b, cpu_milli: 1000, requests: {nvidia.com/mig-1g.10gb: 2}, creation_time: 30, deletion_time: 200}\n"
    )
    cl = tmp_path / "c.yaml"
    cl.write_text(
        "pools:\n  - {name: g, count: 1, gpu_model: A100-SXM4-80GB, gpus_per_node: 2, cpu_milli: 32000, memory_mib: 262144, mode: mig}\n"
    )
    return wl, cl


def test_simulate_time_replays_a_slice_workload_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl, cl = _files(tmp_path)
    rc = main(
        ["simulate", "--trace", str(wl), "--cluster", str(cl), "--policy", "cpsat", "--quiet"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.startswith("time replay: w (2 pods) on c")
    row = next(line.split() for line in out.splitlines() if line.startswith("cpsat"))
    assert row[1] == "2"  # both pods replayed


@pytest.mark.parametrize("protocol", ["saturation", "both"])
def test_simulate_refuses_slices_in_the_share_protocols(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], protocol: str
) -> None:
    wl, cl = _files(tmp_path)
    rc = main(
        ["simulate", "--trace", str(wl), "--cluster", str(cl), "--protocol", protocol, "--quiet"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "2 pod(s) ask for slices by name" in err and "use --protocol time-replay" in err


def test_simulate_names_the_pod_a_cluster_cannot_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl, _ = _files(tmp_path)
    cl = tmp_path / "mps.yaml"
    cl.write_text(
        "pools:\n  - {name: g, count: 1, gpu_model: A100-SXM4-80GB, gpus_per_node: 2, cpu_milli: 32000, memory_mib: 262144, mode: mps}\n"
    )
    rc = main(
        ["simulate", "--trace", str(wl), "--cluster", str(cl), "--policy", "cpsat", "--quiet"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert "2 slice request(s) the cluster cannot serve" in err
    assert "pod 'ns/a' asks for nvidia.com/mig-3g.40gb, a MIG instance" in err
