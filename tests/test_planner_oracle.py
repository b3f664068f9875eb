"""The CP-SAT planner against a brute-force oracle on small random MIG instances.

The oracle shares no code with the planner except the catalog lookups and the validity rule
(``layout_errors``): it enumerates every subset of placements of the test's profiles on each
GPU (keeping every used instance), keeps the valid ones, sums each node's free-instance
vectors over every combination of its GPUs' layouts (remembering the least churn per vector),
then tries every assignment of pods to nodes (or to nobody).  Its optimum is the best
(weight placed per priority, highest priority first: pods, or compute with that setting,
``tests/objective_weights.py``) and then the least churn.
"""

from __future__ import annotations

import itertools
from collections import Counter
from functools import cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from objective_weights import size

from planner import (
    GpuState,
    MigInstance,
    Mode,
    NodeState,
    PendingPod,
    Plan,
    PlannerSettings,
    Snapshot,
    default_catalog,
    plan,
)
from planner.catalog import GpuModel
from planner.geometry import Placement, layout_errors
from planner.settings import PlacementWeight

CATALOG = default_catalog()


def weight(pod: PendingPod) -> int:
    """A placed pod's weight at the objective's placement level (per the settings)."""
    return size(pod) if SETTINGS.placement_weight is PlacementWeight.COMPUTE else 1


PROFILES = {
    "A100-SXM4-80GB": ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "H100-80GB": ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    "A30": ("1g.6gb", "2g.12gb", "4g.24gb"),
}
SETTINGS = PlannerSettings(time_limit_s=10.0)
Inst = tuple[str, int]  # (profile name, start)


# --------------------------------------------------------------------------- oracle


def _placements(model: GpuModel) -> list[Inst]:
    return [(name, start) for name in PROFILES[model.name] for start in model.profile(name).starts]


@cache
def _layouts(model_name: str, pinned: frozenset[Inst]) -> tuple[frozenset[Inst], ...]:
    """Every valid layout of the test profiles containing ``pinned`` (subset enumeration)."""
    model = CATALOG.model(model_name)
    cells = [p for p in _placements(model) if p not in pinned]
    out: list[frozenset[Inst]] = []

    def slots(inst: Inst) -> set[int]:
        prof = model.profile(inst[0])
        return set(range(inst[1], inst[1] + prof.memory_slices))

    def walk(i: int, chosen: list[Inst], taken: set[int]) -> None:
        if i == len(cells):
            layout = [*pinned, *chosen]
            if not layout_errors(model, [Placement(s, model.profile(n)) for n, s in layout]):
                out.append(frozenset(layout))
            return
        walk(i + 1, chosen, taken)
        span = slots(cells[i])
        if taken.isdisjoint(span):
            walk(i + 1, [*chosen, cells[i]], taken | span)

    base: set[int] = set()
    for p in pinned:
        base |= slots(p)
    walk(0, [], base)
    return tuple(out)


def _churn(before: frozenset[Inst], after: frozenset[Inst], s: PlannerSettings) -> int:
    destroyed, created = len(before - after), len(after - before)
    touched = 1 if destroyed or created else 0
    return s.weight_destroy * destroyed + s.weight_create * created + s.weight_gpu_touched * touched


def _node_options(node: NodeState) -> dict[tuple[int, ...], int]:
    """Free-instance vector (over the model's test profiles) -> least churn to reach it."""
    model = CATALOG.model(node.model)
    names = PROFILES[model.name]
    per_gpu: list[dict[tuple[int, ...], int]] = []
    for gpu in node.gpus:
        before = frozenset((i.profile, i.start) for i in gpu.mig)
        used = frozenset((i.profile, i.start) for i in gpu.mig if i.used)
        best: dict[tuple[int, ...], int] = {}
        for layout in _layouts(model.name, used):
            free = Counter(n for n, _ in layout - used)
            vec = tuple(free[n] for n in names)
            c = _churn(before, layout, SETTINGS)
            best[vec] = min(c, best.get(vec, c))
        per_gpu.append(best)
    total: dict[tuple[int, ...], int] = {tuple(0 for _ in names): 0}
    for best in per_gpu:
        nxt: dict[tuple[int, ...], int] = {}
        for (v1, c1), (v2, c2) in itertools.product(total.items(), best.items()):
            v = tuple(a + b for a, b in zip(v1, v2, strict=True))
            nxt[v] = min(c1 + c2, nxt.get(v, c1 + c2))
        total = nxt
    return total


