"""Agent outages in the time replay: every promise still arrives or is re-planned.

The replay stops a node's agent for a while (:class:`simulations.replay.engine.AgentOutage`):
no spec applied, no status written, the device plugin gone (the kubelet marks its devices
unhealthy at once: allocatable 0 from its next status sync, and a slice pod bound before
kube-scheduler sees that is refused).  Whatever the workload and the outage, with the decision
code as shipped: every pod runs in the end, nothing is stolen or disrupted, and the kubelet
refuses only the few pods bound before the first refusal or the empty allocatable was noticed.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulations.bench_random_replay import build, random_case
from simulations.replay.engine import (
    AgentOutage,
    ReplayError,
    ReplayResult,
    ReplaySettings,
    run_time_replay,
)
from simulations.replay.metrics import summarize

REPLAYS = settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
"""Each example is a whole replay (about a second): few examples, and the same ones every run."""


def _replay(
    case: int, pods: int, outages: tuple[AgentOutage, ...], policy: str = "cpsat"
) -> ReplayResult:
    workload, cluster = build(random_case(case, pods))
    return run_time_replay(workload, cluster, policy, ReplaySettings(outages=outages))


def _slice_units(case: int, pods: int, node: str) -> int:
    """The most slice units a node can advertise at once (seven 1g per GPU)."""
    _, cluster = build(random_case(case, pods))
    return 7 * next(n.gpus for n in cluster.nodes if n.name == node)


def test_an_outage_stops_applies_and_status_and_the_node_is_left_alone() -> None:
    # case 14: two nodes of 8 GPUs, one-GPU pods at load 0.9 (a queue forms)
    outage = (AgentOutage("n0", 2000, 6000),)
    base = summarize(_replay(14, 300, ())).as_dict()
    hit = _replay(14, 300, outage)
    s = summarize(hit).as_dict()
    assert (s["never_scheduled"], s["theft"], s["pods_disrupted"]) == (0, 0, 0)
    assert s["pending_mean_s"] > base["pending_mean_s"]  # half the cluster was gone a while
    assert s["admission_rejections"] <= _slice_units(14, 300, "n0")
    # the partitioner saw it, and told it once per change of its node condition (written to the
    # node, as in production), not once per step
    assert 1 <= hit.events.get("DevicePluginGone", 0) <= 6
    nos = summarize(_replay(14, 300, outage, "greedy")).as_dict()
    assert nos["never_scheduled"] == 0 and nos["pending_mean_s"] > base["pending_mean_s"]


@REPLAYS
@given(
    case=st.integers(0, 199),
    node=st.integers(0, 3),
    start=st.floats(0, 3000),
    length=st.floats(60, 5000),
    again=st.booleans(),
)
def test_every_pod_runs_after_any_outage_and_few_are_refused(
    case: int, node: int, start: float, length: float, again: bool
) -> None:
    pods = 80
    spec = random_case(case, pods)
    name = f"n{node % spec.nodes}"
    outages = [AgentOutage(name, start, start + length)]
    if again:  # the agent crash-loops: down again soon after it came back
        outages.append(AgentOutage(name, start + length + 30, start + 2 * length + 30))
    result = _replay(case, pods, tuple(outages))
    s = summarize(result).as_dict()
    assert s["never_scheduled"] == 0, result.planner_errors
    assert s["theft"] == 0 and s["pods_disrupted"] == 0
    # refused: pods bound before kube-scheduler saw the empty allocatable, per stop
    assert s["admission_rejections"] <= len(outages) * _slice_units(case, pods, name)


def test_outages_are_checked() -> None:
    with pytest.raises(ReplayError, match="give a node name"):
        AgentOutage("n0", 10, 5)
    with pytest.raises(ReplayError, match="overlap"):
        ReplaySettings(outages=(AgentOutage("n0", 0, 100), AgentOutage("n0", 50, 150)))
    with pytest.raises(ReplayError, match="NODE:START:END"):
        AgentOutage.parse("n0:later")
    with pytest.raises(ReplayError, match="agent_lease_s must be >= 0"):
        ReplaySettings(agent_lease_s=-1)
    assert AgentOutage.parse("gpu-node:1:60") == AgentOutage("gpu-node", 1.0, 60.0)
    workload, cluster = build(random_case(3, 20))
    with pytest.raises(ReplayError, match=r"has no node ghost \(its nodes: n0, n1"):
        run_time_replay(
            workload, cluster, "cpsat", ReplaySettings(outages=(AgentOutage("ghost", 0, 10),))
        )


def test_a_stopped_agents_lease_spares_its_planned_pods_the_apply_deadline() -> None:
    """Case 7, 120 pods: n0's agent stops at 1,000 s with a spec in flight there (nothing the
    kubelet lists shows it yet).  With the heartbeat Lease the partitioner finds the agent
    silent 50 s later and plans those pods elsewhere; without it they wait for the apply
    deadline and the node misses it."""
    workload, cluster = build(random_case(7, 120))
    outage = (AgentOutage("n0", 1000, 4000),)
    runs = {
        lease: run_time_replay(
            workload, cluster, "cpsat", ReplaySettings(outages=outage, agent_lease_s=lease)
        )
        for lease in (40.0, 0.0)
    }
    assert runs[40.0].events.get("AgentSilent", 0) >= 1
    assert runs[40.0].events.get("ApplyDeadlineMissed", 0) == 0
    assert runs[0.0].events.get("ApplyDeadlineMissed", 0) >= 1
    assert "AgentSilent" not in runs[0.0].events
    for result in runs.values():
        s = summarize(result).as_dict()
        assert (s["never_scheduled"], s["theft"], s["pods_disrupted"]) == (0, 0, 0)


def test_the_kubelet_lists_nothing_from_its_next_sync_after_each_stop() -> None:
    """A crash loop: down at 1000, up at 1100, down again at 1200.  The kubelet marks a stopped
    plugin's devices unhealthy at once, so each stop empties the node's allocatable at its next
    status sync (10 s period), and each start fills it again at the sync after it."""
    workload, cluster = build(random_case(14, 40))
    changes: list[tuple[float, bool, float]] = []
    import simulations.replay.engine as engine

    class Watch(engine._Engine):
        def _handle(self, t: float, kind: engine._Kind, payload: str) -> None:
            before = bool(self.index.nodes["n0"].allocatable)
            super()._handle(t, kind, payload)
            after = bool(self.index.nodes["n0"].allocatable)
            if after != before:
                changes.append((t, after, self.kubelet.next_sync("n0", t - 10 + 1e-6)))

    outages = (AgentOutage("n0", 1000, 1100), AgentOutage("n0", 1200, 2000))
    original = engine._Engine
    engine._Engine = Watch  # type: ignore[misc]
    try:
        run_time_replay(workload, cluster, "cpsat", ReplaySettings(outages=outages))
    finally:
        engine._Engine = original  # type: ignore[misc]
    around = [(t, listed) for t, listed, _ in changes if 1000 <= t <= 2010]
    assert [listed for _, listed in around] == [False, True, False, True]
    for (t, _), stop in zip(around, (1000, 1100, 1200, 2000), strict=True):
        assert stop < t <= stop + 10  # the first status sync after the stop or start
    assert all(t == sync for t, _, sync in changes)  # only ever at a status sync


# -- the partitioner itself down, or restarting ------------------------------------------------


@REPLAYS
@given(
    case=st.integers(0, 199),
    restarts=st.lists(st.floats(0, 8000), min_size=1, max_size=3, unique=True),
)
def test_a_restarted_partitioner_keeps_every_promise(case: int, restarts: list[float]) -> None:
    """Restarts (down for 10 ms: no pod is created meanwhile, so every pod is gated) lose the
    batch window, Events and cool-downs, never a reservation: nothing is stolen."""
    workload, cluster = build(random_case(case, 80))
    windows = tuple((t, t + 0.01) for t in sorted(restarts))
    result = run_time_replay(
        workload, cluster, "cpsat", ReplaySettings(partitioner_outages=windows)
    )
    s = summarize(result).as_dict()
    assert (s["never_scheduled"], s["theft"], s["pods_disrupted"]) == (0, 0, 0)
    assert not result.planner_errors


@REPLAYS
@given(
    case=st.integers(0, 199),
    start=st.floats(0, 3000),
    length=st.floats(1, 4000),
)
def test_every_pod_runs_after_the_partitioner_was_down(
    case: int, start: float, length: float
) -> None:
    """While the partitioner is down its webhook is too: pods created then are not gated and
    kube-scheduler may bind them onto slices promised to gated pods (theft, as documented for a
    webhook outage); still every pod runs and nothing is disrupted."""
    workload, cluster = build(random_case(case, 80))
    settings_ = ReplaySettings(partitioner_outages=((start, start + length),))
    result = run_time_replay(workload, cluster, "cpsat", settings_)
    s = summarize(result).as_dict()
    assert s["never_scheduled"] == 0 and s["pods_disrupted"] == 0
    assert not result.planner_errors


def test_partitioner_outages_are_checked() -> None:
    with pytest.raises(ReplayError, match="partitioner outages"):
        ReplaySettings(partitioner_outages=((100.0, 50.0),))
    with pytest.raises(ReplayError, match="not overlapping"):
        ReplaySettings(partitioner_outages=((0.0, 100.0), (50.0, 150.0)))


@pytest.mark.parametrize(
    "settings_",
    [
        ReplaySettings(partitioner_outages=((1722.0, 3480.0),)),
        ReplaySettings(outages=(AgentOutage("n0", 100, 9000), AgentOutage("n1", 100, 9000))),
    ],
    ids=["partitioner", "every agent"],
)
def test_an_outage_longer_than_any_deadline_does_not_end_the_run(
    settings_: ReplaySettings,
) -> None:
    """Nothing moves during a long enough outage (longer than every window, deadline and drain
    wait together): the replay must still go on when it ends, not count the waiting pods as
    never scheduled (found by hypothesis: case 82, 16 pods)."""
    workload, cluster = build(random_case(82, 80))
    s = summarize(run_time_replay(workload, cluster, "cpsat", settings_)).as_dict()
    assert s["never_scheduled"] == 0 and s["pods_disrupted"] == 0


# -- a released pod whose node stops accepting it before it binds -------------------------------


def _cordon_at_first_release(
    after: float,
    settings: ReplaySettings,
    case: int = 14,
    pods: int = 120,
    uncordon_after: float | None = None,
    when: str = "release",
) -> tuple[ReplayResult, str | None]:
    """Case 14 by default (two nodes of 8 GPUs); the first pod released after ``after`` s
    finds its node cordoned before kube-scheduler tries it (an admin's ``kubectl cordon`` at an
    unlucky moment); the node is uncordoned ``uncordon_after`` s later (None: never).  With
    ``when="reserve"`` the node is cordoned as soon as a pod is reserved there instead (planned,
    still gated).  Returns the replay and that pod's name (None if no pod was released, or
    reserved, after ``after``)."""
    import simulations.replay.engine as engine

    workload, cluster = build(random_case(case, pods))
    caught: list[str] = []
    cordoned: list[tuple[str, float]] = []

    def cordon(self: engine._Engine, name: str, on: bool) -> None:
        node = self.api.nodes[name]
        node["spec"] = (
            {
                "unschedulable": True,
                "taints": [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}],
            }
            if on
            else {}
        )
        self.api._stamp(node)
        self.index.upsert_node(node)

    class Cordon(engine._Engine):
        def _patch_pod(self, t: float, action: engine.PatchPod) -> bool:
            done = super()._patch_pod(t, action)
            if done and action.purpose == when and t >= after and not caught:
                node_name = self.index.pods[action.pod].reservation.node  # type: ignore[union-attr]
                cordon(self, node_name, True)
                caught.append(action.pod.split("/", 1)[1])
                cordoned.append((node_name, t))
            return done

        def _handle(self, t: float, kind: engine._Kind, payload: str) -> None:
            if cordoned and uncordon_after is not None and t >= cordoned[0][1] + uncordon_after:
                cordon(self, cordoned.pop()[0], False)
                self._dirty(t)
                self._wake("schedule_at", t, engine._Kind.SCHEDULE)
            super()._handle(t, kind, payload)

    original = engine._Engine
    engine._Engine = Cordon  # type: ignore[misc]
    try:
        result = run_time_replay(workload, cluster, "cpsat", settings)
    finally:
        engine._Engine = original  # type: ignore[misc]
    return result, caught[0] if caught else None


def test_a_pod_stranded_on_a_cordoned_node_is_evicted_and_runs_elsewhere() -> None:
    result, name = _cordon_at_first_release(500, ReplaySettings())
    assert name is not None
    (rec,) = [p for p in result.pods if p.name == name]
    s = summarize(result).as_dict()
    assert (s["never_scheduled"], s["theft"], s["pods_disrupted"]) == (0, 0, 0)
    assert result.events.get("Stranded", 0) >= 1 and result.events["StrandedEvicted"] >= 1
    assert rec.first_bound is not None
    # the cordon strands it at the partitioner's next step, the eviction comes 600 s later,
    # then its Job creates it again and the new pod waits for its own slice on the other node
    assert rec.pending_s >= 600


def test_without_the_eviction_the_stranded_pod_never_runs() -> None:
    result, name = _cordon_at_first_release(500, ReplaySettings(recreate_stranded_s=0))
    assert name is not None
    (rec,) = [p for p in result.pods if p.name == name]
    assert rec.first_bound is None and "StrandedEvicted" not in result.events
    assert summarize(result).as_dict()["never_scheduled"] >= 1


@REPLAYS
@given(
    case=st.integers(0, 199),
    after=st.floats(0, 3000),
    uncordon=st.one_of(st.none(), st.floats(1, 3000)),
    when=st.sampled_from(["reserve", "release"]),
)
def test_every_pod_runs_whenever_its_node_is_cordoned_after_its_plan_or_release(
    case: int, after: float, uncordon: float | None, when: str
) -> None:
    """A plan is a promise: a pod whose node is cordoned once it is reserved there (planned on
    it, still gated) or between its release and its binding, for a while or for good, still
    runs: planned elsewhere while it is gated; once released, there if the node is uncordoned in
    time, else as the new pod its controller creates after the eviction.  Nothing is stolen or
    disrupted."""
    result, name = _cordon_at_first_release(
        after, ReplaySettings(), case=case, pods=80, uncordon_after=uncordon, when=when
    )
    s = summarize(result).as_dict()
    assert (s["never_scheduled"], s["theft"], s["pods_disrupted"]) == (0, 0, 0)
    if name is not None:  # else no pod was released after ``after``: nothing was cordoned
        (rec,) = [p for p in result.pods if p.name == name]
        assert rec.first_bound is not None


@pytest.mark.parametrize("end", ["inf", "nan", "1e400", "1e9"])
def test_an_outage_that_would_never_end_is_refused(end: str) -> None:
    """An endless (or NaN) outage would keep the replay's periodic events going for ever."""
    with pytest.raises(ReplayError, match=r"end <= 1e\+08"):
        AgentOutage.parse(f"n0:0:{end}")
    with pytest.raises(ReplayError, match=r"end <= 1e\+08"):
        ReplaySettings(partitioner_outages=((0.0, float(end)),))
