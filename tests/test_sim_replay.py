"""Time replay engine: hand-computed timelines, every policy, determinism, zero disruptions."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planner.catalog import Catalog
from planner.greedy import plan_greedy
from planner.settings import PlannerSettings
from planner.snapshot import GpuState, MigInstance, Mode, Plan, Snapshot
from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.workload import Pod, PodShape, Workload
from simulations.replay.engine import (
    ReplayError,
    ReplayPod,
    ReplayPolicy,
    ReplaySettings,
    parse_policy,
    replay_pods,
    run_time_replay,
)
from simulations.replay.fake_cluster import FakeCluster
from simulations.replay.metrics import summarize
from tests.replay_workloads import mig_workload

A100 = "A100-SXM4-80GB"
EMPTY = Workload("none", (Pod("unused", 0),))


def one_gpu() -> FakeCluster:
    return FakeCluster([FakeCluster.node("n0", A100, 1)])


def pod(name: str, resource: str, arrival: float, duration: float, k: int = 1) -> ReplayPod:
    return ReplayPod(name, {f"nvidia.com/mig-{resource}": k}, arrival, duration)


def small_workload(seed: int = 3, count: int = 40) -> tuple[Workload, Cluster]:
    mix = (
        PodShape(4, 1000, 1024, 1, 120),
        PodShape(2, 1000, 1024, 1, 300),
        PodShape(1, 1000, 1024, 1, 1000),
    )
    return mig_workload(
        "small", mix, count=count, rate_per_s=1 / 40, mean_duration_s=600, seed=seed
    )


# ------------------------------------------------------------------ hand-computed timelines


def test_static_whole_gpu_queue_is_hand_computed() -> None:
    pods = [
        pod("a", "7g.80gb", 0, 100),
        pod("b", "7g.80gb", 10, 50),
        pod("c", "7g.80gb", 20, 5, k=2),
    ]
    r = run_time_replay(EMPTY, one_gpu(), "static:all-7g", pods=pods)
    rec = {p.name: p for p in r.pods}
    assert rec["a"].first_bound == 0 and rec["a"].pending_s == 0
    assert rec["b"].first_bound == 100 and rec["b"].pending_s == 90
    assert rec["c"].first_bound is None  # two whole GPUs on a one-GPU cluster
    assert r.end == 150  # b departs at 100 + 50
    assert rec["c"].pending_s == 130  # censored: waited from 20 to the end
    s = summarize(r)
    assert (s.pending_p50_s, s.pending_p95_s, s.never_scheduled) == (90, 130, 1)
    assert s.pending_mean_s == pytest.approx((0 + 90 + 130) / 3)
    assert s.allocation_mean == pytest.approx(1.0)
    assert s.reconfigurations_per_hour == 0 and s.plans == 0
    # b waits 10-100 and c 20-150 while a, then b, holds the GPU: nothing idle while they wait
    assert (s.waiting_span_s, s.idle_gpus_while_waiting) == (140, 0)


@pytest.mark.parametrize(("react", "opened"), [(None, 1.0), (0.1, 0.0)])
def test_partitioner_window_and_apply_delay_are_hand_computed(
    react: float | None, opened: float
) -> None:
    # nos's path (greedy, no gates): kube-scheduler finds no slice at 0 (Unschedulable); the
    # partitioner, which has not stepped yet, sees that at once (the loop before reactions: at
    # its next cycle, 1 s), the window opens then and idles out 10 s later; the spec is applied 5 s after that; the node's allocatable reaches the API at the
    # kubelet's next status sync (phase + 10 k s), and kube-scheduler binds the pod then
    settings = ReplaySettings(batch_timeout_s=60, batch_idle_s=10, apply_delay_s=5, react_s=react)
    r = run_time_replay(EMPTY, one_gpu(), "greedy", settings, pods=[pod("a", "1g.10gb", 0, 100)])
    (rec,) = r.pods
    planned, applied = opened + 10, opened + 15
    phase = r.status_sync["n0"]
    sync = phase + math.ceil((applied - phase) / 10) * 10
    assert applied <= sync < applied + 10
    assert rec.first_bound == pytest.approx(sync) and rec.pending_s == pytest.approx(sync)
    assert r.reconfigurations == [(pytest.approx(applied), 1)]
    assert len(r.plans) == 1 and r.plans[0].placed == 1
    assert r.plans[0].time == pytest.approx(planned)
    assert r.end == pytest.approx(sync + 100)  # the pod departs; nothing waits: the replay ends
    s = summarize(r)
    assert s.pods_disrupted == 0 and s.never_scheduled == 0
    assert s.reconfigurations_per_hour == pytest.approx(1 / ((sync + 100) / 3600))
    # the GPU idles for the whole wait (window, apply, status sync)
    assert s.waiting_span_s == pytest.approx(sync) and s.idle_gpus_while_waiting == 1
    # the pod asks for one instance: the same span counts for one-GPU pods
    assert s.one_gpu_waiting_span_s == pytest.approx(sync)
    assert s.idle_gpus_while_one_gpu_pods_wait == 1


def test_idle_while_one_gpu_pods_wait_leaves_out_pods_no_idle_gpu_can_hold() -> None:
    # static all-7g, one GPU: a holds it 0-100; b (two GPUs) can never bind on this cluster;
    # c (one GPU) waits 10-100 and holds it 100-130; d arrives at 200 and holds it at once
    # until 210, the end.  While c waits the GPU is busy; from 130 to 200 only b waits,
    # beside the idle GPU: that counts for "pods wait", not for "one-GPU pods wait".
    pods = [
        pod("a", "7g.80gb", 0, 100),
        pod("b", "7g.80gb", 5, 1, k=2),
        pod("c", "7g.80gb", 10, 30),
        pod("d", "7g.80gb", 200, 10),
    ]
    r = run_time_replay(EMPTY, one_gpu(), "static:all-7g", pods=pods)
    assert r.end == 210
    s = summarize(r)
    assert s.waiting_span_s == 205  # b waits from 5 to the end
    assert s.idle_gpus_while_waiting == pytest.approx(70 / 205)
    assert s.one_gpu_waiting_span_s == 90  # c waits from 10 to 100, d not at all
    assert s.idle_gpus_while_one_gpu_pods_wait == 0


def test_timeout_closes_a_window_that_keeps_getting_arrivals() -> None:
    # gated pods (cpsat reserves): arrivals at 0, 8, 16, 24 are seen at once (the partitioner
    # reacts to each, its last step long past); the window opened at 0 times out at 20 with 3
    # pods; applied at once, they are released when the node's allocatable shows the slices
    # (the kubelet's status sync: the partitioner reacts to it at once too), and bound then.
    # p3's window opens at 24 and idles out at 34.
    settings = ReplaySettings(batch_timeout_s=20, batch_idle_s=10, apply_delay_s=0)
    pods = [pod(f"p{i}", "1g.10gb", 8 * i, 1000) for i in range(4)]
    r = run_time_replay(EMPTY, one_gpu(), "cpsat", settings, pods=pods)
    assert [(p.time, p.batch) for p in r.plans] == [(20, 3), (34, 1)]
    phase = r.status_sync["n0"]

    def released(applied: float) -> float:
        return phase + math.ceil((applied - phase) / 10) * 10

    bound = sorted((p.name, p.first_bound) for p in r.pods)
    assert bound == [
        ("p0", pytest.approx(released(20))),
        ("p1", pytest.approx(released(20))),
        ("p2", pytest.approx(released(20))),
        ("p3", pytest.approx(released(34))),
    ]
    assert r.theft == 0 and r.events["Released"] == 4


# ------------------------------------------------------------------ policies


@pytest.mark.parametrize("policy", ["cpsat", "greedy", "static:balanced", "static:all-1g"])
def test_every_policy_replays_a_small_workload(policy: str) -> None:
    wl, cl = small_workload()
    r = run_time_replay(wl, cl, policy, ReplaySettings(planner=PlannerSettings(time_limit_s=2)))
    s = summarize(r)
    assert s.pods == 40 and s.pods_disrupted == 0 and not r.planner_errors
    assert len({p.name for p in r.pods}) == 40
    for p in r.pods:
        assert p.first_bound is None or p.first_bound >= p.arrival
    if policy.startswith("static"):
        assert s.plans == 0 and s.gpus_reconfigured == 0
    else:
        assert s.plans > 0 and s.gpus_reconfigured > 0 and s.never_scheduled == 0
        # cpsat reserves (gated pods: Reserved, Released), greedy is nos's path (Planned)
        story = ("Reserved", "Released") if policy == "cpsat" else ("Planned",)
        assert all(r.events.get(e, 0) > 0 for e in story), r.events


def test_replay_is_deterministic_for_a_fixed_seed() -> None:
    wl, cl = small_workload(seed=5)
    settings = ReplaySettings(copies=2, seed=11)

    def run() -> tuple[object, ...]:
        r = run_time_replay(wl, cl, "greedy", settings)
        s = summarize(r).as_dict()
        for k in (
            "wall_s",
            "planner_ms_p50",
            "planner_ms_p95",
            "planner_ms_max",
            "planner_ms_mean",
        ):
            s.pop(k)
        return (s, [(p.name, p.first_bound, p.pending_s) for p in r.pods], r.reconfigurations)

    assert run() == run()


def _mover(snapshot: Snapshot, settings: PlannerSettings, catalog: Catalog) -> Plan:
    """A broken planner: it believes every instance is free, so it may move used ones."""
    nodes = tuple(
        replace(
            n,
            gpus=tuple(
                GpuState(g.index, mig=tuple(MigInstance(i.profile, i.start) for i in g.mig))
                for g in n.gpus
            ),
        )
        for n in snapshot.nodes
    )
    return plan_greedy(Snapshot(nodes, snapshot.pods), settings, catalog)


@pytest.mark.parametrize("planner", ["cpsat", "greedy"])
def test_real_planners_never_disrupt_where_a_mover_would(planner: str) -> None:
    # a 1g pod runs; then a whole-GPU pod arrives: only destroying the used 1g would fit it
    pods = [pod("small", "1g.10gb", 0, 1000), pod("big", "7g.80gb", 100, 100)]
    # the mover keeps evicting whichever pod runs (a livelock): stop it at a horizon
    guard = ReplaySettings(horizon_s=120)  # first eviction at 115, the next at 130
    mover = run_time_replay(
        EMPTY, one_gpu(), ReplayPolicy("mover", planner=_mover), guard, pods=pods
    )
    assert summarize(mover).pods_disrupted == 1
    assert next(p for p in mover.pods if p.name == "small").disruptions == 1

    real = run_time_replay(EMPTY, one_gpu(), planner, pods=pods)
    s = summarize(real)
    assert s.pods_disrupted == 0 and s.never_scheduled == 0
    big = next(p for p in real.pods if p.name == "big")
    small = next(p for p in real.pods if p.name == "small")
    assert small.first_bound is not None and big.first_bound is not None
    assert big.first_bound >= small.first_bound + 1000  # waited for the 1g to finish


def _failing(snapshot: Snapshot, settings: PlannerSettings, catalog: Catalog) -> Plan:
    raise RuntimeError("planner exploded")


def test_a_planner_that_always_fails_ends_the_replay() -> None:
    """Without the error guard the partitioner retries the failing plan forever."""
    pods = [pod("small", "1g.10gb", 0, 1000)]
    r = run_time_replay(
        EMPTY,
        one_gpu(),
        ReplayPolicy("failing", planner=_failing),
        ReplaySettings(max_planner_errors=3),
        pods=pods,
    )
    assert len(r.planner_errors) == 3 and "planner exploded" in r.planner_errors[0]
    s = summarize(r)
    assert s.never_scheduled == 1 and s.planner_errors == 3


# ------------------------------------------------------------------ inputs


def test_replay_pods_use_the_mapping_of_the_cluster_mode() -> None:
    from planner.catalog import default_catalog

    wl = Workload(
        "w",
        (
            Pod("a", 0, 0, 1, 100, creation_time=0, deletion_time=10),
            Pod("b", 0, 0, 8, 1000, creation_time=0, deletion_time=10),
        ),
    )
    m = default_catalog().model(A100)
    mig = replay_pods(wl, m, Mode.MIG)
    assert [dict(p.requests) for p in mig] == [
        {"nvidia.com/mig-1g.10gb": 1},
        {"nvidia.com/mig-7g.80gb": 8},
    ]
    mps = replay_pods(wl, default_catalog().model("V100-32GB"), Mode.MPS)
    # 10 % of the (32768 - 512) MiB = 31 GiB a V100-32GB offers to slices, rounded down
    assert dict(mps[0].requests) == {"nvidia.com/gpu-3gb": 1}
    assert dict(mps[1].requests) == {"nvidia.com/gpu-31gb": 8}  # whole GPUs: all usable memory
    with pytest.raises(ReplayError, match="choose a mig mapping"):
        replay_pods(wl, m, Mode.MIG, ReplaySettings(mapping="mps-memory"))
    with pytest.raises(ReplayError, match="unknown mapping"):
        replay_pods(wl, m, Mode.MIG, ReplaySettings(mapping="nearest"))


def test_replay_pods_compress_and_overlay_copies() -> None:
    from planner.catalog import default_catalog

    wl = Workload(
        "w",
        (
            Pod("a", 0, 0, 1, 100, creation_time=100, deletion_time=300),
            Pod("b", 0, 0, 1, 100, creation_time=500, deletion_time=900),
            Pod("cpu", 100),
        ),
    )
    m = default_catalog().model(A100)
    pods = replay_pods(wl, m, Mode.MIG, ReplaySettings(time_compression=10))
    assert [(p.name, p.arrival, p.duration) for p in pods] == [("a", 0, 20), ("b", 40, 40)]
    copies = replay_pods(wl, m, Mode.MIG, ReplaySettings(copies=3, seed=1))
    assert len(copies) == 6 and len({p.name for p in copies}) == 6
    assert all(0 <= p.arrival < 401 for p in copies)
    assert copies == replay_pods(wl, m, Mode.MIG, ReplaySettings(copies=3, seed=1))
    no_times = Workload("w", (Pod("x", 0, 0, 1, 100),))
    with pytest.raises(ReplayError, match="creation_time"):
        replay_pods(no_times, m, Mode.MIG)


def test_bad_policy_and_uncatalogued_model_are_rejected() -> None:
    with pytest.raises(ReplayError, match="unknown replay policy"):
        parse_policy("random")
    odd = Cluster("odd", (Node("a", 1000, 1000, 1, "G2", Mode.MPS, None),))
    wl, _ = small_workload(count=3)
    with pytest.raises(ReplayError, match="not in the GPU catalog"):
        run_time_replay(wl, odd, "greedy")


def test_mixed_model_and_mode_cluster_replays() -> None:
    # A MIG A100 node and an MPS V100 node: whole-GPU pods map (for the A100, the model with
    # the most MIG GPUs) to 7g.80gb instances, which only the A100 advertises; all are placed.
    mixed = Cluster(
        "mixed",
        (
            Node("a", 64000, 512000, 2, A100, Mode.MIG, A100),
            Node("b", 64000, 512000, 1, "V100-32GB", Mode.MPS, "V100-32GB"),
        ),
    )
    wl, _ = small_workload(count=6)
    r = run_time_replay(wl, mixed, "greedy")
    assert {p.name for p in r.pods} == {p.name for p in wl.pods}
    assert all(p.first_bound is not None for p in r.pods)
    assert r.disruptions == 0 and r.theft == 0


@pytest.mark.parametrize("policy", ["cpsat", "greedy"])
def test_the_partitioner_steps_again_one_cycle_after_its_own_writes(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator sees its own patches as watch events and steps again at its next cycle (a
    reservation a plan made on a free slice is released there); the replay must not wait for
    a time-based wake-up instead (it once waited for the reservation's 300 s deadline)."""
    from simulations.replay import engine as engine_module

    steps: list[tuple[float, bool]] = []
    step = engine_module._Engine._step

    def recording(self: engine_module._Engine, t: float) -> None:
        before = self.index.version
        step(self, t)
        steps.append((t, self.index.version != before))

    monkeypatch.setattr(engine_module._Engine, "_step", recording)
    wl, cl = small_workload(seed=7, count=60)
    settings = ReplaySettings(planner=PlannerSettings(time_limit_s=2))
    run_time_replay(wl, cl, policy, settings)
    wrote = [i for i, (_, changed) in enumerate(steps[:-1]) if changed]
    assert len(wrote) > 10
    late = [
        (steps[i][0], steps[i + 1][0])
        for i in wrote
        if steps[i + 1][0] > steps[i][0] + settings.cycle_s + 1e-6
    ]
    assert not late, late[:5]
