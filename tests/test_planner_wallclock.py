"""``plan()`` honours its time limit as wall time across neighbourhood rounds (planner/api.py).

The planner reads no clock: each round's CP-SAT wall-clock limit is what the solver's own
reported wall times (and the estimates of the work outside it) left of the limit.  A slow or
loaded machine is played by a solver that reports more wall time than it used, so these tests
do not depend on this machine's speed; one test times a real call with a tiny limit.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from ortools.sat.python import cp_model
from test_planner_scale import assert_valid, weight

from planner import PlannerSettings, Policy, default_catalog, plan
from planner.api import (
    _PLANNED_FRACTION,
    _S_PER_GPU,
    _S_PER_MODEL_GPU,
    _S_PER_POD,
    validate_snapshot,
)
from planner.greedy import plan_greedy
from planner.mig_cpsat import DETERMINISTIC_PER_SECOND, MIN_SOLVE_WALL_S, WallBudget
from planner.neighbourhood import spare_capacity
from simulations.inputs.instances import mig_benchmark_snapshot

CATALOG = default_catalog()


class Solves:
    """Records each solve's limits; optionally reports ``extra_s`` more wall time than used."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, extra_s: float = 0.0) -> None:
        self.limits: list[tuple[float, float]] = []
        self.reported: list[float] = []
        real_solve = cp_model.CpSolver.solve
        real_wall = cp_model.CpSolver.wall_time.fget
        assert real_wall is not None
        record = self

        def solve(solver: cp_model.CpSolver, model: cp_model.CpModel, *a: Any, **k: Any) -> Any:
            p = solver.parameters
            record.limits.append((p.max_time_in_seconds, p.max_deterministic_time))
            status = real_solve(solver, model, *a, **k)
            record.reported.append(float(real_wall(solver)) + extra_s)
            return status

        def wall_time(solver: cp_model.CpSolver) -> float:
            return float(real_wall(solver)) + extra_s

        monkeypatch.setattr(cp_model.CpSolver, "solve", solve)
        monkeypatch.setattr(cp_model.CpSolver, "wall_time", property(wall_time))


def instance() -> Any:
    return mig_benchmark_snapshot(20, seed=4, catalog=CATALOG)  # 160 GPUs, 48 pods


SETTINGS = PlannerSettings(time_limit_s=4.0, max_model_gpus=48)
"""A limit long enough that, on this shared machine too, every round fits without the fakes."""


def test_each_round_may_use_what_the_earlier_ones_left(monkeypatch: pytest.MonkeyPatch) -> None:
    snap = instance()
    solves = Solves(monkeypatch)
    result = plan(snap, SETTINGS, CATALOG)
    assert result.stats["neighbourhoods"] == 4 and result.stats["rounds_skipped"] == 0
    assert len(solves.limits) >= 2
    before = _S_PER_GPU * 160 + _S_PER_POD * len(snap.pods) + _S_PER_MODEL_GPU * 48
    (first, first_work), (second, _) = solves.limits[:2]
    # the deterministic share is the reproducible part; the wall limit is all that is left
    assert first_work / DETERMINISTIC_PER_SECOND < first
    assert first == pytest.approx(_PLANNED_FRACTION * SETTINGS.time_limit_s - before)
    # the next round gets what the first solve's own wall time and the next build left (the
    # estimates scaled by at most 8 if the first solve showed a slow machine)
    left = first - solves.reported[0] - _S_PER_MODEL_GPU * 48
    assert left - 7 * (before + _S_PER_MODEL_GPU * 48) - 1e-9 <= second <= left + 1e-9


def test_a_machine_slower_than_the_limits_assume_ends_the_rounds_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snap = instance()
    with monkeypatch.context() as m:
        normal = Solves(m)
        plan(snap, SETTINGS, CATALOG)
    assert len(normal.limits) >= 2
    slow = Solves(monkeypatch, extra_s=3.3)  # every solve "took" 3.3 s more than it ran
    result = plan(snap, SETTINGS, CATALOG)
    assert len(slow.limits) == 1  # 3.3 s of a 3.4 s budget gone: no second round fits
    assert result.stats["rounds"] <= 1 and result.stats["rounds_skipped"] >= 1
    assert_valid(snap, result)
    assert weight(result, snap) >= weight(plan_greedy(snap, SETTINGS, CATALOG), snap)


def test_no_round_fits_a_budget_already_spent_and_greedy_is_returned() -> None:
    snap = mig_benchmark_snapshot(1000, seed=3, catalog=CATALOG)
    # the work before any round is estimated at more than 0.85 x 0.1 s
    s = PlannerSettings(time_limit_s=0.1)
    assert _S_PER_GPU * 8000 + _S_PER_POD * len(snap.pods) > _PLANNED_FRACTION * 0.1
    result = plan(snap, s, CATALOG)
    assert result.status == "GREEDY_FALLBACK" and result.stats["rounds_skipped"] >= 1
    # the warm start of a large snapshot: greedy visiting nodes best fit first
    spare = spare_capacity(snap, validate_snapshot(snap, CATALOG), s)
    greedy = plan_greedy(snap, s, CATALOG, node_rank=spare)
    assert result.assignments == greedy.assignments and result.layouts == greedy.layouts


def best_wall(snap: Any, s: PlannerSettings, repeats: int = 3) -> tuple[float, Any]:
    """The fastest of ``repeats`` calls (this machine is shared: one call may be descheduled)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        result = plan(snap, s, CATALOG)
        best = min(best, time.perf_counter() - started)
    return best, result


def test_a_tiny_limit_on_a_large_instance_returns_in_time_and_not_below_greedy() -> None:
    snap = mig_benchmark_snapshot(100, seed=7, catalog=CATALOG)  # 800 GPUs, 240 pods: rounds
    limit = 0.05
    greedy_s, greedy = best_wall(snap, PlannerSettings(time_limit_s=limit, policy=Policy.GREEDY))
    cpsat_s, result = best_wall(snap, PlannerSettings(time_limit_s=limit))
    # greedy (the fallback, always computed) is the floor no limit can cut; the rest must fit
    # the limit, with 0.1 s for this shared machine's noise
    assert cpsat_s <= greedy_s + limit + 0.1, (cpsat_s, greedy_s)
    assert weight(result, snap) >= weight(greedy, snap)
    assert_valid(snap, result)


def test_wall_budget_scales_estimates_only_by_solves_that_reached_their_work_limit() -> None:
    wall = WallBudget(0.85)
    wall.charge(0.2)
    wall.charge_solve(0.3, deterministic=0.02, deterministic_limit=0.05)  # ended early: no info
    assert wall.slowdown == 1.0 and wall.left() == pytest.approx(0.35)
    wall.charge_solve(0.1, deterministic=0.05, deterministic_limit=0.05)  # as fast as assumed
    assert wall.slowdown == 1.0 and wall.left() == pytest.approx(0.25)
    wall.charge_solve(0.3, deterministic=0.05, deterministic_limit=0.05)  # 3x slower
    assert wall.slowdown == pytest.approx(3.0)
    assert wall.left() == pytest.approx(0.85 - 0.2 * 3.0 - 0.7)
    wall.charge_solve(100.0, deterministic=0.05, deterministic_limit=0.05)
    assert wall.slowdown == 8.0  # clamped
    assert MIN_SOLVE_WALL_S > 0
