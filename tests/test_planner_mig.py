"""Fixed cases for the CP-SAT MIG planner: placement, churn preference, reasons, determinism."""

from __future__ import annotations

import random

import pytest
from objective_weights import placement_weights
from planner_states import gpu

from planner import (
    GpuState,
    Mode,
    NodeState,
    PendingPod,
    PlacementWeight,
    Plan,
    PlannerSettings,
    Policy,
    Snapshot,
    SnapshotError,
    plan,
)
from planner.greedy import plan_greedy

A100 = "A100-SXM4-80GB"


def node(name: str, *gpus: GpuState, model: str = A100, **kw: int) -> NodeState:
    return NodeState(name, Mode.MIG, model, gpus, **kw)


def pod(name: str, profile: str, count: int = 1, **kw: object) -> PendingPod:
    return PendingPod(name, {f"nvidia.com/mig-{profile}": count}, **kw)  # type: ignore[arg-type]


def layout_of(result: Plan, snap: Snapshot, name: str, index: int) -> set[tuple[str, int]]:
    planned = result.layouts.get((name, index))
    if planned is not None:
        return set(planned.mig)
    current = next(g for n in snap.nodes if n.name == name for g in n.gpus if g.index == index)
    return {(i.profile, i.start) for i in current.mig}


def test_3g_beside_used_1g_at_slot_0_goes_to_slot_4() -> None:
    snap = Snapshot((node("n", gpu(0, ("1g.10gb", 0, True))),), (pod("p", "3g.40gb"),))
    result = plan(snap)
    assert result.status == "OPTIMAL"
    assert result.layouts["n", 0].mig == (("1g.10gb", 0), ("3g.40gb", 4))
    assert result.assignments["p"].gpus == {"nvidia.com/mig-3g.40gb": (0,)}


def test_3g_beside_used_1g_prefers_no_extra_gpu_but_never_moves_the_used_one() -> None:
    snap = Snapshot(
        (node("n", gpu(0, ("1g.10gb", 0, True)), gpu(1)),),
        (pod("p", "3g.40gb"),),
    )
    result = plan(snap)
    assert ("1g.10gb", 0) in layout_of(result, snap, "n", 0)
    # keeping GPU 1 whole (usefulness) puts the 3g on GPU 0 at slot 4
    assert result.layouts["n", 0].mig == (("1g.10gb", 0), ("3g.40gb", 4))
    assert ("n", 1) not in result.layouts


def test_used_instances_never_move_even_when_that_leaves_a_pod_unplaced() -> None:
    snap = Snapshot(
        (node("n", gpu(0, ("3g.40gb", 0, True), ("1g.10gb", 4, False))),),
        (pod("p", "4g.40gb"),),
    )
    result = plan(snap)
    assert result.unplaced["p"].startswith("capacity:")
    assert result.layouts == {}


def test_a_free_existing_instance_is_used_before_creating_one() -> None:
    snap = Snapshot(
        (node("n", gpu(0), gpu(1, ("2g.20gb", 2, False))),),
        (pod("p", "2g.20gb"),),
    )
    result = plan(snap)
    assert result.layouts == {}
    assert result.assignments["p"].gpus == {"nvidia.com/mig-2g.20gb": (1,)}
    assert result.stats["churn"] == 0


def test_only_the_gpu_that_must_change_is_touched() -> None:
    snap = Snapshot(
        (node("n", gpu(0, ("1g.10gb", 0, False)), gpu(1), gpu(2, ("7g.80gb", 0, True))),),
        (pod("p", "1g.10gb"), pod("q", "2g.20gb")),
    )
    result = plan(snap)
    assert set(result.assignments) == {"p", "q"}
    # 1g: the free one on GPU 0; 2g: created beside it on GPU 0 (GPU 1 stays whole)
    assert set(result.layouts) == {("n", 0)}
    assert ("1g.10gb", 0) in result.layouts["n", 0].mig


def test_free_instances_in_the_way_are_destroyed_and_counted() -> None:
    snap = Snapshot(
        (node("n", gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False))),),
        (pod("p", "7g.80gb"),),
    )
    result = plan(snap)
    assert result.layouts["n", 0].mig == (("7g.80gb", 0),)
    s = PlannerSettings()
    assert result.stats["churn"] == 2 * s.weight_destroy + s.weight_create + s.weight_gpu_touched


def test_higher_priority_wins_the_last_gpu() -> None:
    snap = Snapshot(
        (node("n", gpu(0)),),
        (pod("low1", "3g.40gb"), pod("low2", "4g.40gb"), pod("high", "7g.80gb", priority=10)),
    )
    result = plan(snap)
    assert set(result.assignments) == {"high"}
    assert set(result.unplaced) == {"low1", "low2"}


