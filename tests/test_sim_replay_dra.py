"""The time replay's DRA mode (simulations/replay/dra.py, policy ``dra``).

Checked: a hand-computed first-fit timeline (placements in the published order, counters,
prepare time in the pending time, instances destroyed at unprepare); a whole-node claim waits
while first-fit keeps landing small claims; every allocation the model makes on a random
workload is a valid MIG layout per the facts oracle (tests/mig_facts.py), written from
shared/facts/mig.md independently of the counters; the model reads the production
ResourceSlices; non-MIG clusters are refused.
"""

from __future__ import annotations

from typing import Any

import pytest
from mig_facts import layout_ok

from planner.settings import PlannerSettings
from planner.snapshot import Mode
from simulations.inputs.cluster import Cluster
from simulations.inputs.workload import Pod, PodShape, Workload
from simulations.replay import dra as dra_module
from simulations.replay.dra import DraPools
from simulations.replay.engine import ReplayError, ReplayPod, ReplaySettings, run_time_replay
from simulations.replay.fake_cluster import FakeCluster
from simulations.replay.metrics import summarize
from tests.replay_workloads import mig_workload

A100 = "A100-SXM4-80GB"
EMPTY = Workload("none", (Pod("unused", 0),))


def pod(name: str, profile: str, arrival: float, duration: float, k: int = 1) -> ReplayPod:
    return ReplayPod(name, {f"nvidia.com/mig-{profile}": k}, arrival, duration)


def small_mix() -> tuple[Workload, Cluster]:
    """300 pods of 4g..7g-sized shares arriving every 5 s on two 2-GPU A100 MIG nodes."""
    mix = (
        PodShape(4, 1000, 1024, 1, 120),
        PodShape(3, 1000, 1024, 1, 300),
        PodShape(2, 1000, 1024, 1, 450),
        PodShape(1, 1000, 1024, 1, 1000),
    )
    return mig_workload("small", mix, count=300, rate_per_s=1 / 5, mean_duration_s=900, seed=4)


def test_first_fit_timeline_is_hand_computed() -> None:
    # one GPU; published order: whole GPU, then placements by size: 1g.10gb s0..s6, ...
    # a (3g) takes s0, b (4g, start 0 only) cannot fit beside it until a ends at 5 + 100;
    # c (1g) lands on the first free slot, s4 (3g at s0 holds slots 0-3)
    pods = [pod("a", "3g.40gb", 0, 100), pod("b", "4g.40gb", 10, 50), pod("c", "1g.10gb", 20, 30)]
    fake = FakeCluster([FakeCluster.node("n0", A100, 1)])
    r = run_time_replay(EMPTY, fake, "dra", ReplaySettings(apply_delay_s=5), pods=pods)
    rec = {p.name: p for p in r.pods}
    assert rec["a"].first_bound == 0 and rec["a"].pending_s == 5  # prepare
    assert rec["c"].first_bound == 20 and rec["c"].pending_s == 5
    # a departs at 105: unprepare frees slots 0-3 and b (backed off) is retried then
    assert rec["b"].first_bound is not None and rec["b"].first_bound >= 105
    assert rec["b"].pending_s == pytest.approx(rec["b"].first_bound + 5 - 10)
    s = summarize(r)
    assert s.never_scheduled == 0 and s.pods_disrupted == 0 and r.theft == 0
    assert s.gpus_reconfigured == 6  # three prepares, three unprepares, one GPU each
    # a pod is unbound from 10 to b's allocation (a prepared claim's pod is bound); the GPU
    # holds a claim throughout but from a's end (105) to b's allocation
    b = rec["b"].first_bound  # its allocation (its wait goes on through prepare)
    assert s.waiting_span_s == pytest.approx(b - 10)
    assert s.idle_gpus_while_waiting * s.waiting_span_s == pytest.approx(b - 105)


def test_first_fit_devices_follow_the_published_order() -> None:
    fake = FakeCluster([FakeCluster.node("n0", A100, 2)])
    pools = DraPools(fake)
    got = pools.fit("n0", {"nvidia.com/mig-1g.10gb": 3})
    assert got is not None and [d.name for d in got] == [
        "gpu0-1g-10gb-s0",
        "gpu0-1g-10gb-s1",
        "gpu0-1g-10gb-s2",
    ]
    pools.allocate("n0", "p", got)
    big = pools.fit("n0", {"nvidia.com/mig-4g.40gb": 1})
    assert big is not None and [d.name for d in big] == ["gpu1-4g-40gb-s0"]  # gpu0's slot 0 is held
    assert pools.fit("n0", {"nvidia.com/mig-7g.80gb": 2}) is None
    pools.release("p")
    assert pools.fit("n0", {"nvidia.com/mig-7g.80gb": 2}) is not None
    assert pools.used_compute() == 0


