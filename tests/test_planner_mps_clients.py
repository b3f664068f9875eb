"""MPS client limit and thread budget (planner/mps.py, "Client limit").

An MPS server accepts at most 48 clients per device (Volta and newer): every slice past the
48th on one GPU (or one hybrid host instance) is a pod whose CUDA init fails.  And the
active-thread percentages the planner gives one GPU's slices add up to at most 100, as NVIDIA's
plugin's ``floor(100 / replicas)`` do.  Both planners (greedy and CP-SAT), the hybrid host
patterns and the node agent's spec check obey the limit; a pod that fits only past it is
unplaced as ``capacity`` with a reason naming the client limit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract.nodepartitioning import DesiredGpu, DesiredMigInstance, DesiredMpsSlice
from node_agent.gpu_plan import ObservedGpu, ObservedInstance, plan_gpu
from node_agent.nvml import GpuInfo
from planner import (
    GpuState,
    MigInstance,
    Mode,
    MpsSlice,
    NodeState,
    PendingPod,
    Plan,
    PlannerSettings,
    Policy,
    Snapshot,
    ThreadPolicy,
    Unplaced,
    default_catalog,
    plan,
)
from planner.hybrid import hybrid_plan_errors, instance_usable_mib, patterns
from planner.mps import MAX_CLIENTS, thread_percentage

GIB = 1024
CATALOG = default_catalog()
GREEDY = replace(PlannerSettings(), policy=Policy.GREEDY)
CPSAT = replace(
    PlannerSettings(), policy=Policy.CPSAT, time_limit_s=2.0, num_workers=1, mps_polish=False
)
"""The CP-SAT model itself; the packing polish after it is checked on its own below."""
POLICIES = pytest.mark.parametrize("s", [GREEDY, CPSAT], ids=["greedy", "cpsat"])


def usable(model: str, s: PlannerSettings = CPSAT) -> int:
    return CATALOG.model(model).memory_mib - s.mps_reserve_mib


def mps_node(name: str, model: str, *gpus: GpuState) -> NodeState:
    return NodeState(name, Mode.MPS, model, gpus or (GpuState(0),))


def pods(n: int, gb: int, prefix: str = "p") -> tuple[PendingPod, ...]:
    return tuple(PendingPod(f"ns/{prefix}{i:03d}", {f"nvidia.com/gpu-{gb}gb": 1}) for i in range(n))


def final_slices(snap: Snapshot, result: Plan) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """(node, GPU) -> (MiB, thread %) of every slice of every MPS GPU as the plan leaves it
    (snapshot slices without a thread % count at the planner's share)."""
    out: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for n in snap.nodes:
        u = usable(n.model)
        for g in n.gpus:
            planned = result.layouts.get((n.name, g.index))
            if planned is not None:
                out[(n.name, g.index)] = [(x.memory_mib, x.thread_percentage) for x in planned.mps]
            else:
                out[(n.name, g.index)] = [
                    (
                        x.memory_mib,
                        x.thread_percentage
                        if x.thread_percentage is not None
                        else thread_percentage(x.memory_mib, u, ThreadPolicy.PROPORTIONAL),
                    )
                    for x in g.mps
                ]
    return out


def assert_within_limits(snap: Snapshot, result: Plan) -> None:
    for where, slices in final_slices(snap, result).items():
        assert len(slices) <= MAX_CLIENTS, f"{where}: {len(slices)} slices"
        total = sum(t for _, t in slices)
        assert total <= 100, f"{where}: thread % add up to {total}"


# --------------------------------------------------------------------------- thread %


def test_thread_percentage_rounds_down_with_a_floor_of_one() -> None:
    u = usable("A100-SXM4-40GB")  # 40448 MiB: 1 GiB is 2.53 %
    assert thread_percentage(GIB, u, ThreadPolicy.PROPORTIONAL) == 2
    assert thread_percentage(5 * GIB, u, ThreadPolicy.PROPORTIONAL) == 12  # 12.66
    assert thread_percentage(GIB, usable("H200-141GB"), ThreadPolicy.PROPORTIONAL) == 1  # 0.71
    assert thread_percentage(u, u, ThreadPolicy.PROPORTIONAL) == 100
    assert thread_percentage(GIB, u, ThreadPolicy.FULL) == 100


@given(
    u=st.integers(1024, 200_000),
    gbs=st.lists(st.integers(1, 200), min_size=1, max_size=60),
)
def test_shares_of_slices_that_fit_add_up_to_at_most_100(u: int, gbs: list[int]) -> None:
    """Brute force over slice lists that fit: rounding down keeps the sum <= 100 whenever no
    slice is under 1 % (where the floor of 1 % takes over, the planners' budget does)."""
    mibs = [gb * GIB for gb in gbs]
    if sum(mibs) > u or any(100 * m < u for m in mibs):
        return
    assert sum(thread_percentage(m, u, ThreadPolicy.PROPORTIONAL) for m in mibs) <= 100


@POLICIES
@pytest.mark.parametrize(
    ("model", "sizes"),
    [
        ("A100-SXM4-40GB", [1] * 39),  # rounded to nearest: 39 x 3 % = 117 %
        ("A100-SXM4-40GB", [5] * 7 + [4]),  # 7 x 13 + 10 = 101 %
        ("A100-SXM4-80GB", [3] * 26),  # 26 x 4 = 104 %
    ],
)
def test_reviewer_cases_sum_to_at_most_100(
    s: PlannerSettings, model: str, sizes: list[int]
) -> None:
    node = mps_node("n1", model)
    batch = tuple(
        PendingPod(f"ns/p{i:02d}", {f"nvidia.com/gpu-{gb}gb": 1}) for i, gb in enumerate(sizes)
    )
    snap = Snapshot((node,), batch)
    result = plan(snap, s)
    assert len(result.assignments) == len(sizes)  # all of them still fit
    assert_within_limits(snap, result)


@POLICIES
def test_tiny_slices_beside_a_large_one_stay_within_the_thread_budget(s: PlannerSettings) -> None:
    """H200: 1 GiB is 0.71 % (raised to 1 %), 100 GiB is 71 %.  Memory would take 39 more
    1 GiB slices beside the 100 GiB one, the thread budget 29."""
    node = mps_node("n1", "H200-141GB")
    big = PendingPod("ns/big", {"nvidia.com/gpu-100gb": 1}, priority=1)
    snap = Snapshot((node,), (big, *pods(40, 1)))
    result = plan(snap, s)
    assert "ns/big" in result.assignments
    assert len(result.assignments) == 1 + 29
    assert_within_limits(snap, result)
    missed = [r for name, r in result.unplaced.items()]
    assert missed and all(r.startswith(Unplaced.CAPACITY.value) for r in missed)
    assert all(f"{MAX_CLIENTS} clients" in r for r in missed), missed[0]


# --------------------------------------------------------------------------- client limit


@POLICIES
@pytest.mark.parametrize("model", ["A100-SXM4-80GB", "H100-80GB", "H200-141GB"])
def test_one_gpu_takes_at_most_48_slices(s: PlannerSettings, model: str) -> None:
    snap = Snapshot((mps_node("n1", model),), pods(70, 1))
    result = plan(snap, s)
    assert len(result.assignments) == MAX_CLIENTS
    assert_within_limits(snap, result)
    assert len(result.unplaced) == 70 - MAX_CLIENTS
    for reason in result.unplaced.values():
        assert reason.startswith(Unplaced.CAPACITY.value), reason
        assert f"at most {MAX_CLIENTS} clients" in reason
        assert "cudaErrorMpsMaxClientsReached" in reason


@POLICIES
def test_the_rest_goes_to_the_next_gpu(s: PlannerSettings) -> None:
    snap = Snapshot((mps_node("n1", "A100-SXM4-80GB", GpuState(0), GpuState(1)),), pods(70, 1))
    result = plan(snap, s)
    assert len(result.assignments) == 70
    assert_within_limits(snap, result)
    per_gpu = Counter(a.gpus["nvidia.com/gpu-1gb"][0] for a in result.assignments.values())
    assert max(per_gpu.values()) <= MAX_CLIENTS


@POLICIES
def test_existing_slices_count_towards_the_limit(s: PlannerSettings) -> None:
    """40 used and 8 free 1 GiB slices: the 8 free ones take pods, nothing more is made
    although 31 GiB are left."""
    gpu = GpuState(0, mps=(MpsSlice(GIB, used=True),) * 40 + (MpsSlice(GIB),) * 8)
    snap = Snapshot((mps_node("n1", "A100-SXM4-80GB", gpu),), pods(12, 1))
    result = plan(snap, s)
    assert len(result.assignments) == 8
    assert_within_limits(snap, result)
    assert all(f"{MAX_CLIENTS} clients" in r for r in result.unplaced.values())


@POLICIES
def test_free_slices_are_replaced_within_the_limit(s: PlannerSettings) -> None:
    """45 used 1 GiB slices and 3 free 2 GiB ones: 1 GiB pods get at most 3 slices (the free
    2 GiB ones make way for them), never a 49th."""
    gpu = GpuState(0, mps=(MpsSlice(GIB, used=True),) * 45 + (MpsSlice(2 * GIB),) * 3)
    snap = Snapshot((mps_node("n1", "A100-SXM4-80GB", gpu),), pods(5, 1))
    result = plan(snap, s)
    assert len(result.assignments) == 3
    assert_within_limits(snap, result)


def test_polish_keeps_the_client_limit() -> None:
    """The packing polish (on by default) moves pods towards the fullest GPU: not past 48."""
    snap = Snapshot((mps_node("n1", "A100-SXM4-80GB", GpuState(0), GpuState(1)),), pods(70, 1))
    result = plan(snap, replace(CPSAT, mps_polish=True))
    assert len(result.assignments) == 70
    assert_within_limits(snap, result)


def test_cpsat_drops_free_slices_over_the_limit() -> None:
    """An older plan left 60 free slices: CP-SAT's plan of that GPU keeps at most 48."""
    gpu = GpuState(0, mps=(MpsSlice(GIB),) * 60)
    snap = Snapshot((mps_node("n1", "A100-SXM4-80GB", gpu),), pods(2, 1))
    result = plan(snap, CPSAT)
    assert len(result.assignments) == 2
    assert len(result.layouts["n1", 0].mps) <= MAX_CLIENTS


def test_used_slices_over_the_limit_are_kept_and_nothing_is_added() -> None:
    """50 used slices (an older plan): both planners keep them and add no client."""
    gpu = GpuState(0, mps=(MpsSlice(GIB, used=True),) * 50)
    snap = Snapshot((mps_node("n1", "A100-SXM4-80GB", gpu),), pods(3, 1))
    for s in (GREEDY, CPSAT):
        result = plan(snap, s)
        assert not result.assignments
        assert ("n1", 0) not in result.layouts


@st.composite
def mps_batches(draw: st.DrawFn) -> Snapshot:
    model = draw(st.sampled_from(["A100-SXM4-40GB", "A100-SXM4-80GB", "H200-141GB"]))
    u = usable(model)
    gpus = []
    for i in range(draw(st.integers(1, 2))):
        slices: list[MpsSlice] = []
        for _ in range(draw(st.integers(0, 50))):
            gb = draw(st.sampled_from([1, 1, 1, 2, 3, 8]))
            if sum(x.memory_mib for x in slices) + gb * GIB <= u:
                slices.append(MpsSlice(gb * GIB, used=draw(st.booleans())))
        # snapshots that already break a limit are the older plans' business (tests above)
        if (
            len(slices) > MAX_CLIENTS
            or sum(thread_percentage(x.memory_mib, u, ThreadPolicy.PROPORTIONAL) for x in slices)
            > 100
        ):
            slices = slices[: min(MAX_CLIENTS, 30)]
        gpus.append(GpuState(i, mps=tuple(slices)))
    batch: list[PendingPod] = []
    for k in range(draw(st.integers(1, 4))):
        gb = draw(st.sampled_from([1, 1, 2, 4, 10, 30]))
        batch += pods(draw(st.integers(1, 40)), gb, prefix=f"g{k}-")
    return Snapshot((mps_node("n1", model, *gpus),), tuple(batch))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(snap=mps_batches(), use_cpsat=st.booleans())
def test_random_mps_batches_stay_within_the_limits(snap: Snapshot, use_cpsat: bool) -> None:
    s = replace(CPSAT, time_limit_s=0.5) if use_cpsat else GREEDY
    result = plan(snap, s)
    for where, slices in final_slices(snap, result).items():
        gpu = next(g for g in snap.nodes[0].gpus if g.index == where[1])
        assert len(slices) <= max(MAX_CLIENTS, len(gpu.mps)), where
        assert sum(t for _, t in slices) <= 100, where
    for reason in result.unplaced.values():
        assert reason.startswith(Unplaced.CAPACITY.value), reason


# --------------------------------------------------------------------------- hybrid


def hybrid_node(model: str, *gpus: GpuState) -> NodeState:
    return NodeState("h1", Mode.HYBRID, model, gpus or (GpuState(0),))


def test_patterns_respect_the_client_limit_and_thread_budget() -> None:
    u = 80_000
    got = patterns(u, [GIB], [70])
    assert got and max(sum(p) for p in got) == MAX_CLIENTS  # memory alone would take 70
    threads = [thread_percentage(m, 143_000, ThreadPolicy.PROPORTIONAL) for m in (GIB, 100 * GIB)]
    mixed = patterns(143_000, [GIB, 100 * GIB], [40, 1], threads)
    assert (29, 1) in mixed and all(p[0] * 1 + p[1] * 71 <= 100 for p in mixed)
    many = patterns(143_000, [GIB, 2 * GIB, 3 * GIB], [70, 70, 70])  # maximal ones only
    assert many and all(sum(p) <= MAX_CLIENTS for p in many)


def assert_hosts_within_limits(snap: Snapshot, result: Plan, s: PlannerSettings) -> None:
    node = snap.nodes[0]
    model = CATALOG.model(node.model)
    for (_, _), planned in result.layouts.items():
        assert not hybrid_plan_errors(node, model, planned, s)
        names = {start: name for name, start in planned.mig}
        for start, slices in planned.mig_mps:
            assert len(slices) <= MAX_CLIENTS, (start, len(slices))
            u = instance_usable_mib(model.profile(names[start]), s)
            assert sum(x.thread_percentage for x in slices) <= 100, (start, u)


@POLICIES
def test_hybrid_host_takes_at_most_48_slices(s: PlannerSettings) -> None:
    """One H200 made one 7g host (a used slice pins it): 60 x 1 GiB fit its memory, 48 its
    daemon."""
    host = MigInstance("7g.141gb", 0, mps=(MpsSlice(GIB, used=True),))
    snap = Snapshot((hybrid_node("H200-141GB", GpuState(0, mig=(host,))),), pods(60, 1))
    result = plan(snap, s)
    assert len(result.assignments) == MAX_CLIENTS - 1
    assert_hosts_within_limits(snap, result, s)
    assert all(f"{MAX_CLIENTS} clients" in r for r in result.unplaced.values())


@POLICIES
def test_hybrid_new_hosts_stay_within_the_limits(s: PlannerSettings) -> None:
    snap = Snapshot((hybrid_node("H200-141GB"),), pods(70, 1) + pods(1, 100, prefix="big"))
    result = plan(snap, s)
    assert_hosts_within_limits(snap, result, s)


def test_hybrid_plan_errors_name_the_client_limit() -> None:
    model = CATALOG.model("H200-141GB")
    node = hybrid_node("H200-141GB")
    from planner.snapshot import PlannedGpu, PlannedSlice

    slices = (PlannedSlice(GIB, 1),) * (MAX_CLIENTS + 1)
    planned = PlannedGpu("h1", 0, mig=(("7g.141gb", 0),), mig_mps=((0, slices),))
    errors = hybrid_plan_errors(node, model, planned, CPSAT)
    assert any(f"at most {MAX_CLIENTS} clients" in e for e in errors), errors


# --------------------------------------------------------------------------- node agent


A100 = CATALOG.model("A100-SXM4-80GB")
MPS_INFO = GpuInfo(0, "GPU-0", "NVIDIA A100-SXM4-80GB", "20B2", 81920, mig_enabled=False)


def mps_spec(n: int) -> DesiredGpu:
    return DesiredGpu(index=0, mps=[DesiredMpsSlice(memoryMiB=GIB, activeThreadPercentage=1)] * n)


def test_agent_refuses_an_mps_spec_over_the_client_limit() -> None:
    obs = ObservedGpu(MPS_INFO, A100, (), 0, (), frozenset(), True)
    ok = plan_gpu(obs, mps_spec(MAX_CLIENTS), "mps")
    assert ok.block is None and ok.slices is not None and len(ok.slices) == MAX_CLIENTS
    over = plan_gpu(obs, mps_spec(MAX_CLIENTS + 1), "mps")
    assert over.block is not None and over.block.reason == "InvalidSpec"
    assert f"at most {MAX_CLIENTS} clients" in over.block.message
    assert "cudaErrorMpsMaxClientsReached" in over.block.message


def test_agent_refuses_a_hybrid_host_over_the_client_limit() -> None:
    info = replace(MPS_INFO, mig_enabled=True)
    prof = A100.profile("7g.80gb")
    inst = ObservedInstance(1, prof.profile_id, prof, 0, 8, (0,), "MIG-0", False, False, ())
    obs = ObservedGpu(info, A100, (inst,), 0, (), frozenset(), True)

    def spec(n: int) -> DesiredGpu:
        mps = [DesiredMpsSlice(memoryMiB=GIB, activeThreadPercentage=1)] * n
        return DesiredGpu(index=0, mig=[DesiredMigInstance(profile="7g.80gb", start=0, mps=mps)])

    assert plan_gpu(obs, spec(MAX_CLIENTS), "hybrid").block is None
    over = plan_gpu(obs, spec(MAX_CLIENTS + 1), "hybrid")
    assert over.block is not None and over.block.reason == "InvalidSpec"
    assert f"at most {MAX_CLIENTS} clients" in over.block.message
