"""A deep queue over many priorities: each priority outweighs every pod below it, so the
objective's coefficients outgrow CP-SAT's int64 (64 PriorityClasses of one pod each already
do).  plan() raised building the objective, and the partitioner's batch failed every step with
no pod planned; it returns the greedy plan now, which orders pods by priority the same."""

from __future__ import annotations

from planner import plan
from planner.snapshot import GpuState, Mode, NodeState, PendingPod, Snapshot

A100 = "A100-SXM4-80GB"


def test_many_priorities_fall_back_to_the_greedy_plan() -> None:
    node = NodeState("n0", Mode.MPS, A100, tuple(GpuState(i) for i in range(8)))
    pods = tuple(
        PendingPod(f"p{q}", {"nvidia.com/gpu-10gb": 1}, priority=q) for q in range(64)
    )
    result = plan(Snapshot((node,), pods))
    assert result.status == "GREEDY_FALLBACK"
    assert len(result.assignments) == 56  # 7 slices of 10 GiB on each of 8 GPUs
    placed = {int(name[1:]) for name in result.assignments}
    assert placed == set(range(8, 64))  # the highest priorities first


def test_a_node_cpu_reason_says_its_code_once() -> None:
    """The reason read 'node cpu/memory: node cpu/memory: node n0 has ...' in the pod's Event."""
    node = NodeState("n0", Mode.MPS, A100, (GpuState(0),), cpu_milli_free=1000)
    pod = PendingPod("p", {"nvidia.com/gpu-10gb": 1}, cpu_milli=2000)
    (reason,) = plan(Snapshot((node,), (pod,))).unplaced.values()
    assert reason.count("node cpu/memory") == 1 and "node n0 has 1000m CPU" in reason
