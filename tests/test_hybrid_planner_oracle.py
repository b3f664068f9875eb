"""The planner on hybrid nodes (MPS slices inside MIG instances) against a brute-force oracle.

Rules the oracle knows (written from the issue and shared/facts/mig.md, not from the planner):
every GPU holds a valid MIG layout (validity: ``planner.geometry.layout_errors``, the rule the
MIG oracle uses too) that keeps every *pinned* instance where it is -- an instance a pod uses
whole, or one hosting a used MPS slice.  A pod asking for ``nvidia.com/mig-<P>`` takes a whole
free instance of ``P``; a pod asking for ``nvidia.com/gpu-<N>gb`` takes an MPS slice of
``N`` GiB inside an instance that no MIG pod takes and no pod uses whole.  An instance of
profile ``P`` holds slices of at most ``memory(P) - mps_reserve_mib`` MiB in all; in a host
with used slices those stay, the free ones may go.  All of a pod's units go to one node.  A pod
asking for more than one MPS slice in all is never placed: the node agent runs one MPS daemon
per MIG instance and a container reaches one daemon (reason code ``more than one MPS slice``).

The oracle enumerates every layout of each GPU (a recursive walk over all placements of the
model's profiles, each leaf checked with ``layout_errors``), and, for every subset of the pods
it may place (largest priority weight first), every way to spread their units over the GPUs; a
GPU holds a set of units if some layout has enough free instances of each MIG profile and the
slices bin-pack into its other free instances and the pinned hosts' room.  Its optimum is the
largest placed weight (tests/objective_weights.py: priorities, then pods placed).

The plan checks, independent of the oracle: no pod asking for several MPS slices is placed
(each is unplaced with that reason code), every planned layout is valid, pinned instances and
used slices stay, hosts are instances of the layout that no pod uses whole, their slices fit,
thread percentages are 1..100, and every assigned unit has its own free instance or its own
free slice of its size in the named host.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from functools import cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from objective_weights import placement_weights

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
    ThreadPolicy,
    Unplaced,
    default_catalog,
    plan,
)
from planner.catalog import GpuModel
from planner.geometry import Placement, layout_errors
from planner.greedy import plan_greedy

CATALOG = default_catalog()
MODEL = "A100-SXM4-80GB"
GIB = 1024
Inst = tuple[str, int]  # (profile name, start)
MIG_PODS = ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
MPS_GB = (5, 9, 19, 38)  # 9, 19 and 38 GiB fill a 1g.10gb, 1g.20gb, 3g.40gb after a 512 MiB reserve


# --------------------------------------------------------------------------- oracle


@cache
def _all_layouts(model_name: str) -> tuple[frozenset[Inst], ...]:
    model = CATALOG.model(model_name)
    cells = sorted(
        ((p.name, s) for p in model.profiles for s in p.starts), key=lambda c: (c[1], c[0])
    )
    out: list[frozenset[Inst]] = []

    def span(c: Inst) -> set[int]:
        prof = model.profile(c[0])
        return set(range(c[1], c[1] + prof.memory_slices))

    def walk(k: int, chosen: list[Inst], taken: set[int]) -> None:
        if k == len(cells):
            layout = [Placement(s, model.profile(n)) for n, s in chosen]
            if not layout_errors(model, layout):
                out.append(frozenset(chosen))
            return
        walk(k + 1, chosen, taken)
        sl = span(cells[k])
        if not sl & taken:
            chosen.append(cells[k])
            walk(k + 1, chosen, taken | sl)
            chosen.pop()

    walk(0, [], set())
    return tuple(out)


def _usable(model: GpuModel, profile: str, s: PlannerSettings) -> int:
    return model.profile(profile).memory_mib - s.mps_reserve_mib


def _pinned(i: MigInstance) -> bool:
    return i.used or any(x.used for x in i.mps)


def _bins_fit(items: Sequence[int], bins: Sequence[int]) -> bool:
    """Can ``items`` (MiB) be packed into bins of these capacities (MiB)?"""
    items = sorted(items, reverse=True)
    room = list(bins)

    def go(k: int) -> bool:
        if k == len(items):
            return True
        seen: set[int] = set()
        for b in range(len(room)):
            if room[b] >= items[k] and room[b] not in seen:
                seen.add(room[b])
                room[b] -= items[k]
                if go(k + 1):
                    return True
                room[b] += items[k]
        return False

    return go(0)


def _gpu_holds(
    model: GpuModel, gpu: GpuState, mig: Counter[str], mps: tuple[int, ...], s: PlannerSettings
) -> bool:
    if gpu.locked:  # nothing created or destroyed: free instances and free slices as they are
        free = Counter(i.profile for i in gpu.mig if not _pinned(i) and not i.mps)
        slices = Counter(x.memory_mib for i in gpu.mig if not i.used for x in i.mps if not x.used)
        return not (mig - free) and not (Counter(mps) - slices)
    pinned = {(i.profile, i.start) for i in gpu.mig if _pinned(i)}
    host_room = [
        _usable(model, i.profile, s) - sum(x.memory_mib for x in i.mps if x.used)
        for i in gpu.mig
        if not i.used and any(x.used for x in i.mps)
    ]
    for layout in _all_layouts(model.name):
        if not pinned <= layout:
            continue
        free = Counter(n for n, at in layout if (n, at) not in pinned)
        if any(free[p] < k for p, k in mig.items()):
            continue
        left = free - mig
        bins = [_usable(model, p, s) for p in left.elements()] + host_room
        if _bins_fit(mps, bins):
            return True
    return False


def _units(pod: PendingPod) -> tuple[list[str], list[int]]:
    mig: list[str] = []
    mps: list[int] = []
    for res, n in pod.requests.items():
        if res.startswith("nvidia.com/mig-"):
            mig += [res.removeprefix("nvidia.com/mig-")] * n
        else:
            mps += [int(res.removeprefix("nvidia.com/gpu-").removesuffix("gb")) * GIB] * n
    return mig, mps


def _mps_slices(pod: PendingPod) -> int:
    """How many MPS slices the pod asks for in all (more than one: never placed)."""
    return len(_units(pod)[1])


def oracle(snap: Snapshot, s: PlannerSettings) -> int:
    (node,) = snap.nodes
    model = CATALOG.model(node.model)
    w = placement_weights(snap.pods)
    memo: dict[tuple[int, tuple[tuple[str, int], ...], tuple[int, ...]], bool] = {}

    def holds(k: int, mig: list[str], mps: list[int]) -> bool:
        key = (k, tuple(sorted(Counter(mig).items())), tuple(sorted(mps)))
        if key not in memo:
            memo[key] = _gpu_holds(model, node.gpus[k], Counter(mig), key[2], s)
        return memo[key]

    best = 0
    n = len(node.gpus)
    placeable = [p for p in snap.pods if _mps_slices(p) <= 1]
    for r in range(len(placeable), 0, -1):
        for subset in itertools.combinations(placeable, r):
            weight = sum(w[p.name] for p in subset)
            if weight <= best:
                continue
            units = [("mig", u) for p in subset for u in _units(p)[0]]
            units += [("mps", u) for p in subset for u in _units(p)[1]]
            for split in itertools.product(range(n), repeat=len(units)):
                ok = True
                for k in range(n):
                    mine = [u for u, g in zip(units, split, strict=True) if g == k]
                    mig = [str(v) for kind, v in mine if kind == "mig"]
                    mps = [int(v) for kind, v in mine if kind == "mps"]
                    if not holds(k, mig, mps):
                        ok = False
                        break
                if ok:
                    best = weight
                    break
    return best


# --------------------------------------------------------------------------- plan checks


def check_plan(snap: Snapshot, result: Plan, s: PlannerSettings) -> int:
    """Assert the plan is valid (module docstring); return its placed priority weight."""
    (node,) = snap.nodes
    model = CATALOG.model(node.model)
    final: dict[int, tuple[set[Inst], dict[int, list[tuple[int, bool]]]]] = {}
    for gpu in node.gpus:
        planned = result.layouts.get((node.name, gpu.index))
        if planned is None:
            layout = {(model.profile(i.profile).name, i.start) for i in gpu.mig}
            hosts = {i.start: [(x.memory_mib, x.used) for x in i.mps] for i in gpu.mig if i.mps}
        else:
            assert not planned.mps
            layout = set(planned.mig)
            assert len(layout) == len(planned.mig)
            errs = layout_errors(model, [Placement(at, model.profile(n)) for n, at in layout])
            assert not errs, errs
            hosts = {at: [(x.memory_mib, x.used) for x in sl] for at, sl in planned.mig_mps}
            for _, sl in planned.mig_mps:
                assert all(1 <= x.thread_percentage <= 100 for x in sl)
        by_start = {at: n for n, at in layout}
        if gpu.locked:
            assert layout == {(model.profile(i.profile).name, i.start) for i in gpu.mig}
        for i in gpu.mig:
            if _pinned(i):
                assert by_start.get(i.start) == model.profile(i.profile).name, f"moved {i}"
            if i.mps and (i.used or gpu.locked):  # sealed, or on a locked GPU: kept exactly
                got = sorted(m for m, _ in hosts.get(i.start, []))
                assert got == sorted(x.memory_mib for x in i.mps), f"slices of kept {i} changed"
            used = Counter(x.memory_mib for x in i.mps if x.used)
            kept = Counter(m for m, u in hosts.get(i.start, []) if u)
            assert not used - kept, f"used slices of {i} dropped"
            if i.used and not i.mps:
                assert i.start not in hosts, f"whole-used {i} hosts slices"
        for at, sl in hosts.items():
            assert at in by_start, f"slices in no instance at {at}"
            assert sum(m for m, _ in sl) <= _usable(model, by_start[at], s)
        final[gpu.index] = (layout, hosts)
    used_whole = {(g.index, i.start) for g in node.gpus for i in g.mig if i.used and not i.mps}
    free_mig: Counter[tuple[int, str]] = Counter()
    for k, (layout, hosts) in final.items():
        for n, at in layout:
            if at not in hosts and (k, at) not in used_whole:
                free_mig[(k, n)] += 1
    sealed = {(g.index, i.start) for g in node.gpus for i in g.mig if i.used and i.mps}
    free_mps: Counter[tuple[int, int, int]] = Counter()
    for k, (_, hosts) in final.items():
        for at, sl in hosts.items():
            for m, u in sl:
                if not u and (k, at) not in sealed:
                    free_mps[(k, at, m)] += 1
    w = placement_weights(snap.pods)
    weight = 0
    for pod in snap.pods:
        a = result.assignments.get(pod.name)
        if _mps_slices(pod) > 1:
            assert a is None, f"{pod.name} placed with {pod.requests}: one MPS slice per pod"
            assert result.unplaced[pod.name].startswith(Unplaced.MPS_SLICES.value)
        if a is None:
            assert pod.name in result.unplaced
            continue
        assert a.node == node.name
        weight += w[pod.name]
        for res, gpus in a.gpus.items():
            assert len(gpus) == pod.requests[res]
            if res.startswith("nvidia.com/mig-"):
                prof = model.profile(res.removeprefix("nvidia.com/mig-")).name
                for k in gpus:
                    free_mig[(k, prof)] -= 1
                    assert free_mig[(k, prof)] >= 0, f"{pod.name}: no free {prof} on GPU {k}"
            else:
                mib = int(res.removeprefix("nvidia.com/gpu-").removesuffix("gb")) * GIB
                starts = a.hosts[res]
                assert len(starts) == len(gpus)
                for k, at in zip(gpus, starts, strict=True):
                    free_mps[(k, at, mib)] -= 1
                    assert free_mps[(k, at, mib)] >= 0, f"{pod.name}: no free slice {k}@{at}"
    return weight


# --------------------------------------------------------------------------- instances


@st.composite
def gpu_state(draw: st.DrawFn, index: int, s: PlannerSettings) -> GpuState:
    """A GPU's instances: free, used whole, hosts (slices used or free), now and then a
    sealed host (used itself: processes of no pod on it), and one GPU in six locked (its
    hosts then pinned or sealed: the partitioner locks a GPU unhealthy as a whole, whose
    slices all count as used, or one adopted from labels, which lists no slices)."""
    model = CATALOG.model(MODEL)
    layouts = [lay for lay in _all_layouts(MODEL) if "+" not in str(sorted(lay))]
    layout = sorted(draw(st.sampled_from([frozenset(), *layouts[:: max(1, len(layouts) // 60)]])))
    locked = draw(st.integers(0, 5)) == 0
    instances: list[MigInstance] = []
    for name, start in sorted(layout, key=lambda c: c[1]):
        kind = draw(st.sampled_from(["free", "used", "host", "host", "sealed"]))
        if kind == "used":
            instances.append(MigInstance(name, start, used=True))
            continue
        slices: list[MpsSlice] = []
        if kind in ("host", "sealed"):
            left = _usable(model, name, s)
            for _ in range(draw(st.integers(1, 3))):
                fits = [gb for gb in MPS_GB if gb * GIB <= left]
                if not fits:
                    break
                gb = draw(st.sampled_from(fits))
                slices.append(MpsSlice(gb * GIB, used=draw(st.booleans())))
                left -= gb * GIB
            if locked and kind == "host" and slices and not any(x.used for x in slices):
                slices[0] = MpsSlice(slices[0].memory_mib, used=True)
        instances.append(MigInstance(name, start, used=kind == "sealed", mps=tuple(slices)))
    return GpuState(index, mig=tuple(instances), locked=locked)


@st.composite
def instances(draw: st.DrawFn) -> tuple[Snapshot, PlannerSettings]:
    s = PlannerSettings(
        time_limit_s=10.0,
        mps_reserve_mib=draw(st.sampled_from([512, 1536])),
        mps_thread_policy=draw(st.sampled_from(list(ThreadPolicy))),
    )
    n_gpus = draw(st.integers(1, 2))
    gpus = tuple(draw(gpu_state(k, s)) for k in range(n_gpus))
    node = NodeState("n1", Mode.HYBRID, MODEL, gpus)
    pods: list[PendingPod] = []
    for j in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            requests = {f"nvidia.com/mig-{draw(st.sampled_from(MIG_PODS))}": 1}
        else:
            # mostly one slice; now and then two (one size or two), which must stay unplaced
            slices = 2 if draw(st.integers(0, 4)) == 0 else 1
            sizes = [draw(st.sampled_from(MPS_GB)) for _ in range(slices)]
            requests = {f"nvidia.com/gpu-{gb}gb": n for gb, n in Counter(sizes).items()}
        pods.append(PendingPod(f"p{j}", requests, priority=draw(st.integers(0, 1))))
    return Snapshot((node,), tuple(pods)), s


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(instances())
def test_cpsat_hybrid_plan_is_valid_and_matches_bruteforce_optimum(
    case: tuple[Snapshot, PlannerSettings],
) -> None:
    snap, s = case
    result = plan(snap, s)
    weight = check_plan(snap, result, s)
    if result.status == "OPTIMAL":
        assert weight == oracle(snap, s)
    else:
        assert weight <= oracle(snap, s)


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(instances())
def test_greedy_hybrid_plan_is_valid(case: tuple[Snapshot, PlannerSettings]) -> None:
    snap, s = case
    result = plan_greedy(snap, s)
    assert check_plan(snap, result, s) <= oracle(snap, s)


# --------------------------------------------------------------------------- by hand


def test_oracle_and_planner_on_the_issue_example() -> None:
    """A 10 GiB MPS pod and a 3g.40gb pod on one empty A100-80GB: both fit, one GPU."""
    s = PlannerSettings(time_limit_s=10.0)
    node = NodeState("n1", Mode.HYBRID, MODEL, (GpuState(0),))
    pods = (
        PendingPod("mps", {"nvidia.com/gpu-10gb": 1}),
        PendingPod("mig", {"nvidia.com/mig-3g.40gb": 1}),
    )
    snap = Snapshot((node,), pods)
    assert oracle(snap, s) == 2
    result = plan(snap, s)
    assert check_plan(snap, result, s) == 2
    planned = result.layouts[("n1", 0)]
    (host_start,) = result.assignments["mps"].hosts["nvidia.com/gpu-10gb"]
    assert host_start in dict(planned.mig_mps)
    assert ("3g.40gb", host_start) not in planned.mig  # the MIG pod's instance hosts nothing


def test_a_used_slice_pins_its_instance() -> None:
    """A 7g.80gb hosting a used slice stays: a 3g.40gb pod cannot get an instance, a 20 GiB
    MPS pod gets a slice beside the used one."""
    s = PlannerSettings(time_limit_s=10.0)
    gpu = GpuState(0, mig=(MigInstance("7g.80gb", 0, mps=(MpsSlice(10 * GIB, used=True),)),))
    node = NodeState("n1", Mode.HYBRID, MODEL, (gpu,))
    pods = (
        PendingPod("mig", {"nvidia.com/mig-3g.40gb": 1}),
        PendingPod("mps", {"nvidia.com/gpu-20gb": 1}),
    )
    snap = Snapshot((node,), pods)
    for result in (plan(snap, s), plan_greedy(snap, s)):
        assert check_plan(snap, result, s) == oracle(snap, s) == 1
        assert "mig" in result.unplaced and result.assignments["mps"].hosts == {
            "nvidia.com/gpu-20gb": (0,)
        }
        planned = result.layouts[("n1", 0)]
        assert planned.mig == (("7g.80gb", 0),)
        (sl,) = [x for _, x in planned.mig_mps]
        assert sorted((x.memory_mib, x.used) for x in sl) == [(10 * GIB, True), (20 * GIB, False)]


def test_a_new_slice_joins_a_host_with_room_before_a_free_instance_becomes_a_host() -> None:
    """A 20 GiB MPS pod, a 7g.80gb hosting a used 10 GiB slice (room for 69 GiB more) on GPU 0
    and a free whole 7g.80gb on GPU 1: the slice goes beside the used one and GPU 1 stays a
    whole MIG device.  Making GPU 1 a host changes a GPU as much (a daemon started, a MIG
    device withdrawn) and leaves a host that a 7g pod can have only after another
    reconfiguration: the churn level charges a host started or stopped like a touched GPU
    (before, a new host cost one slice, 2, and a slice in a pinned host 10)."""
    s = PlannerSettings(time_limit_s=10.0)
    host = GpuState(0, mig=(MigInstance("7g.80gb", 0, mps=(MpsSlice(10 * GIB, used=True),)),))
    whole = GpuState(1, mig=(MigInstance("7g.80gb", 0),))
    snap = Snapshot(
        (NodeState("n1", Mode.HYBRID, MODEL, (host, whole)),),
        (PendingPod("mps", {"nvidia.com/gpu-20gb": 1}),),
    )
    for result in (plan(snap, s), plan_greedy(snap, s)):
        assert check_plan(snap, result, s) == oracle(snap, s) == 1
        assert result.assignments["mps"].gpus == {"nvidia.com/gpu-20gb": (0,)}
        assert set(result.layouts) == {("n1", 0)}


def test_oracle_refuses_what_does_not_fit() -> None:
    """Two 38 GiB slices exceed any instance's usable memory on an A100-80GB split 3g+4g (the
    4g in use): one of two one-slice pods fits, the other does not; and a pod asking for both
    slices is refused however much room there is (one MPS slice per pod)."""
    s = PlannerSettings(time_limit_s=10.0)
    gpu = GpuState(0, mig=(MigInstance("4g.40gb", 0, used=True), MigInstance("3g.40gb", 4)))
    node = NodeState("n1", Mode.HYBRID, MODEL, (gpu,))
    pods = (
        PendingPod("a", {"nvidia.com/gpu-38gb": 1}),
        PendingPod("b", {"nvidia.com/gpu-38gb": 1}),
    )
    snap = Snapshot((node,), pods)
    assert oracle(snap, s) == 1
    result = plan(snap, s)
    assert check_plan(snap, result, s) == 1 and len(result.unplaced) == 1
    (reason,) = result.unplaced.values()
    assert reason.startswith(Unplaced.CAPACITY.value), reason
    empty = Snapshot((NodeState("n1", Mode.HYBRID, MODEL, (GpuState(0),)),), pods)
    assert oracle(empty, s) == 2  # a 7g.80gb, or two 3g.40gb, holds both
    both = Snapshot(empty.nodes, (PendingPod("a", {"nvidia.com/gpu-38gb": 2}),))
    assert oracle(both, s) == 0
    for result in (plan(both, s), plan_greedy(both, s)):
        assert check_plan(both, result, s) == 0 and not result.layouts
        assert result.unplaced["a"].startswith(Unplaced.MPS_SLICES.value)


def test_a_locked_gpu_hosts_nothing_new() -> None:
    """A locked GPU (instances adopted before gpuslice, places or users unsure) keeps its
    layout exactly: its free 3g.40gb cannot become a host; an unlocked GPU's instance can."""
    s = PlannerSettings(time_limit_s=10.0)
    locked = GpuState(0, mig=(MigInstance("3g.40gb", 0), MigInstance("3g.40gb", 4)), locked=True)
    pods = (PendingPod("mps", {"nvidia.com/gpu-10gb": 1}),)
    alone = Snapshot((NodeState("n1", Mode.HYBRID, MODEL, (locked,)),), pods)
    for result in (plan(alone, s), plan_greedy(alone, s)):
        assert "mps" in result.unplaced and not result.layouts
    free = GpuState(1, mig=(MigInstance("7g.80gb", 0),))
    both = Snapshot((NodeState("n1", Mode.HYBRID, MODEL, (locked, free)),), pods)
    for result in (plan(both, s), plan_greedy(both, s)):
        assert result.assignments["mps"].gpus == {"nvidia.com/gpu-10gb": (1,)}
        assert set(result.layouts) == {("n1", 1)}


