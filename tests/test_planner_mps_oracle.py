"""The CP-SAT planner against a brute-force oracle on small random MPS instances.

Model of an MPS GPU (what the oracle knows, written from the issue, not from the planner):
the GPU offers ``usable = memory - settings.mps_reserve_mib`` MiB (memory from
``NodeState.gpu_memory_mib`` if set, else the catalog).  Used slices stay exactly as they are.
Each free slice is kept (and may serve one unit of a pod asking for exactly its size) or
removed; new slices of any requested size may be created.  Everything kept or created, plus
the used slices, must fit ``usable``.  Churn of a GPU = ``weight_destroy`` per removed slice +
``weight_create`` per created slice + ``weight_gpu_touched`` if anything changed; a GPU that
ends with no slice at all counts as one empty GPU.

A pod asking for more than one slice in all (two units of one size, or one unit each of two
sizes) is never placed: the node agent runs one MPS daemon per GPU and a container reaches one
daemon, so gpuslice serves an MPS pod one slice (reason code ``more than one MPS slice``).

The oracle shares no code with the planner; its weights are tests/objective_weights.py
(so that "placed weight" means the same number).  It tries every assignment of each
one-slice pod to an allowed node or to nobody (a pod asking for more slices: nobody); on a
node it tries every way to spread the node's units (one per pod there) over its GPUs (units of
equal size are interchangeable, so it enumerates, per size, every split of the unit count
over the GPUs), and on a GPU every count of kept free slices per size, creating
whatever units the kept ones do not cover.  Node CPU/memory must hold the node's pods.  Its
optimum is the largest priority-weighted placement, then the least churn, then the most empty
GPUs: the planner's lexicographic objective.

The plan checks assert, independently of the oracle, that only one-slice pods are placed (the
others unplaced with that reason code), that every planned GPU fits its usable
memory, used slices survive exactly (size, used flag, a given thread percentage), every
assigned unit has its own free slice of its size on the named GPU, thread percentages follow
the policy, and node CPU/memory hold the assigned pods.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from objective_weights import placement_weights

from planner import (
    GpuState,
    Mode,
    MpsSlice,
    NodeState,
    PendingPod,
    Plan,
    PlannedGpu,
    PlannedSlice,
    PlannerSettings,
    Snapshot,
    ThreadPolicy,
    Unplaced,
    default_catalog,
    plan,
)
from planner.mps import MAX_CLIENTS

CATALOG = default_catalog()
MODELS = ("V100-32GB", "A100-SXM4-40GB", "T4")
GIB = 1024
Score = tuple[int, int, int]  # (placed priority weight, churn, empty GPUs)
Cost = tuple[int, int]  # (churn, -empty GPUs): smaller is better, adds component-wise


def _usable(node: NodeState, s: PlannerSettings) -> int:
    memory = node.gpu_memory_mib
    if memory is None:
        memory = CATALOG.model(node.model).memory_mib
    return memory - s.mps_reserve_mib


def _requested(pod: PendingPod) -> Counter[int]:
    """Units per slice size (MiB) the pod asks for."""
    out: Counter[int] = Counter()
    for res, count in pod.requests.items():
        gb = int(res.removeprefix("nvidia.com/gpu-").removesuffix("gb"))
        out[gb * GIB] += count
    return out


def _one_slice(pod: PendingPod) -> bool:
    """Whether the pod asks for exactly one MPS slice (the only pods that may be placed)."""
    return _requested(pod).total() == 1


def _touch_cost(destroyed: int, created: int, s: PlannerSettings) -> int:
    touched = 1 if destroyed or created else 0
    return s.weight_destroy * destroyed + s.weight_create * created + s.weight_gpu_touched * touched


# --------------------------------------------------------------------------- oracle


def _gpu_cost(gpu: GpuState, usable: int, need: dict[int, int], s: PlannerSettings) -> Cost | None:
    """Least (churn, -empty) for ``gpu`` to offer ``need`` (size -> units); None if impossible."""
    room = usable - sum(x.memory_mib for x in gpu.mps if x.used)
    has_used = any(x.used for x in gpu.mps)
    free = Counter(x.memory_mib for x in gpu.mps if not x.used)
    sizes = sorted(free)
    best: Cost | None = None
    for kept in itertools.product(*(range(free[m] + 1) for m in sizes)):
        keep = dict(zip(sizes, kept, strict=True))
        new = {m: max(0, u - keep.get(m, 0)) for m, u in need.items()}
        if sum(m * k for m, k in keep.items()) + sum(m * n for m, n in new.items()) > room:
            continue
        destroyed, created = free.total() - sum(kept), sum(new.values())
        empty = not has_used and sum(kept) == 0 and created == 0
        cost = (_touch_cost(destroyed, created, s), -int(empty))
        if best is None or cost < best:
            best = cost
    return best


def _splits(units: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``units`` as an ordered sum of ``parts`` non-negative integers."""
    if parts == 1:
        yield (units,)
        return
    for first in range(units + 1):
        for rest in _splits(units - first, parts - 1):
            yield (first, *rest)


