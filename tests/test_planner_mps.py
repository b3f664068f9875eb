"""Fixed cases for MPS planning: slice sizes, reserve, thread %, churn, mixed MIG/MPS snapshots."""

from __future__ import annotations

from planner import (
    GpuState,
    MigInstance,
    Mode,
    MpsSlice,
    NodeState,
    PendingPod,
    PlannedSlice,
    PlannerSettings,
    Snapshot,
    ThreadPolicy,
    Unplaced,
    plan,
)
from planner.mps import thread_percentage

A100 = "A100-SXM4-80GB"
USABLE = 81920 - 512  # A100-80GB memory minus the default MPS server reserve
GIB = 1024


def mps_node(name: str, *gpus: GpuState, **kw: int) -> NodeState:
    return NodeState(name, Mode.MPS, A100, gpus, **kw)


def mps_gpu(index: int, *slices: tuple[int, bool]) -> GpuState:
    return GpuState(index, mps=tuple(MpsSlice(gb * GIB, used=u) for gb, u in slices))


def mps_pod(name: str, gb: int, count: int = 1, **kw: int) -> PendingPod:
    return PendingPod(name, {f"nvidia.com/gpu-{gb}gb": count}, **kw)  # type: ignore[arg-type]


def test_empty_gpu_is_split_into_requested_slices_with_proportional_threads() -> None:
    pods = tuple(mps_pod(f"p{k}", 10) for k in range(3))
    result = plan(Snapshot((mps_node("n", mps_gpu(0)),), pods))
    pct = 100 * 10 * GIB // USABLE  # the share rounded down
    assert result.layouts["n", 0].mps == (PlannedSlice(10 * GIB, pct),) * 3
    for p in pods:
        assert result.assignments[p.name].gpus == {"nvidia.com/gpu-10gb": (0,)}
    # one pod asking for the three slices is refused: a container reaches one MPS daemon
    result = plan(Snapshot((mps_node("n", mps_gpu(0)),), (mps_pod("p", 10, 3),)))
    assert not result.assignments and not result.layouts
    assert result.unplaced["p"].startswith(Unplaced.MPS_SLICES.value), result.unplaced["p"]


def test_full_thread_policy_gives_every_slice_100_percent() -> None:
    s = PlannerSettings(mps_thread_policy=ThreadPolicy.FULL)
    result = plan(Snapshot((mps_node("n", mps_gpu(0)),), (mps_pod("p", 20),)), s)
    assert result.layouts["n", 0].mps == (PlannedSlice(20 * GIB, 100),)


def test_thread_percentage_is_clamped() -> None:
    assert thread_percentage(1, 100_000, ThreadPolicy.PROPORTIONAL) == 1
    assert thread_percentage(100_000, 100_000, ThreadPolicy.PROPORTIONAL) == 100
    assert thread_percentage(40 * GIB, USABLE, ThreadPolicy.PROPORTIONAL) == 50


def test_free_slice_of_the_right_size_is_reused_without_change() -> None:
    snap = Snapshot((mps_node("n", mps_gpu(0, (40, True), (20, False))),), (mps_pod("p", 20),))
    result = plan(snap)
    assert result.layouts == {}
    assert result.assignments["p"].gpus == {"nvidia.com/gpu-20gb": (0,)}


def test_used_slices_stay_and_a_free_slice_in_the_way_is_removed() -> None:
    # 79.5 GiB usable: used 40 + free 30 leaves 9.5; a 20 GiB slice needs the 30 removed
    snap = Snapshot((mps_node("n", mps_gpu(0, (40, True), (30, False))),), (mps_pod("p", 20),))
    result = plan(snap)
    slices = result.layouts["n", 0].mps
    assert [(s.memory_mib // GIB, s.used) for s in slices] == [(40, True), (20, False)]


def test_slices_never_exceed_memory_minus_reserve() -> None:
    snap = Snapshot((mps_node("n", mps_gpu(0)),), (mps_pod("p", 40), mps_pod("q", 40)))
    result = plan(snap)
    assert len(result.assignments) == 1  # 2 x 40 GiB = 81920 MiB > 81408 usable
    assert sum(s.memory_mib for s in result.layouts["n", 0].mps) <= USABLE


def test_gpu_memory_label_overrides_the_catalog_and_reserve_is_configurable() -> None:
    node = NodeState("n", Mode.MPS, A100, (mps_gpu(0),), gpu_memory_mib=40 * GIB)
    snap = Snapshot((node,), (mps_pod("p", 40),))
    assert plan(snap).unplaced["p"].startswith("exceeds any GPU of model A100-SXM4-80GB")
    assert "p" in plan(snap, PlannerSettings(mps_reserve_mib=0)).assignments


def test_prefers_the_gpu_already_holding_slices_over_an_empty_one() -> None:
    snap = Snapshot(
        (mps_node("n", mps_gpu(0), mps_gpu(1, (10, True))),),
        (mps_pod("p", 10),),
    )
    result = plan(snap)
    assert set(result.layouts) == {("n", 1)}  # GPU 0 stays whole for the next batch


def test_mig_pods_go_to_mig_nodes_and_mps_pods_to_mps_nodes() -> None:
    mig = NodeState("m", Mode.MIG, A100, (GpuState(0, (MigInstance("7g.80gb", 0, True),)),))
    mig2 = NodeState("m2", Mode.MIG, A100, (GpuState(0),))
    snap = Snapshot(
        (mig, mig2, mps_node("s", mps_gpu(0))),
        (
            mps_pod("p", 10),
            PendingPod("q", {"nvidia.com/mig-1g.10gb": 1}),
        ),
    )
    result = plan(snap)
    assert result.assignments["p"].node == "s"
    assert result.assignments["q"].node == "m2"
    assert result.status == "OPTIMAL"


def test_mps_pod_without_mps_nodes_has_no_eligible_node() -> None:
    mig = NodeState("m", Mode.MIG, A100, (GpuState(0),))
    result = plan(Snapshot((mig,), (mps_pod("p", 10),)))
    assert result.unplaced["p"].startswith("no eligible node")
    assert "mig mode" in result.unplaced["p"]


def test_node_memory_limits_mps_pods() -> None:
    snap = Snapshot(
        (mps_node("n", mps_gpu(0), memory_mib_free=8000),),
        (mps_pod("p", 5, memory_mib=6000), mps_pod("q", 5, memory_mib=6000)),
    )
    assert len(plan(snap).assignments) == 1
