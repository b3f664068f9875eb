"""The controller benchmark's code path on a tiny cluster (a test, not the benchmark).

Checks that the generated cluster is what the benchmark says it is (counts add up, every MIG
instance is held by a bound pod, pods are sized like real ones), that the result document has
its figures and that they agree with each other (the pending pods are what decide() sees and
what the snapshot holds), and the ``gpuslice bench controller`` command around it.  Also the
two sharing rules the benchmark relies on: pods with the same node constraints share one
eligible-node set in the index and in the planner's snapshot.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuslice.cli import main
from partitioner.decide import ControllerState, decide
from simulations import bench_controller as bc

NODES, PODS, PENDING = 4, 300, 30


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return bc.run_benchmark(NODES, PODS, PENDING, cycles=3, snapshot_repeats=2, seed=0)


def test_generated_cluster_adds_up_and_every_instance_is_held() -> None:
    cluster = bc.generate(NODES, PODS, PENDING, seed=1)
    counts = cluster.counts
    assert counts["pending_pods"] == PENDING
    assert counts["bound_slice_pods"] + counts["daemonset_pods"] + counts["cpu_pods"] == (
        PODS - PENDING
    )
    assert len(cluster.pods) == PODS and len(cluster.nodes) == NODES
    instances = Counter(
        (name, f"nvidia.com/mig-{p}") for name, gpus in cluster.nodes for g in gpus for p, _ in g
    )
    held = Counter(
        (s.node, f"nvidia.com/mig-{s.slice_profile}")
        for s in cluster.pods
        if s.node and s.slice_profile
    )
    assert held == instances  # one bound pod per instance: no free slice for the fast path
    for i, (name, gpus) in enumerate(cluster.nodes):
        alloc = bc._node(name, i, gpus)["status"]["allocatable"]
        advertised = {r: int(v) for r, v in alloc.items() if r.startswith("nvidia.com/mig-")}
        assert advertised == {r: k for (n, r), k in instances.items() if n == name}
    pending = [s for s in cluster.pods if not s.node]
    assert len(pending) == PENDING and all(s.gated and s.slice_profile for s in pending)
    assert all(bc.CLOCK - 3600 <= s.created < bc.CLOCK for s in pending)


def test_pods_are_sized_like_real_ones() -> None:
    cluster = bc.generate(2, 60, 10, seed=0)
    bound = next(s for s in cluster.pods if s.node and s.slice_profile)
    pending = next(s for s in cluster.pods if not s.node)
    for spec in (bound, pending):
        pod = bc._pod(spec, "uid-1", 1)
        size = len(json.dumps(pod, separators=(",", ":")))
        assert 4000 <= size <= 9000, size
        meta = pod["metadata"]
        assert meta["managedFields"] and meta["ownerReferences"] and meta["annotations"]
        assert len(pod["spec"]["containers"]) == 2 and pod["spec"]["initContainers"]
    assert bc._pod(pending, "uid-2", 2)["spec"]["schedulingGates"] == [{"name": bc.GATE}]


def test_document_figures_are_consistent(doc: dict[str, Any]) -> None:
    assert doc["benchmark"] == "controller"
    assert (doc["nodes"], doc["pods"], doc["pending"]) == (NODES, PODS, PENDING)
    idx = doc["index"]
    assert idx["pods_kept"] == PODS and idx["waiting"] == PENDING
    assert idx["objects"] == 2 * NODES + PODS
    assert 0 < idx["build_s"] <= idx["wall_s"]
    cycles = doc["cycles"]
    assert cycles["counts"] == {"candidates": PENDING, "rejected": 0, "waiting": PENDING}
    assert cycles["first_actions"] == PENDING  # one Gated Event per pending pod, once
    assert cycles["idle_actions_max"] == 0  # idle: nothing to write
    for name in ("idle_window_open_s", "idle_after_plan_s", "idle_all_s"):
        s = cycles[name]
        assert 0 < s["p50"] <= s["p99"] <= s["max"]
    snap = doc["snapshot"]
    assert snap["batch"] == PENDING  # every pending pod is a candidate of the batch
    # ... and enters the snapshot unless its resource is at the GPUs' bound (none at seed 0)
    assert snap["pods"] + snap["counts"].get("capped", 0) == PENDING
    assert snap["pods"] == PENDING
    assert snap["nodes"] == NODES and snap["gpus"] == NODES * bc.GPUS_PER_NODE
    assert snap["counts"]["candidates"] == PENDING
    assert 0 < snap["build_s"]["p50"] <= snap["decide_s"]["p50"]
    assert snap["planner_s"]["max"] < snap["decide_s"]["p50"]
    mem = doc["memory"]
    assert mem["rss_before_mib"] is not None and mem["rss_before_mib"] > 10
    assert mem["index_mib"] == round(mem["rss_after_build_mib"] - mem["rss_before_mib"], 1)
    for name, t in doc["targets"].items():
        assert t["limit"] == bc.TARGETS[name]
        assert t["pass"] is (t["value"] is not None and t["value"] <= t["limit"])
    idle_p99 = doc["targets"]["idle_cycle_p99_s"]["value"]
    assert abs(idle_p99 - cycles["idle_all_s"]["p99"]) <= 1e-4  # the same figure, rounded
    turnover = doc["turnover"]
    assert turnover["pods"] == PODS and turnover["apply_s"] > 0
    assert 0 < turnover["build_s"]["p50"] <= turnover["decide_s"]["p50"]
    build_p99 = doc["targets"]["snapshot_build_s"]["value"]  # the worse of the two phases
    assert abs(build_p99 - max(snap["build_s"]["p99"], turnover["build_s"]["p99"])) <= 1e-4
    heap = doc["heap"]
    assert heap["policy"] == "keep frozen" and heap["reclaim_every_s"] == 3600
    assert heap["frozen_objects"] > 0 and heap["reclaim_unreachable"] >= 0
    assert heap["reclaim_s"] > 0 and heap["refreezes"] >= 1
    assert mem["rss_after_turnover_mib"] is not None
    assert doc["machine"]["cpus"] >= 1


def test_pods_with_the_same_constraints_share_their_eligible_nodes() -> None:
    recorder = bc._Recorder()
    config, _ = bc._config(recorder)
    cluster = bc.generate(6, 400, 60, seed=3)
    shapes = {
        repr((s.node_selector, s.zones)) for s in cluster.pods if not s.node
    }  # selector / zone affinity / none
    index, _ = bc.build_index(cluster, config.catalog, lambda _: None)
    first = decide(ControllerState(), index, bc.CLOCK, config)
    decide(first.state, index, bc.CLOCK + config.policy.idle + 1, config)
    snapshot = recorder.snapshot
    assert snapshot is not None and len(snapshot.pods) == 60
    waiting = index.waiting()
    sets = {id(index.eligible(p, index.gpu_nodes())) for p in waiting}
    assert len(sets) <= len(shapes) < len(waiting)
    assert len({id(p.eligible_nodes) for p in snapshot.pods}) <= len(shapes)
    zoned = [p for p in waiting if "affinity" in p.obj["spec"]]
    for pod in zoned:  # a shared set is still the pod's own answer
        zones = pod.obj["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"]
        expected = {
            n
            for n, info in index.gpu_nodes().items()
            if info.obj["metadata"]["labels"]["topology.kubernetes.io/zone"] in zones
        }
        assert index.eligible(pod, index.gpu_nodes()) == expected


def test_bad_sizes_name_the_option() -> None:
    with pytest.raises(ValueError, match=r"--pods \(5\) counts the pending pods"):
        bc.check_sizes(10, 5, 6, 3, 1)
    with pytest.raises(ValueError, match="--nodes"):
        bc.check_sizes(0, 10, 5, 3, 1)
    with pytest.raises(ValueError, match="--cycles"):
        bc.check_sizes(1, 10, 5, 0, 1)


def test_cli_prints_the_document_and_a_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["bench", "controller", "--nodes", "2", "--pods", "120", "--pending", "12",
            "--cycles", "2", "--snapshot-repeats", "1", "--quiet"]  # fmt: skip
    assert main([*argv, "-o", "yaml", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    printed = yaml.safe_load(out)
    written = json.loads((tmp_path / "controller.json").read_text())
    assert printed["pending"] == written["pending"] == 12
    assert set(printed) == set(written)
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == "" and "controller benchmark: 2 nodes" in out
    lines = out.splitlines()
    idle = next(line for line in lines if line.startswith("idle cycle, all"))
    snap = next(line for line in lines if line.startswith("snapshot build (12 pods, 2 nodes)"))
    assert "p99 <= 50.0 ms" in idle and "p99 <= 300.0 ms" in snap
    assert idle.rstrip().endswith(("pass", "FAIL")) and snap.rstrip().endswith(("pass", "FAIL"))
    turned = next(line for line in lines if line.startswith("snapshot build, every pod updated"))
    assert "p99 <= 300.0 ms" in turned and turned.rstrip().endswith(("pass", "FAIL"))
    reclaim = next(line for line in lines if line.startswith("heap reclaim, every 3600 s"))
    assert "(keep frozen)" in reclaim and "objects freed from frozen cycles" in reclaim
    assert main([*argv, "--freeze-once", "-o", "json"]) == 0
    once = json.loads(capsys.readouterr().out)["heap"]
    assert once["policy"] == "freeze once" and once["refreezes"] == 0
    assert once["reclaim_s"] is None and once["reclaim_unreachable"] is None
    assert main(["bench", "controller", "--pods", "5", "--pending", "6", "--quiet"]) == 2
    assert "--pods (5) counts the pending pods" in capsys.readouterr().err
