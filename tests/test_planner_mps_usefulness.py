"""The MPS free-capacity level: FGD's fragmentation measure on slice memory (planner/mps.py).

These check the solve's own level, so the packing polish that may move its placements
afterwards (planner/mps_polish.py, tests/test_planner_mps_polish.py) is off here.

A fixed case where best fit strands memory and the measure does not, the learned target, and
a hypothesis property: on random MPS GPUs the GPU the planner gives a pending pod scores best
by the definition, computed here by brute force over every GPU the pod fits on (a planner
that only valued empty GPUs, the previous level, fails it).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from partitioner.settings import PartitionerSettings, parse_mps_sizes
from planner import GpuState, Mode, MpsSlice, NodeState, PendingPod, PlannerSettings, Snapshot, plan
from planner.mps import USEFUL_RESOLUTION, _allocation_levels, mps_target, usefulness_table

A100 = "A100-SXM4-80GB"
GIB = 1024
USABLE = 80 * GIB - 512


def gpu(index: int, *used_gib: int) -> GpuState:
    return GpuState(index, mps=tuple(MpsSlice(g * GIB, used=True) for g in used_gib))


def pod(gb: int) -> PendingPod:
    return PendingPod("p", {f"nvidia.com/gpu-{gb}gb": 1})


def where(gpus: tuple[GpuState, ...], gb: int, s: PlannerSettings) -> int:
    result = plan(Snapshot((NodeState("n", Mode.MPS, A100, gpus),), (pod(gb),)), s)
    return result.assignments["p"].gpus[f"nvidia.com/gpu-{gb}gb"][0]


def test_a_pod_goes_where_it_leaves_memory_the_next_pods_can_use() -> None:
    # GPU 0 has 30.5 GiB left, GPU 1 11.5 GiB.  Best fit puts a 10 GiB pod on GPU 1 and
    # strands 1.5 GiB; on GPU 0 it leaves 20.5 + 11.5 GiB, room for three more 10 GiB pods.
    gpus = (gpu(0, 49), gpu(1, 68))
    s = PlannerSettings(
        free_capacity_mps_sizes=((10 * GIB, 1.0),), free_capacity_cpu_milli=0, mps_polish=False
    )
    assert where(gpus, 10, s) == 0
    # a target of 21 GiB pods: only GPU 0's 30.5 GiB can hold one, so it is kept whole
    s = PlannerSettings(
        free_capacity_mps_sizes=((21 * GIB, 1.0),), free_capacity_cpu_milli=0, mps_polish=False
    )
    assert where(gpus, 10, s) == 1


def test_the_target_is_learned_from_slices_in_use_and_pending_requests() -> None:
    snap = Snapshot(
        (NodeState("n", Mode.MPS, A100, (gpu(0, 10, 10, 20), gpu(1))),),
        (pod(40),),
    )
    assert mps_target(snap, PlannerSettings()) == {10 * GIB: 0.5, 20 * GIB: 0.25, 40 * GIB: 0.25}
    given_sizes = PlannerSettings(free_capacity_mps_sizes=((5 * GIB, 3.0), (10 * GIB, 1.0)))
    assert mps_target(snap, given_sizes) == {5 * GIB: 0.75, 10 * GIB: 0.25}
    assert mps_target(snap, PlannerSettings(free_capacity_mps_sizes=())) == {}


def test_the_table_never_grows_with_the_memory_allocated() -> None:
    s = PlannerSettings()
    target = {1 * GIB: 0.2, 7 * GIB: 0.3, 40 * GIB: 0.4, 79 * GIB: 0.1}
    for room in (USABLE, 50 * GIB + 512, 3 * GIB, 700):
        table = usefulness_table(room, USABLE, target, s)
        assert all(a >= b for a, b in itertools.pairwise(table))
    full = usefulness_table(USABLE, USABLE, target, s)
    assert full[0] == USEFUL_RESOLUTION * 8 * s.weight_free_block  # every size fits: the whole GPU


def _value(room: int, alloc_gib: int, empty: bool, target: dict[int, float]) -> int:
    """One GPU's usefulness by the definition (module docstring of planner/mps.py)."""
    s = PlannerSettings()
    free = max(0, room - GIB * alloc_gib)
    share = sum(p for mib, p in target.items() if mib <= free)
    v = round(USEFUL_RESOLUTION * 8 * s.weight_free_block * free * share / USABLE)
    return v + USEFUL_RESOLUTION * s.weight_free_gpu * empty


