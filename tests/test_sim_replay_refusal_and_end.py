"""Time replay fidelity: the kubelet refuses what the agent's ``Allocate`` refuses (MPS slices
of two daemons in one container), and the replay runs on after the last event that may let a
waiting pod in (a departure, an arrival), not only after the last bind."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from planner.snapshot import Mode, PlannedGpu, PlannedSlice
from simulations.inputs.workload import Pod, Workload
from simulations.replay.engine import ReplayPod, ReplaySettings, run_time_replay
from simulations.replay.fake_cluster import FakeCluster
from simulations.replay.kube import SimApi
from simulations.replay.metrics import summarize

A100 = "A100-SXM4-80GB"
EMPTY = Workload("none", (Pod("unused", 0),))
GIB = 1024


def _statuses(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every pod status the replay's kubelet writes, in order."""
    seen: list[tuple[str, dict[str, Any]]] = []
    original = SimApi.set_pod_status

    def record(self: SimApi, key: str, status: Mapping[str, Any]) -> None:
        seen.append((key, dict(status)))
        original(self, key, status)

    monkeypatch.setattr(SimApi, "set_pod_status", record)
    return seen


def _mps(layouts: Mapping[int, tuple[int, ...]]) -> FakeCluster:
    """One MPS node of two A100s; GPU ``i`` holds slices of ``layouts[i]`` GiB."""
    fake = FakeCluster([FakeCluster.node("n0", A100, 2, Mode.MPS)])
    for gpu, sizes in layouts.items():
        slices = tuple(PlannedSlice(gb * GIB, 50) for gb in sizes)
        fake.set_layout("n0", gpu, PlannedGpu("n0", gpu, mps=slices))
    return fake


def _hybrid(hosts: Mapping[int, tuple[int, ...]]) -> FakeCluster:
    """One hybrid node of one A100: two 3g.40gb instances (starts 0 and 4), instance ``s``
    hosting slices of ``hosts[s]`` GiB (an instance not listed is a whole MIG device)."""
    fake = FakeCluster([FakeCluster.node("n0", A100, 1, Mode.HYBRID)])
    hosted = tuple(
        (start, tuple(PlannedSlice(gb * GIB, 100) for gb in sizes))
        for start, sizes in sorted(hosts.items())
    )
    layout = PlannedGpu("n0", 0, mig=(("3g.40gb", 0), ("3g.40gb", 4)), mig_mps=hosted)
    fake.set_layout("n0", 0, layout)
    return fake


# ------------------------------------------------------------- Allocate refuses two daemons


