"""Benchmark code path (a tiny smoke run, not the benchmark) and the instance generators."""

from __future__ import annotations

from typing import Any

import pytest

from planner.catalog import default_catalog
from planner.geometry import parse_layout
from planner.settings import PlannerSettings
from planner.snapshot import Mode, Plan, PlannedGpu, Snapshot
from simulations.bench_planner import percentile, plan_churn, run_benchmark, unplaced_eligible
from simulations.inputs.instances import demo_snapshot, mig_benchmark_snapshot

CAT = default_catalog()


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [([3.0], 99, 3.0), ([1.0, 2.0, 3.0, 4.0], 50, 2.0), ([5.0, 1.0, 9.0], 99, 9.0)],
)
def test_percentile_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == expected


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_plan_churn_counts_created_destroyed_and_touched() -> None:
    snap = demo_snapshot()
    plan = Plan(
        layouts={
            # node-a GPU 0: 3g@0 used stays, free 3g@4 -> 2g@4 + 1g@6
            ("node-a", 0): PlannedGpu(
                "node-a", 0, mig=(("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6))
            ),
            # unchanged layout listed anyway: not touched
            ("node-b", 0): PlannedGpu("node-b", 0, mig=(("7g.80gb", 0),)),
        },
        assignments={},
        unplaced={},
    )
    settings = PlannerSettings(weight_destroy=4, weight_create=2, weight_gpu_touched=8)
    churn = plan_churn(snap, plan, settings, CAT)
    assert churn == {
        "instances_created": 2,
        "instances_destroyed": 1,
        "gpus_touched": 1,
        "weighted": 4 * 1 + 2 * 2 + 8 * 1,
    }


def test_unplaced_eligible_counts_only_room_reasons() -> None:
    plan = Plan(
        layouts={},
        assignments={},
        unplaced={
            "a": "capacity: no room for 1 x nvidia.com/mig-7g.80gb on its 3 eligible node(s)",
            "b": "node cpu/memory: GPU room for the pod exists, but ...",
            "c": "no eligible node: none of the nodes ...",
            "d": "exceeds any GPU of model A100-SXM4-80GB: ...",
        },
    )
    assert unplaced_eligible(plan) == 2


def test_benchmark_instance_matches_its_parameters() -> None:
    snap = mig_benchmark_snapshot(20, occupancy=0.85, pending_fraction=0.3, seed=7)
    model = CAT.model("A100-SXM4-80GB")
    gpus = [g for n in snap.nodes for g in n.gpus]
    assert len(snap.nodes) == 20 and len(gpus) == 160
    assert len(snap.pods) == round(0.3 * 160)
    assert all(n.mode is Mode.MIG and len(n.gpus) == 8 for n in snap.nodes)
    used = sum(model.profile(i.profile).compute for g in gpus for i in g.mig if i.used)
    target = 0.85 * 7 * 160
    assert target - 7 <= used <= target
    assert any(not i.used for g in gpus for i in g.mig), "some FREE instances too"
    for g in gpus:
        parse_layout(model, [(i.profile, i.start) for i in g.mig])
    assert any(p.eligible_nodes is not None for p in snap.pods)
    assert len({p.priority for p in snap.pods}) > 1
    assert snap == mig_benchmark_snapshot(20, occupancy=0.85, pending_fraction=0.3, seed=7)
    assert snap != mig_benchmark_snapshot(20, occupancy=0.85, pending_fraction=0.3, seed=8)


def test_benchmark_rejects_a_non_8_slot_model() -> None:
    with pytest.raises(ValueError, match="8-slot"):
        mig_benchmark_snapshot(1, model_name="A30")


def walls(doc: dict[str, Any], name: str) -> list[float]:
    """Each call's wall time, from the per-plan list (its summary must agree)."""
    (size,) = doc["sizes"]
    values = [p["wall_s"] for p in size[name]["per_plan"]]
    assert max(values) == pytest.approx(size[name]["solve_s"]["max"], abs=1e-4)
    return values


def test_smoke_run_reports_both_planners() -> None:
    doc = run_benchmark([2], [2], time_limit_s=0.5, seed=1)
    (size,) = doc["sizes"]
    assert size["nodes"] == 2 and size["gpus"] == 16 and size["instances"] == 2
    for name in ("cpsat", "greedy"):
        s = size[name]
        assert 0 < s["solve_s"]["p50"] <= s["solve_s"]["p99"] == s["solve_s"]["max"]
        assert 0 < s["cpu_s"]["p50"] <= s["cpu_s"]["p99"] == s["cpu_s"]["max"]
        assert len(s["placed"]) == len(s["placed_weight"]) == len(s["churn"]) == 2
        assert all(
            0 <= u <= pods - placed
            for u, pods, placed in zip(
                s["unplaced_eligible"], size["pending_pods"], s["placed"], strict=True
            )
        )
        per_plan = s["per_plan"]
        assert [p["wall_s"] for p in per_plan] == [round(w, 4) for w in walls(doc, name)]
        assert all(p["cpu_s"] > 0 and (p["loadavg_1m"] or 0) >= 0 for p in per_plan)
        over = sum(1 for p in per_plan if p["wall_s"] > 1.1 * doc["time_limit_s"])
        assert s["over_limit_10pct"] == over
    assert all(p["rounds"] == 1 and p["rounds_skipped"] == 0 for p in size["cpsat"]["per_plan"])
    load = doc["machine"]["loadavg_start"]
    assert load is None or (len(load) == 3 and min(load) >= 0)
    assert size["cpsat_ge_greedy"] == all(size["per_instance_cpsat_ge_greedy"])
    assert doc["cpsat_ge_greedy_everywhere"] == size["cpsat_ge_greedy"]


def test_demo_snapshot_is_small_and_valid() -> None:
    snap: Snapshot = demo_snapshot()
    assert {n.mode for n in snap.nodes} == {Mode.MIG, Mode.MPS}
    assert 8 <= len(snap.pods) <= 12
    for node in snap.nodes:
        model = CAT.model(node.model)
        for g in node.gpus:
            if node.mode is Mode.MIG:
                parse_layout(model, [(i.profile, i.start) for i in g.mig])
