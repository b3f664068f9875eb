"""Planner settings no plan can run with are refused where they are read.

CP-SAT's random seed is a 32-bit integer and its time limit a finite number of seconds: a seed
of 10**20 made the solver's parameters raise (a TypeError out of OR-Tools at the first plan, so
a partitioner started with it crashed on its first batch), and an infinite limit overflowed the
MPS polish's budget.  :class:`planner.settings.PlannerSettings` now refuses them with a message
naming the field, the partitioner's settings too (exit 2 before it connects).
"""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from gpuslice.cli import EXIT_BAD_INPUT, main
from partitioner.settings import PartitionerSettings
from planner.settings import MAX_SEED, MAX_TIME_LIMIT_S, PlannerSettings


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("time_limit_s", math.inf),
        ("time_limit_s", math.nan),
        ("time_limit_s", 0.0),
        ("time_limit_s", MAX_TIME_LIMIT_S * 2),
        ("seed", MAX_SEED + 1),
        ("seed", -1),
        ("num_workers", 0),
    ],
)
def test_planner_settings_refuse_what_no_plan_can_run_with(field: str, value: float) -> None:
    words = {"time_limit_s": "time limit", "seed": "seed", "num_workers": "num_workers"}
    with pytest.raises(ValueError, match=words[field]):
        PlannerSettings(**{field: value})


def test_the_edges_are_accepted_and_plan() -> None:
    from planner.api import plan
    from planner.catalog import default_catalog
    from simulations.inputs.instances import demo_snapshot

    s = PlannerSettings(seed=MAX_SEED, time_limit_s=0.5)
    assert plan(demo_snapshot(), s, default_catalog()).stats is not None


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ("planner_seed", 10**20),
        ("planner_seed", -3),
        ("planner_time_limit_seconds", math.inf),
        ("planner_time_limit_seconds", MAX_TIME_LIMIT_S + 1),
    ],
)
def test_partitioner_settings_refuse_them(env: str, value: float) -> None:
    with pytest.raises(ValidationError):
        PartitionerSettings(**{env: value})


def test_the_partitioner_command_exits_2_before_it_connects(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUSLICE_PLANNER_SEED", str(10**20))
    assert main(["partitioner"]) == EXIT_BAD_INPUT
    assert "planner_seed" in capsys.readouterr().err.lower().replace("-", "_")
