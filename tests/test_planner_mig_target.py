"""Free MIG instances are valued by the requests that wait for them (planner/mig_target.py).

Model (planner/mig_cpsat.py, "Usefulness"): a layout's usefulness adds ``round(8 w_free_block
sum slots_i t_r(i))`` over its instances not in use, ``t`` the target workload's share of each
MIG request.  The oracle for the random cases scores every layout a one-pod plan can give the
GPU that hosts the pod, from that definition alone (slot arithmetic written here, validity from
``layout_errors``), and the planner's choice must score the best (least churn, then most
usefulness).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_states import gpu

from partitioner.settings import PartitionerSettings, parse_mig_profiles
from planner import (
    GpuState,
    MigInstance,
    Mode,
    NodeState,
    PendingPod,
    PlannerSettings,
    Snapshot,
    plan,
)
from planner.catalog import default_catalog
from planner.geometry import Placement, layout_errors
from planner.mig_target import mig_target
from planner.snapshot import MpsSlice

A100 = "A100-SXM4-80GB"
MODEL = default_catalog().model(A100)
SETTINGS = PlannerSettings(time_limit_s=10.0, free_capacity_cpu_milli=0, free_capacity_memory_mib=0)
"""Deterministic and optimal on these small models; CPU- and memory-blind usefulness."""
R = "nvidia.com/mig-"


def four_g_pod() -> PendingPod:
    return PendingPod("p", {R + "4g.40gb": 1})


def idle_choice_snapshot() -> Snapshot:
    """GPU 0: a free 7g; GPU 1: two free 3g; GPUs 2-3: a 7g in use each; one 4g pod."""
    n = NodeState(
        "n",
        Mode.MIG,
        A100,
        (
            gpu(0, ("7g.80gb", 0, False)),
            gpu(1, ("3g.40gb", 0, False), ("3g.40gb", 4, False)),
            gpu(2, ("7g.80gb", 0, True)),
            gpu(3, ("7g.80gb", 0, True)),
        ),
    )
    return Snapshot((n,), (four_g_pod(),))


def test_a_4g_pod_is_carved_from_the_gpu_whose_free_instances_nobody_asks_for() -> None:
    """Both choices cost the same churn (destroy one free instance, create the 4g, touch one
    GPU).  Learned from the snapshot, 7g is two thirds of the target (two in use, one 4g
    waiting) and 3g none of it: the free 7g stays, the 4g replaces the 3g at slot 0.  With free
    instances counting nothing (``()``, the rule before), the 7g was cut: its slots 4-7 left
    unallocated scored higher than a free 3g there."""
    snap = idle_choice_snapshot()
    learned = plan(snap, SETTINGS)
    blind = plan(snap, replace(SETTINGS, free_capacity_mig_profiles=()))
    assert learned.status == blind.status == "OPTIMAL"
    assert learned.layouts["n", 1].mig == (("4g.40gb", 0), ("3g.40gb", 4))
    assert ("n", 0) not in learned.layouts or learned.layouts["n", 0].mig == (("7g.80gb", 0),)
    assert learned.assignments["p"].gpus == {R + "4g.40gb": (1,)}
    assert blind.layouts["n", 0].mig == (("4g.40gb", 0),)
    assert learned.stats["churn"] == blind.stats["churn"]


def test_a_given_target_overrides_what_the_snapshot_shows() -> None:
    """Told that 3g pods are what comes next, the planner keeps the two free 3g and cuts the
    7g, although two 7g are in use."""
    snap = idle_choice_snapshot()
    given_target = replace(SETTINGS, free_capacity_mig_profiles=((R + "3g.40gb", 1.0),))
    result = plan(snap, given_target)
    assert result.layouts["n", 0].mig == (("4g.40gb", 0),)
    assert ("n", 1) not in result.layouts or result.layouts["n", 1].mig == (
        ("3g.40gb", 0),
        ("3g.40gb", 4),
    )


def test_the_target_is_learned_from_instances_in_use_and_waiting_requests() -> None:
    mig = NodeState(
        "mig",
        Mode.MIG,
        A100,
        (gpu(0, ("3g.40gb", 0, True), ("3g.40gb", 4, False)), gpu(1, ("7g.80gb", 0, True))),
    )
    hybrid = NodeState(
        "hyb",
        Mode.HYBRID,
        A100,
        (
            GpuState(
                0,
                (
                    MigInstance("4g.40gb", 0, used=True, mps=(MpsSlice(10_240, used=True),)),
                    MigInstance("3g.40gb", 4, used=True),
                ),
            ),
        ),
    )
    mps = NodeState("mps", Mode.MPS, A100, (GpuState(0, mps=(MpsSlice(20_480, used=True),)),))
    pods = (
        PendingPod("a", {R + "1g.10gb": 2, "cpu": 1}),
        PendingPod("b", {"nvidia.com/gpu-10gb": 1}),
    )
    target = mig_target(Snapshot((mig, hybrid, mps), pods), PlannerSettings())
    # in use: 3g (mig), 7g (mig), 3g (hybrid, no slices); the 4g host with a slice is no
    # request; waiting: two 1g units; MPS slices and requests are not MIG requests
    assert target == pytest.approx(
        {R + "1g.10gb": 2 / 5, R + "3g.40gb": 2 / 5, R + "7g.80gb": 1 / 5}
    )
    given_target = PlannerSettings(
        free_capacity_mig_profiles=((R + "7g.80gb", 3.0), (R + "7g.80gb", 1.0), ("cpu", 5.0))
    )
    assert mig_target(Snapshot((mig,), pods), given_target) == {R + "7g.80gb": 1.0}
    assert mig_target(Snapshot((mig,), pods), PlannerSettings(free_capacity_mig_profiles=())) == {}
    assert mig_target(Snapshot((), ()), PlannerSettings()) == {}


def test_the_partitioner_setting_parses_profiles_and_names_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse_mig_profiles("7g.80gb:3, 4g.40gb") == ((R + "7g.80gb", 3.0), (R + "4g.40gb", 1.0))
    assert parse_mig_profiles(R + "1g.10gb+me:2") == ((R + "1g.10gb.me", 2.0),)
    assert parse_mig_profiles("") == () and parse_mig_profiles(None) is None
    monkeypatch.setenv("GPUSLICE_FREE_CAPACITY_MIG_PROFILES", "7g.80gb:3,4g.40gb:1")
    assert PartitionerSettings().planner_settings().free_capacity_mig_profiles == (
        (R + "7g.80gb", 3.0),
        (R + "4g.40gb", 1.0),
    )
    for bad in ("7g:3", "7g.80gb:0", "7g.80gb:x", "3g.40gb:inf", "gpu-10gb"):
        monkeypatch.setenv("GPUSLICE_FREE_CAPACITY_MIG_PROFILES", bad)
        with pytest.raises(ValueError, match=r"GPUSLICE_FREE_CAPACITY_MIG_PROFILES.*e\.g\. '7g"):
            PartitionerSettings()


# --------------------------------------------------------------------------- oracle

PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
CELLS = [(name, start) for name in PROFILES for start in MODEL.profile(name).starts]


def _valid(layout: list[tuple[str, int]]) -> bool:
    return not layout_errors(MODEL, [Placement(s, MODEL.profile(n)) for n, s in layout])


def _layouts() -> list[frozenset[tuple[str, int]]]:
    """Every valid layout of the test profiles (subsets of at most 7 placements)."""
    out = []
    for k in range(0, 8):
        for combo in itertools.combinations(CELLS, k):
            if _valid(list(combo)):
                out.append(frozenset(combo))
    return out


ALL_LAYOUTS = _layouts()


def _slots(layout: frozenset[tuple[str, int]]) -> set[int]:
    taken: set[int] = set()
    for name, start in layout:
        taken |= set(range(start, start + MODEL.profile(name).memory_slices))
    return taken


def _span(layout: frozenset[tuple[str, int]]) -> int:
    """Memory slots of the largest profile of the model (``1g.20gb`` too, not only the test
    profiles) placeable on the unallocated slots."""
    taken = _slots(layout)
    best = 0
    for prof in MODEL.profiles:
        for start in prof.starts:
            if not taken & set(range(start, start + prof.memory_slices)):
                best = max(best, prof.memory_slices)
    return best


def _useful(layout: frozenset[tuple[str, int]], target: dict[str, float]) -> int:
    s = SETTINGS
    base = 8 * (s.weight_free_gpu * (not layout) + s.weight_free_block * _span(layout))
    value = sum(MODEL.profile(n).memory_slices * target.get(R + n, 0.0) for n, _ in layout)
    return base + round(8 * s.weight_free_block * value)


def _churn(before: frozenset[tuple[str, int]], after: frozenset[tuple[str, int]]) -> int:
    s = SETTINGS
    d, c = len(before - after), len(after - before)
    return s.weight_destroy * d + s.weight_create * c + s.weight_gpu_touched * (d + c > 0)


def _greedy_valid(cells: list[tuple[str, int]]) -> frozenset[tuple[str, int]]:
    """The cells in order, each kept if the layout stays valid with it."""
    kept: list[tuple[str, int]] = []
    for c in cells:
        if c not in kept and _valid([*kept, c]):
            kept.append(c)
    return frozenset(kept)


TYPICAL = [
    frozenset(lay)
    for lay in (
        [("7g.80gb", 0)],
        [("4g.40gb", 0)],
        [("3g.40gb", 0), ("3g.40gb", 4)],
        [("4g.40gb", 0), ("3g.40gb", 4)],
        [("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4)],
        [("4g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)],
    )
]
"""Idle layouts a cluster that cycles between shapes holds; two GPUs often tie on churn."""
random_layout = st.one_of(
    st.sampled_from(TYPICAL), st.lists(st.sampled_from(CELLS), max_size=4).map(_greedy_valid)
)


TARGETS = (
    {"7g.80gb": 4, "4g.40gb": 2, "3g.40gb": 1},
    {"3g.40gb": 3, "2g.20gb": 2, "1g.10gb": 1},
    {"4g.40gb": 1, "2g.20gb": 1, "1g.10gb": 1},
)


def test_every_pair_of_typical_idle_gpus_scores_best_by_the_definition() -> None:
    """Exhaustive over two idle GPUs with typical layouts, each pod size and three targets:
    ties on churn are common here, so this is where the value of free instances decides."""
    for (a, b), profile, weights in itertools.product(
        itertools.combinations_with_replacement(TYPICAL, 2), PROFILES[:4], TARGETS
    ):
        check_one_pod_plan([a, b], profile, weights)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(random_layout, min_size=2, max_size=3),
    st.sampled_from(PROFILES[:4]),
    st.dictionaries(st.sampled_from(PROFILES), st.integers(1, 5), min_size=1),
)
def test_the_planner_s_layout_scores_best_by_the_definition(
    idle: list[frozenset[tuple[str, int]]], profile: str, weights: dict[str, int]
) -> None:
    """The same check on random idle layouts and random targets."""
    check_one_pod_plan(idle, profile, weights)


def check_one_pod_plan(
    idle: list[frozenset[tuple[str, int]]], profile: str, weights: dict[str, int]
) -> None:
    """One node of idle GPUs with free layouts ``idle``, one ``profile`` pod, the target given
    by ``weights``: the plan places the pod (some GPU can always be re-laid out for it) and the
    (churn, usefulness) of the hosting GPU's new layout, the others unchanged, is the best any
    valid layout holding the pod's instance reaches."""
    target = {R + n: w / sum(weights.values()) for n, w in weights.items()}
    s = replace(SETTINGS, free_capacity_mig_profiles=tuple((r, t) for r, t in target.items()))
    node = NodeState(
        "n",
        Mode.MIG,
        A100,
        tuple(gpu(i, *((n, st_, False) for n, st_ in sorted(lay))) for i, lay in enumerate(idle)),
    )
    result = plan(Snapshot((node,), (PendingPod("p", {R + profile: 1}),)), s)
    assert result.status == "OPTIMAL"
    base = [_useful(lay, target) for lay in idle]
    best = max(
        (-_churn(before, after), sum(base) - base[i] + _useful(after, target))
        for i, before in enumerate(idle)
        for after in ALL_LAYOUTS
        if any(n == profile for n, _ in after)
    )
    a = result.assignments["p"]
    ((g,),) = a.gpus.values()
    after = frozenset(result.layouts["n", g].mig) if ("n", g) in result.layouts else idle[g]
    others = [k for k in range(len(idle)) if k != g]
    assert all(
        ("n", k) not in result.layouts or frozenset(result.layouts["n", k].mig) == idle[k]
        for k in others
    )
    chosen = (-_churn(idle[g], after), sum(base) - base[g] + _useful(after, target))
    assert chosen == best
