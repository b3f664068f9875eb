"""Packing polish of MPS placements: FGD-style descent on an exact node-level measure.

Why
---
The CP-SAT model values an MPS GPU's free memory per GPU (:mod:`planner.mps`: ``f P(f)``,
FGD's fragmentation of one GPU), which the model can sum linearly.  What packs a cluster is a
*node*-level measure: a GPU's free memory is of use only to pods the node's free CPU can still
host, and only as many of them as that CPU admits; and a free share that fits the next pod may
still leave a hole no later pod fits.  Neither is linear in the model's variables.  So after
the solve the placements of MPS pods asking for one slice size (one slice or several, on one
node) are polished with that measure, keeping every higher level of the objective: the same
pods placed, no more churn.

Measure (one node; memory in MiB, reported in milli-GPU: ``× 1000 / full``, ``full`` the GPU's
usable memory rounded down to GiB, the whole-GPU slice)
-------------------------------------------------------------------------------------------
Target shapes ``m`` (:func:`polish_target`): CPU ``c_m``, slice ``s_m`` MiB, GPUs ``k_m``,
share ``p_m`` (summing to 1).  Node state: free CPU ``c``, free memory ``f_g`` per GPU (usable
memory minus every slice the plan leaves on it, used or free), ``idle = Σ_g f_g``.

* CPU-aware fragmentation ``F' = Σ_m p_m (idle - u_m)``: ``u_m`` is the sum of the ``n_m k_m``
  largest ``f_g >= s_m``, ``n_m = floor(c / c_m)`` pods of ``m`` the CPU admits (``u_m = 0`` if
  fewer than ``k_m`` GPUs fit or ``n_m = 0``).  FGD's measure treats CPU as a yes/no gate; here
  it also caps how many GPUs a shape can use (a node with the CPU for one more pod cannot use
  two GPUs' free memory).
* Expected waste ``W = Σ_g w(f_g)``: what is expected to remain of a free share once future
  single-GPU pods of the shapes the CPU admits (``c_m <= c``) have filled it, the next one
  drawn in proportion to ``p_m`` among those that fit: ``w(h) = h`` if no ``s_m <= h``, else
  ``Σ_{s_m <= h} p_m w(h - s_m) / Σ_{s_m <= h} p_m``; computed per whole GiB (slices are GiB
  multiples), the sub-GiB rest being waste.
* ``G = F' + ½ W``.

Polish
------
Movable: every pod of the plan whose request is one MPS slice size (``n >= 1`` slices) on an
MPS node, on GPUs none of which had a free slice of that size before (so its slices are new).
In order of the memory it asks for (largest first), then slice size, then name, each movable
pod is taken off its GPUs and put back where its *score* ``-floor((G_after - G_before) / 20
milli)`` is highest among the snapshot's MPS nodes it may use (eligible node, the node's CPU
and memory left by the plan, free memory for its slices); on a node its slices are chosen one
at a time, each on the GPU with the smallest raw ``G`` after it (equal values to the fullest
GPU, then the lower index; a GPU may take several), moving it only where churn does not grow:
it may start touching at most as many GPUs (``w_touched`` each) as its source GPUs stop
being touched.  Ties between nodes go to the earlier node in the snapshot's order, then to the
lower first GPU index.  A multi-GPU pod moves as a whole, so where it goes is chosen by what
its GPUs leave behind: the measure counts a node's free GPUs for the multi-GPU shapes of the
target only while enough of them fit together.  The quantisation is FGD's (fgd.md §7):
changes within one step tie and go to a fixed node order, which packs nodes one after another
(measured: without it the same measure loses 0.4 points on the openb saturation protocol).

Cost.  A pod's candidates are every MPS node of the snapshot it may use.  One plan makes at
most ``max_evals`` node evaluations, one per node and slice of a pod (:func:`polish_evals`:
:data:`TIME_SHARE` of the time limit less the setup, :data:`S_PER_GPU` per MPS GPU, at
:data:`S_PER_EVAL` an evaluation); a pod with fewer evaluations left than its candidates
times its slices gets its own node and the best-fit ones (least free memory share, then the snapshot's order) up to what
is left, and a pod with fewer evaluations left than its slices stays where the solve put it
(smaller pods after it may still move).  Why every node, measured (openb default, seed 42,
kube-scheduler's default profile placing the CPU-only pods,
simulations/results/saturation-2026-12-02/): with the candidates cut to the best-fit MPS nodes
of ``max_model_gpus`` GPUs the planner reached 89.16 % GPU-milli allocation, the rule
``fgd-waste`` scoring every node 96.10 %, and that rule cut to the same best-fit nodes 90.04 %:
a node whose free CPU strands its GPUs looks roomy to best fit, and a small pod there is what
packs.

Pure and deterministic: no clock; memoised per (node class, CPU, free memory).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from planner.catalog import GpuModel
from planner.demand import mps_usable_mib
from planner.mps import client_slots, thread_budget, thread_percentage
from planner.settings import PlannerSettings, ThreadPolicy
from planner.snapshot import (
    Assignment,
    Mode,
    NodeState,
    PendingPod,
    Plan,
    PlannedGpu,
    PlannedSlice,
    Snapshot,
    mps_gb_of,
)

__all__ = [
    "SCORE_STEP_MILLI",
    "S_PER_EVAL",
    "S_PER_GPU",
    "TIME_SHARE",
    "WASTE_WEIGHT",
    "NodeMeasure",
    "Shape",
    "node_measure",
    "node_score",
    "polish_budget",
    "polish_evals",
    "polish_mps",
    "polish_target",
]

SCORE_STEP_MILLI = 20.0
"""Width of one score step of the measure's change, milli-GPU (module docstring)."""
WASTE_WEIGHT = 0.5
"""Weight of the expected waste beside the CPU-aware fragmentation."""
S_PER_EVAL = 1e-5
"""Seconds one node evaluation takes (one core of the development machine, the 1213-node
openb cluster: 3 µs measured once the measure's memo holds the nodes' states, as it does
across consecutive plans; up to 80 µs for a state never seen, so the first plan after a start
or a target change may overrun its share)."""
S_PER_GPU = 5e-6
"""Seconds the polish's setup takes per MPS GPU of the snapshot (2.5-5 µs measured)."""
TIME_SHARE = 0.1
"""The most of a plan's time limit the polish may take (:func:`polish_evals`)."""
COVERAGE = 0.95
"""The target keeps its most frequent shapes up to this share of the weight (as FGD's)."""
_GIB = 1024
_MEMO_LIMIT = 200_000
"""Node states remembered per measure before the memo starts afresh (bounds its memory)."""


