"""Locked GPUs (``GpuState.locked``): their free instances take pods, their layout never changes."""

from __future__ import annotations

import pytest

from planner.api import plan
from planner.demand import SnapshotError
from planner.settings import PlannerSettings, Policy
from planner.snapshot import GpuState, MigInstance, Mode, NodeState, PendingPod, Snapshot

SEVEN_1G = tuple(MigInstance("1g.10gb", s, used=s < 3) for s in range(7))


def pods(profile: str, n: int, prefix: str) -> tuple[PendingPod, ...]:
    return tuple(PendingPod(f"{prefix}{i}", {f"nvidia.com/mig-{profile}": 1}) for i in range(n))


@pytest.mark.parametrize("policy", [Policy.GREEDY, Policy.CPSAT])
def test_locked_gpu_lends_its_free_instances_and_keeps_its_layout(policy: Policy) -> None:
    locked = GpuState(0, mig=SEVEN_1G, locked=True)
    node = NodeState("n", Mode.MIG, "A100-SXM4-80GB", (locked,))
    snap = Snapshot((node,), pods("1g.10gb", 5, "small") + pods("2g.20gb", 1, "big"))
    result = plan(snap, PlannerSettings(policy=policy, time_limit_s=2.0))
    assert sorted(result.assignments) == [f"small{i}" for i in range(4)]
    assert set(result.unplaced) == {"small4", "big0"}
    assert not result.layouts  # nothing created or destroyed on a locked GPU


@pytest.mark.parametrize("policy", [Policy.GREEDY, Policy.CPSAT])
def test_the_unlocked_twin_of_that_gpu_is_reshaped(policy: Policy) -> None:
    # The same GPU, not locked: its free 1g instances at 4-6 give way to a 2g (a check that
    # the test above would fail without the lock).
    node = NodeState("n", Mode.MIG, "A100-SXM4-80GB", (GpuState(0, mig=SEVEN_1G),))
    result = plan(Snapshot((node,), pods("2g.20gb", 1, "big")), PlannerSettings(policy=policy))
    assert "big0" in result.assignments
    after = result.layouts["n", 0].mig
    assert {("1g.10gb", s) for s in range(3)} <= set(after)


@pytest.mark.parametrize("policy", [Policy.GREEDY, Policy.CPSAT])
def test_an_empty_locked_gpu_gets_nothing_and_its_unlocked_neighbour_does(policy: Policy) -> None:
    node = NodeState("n", Mode.MIG, "A100-SXM4-80GB", (GpuState(0, locked=True), GpuState(1)))
    result = plan(Snapshot((node,), pods("3g.40gb", 3, "p")), PlannerSettings(policy=policy))
    assert len(result.assignments) == 2
    assert set(result.layouts) == {("n", 1)}


def test_locked_mps_gpus_are_refused() -> None:
    node = NodeState("m", Mode.MPS, "A100-SXM4-80GB", (GpuState(0, locked=True),))
    with pytest.raises(SnapshotError, match="only MIG GPUs"):
        plan(Snapshot((node,), ()))
