"""Fake cluster, static layouts, geometry bound, metrics and report of the time replay."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from planner.catalog import default_catalog
from planner.snapshot import Mode, PlannedGpu, PlannedSlice
from simulations.inputs.workload import Pod, Workload
from simulations.replay.engine import ReplayPod, run_time_replay
from simulations.replay.fake_cluster import FakeCluster, FakeClusterError
from simulations.replay.metrics import (
    PodRecord,
    nearest_rank,
    overtakes,
    summarize,
    time_weighted_mean,
)
from simulations.replay.static_layouts import (
    BUILTIN_STATIC,
    StaticLayoutError,
    assign_static,
    demand_matched_mix,
    maximal_layouts,
    static_policy,
)
from simulations.reports.replay_report import format_table, write_replay_report
from simulations.saturation.geometry_bound import geometry_bound, gpus_needed, peak_demands

CAT = default_catalog()
A100 = CAT.model("A100-SXM4-80GB")
MIG_1G = "nvidia.com/mig-1g.10gb"


def mig(node: str, index: int, *instances: tuple[str, int]) -> PlannedGpu:
    return PlannedGpu(node, index, mig=instances)


# ------------------------------------------------------------------ fake cluster


def test_fake_agent_withdraws_removed_devices_and_keeps_used_ones() -> None:
    fc = FakeCluster([FakeCluster.node("n", A100, 1)])
    fc.set_layout("n", 0, mig("n", 0, ("1g.10gb", 0), ("1g.10gb", 1), ("2g.20gb", 2)))
    fc.bind("p", "n", {MIG_1G: 1})
    assert fc.free_on("n", MIG_1G) == 1 and fc.used_compute() == 1
    # keep the used 1g@0, drop 1g@1 and 2g@2, add 3g@4
    fc.write_spec("n", [mig("n", 0, ("1g.10gb", 0), ("3g.40gb", 4))], apply_at=5)
    assert fc.free_on("n", MIG_1G) == 0  # 1g@1 withdrawn at once
    assert fc.node_states() == ()  # in flight: left out of snapshots
    res = fc.apply_spec("n")
    assert (res.created, res.destroyed, res.gpus_changed, res.disrupted) == (1, 2, 1, ())
    assert fc.bindings["p"].devices == ((0, ("1g.10gb", 0)),)
    assert fc.free_on("n", "nvidia.com/mig-3g.40gb") == 1
    fc.release("p")
    assert fc.free_on("n", MIG_1G) == 1 and fc.used_compute() == 0


def test_fake_agent_counts_a_removed_used_device_as_a_disruption() -> None:
    fc = FakeCluster([FakeCluster.node("n", A100, 1)])
    fc.set_layout("n", 0, mig("n", 0, ("1g.10gb", 0)))
    fc.bind("p", "n", {MIG_1G: 1})
    fc.write_spec("n", [mig("n", 0, ("7g.80gb", 0))], apply_at=0)
    res = fc.apply_spec("n")
    assert res.disrupted == ("p",) and "p" not in fc.bindings


def test_fake_cluster_rejects_invalid_layouts_and_bad_binds() -> None:
    fc = FakeCluster([FakeCluster.node("n", A100, 1)])
    with pytest.raises(FakeClusterError, match="n GPU 0: invalid MIG layout"):
        fc.set_layout("n", 0, mig("n", 0, ("3g.40gb", 0), ("3g.40gb", 4), ("1g.10gb", 3)))
    with pytest.raises(FakeClusterError, match="does not fit"):
        fc.bind("p", "n", {MIG_1G: 1})
    with pytest.raises(FakeClusterError, match="unknown node"):
        fc.write_spec("x", [], 0)
    with pytest.raises(FakeClusterError, match="MIG-capable"):
        FakeCluster([FakeCluster.node("v", "V100-32GB", 1, Mode.MIG)])


def test_fake_mps_keeps_a_used_slice_whose_size_the_spec_keeps() -> None:
    fc = FakeCluster([FakeCluster.node("m", "V100-32GB", 1, Mode.MPS)])
    fc.set_layout("m", 0, PlannedGpu("m", 0, mps=(PlannedSlice(8192, 25), PlannedSlice(16384, 50))))
    fc.bind("p", "m", {"nvidia.com/gpu-16gb": 1})
    spec = PlannedGpu(
        "m", 0, mps=(PlannedSlice(16384, 50, True), PlannedSlice(4096, 12), PlannedSlice(4096, 12))
    )
    fc.write_spec("m", [spec], 0)
    res = fc.apply_spec("m")
    assert res.disrupted == () and (res.created, res.destroyed) == (2, 1)
    assert fc.free_on("m", "nvidia.com/gpu-4gb") == 2
    with pytest.raises(FakeClusterError, match="bound pods"):
        fc.set_layout("m", 0, PlannedGpu("m", 0))
    fc.release("p")
    with pytest.raises(FakeClusterError, match="more than the"):
        fc.set_layout("m", 0, PlannedGpu("m", 0, mps=(PlannedSlice(32768, 100),)))


# ------------------------------------------------------------------ static layouts


def test_balanced_is_mig_parted_all_balanced() -> None:
    (pg,) = assign_static(static_policy("balanced"), [("n", 0, A100)])
    assert Counter(p for p, _ in pg.mig) == {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    (a30,) = assign_static(static_policy("balanced"), [("n", 0, CAT.model("A30"))])
    assert Counter(p for p, _ in a30.mig) == {"1g.6gb": 2, "2g.12gb": 1}
    with pytest.raises(StaticLayoutError, match="no layout that fits A30"):
        assign_static(BUILTIN_STATIC["all-3g"], [("n", 0, CAT.model("A30"))])
    with pytest.raises(StaticLayoutError, match="unknown static layout"):
        static_policy("half")


def test_maximal_layouts_and_demand_matched_mix() -> None:
    layouts = maximal_layouts(A100)
    assert len(layouts) == 14 and (("7g", 0),) in layouts
    assert (("3g", 0), ("3g", 4)) in layouts
    assert not any(Counter(s for s, _ in lay) == {"3g": 2, "1g": 1} for lay in layouts)  # 3g+3g+1g
    only_3g = demand_matched_mix(A100, {"3g": 4}, 3)
    assert only_3g.per_model == {A100.name: ((3, (("3g", 0), ("3g", 4))),)}
    mixed = demand_matched_mix(A100, {"7g": 1, "1g": 7}, 2)
    counts = dict((lay, n) for n, lay in mixed.per_model[A100.name])  # type: ignore[index]
    assert counts == {tuple(("1g", s) for s in range(7)): 1, (("7g", 0),): 1}
    gpus = [("n", i, A100) for i in range(2)]
    assert sorted(len(pg.mig) for pg in assign_static(mixed, gpus)) == [1, 7]


# ------------------------------------------------------------------ geometry bound


def _pods(*specs: tuple[str, int, float, float]) -> list[ReplayPod]:
    return [
        ReplayPod(f"p{i}", {f"nvidia.com/mig-{prof}": k}, a, d)
        for i, (prof, k, a, d) in enumerate(specs)
    ]


def test_geometry_bound_beats_the_slice_bound_where_geometry_binds() -> None:
    # three 4g at once: 12 compute slices fit 2 GPUs by count, but one 4g per GPU -> 3
    pods = _pods(("4g.40gb", 1, 0, 10), ("4g.40gb", 1, 1, 10), ("4g.40gb", 1, 2, 10))
    b = geometry_bound(A100, pods)
    assert (b.gpus, b.simple_bound, b.at) == (3, 2, 2)
    assert b.demand == {"4g.40gb": 3}
    assert gpus_needed(A100, Counter({"1g.10gb": 7})) == 1
    assert gpus_needed(A100, Counter({"3g.40gb": 2, "1g.10gb": 1})) == 2  # 3g+3g+1g is invalid
    assert gpus_needed(A100, Counter({"4g.40gb": 1, "3g.40gb": 1})) == 1


def test_peak_demands_are_local_maxima() -> None:
    # a:[0,10) b:[5,20) c:[15,30): peaks {a,b} at 5 and {b,c} at 15; departures at 10 first
    pods = _pods(("1g.10gb", 1, 0, 10), ("2g.20gb", 1, 5, 15), ("3g.40gb", 1, 15, 15))
    peaks = peak_demands(pods)
    assert [(t, dict(d)) for t, d in peaks] == [
        (5, {"1g.10gb": 1, "2g.20gb": 1}),
        (15, {"2g.20gb": 1, "3g.40gb": 1}),
    ]


# ------------------------------------------------------------------ metrics and report


def test_nearest_rank_and_time_weighted_mean_by_hand() -> None:
    assert nearest_rank([4, 1, 3, 2], 50) == 2
    assert nearest_rank([4, 1, 3, 2], 95) == 4
    assert nearest_rank([4, 1, 3, 2], 25) == 1
    assert math.isnan(nearest_rank([], 50))
    with pytest.raises(ValueError):
        nearest_rank([1], 0)
    assert time_weighted_mean([(0, 0.5), (10, 1.0)], 0, 20) == pytest.approx(0.75)
    assert time_weighted_mean([(5, 1.0)], 0, 10) == pytest.approx(0.5)


def test_report_writes_markdown_json_and_plots(tmp_path: Path) -> None:
    fc = FakeCluster([FakeCluster.node("n", A100, 1)])
    pods = [ReplayPod("a", {MIG_1G: 1}, 0, 100), ReplayPod("b", {MIG_1G: 2}, 10, 50)]
    r = run_time_replay(Workload("w", (Pod("x", 0),)), fc, "greedy", pods=pods)
    md = write_replay_report([r], tmp_path, context={"trace": "hand-made"})
    text = md.read_text()
    assert "| greedy | 2 |" in text and "![pending_cdf](pending_cdf.png)" in text
    for png in ("pending_cdf.png", "reconfigurations.png", "allocation.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    doc = json.loads((tmp_path / "replay.json").read_text())
    assert doc["summaries"][0]["pods_disrupted"] == 0 and doc["context"]["trace"] == "hand-made"
    assert "greedy" in format_table([summarize(r)])


def test_simulate_time_replay_protocol_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpuslice.cli import main

    argv = ["simulate", "--protocol", "time-replay", "--quiet", "--policy", "greedy,static:all-7g"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "time replay: sweep-default (160 pods)" in out and "static:all-7g" in out
    assert (tmp_path / "replay.md").exists()
    # what the reconfigurations were: greedy's changes, counted and tabled; a static layout has none
    changes = json.loads((tmp_path / "layout_changes.json").read_text())["policies"]
    greedy, static = changes
    reconfigured = json.loads((tmp_path / "replay.json").read_text())["summaries"][0]
    assert sum(greedy["transitions"].values()) == reconfigured["gpus_reconfigured"] > 0
    assert len(greedy["layout_changes"]) == reconfigured["gpus_reconfigured"]
    assert static["transitions"] == {} and static["layout_changes"] == []
    report = (tmp_path / "replay.md").read_text()
    top, count = next(iter(greedy["transitions"].items()))
    assert f"| greedy | {top} | {count} |" in report
    assert main(["simulate", "--protocol", "time-replay", "--quiet", "--policy", "fifo"]) == 2
    assert "unknown replay policy" in capsys.readouterr().err


def test_overtakes_count_pods_bound_before_an_older_pod_of_their_request() -> None:
    def rec(name: str, arrival: float, bound: float | None, req: str = "a") -> PodRecord:
        return PodRecord(name, arrival, {req: 1}, first_bound=bound)

    fifo = [rec("p1", 0, 5), rec("p2", 1, 6), rec("p3", 2, 7)]
    assert overtakes(fifo) == 0
    # p3 is bound at 6 while p2 (older) waits until 9; p4 is bound while p2 waits too
    out_of_order = [rec("p1", 0, 5), rec("p2", 1, 9), rec("p3", 2, 6), rec("p4", 3, 8)]
    assert overtakes(out_of_order) == 2
    # an older pod never bound is overtaken by every later binding of its request only
    never = [rec("p1", 0, None), rec("p2", 1, 3), rec("p3", 2, 4, req="b")]
    assert overtakes(never) == 1
    # pods arriving at the same instant do not overtake each other
    assert overtakes([rec("p1", 0, 9), rec("p2", 0, 1)]) == 0