@dataclass(frozen=True, slots=True)
class Shape:
    cpu_milli: int
    mib: int
    gpus: int
    p: float


def polish_target(snapshot: Snapshot, settings: PlannerSettings) -> tuple[Shape, ...]:
    """The target shapes (module docstring): ``settings.free_capacity_mps_shapes`` when given;
    else ``settings.free_capacity_mps_sizes`` when given, each size one slice with the target's
    per-pod CPU (``free_capacity_cpu_milli``, or 0); else learned from the snapshot: one count
    per pending pod asking for MPS slices (its CPU, slice size and count) and one per slice in
    use on an MPS GPU (the CPU of the pod holding it is not in the snapshot: the target's
    per-pod CPU, or 0).  The most frequent shapes up to :data:`COVERAGE` of the weight are
    kept."""
    counts: Counter[tuple[int, int, int]] = Counter()
    weights: dict[tuple[int, int, int], float] = defaultdict(float)
    target_cpu = max(0, settings.free_capacity_cpu_milli or 0)
    if settings.free_capacity_mps_shapes is not None:
        for cpu, mib, gpus, w in settings.free_capacity_mps_shapes:
            if mib > 0 and gpus > 0 and w > 0:
                weights[(max(0, cpu), mib, gpus)] += w
    elif settings.free_capacity_mps_sizes is not None:
        for mib, w in settings.free_capacity_mps_sizes:
            if mib > 0 and w > 0:
                weights[(target_cpu, mib, 1)] += w
    else:
        used_cpu = target_cpu
        for node in snapshot.nodes:
            if node.mode is Mode.MPS:
                for gpu in node.gpus:
                    counts.update((used_cpu, s.memory_mib, 1) for s in gpu.mps if s.used)
        for pod in snapshot.pods:
            shape = _pod_shape(pod)
            if shape is not None:
                counts[shape] += 1
        for key, n in counts.items():
            weights[key] += n
    total = sum(weights.values())
    if total <= 0:
        return ()
    ordered = sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))
    kept: list[tuple[tuple[int, int, int], float]] = []
    cum = 0.0
    for key, w in ordered:
        kept.append((key, w))
        cum += w
        if cum >= COVERAGE * total:
            break
    kept_total = sum(w for _, w in kept)
    return tuple(Shape(c, mib, g, w / kept_total) for (c, mib, g), w in kept)