def _node_cost(node: NodeState, units: Counter[int], s: PlannerSettings) -> Cost | None:
    """Least (churn, -empty) over every spread of ``units`` over the node's GPUs."""
    usable = _usable(node, s)
    sizes = sorted(units)
    gpus = node.gpus
    best: Cost | None = None
    for spread in itertools.product(*(_splits(units[m], len(gpus)) for m in sizes)):
        total: Cost = (0, 0)
        for g, gpu in enumerate(gpus):
            need = {m: split[g] for m, split in zip(sizes, spread, strict=True) if split[g]}
            cost = _gpu_cost(gpu, usable, need, s)
            if cost is None:
                break
            total = (total[0] + cost[0], total[1] + cost[1])
        else:
            if best is None or total < best:
                best = total
    return best


def oracle(snap: Snapshot, s: PlannerSettings) -> Score:
    """(most priority-weighted compute placed, least churn for that, most empty GPUs for both)."""
    weights = placement_weights(snap.pods)
    nodes = list(snap.nodes)
    memo: dict[tuple[int, tuple[tuple[int, int], ...]], Cost | None] = {}

    def node_cost(k: int, units: Counter[int]) -> Cost | None:
        key = (k, tuple(sorted(units.items())))
        if key not in memo:
            memo[key] = _node_cost(nodes[k], units, s)
        return memo[key]

    choices: list[list[int | None]] = []
    for pod in snap.pods:
        allowed = [
            k
            for k, n in enumerate(nodes)
            if _one_slice(pod) and (pod.eligible_nodes is None or n.name in pod.eligible_nodes)
        ]
        choices.append([None, *allowed])
    best: tuple[int, int, int] | None = None  # (weight, -churn, empties): larger is better
    for combo in itertools.product(*choices):
        weight = sum(
            weights[p.name] for p, c in zip(snap.pods, combo, strict=True) if c is not None
        )
        if best is not None and weight < best[0]:
            continue
        total: Cost = (0, 0)
        for k, node in enumerate(nodes):
            mine = [p for p, c in zip(snap.pods, combo, strict=True) if c == k]
            if sum(p.cpu_milli for p in mine) > node.cpu_milli_free:
                break
            if sum(p.memory_mib for p in mine) > node.memory_mib_free:
                break
            units: Counter[int] = Counter()
            for p in mine:
                units.update(_requested(p))
            cost = node_cost(k, units)
            if cost is None:
                break
            total = (total[0] + cost[0], total[1] + cost[1])
        else:
            cand = (weight, -total[0], -total[1])
            if best is None or cand > best:
                best = cand
    assert best is not None  # placing nobody is always possible
    return best[0], -best[1], best[2]


# --------------------------------------------------------------------------- plan checks


