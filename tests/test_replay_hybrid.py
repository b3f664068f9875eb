"""Time replay on hybrid nodes (MPS slices inside MIG instances) and on mixed-model clusters."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from planner.api import plan
from planner.catalog import Catalog
from planner.settings import PlannerSettings
from planner.snapshot import Mode, Plan, PlannedGpu, PlannedSlice, Snapshot
from simulations.bench_replay import cluster_label, mig_cluster, render_table
from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.workload import Pod, PodShape, SyntheticSpec, Workload, synthetic_workload
from simulations.replay.engine import (
    ReplayError,
    ReplayPod,
    ReplayPolicy,
    ReplaySettings,
    build_fake_cluster,
    cluster_kinds,
    cluster_replay_pods,
    default_mapping,
    parse_policy,
    run_time_replay,
)
from simulations.replay.fake_cluster import FakeCluster, FakeClusterError
from simulations.replay.metrics import summarize

A100 = "A100-SXM4-80GB"
H100 = "H100-SXM5-80GB"
G10 = "nvidia.com/gpu-10gb"
MIG3 = "nvidia.com/mig-3g.40gb"
EMPTY = Workload("none", (Pod("unused", 0),))


def hybrid_node(gpus: int = 1) -> FakeCluster:
    return FakeCluster([FakeCluster.node("h0", A100, gpus, Mode.HYBRID)])


def host_layout(slices: tuple[tuple[int, int], ...], whole: bool = True) -> PlannedGpu:
    """GPU 0: a 3g.40gb at 4 (whole) and a 4g.40gb at 0 hosting ``slices`` (MiB, %)."""
    return PlannedGpu(
        "h0",
        0,
        mig=(("4g.40gb", 0), ("3g.40gb", 4)),
        mig_mps=((0, tuple(PlannedSlice(m, p) for m, p in slices)),) if slices else (),
    )


# ------------------------------------------------------------------ the fake agent


def test_host_is_advertised_only_as_its_slices() -> None:
    fake = hybrid_node()
    fake.set_layout("h0", 0, host_layout(((10240, 26), (10240, 26))))
    assert fake.advertised("h0") == {G10: 2, MIG3: 1}
    state = fake.gpu_state(fake.nodes["h0"], fake.nodes["h0"].gpus[0])
    host = next(m for m in state.mig if m.start == 0)
    assert host.profile == "4g.40gb" and len(host.mps) == 2 and not host.pinned


def test_used_slice_is_kept_and_pins_its_instance() -> None:
    fake = hybrid_node()
    fake.set_layout("h0", 0, host_layout(((10240, 26), (10240, 26))))
    fake.bind("p", "h0", {G10: 1})
    used_key = fake.bindings["p"].devices[0][1]
    # drop one 10 GiB slice, add a 20 GiB one: the bound slice is the one kept
    fake.write_spec("h0", [host_layout(((10240, 26), (20480, 53)))], apply_at=5)
    assert fake.advertised("h0") == {G10: 1, MIG3: 1}  # the free twin is withdrawn at once
    res = fake.apply_spec("h0")
    assert res.disrupted == () and res.gpus_changed == 1
    assert (res.created, res.destroyed) == (1, 1)
    assert fake.bindings["p"].devices[0][1] == used_key
    assert fake.advertised("h0") == {G10: 1, "nvidia.com/gpu-20gb": 1, MIG3: 1}
    state = fake.gpu_state(fake.nodes["h0"], fake.nodes["h0"].gpus[0])
    assert next(m for m in state.mig if m.start == 0).pinned


@pytest.mark.parametrize(
    "layout",
    [
        host_layout(()),  # the host becomes a whole 4g.40gb: its bound slice goes
        host_layout(((20480, 53),)),  # the bound 10 GiB slice is not in the table
        PlannedGpu("h0", 0, mig=(("7g.80gb", 0),)),  # the host is destroyed
    ],
)
def test_removing_a_bound_slice_disrupts_its_pod(layout: PlannedGpu) -> None:
    fake = hybrid_node()
    fake.set_layout("h0", 0, host_layout(((10240, 26),)))
    fake.bind("p", "h0", {G10: 1})
    fake.write_spec("h0", [layout], apply_at=5)
    assert fake.apply_spec("h0").disrupted == ("p",)
    assert "p" not in fake.bindings


def test_bound_whole_instance_made_a_host_disrupts_its_pod() -> None:
    fake = hybrid_node()
    fake.set_layout("h0", 0, host_layout(()))
    fake.bind("p", "h0", {"nvidia.com/mig-4g.40gb": 1})
    fake.write_spec("h0", [host_layout(((10240, 26),))], apply_at=5)
    assert fake.apply_spec("h0").disrupted == ("p",)
    assert fake.advertised("h0") == {G10: 1, MIG3: 1}


def test_invalid_hosted_slices_are_refused() -> None:
    fake = hybrid_node()
    with pytest.raises(FakeClusterError, match="more than its"):
        fake.set_layout("h0", 0, host_layout(((40960, 100),)))  # > 40192 MiB of a 4g.40gb
    mig = FakeCluster([FakeCluster.node("m0", A100, 1, Mode.MIG)])
    with pytest.raises(FakeClusterError, match="need mode hybrid"):
        mig.set_layout("m0", 0, host_layout(((10240, 26),)))


# ------------------------------------------------------------------ hand-computed replay


def test_hybrid_replay_is_hand_computed() -> None:
    # One hybrid A100: a 3g.40gb pod and two 10 GiB MPS pods arrive at 0.  gpuslice (CP-SAT,
    # gates): the partitioner sees them at once (it reacts to changes), the 10 s idle window
    # closes at 10, the spec is written then and applied 5 s later (15); the node's first
    # kubelet status sync after 15 posts the slices, the partitioner reacts to it at once and
    # releases the pods, which bind then.  CP-SAT packs the two slices into one host (a
    # 4g.40gb: 40192 - 512 MiB hold two 10 GiB slices) beside the 3g.40gb.
    fake = hybrid_node()
    pods = [
        ReplayPod("big", {MIG3: 1}, 0, 1000),
        ReplayPod("s1", {G10: 1}, 0, 1000),
        ReplayPod("s2", {G10: 1}, 0, 1000),
    ]
    r = run_time_replay(EMPTY, fake, "cpsat", ReplaySettings(horizon_s=500), pods=pods)
    phase = r.status_sync["h0"]
    sync = phase + math.ceil((15 - phase) / 10 - 1e-9) * 10
    assert r.reconfigurations == [(15.0, 1)]
    assert {p.name: p.first_bound for p in r.pods} == {
        n: pytest.approx(sync) for n in ("big", "s1", "s2")
    }
    assert all(p.pending_s == pytest.approx(sync) for p in r.pods)
    assert r.disruptions == 0 and r.theft == 0 and r.admission_rejections == 0
    assert r.planner_errors == []
    hosts = {fake.bindings[s].devices[0][1][0] for s in ("s1", "s2")}
    assert len(hosts) == 1  # one instance hosts both slices
    gpu = fake.nodes["h0"].gpus[0]
    host = next(d for d in gpu.devices if d.is_host)
    assert hosts == {f"{G10}@{host.slot}"}
    assert fake.bindings["big"].devices == ((0, ("3g.40gb", 4)),)
    # allocation: the 3g's 3 compute slices + each slice's share of the host's compute
    share = host.compute * 10240 / (host.memory_mib - 512)
    assert r.allocation[-1][1] == pytest.approx((3 + 2 * share) / 7)


# ------------------------------------------------------------------ mapping and mixed clusters


def shares(count: int, seed: int = 5) -> Workload:
    mix = (
        PodShape(3, 1000, 1024, 1, 100),  # 10 GiB-ish slices
        PodShape(2, 1000, 1024, 1, 300),
        PodShape(2, 1000, 1024, 1, 600),  # MIG (>= 500 milli)
        PodShape(1, 1000, 1024, 1, 1000),
    )
    return synthetic_workload(
        SyntheticSpec(
            count=count, mix=mix, arrival_rate_per_s=1 / 30, mean_duration_s=900, seed=seed
        )
    )


def test_hybrid_and_mixed_clusters_map_per_reference_model() -> None:
    wl = shares(20)
    hybrid = build_fake_cluster(mig_cluster(2, 2, mode=Mode.HYBRID))
    assert default_mapping(cluster_kinds(hybrid)) == "hybrid-threshold:500"
    pods = cluster_replay_pods(wl, hybrid)
    by_share = {p.name: p.gpu_milli for p in wl.pods}
    for p in pods:
        (resource,) = p.requests
        big = by_share[p.name] >= 500
        assert resource.startswith("nvidia.com/mig-" if big else "nvidia.com/gpu-")
    # A100 and H100 nodes: the same profile names on both; mapped once, for the A100 (3 nodes)
    mixed = build_fake_cluster(mig_cluster(5, 2, models=(A100, H100)))
    assert [m.name for m, _ in cluster_kinds(mixed)] == [A100, "H100-80GB"]
    assert default_mapping(cluster_kinds(mixed)) == "mig-compute"
    assert {n.model.name for n in mixed.nodes.values()} == {A100, "H100-80GB"}
    assert cluster_label({"mode": "mig", "models": [A100, H100]}) == "mig A100-SXM4-80GB+H100-80GB"
    assert cluster_label({"mode": "mig", "models": []}) == ""


def recording(seen: set[str]) -> Callable[[Snapshot, PlannerSettings, Catalog], Plan]:
    def run(snapshot: Snapshot, settings: PlannerSettings, catalog: Catalog) -> Plan:
        p = plan(snapshot, settings, catalog)
        seen.update(a.node for a in p.assignments.values())
        return p

    return run


def test_mixed_a100_h100_cluster_replays_every_pod_without_disruption() -> None:
    wl = shares(30, seed=7)
    cluster = mig_cluster(2, 2, models=(A100, H100))
    seen: set[str] = set()
    pol = ReplayPolicy("cpsat", planner=recording(seen))
    r = run_time_replay(wl, cluster, pol, ReplaySettings(planner=PlannerSettings(time_limit_s=1)))
    assert len(r.pods) == 30
    assert all(p.first_bound is not None for p in r.pods)
    assert r.disruptions == 0 and r.theft == 0 and r.planner_errors == []
    assert seen == {"dgx-000", "dgx-001"}  # both models got pods


def test_mixed_mode_hybrid_cluster_replays() -> None:
    # hybrid A100 + MIG H100: MPS-mapped pods can only go to the hybrid node
    cluster = Cluster(
        "mixed-modes",
        (
            Node("h", 64000, 512000, 2, A100, Mode.HYBRID, A100),
            Node("m", 64000, 512000, 2, "H100-80GB", Mode.MIG, "H100-80GB"),
        ),
    )
    r = run_time_replay(shares(20, seed=2), cluster, "greedy")
    assert all(p.first_bound is not None for p in r.pods)
    assert r.disruptions == 0 and r.theft == 0


@pytest.mark.parametrize("policy", ["cpsat", "greedy"])
def test_hybrid_replay_is_deterministic(policy: str) -> None:
    wl = shares(24, seed=11)
    settings = ReplaySettings(planner=PlannerSettings(time_limit_s=1), seed=4)

    def once() -> tuple[object, ...]:
        cluster = mig_cluster(2, 1, mode=Mode.HYBRID)
        r = run_time_replay(wl, cluster, parse_policy(policy), settings)
        s = summarize(r)
        return (
            [(p.name, p.first_bound, p.pending_s, p.disruptions) for p in r.pods],
            r.reconfigurations,
            r.theft,
            s.pending_p95_s,
            s.allocation_mean,
        )

    first = once()
    assert first == once()
    assert first[2] == 0


def test_render_keeps_cluster_kinds_apart(tmp_path: Path) -> None:
    pol = {
        "pending_p95_s": 10.0,
        "pending_p99_s": 20.0,
        "gpus_reconfigured": 3,
        "theft": 0,
        "pods_disrupted": 0,
    }
    cell = {"trace": "default", "nodes": 4, "gpus": 32, "policies": {"cpsat": pol, "greedy": pol}}
    mig, hyb = tmp_path / "mig.json", tmp_path / "hybrid.json"
    mig.write_text(json.dumps({"cells": [cell]}))
    hyb.write_text(json.dumps({"cells": [{**cell, "cluster": "hybrid A100-SXM4-80GB"}]}))
    rows = render_table([str(mig), str(hyb)]).splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| default", "| default (hybrid A100-SXM4-80GB)"]


def test_named_slices_are_checked_against_every_node_kind() -> None:
    hybrid = build_fake_cluster(mig_cluster(1, 1, mode=Mode.HYBRID))
    ok = Workload(
        "named",
        (
            Pod("a", 100, creation_time=0, slices=((G10, 1),)),
            Pod("b", 100, creation_time=5, slices=((MIG3, 1),)),
        ),
    )
    assert [dict(p.requests) for p in cluster_replay_pods(ok, hybrid)] == [{G10: 1}, {MIG3: 1}]
    bad = Workload(
        "named",
        (
            Pod(
                "c",
                100,
                creation_time=0,
                slices=(("nvidia.com/mig-3g.20gb", 1),),
            ),
        ),
    )
    with pytest.raises(ReplayError, match="no node of the cluster"):
        cluster_replay_pods(bad, hybrid)
    # a slice larger than the largest instance minus the MPS server reserve
    big = Workload(
        "named",
        (
            Pod(
                "d",
                100,
                creation_time=0,
                slices=(("nvidia.com/gpu-80gb", 1),),
            ),
        ),
    )
    with pytest.raises(ReplayError, match="gpu-80gb"):
        cluster_replay_pods(big, hybrid)