def test_every_allocation_is_a_valid_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = 0
    allocate = DraPools.allocate

    def checking(self: DraPools, node: str, pod_name: str, devices: Any) -> None:
        nonlocal checked
        allocate(self, node, pod_name, devices)
        pool = self.pools[node]
        by_gpu: dict[int, list[tuple[str, int]]] = {}
        for d in pool.devices:
            if d.name in pool.held and d.profile is not None:
                by_gpu.setdefault(d.gpu, []).append((d.profile, int(d.name.rsplit("-s", 1)[1])))
        for placements in by_gpu.values():
            assert layout_ok(A100, placements), placements
            checked += 1

    monkeypatch.setattr(dra_module.DraPools, "allocate", checking)
    wl, cluster = small_mix()
    r = run_time_replay(wl, cluster, "dra", ReplaySettings(planner=PlannerSettings()))
    s = summarize(r)
    assert s.pods == 300 and s.never_scheduled == 0 and s.pods_disrupted == 0
    assert checked > 300
    assert 0 < s.allocation_mean <= 1


def test_dra_needs_mig_nodes() -> None:
    fake = FakeCluster([FakeCluster.node("n0", A100, 1, mode=Mode.MPS)])
    with pytest.raises(ReplayError, match="not MIG nodes"):
        run_time_replay(EMPTY, fake, "dra", pods=[pod("a", "1g.10gb", 0, 1)])


# ----------------------------------------------------------------------------- planner-shaped


def test_shaped_publishing_plans_the_claim_and_a_later_claim_adopts_the_kept_instance() -> None:
    # a (3g) arrives at 0: gated at admission, planned at the window's end; the agent creates
    # the instance and publishes it (apply_delay_s), a is released, prepare adopts the instance,
    # a runs 100 s; unprepare keeps the instance (the spec lists it); b (3g) at 300 is reserved
    # from the free slice at once and adopts it too: no wait beyond the partitioner's cycle.
    settings = ReplaySettings(apply_delay_s=5, batch_timeout_s=20, batch_idle_s=5, cycle_s=1)
    pods = [pod("a", "3g.40gb", 0, 100), pod("b", "3g.40gb", 300, 50)]
    fake = FakeCluster([FakeCluster.node("n0", A100, 1)])
    r = run_time_replay(EMPTY, fake, "dra-shaped", settings, pods=pods)
    rec = {p.name: p for p in r.pods}
    assert rec["a"].first_bound is not None and 5 <= rec["a"].first_bound <= 30
    assert rec["a"].pending_s == pytest.approx(rec["a"].first_bound)  # nothing left to create
    assert rec["b"].pending_s <= 2 and rec["b"].first_bound is not None
    s = summarize(r)
    assert s.never_scheduled == 0 and s.pods_disrupted == 0 and r.theft == 0
    assert s.gpus_reconfigured == 1  # the spec applied once; the instance kept at both unprepares
    assert not r.planner_errors
    everything = run_time_replay(
        EMPTY, FakeCluster([FakeCluster.node("n0", A100, 1)]), "dra", settings, pods=pods
    )
    assert summarize(everything).gpus_reconfigured == 4


def test_shaped_reports_valid_layouts_and_reconfigures_less_than_publishing_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reports = 0
    status_gpus = DraPools.status_gpus

    def checking(self: DraPools, node: str, gpu_count: int) -> list[dict[str, Any]]:
        nonlocal reports
        out = status_gpus(self, node, gpu_count)
        for g in out:
            assert layout_ok(A100, [(m["profile"], m["start"]) for m in g["mig"]]), g
            used = {(m["profile"], m["start"]) for m in g["mig"] if m["used"]}
            held = {
                (d.profile, d.start)
                for d in self.pools[node].devices
                if d.gpu == g["index"] and d.name in self.pools[node].held
            }
            assert used == held  # every allocated device is reported, as used
        reports += 1
        return out

    monkeypatch.setattr(dra_module.DraPools, "status_gpus", checking)
    wl, cluster = small_mix()
    settings = ReplaySettings(planner=PlannerSettings())
    shaped = summarize(run_time_replay(wl, cluster, "dra-shaped", settings))
    everything = summarize(run_time_replay(wl, small_mix()[1], "dra", settings))
    assert shaped.pods == everything.pods == 300
    assert shaped.never_scheduled == 0 and shaped.pods_disrupted == 0
    assert reports > 50
    assert shaped.gpus_reconfigured < everything.gpus_reconfigured / 2