def test_a_free_host_on_a_locked_gpu_keeps_its_slices_and_serves_from_them() -> None:
    """A locked GPU's free MPS host (no used slice) keeps its slices exactly and a pod asking
    for one of their size gets it.  CP-SAT's model counted such hosts among the locked GPU's
    free instances and so could not keep them: it placed nothing on the GPU alone, and with a
    free GPU beside it wrote the locked GPU's layout without the host's slices and made the
    same slices anew on the free GPU."""
    s = PlannerSettings(time_limit_s=10.0)
    host = MigInstance("1g.10gb", 0, mps=(MpsSlice(4096), MpsSlice(4096)))
    locked = GpuState(0, mig=(host, MigInstance("1g.10gb", 1, used=True)), locked=True)
    pods = (PendingPod("p", {"nvidia.com/gpu-4gb": 1}),)
    for gpus in ((locked,), (locked, GpuState(1))):
        snap = Snapshot((NodeState("n", Mode.HYBRID, MODEL, gpus),), pods)
        for result in (plan(snap, s), plan_greedy(snap, s)):
            assert result.assignments["p"].gpus == {"nvidia.com/gpu-4gb": (0,)}
            assert result.assignments["p"].hosts == {"nvidia.com/gpu-4gb": (0,)}
            assert ("n", 0) not in result.layouts and not result.layouts