def _demand(pod: PendingPod, node: NodeState) -> tuple[int, ...] | None:
    model = CATALOG.model(node.model)
    names = PROFILES[model.name]
    vec = [0] * len(names)
    for res, count in pod.requests.items():
        try:
            name = model.profile(res.removeprefix("nvidia.com/mig-")).name
        except ValueError:
            return None
        vec[names.index(name)] += count
    return tuple(vec)


def oracle(snap: Snapshot) -> tuple[tuple[int, ...], int]:
    """(weight placed per distinct priority, highest first; least churn for that)."""
    nodes = list(snap.nodes)
    options = [_node_options(n) for n in nodes]
    prios = sorted({p.priority for p in snap.pods}, reverse=True)
    best: tuple[tuple[int, ...], int] | None = None
    choices: list[list[int | None]] = []
    for pod in snap.pods:
        ok: list[int | None] = [None]
        for k, node in enumerate(nodes):
            allowed = pod.eligible_nodes is None or node.name in pod.eligible_nodes
            if allowed and _demand(pod, node) is not None:
                ok.append(k)
        choices.append(ok)
    for combo in itertools.product(*choices):
        churn = 0
        feasible = True
        for k, node in enumerate(nodes):
            mine = [p for p, c in zip(snap.pods, combo, strict=True) if c == k]
            if sum(p.cpu_milli for p in mine) > node.cpu_milli_free:
                feasible = False
                break
            need = [0] * len(next(iter(options[k])))
            for p in mine:
                d = _demand(p, node)
                assert d is not None
                need = [a + b for a, b in zip(need, d, strict=True)]
            costs = [
                c
                for v, c in options[k].items()
                if all(a >= b for a, b in zip(v, need, strict=True))
            ]
            if not costs:
                feasible = False
                break
            churn += min(costs)
        if not feasible:
            continue
        placed = tuple(
            sum(
                weight(p)
                for p, c in zip(snap.pods, combo, strict=True)
                if c is not None and p.priority == q
            )
            for q in prios
        )
        cand = (placed, churn)
        if best is None or (cand[0], -cand[1]) > (best[0], -best[1]):
            best = cand
    assert best is not None
    return best


# --------------------------------------------------------------------------- plan checks


def check_plan(snap: Snapshot, result: Plan) -> tuple[tuple[int, ...], int]:
    """Assert ``result`` is a consistent, valid plan; return (weight placed per priority,
    churn)."""
    assert set(result.assignments).isdisjoint(result.unplaced)
    assert set(result.assignments) | set(result.unplaced) == {p.name for p in snap.pods}
    nodes = {n.name: n for n in snap.nodes}
    free: Counter[tuple[str, int, str]] = Counter()
    churn = 0
    for node in snap.nodes:
        model = CATALOG.model(node.model)
        for gpu in node.gpus:
            before = frozenset((model.profile(i.profile).name, i.start) for i in gpu.mig)
            used = frozenset((model.profile(i.profile).name, i.start) for i in gpu.mig if i.used)
            planned = result.layouts.get((node.name, gpu.index))
            after = frozenset(planned.mig) if planned is not None else before
            if planned is not None:
                assert after != before, "a plan lists only GPUs whose layout changes"
            layout = [Placement(s, model.profile(n)) for n, s in after]
            assert layout_errors(model, layout) == []
            assert used <= after, f"used instance moved/removed on {node.name}/{gpu.index}"
            churn += _churn(before, after, SETTINGS)
            for name, _start in after - used:
                free[(node.name, gpu.index, name)] += 1
    taken: Counter[tuple[str, int, str]] = Counter()
    cpu: Counter[str] = Counter()
    pods = {p.name: p for p in snap.pods}
    for name, a in result.assignments.items():
        pod = pods[name]
        node = nodes[a.node]
        assert pod.eligible_nodes is None or a.node in pod.eligible_nodes
        model = CATALOG.model(node.model)
        assert set(a.gpus) == {r for r, c in pod.requests.items() if c}
        for res, indices in a.gpus.items():
            assert len(indices) == pod.requests[res]
            for index in indices:
                taken[(a.node, index, model.profile(res.removeprefix("nvidia.com/mig-")).name)] += 1
        cpu[a.node] += pod.cpu_milli
    for key, n in taken.items():
        assert n <= free[key], f"{key}: {n} units assigned, {free[key]} free instances"
    for name, c in cpu.items():
        assert c <= nodes[name].cpu_milli_free
    prios = sorted({p.priority for p in snap.pods}, reverse=True)
    placed = tuple(
        sum(weight(pods[n]) for n in result.assignments if pods[n].priority == q) for q in prios
    )
    return placed, churn


