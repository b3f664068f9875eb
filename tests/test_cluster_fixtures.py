"""Dumps of clusters that already run GPUs: GPU Operator single and mixed strategy, a nos node.

The fixtures in ``tests/fixtures/clusters/`` are ``kubectl get nodes,pods -A -o json`` output
(no gpuslice CRD yet) shaped after real objects; see that folder's README for where each label
comes from.  Each has running MIG pods and pending ones.  For each, and for both planners: the
plan uses the physical GPU count, keeps every instance in use, changes no locked GPU, places
the pending pods it can (and names why not the others), and never gives a pod a resource name
other than its request.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gpuslice.cli import main
from partitioner.actions import EmitEvent, SetNodeCondition
from partitioner.batching import BatchPolicy
from partitioner.decide import ControllerState, DecideConfig, decide
from partitioner.node_labels import with_operands_off
from partitioner.snapshot import ClusterReading, opted_in, read_kubectl_list, view_from_items
from planner.api import plan
from planner.catalog import default_catalog
from planner.settings import PlannerSettings, Policy
from planner.snapshot import Plan, mig_resource

CAT = default_catalog()
FIXTURES = Path(__file__).parent / "fixtures" / "clusters"


def load(name: str) -> dict[str, Any]:
    """The dump as the cluster shows it before gpuslice."""
    doc: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return doc


def prepared(name: str) -> dict[str, Any]:
    """The dump once the GPU Operator's MIG manager and device plugin are off on the gpuslice
    nodes (docs/operations.md, 'GPU Operator'), as the pre-install what-if assumes."""
    doc = load(name)
    doc["items"] = [
        with_operands_off(i)[0] if i["kind"] == "Node" and opted_in(i) else i for i in doc["items"]
    ]
    return doc


# fixture -> (node -> physical GPUs, pods the plan must place, pods it cannot, pods rejected)
EXPECTED: dict[str, tuple[dict[str, int], set[str], set[str], set[str]]] = {
    "gpu-operator-single.json": (
        {"gpu-single-0": 2},  # 14 MIG devices of all-1g.5gb: 2 GPUs, not 14
        {f"research/notebook-5d4b7-{i}" for i in range(3)},  # on the 5 free 1g.5gb
        {"research/train-6f8d9-0"},  # 3g.20gb: both GPUs may hold used 1g.5gb (locked)
        {"research/nvl-job-8e2a1-0"},  # 1g.12gb is an H100 NVL name
    ),
    "gpu-operator-mixed.json": (
        {"gpu-mixed-0": 2, "gpu-mixed-1": 1},
        {"research/train-4g-71b3e-0", "research/eval-2g-93c1d-0", "research/eval-2g-93c1d-1"},
        {"research/pretrain-7g-1e4f2-0"},
        {"research/h100nvl-3g-0a9b8-0"},
    ),
    "nos-mig.json": (
        {"gpu-nos-0": 4},
        {
            "research/batch-8c2f3-1",
            "research/big-6d9e1-0",
            "research/dev-2g-3a7b5-0",
            "research/dev-2g-3a7b5-1",
            "research/dev-1g-7f3c9-0",
        },
        set(),
        set(),
    ),
}


def check_plan(reading: ClusterReading, result: Plan) -> None:
    """Independent of the fixture: exact names, in-use instances kept, locked GPUs unchanged,
    and every placed pod's units covered by free instances of exactly its resource name."""
    nodes = {n.name: n for n in reading.nodes}
    for (name, index), planned in result.layouts.items():
        gpu = next(g for g in nodes[name].gpus if g.index == index)
        assert not gpu.locked, f"{name} GPU {index} is locked but the plan changes it"
        used = {(i.profile, i.start) for i in gpu.mig if i.used}
        assert used <= set(planned.mig), f"{name} GPU {index}: in-use instances dropped"
    wanted: dict[str, Counter[str]] = {}
    snapshot = reading.snapshot()
    pods = {p.name: p for p in snapshot.pods}
    for pod_name, a in result.assignments.items():
        model = CAT.model(nodes[a.node].model)
        own = {mig_resource(p.name) for p in model.profiles}
        for resource, units in a.gpus.items():
            assert resource in pods[pod_name].requests
            assert resource in own, f"{pod_name}: {resource} is not a name {model.name} has"
            wanted.setdefault(a.node, Counter())[resource] += len(units)
    for name, want in wanted.items():
        free: Counter[str] = Counter()
        for gpu in nodes[name].gpus:
            planned = result.layouts.get((name, gpu.index))
            used = {(i.profile, i.start) for i in gpu.mig if i.used}
            after = planned.mig if planned else tuple((i.profile, i.start) for i in gpu.mig)
            free.update(mig_resource(p) for p, s in after if (p, s) not in used)
        assert all(n <= free[r] for r, n in want.items()), (name, want, free)