def _pod_shape(pod: PendingPod) -> tuple[int, int, int] | None:
    """(CPU, slice MiB, slices) of a pod asking for one MPS slice size, else ``None``."""
    sizes = [(mps_gb_of(r), n) for r, n in pod.requests.items() if n > 0]
    if len(sizes) != 1 or sizes[0][0] is None:
        return None
    gb, n = sizes[0]
    return (pod.cpu_milli, (gb or 0) * _GIB, n)


class NodeMeasure:
    """``G`` of the module docstring for one target and one GPU size, memoised."""

    def __init__(self, shapes: Sequence[Shape], usable_mib: int) -> None:
        self.shapes = tuple(shapes)
        self.usable = usable_mib
        self.full = usable_mib // _GIB * _GIB
        self._memo: dict[tuple[int, tuple[int, ...]], float] = {}
        self._waste: dict[tuple[int, ...], list[float]] = {}
        self._cpu_steps = sorted({s.cpu_milli for s in self.shapes if s.gpus == 1})

    def value(self, cpu: int, frees: Sequence[int]) -> float:
        """``G`` in milli-GPU of a node with ``cpu`` free CPU and GPUs with ``frees`` MiB free."""
        key = (cpu, tuple(sorted(frees, reverse=True)))
        v = self._memo.get(key)
        if v is None:
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            v = self._memo[key] = self._compute(key[0], key[1])
        return v

    def _compute(self, cpu: int, desc: tuple[int, ...]) -> float:
        if not desc or self.full <= 0:
            return 0.0
        idle = sum(desc)
        frag = 0.0
        for s in self.shapes:
            pods = cpu // s.cpu_milli if s.cpu_milli > 0 else len(desc)
            fit = 0
            while fit < len(desc) and desc[fit] >= s.mib:
                fit += 1
            if fit < s.gpus or pods <= 0:
                frag += s.p * idle
            else:
                frag += s.p * (idle - sum(desc[: min(fit, pods * s.gpus)]))
        table = self._waste_table(cpu)
        waste = 0.0
        for f in desc:
            gib, rest = divmod(max(0, f), _GIB)
            waste += _GIB * table[min(gib, len(table) - 1)] + rest
        return (frag + WASTE_WEIGHT * waste) * 1000.0 / self.full

    def _waste_table(self, cpu: int) -> list[float]:
        admitted = tuple(i for i, s in enumerate(self.shapes) if s.gpus == 1 and s.cpu_milli <= cpu)
        t = self._waste.get(admitted)
        if t is None:
            sizes = sorted((self.shapes[i].mib // _GIB, self.shapes[i].p) for i in admitted)
            top = self.usable // _GIB
            w = [0.0] * (top + 1)
            for h in range(top + 1):
                num = den = 0.0
                for gib, p in sizes:
                    if gib > h or gib <= 0:
                        continue
                    num += p * w[h - gib]
                    den += p
                w[h] = num / den if den > 0 else float(h)
            t = self._waste[admitted] = w
        return t


def node_score(
    measure: NodeMeasure,
    cpu_free: int,
    frees: Sequence[int],
    pod_cpu: int,
    mib: int,
    count: int = 1,
    cost: Sequence[int] | None = None,
    budget: int = 0,
    slots: Sequence[int] | None = None,
) -> tuple[int, tuple[int, ...]] | None:
    """The polish's score of a node for a pod of ``pod_cpu`` CPU on ``count`` slices of
    ``mib`` MiB, and the GPUs they would take (module docstring, "Polish"):
    ``-floor((G_after - G_before) / step)``.  The slices are chosen one at a time, each on the
    GPU with the smallest ``G`` after it (the node's CPU already less the pod's; equal values
    to the fullest GPU, then the lowest index) among the GPUs with ``mib`` free whose churn
    ``cost[k]`` (default 0: none) keeps the total of distinct GPUs chosen within ``budget``; a
    GPU may take several, at most ``slots[k]`` (default: no limit; the MPS client limit and
    thread budget, :func:`open_slots`).  ``None`` when fewer than ``count`` slices fit.  The
    caller checks that the node's CPU and memory admit the pod."""
    if count < 1:
        return None
    left = list(frees)
    before = measure.value(cpu_free, frees)
    after_cpu = cpu_free - pod_cpu
    chosen: list[int] = []
    spent = 0
    value = before
    for _ in range(count):
        pick: tuple[float, int, int] | None = None
        for k, f in enumerate(left):
            if f < mib or (slots is not None and chosen.count(k) >= slots[k]):
                continue
            extra = 0 if cost is None or k in chosen else cost[k]
            if spent + extra > budget:
                continue
            left[k] -= mib
            v = measure.value(after_cpu, left)
            left[k] += mib
            # equal values: the fullest GPU (an empty one stays empty), then the lowest index
            if pick is None or (v, f) < (pick[0], pick[2]):
                pick = (v, k, f)
        if pick is None:
            return None
        value, k, _ = pick
        spent += 0 if cost is None or k in chosen else cost[k]
        left[k] -= mib
        chosen.append(k)
    return -math.floor((value - before) / SCORE_STEP_MILLI), tuple(sorted(chosen))


@lru_cache(maxsize=8)
def node_measure(shapes: tuple[Shape, ...], usable_mib: int) -> NodeMeasure:
    """One :class:`NodeMeasure` per (target, GPU size), shared by consecutive plans: its memo
    is a pure function's (the values never depend on what was asked before)."""
    return NodeMeasure(shapes, usable_mib)


@dataclass(slots=True)
class _Gpu:
    node: str
    index: int
    usable: int
    current: tuple[tuple[int, bool, int | None], ...]
    """(MiB, used, threads) of the slices it has now."""
    planned: list[PlannedSlice] | None
    """The slices the plan gives it; ``None``: its current ones (built on the first change, so
    the setup of a large snapshot costs little)."""
    free: int = 0
    """Usable memory minus every planned slice (:meth:`update`)."""
    touched: bool = False
    """The plan changes its slices (:meth:`update`)."""

    def slices(self, policy: ThreadPolicy) -> list[PlannedSlice]:
        """The planned slices, built from the current ones when the plan leaves it alone."""
        if self.planned is None:
            self.planned = [
                PlannedSlice(
                    m, t if t is not None else thread_percentage(m, self.usable, policy), u
                )
                for m, u, t in self.current
            ]
        return self.planned

    def update(self) -> None:
        if self.planned is None:
            self.free = self.usable - sum(m for m, _, _ in self.current)
            self.touched = False
            return
        self.free = self.usable - sum(x.memory_mib for x in self.planned)
        now = Counter((m, u) for m, u, _ in self.current)
        self.touched = now != Counter((x.memory_mib, x.used) for x in self.planned)


def polish_budget(snapshot: Snapshot, settings: PlannerSettings) -> tuple[int, float]:
    """(evaluations, seconds) of the polish of a plan of ``snapshot``: the node evaluations it
    may make, every MPS node for each slice of the pods asking for one MPS slice size, within
    :data:`TIME_SHARE` of the time limit once the setup (:data:`S_PER_GPU` per MPS GPU) is
    paid (0 without MPS nodes, with the polish off, or when the setup alone takes the share);
    and the time it is expected to take, setup and evaluations (0 when it evaluates nothing).
    Deterministic, so :func:`planner.plan` sets the time aside before the solve and hands the
    evaluations to :func:`polish_mps`."""
    if not settings.mps_polish:
        return 0, 0.0
    nodes = [n for n in snapshot.nodes if n.mode is Mode.MPS and n.gpus]
    if not nodes:
        return 0, 0.0
    slices = sum(shape[2] for p in snapshot.pods if (shape := _pod_shape(p)) is not None)
    setup = S_PER_GPU * sum(len(n.gpus) for n in nodes)
    cap = int((TIME_SHARE * settings.time_limit_s - setup) / S_PER_EVAL)
    evals = max(0, min(cap, slices * len(nodes)))
    return evals, (setup + S_PER_EVAL * evals if evals > 0 else 0.0)


def polish_evals(snapshot: Snapshot, settings: PlannerSettings) -> int:
    """The evaluations of :func:`polish_budget`."""
    return polish_budget(snapshot, settings)[0]


def polish_mps(
    snapshot: Snapshot,
    result: Plan,
    models: Mapping[str, GpuModel],
    settings: PlannerSettings,
    max_evals: int | None = None,
) -> Plan:
    """``result`` with its movable MPS placements polished (module docstring); at most
    ``max_evals`` node evaluations (default :func:`polish_evals`)."""
    limit = polish_evals(snapshot, settings) if max_evals is None else max_evals
    shapes = polish_target(snapshot, settings) if limit > 0 else ()
    if not shapes:
        return result
    mps_nodes = [n for n in snapshot.nodes if n.mode is Mode.MPS and n.gpus]
    if not mps_nodes:
        return result
    order = {n.name: i for i, n in enumerate(mps_nodes)}
    policy = settings.mps_thread_policy
    gpus: dict[tuple[str, int], _Gpu] = {}
    measures: dict[int, NodeMeasure] = {}
    for n in mps_nodes:
        usable = mps_usable_mib(n, models[n.name], settings)
        if usable not in measures:
            measures[usable] = node_measure(shapes, usable)
        for g in n.gpus:
            planned = result.layouts.get((n.name, g.index))
            cur = tuple((s.memory_mib, s.used, s.thread_percentage) for s in g.mps)
            state = _Gpu(n.name, g.index, usable, cur, list(planned.mps) if planned else None)
            state.update()
            gpus[(n.name, g.index)] = state
    cpu_left = {n.name: n.cpu_milli_free for n in mps_nodes}
    mem_left = {n.name: n.memory_mib_free for n in mps_nodes}
    pods = {p.name: p for p in snapshot.pods}
    for name, a in result.assignments.items():
        if a.node in cpu_left:
            cpu_left[a.node] -= pods[name].cpu_milli
            mem_left[a.node] -= pods[name].memory_mib
    movable = _movable(result, pods, gpus)
    if not movable:
        return result
    assignments = dict(result.assignments)
    evals = moved = 0
    w_t = settings.weight_gpu_touched
    for pod_name in movable:
        pod = pods[pod_name]
        ((resource, count),) = pod.requests.items()
        mib = (mps_gb_of(resource) or 0) * _GIB
        here = assignments[pod_name]
        srcs = [gpus[(here.node, k)] for k in here.gpus[resource]]
        allowed = _candidates(pod, here.node, mps_nodes, gpus, order, (limit - evals) // count)
        if not allowed:
            continue  # too few evaluations left for its slices; a smaller pod may still move
        evals += len(allowed) * count
        for src in srcs:
            _take_off(src, mib, policy)
        cpu_left[here.node] += pod.cpu_milli
        mem_left[here.node] += pod.memory_mib
        # churn: a source stops being touched if its slices were its only change; a GPU the
        # plan does not touch yet would start to be: the pod may touch as many such GPUs as
        # its sources stop being touched
        budget = w_t * sum(1 for g in {id(g): g for g in srcs}.values() if not g.touched)
        best: tuple[tuple[int, int, int], list[_Gpu]] | None = None
        for node in allowed:
            cpu = cpu_left[node.name]
            if cpu < pod.cpu_milli or mem_left[node.name] < pod.memory_mib:
                continue
            mine = [gpus[(node.name, x.index)] for x in node.gpus]
            scored = node_score(
                measures[mine[0].usable],
                cpu,
                [g.free for g in mine],
                pod.cpu_milli,
                mib,
                count,
                [0 if g.touched else w_t for g in mine],
                budget,
                [_open_slots(g, mib, policy) for g in mine],
            )
            if scored is None:
                continue
            score, ks = scored
            key = (score, -order[node.name], -mine[ks[0]].index)
            if best is None or key > best[0]:
                best = (key, [mine[k] for k in ks])
        dsts = best[1] if best is not None else srcs
        for dst in dsts:
            _put_on(dst, mib, policy)
        cpu_left[dsts[0].node] -= pod.cpu_milli
        mem_left[dsts[0].node] -= pod.memory_mib
        if sorted((g.node, g.index) for g in dsts) != sorted((g.node, g.index) for g in srcs):
            indices = tuple(g.index for g in dsts)
            assignments[pod_name] = Assignment(dsts[0].node, {resource: indices})
            moved += 1
    if not moved:
        return replace(result, stats={**result.stats, "polish_moved": 0.0})
    layouts = {k: v for k, v in result.layouts.items() if k not in gpus}
    for where, state in gpus.items():
        if state.touched:
            layouts[where] = PlannedGpu(
                node=state.node, index=state.index, mps=tuple(state.slices(policy))
            )
    stats = {**result.stats, "polish_moved": float(moved), "gpus_touched": float(len(layouts))}
    return replace(result, layouts=layouts, assignments=assignments, stats=stats)


def _candidates(
    pod: PendingPod,
    home: str,
    mps_nodes: Sequence[NodeState],
    gpus: Mapping[tuple[str, int], _Gpu],
    order: Mapping[str, int],
    budget: int,
) -> list[NodeState]:
    """The pod's candidate nodes (module docstring, "Cost"), in the snapshot's order: every
    MPS node it may use, or, when more than ``budget`` evaluations are left, its own node and
    the best-fit ones up to ``budget``; none when no evaluation is left."""
    if budget <= 0:
        return []
    usable = [n for n in mps_nodes if pod.eligible_nodes is None or n.name in pod.eligible_nodes]
    if len(usable) <= budget:
        return usable

    def spare(n: NodeState) -> float:
        states = [gpus[(n.name, g.index)] for g in n.gpus]
        return sum(max(0, g.free) / g.usable for g in states if g.usable > 0)

    chosen = {home}
    for n in sorted(usable, key=lambda n: (spare(n), order[n.name])):
        if len(chosen) >= budget:
            break
        chosen.add(n.name)
    return [n for n in usable if n.name in chosen]


def _movable(
    result: Plan, pods: Mapping[str, PendingPod], gpus: Mapping[tuple[str, int], _Gpu]
) -> list[str]:
    """Pods on new MPS slices of one size (module docstring), the most memory first, then
    the larger slice, then by name."""
    out: list[tuple[int, int, str]] = []
    for name, a in result.assignments.items():
        pod = pods.get(name)
        if pod is None or len(pod.requests) != 1:
            continue
        ((resource, n),) = pod.requests.items()
        gb = mps_gb_of(resource)
        if gb is None or n < 1 or resource not in a.gpus or len(a.gpus[resource]) != n:
            continue
        where = [gpus.get((a.node, k)) for k in a.gpus[resource]]
        if any(g is None for g in where):
            continue
        mib = gb * _GIB
        if any(not used and m == mib for g in where if g is not None for m, used, _ in g.current):
            continue  # it may hold a free slice that existed before: moving it adds churn
        out.append((-mib * n, -mib, name))
    return [name for *_, name in sorted(out)]


def _open_slots(g: _Gpu, mib: int, policy: ThreadPolicy) -> int:
    """New slices of ``mib`` MiB the MPS client limit and thread budget still let ``g`` take
    (:mod:`planner.mps`, "Client limit"); memory is ``node_score``'s to check."""
    have = (
        [x.memory_mib for x in g.planned] if g.planned is not None else [m for m, _, _ in g.current]
    )
    n = client_slots(len(have))
    left = thread_budget((thread_percentage(m, g.usable, policy) for m in have), policy)
    return n if left is None else min(n, left // thread_percentage(mib, g.usable, policy))


def _take_off(g: _Gpu, mib: int, policy: ThreadPolicy) -> None:
    planned = g.slices(policy)
    for k in range(len(planned) - 1, -1, -1):
        s = planned[k]
        if not s.used and s.memory_mib == mib:
            del planned[k]
            g.update()
            return
    raise AssertionError(f"polish: GPU {g.node}/{g.index} holds no free {mib} MiB slice")


def _put_on(g: _Gpu, mib: int, policy: ThreadPolicy) -> None:
    pct = thread_percentage(mib, g.usable, policy)
    g.slices(policy).append(PlannedSlice(mib, pct, False))
    g.update()