def test_slice_patterns_are_every_fitting_multiset_or_the_maximal_ones() -> None:
    """planner.hybrid.patterns against a product enumeration: every non-empty multiset within
    the caps and the memory while there are at most 64, else the maximal ones."""
    import random

    from planner.hybrid import patterns

    rng = random.Random(7)
    for _ in range(300):
        sizes = sorted(rng.sample([1024, 2048, 3072, 5120, 9216, 20480], rng.randint(1, 3)))
        caps = [rng.randint(0, 12) for _ in sizes]
        usable = rng.choice([9216, 19456, 39680, 80640])
        capped = [min(c, usable // m) for m, c in zip(sizes, caps, strict=True)]
        fits = [
            c
            for c in itertools.product(*(range(k + 1) for k in capped))
            if any(c) and sum(n * m for n, m in zip(c, sizes, strict=True)) <= usable
        ]

        maximal = []
        for c in fits:
            left = usable - sum(n * m for n, m in zip(c, sizes, strict=True))
            if all(n >= k or m > left for n, k, m in zip(c, capped, sizes, strict=True)):
                maximal.append(c)
        maximal.sort(key=lambda c: (-sum(c), c))
        got = set(patterns(usable, sizes, caps))
        assert got == (set(fits) if len(fits) <= 64 else set(maximal[:64]))