def test_multi_unit_pod_takes_units_on_one_node() -> None:
    snap = Snapshot(
        (
            node("a", gpu(0, ("1g.10gb", 0, True))),
            node("b", gpu(0, ("1g.10gb", 0, True)), gpu(1, ("1g.10gb", 0, True))),
        ),
        (pod("p", "3g.40gb", 2),),
    )
    result = plan(snap)
    a = result.assignments["p"]
    assert a.node == "b"
    assert sorted(a.gpus["nvidia.com/mig-3g.40gb"]) == [0, 1]


def test_node_cpu_limits_the_pods_on_it() -> None:
    snap = Snapshot(
        (node("a", gpu(0), cpu_milli_free=3000), node("b", gpu(0), cpu_milli_free=3000)),
        (pod("p", "1g.10gb", cpu_milli=2000), pod("q", "1g.10gb", cpu_milli=2000)),
    )
    result = plan(snap)
    assert {result.assignments["p"].node, result.assignments["q"].node} == {"a", "b"}


def test_a_name_the_node_does_not_advertise_is_never_planned() -> None:
    # 3g.39gb is a 535.x driver's spelling of A100-80GB's 3g.40gb: the agent advertises the
    # catalog's name, so a plan giving this pod a 3g.40gb instance would leave it pending.
    snap = Snapshot((node("n", gpu(0)),), (pod("p", "3g.39gb"),))
    result = plan(snap)
    assert not result.assignments and not result.layouts
    assert "3g.39gb" in result.unplaced["p"] and "does not exist" in result.unplaced["p"]


def test_hybrid_nodes_are_planned_as_mig() -> None:
    hybrid = NodeState("h", Mode.HYBRID, A100, (gpu(0),))
    result = plan(Snapshot((hybrid,), (pod("p", "2g.20gb"),)))
    assert result.assignments["p"].node == "h"


@pytest.mark.parametrize(
    ("snap_pod", "nodes", "reason"),
    [
        (PendingPod("p", {"example.com/fpga": 1}), None, "unknown resource: example.com/fpga"),
        (
            PendingPod("p", {"nvidia.com/mig-1g.10gb": 1, "nvidia.com/gpu-10gb": 1}),
            None,
            "unknown resource: the pod requests both MIG and MPS",
        ),
        (pod("p", "7g.80gb"), ["A30"], "exceeds any GPU of model A30"),
        (pod("p", "1g.10gb", eligible_nodes=frozenset({"elsewhere"})), None, "no eligible node"),
        (pod("p", "1g.5gb"), None, "no eligible node: node n0: MIG profile '1g.5gb'"),
        (pod("p", "1g.10gb", cpu_milli=10_000), None, "node cpu/memory"),
        (pod("p", "7g.80gb", 2), None, "no eligible node: node n0: 2 x 7g.80gb exceed"),
    ],
)
def test_unplaced_reasons(snap_pod: PendingPod, nodes: list[str] | None, reason: str) -> None:
    models = nodes or [A100]
    snap = Snapshot(
        tuple(node(f"n{i}", gpu(0), model=m, cpu_milli_free=4000) for i, m in enumerate(models)),
        (snap_pod,),
    )
    result = plan(snap)
    assert result.unplaced["p"].startswith(reason), result.unplaced["p"]


def test_capacity_reason_when_eligible_but_full() -> None:
    snap = Snapshot((node("n", gpu(0, ("7g.80gb", 0, True))),), (pod("p", "1g.10gb"),))
    assert plan(snap).unplaced["p"].startswith("capacity: no room for 1 x nvidia.com/mig-1g.10gb")


def test_bad_snapshots_raise_errors_naming_the_object() -> None:
    with pytest.raises(SnapshotError, match="node n: unknown GPU model 'Z9000'"):
        plan(Snapshot((node("n", gpu(0), model="Z9000"),), ()))
    with pytest.raises(SnapshotError, match=r"node\(s\) \['n'\] more than once"):
        plan(Snapshot((node("n", gpu(0)), node("n", gpu(0))), ()))
    with pytest.raises(SnapshotError, match="node n GPU 0: current MIG layout is impossible"):
        plan(Snapshot((node("n", gpu(0, ("3g.40gb", 0, True), ("4g.40gb", 0, False))),), ()))
    with pytest.raises(SnapshotError, match="does not support MIG"):
        plan(Snapshot((node("n", gpu(0), model="V100-16GB"),), ()))


