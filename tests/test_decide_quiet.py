"""A quiet step (nothing changed, nothing due) is returned without recomputing, and it is
exactly what the full step would decide.

The time replay drives the real decision step through arrivals, plans, applies, releases,
binds, drains and missed deadlines.  After every step it makes, the test probes the same index
and state at later times, before and after the step's ``next_wakeup``: wherever
:func:`partitioner.decide.decide` answers from its quiet mark, the full step computed from the
same state at the same time must have no action, plan nothing and return an equal state.  A
time-based decision missing from ``next_wakeup`` (a deadline, the drain wait, the window) fails
here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

import simulations.replay.engine as replay_module
from partitioner import decide as decide_module
from partitioner.decide import ControllerState, Decision, _same_state, _Step
from planner.settings import PlannerSettings
from simulations.inputs.cluster import Cluster
from simulations.inputs.workload import PodShape
from simulations.replay.engine import ReplaySettings, run_time_replay
from simulations.replay.metrics import summarize
from tests.replay_workloads import mig_workload


def _workload(count: int, seed: int) -> tuple[Any, Cluster]:
    mix = (
        PodShape(4, 1000, 1024, 1, 120),
        PodShape(2, 1000, 1024, 1, 300),
        PodShape(1, 1000, 1024, 1, 1000),
        PodShape(1, 1000, 1024, 2, 1000),
    )
    return mig_workload(
        "quiet", mix, count=count, rate_per_s=1 / 20, mean_duration_s=900, seed=seed
    )


def _probe_times(now: float, decision: Decision) -> list[float]:
    wake = decision.next_wakeup
    times = [now + 0.5, now + 7.0, now + 45.0, now + 250.0]
    if wake is not None:
        times += [(now + wake) / 2, wake - 1e-3, wake + 1e-3]
    return sorted(t for t in times if t > now)


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(ReplaySettings(planner=PlannerSettings(time_limit_s=1)), id="defaults"),
        pytest.param(
            ReplaySettings(
                planner=PlannerSettings(time_limit_s=1),
                apply_delay_s=400.0,  # past the apply deadline: re-plans, cool-downs
                drain_after_s=300.0,
                bind_deadline_s=30.0,
            ),
            id="slow-agent",
        ),
    ],
)
def test_quiet_steps_equal_full_steps(
    monkeypatch: pytest.MonkeyPatch, settings: ReplaySettings
) -> None:
    real = decide_module.decide
    seen: Counter[str] = Counter()

    def checking(state: ControllerState, index: Any, now: float, config: Any) -> Decision:
        decision = real(state, index, now, config)
        for t in _probe_times(now, decision):
            probed = real(decision.state, index, t, config)
            quiet = decision.state.quiet
            if probed.state is not decision.state or quiet is None or t >= quiet.until:
                seen["full"] += 1
                continue
            seen["quiet"] += 1
            assert probed.actions == () and probed.plan is None and probed.snapshot is None
            full = _Step(index, replace(decision.state, quiet=None), t, config).run()
            assert full.actions == (), f"t={t}: quiet, but a full step acts: {full.actions}"
            assert full.snapshot is None and not full.error
            assert _same_state(full.state, decision.state)
            assert dict(full.counts) == dict(probed.counts)
        return decision

    monkeypatch.setattr(replay_module, "decide", checking)
    wl, cluster = _workload(60, seed=7)
    result = run_time_replay(wl, cluster, "cpsat", settings)
    s = summarize(result)
    assert s.pods == 60 and s.pods_disrupted == 0 and not result.planner_errors
    # Both kinds of probe happened, often: the check above ran on real quiet steps.
    assert seen["quiet"] > 50 and seen["full"] > 20, seen


def test_a_changed_index_or_a_due_time_ends_quiet() -> None:
    """The mark is only used with the index version and configuration it was made with, and
    before its ``until``."""
    wl, cluster = _workload(12, seed=3)
    steps: list[tuple[Decision, Any, float, Any]] = []
    real = decide_module.decide

    def recording(state: ControllerState, index: Any, now: float, config: Any) -> Decision:
        decision = real(state, index, now, config)
        steps.append((decision, index, now, config))
        return decision

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replay_module, "decide", recording)
        run_time_replay(
            wl, cluster, "cpsat", ReplaySettings(planner=PlannerSettings(time_limit_s=1))
        )
    # The last step of the replay saw the final index: probe it.
    decision, index, now, config = steps[-1]
    state = replace(decision.state, quiet=None)
    again = real(state, index, now + 1.0, config)  # one full step: the mark is set or not
    if again.state.quiet is None:
        again = real(again.state, index, now + 2.0, config)
    assert again.state.quiet is not None, "a replay's final state is a fixed point"
    mark = again.state.quiet
    # Same index, same config, before until: answered from the mark (the very same state).
    assert real(again.state, index, now + 3.0, config).state is again.state
    # Another configuration object: a full step.
    other = replace(config, drain_after_s=config.drain_after_s + 1)
    assert real(again.state, index, now + 3.0, other).state is not again.state
    # A changed index: a full step.
    index.version += 1
    try:
        assert real(again.state, index, now + 3.0, config).state is not again.state
    finally:
        index.version -= 1
    # Past until: a full step.
    if mark.until != float("inf"):
        assert real(again.state, index, mark.until, config).state is not again.state
