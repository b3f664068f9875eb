"""DRA agent outages in the time replay (policy ``dra-shaped``).

While a DRA node's agent is down its plugin is gone: the kubelet deletes the node's
ResourceSlices 30 s later (nothing more is allocated there), cannot prepare the claims of pods
bound there meanwhile (they stay ``Pending``) and cannot unprepare the claims of pods whose
containers ended (they hold their devices and stay bound: the kubelet unprepares before a pod
may end).  The partitioner finds the agent silent by its Lease, plans elsewhere, strands the
bound pods that cannot start and evicts them after ``recreate_stranded_s``.  When the agent is
back it publishes again, the ended pods end and the bound ones start.  Checked on hand-built
timelines and, for any outage, on random workloads: every pod runs, nothing is stolen or
disrupted.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from simulations.bench_random_replay import build, random_case
from simulations.inputs.workload import Pod, Workload
from simulations.replay.engine import (
    AgentOutage,
    ReplayError,
    ReplayPod,
    ReplayResult,
    ReplaySettings,
    run_time_replay,
)
from simulations.replay.fake_cluster import FakeCluster
from simulations.replay.metrics import summarize

A100 = "A100-SXM4-80GB"
EMPTY = Workload("none", (Pod("unused", 0),))
QUICK = {"apply_delay_s": 5, "batch_timeout_s": 20, "batch_idle_s": 5, "cycle_s": 1}


def pod(name: str, profile: str, arrival: float, duration: float) -> ReplayPod:
    return ReplayPod(name, {f"nvidia.com/mig-{profile}": 1}, arrival, duration)


def two_nodes() -> FakeCluster:
    return FakeCluster([FakeCluster.node("n0", A100, 1), FakeCluster.node("n1", A100, 1)])


def run(pods: list[ReplayPod], outage: AgentOutage, cluster: FakeCluster) -> ReplayResult:
    return run_time_replay(
        EMPTY, cluster, "dra-shaped", ReplaySettings(outages=(outage,), **QUICK), pods=pods
    )


def bound_during_the_outage(end: float, arrives: float = 1010) -> ReplayResult:
    """``c`` (7g) fills n0 for 100,000 s, so ``a`` (3g) runs on n1, and its instance is kept
    (the spec lists it); n1's agent stops at 1,000 s and ``b`` (3g) arrives at 1,010 s: the
    partitioner, which has not found the agent silent yet, releases ``b`` to n1's free
    instance, kube-scheduler allocates it (the slices are still there) and binds ``b`` there;
    the kubelet cannot prepare its claim."""
    pods = [
        pod("c", "7g.80gb", 0, 100_000),
        pod("a", "3g.40gb", 60, 100),
        pod("b", "3g.40gb", arrives, 100),
    ]
    return run(pods, AgentOutage("n1", 1000, end), two_nodes())


def test_a_pod_bound_before_the_slices_are_wiped_starts_once_the_agent_is_back() -> None:
    r = bound_during_the_outage(end=1300)
    rec = {p.name: p for p in r.pods}
    assert rec["b"].first_bound is not None and 1010 <= rec["b"].first_bound < 1040
    assert 290 - 5 <= rec["b"].pending_s <= 300  # it started when the agent was back (1,300 s)
    assert r.events.get("Stranded") == 1 and not r.events.get("StrandedEvicted")
    s = summarize(r)
    assert (s.never_scheduled, s.pods_disrupted, r.theft) == (0, 0, 0)


def test_a_pod_released_after_the_slices_are_wiped_is_allocated_once_the_agent_is_back() -> None:
    """``b`` arrives at 1,040 s: the slices went at 1,030 s, the partitioner finds the agent
    silent only at 1,050 s, so it releases ``b`` to n1, but nothing there can be allocated:
    ``b`` is bound when the agent publishes again (1,300 s), not before."""
    r = bound_during_the_outage(end=1300, arrives=1040)
    rec = {p.name: p for p in r.pods}
    assert rec["b"].first_bound is not None and rec["b"].first_bound >= 1300
    s = summarize(r)
    assert (s.never_scheduled, s.pods_disrupted, r.theft) == (0, 0, 0)


def test_a_pod_bound_there_is_evicted_after_the_setting_and_runs_once_recreated() -> None:
    r = bound_during_the_outage(end=20_000)
    rec = {p.name: p for p in r.pods}
    assert r.events.get("StrandedEvicted") == 1
    # found silent (40 s Lease + 10 s listing), stranded 600 s, recreated 30 s later; the
    # only other node is full for 100,000 s, so it waits for n1's agent, then starts there
    assert rec["b"].pending_s >= 20_000 - 1010
    s = summarize(r)
    assert (s.never_scheduled, s.pods_disrupted, r.theft) == (0, 0, 0)


def test_a_pod_that_ends_during_the_outage_holds_its_instance_until_the_agent_is_back() -> None:
    """``a`` (7g) runs on n0 from 10 s to 510 s (``b``, 7g, waits for it from 100 s and without
    an outage is bound at 510 s); n0's agent stops at 500 s.  ``a``'s containers end at 510 s,
    before the kubelet deletes the slices (530 s), but the kubelet cannot unprepare its claim,
    so ``a`` stays bound and holds the GPU until the agent is back at 2,000 s: ``b`` is not
    bound there meanwhile (it would be, at 510 s, if ``a`` simply ended)."""
    pods = [pod("a", "7g.80gb", 0, 500), pod("b", "7g.80gb", 100, 100)]
    one = FakeCluster([FakeCluster.node("n0", A100, 1)])
    calm = {
        p.name: p
        for p in run_time_replay(EMPTY, one, "dra-shaped", ReplaySettings(**QUICK), pods=pods).pods
    }
    assert (calm["a"].first_bound, calm["b"].first_bound) == (10, 510)
    one = FakeCluster([FakeCluster.node("n0", A100, 1)])
    r = run(pods, AgentOutage("n0", 500, 2000), one)
    rec = {p.name: p for p in r.pods}
    assert rec["b"].first_bound is not None and rec["b"].first_bound >= 2000
    assert not r.events.get("Stranded")  # never bound there while the agent was down
    s = summarize(r)
    assert (s.never_scheduled, s.pods_disrupted, r.theft) == (0, 0, 0)


def test_publishing_everything_still_refuses_outages() -> None:
    import pytest

    with pytest.raises(ReplayError, match="publishing everything"):
        run_time_replay(
            EMPTY,
            two_nodes(),
            "dra",
            ReplaySettings(outages=(AgentOutage("n0", 10, 20),)),
            pods=[pod("a", "3g.40gb", 0, 10)],
        )


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
    case=st.integers(0, 199),
    node=st.integers(0, 3),
    start=st.floats(0, 3000),
    length=st.floats(20, 5000),
)
def test_every_pod_runs_after_any_dra_agent_outage(
    case: int, node: int, start: float, length: float
) -> None:
    spec = random_case(case, 60)
    workload, cluster = build(spec)
    outage = AgentOutage(f"n{node % spec.nodes}", start, start + length)
    r = run_time_replay(workload, cluster, "dra-shaped", ReplaySettings(outages=(outage,)))
    s = summarize(r).as_dict()
    assert s["never_scheduled"] == 0, r.planner_errors
    assert s["theft"] == 0 and s["pods_disrupted"] == 0