@pytest.mark.parametrize("policy", [Policy.GREEDY, Policy.CPSAT])
@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_fixture_is_planned_around_what_runs(fixture: str, policy: Policy) -> None:
    counts, placed, unplaced, rejected = EXPECTED[fixture]
    reading = read_kubectl_list(prepared(fixture), CAT)
    assert not reading.problems
    assert {n: g.gpu_count for n, g in reading.gpu_nodes.items()} == counts
    assert {n.name: len(n.gpus) for n in reading.nodes} == counts
    used_now = sum(i.used for n in reading.nodes for g in n.gpus for i in g.mig)
    running = sum(
        1
        for p in load(fixture)["items"]
        if p["kind"] == "Pod" and (p["spec"].get("nodeName") or "").startswith("gpu-")
    )
    assert used_now == running  # one instance per running MIG pod
    assert set(reading.rejected) == rejected
    result = plan(reading.snapshot(), PlannerSettings(policy=policy, time_limit_s=2.0), CAT)
    assert set(result.assignments) == placed
    assert set(result.unplaced) == unplaced
    check_plan(reading, result)


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_the_controller_leaves_nodes_with_mig_manager_or_nvidias_plugin_on_out(
    fixture: str,
) -> None:
    reading = read_kubectl_list(load(fixture), CAT)
    assert set(reading.problems) == set(EXPECTED[fixture][0]) and not reading.nodes
    for name, problem in reading.problems.items():
        assert problem.reason in ("MigManagerEnabled", "NvidiaDevicePluginEnabled")
        assert f"kubectl label node {name} nvidia.com/gpu.deploy." in problem.message
        assert "=false --overwrite" in problem.message


def test_nos_node_keeps_its_full_gpu_and_its_half_used_one_as_they_are() -> None:
    reading = read_kubectl_list(prepared("nos-mig.json"), CAT)
    (state,) = reading.nodes
    g0, g1, g2, g3 = state.gpus
    assert [(i.profile, i.start, i.used) for i in g0.mig] == [
        ("1g.10gb", s, True) for s in range(7)
    ]
    assert g1.locked and sorted(i.used for i in g1.mig) == [False, True]
    assert [(i.profile, i.used) for i in g2.mig] == [("7g.80gb", False)] and not g3.mig
    result = plan(reading.snapshot(), PlannerSettings(time_limit_s=2.0), CAT)
    assert ("gpu-nos-0", 0) not in result.layouts and ("gpu-nos-0", 1) not in result.layouts


def test_plan_snapshot_prints_what_it_read_per_node(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = main(["plan", "--snapshot", str(FIXTURES / "gpu-operator-single.json"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    read = doc["nodes_read"]["gpu-single-0"]
    assert (read["gpus"], read["mig_strategy"], read["locked_gpus"]) == (2, "single", [0, 1])
    assumed = " | ".join(read["assumed"])
    assert "assumed nvidia.com/gpu.deploy.mig-manager=false (it is 'true')" in assumed
    assert "GPU count 2 from nvidia.com/mig.config=all-1g.5gb" in assumed
    assert "14 x 1g.5gb" in assumed and "9 x 1g.5gb" in assumed
    rc = main(["plan", "--snapshot", str(FIXTURES / "gpu-operator-mixed.json")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "Read from the dump (2 opted-in node(s)):" in out
    assert "gpu-mixed-1 (A100-SXM4-80GB, mig, mig.strategy=mixed)" in out
    assert "in use by 1 running pod (research/ft-2c8e4-0): 1 x 3g.40gb" in out


def huge_count_dump() -> dict[str, Any]:
    doc = copy.deepcopy(prepared("gpu-operator-mixed.json"))
    for item in doc["items"]:
        if item["metadata"]["name"] == "gpu-mixed-0":
            item["metadata"]["labels"]["nvidia.com/gpu.count"] = str(10**9)
    return doc


def test_a_billion_gpus_is_a_node_problem_and_the_cycle_stays_under_50_ms() -> None:
    doc = huge_count_dump()
    view = view_from_items(doc["items"])
    config = DecideConfig(
        CAT, BatchPolicy(timeout=1, idle=1), PlannerSettings(policy=Policy.GREEDY)
    )
    state = decide(ControllerState(), view, 0.0, config).state  # opens the batch window
    times = []
    for _ in range(5):
        start = time.perf_counter()
        got = decide(state, view, 5.0, config)  # the window is due: read, plan, act
        times.append(time.perf_counter() - start)
    problem = got.problems["gpu-mixed-0"]
    assert problem.reason == "TooManyGpus" and "1000000000" in problem.message
    assert any(isinstance(a, SetNodeCondition) and a.reason == "TooManyGpus" for a in got.actions)
    assert any(isinstance(a, EmitEvent) and a.reason == "TooManyGpus" for a in got.actions)
    assert got.plan is not None and got.plan.assignments  # the other node is still planned
    assert {a.node for a in got.plan.assignments.values()} == {"gpu-mixed-1"}
    print(
        f"cycle with gpu.count=1e9: min {min(times) * 1000:.1f} ms, median {statistics.median(times) * 1000:.1f} ms"
    )
    assert min(times) < 0.050


def test_plan_snapshot_on_a_billion_gpus_exits_0_naming_the_node(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(huge_count_dump()))
    assert main(["plan", "--snapshot", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["nodes_read"]["gpu-mixed-0"]["problem"].startswith("TooManyGpus: label")