def random_cluster(seed: int, n_nodes: int, n_pods: int) -> Snapshot:
    """A busy cluster: each A100 holds a few used/free instances; a mixed pending batch."""
    rng = random.Random(seed)
    menus = [
        [("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)],
        [("4g.40gb", 0), ("3g.40gb", 4)],
        [("1g.10gb", 0), ("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 4)],
        [("7g.80gb", 0)],
        [],
    ]
    nodes = []
    for k in range(n_nodes):
        gpus = []
        for i in range(8):
            menu = rng.choice(menus)
            gpus.append(gpu(i, *((p, s, rng.random() < 0.6) for p, s in menu)))
        nodes.append(node(f"node-{k:03d}", *gpus, cpu_milli_free=64_000))
    profiles = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    pods = tuple(
        pod(
            f"pod-{j:03d}", rng.choice(profiles), rng.choice([1, 1, 2]), priority=rng.choice([0, 1])
        )
        for j in range(n_pods)
    )
    return Snapshot(tuple(nodes), pods)


def _weight(result: Plan, snap: Snapshot) -> int:
    w = placement_weights(snap.pods)
    return sum(w[n] for n in result.assignments)


def test_same_input_and_seed_give_the_same_plan() -> None:
    snap = random_cluster(7, 6, 25)
    s = PlannerSettings(time_limit_s=5.0)
    first, second = plan(snap, s), plan(snap, s)
    assert first.status == "OPTIMAL"
    assert first.layouts == second.layouts
    assert first.assignments == second.assignments
    assert first.unplaced == second.unplaced


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cpsat_places_at_least_as_much_as_greedy(seed: int) -> None:
    snap = random_cluster(seed, 8, 40)
    s = PlannerSettings(time_limit_s=2.0)
    cpsat, greedy = plan(snap, s), plan_greedy(snap, s)
    assert _weight(cpsat, snap) >= _weight(greedy, snap)
    assert plan(snap, PlannerSettings(policy=Policy.GREEDY)).status == "GREEDY"


def test_candidate_node_pruning_keeps_the_greedy_nodes() -> None:
    snap = random_cluster(4, 12, 40)
    pruned = plan(snap, PlannerSettings(time_limit_s=5.0, max_candidate_nodes=1))
    greedy = plan_greedy(snap)
    assert pruned.policy == "cpsat"
    assert _weight(pruned, snap) >= _weight(greedy, snap)


@pytest.mark.parametrize("weight", list(PlacementWeight))
def test_a_long_waiting_whole_gpu_pod_and_seven_fresh_1g_pods_contest_one_free_gpu(
    weight: PlacementWeight,
) -> None:
    """One free 7g.80gb; a 7g pod that has waited two hours and seven 1g pods that just came.
    Counting pods, the seven always win (7 > 1) whatever the 7g pod waited; counting compute,
    both choices place 7 slices and the waiting level gives the GPU to the older pod, whose
    instance is already there (no churn either)."""
    snap = Snapshot(
        (node("n", gpu(0, ("7g.80gb", 0, False))),),
        (pod("old", "7g.80gb", waited_s=7200.0), *(pod(f"new{i}", "1g.10gb") for i in range(7))),
    )
    result = plan(snap, PlannerSettings(placement_weight=weight))
    assert result.status == "OPTIMAL"
    if weight is PlacementWeight.COMPUTE:
        assert set(result.assignments) == {"old"}
        assert ("n", 0) not in result.layouts  # the 7g stays as it is
    else:
        assert set(result.assignments) == {f"new{i}" for i in range(7)}
        assert result.layouts["n", 0].mig == tuple(("1g.10gb", s) for s in range(7))


def test_a_group_of_identical_pods_gives_its_places_to_the_longest_waiting() -> None:
    """Three identical 3g pods, one free 3g: the one that waited longest gets it, whatever the
    names (the tiers are equal: all waited under the first threshold)."""
    snap = Snapshot(
        (node("n", gpu(0, ("3g.40gb", 4, False), ("4g.40gb", 0, True))),),
        (
            pod("a", "3g.40gb", waited_s=10.0),
            pod("b", "3g.40gb", waited_s=250.0),
            pod("c", "3g.40gb", waited_s=100.0),
        ),
    )
    result = plan(snap)
    assert result.status == "OPTIMAL"
    assert set(result.assignments) == {"b"}


@pytest.mark.parametrize(
    ("tiers", "winner"),
    [
        (PlannerSettings().wait_tiers_s, "old4g"),
        ((300.0, 1800.0, 7200.0, 28800.0), "young7g"),  # the tiers before 2026-12-02
    ],
)
def test_past_eight_hours_the_older_pod_still_wins_a_freed_gpu(
    tiers: tuple[float, ...], winner: str
) -> None:
    """One free 7g.80gb; a 7g pod that has waited 9 h and a 4g pod that has waited 4 days (a
    queue that lasts). Either places one pod. With tiers past 8 h the 4-day pod is in a higher
    tier and gets the GPU (carved into a 4g); with 8 h as the last tier both sit in it, and
    churn gives the GPU to the 7g pod, whose instance is already there."""
    snap = Snapshot(
        (node("n", gpu(0, ("7g.80gb", 0, False))),),
        (
            pod("young7g", "7g.80gb", waited_s=9 * 3600.0),
            pod("old4g", "4g.40gb", waited_s=4 * 86400.0 + 60),
        ),
    )
    result = plan(snap, PlannerSettings(wait_tiers_s=tiers))
    assert result.status == "OPTIMAL"
    assert set(result.assignments) == {winner}
    if winner == "old4g":
        assert ("4g.40gb", 0) in layout_of(result, snap, "n", 0)
    else:
        assert ("n", 0) not in result.layouts
