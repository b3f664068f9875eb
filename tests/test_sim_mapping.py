"""Fractional request -> slice mapping rules (simulations.inputs.mapping), hand-computed cases."""

from __future__ import annotations

import pytest

from simulations.inputs.mapping import (
    Mapping,
    MappingError,
    MpsByMemory,
    SliceRequest,
    make_mapping,
)
from simulations.inputs.workload import Pod


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
        # A100-80GB: (81920 - 512 reserve) MiB = 79 GiB usable; shares round down
        ("mps-memory", 810, 63),  # floor(0.81 * 79) = floor(63.99)
        ("mps-memory", 143, 11),  # floor(11.30)
        ("mps-memory", 5, 1),  # at least one granule
        ("mps-memory:5", 143, 10),
        ("mps-memory:5", 810, 60),
        ("mps-memory:10", 810, 60),
        ("mps-memory:10", 1000, 70),  # the whole usable memory rounded down to 10
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
        "nvidia.com/gpu-76gb": 4
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
    with pytest.raises(MappingError, match="exceeds the 14 GiB T4 offers to MPS slices"):
        MpsByMemory("T4", 15)  # (15360 - 512) MiB = 14 GiB usable


@pytest.mark.parametrize("spec", ["mps-memory", "mps-memory:2", "mps-memory:5"])
@pytest.mark.parametrize("model", ["A100-SXM4-80GB", "V100-32GB", "T4", "A30"])
def test_mps_shares_that_fit_one_gpu_map_to_slices_that_fit_it(spec: str, model: str) -> None:
    """Shares summing to <= 1000 milli must map to slices within the GPU's usable memory.

    (Where a share is worth less than one granule it is rounded up to one: a coarse granularity
    cannot represent it, so such combinations are left out.)
    """
    m = make_mapping(spec, model)
    assert isinstance(m, MpsByMemory)
    combos = ([500, 500], [810, 190], [470, 470, 60], [333, 333, 334], [1000], [250] * 4)
    checked = 0
    for shares in combos:
        if any(gm * m.gpu_gb < m.granularity_gb * 1000 for gm in shares):
            continue
        checked += 1
        total = sum(req(m, share(gm)).memory_gb for gm in shares)
        assert total <= m.gpu_gb, (shares, total, m.gpu_gb)
    assert checked >= 2


def test_two_half_gpu_pods_are_planned_onto_one_gpu() -> None:
    """nos #47: 2 x half of a GPU left one pod pending; the mapping plus the planner do not."""
    from planner.api import plan
    from planner.snapshot import GpuState, Mode, NodeState, PendingPod, Snapshot

    m = make_mapping("mps-memory", "A100-SXM4-40GB")
    requests = [req(m, share(500)).as_requests() for _ in range(2)]
    node = NodeState("n", Mode.MPS, "A100-SXM4-40GB", (GpuState(0),))
    result = plan(Snapshot((node,), tuple(PendingPod(f"p{i}", r) for i, r in enumerate(requests))))
    assert not result.unplaced and len(result.assignments) == 2
