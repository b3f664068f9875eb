"""The packing polish of MPS placements (planner/mps_polish.py).

The measure by hand (CPU gate, CPU cap on the GPUs a shape can use, expected waste); the
target's precedence; and a brute-force oracle written from the module docstring, not from the
code: for one pending pod on random MPS nodes, the planner puts it where the quantised change
of the node measure is best (ties: earlier node, then the lower GPU index; within a node the
GPU with the smallest measure after, then the fullest), never adds churn, and keeps every used
slice, CPU, memory and eligibility.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import (
    GpuState,
    Mode,
    MpsSlice,
    NodeState,
    PendingPod,
    PlannerSettings,
    Snapshot,
    Unplaced,
    plan,
)
from planner.catalog import GpuModel, default_catalog
from planner.mps_polish import NodeMeasure, Shape, polish_evals, polish_mps, polish_target
from planner.snapshot import Assignment, Plan, PlannedGpu, PlannedSlice, mps_gb_of

A100 = "A100-SXM4-80GB"
GIB = 1024
USABLE = 80 * GIB - 512
FULL = 79 * GIB
TO_MILLI = 1000 / FULL


def gpu(index: int, *used_gib: int) -> GpuState:
    return GpuState(index, mps=tuple(MpsSlice(g * GIB, used=True) for g in used_gib))


def test_the_measure_by_hand() -> None:
    ten = NodeMeasure((Shape(0, 10 * GIB, 1, 1.0),), USABLE)
    # an empty GPU: every 10 GiB pod fits (no fragmentation); 79 GiB = 7 x 10 + 9 GiB and the
    # half GiB below a GiB are left once it is filled: half of that waste counts
    assert ten.value(0, [USABLE]) == pytest.approx(0.5 * (9 * GIB + 512) * TO_MILLI)
    gated = NodeMeasure((Shape(4000, 10 * GIB, 1, 1.0),), USABLE)
    # no CPU for the shape: all free memory is lost, and nothing fills it (waste = idle)
    assert gated.value(3000, [USABLE]) == pytest.approx(1.5 * USABLE * TO_MILLI)
    # CPU for one more pod: one GPU's free memory counts, the other's is lost
    capped = gated.value(4000, [USABLE, USABLE])
    assert capped == pytest.approx((USABLE + 0.5 * 2 * (9 * GIB + 512)) * TO_MILLI)
    # CPU for two: both count
    assert gated.value(8000, [USABLE, USABLE]) == pytest.approx((9 * GIB + 512) * TO_MILLI)
    # two GPUs of 10 GiB needed on one node: one fitting GPU is not enough, and the waste,
    # which only single-GPU shapes fill, is all the free memory
    pair = NodeMeasure((Shape(0, 10 * GIB, 2, 1.0),), USABLE)
    assert pair.value(0, [USABLE, 5 * GIB]) == pytest.approx(1.5 * (USABLE + 5 * GIB) * TO_MILLI)
    assert pair.value(0, [USABLE, USABLE]) == pytest.approx(USABLE * TO_MILLI)


def test_the_target_given_as_shapes_then_sizes_then_learned() -> None:
    snap = Snapshot(
        (NodeState("n", Mode.MPS, A100, (gpu(0, 10, 10, 20), gpu(1))),),
        (PendingPod("p", {"nvidia.com/gpu-40gb": 1}, cpu_milli=3000),),
    )
    learned = polish_target(snap, PlannerSettings(free_capacity_cpu_milli=500))
    assert {(s.cpu_milli, s.mib, s.gpus): s.p for s in learned} == {
        (500, 10 * GIB, 1): 0.5,
        (500, 20 * GIB, 1): 0.25,
        (3000, 40 * GIB, 1): 0.25,
    }
    sizes = PlannerSettings(free_capacity_mps_sizes=((5 * GIB, 3.0),), free_capacity_cpu_milli=7)
    assert polish_target(snap, sizes) == (Shape(7, 5 * GIB, 1, 1.0),)
    shapes = PlannerSettings(
        free_capacity_mps_sizes=((5 * GIB, 3.0),),
        free_capacity_mps_shapes=((1000, 8 * GIB, 2, 1.0), (2000, 1 * GIB, 1, 3.0)),
    )
    assert polish_target(snap, shapes) == (
        Shape(2000, 1 * GIB, 1, 0.75),
        Shape(1000, 8 * GIB, 2, 0.25),
    )
    # the most frequent shapes up to 95 % of the weight
    tail = PlannerSettings(free_capacity_mps_shapes=((0, GIB, 1, 96.0), (0, 2 * GIB, 1, 4.0)))
    assert polish_target(snap, tail) == (Shape(0, GIB, 1, 1.0),)
    assert polish_target(snap, PlannerSettings(free_capacity_mps_sizes=())) == ()


# --------------------------------------------------------------------------- the oracle


@functools.cache
def _waste(h_gib: int, sizes: tuple[tuple[int, float], ...]) -> float:
    """w(h) of the definition, in GiB, by recursion (memoised)."""
    fit = [(s, p) for s, p in sizes if s <= h_gib]
    if not fit:
        return float(h_gib)
    return sum(p * _waste(h_gib - s, sizes) for s, p in fit) / sum(p for _, p in fit)


def _g(shapes: list[Shape], cpu: int, frees: list[int]) -> float:
    """G of the definition (milli-GPU), written from the docstring."""
    idle = sum(frees)
    frag = 0.0
    for s in shapes:
        n = cpu // s.cpu_milli if s.cpu_milli else len(frees)
        fits = sorted((f for f in frees if f >= s.mib), reverse=True)
        usable = sum(fits[: n * s.gpus]) if len(fits) >= s.gpus and n > 0 else 0
        frag += s.p * (idle - usable)
    admitted = tuple(
        sorted((s.mib // GIB, s.p) for s in shapes if s.gpus == 1 and s.cpu_milli <= cpu)
    )
    waste = sum(GIB * _waste(f // GIB, admitted) + f % GIB for f in frees)
    return (frag + 0.5 * waste) * TO_MILLI


SIZES = [1, 5, 10, 20, 39]


def _draw_nodes(
    draw: st.DrawFn, most_gpus: int, most_used: int, cpus: list[int]
) -> list[NodeState]:
    """1-3 MPS nodes of 1..``most_gpus`` GPUs, each with up to ``most_used`` used slices of
    :data:`SIZES` that fit, and a free CPU drawn from ``cpus``."""
    nodes = []
    for k in range(draw(st.integers(1, 3))):
        gpus = []
        for i in range(draw(st.integers(1, most_gpus))):
            used = draw(st.lists(st.sampled_from(SIZES), max_size=most_used))
            while sum(used) * GIB > USABLE:
                used.pop()
            gpus.append(gpu(i, *used))
        cpu = draw(st.sampled_from(cpus))
        nodes.append(NodeState(f"n{k}", Mode.MPS, A100, tuple(gpus), cpu, 1 << 20))
    return nodes


@st.composite
def one_pod_cases(draw: st.DrawFn) -> tuple[Snapshot, PlannerSettings, int]:
    nodes = _draw_nodes(draw, 3, 3, [2000, 6000, 12000, 64000])
    size = draw(st.sampled_from(SIZES))
    shapes = draw(
        st.lists(
            st.tuples(st.sampled_from([0, 2000, 4000, 8000]), st.sampled_from(SIZES)),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    s = PlannerSettings(
        free_capacity_mps_shapes=tuple((c, g * GIB, 1, 1.0) for c, g in shapes),
        free_capacity_cpu_milli=0,
        free_capacity_memory_mib=0,
        time_limit_s=10.0,
    )
    pod = PendingPod("p", {f"nvidia.com/gpu-{size}gb": 1}, cpu_milli=2000)
    return Snapshot(tuple(nodes), (pod,)), s, size


@given(one_pod_cases())
@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
def test_one_pod_goes_where_the_quantised_measure_is_best(
    case: tuple[Snapshot, PlannerSettings, int],
) -> None:
    snap, s, size = case
    mib = size * GIB
    shapes = list(polish_target(snap, s))
    result = plan(snap, s)
    options = [
        (k, n, i)
        for k, n in enumerate(snap.nodes)
        if n.cpu_milli_free >= 2000
        for i, g in enumerate(n.gpus)
        if USABLE - sum(x.memory_mib for x in g.mps) >= mib
    ]
    if not options:
        assert "p" not in result.assignments
        return
    a = result.assignments["p"]
    chosen = (a.node, a.gpus[f"nvidia.com/gpu-{size}gb"][0])
    # every GPU here gets a new slice (no free slice exists): the same churn everywhere, so
    # the polish may choose among all of them
    best_key = None
    best_at = None
    for k, n in enumerate(snap.nodes):
        frees = [USABLE - sum(x.memory_mib for x in g.mps) for g in n.gpus]
        mine = [i for kk, nn, i in options if kk == k]
        if not mine:
            continue
        before = _g(shapes, n.cpu_milli_free, frees)
        # within the node: the smallest measure after, then the fullest GPU, then the index
        pick = min(
            mine,
            key=lambda i: (
                _g(
                    shapes,
                    n.cpu_milli_free - 2000,
                    [f - mib if j == i else f for j, f in enumerate(frees)],
                ),
                frees[i],
                i,
            ),
        )
        after = _g(
            shapes,
            n.cpu_milli_free - 2000,
            [f - mib if j == pick else f for j, f in enumerate(frees)],
        )
        key = (-math.floor((after - before) / 20.0), -k, -pick)
        if best_key is None or key > best_key:
            best_key, best_at = key, (n.name, pick)
    assert chosen == best_at
    assert result.stats["polish_moved"] in (0.0, 1.0)


def test_a_pod_on_a_kept_free_slice_is_not_moved_and_eligibility_holds() -> None:
    free10 = GpuState(0, mps=(MpsSlice(10 * GIB),))
    snap = Snapshot(
        (
            NodeState("a", Mode.MPS, A100, (free10,)),
            NodeState("b", Mode.MPS, A100, (gpu(0), gpu(1))),
        ),
        (
            PendingPod("kept", {"nvidia.com/gpu-10gb": 1}),
            PendingPod("only-b", {"nvidia.com/gpu-20gb": 1}, eligible_nodes=frozenset({"b"})),
        ),
    )
    s = PlannerSettings(free_capacity_mps_shapes=((0, 10 * GIB, 1, 1.0), (0, 20 * GIB, 1, 1.0)))
    result = plan(snap, s)
    assert result.assignments["kept"].node == "a"  # its free slice: moving it would add churn
    assert ("a", 0) not in result.layouts
    assert result.assignments["only-b"].node == "b"
    assert result.stats["churn"] >= 0


def _stranded_cluster() -> Snapshot:
    """12 tight nodes of 8 GPUs (60 GiB used on each GPU, CPU to spare): 96 GPUs, all a best
    fit would look at; and ``z``, 8 empty GPUs whose node has CPU for one small pod only."""
    tight = [
        NodeState(f"t{k:02d}", Mode.MPS, A100, tuple(gpu(i, 60) for i in range(8)), 64000, 1 << 20)
        for k in range(12)
    ]
    z = NodeState("z", Mode.MPS, A100, tuple(gpu(i) for i in range(8)), 2000, 1 << 20)
    pod = PendingPod("p", {"nvidia.com/gpu-10gb": 1}, cpu_milli=2000)
    return Snapshot((*tight, z), (pod,))


STRANDED_TARGET = PlannerSettings(
    free_capacity_mps_shapes=((8000, 10 * GIB, 1, 1.0),),
    free_capacity_cpu_milli=8000,
    free_capacity_memory_mib=0,
)
"""The target of the stranded cluster: pods of 8 cores on one 10 GiB slice."""


def test_every_node_is_a_candidate_not_only_the_best_fit_ones() -> None:
    # The target pods need 8 cores: z's GPUs are of no use to them (its CPU strands them),
    # so a small pod there loses nothing (the measure falls), while on a tight node it cuts a
    # 19.5 GiB hole the target's 10 GiB pods could use (the measure rises).  Best fit ranks z
    # last (all its memory is free), beyond max_model_gpus = 96 GPUs of tight nodes.
    snap = _stranded_cluster()
    s = STRANDED_TARGET
    shapes = list(polish_target(snap, s))
    on_z = _g(shapes, 0, [USABLE - 10 * GIB] + [USABLE] * 7) - _g(shapes, 2000, [USABLE] * 8)
    tight_free = [USABLE - 60 * GIB] * 8
    on_tight = _g(shapes, 62000, [tight_free[0] - 10 * GIB, *tight_free[1:]]) - _g(
        shapes, 64000, tight_free
    )
    assert on_z < 0 < on_tight
    result = plan(snap, s)
    assert result.assignments["p"].node == "z"


def test_a_short_budget_evaluates_the_best_fit_nodes() -> None:
    # with fewer evaluations left than candidates, the pod's own node and the best-fit ones
    # up to the budget are looked at: z, the roomiest node, is not among them
    snap = _stranded_cluster()
    s = replace(STRANDED_TARGET, mps_polish=False)
    solved = plan(snap, s)
    assert solved.assignments["p"].node != "z"
    on = replace(s, mps_polish=True)
    models = {n.name: default_catalog().model(A100) for n in snap.nodes}
    assert polish_mps(snap, solved, models, on, max_evals=12).assignments["p"].node != "z"
    assert polish_mps(snap, solved, models, on, max_evals=13).assignments["p"].node == "z"
    assert polish_evals(snap, on) == 13  # one pod, 13 MPS nodes, within the 100 ms share
    assert polish_evals(snap, replace(on, time_limit_s=0.005)) == 0  # setup 0.52 > 0.5 ms


# --------------------------------------------------------------------------- multi-slice pods

PAIR = "nvidia.com/gpu-79gb"


def _whole(node: str, *indices: int) -> dict[tuple[str, int], PlannedGpu]:
    return {(node, i): PlannedGpu(node, i, mps=(PlannedSlice(FULL, 100, False),)) for i in indices}


def test_a_pod_moves_off_a_whole_free_node() -> None:
    # The target holds eight-GPU pods: "big", 8 empty GPUs with the CPU for one of them, is
    # what they need.  A plan putting a one-GPU pod there breaks it up; "pair", 2 empty GPUs
    # beside used ones, holds the pod and keeps big whole.  The polish moves the pod there and
    # adds no churn (1 GPU no longer touched, 1 now).  (This test once moved a pod of two
    # 79 GiB slices as a whole, to two GPUs of one node; such a pod is no longer placed, see
    # the end, so the move of a multi-GPU MPS pod only happens on a hand-made plan.)
    big = NodeState("big", Mode.MPS, A100, tuple(gpu(i) for i in range(8)), 96000, 1 << 20)
    pair = NodeState(
        "pair", Mode.MPS, A100, (gpu(0, 79), gpu(1, 79), gpu(2), gpu(3)), 96000, 1 << 20
    )
    pod = PendingPod("p", {PAIR: 1}, cpu_milli=8000)
    snap = Snapshot((big, pair), (pod,))
    s = PlannerSettings(
        free_capacity_mps_shapes=((64000, FULL, 8, 1.0), (8000, FULL, 1, 1.0)),
        free_capacity_cpu_milli=8000,
        free_capacity_memory_mib=0,
    )
    models = {n.name: default_catalog().model(A100) for n in snap.nodes}
    on_big = Plan(_whole("big", 0), {"p": Assignment("big", {PAIR: (0,)})}, {})
    polished = polish_mps(snap, on_big, models, s)
    assert polished.assignments["p"] == Assignment("pair", {PAIR: (2,)})
    assert set(polished.layouts) == {("pair", 2)}
    assert polished.stats["polish_moved"] == 1.0
    # the measure agrees: big loses its eight-GPU room, pair loses nothing it could use
    shapes = list(polish_target(snap, s))
    on_big_g = _g(shapes, 88000, [0, *[USABLE] * 7]) - _g(shapes, 96000, [USABLE] * 8)
    on_pair_g = _g(shapes, 88000, [USABLE - FULL] * 3 + [USABLE]) - _g(
        shapes, 96000, [USABLE - FULL] * 2 + [USABLE] * 2
    )
    assert on_pair_g < 0 < on_big_g
    # and the planner, given the choice, ends there too
    assert plan(snap, s).assignments["p"].node == "pair"
    # a pod asking for two such slices (two GPUs' MPS daemons) is not placed at all: a
    # container reaches one daemon (planner.demand.one_mps_slice)
    two = Snapshot(snap.nodes, (PendingPod("p", {PAIR: 2}, cpu_milli=8000),))
    result = plan(two, s)
    assert not result.assignments and not result.layouts
    assert result.unplaced["p"].startswith(Unplaced.MPS_SLICES.value), result.unplaced["p"]


def _p_and_q(
    a_gpus: tuple[GpuState, ...], b_gpus: tuple[GpuState, ...], target_gib: int
) -> tuple[Snapshot, PlannerSettings, dict[str, GpuModel]]:
    """Nodes ``a`` and ``b`` (64 cores each), pods ``p`` (two 20 GiB slices) and ``q`` (one
    10 GiB slice), a target of one shape (no CPU, one ``target_gib`` slice), and the models."""
    a = NodeState("a", Mode.MPS, A100, a_gpus, 64000, 1 << 20)
    b = NodeState("b", Mode.MPS, A100, b_gpus, 64000, 1 << 20)
    pods = (
        PendingPod("p", {"nvidia.com/gpu-20gb": 2}, cpu_milli=1000),
        PendingPod("q", {"nvidia.com/gpu-10gb": 1}, cpu_milli=1000),
    )
    s = PlannerSettings(
        free_capacity_mps_shapes=((0, target_gib * GIB, 1, 1.0),),
        free_capacity_cpu_milli=0,
        free_capacity_memory_mib=0,
    )
    models = {n: default_catalog().model(A100) for n in ("a", "b")}
    return Snapshot((a, b), pods), s, models


def test_a_multi_slice_pod_that_cannot_move_without_churn_stays() -> None:
    # p's two 20 GiB slices share GPU 0 of "a" with q's new 10 GiB slice, so taking them off
    # frees no GPU; on "b" one would fill GPU 1's last 20.5 GiB, the other take empty GPU 0,
    # which the measure prefers (a's GPU 0 keeps room for two 30 GiB pods), but that touches
    # two GPUs more: only with GPU touches free of churn does p move
    snap, s, models = _p_and_q((gpu(0), gpu(1)), (gpu(0), gpu(1, 59)), 30)
    slices = (
        PlannedSlice(20 * GIB, 25, False),
        PlannedSlice(20 * GIB, 25, False),
        PlannedSlice(10 * GIB, 13, False),
    )
    solved = Plan(
        {("a", 0): PlannedGpu("a", 0, mps=slices)},
        {
            "p": Assignment("a", {"nvidia.com/gpu-20gb": (0, 0)}),
            "q": Assignment("a", {"nvidia.com/gpu-10gb": (0,)}),
        },
        {},
    )
    kept = polish_mps(snap, solved, models, s)
    assert kept.assignments == solved.assignments
    assert set(kept.layouts) == {("a", 0)}
    free = polish_mps(snap, solved, models, replace(s, weight_gpu_touched=0))
    assert free.assignments["p"] == Assignment("b", {"nvidia.com/gpu-20gb": (0, 1)})


@st.composite
def multi_pod_cases(draw: st.DrawFn) -> tuple[Snapshot, PlannerSettings]:
    nodes = _draw_nodes(draw, 4, 2, [4000, 16000, 64000])
    pods = []
    for j in range(draw(st.integers(1, 3))):
        size = draw(st.sampled_from([5, 10, 20, 39, 79]))
        n = draw(st.integers(1, 3))
        pods.append(PendingPod(f"p{j}", {f"nvidia.com/gpu-{size}gb": n}, cpu_milli=2000))
    shapes = draw(
        st.lists(
            st.tuples(st.sampled_from([0, 2000, 8000]), st.sampled_from(SIZES), st.integers(1, 3)),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    s = PlannerSettings(
        free_capacity_mps_shapes=tuple((c, g * GIB, n, 1.0) for c, g, n in shapes),
        free_capacity_cpu_milli=0,
        free_capacity_memory_mib=0,
        time_limit_s=10.0,
    )
    return Snapshot(tuple(nodes), tuple(pods)), s


@given(multi_pod_cases())
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
def test_the_polish_of_multi_slice_pods_keeps_what_the_solve_promised(
    case: tuple[Snapshot, PlannerSettings],
) -> None:
    # Whatever the polish moves: the same pods placed, each slice on a GPU of one node of the
    # pod, every used slice kept, no GPU over its memory, no node over its CPU, and no more
    # GPUs touched than the solve's plan.
    snap, s = case
    solved = plan(snap, replace(s, mps_polish=False))
    polished = plan(snap, s)
    assert set(polished.assignments) == set(solved.assignments)
    assert len(polished.layouts) <= len(solved.layouts)
    by_node = {n.name: n for n in snap.nodes}
    cpu_used: dict[str, int] = {}
    demand: dict[tuple[str, int], int] = {}
    for pod in snap.pods:
        a = polished.assignments.get(pod.name)
        if a is None:
            continue
        ((resource, n),) = pod.requests.items()
        assert len(a.gpus[resource]) == n
        cpu_used[a.node] = cpu_used.get(a.node, 0) + pod.cpu_milli
        for k in a.gpus[resource]:
            demand[(a.node, k)] = demand.get((a.node, k), 0) + (mps_gb_of(resource) or 0) * GIB
    for name, used in cpu_used.items():
        assert used <= by_node[name].cpu_milli_free
    for node in snap.nodes:
        for g in node.gpus:
            laid = polished.layouts.get((node.name, g.index))
            slices = (
                laid.mps
                if laid is not None
                else tuple(PlannedSlice(x.memory_mib, 0, x.used) for x in g.mps)
            )
            assert sum(x.memory_mib for x in slices) <= USABLE
            kept = sorted(x.memory_mib for x in slices if x.used)
            assert kept == sorted(x.memory_mib for x in g.mps if x.used)
            free = sorted(x.memory_mib for x in slices if not x.used)
            # every slice the pods were given exists, free, on that GPU
            want = demand.get((node.name, g.index), 0)
            assert sum(free) >= want


def test_a_pod_the_budget_cannot_cover_is_skipped_not_the_rest() -> None:
    # max_evals = 1: the two-slice pod (first, the most memory) needs 2 evaluations and stays;
    # the one-slice pod still gets its own node evaluated: on a's GPU 1 its slice leaves half
    # a GiB no 10 GiB pod fits, on the empty GPU 0 nothing is lost, so it moves there
    snap, s, models = _p_and_q((gpu(0), gpu(1, 69)), (gpu(0), gpu(1)), 10)
    twenty = PlannedSlice(20 * GIB, 25, False)
    on_a1 = (PlannedSlice(69 * GIB, 87, True), PlannedSlice(10 * GIB, 13, False))
    solved = Plan(
        {
            ("a", 1): PlannedGpu("a", 1, mps=on_a1),
            ("b", 0): PlannedGpu("b", 0, mps=(twenty,)),
            ("b", 1): PlannedGpu("b", 1, mps=(twenty,)),
        },
        {
            "p": Assignment("b", {"nvidia.com/gpu-20gb": (0, 1)}),
            "q": Assignment("a", {"nvidia.com/gpu-10gb": (1,)}),
        },
        {},
    )
    polished = polish_mps(snap, solved, models, s, max_evals=1)
    assert polished.assignments["p"] == solved.assignments["p"]
    assert polished.assignments["q"] == Assignment("a", {"nvidia.com/gpu-10gb": (0,)})
    assert ("a", 1) not in polished.layouts  # back to its used slice alone: untouched
    assert polish_mps(snap, solved, models, s, max_evals=0).assignments == solved.assignments
