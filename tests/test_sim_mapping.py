"""Fractional request -> slice mapping rules (simulations.mapping), hand-computed cases."""

from __future__ import annotations

import pytest

from simulations.mapping import Mapping, MappingError, MpsByMemory, SliceRequest, make_mapping
from simulations.workload import Pod


def share(gm: int, qos: str = "BE", num_gpu: int = 1) -> Pod:
    return Pod(f"p{gm}", 1000, 0, num_gpu, gm, qos=qos)


def req(mapping: Mapping, pod: Pod) -> SliceRequest:
    r = mapping.map(pod)
    assert r is not None, pod
    return r


@pytest.mark.parametrize(
    ("gm", "profile"),
    [
        (50, "1g.10gb"),  # 50 * 7 / 1000 = 0.35 compute slices -> 1g (fewest memory slices)
        (142, "1g.10gb"),  # 0.994
        (143, "2g.20gb"),  # 1.001
        (285, "2g.20gb"),  # 1.995
        (300, "3g.40gb"),  # 2.1
        (429, "4g.40gb"),  # 3.003
        (500, "4g.40gb"),  # 3.5
        (572, "7g.80gb"),  # 4.004
        (810, "7g.80gb"),
        (1000, "7g.80gb"),
    ],
)
def test_mig_by_compute_a100_80gb(gm: int, profile: str) -> None:
    r = make_mapping("mig-compute", "A100-SXM4-80GB").map(share(gm))
    assert r is not None and r.kind == "mig" and r.profile == profile
    assert r.as_requests() == {f"nvidia.com/mig-{profile}": 1}


def test_mig_by_compute_on_a30_uses_its_four_slices() -> None:
    m = make_mapping("mig-compute", "A30")
    assert [req(m, share(g)).profile for g in (250, 251, 500, 501, 1000)] == [
        "1g.6gb",
        "2g.12gb",
        "2g.12gb",
        "4g.24gb",
        "4g.24gb",
    ]


@pytest.mark.parametrize(
    ("gm", "profile"),
    [
        (50, "1g.10gb"),
        (125, "1g.10gb"),
        (126, "1g.20gb"),
        (250, "1g.20gb"),
        (251, "3g.40gb"),
        (500, "3g.40gb"),
        (501, "7g.80gb"),
    ],
)
def test_mig_by_memory_a100_80gb(gm: int, profile: str) -> None:
    # memory slots of 8: 1g.10gb = 1/8, 1g.20gb = 2/8, 3g.40gb = 4/8, 7g.80gb = 8/8
    r = make_mapping("mig-memory", "A100-SXM4-80GB").map(share(gm))
    assert r is not None and r.profile == profile


@pytest.mark.parametrize(
    ("spec", "gm", "gb"),
    [
        ("mps-memory", 810, 65),  # ceil(0.81 * 80) = 65
        ("mps-memory", 143, 12),  # ceil(11.44)
        ("mps-memory:5", 143, 15),
        ("mps-memory:5", 810, 65),
        ("mps-memory:10", 810, 70),
        ("mps-memory:10", 1000, 80),
        ("mps-memory:30", 990, 60),  # capped at the GPU memory rounded down to the granularity
    ],
)
def test_mps_by_memory_granularity(spec: str, gm: int, gb: int) -> None:
    r = make_mapping(spec, "A100-SXM4-80GB").map(share(gm))
    assert r is not None and r.kind == "mps" and r.memory_gb == gb
    assert r.resource == f"nvidia.com/gpu-{gb}gb"


def test_whole_and_multi_gpu_pods_take_full_slices() -> None:
    pod = share(1000, num_gpu=4)
    assert req(make_mapping("mig-compute", "H100-80GB"), pod).as_requests() == {
        "nvidia.com/mig-7g.80gb": 4
    }
    assert req(make_mapping("mps-memory:4", "A100-SXM4-80GB"), pod).as_requests() == {
        "nvidia.com/gpu-80gb": 4
    }


def test_hybrid_routes_by_qos_and_cpu_only_maps_to_none() -> None:
    m = make_mapping("hybrid", "A100-SXM4-80GB")
    assert req(m, share(300, qos="LS")).kind == "mig"
    assert req(m, share(300, qos="Guaranteed")).kind == "mig"
    assert req(m, share(300, qos="BE")).kind == "mps"
    assert req(m, share(300, qos="Burstable")).kind == "mps"
    assert m.map(Pod("c", 1000)) is None


def test_mapping_errors_name_the_fix() -> None:
    with pytest.raises(MappingError, match="T4 is not MIG-capable; use the mps-memory mapping"):
        make_mapping("mig-compute", "T4")
    with pytest.raises(MappingError, match="unknown mapping 'mig'"):
        make_mapping("mig", "A100-SXM4-80GB")
    with pytest.raises(MappingError, match="granularity 'x' is not an integer"):
        make_mapping("mps-memory:x", "A100-SXM4-80GB")
    with pytest.raises(MappingError, match="exceeds T4's 15 GiB"):
        MpsByMemory("T4", 16)
