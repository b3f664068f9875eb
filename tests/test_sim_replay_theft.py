"""Time replay theft accounting: a slice made for one pod counts as stolen only when another
pod's bind leaves the node unable to give it one (engine ``_account_theft``)."""

from __future__ import annotations

import pytest

from planner.snapshot import PlannedGpu
from simulations.inputs.workload import Pod, Workload
from simulations.replay.engine import ReplayPod, ReplaySettings, run_time_replay
from simulations.replay.fake_cluster import FakeCluster
from simulations.replay.metrics import ReplayResult

A100 = "A100-SXM4-80GB"
# The scenarios rely on a requeued pod waiting out its backoff (the queue before
# SchedulerPopFromBackoffQ, Kubernetes 1.33): theft needs a window to happen in.
EMPTY = Workload("none", (Pod("unused", 0),))


def cluster() -> FakeCluster:
    """GPU 0 one 7g instance, GPU 1 empty, GPU 2 seven 1g instances."""
    fake = FakeCluster([FakeCluster.node("n0", A100, 3)])
    fake.set_layout("n0", 0, PlannedGpu("n0", 0, mig=(("7g.80gb", 0),)))
    fake.set_layout("n0", 2, PlannedGpu("n0", 2, mig=tuple(("1g.10gb", s) for s in range(7))))
    return fake


def pod(name: str, profile: str, arrival: float, duration: float) -> ReplayPod:
    return ReplayPod(name, {f"nvidia.com/mig-{profile}": 1}, arrival, duration)


def pods(d_end: float, e_end: float, b_at: float) -> list[ReplayPod]:
    """D holds GPU 0's 7g until ``d_end``; E a 1g of GPU 2 until ``e_end`` (its end requeues
    A, which backs off); A waits for a 7g from t=20, and greedy makes GPU 1 a 7g for it (spec
    at 30, applied at 35); B asks for a 7g at ``b_at``."""
    return [
        pod("D", "7g.80gb", 0, d_end),
        pod("E", "1g.10gb", 0, e_end),
        pod("A", "7g.80gb", 20, 100),
        pod("B", "7g.80gb", b_at, 100),
    ]


def first_bound(r: ReplayResult) -> dict[str, float | None]:
    return {p.name: p.first_bound for p in r.pods}


def test_binding_a_pre_existing_free_instance_is_no_theft() -> None:
    # D ends at 32 as B arrives: B binds GPU 0's old 7g while A is in backoff; the 7g made
    # on GPU 1 for A (spec in flight) still goes to A at 37.
    r = run_time_replay(EMPTY, cluster(), "greedy", ReplaySettings(pop_from_backoff=False), pods=pods(32, 31, 32))
    bound = first_bound(r)
    assert bound["B"] == 32 and bound["A"] == pytest.approx(37.0)
    assert r.reconfigurations == [(35.0, 1)]  # one 7g made, and A got it
    assert r.theft == 0


def test_binding_the_instance_made_for_another_pod_is_theft() -> None:
    # D holds GPU 0's 7g for long; B arrives at 35.5, after GPU 1's 7g made for A appeared,
    # while A backs off, and binds it: A is left without one and waits for another layout.
    r = run_time_replay(EMPTY, cluster(), "greedy", ReplaySettings(pop_from_backoff=False), pods=pods(500, 34, 35.5))
    bound = first_bound(r)
    assert bound["B"] == 35.5
    assert bound["A"] is not None and bound["A"] > 50
    assert r.theft == 1


def two_waiting() -> list[ReplayPod]:
    """D holds GPU 0 for long, E a 1g of GPU 2 until 44; A0 and A1 wait for a 3g from t=20:
    greedy makes GPU 1 two 3g for them (applied at 45); B asks for a 3g at 45.5, while both
    back off."""
    return [
        pod("D", "7g.80gb", 0, 500),
        pod("E", "1g.10gb", 0, 44),
        pod("A0", "3g.40gb", 20, 100),
        pod("A1", "3g.40gb", 20.1, 100),
        pod("B", "3g.40gb", 45.5, 100),
    ]


def test_a_robbed_pod_binding_the_other_instance_is_not_a_second_theft() -> None:
    # B binds one of the two 3g made for A0 and A1 (one theft: A0's, the oldest, is dropped);
    # A0 then binds the other at 46, which leaves A1 short: still that one theft, not a second
    r = run_time_replay(EMPTY, cluster(), "greedy", ReplaySettings(pop_from_backoff=False), pods=two_waiting())
    bound = first_bound(r)
    assert bound["B"] == 45.5 and bound["A0"] == pytest.approx(46.0)
    assert bound["A1"] is not None and bound["A1"] > 50  # waited for another layout
    assert r.theft == 1


@pytest.mark.parametrize("case", [(32, 31, 32), (500, 34, 35.5), None])
def test_gated_cpsat_steals_nothing(case: tuple[float, float, float] | None) -> None:
    replayed = two_waiting() if case is None else pods(*case)
    r = run_time_replay(EMPTY, cluster(), "cpsat", ReplaySettings(pop_from_backoff=False), pods=replayed)
    assert r.theft == 0 and r.disruptions == 0


def test_to_create_counts_a_spec_in_flight() -> None:
    fake = cluster()
    assert fake.to_create("n0", "nvidia.com/mig-7g.80gb") == 0
    fake.write_spec("n0", [PlannedGpu("n0", 1, mig=(("7g.80gb", 0),))], apply_at=5.0)
    assert fake.to_create("n0", "nvidia.com/mig-7g.80gb") == 1
    assert fake.to_create("n0", "nvidia.com/mig-1g.10gb") == 0
    fake.apply_spec("n0")
    assert fake.to_create("n0", "nvidia.com/mig-7g.80gb") == 0
    assert fake.free_on("n0", "nvidia.com/mig-7g.80gb") == 2


def test_an_idle_scheduler_pops_its_backoff_queue() -> None:
    """Kubernetes >= 1.33 (SchedulerPopFromBackoffQ, on by default): a pod requeued while it
    still backs off is tried at once when nothing else is queued, so A binds GPU 1's new 7g
    at the node's status sync that shows it (35.37 s), not when its backoff ends (37 s)."""
    r = run_time_replay(EMPTY, cluster(), "greedy", ReplaySettings(), pods=pods(32, 31, 32))
    bound = first_bound(r)
    assert bound["B"] == 32
    assert bound["A"] is not None and 35 < bound["A"] < 37
    assert r.theft == 0


def test_a_jobs_failed_pods_are_replaced_after_its_backoff() -> None:
    """The Job controller replaces the k-th failed pod of a Job 10 s x 2^(k-1) later (at most
    10 min, its MaxJobPodFailureBackOff; 6 min came from older docs), plus the controller's
    round trip; 0 turns the backoff off."""
    from simulations.replay.engine import ReplayError, replacement_delay

    s = ReplaySettings()
    assert [replacement_delay(s, k) for k in (1, 2, 3, 6, 7, 40)] == [
        11.0, 21.0, 41.0, 321.0, 601.0, 601.0
    ]  # fmt: skip
    assert replacement_delay(ReplaySettings(job_backoff_s=0), 5) == 1.0
    with pytest.raises(ReplayError, match="job_backoff_s"):
        ReplaySettings(job_backoff_s=-1)