gib_slices = st.lists(st.sampled_from([1, 2, 3, 5, 7, 10, 13, 20, 24, 39]), max_size=6)


@given(
    used=st.lists(gib_slices, min_size=2, max_size=5),
    size=st.sampled_from([1, 2, 3, 5, 10, 13, 20]),
    sizes=st.lists(st.sampled_from([1, 2, 4, 5, 8, 10, 16, 20, 40, 79]), min_size=1, max_size=4),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_the_chosen_gpu_scores_best_by_the_definition(
    used: list[list[int]], size: int, sizes: list[int]
) -> None:
    used = [u for u in used if sum(u) * GIB <= USABLE]
    gpus = tuple(gpu(i, *u) for i, u in enumerate(used))
    rooms = [USABLE - sum(u) * GIB for u in used]
    fits = [i for i, r in enumerate(rooms) if r >= size * GIB]
    if len(used) < 2 or not fits:
        return
    target = {g * GIB: 1.0 / len(set(sizes)) for g in set(sizes)}
    s = PlannerSettings(
        free_capacity_mps_sizes=tuple((g * GIB, 1.0) for g in set(sizes)),
        free_capacity_cpu_milli=0,
        free_capacity_memory_mib=0,
        mps_polish=False,
    )

    def total(on: int) -> int:
        return sum(
            _value(r, size if i == on else 0, not used[i] and i != on, target)
            for i, r in enumerate(rooms)
        )

    best = max(total(i) for i in fits)
    chosen = where(gpus, size, s)
    assert chosen in fits
    assert total(chosen) == best, (chosen, {i: total(i) for i in fits})


def test_the_partitioner_setting_gives_the_sizes_and_rejects_malformed_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse_mps_sizes("10:3, 20:1") == ((10 * GIB, 3.0), (20 * GIB, 1.0))
    assert parse_mps_sizes("5") == ((5 * GIB, 1.0),)
    assert parse_mps_sizes("") == () and parse_mps_sizes(None) is None
    monkeypatch.setenv("GPUSLICE_FREE_CAPACITY_MPS_SIZES", "10:3,20:1")
    assert PartitionerSettings().planner_settings().free_capacity_mps_sizes == (
        (10 * GIB, 3.0),
        (20 * GIB, 1.0),
    )
    for bad in ("10gb:3", "0:1", "10:-1", "10:nan", "x"):
        monkeypatch.setenv("GPUSLICE_FREE_CAPACITY_MPS_SIZES", bad)
        with pytest.raises(
            ValueError, match=r"GPUSLICE_FREE_CAPACITY_MPS_SIZES.*e\.g\. '10:3,20:1'"
        ):
            PartitionerSettings()


@given(
    free=st.lists(st.sampled_from([1024, 2048, 5120, 10240, 10340, 20480]), max_size=3),
    new=st.dictionaries(st.sampled_from([1, 2, 4, 7, 10, 13]), st.integers(0, 4), max_size=3),
    room_gib=st.integers(0, 80),
)
@settings(max_examples=200, deadline=None)
def test_the_allocation_levels_are_every_sum_the_slices_can_reach(
    free: list[int], new: dict[int, int], room_gib: int
) -> None:
    """The one-hot levels of a GPU: exactly the rounded-up sums of its free slices kept and new
    slices created that fit its room (brute force over every subset)."""
    m = cp_model.CpModel()
    g = GpuState(0, mps=tuple(MpsSlice(x) for x in free))
    keep = [(j, m.new_bool_var(f"k{j}")) for j in range(len(free))]
    new_vars = {gb * GIB: m.new_int_var(0, n, f"n{gb}") for gb, n in new.items()}
    room = room_gib * GIB + 512
    items = free + [gb * GIB for gb, n in new.items() for _ in range(n)]
    sums = {
        sum(c)
        for r in range(len(items) + 1)
        for c in itertools.combinations(items, r)
        if sum(c) <= room
    }
    assert _allocation_levels(g, keep, new_vars, room) == sorted({-(-x // GIB) for x in sums})