# --------------------------------------------------------------------------- instances


@st.composite
def gpu_state(draw: st.DrawFn, model_name: str, index: int) -> GpuState:
    model = CATALOG.model(model_name)
    cells = _placements(model)
    chosen: list[Placement] = []
    instances: list[MigInstance] = []
    for name, start in draw(st.lists(st.sampled_from(cells), max_size=4)):
        p = Placement(start, model.profile(name))
        if not layout_errors(model, [*chosen, p]):
            chosen.append(p)
            instances.append(MigInstance(name, start, used=draw(st.booleans())))
    return GpuState(index, tuple(instances))


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    n_nodes = draw(st.integers(1, 2))
    gpu_counts = draw(
        st.sampled_from([(1,), (2,), (3,)] if n_nodes == 1 else [(1, 1), (1, 2), (2, 1)])
    )
    nodes: list[NodeState] = []
    for k, n_gpus in enumerate(gpu_counts):
        model_name = draw(st.sampled_from(sorted(PROFILES)))
        gpus = tuple(draw(gpu_state(model_name, i)) for i in range(n_gpus))
        cpu = draw(st.sampled_from([2000, 4000, 1 << 40]))
        nodes.append(NodeState(f"n{k}", Mode.MIG, model_name, gpus, cpu_milli_free=cpu))
    names = sorted({p for n in nodes for p in PROFILES[n.model]})
    pods: list[PendingPod] = []
    for j in range(draw(st.integers(0, 8))):
        profile = draw(st.sampled_from(names))
        eligible = draw(
            st.one_of(st.none(), st.sets(st.sampled_from([n.name for n in nodes]), max_size=2))
        )
        pods.append(
            PendingPod(
                f"p{j}",
                {f"nvidia.com/mig-{profile}": draw(st.integers(1, 2))},
                cpu_milli=draw(st.sampled_from([0, 1000, 2000])),
                priority=draw(st.integers(0, 1)),
                eligible_nodes=None if eligible is None else frozenset(eligible),
            )
        )
    return Snapshot(tuple(nodes), tuple(pods))


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(snapshots())
def test_cpsat_plan_matches_bruteforce_optimum(snap: Snapshot) -> None:
    result = plan(snap, SETTINGS)
    assert result.status == "OPTIMAL", result.status
    placed, churn = check_plan(snap, result)
    assert (placed, churn) == oracle(snap)


def test_oracle_finds_what_a_human_would() -> None:
    """The oracle itself on a hand-solved case: 3g@4 beside a used 1g@0, else the empty GPU."""
    snap = Snapshot(
        (
            NodeState(
                "n0",
                Mode.MIG,
                "A100-SXM4-80GB",
                (GpuState(0, (MigInstance("1g.10gb", 0, used=True),)),),
            ),
        ),
        (
            PendingPod("a", {"nvidia.com/mig-3g.40gb": 1}),
            PendingPod("b", {"nvidia.com/mig-3g.40gb": 1}),
        ),
    )
    # only 3g@4 fits beside 1g@0: one pod, one created instance, GPU touched
    assert oracle(snap) == (
        (weight(snap.pods[0]),),
        SETTINGS.weight_create + SETTINGS.weight_gpu_touched,
    )