@pytest.mark.parametrize(
    ("fake", "request_gb"),
    [
        pytest.param(_mps({0: (40,), 1: (40,)}), 40, id="mps-two-gpus"),
        pytest.param(_hybrid({0: (10,), 4: (10,)}), 10, id="hybrid-two-instances"),
    ],
)
def test_mps_slices_of_two_daemons_are_refused_and_the_pod_is_never_scheduled(
    fake: FakeCluster, request_gb: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the node advertises two free slices, so kube-scheduler binds the pod (greedy: never
    # gated); the preferred allocation picks them, each on its own MPS daemon, and the
    # agent's Allocate refuses them: the pod fails, is created again, and is refused again
    # until the replay ends
    statuses = _statuses(monkeypatch)
    pods = [ReplayPod("two", {f"nvidia.com/gpu-{request_gb}gb": 2}, 0, 100)]
    horizon = ReplaySettings(horizon_s=10 * 3600.0)  # a run that would not end stops there
    r = run_time_replay(EMPTY, fake, "greedy", horizon, pods=pods)
    (rec,) = r.pods
    assert rec.first_bound is None and summarize(r).never_scheduled == 1
    assert not fake.bindings
    assert r.admission_rejections >= 2  # created again after its Job's backoff, refused again
    refusals = [s for key, s in statuses if key.endswith("/two")]
    assert len(refusals) == r.admission_rejections
    for s in refusals:
        assert (s["phase"], s["reason"]) == ("Failed", "UnexpectedAdmissionError")
        assert "code = InvalidArgument" in s["message"]
        assert "gives a container one MPS slice" in s["message"]
        assert "served by 2 MPS daemons" in s["message"]
    # the refused pod's re-creations are no progress: the run ends once nothing else can
    # change (the settle time after its arrival), long before the horizon
    assert r.end < 3600


@pytest.mark.parametrize(
    ("fake", "request_gb"),
    [
        pytest.param(_mps({0: (20, 20), 1: (40,)}), 20, id="mps-one-gpu"),
        pytest.param(_hybrid({0: (10, 10), 4: (10,)}), 10, id="hybrid-one-instance"),
    ],
)
def test_mps_slices_of_one_daemon_are_refused_too(
    fake: FakeCluster, request_gb: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the preferred allocation keeps the pod's slices on one GPU (one instance here), but the
    # agent gives a container one MPS slice (its daemon caps each client at one slice's
    # memory and threads: the second would be held for nothing), as production's Allocate
    # does since 2026-12-07 (node_agent.deviceplugin.more_than_one_mps_slice); before, the
    # replay admitted such a pod and production refused it
    statuses = _statuses(monkeypatch)
    pods = [ReplayPod("two", {f"nvidia.com/gpu-{request_gb}gb": 2}, 0, 100)]
    horizon = ReplaySettings(horizon_s=10 * 3600.0)
    r = run_time_replay(EMPTY, fake, "greedy", horizon, pods=pods)
    (rec,) = r.pods
    assert rec.first_bound is None and summarize(r).never_scheduled == 1
    assert r.admission_rejections >= 2
    refusals = [s for key, s in statuses if key.endswith("/two")]
    assert refusals and all("gives a container one MPS slice" in s["message"] for s in refusals)
    assert not any("MPS daemons" in s["message"] for s in refusals)  # one daemon here


# ------------------------------------------------------------------ when the replay ends


def _mig(name: str, profile: str, arrival: float, duration: float, k: int = 1) -> ReplayPod:
    return ReplayPod(name, {f"nvidia.com/mig-{profile}": k}, arrival, duration)


def test_a_pod_the_last_departure_makes_room_for_is_scheduled() -> None:
    # one GPU: "a" holds it (7g.80gb) from 25 s (its spec applied) to 10,025 s; "b" waits for
    # it, gated, with nothing bound for 10,000 s.  The departure is the last live event; the
    # partitioner releases "b" after the agent's report and the kubelet's sync.  A run ended
    # at the departure (nothing bound for longer than the settle time) would count "b"
    # never scheduled.
    fake = FakeCluster([FakeCluster.node("n0", A100, 1)])
    pods = [_mig("a", "7g.80gb", 0, 10_000), _mig("b", "7g.80gb", 1, 100)]
    r = run_time_replay(EMPTY, fake, "cpsat", pods=pods)
    rec = {p.name: p for p in r.pods}
    assert rec["a"].first_bound is not None
    departed = rec["a"].first_bound + 10_000
    assert rec["b"].first_bound is not None
    assert departed <= rec["b"].first_bound < departed + 300
    assert summarize(r).never_scheduled == 0
    assert r.end == pytest.approx(rec["b"].first_bound + 100)


@pytest.mark.parametrize("policy", ["cpsat", "greedy"])
def test_a_pod_arriving_after_a_long_wait_of_another_is_scheduled(policy: str) -> None:
    # "a" asks for two GPUs of a one-GPU cluster: it waits forever and nothing binds.  "c"
    # arrives at 5,000 s, the last live event, and fits: it must run, and only "a" is never
    # scheduled.
    fake = FakeCluster([FakeCluster.node("n0", A100, 1)])
    pods = [_mig("a", "7g.80gb", 0, 100, k=2), _mig("c", "7g.80gb", 5_000, 100)]
    r = run_time_replay(EMPTY, fake, policy, pods=pods)
    rec = {p.name: p for p in r.pods}
    assert rec["a"].first_bound is None
    assert rec["c"].first_bound is not None and 5_000 <= rec["c"].first_bound < 5_300
    assert summarize(r).never_scheduled == 1