def _check_threads(
    gpu: PlannedGpu, given: Counter[tuple[int, int]], usable: int, s: PlannerSettings
) -> None:
    """Percentages the planner chose (all but ``given`` ones kept from the snapshot)."""
    rest = Counter((x.memory_mib, x.thread_percentage) for x in gpu.mps)
    assert given <= rest, f"{gpu.node}/{gpu.index}: a used slice lost its thread percentage"
    chosen = sorted((rest - given).elements())
    for mib, pct in chosen:
        if s.mps_thread_policy is ThreadPolicy.FULL:
            assert pct == 100
        else:
            assert pct == max(1, 100 * mib // usable), (mib, pct, usable)  # rounded down
    pcts = [pct for _, pct in chosen]  # sorted by size
    assert pcts == sorted(pcts), f"{gpu.node}/{gpu.index}: thread % not monotone in size"
    assert len(gpu.mps) <= MAX_CLIENTS, f"{gpu.node}/{gpu.index}: over the MPS client limit"
    if s.mps_thread_policy is ThreadPolicy.PROPORTIONAL:
        # the memory shares of the slices fit 100 % (unless the used ones alone do not)
        shares = [max(1, 100 * x.memory_mib // usable) for x in gpu.mps]
        used = sum(t for t, x in zip(shares, gpu.mps, strict=True) if x.used)
        assert sum(shares) <= max(100, used), f"{gpu.node}/{gpu.index}: shares over 100 %"


def check_plan(snap: Snapshot, result: Plan, s: PlannerSettings) -> Score:
    """Assert ``result`` is a consistent, valid MPS plan; return its (weight, churn, empties)."""
    assert set(result.assignments).isdisjoint(result.unplaced)
    assert set(result.assignments) | set(result.unplaced) == {p.name for p in snap.pods}
    nodes = {n.name: n for n in snap.nodes}
    known = {(n.name, g.index) for n in snap.nodes for g in n.gpus}
    assert set(result.layouts) <= known, "a plan names a GPU the snapshot lacks"
    free: Counter[tuple[str, int, int]] = Counter()
    churn = empties = 0
    for node in snap.nodes:
        usable = _usable(node, s)
        for gpu in node.gpus:
            planned = result.layouts.get((node.name, gpu.index))
            before_used = Counter(x.memory_mib for x in gpu.mps if x.used)
            before_free = Counter(x.memory_mib for x in gpu.mps if not x.used)
            if planned is None:
                after_used, after_free = before_used, before_free
            else:
                assert planned.mig == ()
                after = planned.mps
                after_used = Counter(x.memory_mib for x in after if x.used)
                after_free = Counter(x.memory_mib for x in after if not x.used)
                assert (after_used, after_free) != (before_used, before_free), (
                    "a plan lists only GPUs whose slices change"
                )
                assert after_used == before_used, f"used slice changed on {node.name}/{gpu.index}"
                assert sum(x.memory_mib for x in after) <= usable, "slices exceed usable memory"
                assert all(x.memory_mib > 0 for x in after)
                given = Counter(
                    (x.memory_mib, x.thread_percentage)
                    for x in gpu.mps
                    if x.used and x.thread_percentage is not None
                )
                _check_threads(planned, given, usable, s)
            kept = (before_free & after_free).total()
            destroyed, created = before_free.total() - kept, after_free.total() - kept
            churn += _touch_cost(destroyed, created, s)
            empties += (after_used + after_free).total() == 0
            for mib, n in after_free.items():
                free[(node.name, gpu.index, mib)] += n
    taken: Counter[tuple[str, int, int]] = Counter()
    cpu: Counter[str] = Counter()
    mem: Counter[str] = Counter()
    pods = {p.name: p for p in snap.pods}
    for pod in snap.pods:
        if not _one_slice(pod):
            reason = result.unplaced.get(pod.name, "")
            assert reason.startswith(Unplaced.MPS_SLICES.value), (pod.name, reason)
    for name, a in result.assignments.items():
        pod = pods[name]
        assert _one_slice(pod), f"{name} placed with {pod.requests}: one MPS slice per pod"
        assert a.node in nodes
        assert pod.eligible_nodes is None or a.node in pod.eligible_nodes
        assert set(a.gpus) == {r for r, c in pod.requests.items() if c}
        for res, indices in a.gpus.items():
            assert len(indices) == pod.requests[res]
            mib = int(res.removeprefix("nvidia.com/gpu-").removesuffix("gb")) * GIB
            for index in indices:
                taken[(a.node, index, mib)] += 1
        cpu[a.node] += pod.cpu_milli
        mem[a.node] += pod.memory_mib
    for key, n in taken.items():
        assert n <= free[key], f"{key}: {n} units assigned, {free[key]} free slices of that size"
    for name in cpu:
        assert cpu[name] <= nodes[name].cpu_milli_free
        assert mem[name] <= nodes[name].memory_mib_free
    weights = placement_weights(snap.pods)
    weight = sum(weights[n] for n in result.assignments)
    return weight, churn, empties


# --------------------------------------------------------------------------- instances

SIZES_GB = (1, 2, 4, 5, 8, 10, 16)
"""Sizes drawn most often, so that free slices and requests meet."""


def _size_gb(draw: st.DrawFn, top_gb: int) -> int:
    return draw(
        st.one_of(st.sampled_from([g for g in SIZES_GB if g <= top_gb]), st.integers(1, top_gb))
    )


@st.composite
def gpu_state(draw: st.DrawFn, index: int, usable: int) -> GpuState:
    slices: list[MpsSlice] = []
    left = usable
    for _ in range(draw(st.integers(0, 3))):
        if left < GIB:
            break
        mib = _size_gb(draw, left // GIB) * GIB  # fits what the slices before left
        if left >= 1500 and not draw(st.integers(0, 5)):
            mib = 1500  # now and then a size no pod asks for
        used = draw(st.booleans())
        pct = draw(st.sampled_from([None, 37])) if used else None
        slices.append(MpsSlice(mib, used=used, thread_percentage=pct))
        left -= mib
    if left >= GIB and draw(st.booleans()):
        slices.append(MpsSlice(left // GIB * GIB))  # a free slice filling the rest: in the way
    assert sum(x.memory_mib for x in slices) <= usable
    return GpuState(index, mps=tuple(slices))


@st.composite
def instances(draw: st.DrawFn) -> tuple[Snapshot, PlannerSettings]:
    # the oracle's third level counts empty GPUs: the planner's free-capacity level reduced to
    # that (no target sizes, CPU- and memory-blind); the full level has tests of its own
    # (test_planner_mps_usefulness.py, test_planner_usefulness.py)
    s = PlannerSettings(
        time_limit_s=10.0,
        mps_reserve_mib=draw(st.sampled_from([512, 0, 1536])),
        mps_thread_policy=draw(st.sampled_from(list(ThreadPolicy))),
        free_capacity_cpu_milli=0,
        free_capacity_memory_mib=0,
        free_capacity_mps_sizes=(),
    )
    n_nodes = draw(st.integers(1, 2))
    counts = draw(st.sampled_from([(1,), (2,), (3,)] if n_nodes == 1 else [(1, 1), (1, 2), (2, 1)]))
    nodes: list[NodeState] = []
    for k, n_gpus in enumerate(counts):
        model = draw(st.sampled_from(MODELS))
        override = draw(st.sampled_from([None, None, 12 * GIB, 24000]))
        node = NodeState(
            f"n{k}",
            Mode.MPS,
            model,
            (),
            cpu_milli_free=draw(st.sampled_from([1000, 2000, 1 << 40])),
            memory_mib_free=draw(st.sampled_from([4096, 8192, 1 << 50])),
            gpu_memory_mib=override,
        )
        usable = _usable(node, s)
        gpus = tuple(draw(gpu_state(i, usable)) for i in range(n_gpus))
        nodes.append(
            NodeState(
                node.name,
                Mode.MPS,
                model,
                gpus,
                node.cpu_milli_free,
                node.memory_mib_free,
                override,
            )
        )
    top_gb = max(_usable(n, s) for n in nodes) // GIB
    pods: list[PendingPod] = []
    for j in range(draw(st.integers(0, 7))):
        # mostly one unit; now and then two units of one size, or one unit each of two sizes,
        # which must stay unplaced (more than one MPS slice)
        sizes = [_size_gb(draw, top_gb) for _ in range(2 if draw(st.integers(0, 4)) == 0 else 1)]
        requests = {f"nvidia.com/gpu-{gb}gb": n for gb, n in Counter(sizes).items()}
        eligible = draw(
            st.one_of(st.none(), st.sets(st.sampled_from([n.name for n in nodes]), max_size=2))
        )
        pods.append(
            PendingPod(
                f"p{j}",
                requests,
                cpu_milli=draw(st.sampled_from([0, 500, 1000])),
                memory_mib=draw(st.sampled_from([0, 2048, 4096])),
                priority=draw(st.integers(0, 2)),
                eligible_nodes=None if eligible is None else frozenset(eligible),
            )
        )
    return Snapshot(tuple(nodes), tuple(pods)), s


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(instances())
def test_cpsat_mps_plan_matches_bruteforce_optimum(case: tuple[Snapshot, PlannerSettings]) -> None:
    snap, s = case
    result = plan(snap, s)
    assert result.status == "OPTIMAL", result.status
    score = check_plan(snap, result, s)
    assert score == oracle(snap, s)
    assert result.stats["churn"] == score[1]  # the planner's own churn reads the plan the same way
    # with the free-capacity level learned, and the packing polish (planner/mps_polish.py)
    # moving pods afterwards, the two higher levels stay the optimum: the same priority
    # weight placed with the same churn, in a valid plan
    learned = replace(
        s, free_capacity_cpu_milli=None, free_capacity_memory_mib=None, free_capacity_mps_sizes=None
    )
    polished = plan(snap, learned)
    assert check_plan(snap, polished, learned)[:2] == score[:2]


# --------------------------------------------------------------------------- the oracle and checks themselves

V100_USABLE = 32768 - 512


def _hand_case() -> Snapshot:
    """V100-32GB, used 16 GiB + free 10 GiB; a 10 GiB pod (prio 0) and an 8 GiB pod (prio 1)."""
    gpu = GpuState(0, mps=(MpsSlice(16 * GIB, used=True), MpsSlice(10 * GIB)))
    node = NodeState("n0", Mode.MPS, "V100-32GB", (gpu,))
    pods = (
        PendingPod("a", {"nvidia.com/gpu-10gb": 1}, priority=0),
        PendingPod("c", {"nvidia.com/gpu-8gb": 1}, priority=1),
    )
    return Snapshot((node,), pods)


def test_oracle_finds_what_a_human_would() -> None:
    """15.5 GiB beside the used slice: 8 + 10 do not fit, so the free 10 goes for the 8."""
    s = PlannerSettings()
    snap = _hand_case()
    # priority weights: prio 0 -> 1, prio 1 -> 2; c placed, the free 10 destroyed, an 8 created
    assert oracle(snap, s) == (2, s.weight_destroy + s.weight_create + s.weight_gpu_touched, 0)
    lower = Snapshot(snap.nodes, (snap.pods[0], PendingPod("c", {"nvidia.com/gpu-8gb": 1})))
    assert oracle(lower, s) == (1, 0, 0)  # equal priorities: reuse the free 10, change nothing


def test_plan_checks_reject_a_broken_plan() -> None:
    """The checks catch a dropped used slice, an oversized layout and a double-booked slice."""
    s = PlannerSettings()
    snap = _hand_case()
    good = plan(snap, s)
    assert check_plan(snap, good, s) == oracle(snap, s)

    def planned(gb: int, used: bool = False) -> PlannedSlice:
        return PlannedSlice(gb * GIB, 100 * gb * GIB // V100_USABLE, used)

    broken = [
        (planned(8),),  # the used 16 GiB slice is gone
        (planned(16, used=True), planned(8), planned(8)),  # 32 GiB > 31.5 usable
        (planned(16, used=True), planned(1)),  # no 8 GiB slice for c
        (planned(16, used=True), PlannedSlice(8 * GIB, 100)),  # 25 % of the memory, 100 % threads
    ]
    for slices in broken:
        bad = Plan(
            layouts={("n0", 0): PlannedGpu("n0", 0, mps=slices)},
            assignments=good.assignments,
            unplaced=good.unplaced,
        )
        try:
            check_plan(snap, bad, s)
        except AssertionError:
            continue
        raise AssertionError(f"check_plan accepted {slices}")
