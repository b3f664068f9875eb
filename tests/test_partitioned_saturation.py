"""The partitioned-mode saturation protocol (simulations.saturation.partitioned).

Hand-computed allocations on one-GPU clusters, a brute-force check of the MIG upper bound,
the bound above every MIG row on random small instances, used instances never moving, and
determinism for a seed.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.catalog import default_catalog
from planner.settings import PlannerSettings, Policy
from planner.snapshot import Mode, Plan, Snapshot
from simulations.bench_partitioned import markdown, summarise, targets
from simulations.inputs.cluster import Cluster, Node
from simulations.inputs.mapping import HybridThreshold, MappingError, make_mapping
from simulations.inputs.workload import Pod, Workload
from simulations.replay.static_layouts import StaticPolicy, maximal_layouts
from simulations.saturation.partitioned import (
    GPU_MODEL,
    PartitionedState,
    PlanViolation,
    hybrid_support,
    mig_upper_bound,
    run_planned,
    run_static,
)

MODEL = default_catalog().model(GPU_MODEL)


def cluster(*gpus: int, cpu: int = 64000, label: str = "T4") -> Cluster:
    return Cluster(
        "test",
        tuple(
            Node(f"n{i}", cpu, 1 << 20, g, model=label, catalog_model="T4")
            for i, g in enumerate(gpus)
        ),
    )


def pod(
    name: str, milli: int, num_gpu: int = 1, cpu: int = 1000, spec: tuple[str, ...] = ()
) -> Pod:
    if milli == 0:
        return Pod(name, cpu)
    return Pod(name, cpu, 0, num_gpu, milli, spec)


def workload(*pods: Pod) -> Workload:
    return Workload("w", tuple(pods))


def mig_run(c: Cluster, arrivals: list[Pod], policy: Policy, **kw: object):  # type: ignore[no-untyped-def]
    return run_planned(
        c, workload(*arrivals), Mode.MIG, "mig-compute", 1, policy=policy, arrivals=arrivals, **kw
    )


@pytest.mark.parametrize("policy", [Policy.GREEDY, Policy.CPSAT])
def test_one_gpu_mig_by_hand(policy: Policy) -> None:
    # 470 -> 4g, 320 -> 3g: 4g@0 + 3g@4 fill the GPU; the whole-GPU pod then fails
    arrivals = [pod("a", 470), pod("b", 320), pod("c", 1000)]
    r = mig_run(cluster(1), arrivals, policy)
    assert (r.placed, r.failed) == (2, 1)
    assert r.used.tolist() == [470, 790, 790]
    assert r.arrived.tolist() == [470, 790, 1790]
    assert r.failed_gpu_milli == 1000
    # every compute slice held; 790 of the 1000 milli they stand for are requested
    assert (r.extra["slices_used_pct"], r.extra["fill_pct"]) == (100.0, 79.0)


@pytest.mark.parametrize("policy", [Policy.GREEDY, Policy.CPSAT])
def test_3g_first_keeps_slot_zero_for_4g(policy: Policy) -> None:
    # a 3g placed at 0 would block the 4g (4g starts at 0 only); both planners put it at 4
    r = mig_run(cluster(1), [pod("a", 320), pod("b", 470)], policy)
    assert r.used.tolist() == [320, 790]
    # two 3g fill both halves; the 4g then has nowhere to go
    r = mig_run(cluster(1), [pod("a", 320), pod("b", 370), pod("c", 470)], policy)
    assert r.used.tolist() == [320, 690, 690]


def test_batch_of_two_is_planned_together() -> None:
    # a batch holding both pods: CP-SAT places both (4g@0 + 3g@4) whatever the order
    arrivals = [pod("a", 320), pod("b", 470)]
    r = mig_run(cluster(1), arrivals, Policy.CPSAT, batch=2)
    assert r.placed == 2 and r.extra["planner_calls"] == 1


def test_mps_one_gpu_by_hand() -> None:
    # mps-memory on an A100-80GB: 79 GiB usable; 500 milli -> 39 GiB, 100 milli -> 7 GiB
    arrivals = [pod("a", 500), pod("b", 500), pod("c", 100)]
    r = run_planned(cluster(1), workload(*arrivals), Mode.MPS, "mps-memory", 1, arrivals=arrivals)
    # a pod counts the slice's share of the 81,408 usable MiB, not more than it got: 39 GiB is
    # 39936 * 1000 // 81408 = 490 milli (500 credited a GPU with more than it holds)
    assert r.used.tolist() == [490, 980, 980]
    assert r.extra["prefiltered_failures"] == 1  # 78 GiB used: no room for 7 GiB
    assert r.extra["slices_used_pct"] == pytest.approx(
        100 * 78 * 1024 / (80 * 1024 - 512), abs=1e-3
    )


def test_cpu_only_pods_take_cpu_and_count_zero() -> None:
    # the CPU-only pod takes all the node's CPU: the GPU pod then fits nowhere
    arrivals = [pod("cpu", 0, cpu=64000), pod("a", 320)]
    r = mig_run(cluster(1), arrivals, Policy.GREEDY)
    assert (r.placed, r.failed) == (1, 1)
    assert r.used.tolist() == [0, 0]


def test_gpu_spec_restricts_nodes() -> None:
    c = Cluster(
        "two",
        (
            Node("a", 64000, 1 << 20, 1, model="T4"),
            Node("b", 64000, 1 << 20, 1, model="P100"),
        ),
    )
    arrivals = [pod("x", 1000, spec=("T4",)), pod("y", 1000, spec=("T4",)), pod("z", 1000)]
    r = mig_run(c, arrivals, Policy.CPSAT)
    assert r.used.tolist() == [1000, 1000, 2000]


def test_multi_gpu_pod_needs_whole_gpus_on_one_node() -> None:
    c = cluster(2, 2)
    arrivals = [pod("s", 100), pod("m", 1000, num_gpu=2), pod("m2", 1000, num_gpu=2)]
    r = mig_run(c, arrivals, Policy.CPSAT)
    # the 1g takes a GPU of one node; one 2-GPU pod fits on the other node, the next fails
    assert r.used.tolist() == [100, 2100, 2100]


def test_static_layout_by_hand() -> None:
    all_3g = StaticPolicy("3g", ((1.0, (("3g", 0), ("3g", 4))),))
    arrivals = [pod("a", 470), pod("b", 320), pod("c", 370), pod("d", 300)]
    r = run_static(cluster(1), workload(*arrivals), all_3g, 1, arrivals=arrivals)
    assert r.used.tolist() == [0, 320, 690, 690]


def _brute_force_bound(gpus: int, arrivals: list[Pod]) -> int:
    """Most GPU-milli of a subset of pods that some choice of maximal layouts can hold."""
    mapper = make_mapping("mig-compute", MODEL)
    reqs = [(mapper.map(p), p.total_gpu_milli) for p in arrivals if not p.is_cpu_only]
    layouts = [Counter(s for s, _ in lay) for lay in maximal_layouts(MODEL)]
    supplies = []
    for combo in itertools.combinations_with_replacement(range(len(layouts)), gpus):
        total: Counter[str] = Counter()
        for i in combo:
            total.update(layouts[i])
        supplies.append(total)
    best = 0
    for mask in range(1 << len(reqs)):
        need: Counter[str] = Counter()
        value = 0
        for i, (req, v) in enumerate(reqs):
            if mask >> i & 1:
                assert req is not None and req.profile is not None
                need[MODEL.profile(req.profile).shape] += req.count
                value += v
        if value > best and any(all(s[k] >= n for k, n in need.items()) for s in supplies):
            best = value
    return best


MILLI = st.sampled_from([110, 160, 230, 320, 470, 550, 650, 810, 1000])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpus=st.integers(1, 2), millis=st.lists(MILLI, min_size=1, max_size=7))
def test_upper_bound_matches_brute_force(gpus: int, millis: list[int]) -> None:
    arrivals = [pod(f"p{i}", m) for i, m in enumerate(millis)]
    ub = mig_upper_bound(cluster(gpus), arrivals)
    assert ub.optimal
    assert ub.milli == _brute_force_bound(gpus, arrivals)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpus=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    millis=st.lists(MILLI, min_size=2, max_size=14),
    multi=st.integers(0, 2),
    seed=st.integers(0, 1000),
)
def test_upper_bound_above_every_mig_row(
    gpus: list[int], millis: list[int], multi: int, seed: int
) -> None:
    c = cluster(*gpus, cpu=8000)
    arrivals = [pod(f"p{i}", m) for i, m in enumerate(millis)]
    arrivals += [pod(f"m{i}", 1000, num_gpu=2) for i in range(multi)]
    random.Random(seed).shuffle(arrivals)
    ub = mig_upper_bound(c, arrivals)
    finals = [
        mig_run(c, arrivals, Policy.GREEDY).used[-1],
        mig_run(c, arrivals, Policy.CPSAT).used[-1],
        mig_run(c, arrivals, Policy.CPSAT, batch=3).used[-1],
    ]
    for static in (
        StaticPolicy("3g", ((1.0, (("3g", 0), ("3g", 4))),)),
        StaticPolicy("mix", ((1.0, (("4g", 0), ("2g", 4), ("1g", 6))), (1.0, (("7g", 0),)))),
    ):
        finals.append(run_static(c, workload(*arrivals), static, seed, arrivals=arrivals).used[-1])
    assert all(f <= ub.milli for f in finals), (finals, ub)


def _random_arrivals(seed: int, n: int) -> list[Pod]:
    rng = random.Random(seed)
    millis = [110, 160, 230, 320, 470, 550, 810, 1000, 0]
    out = []
    for i in range(n):
        m = rng.choice(millis)
        out.append(pod(f"p{i}", m, cpu=rng.choice([1000, 4000, 8000])))
    return out


@pytest.mark.parametrize(("mode", "mapping"), [(Mode.MIG, "mig-compute"), (Mode.MPS, "mps-memory")])
@pytest.mark.parametrize("batch", [1, 3])
def test_used_instances_never_move(mode: Mode, mapping: str, batch: int) -> None:
    c = cluster(2, 3, 1, cpu=32000)
    arrivals = _random_arrivals(7, 40)
    history: list[tuple[set[tuple[str, int, str, int]], Counter[tuple[str, int, int]]]] = []

    def record(state: PartitionedState) -> None:
        history.append((state.used_instances(), state.used_slices()))

    r = run_planned(
        c, workload(*arrivals), mode, mapping, 3, batch=batch, arrivals=arrivals, on_batch=record
    )
    assert r.placed > 0 and len(history) == -(-len(arrivals) // batch)
    for (mig_a, mps_a), (mig_b, mps_b) in itertools.pairwise(history):
        assert mig_a <= mig_b
        assert not (mps_a - mps_b)
    used_units = len(history[-1][0]) if mode is Mode.MIG else history[-1][1].total()
    assert used_units == sum(p.num_gpu for p in arrivals if not p.is_cpu_only) - sum(
        p.num_gpu
        for p, ok in zip(arrivals, r.extra["placed_flags"].tolist(), strict=True)
        if not ok and not p.is_cpu_only
    )


def test_a_plan_that_moves_a_used_instance_is_rejected() -> None:
    c = cluster(1)
    arrivals = [pod("a", 320), pod("b", 320)]

    def mover(snapshot: Snapshot, settings: PlannerSettings) -> Plan:
        from planner.api import plan

        result = plan(snapshot, settings)
        if any(i.used for n in snapshot.nodes for g in n.gpus for i in g.mig):
            # destroy everything and re-create the second 3g where the first one was used
            from planner.snapshot import PlannedGpu

            node = snapshot.nodes[0].name
            layouts = {(node, 0): PlannedGpu(node, 0, mig=(("3g.40gb", 0),))}
            return Plan(layouts, result.assignments, result.unplaced)
        return result

    with pytest.raises(PlanViolation, match="drops used instances"):
        mig_run(c, arrivals, Policy.GREEDY, planner=mover)


@pytest.mark.parametrize("policy", [Policy.GREEDY, Policy.CPSAT])
def test_deterministic_for_a_seed(policy: Policy) -> None:
    c = cluster(2, 2, cpu=32000)
    pods = tuple(_random_arrivals(11, 12))
    w = workload(*pods)
    runs = [run_planned(c, w, Mode.MIG, "mig-compute", 5, policy=policy) for _ in range(2)]
    assert runs[0].used.tolist() == runs[1].used.tolist()
    assert runs[0].arrived.tolist() == runs[1].arrived.tolist()
    other = run_planned(c, w, Mode.MIG, "mig-compute", 6, policy=policy)
    # a different seed draws a different arrival list (130 % of 4 GPUs)
    assert other.arrived.tolist() != runs[0].arrived.tolist()


def test_hybrid_support_reports_a_reason() -> None:
    ok, why = hybrid_support()
    assert isinstance(ok, bool) and why

    def broken(snapshot: Snapshot, settings: PlannerSettings) -> Plan:
        raise ValueError("hybrid nodes are planned as MIG")

    ok, why = hybrid_support(broken)
    assert not ok and "hybrid nodes are planned as MIG" in why


def test_hybrid_threshold_mapping() -> None:
    m = make_mapping("hybrid-threshold:500", MODEL)
    assert isinstance(m, HybridThreshold)
    big, small, whole = m.map(pod("a", 500)), m.map(pod("b", 499)), m.map(pod("c", 1000, 2))
    assert big is not None and big.kind == "mig" and big.profile == "4g.40gb"
    assert small is not None and small.kind == "mps" and small.memory_gb == 39
    assert whole is not None and whole.kind == "mig" and whole.count == 2
    assert m.map(pod("cpu", 0)) is None
    with pytest.raises(MappingError):
        make_mapping("hybrid-threshold:0", MODEL)
    with pytest.raises(MappingError):
        make_mapping("hybrid-threshold:x", MODEL)


def test_summary_and_targets() -> None:
    recs = [
        {
            "trace": "t",
            "row": "mig-cpsat",
            "seed": s,
            "alloc@130": v,
            "failed": 1,
            "pods": 9,
            "runtime_s": 1.0,
            "plan_s": [0.01, 0.03],
        }
        for s, v in ((1, 90.0), (2, 92.0))
    ]
    recs += [
        {
            "trace": "t",
            "row": "mig-greedy",
            "seed": 1,
            "alloc@130": 86.0,
            "failed": 2,
            "pods": 9,
            "runtime_s": 1.0,
        },
        {
            "trace": "t",
            "row": "mig-bound",
            "seed": 1,
            "alloc@130": 95.0,
            "failed": None,
            "optimal": True,
            "runtime_s": 0.1,
        },
        {"trace": "t", "row": "hybrid", "seed": 1, "unsupported": "no"},
    ]
    rows = summarise(recs)
    assert rows["mig-cpsat"]["alloc@130"] == 91.0
    assert rows["mig-cpsat"]["per_seed_alloc@130"] == [90.0, 92.0]
    assert rows["hybrid"]["status"] == "unsupported"
    t = targets(rows)
    assert t["mig_cpsat_ge_greedy_plus_3"] is True
    assert t["mig_cpsat_ge_97pct_bound"] is False
    assert t["hybrid_ge_cpsat_plus_10"] == "unsupported"
    doc = {
        "date": "d",
        "seeds": [1, 2],
        "batch": 1,
        "neighbourhood_gpus": 96,
        "partitioned_cluster": "c",
        "traces": {"t": {"rows": rows}},
    }
    table = markdown(doc)
    assert "| t | mig-cpsat | 91.00 ± 1.41 | 90.00, 92.00 | 1 | 20.0 / 30.0 | 1 |" in table
    assert "| t | hybrid | unsupported |" in table


def test_hybrid_row_places_small_shares_inside_instances() -> None:
    ok, why = hybrid_support()
    if not ok:
        pytest.skip(f"planner without hybrid planning: {why}")
    # 500 -> a 4g instance (whole); 100 and 200 -> 7 and 15 GiB MPS slices inside an instance
    arrivals = [pod("a", 500), pod("b", 100), pod("c", 200), pod("d", 1000)]
    history: list[tuple[set[tuple[str, int, str, int]], Counter[tuple[str, int, int, int]]]] = []

    def record(state: PartitionedState) -> None:
        history.append((state.used_instances(), state.used_slices()))
        for n in state.nodes:
            for g in n.gpus:
                for i in g.mig:
                    assert not (i.used and getattr(i, "mps", ())), "a whole instance hosts slices"

    r = run_planned(
        cluster(1),
        workload(*arrivals),
        Mode.HYBRID,
        "hybrid-threshold:500",
        1,
        arrivals=arrivals,
        on_batch=record,
    )
    # the 4g instance counts the 500 asked; the 7 and 15 GiB slices 88 and 188 milli of the
    # GPU's 81,408 usable MiB (7168 * 1000 // 81408, 15360 * 1000 // 81408), under the 100
    # and 200 asked
    assert r.used.tolist() == [500, 588, 776, 776]
    assert history[-1][1].total() == 2 and all(k[2] >= 0 for k in history[-1][1])
    for (mig_a, mps_a), (mig_b, mps_b) in itertools.pairwise(history):
        assert mig_a <= mig_b and not (mps_a - mps_b)


def test_no_gpu_counts_more_than_it_holds() -> None:
    """``mps-memory`` rounds a share down to whole GiB (so shares that fit together still
    fit): a 550- and a 460-milli pod both fit one GPU, and crediting what they asked made it
    101 % allocated.  Each counts its slice's share, and a GPU never more than 1000."""
    from simulations.inputs.cluster import Cluster, Node
    from simulations.inputs.workload import Pod, Workload
    from simulations.saturation.mps_rules import run_rule

    one = Cluster("one", (Node("n0", 96000, 400000, 1, model="A100-SXM4-80GB"),))
    pods = (Pod("a", 1000, 1000, 1, 550), Pod("b", 1000, 1000, 1, 460))
    wl = Workload("w", pods)
    results = [run_rule(one, wl, rule, 42, arrivals=list(pods), target=1.3) for rule in ("bestfit", "fgd")]
    results.append(run_planned(one, wl, Mode.MPS, "mps-memory", 42, arrivals=list(pods)))
    for r in results:
        assert r.placed == 2
        assert r.used[-1] == 44032 * 1000 // 81408 + 36864 * 1000 // 81408  # 43 + 36 GiB
        assert r.final_alloc_pct <= 100.0
