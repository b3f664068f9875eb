"""The planner at scale: fast eligibility, exact Pareto pruning, neighbourhood (LNS) rounds.

Each fast path is checked against the plain definition it replaces (``eligibility``, a naive
dominance filter), and plans made by neighbourhood rounds are checked for validity against
the snapshot: used instances kept, every unit on a free instance of its profile, node CPU and
memory respected, nothing placed below the greedy plan.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from objective_weights import placement_weights
from test_planner_mps import mps_gpu, mps_node

from planner import (
    GpuState,
    MigInstance,
    Mode,
    MpsSlice,
    NodeState,
    PendingPod,
    Plan,
    PlannerSettings,
    Snapshot,
    Unplaced,
    default_catalog,
    plan,
)
from planner.api import (
    _MIN_ROUND_S,
    _MIN_SOLVE_FRACTION,
    _PLANNED_FRACTION,
    _S_PER_GPU,
    _S_PER_MODEL_GPU,
    _S_PER_POD,
    neighbourhood_gpus,
    round_limits,
    solver_budget,
)
from planner.demand import EligibilityIndex, capacity_reason, eligibility
from planner.geometry import Placement, enumerate_layouts, layout_errors
from planner.greedy import plan_greedy
from planner.mig_cpsat import LayoutOption, candidate_layouts, current_mig, layout_option
from planner.neighbourhood import (
    merge_plans,
    node_chunks,
    packing_chunk,
    restrict,
    spare_capacity,
)
from planner.snapshot import Assignment, PlannedGpu
from simulations.inputs.instances import mig_benchmark_snapshot

CATALOG = default_catalog()
A100 = "A100-SXM4-80GB"
MENUS: list[list[tuple[str, int]]] = [
    [("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)],
    [("4g.40gb", 0), ("3g.40gb", 4)],
    [("1g.10gb", 0), ("1g.10gb", 1), ("2g.20gb", 2), ("3g.40gb", 4)],
    [("7g.80gb", 0)],
    [("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4), ("1g.10gb", 6)],
    [],
]


def busy_cluster(seed: int, n_nodes: int, n_pods: int, gpus: int = 4) -> Snapshot:
    """A100 MIG nodes with used/free instances, mixed pods, some pinned to a node subset."""
    rng = random.Random(seed)
    nodes = []
    for k in range(n_nodes):
        states = []
        for i in range(gpus):
            menu = rng.choice(MENUS)
            states.append(
                GpuState(i, tuple(MigInstance(p, s, used=rng.random() < 0.6) for p, s in menu))
            )
        nodes.append(
            NodeState(
                f"node-{k:03d}",
                Mode.MIG,
                A100,
                tuple(states),
                cpu_milli_free=rng.choice([4000, 16000, 64000]),
                memory_mib_free=rng.choice([16, 256]) * 1024,
            )
        )
    names = [n.name for n in nodes]
    profiles = ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    pods = tuple(
        PendingPod(
            f"pod-{j:03d}",
            {f"nvidia.com/mig-{rng.choice(profiles)}": rng.choice([1, 1, 2])},
            cpu_milli=rng.choice([0, 1000, 4000]),
            memory_mib=rng.choice([0, 8192]),
            priority=rng.choice([0, 0, 5]),
            eligible_nodes=frozenset(rng.sample(names, 2)) if rng.random() < 0.2 else None,
        )
        for j in range(n_pods)
    )
    return Snapshot(tuple(nodes), pods)


def assert_valid(snap: Snapshot, result: Plan) -> None:
    """Every placement rule a plan of a MIG snapshot must keep (module docstring)."""
    assert set(result.assignments).isdisjoint(result.unplaced)
    assert set(result.assignments) | set(result.unplaced) == {p.name for p in snap.pods}
    nodes = {n.name: n for n in snap.nodes}
    free: Counter[tuple[str, int, str]] = Counter()
    for node in snap.nodes:
        model = CATALOG.model(node.model)
        for gpu in node.gpus:
            before = {(model.profile(i.profile).name, i.start) for i in gpu.mig}
            used = {(model.profile(i.profile).name, i.start) for i in gpu.mig if i.used}
            planned = result.layouts.get((node.name, gpu.index))
            after = set(planned.mig) if planned is not None else before
            assert planned is None or after != before, "only changed GPUs are listed"
            assert layout_errors(model, [Placement(s, model.profile(n)) for n, s in after]) == []
            assert used <= after, f"a used instance moved on {node.name}/{gpu.index}"
            for name, _ in after - used:
                free[(node.name, gpu.index, name)] += 1
    taken: Counter[tuple[str, int, str]] = Counter()
    cpu: Counter[str] = Counter()
    mem: Counter[str] = Counter()
    pods = {p.name: p for p in snap.pods}
    for name, a in result.assignments.items():
        pod = pods[name]
        assert pod.eligible_nodes is None or a.node in pod.eligible_nodes
        model = CATALOG.model(nodes[a.node].model)
        assert set(a.gpus) == {r for r, c in pod.requests.items() if c}
        for res, indices in a.gpus.items():
            assert len(indices) == pod.requests[res]
            for index in indices:
                profile = model.profile(res.removeprefix("nvidia.com/mig-")).name
                taken[(a.node, index, profile)] += 1
        cpu[a.node] += pod.cpu_milli
        mem[a.node] += pod.memory_mib
    for key, n in taken.items():
        assert n <= free[key], f"{key}: {n} units on {free[key]} free instances"
    for name in cpu:
        assert cpu[name] <= nodes[name].cpu_milli_free
        assert mem[name] <= nodes[name].memory_mib_free


def weight(result: Plan, snap: Snapshot) -> int:
    w = placement_weights(snap.pods)
    return sum(w[n] for n in result.assignments)


# --------------------------------------------------------------------------- eligibility


@st.composite
def mixed_snapshots(draw: st.DrawFn) -> Snapshot:
    """MIG, hybrid and MPS nodes of several models, and pods of every kind (also invalid)."""
    models = ["A100-SXM4-80GB", "H100-80GB", "A30", "V100-32GB"]
    nodes = []
    for k in range(draw(st.integers(1, 6))):
        model = draw(st.sampled_from(models))
        mode = Mode.MPS if model == "V100-32GB" else draw(st.sampled_from(list(Mode)))
        gpus = tuple(GpuState(i) for i in range(draw(st.integers(0, 3))))
        nodes.append(
            NodeState(
                f"n{k}",
                mode,
                model,
                gpus,
                cpu_milli_free=draw(st.sampled_from([1000, 8000])),
                memory_mib_free=draw(st.sampled_from([4096, 65536])),
                gpu_memory_mib=draw(st.sampled_from([None, 16384])) if mode is Mode.MPS else None,
            )
        )
    resources = [
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/mig-7g.80gb",
        "nvidia.com/mig-1g.6gb",
        "nvidia.com/mig-4g.24gb",
        "nvidia.com/gpu-8gb",
        "nvidia.com/gpu-40gb",
        "example.com/fpga",
    ]
    names = [n.name for n in nodes] + ["elsewhere"]
    pods = []
    for j in range(draw(st.integers(1, 12))):
        requests = draw(
            st.dictionaries(st.sampled_from(resources), st.integers(0, 3), min_size=1, max_size=2)
        )
        allowed = draw(st.one_of(st.none(), st.frozensets(st.sampled_from(names), max_size=3)))
        pods.append(
            PendingPod(
                f"p{j}",
                requests,
                cpu_milli=draw(st.sampled_from([0, 2000, 16000])),
                memory_mib=draw(st.sampled_from([0, 8192])),
                eligible_nodes=allowed,
            )
        )
    return Snapshot(tuple(nodes), tuple(pods))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_snapshots())
def test_eligibility_index_matches_eligibility(snap: Snapshot) -> None:
    models = {n.name: CATALOG.model(n.model) for n in snap.nodes}
    s = PlannerSettings()
    index = EligibilityIndex(snap.nodes, models, s)
    for pod in snap.pods:
        want = eligibility(pod, snap.nodes, models, s)
        got = index.of(pod)
        assert list(got.demands.items()) == list(want.demands.items())
        assert got.reason == want.reason
        assert index.eligible_names(pod) == list(want.demands)


# --------------------------------------------------------------------------- Pareto pruning


def naive_front(options: list[LayoutOption], keys: list[str]) -> list[LayoutOption]:
    """The dominance rule of the mig_cpsat docstring, applied pairwise (ties keep the first)."""

    def vec(o: LayoutOption) -> tuple[int, ...]:
        return tuple(o.free.get(k, 0) for k in keys)

    def dominates(a: LayoutOption, b: LayoutOption) -> bool:
        return (
            a.churn <= b.churn
            and a.useful >= b.useful
            and all(x >= y for x, y in zip(vec(a), vec(b), strict=True))
        )

    order = sorted(
        range(len(options)),
        key=lambda i: (options[i].churn, -options[i].useful, [-f for f in vec(options[i])], i),
    )
    kept: list[int] = []
    for i in order:
        if i == 0 or not any(dominates(options[j], options[i]) for j in kept):
            kept.append(i)
    return [options[i] for i in sorted(kept)]


@pytest.mark.parametrize("menu", range(len(MENUS)))
@pytest.mark.parametrize("used_mask", [0, 1, 2, 5])
def test_packed_pareto_front_equals_the_naive_filter(menu: int, used_mask: int) -> None:
    model = CATALOG.model(A100)
    gpu = GpuState(
        0,
        tuple(
            MigInstance(p, s, used=bool(used_mask >> k & 1)) for k, (p, s) in enumerate(MENUS[menu])
        ),
    )
    node = NodeState("n", Mode.MIG, A100, (gpu,))
    current = current_mig(node, gpu, model)
    needed = frozenset(model.profile(p) for p in ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"))
    s = PlannerSettings()
    got = candidate_layouts(model, current, needed, s)
    # every candidate the enumeration offers, scored the same way, then filtered naively
    names = frozenset(p.name for p in needed)
    addable = set(needed) | {p.profile for p in current.layout if p not in current.used}
    everything = [layout_option(model, current, current.layout, names, s)] + [
        layout_option(model, current, lay, names, s)
        for lay in enumerate_layouts(model, sorted(current.used), addable)
        if lay != current.layout
    ]
    want = naive_front(everything, sorted(names))
    assert [o.layout for o in got] == [o.layout for o in want]
    assert got[0].layout == current.layout


# --------------------------------------------------------------------------- neighbourhoods


def test_node_chunks_partition_the_nodes_most_spare_first() -> None:
    snap = busy_cluster(3, 9, 0, gpus=4)
    models = {n.name: CATALOG.model(n.model) for n in snap.nodes}
    spare = spare_capacity(snap, models, PlannerSettings())
    chunks = node_chunks(snap, spare, 8)
    assert sorted(n for c in chunks for n in c) == sorted(n.name for n in snap.nodes)
    assert all(len(c) == 2 for c in chunks[:-1])  # 2 nodes x 4 GPUs = the cap of 8
    firsts = [min(spare[n] for n in c) for c in chunks]
    lasts = [max(spare[n] for n in c) for c in chunks]
    assert all(a >= b for a, b in zip(firsts, lasts[1:], strict=False))
    assert node_chunks(snap, spare, 36) == [frozenset(n.name for n in snap.nodes)]


def _mps_nodes(used_gb: list[int], gpus: int = 4) -> tuple[NodeState, ...]:
    """MPS A100 nodes ``n00, n01, ...``: node ``k`` has a used slice of ``used_gb[k]`` GiB on
    GPU 0 (none for 0), its other GPUs empty."""
    return tuple(
        mps_node(
            f"n{k:02d}",
            mps_gpu(0, (gb, True)) if gb else mps_gpu(0),
            *(mps_gpu(i) for i in range(1, gpus)),
        )
        for k, gb in enumerate(used_gb)
    )


def test_greedy_visits_nodes_by_the_rank_it_is_given() -> None:
    nodes = _mps_nodes([0, 0, 60, 30])
    pod = PendingPod("p", {"nvidia.com/gpu-10gb": 1})
    snap = Snapshot(nodes, (pod,))
    assert plan_greedy(snap).assignments["p"].node == "n00"  # nos: first by name
    rank = {"n00": 4.0, "n01": 4.0, "n02": 3.2, "n03": 3.6}
    assert plan_greedy(snap, node_rank=rank).assignments["p"].node == "n02"
    # the rank orders the visit; a node the pod does not fit is still skipped
    full = _mps_nodes([0, 79])
    got = plan_greedy(Snapshot(full, (pod,)), node_rank={"n01": 0.0, "n00": 1.0})
    assert got.assignments["p"].node == "n01"  # 79 GiB used on GPU 0, GPUs 1-3 empty


def test_a_large_snapshot_places_a_pod_where_the_exact_model_does() -> None:
    # 24 nodes x 4 GPUs = 96 GPUs, more than the model's 16: neighbourhood rounds.  Empty
    # nodes come first by name (nos's greedy puts the pod on n00); n20-n23 have 40-70 GiB
    # used on GPU 0.  The rounds must find what one exact model over every GPU finds.
    nodes = _mps_nodes([0] * 20 + [40, 50, 60, 70])
    snap = Snapshot(nodes, (PendingPod("p", {"nvidia.com/gpu-9gb": 1}),))
    exact = plan(snap, PlannerSettings(max_model_gpus=96, time_limit_s=2.0), CATALOG)
    assert exact.status == "OPTIMAL" and exact.assignments["p"].node in {"n20", "n21", "n22", "n23"}
    rounds = plan(snap, PlannerSettings(max_model_gpus=16, time_limit_s=2.0), CATALOG)
    assert rounds.stats["neighbourhoods"] > 1
    assert rounds.assignments == exact.assignments and rounds.layouts == exact.layouts


def test_the_packing_neighbourhood_is_the_warm_starts_nodes_then_the_tightest() -> None:
    nodes = _mps_nodes([0, 0, 40, 70, 79, 79, 10])
    models = {n.name: CATALOG.model(n.model) for n in nodes}
    s = PlannerSettings()
    pods = (
        PendingPod(
            "a",
            {"nvidia.com/gpu-5gb": 1},
            eligible_nodes=frozenset(nodes[i].name for i in (0, 2, 3, 5, 6)),
        ),
    )
    snap = Snapshot(nodes, pods)
    spare = spare_capacity(snap, models, s)
    warm = Plan(
        layouts={},
        assignments={"a": Assignment("n00", {"nvidia.com/gpu-5gb": (0,)})},
        unplaced={},
    )
    # n00 (where the warm start placed the pod) first, then room by least spare: n05 (GPU 0
    # almost full), n03, n02; n04 is not eligible for any pod; 4 nodes x 4 GPUs = the cap
    assert packing_chunk(snap, warm, spare, 16) == frozenset({"n00", "n05", "n03", "n02"})
    assert packing_chunk(snap, warm, spare, 4) == frozenset({"n00"})
    chunks = node_chunks(snap, spare, 8, frozenset({"n00", "n05"}))
    assert chunks[0] == frozenset({"n00", "n05"})
    assert sorted(n for c in chunks for n in c) == sorted(n.name for n in nodes)
    assert all(c.isdisjoint(chunks[0]) for c in chunks[1:])


def test_restrict_and_merge_keep_the_fixed_part() -> None:
    snap = busy_cluster(5, 6, 30)
    greedy = plan_greedy(snap)
    names = frozenset({"node-000", "node-001"})
    nb = restrict(snap, greedy, names, pod_cap=100)
    assert not nb.whole
    assert {n.name for n in nb.snapshot.nodes} == names
    pods = {p.name for p in nb.snapshot.pods}
    on_n = {p for p, a in greedy.assignments.items() if a.node in names}
    assert on_n <= pods
    assert all(p in on_n or p in greedy.unplaced for p in pods)
    assert set(nb.warm_start.assignments) == on_n
    # a part that places nothing: everything outside the neighbourhood is greedy's
    empty = Plan(layouts={}, assignments={}, unplaced={p: "capacity: test" for p in pods})
    merged = merge_plans(greedy, nb, empty)
    assert {p for p in merged.assignments} == set(greedy.assignments) - on_n
    assert all(k[0] not in names for k in merged.layouts)
    assert all(merged.layouts[k] == v for k, v in greedy.layouts.items() if k[0] not in names)
    # and what the part decides replaces greedy's decisions inside it
    part = Plan(
        layouts={("node-000", 0): PlannedGpu("node-000", 0, mig=(("7g.80gb", 0),))},
        assignments={},
        unplaced=empty.unplaced,
    )
    assert merge_plans(greedy, nb, part).layouts[("node-000", 0)].mig == (("7g.80gb", 0),)


@pytest.mark.parametrize("seed", [1, 2])
def test_neighbourhood_rounds_give_a_valid_plan_at_least_as_good_as_greedy(seed: int) -> None:
    snap = busy_cluster(seed, 12, 50)
    s = PlannerSettings(time_limit_s=1.5, max_model_gpus=12)
    result = plan(snap, s)
    greedy = plan_greedy(snap, s)
    assert result.policy == "cpsat" and result.status == "FEASIBLE"
    assert result.stats["rounds"] >= 1
    assert_valid(snap, result)
    assert weight(result, snap) >= weight(greedy, snap)
    # unplaced reasons name eligible nodes across the whole cluster, not one neighbourhood
    index = EligibilityIndex(snap.nodes, {n.name: CATALOG.model(n.model) for n in snap.nodes}, s)
    rooms = 0
    for name, reason in result.unplaced.items():
        if reason.startswith(("capacity", "node cpu/memory")):
            rooms += 1
            pod = next(p for p in snap.pods if p.name == name)
            assert reason == capacity_reason(pod, index.eligible_names(pod))
    assert rooms > 0


def test_benchmark_instance_in_rounds_is_valid_and_not_below_greedy() -> None:
    snap = mig_benchmark_snapshot(20, seed=4)
    s = PlannerSettings(time_limit_s=1.0, max_model_gpus=48)
    result = plan(snap, s)
    assert result.stats["neighbourhoods"] == 4  # 160 GPUs in chunks of 48
    assert_valid(snap, result)
    assert weight(result, snap) >= weight(plan_greedy(snap, s), snap)
    assert result.stats["placed_weight"] <= result.stats["placed_weight_bound"]


def test_small_snapshots_get_one_exact_model() -> None:
    snap = busy_cluster(7, 3, 10)
    result = plan(snap, PlannerSettings(time_limit_s=5.0))
    assert result.status == "OPTIMAL"
    assert "neighbourhoods" not in result.stats


def test_mps_nodes_take_part_in_rounds() -> None:
    # three one-slice MPS pods: a 60 GiB one needs an empty GPU (GPU 0 of each MPS node has
    # 39.5 GiB left beside its used slice), the two 20 GiB ones fit anywhere; a pod asking
    # for two 20 GiB slices (two GPUs' daemons) is refused whatever the rounds do
    gib = 1024
    mps = tuple(
        NodeState(
            f"mps-{k}",
            Mode.MPS,
            A100,
            (GpuState(0, mps=(MpsSlice(40 * gib, used=True),)), GpuState(1)),
        )
        for k in range(3)
    )
    snap = busy_cluster(9, 4, 12)
    mine = {"mps-60": 60, "mps-20a": 20, "mps-20b": 20}
    pods = (
        *snap.pods,
        *(PendingPod(name, {f"nvidia.com/gpu-{gb}gb": 1}) for name, gb in mine.items()),
        PendingPod("mps-pair", {"nvidia.com/gpu-20gb": 2}),
    )
    snap = Snapshot((*snap.nodes, *mps), pods)
    result = plan(snap, PlannerSettings(time_limit_s=1.5, max_model_gpus=8))
    assert result.stats["neighbourhoods"] >= 2 and result.stats["rounds"] >= 1
    for name, gb in mine.items():
        a = result.assignments.get(name)
        assert isinstance(a, Assignment), result.unplaced.get(name)
        assert a.node.startswith("mps-")
        ((resource, gpus),) = a.gpus.items()
        assert resource == f"nvidia.com/gpu-{gb}gb" and len(gpus) == 1
    assert result.assignments["mps-60"].gpus == {"nvidia.com/gpu-60gb": (1,)}
    assert result.unplaced["mps-pair"].startswith(Unplaced.MPS_SLICES.value)


def test_time_budget_stays_within_the_time_limit() -> None:
    s = PlannerSettings(time_limit_s=1.0)
    small = solver_budget(s, 80, 24)
    assert 0.7 < small < _PLANNED_FRACTION
    assert round_limits(small, [80]) == [pytest.approx(small - _S_PER_MODEL_GPU * 80)]
    budget = solver_budget(s, 8000, 2400)
    size = neighbourhood_gpus(s, budget)
    assert 8 <= size < s.max_model_gpus  # a short budget gets smaller neighbourhoods
    assert neighbourhood_gpus(s, 10.0) == s.max_model_gpus
    big = round_limits(budget, [size] * (8000 // size))
    assert len(big) >= 1
    overhead = _S_PER_GPU * 8000 + _S_PER_POD * 2400 + _S_PER_MODEL_GPU * size * len(big)
    assert sum(big) + overhead <= _PLANNED_FRACTION * s.time_limit_s + 1e-9
    assert len(big) >= 2, "the 1000-node benchmark budget buys more than one round"
    many = round_limits(solver_budget(s, 800, 240), [96] * 9)
    assert len(many) > 1
    assert all(limit >= _MIN_ROUND_S for limit in [*many, *big])
    # a starved budget still gives the solver a floor share of the limit
    starved = PlannerSettings(time_limit_s=0.1)
    assert solver_budget(starved, 8000, 2400) == pytest.approx(0.1 * _MIN_SOLVE_FRACTION)


def test_an_invalid_warm_start_is_ignored_in_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    snap = busy_cluster(11, 6, 20)
    used = next((n.name, g.index) for n in snap.nodes for g in n.gpus if any(i.used for i in g.mig))
    bad = Plan(  # drops a used instance: api must not build on this plan
        layouts={used: PlannedGpu(used[0], used[1], mig=())},
        assignments={},
        unplaced={p.name: "capacity: greedy" for p in snap.pods},
    )
    monkeypatch.setattr("planner.api.plan_greedy", lambda *_, **__: bad)
    result = plan(snap, PlannerSettings(time_limit_s=1.5, max_model_gpus=8))
    assert_valid(snap, result)
    assert result.assignments
