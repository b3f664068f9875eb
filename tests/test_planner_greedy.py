"""The nos-like greedy planner: placement validity, nos ordering rules, MPS, reasons, determinism."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.catalog import default_catalog
from planner.geometry import enumerate_layouts, layout_errors, parse_layout
from planner.greedy import plan_greedy
from planner.settings import PlannerSettings, ThreadPolicy
from planner.snapshot import (
    GpuState,
    MigInstance,
    Mode,
    MpsSlice,
    NodeState,
    PendingPod,
    Plan,
    PlannedGpu,
    Snapshot,
    Unplaced,
)
from simulations.inputs.instances import demo_snapshot, mig_benchmark_snapshot

CAT = default_catalog()
A100 = CAT.model("A100-SXM4-80GB")
MIG_PROFILES = [p.name for p in A100.profiles if not p.has_media_extensions]


def mig_node(name: str, *gpus: list[tuple[str, int, bool]], cpu: int = 64_000) -> NodeState:
    return NodeState(
        name=name,
        mode=Mode.MIG,
        model="A100-SXM4-80GB",
        gpus=tuple(
            GpuState(i, mig=tuple(MigInstance(p, s, used=u) for p, s, u in g))
            for i, g in enumerate(gpus)
        ),
        cpu_milli_free=cpu,
        memory_mib_free=256 * 1024,
    )


def pod(name: str, resource: str, count: int = 1, **kw: object) -> PendingPod:
    return PendingPod(name=name, requests={resource: count}, **kw)  # type: ignore[arg-type]


def mig(profile: str) -> str:
    return f"nvidia.com/mig-{profile}"


def check_plan(snapshot: Snapshot, plan: Plan) -> None:
    """Every invariant a plan must satisfy, whatever the planner."""
    nodes = {n.name: n for n in snapshot.nodes}
    pods = {p.name: p for p in snapshot.pods}
    assert set(plan.assignments) | set(plan.unplaced) == set(pods)
    assert not set(plan.assignments) & set(plan.unplaced)
    for reason in plan.unplaced.values():
        assert any(reason.startswith(code.value) for code in Unplaced), reason
    # Final layout per GPU; used instances stay exactly where they are.
    final: dict[tuple[str, int], Counter[tuple[str, int]]] = {}
    for node in snapshot.nodes:
        model = CAT.model(node.model)
        for gpu in node.gpus:
            key = (node.name, gpu.index)
            before = Counter((i.profile, i.start) for i in gpu.mig)
            planned = plan.layouts.get(key)
            if node.mode is Mode.MPS:
                continue
            after = Counter(planned.mig) if planned else before
            assert not layout_errors(model, parse_layout(model, list(after.elements())))
            for inst in gpu.mig:
                if inst.used:
                    assert after[(inst.profile, inst.start)] >= 1, (key, inst)
            used = Counter((i.profile, i.start) for i in gpu.mig if i.used)
            final[key] = after - used
    # Assigned units exist as unused instances; node CPU/memory hold the pods.
    demand: Counter[tuple[str, int, str]] = Counter()
    cpu: Counter[str] = Counter()
    mem: Counter[str] = Counter()
    for name, a in plan.assignments.items():
        p = pods[name]
        assert p.eligible_nodes is None or a.node in p.eligible_nodes
        cpu[a.node] += p.cpu_milli
        mem[a.node] += p.memory_mib
        assert {r: len(ix) for r, ix in a.gpus.items()} == {
            r: c for r, c in p.requests.items() if c
        }
        if nodes[a.node].mode is Mode.MPS:  # a container reaches one MPS daemon
            assert sum(len(ix) for ix in a.gpus.values()) == 1, (name, a)
        for resource, gpus in a.gpus.items():
            for g in gpus:
                demand[(a.node, g, resource)] += 1
    for (node_name, g, resource), n in demand.items():
        node = nodes[node_name]
        if node.mode is Mode.MPS:
            continue
        offered = sum(c for (prof, _), c in final[(node_name, g)].items() if mig(prof) == resource)
        assert n <= offered, (node_name, g, resource)
    for name, node in nodes.items():
        assert cpu[name] <= node.cpu_milli_free
        assert mem[name] <= node.memory_mib_free


def test_first_node_by_name_wins() -> None:
    snap = Snapshot(
        nodes=(mig_node("node-b", []), mig_node("node-a", [])),
        pods=(pod("p", mig("3g.40gb")),),
    )
    plan = plan_greedy(snap)
    assert plan.assignments["p"].node == "node-a"
    assert list(plan.layouts) == [("node-a", 0)]
    assert plan.policy == "greedy"


def test_priority_first_then_smallest_slice_first() -> None:
    # One empty GPU: the high-priority 4g goes first, then the 1g before the 3g (smaller).
    snap = Snapshot(
        nodes=(mig_node("n", []),),
        pods=(
            pod("a-3g", mig("3g.40gb")),
            pod("b-1g", mig("1g.10gb")),
            pod("z-4g", mig("4g.40gb"), priority=5),
        ),
    )
    plan = plan_greedy(snap)
    check_plan(snap, plan)
    assert set(plan.assignments) == {"z-4g", "b-1g"}
    assert plan.unplaced["a-3g"].startswith(Unplaced.CAPACITY.value)
    assert plan.layouts[("n", 0)].mig == (("4g.40gb", 0), ("1g.10gb", 6))


def test_free_instance_is_reused_without_churn() -> None:
    snap = Snapshot(
        nodes=(mig_node("n", [("1g.10gb", 0, True), ("2g.20gb", 2, False)]),),
        pods=(pod("p", mig("2g.20gb")),),
    )
    plan = plan_greedy(snap)
    assert plan.assignments["p"].gpus == {mig("2g.20gb"): (0,)}
    assert plan.layouts == {}
    assert plan.stats["gpus_touched"] == 0


def test_used_instances_pinned_and_free_ones_destroyed_when_needed() -> None:
    # GPU 0: a used 1g@0 blocks a 4g; GPU 1: a free 7g is replaced by the 4g.
    snap = Snapshot(
        nodes=(mig_node("n", [("1g.10gb", 0, True)], [("7g.80gb", 0, False)]),),
        pods=(pod("p", mig("4g.40gb")),),
    )
    plan = plan_greedy(snap)
    check_plan(snap, plan)
    assert plan.assignments["p"].gpus == {mig("4g.40gb"): (1,)}
    assert plan.layouts[("n", 1)].mig == (("4g.40gb", 0),)
    assert (plan.stats["instances_created"], plan.stats["instances_destroyed"]) == (1, 1)


def test_layout_tie_break_keeps_free_instances_and_is_canonical() -> None:
    # A free 3g@4 can stay (least churn); the 1g takes its rightmost free start (canonical
    # order leaves slots empty first), on an empty GPU as well.
    snap = Snapshot(
        nodes=(mig_node("n", [("3g.40gb", 4, False)], []),),
        pods=(pod("p", mig("1g.10gb")), pod("q", mig("1g.10gb"), priority=1)),
    )
    plan = plan_greedy(snap)
    assert plan.layouts[("n", 0)].mig == (("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4))
    assert ("n", 1) not in plan.layouts


def test_multi_unit_pod_spans_gpus_on_one_node() -> None:
    snap = Snapshot(
        nodes=(mig_node("n", [("4g.40gb", 0, True)], [("4g.40gb", 0, True)]),),
        pods=(pod("p", mig("3g.40gb"), count=2),),
    )
    plan = plan_greedy(snap)
    check_plan(snap, plan)
    assert plan.assignments["p"].gpus == {mig("3g.40gb"): (0, 1)}


def test_node_cpu_limits_placement_and_reason() -> None:
    snap = Snapshot(
        nodes=(mig_node("n", [], cpu=3000),),
        pods=(
            pod("a", mig("1g.10gb"), cpu_milli=2000),
            pod("b", mig("1g.10gb"), cpu_milli=2000),
        ),
    )
    plan = plan_greedy(snap)
    check_plan(snap, plan)
    assert list(plan.assignments) == ["a"]
    assert plan.unplaced["b"].startswith(Unplaced.NODE_RESOURCES.value)


@pytest.mark.parametrize(
    ("requests", "eligible", "code"),
    [
        ({"nvidia.com/gpu": 1}, None, Unplaced.UNKNOWN_RESOURCE),
        ({mig("1g.10gb"): 1}, frozenset({"elsewhere"}), Unplaced.NO_ELIGIBLE_NODE),
        ({mig("8g.160gb"): 1}, None, Unplaced.EXCEEDS_GPU),
        ({mig("7g.80gb"): 1}, None, Unplaced.CAPACITY),
    ],
)
def test_unplaced_reasons(
    requests: dict[str, int], eligible: frozenset[str] | None, code: Unplaced
) -> None:
    snap = Snapshot(
        nodes=(mig_node("n", [("1g.10gb", 0, True)]),),
        pods=(PendingPod("p", requests, eligible_nodes=eligible),),
    )
    plan = plan_greedy(snap)
    assert plan.unplaced["p"].startswith(code.value), plan.unplaced["p"]


def test_reason_for_a_pod_no_node_accepts_is_summarised_once_per_request_shape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The no-eligible-node summary visits every node of the snapshot; a queue of many pods of
    a few shapes (MPS pods on a MIG cluster) made that pass most of plan()'s time.  Each shape
    (requests, CPU, memory, allowed nodes) is summarised once, and every pod gets the reason
    :func:`planner.demand.eligibility` gives it."""
    import planner.demand
    import planner.greedy

    calls: list[str] = []

    def counting(pod: PendingPod, *args: object) -> object:
        calls.append(pod.name)
        return planner.demand.eligibility(pod, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(planner.greedy, "eligibility", counting)
    nodes = tuple(mig_node(f"n{i}", []) for i in range(5))
    shapes = [
        ({"nvidia.com/gpu-10gb": 1}, 1000, None),
        ({"nvidia.com/gpu-20gb": 1}, 1000, None),
        ({"nvidia.com/gpu-10gb": 1}, 2000, None),
        ({mig("1g.10gb"): 1}, 1000, frozenset({"elsewhere"})),
    ]
    pods = tuple(
        PendingPod(f"p{k}", req, cpu_milli=cpu, eligible_nodes=allowed)
        for k, (req, cpu, allowed) in enumerate(shapes * 6)
    )
    snap = Snapshot(nodes=nodes, pods=pods)
    plan = plan_greedy(snap)
    assert len(calls) == len(shapes), calls
    for p in pods:
        want = planner.demand.eligibility(
            p, nodes, {n.name: A100 for n in nodes}, PlannerSettings()
        )
        assert want.reason is not None
        assert plan.unplaced[p.name] == str(want.reason)


def mps_node(*gpus: tuple[MpsSlice, ...]) -> NodeState:
    return NodeState(
        name="m",
        mode=Mode.MPS,
        model="V100-32GB",
        gpus=tuple(GpuState(i, mps=g) for i, g in enumerate(gpus)),
    )


def test_mps_reserve_splits_units_across_gpus_with_proportional_threads() -> None:
    # 2 x 16 GiB = 32768 MiB > 32768 - 512: one slice per GPU (nos issue #39), so two
    # one-slice pods land on two GPUs.
    snap = Snapshot(
        nodes=(mps_node((), ()),),
        pods=(pod("p", "nvidia.com/gpu-16gb"), pod("q", "nvidia.com/gpu-16gb")),
    )
    plan = plan_greedy(snap)
    check_plan(snap, plan)
    assert sorted(plan.assignments[n].gpus["nvidia.com/gpu-16gb"] for n in "pq") == [(0,), (1,)]
    for g in (0, 1):
        (s,) = plan.layouts[("m", g)].mps
        assert (s.memory_mib, s.thread_percentage) == (16384, 100 * 16384 // 32256)
    # One pod asking for both slices is never split over two GPUs' MPS daemons: a container
    # reaches one daemon (planner.demand.one_mps_slice), so it stays unplaced and nothing changes.
    two = Snapshot(nodes=snap.nodes, pods=(pod("p", "nvidia.com/gpu-16gb", count=2),))
    plan = plan_greedy(two)
    check_plan(two, plan)
    assert not plan.assignments and not plan.layouts
    assert plan.unplaced["p"].startswith(Unplaced.MPS_SLICES.value), plan.unplaced["p"]


def test_mps_full_thread_policy_and_free_slice_removed_only_when_needed() -> None:
    used = MpsSlice(8192, used=True, thread_percentage=25)
    snap = Snapshot(
        nodes=(mps_node((used, MpsSlice(20480), MpsSlice(2048))),),
        pods=(pod("p", "nvidia.com/gpu-16gb"),),
    )
    plan = plan_greedy(snap, PlannerSettings(mps_thread_policy=ThreadPolicy.FULL))
    slices = plan.layouts[("m", 0)].mps
    # 32256 - 8192 - 20480 - 2048 leaves 1536: the 20 GiB free slice goes, the 2 GiB one stays.
    assert sorted((s.memory_mib, s.used) for s in slices) == [
        (2048, False),
        (8192, True),
        (16384, False),
    ]
    assert {s.memory_mib: s.thread_percentage for s in slices}[16384] == 100
    assert plan.stats["instances_destroyed"] == 1


def test_demo_plan() -> None:
    snap = demo_snapshot()
    plan = plan_greedy(snap)
    check_plan(snap, plan)
    assert plan.unplaced.keys() == {"infer/too-big"}
    assert plan.unplaced["infer/too-big"].startswith(Unplaced.EXCEEDS_GPU.value)
    assert plan.assignments["ml/h100-only"].node == "node-c"
    # the two one-slice inference pods (once one pod asking for two 8 GiB slices) both run on
    # the MPS node, each on one GPU's daemon
    for name in ("infer/small-1", "infer/small-2"):
        a = plan.assignments[name]
        assert a.node == "node-d" and a.gpus.keys() == {"nvidia.com/gpu-8gb"}
        assert len(a.gpus["nvidia.com/gpu-8gb"]) == 1
    # the old shape, one pod asking for both slices, is refused with its own reason
    pair = PendingPod("infer/small", {"nvidia.com/gpu-8gb": 2}, cpu_milli=1000)
    snap = Snapshot(snap.nodes, (*snap.pods, pair))
    plan = plan_greedy(snap)
    check_plan(snap, plan)
    assert plan.unplaced["infer/small"].startswith(Unplaced.MPS_SLICES.value)


def test_deterministic_and_independent_of_input_order() -> None:
    snap = mig_benchmark_snapshot(6, seed=3)
    first = plan_greedy(snap)
    rng = random.Random(0)
    nodes, pods = list(snap.nodes), list(snap.pods)
    rng.shuffle(nodes)
    rng.shuffle(pods)
    again = plan_greedy(Snapshot(tuple(nodes), tuple(pods)))
    assert first == again
    check_plan(snap, first)


@pytest.mark.parametrize("seed", range(3))
def test_benchmark_instances_give_valid_plans(seed: int) -> None:
    snap = mig_benchmark_snapshot(12, seed=seed)
    plan = plan_greedy(snap)
    check_plan(snap, plan)
    assert plan.stats["placed"] == len(plan.assignments) > 0


# ---- random small instances --------------------------------------------------------------

ALL_LAYOUTS = list(enumerate_layouts(A100))


@st.composite
def small_snapshots(draw: st.DrawFn) -> Snapshot:
    nodes = []
    for n in range(draw(st.integers(1, 2))):
        gpus = []
        for _ in range(draw(st.integers(1, 3))):
            layout = draw(st.sampled_from(ALL_LAYOUTS))
            used = draw(st.lists(st.booleans(), min_size=len(layout), max_size=len(layout)))
            gpus.append([(p.profile.name, p.start, u) for p, u in zip(layout, used, strict=True)])
        nodes.append(mig_node(f"n{n}", *gpus, cpu=draw(st.sampled_from([2000, 64_000]))))
    pods = [
        pod(
            f"p{i}",
            mig(draw(st.sampled_from(MIG_PROFILES))),
            count=draw(st.integers(1, 2)),
            priority=draw(st.sampled_from([0, 0, 1])),
            cpu_milli=1000,
            eligible_nodes=draw(st.sampled_from([None, frozenset({"n0"})])),
        )
        for i in range(draw(st.integers(0, 8)))
    ]
    return Snapshot(tuple(nodes), tuple(pods))


@settings(max_examples=60, deadline=None)
@given(small_snapshots())
def test_random_instances_give_valid_deterministic_plans(snap: Snapshot) -> None:
    plan = plan_greedy(snap)
    check_plan(snap, plan)
    assert plan_greedy(snap) == plan


def test_plan_checker_rejects_a_moved_used_instance_and_a_phantom_unit() -> None:
    snap = Snapshot(
        nodes=(mig_node("n", [("1g.10gb", 0, True)]),),
        pods=(pod("p", mig("2g.20gb")),),
    )
    good = plan_greedy(snap)
    check_plan(snap, good)
    moved = Plan(
        layouts={("n", 0): PlannedGpu("n", 0, mig=(("1g.10gb", 1), ("2g.20gb", 2)))},
        assignments=good.assignments,
        unplaced={},
    )
    with pytest.raises(AssertionError):
        check_plan(snap, moved)
    phantom = Plan(layouts={}, assignments=good.assignments, unplaced={})
    with pytest.raises(AssertionError):
        check_plan(snap, phantom)
