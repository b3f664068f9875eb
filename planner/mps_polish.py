"""Packing polish of MPS placements: FGD-style descent on an exact node-level measure.

Why
---
The CP-SAT model values an MPS GPU's free memory per GPU (:mod:`planner.mps`: ``f P(f)``,
FGD's fragmentation of one GPU), which the model can sum linearly.  What packs a cluster is a
*node*-level measure: a GPU's free memory is of use only to pods the node's free CPU can still
host, and only as many of them as that CPU admits; and a free share that fits the next pod may
still leave a hole no later pod fits.  Neither is linear in the model's variables.  So after
the solve the placements of single-slice MPS pods are polished with that measure, keeping
every higher level of the objective: the same pods placed, no more churn.

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
Movable: every pod of the plan whose request is one MPS slice on an MPS node, on a GPU that had
no free slice of that size before (so its slice is new).  In order of slice size (largest
first), then name, each movable pod is taken off its GPU and put back where its *score*
``-floor((G_after - G_before) / 20 milli)`` is highest among the GPUs of the snapshot's MPS
nodes it may use (eligible node, the node's CPU and memory left by the plan, free memory for
the slice), moving it only where churn does not grow (``w_touched`` for a GPU the plan now
touches, none back for one it no longer does); ties go to the earlier node in the snapshot's
order, then to the lower GPU index; within a node the GPU with the smallest raw ``G_after``
counts.  The quantisation is FGD's (fgd.md §7): changes within one step tie and go to a fixed
node order, which packs nodes one after another (measured: without it the same measure loses
0.4 points on the openb saturation protocol).

Cost.  A pod's candidates are its own node and, best fit first (least free memory share, then
the snapshot's order), the MPS nodes it may use, up to ``settings.max_model_gpus`` GPUs (the
planner's neighbourhood size).  One plan evaluates at most ``max_evals`` nodes (its caller's
share of the time limit, :func:`polish_evals`; pods beyond are left where the solve put them),
about a millisecond each on the development machine (:data:`S_PER_EVAL`).

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
from planner.mps import thread_percentage
from planner.settings import PlannerSettings
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
    "TIME_SHARE",
    "WASTE_WEIGHT",
    "NodeMeasure",
    "Shape",
    "polish_evals",
    "polish_mps",
    "polish_target",
]

SCORE_STEP_MILLI = 20.0
"""Width of one score step of the measure's change, milli-GPU (module docstring)."""
WASTE_WEIGHT = 0.5
"""Weight of the expected waste beside the CPU-aware fragmentation."""
S_PER_EVAL = 1e-3
"""Seconds one node evaluation takes (one core of the development machine, rounded up)."""
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


@lru_cache(maxsize=8)
def _measure(shapes: tuple[Shape, ...], usable_mib: int) -> NodeMeasure:
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
    planned: list[PlannedSlice]

    @property
    def free(self) -> int:
        return self.usable - sum(s.memory_mib for s in self.planned)


def polish_evals(snapshot: Snapshot, settings: PlannerSettings) -> int:
    """Node evaluations the polish of a plan of ``snapshot`` may make: one neighbourhood per
    pod asking for one MPS slice, within :data:`TIME_SHARE` of the time limit; 0 without
    MPS nodes or with the polish off.  Deterministic, so the caller can set the time aside."""
    if not settings.mps_polish:
        return 0
    mps_gpus = [len(n.gpus) for n in snapshot.nodes if n.mode is Mode.MPS and n.gpus]
    if not mps_gpus:
        return 0
    per_pod = 0
    total = 0
    for k in sorted(mps_gpus):  # the most nodes one neighbourhood of max_model_gpus can hold
        if total + k > max(1, settings.max_model_gpus):
            break
        total += k
        per_pod += 1
    pods = sum(
        1 for p in snapshot.pods if _pod_shape(p) is not None and sum(p.requests.values()) == 1
    )
    cap = int(TIME_SHARE * settings.time_limit_s / S_PER_EVAL)
    return min(cap, pods * max(1, per_pod))


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
    shapes = polish_target(snapshot, settings)
    if not shapes:
        return result
    mps_nodes = [n for n in snapshot.nodes if n.mode is Mode.MPS and n.gpus]
    if not mps_nodes:
        return result
    order = {n.name: i for i, n in enumerate(mps_nodes)}
    gpus: dict[tuple[str, int], _Gpu] = {}
    measures: dict[int, NodeMeasure] = {}
    for n in mps_nodes:
        usable = mps_usable_mib(n, models[n.name], settings)
        if usable not in measures:
            measures[usable] = _measure(shapes, usable)
        policy = settings.mps_thread_policy
        for g in n.gpus:
            planned = result.layouts.get((n.name, g.index))
            cur = tuple((s.memory_mib, s.used, s.thread_percentage) for s in g.mps)
            slices = (
                list(planned.mps)
                if planned is not None
                else [
                    PlannedSlice(m, t if t is not None else thread_percentage(m, usable, policy), u)
                    for m, u, t in cur
                ]
            )
            gpus[(n.name, g.index)] = _Gpu(n.name, g.index, usable, cur, slices)
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
        ((resource, _n),) = pod.requests.items()
        mib = (mps_gb_of(resource) or 0) * _GIB
        here = assignments[pod_name]
        src = gpus[(here.node, here.gpus[resource][0])]
        allowed = _neighbourhood(pod, src.node, mps_nodes, gpus, order, settings.max_model_gpus)
        evals += len(allowed)
        if evals > limit:
            break
        _take_off(src, mib)
        cpu_left[src.node] += pod.cpu_milli
        mem_left[src.node] += pod.memory_mib
        # churn: the source stops being touched if the slice was its only change; a GPU the
        # plan does not touch yet would start to be
        src_gain = 0 if _differs(src) else w_t
        best: tuple[tuple[int, int, int], _Gpu] | None = None
        for node in allowed:
            cpu = cpu_left[node.name]
            if cpu < pod.cpu_milli or mem_left[node.name] < pod.memory_mib:
                continue
            mine = [gpus[(node.name, x.index)] for x in node.gpus]
            frees = [g.free for g in mine]
            options = [
                k
                for k, g in enumerate(mine)
                if g.free >= mib and (0 if _differs(g) else w_t) - src_gain <= 0
            ]
            if not options:
                continue
            measure = measures[mine[0].usable]
            before = measure.value(cpu, frees)
            pick: tuple[float, int, int] | None = None
            for k in options:
                after = list(frees)
                after[k] -= mib
                v = measure.value(cpu - pod.cpu_milli, after)
                # equal values: the fullest GPU (an empty one stays empty), then the lowest index
                if pick is None or (v, frees[k]) < (pick[0], pick[2]):
                    pick = (v, k, frees[k])
            assert pick is not None
            score = -math.floor((pick[0] - before) / SCORE_STEP_MILLI)
            key = (score, -order[node.name], -mine[pick[1]].index)
            if best is None or key > best[0]:
                best = (key, mine[pick[1]])
        dst = best[1] if best is not None else src
        _put_on(dst, mib, settings)
        cpu_left[dst.node] -= pod.cpu_milli
        mem_left[dst.node] -= pod.memory_mib
        if dst is not src:
            assignments[pod_name] = Assignment(dst.node, {resource: (dst.index,)})
            moved += 1
    if not moved:
        return replace(result, stats={**result.stats, "polish_moved": 0.0})
    layouts = {k: v for k, v in result.layouts.items() if k not in gpus}
    for where, state in gpus.items():
        if _differs(state):
            layouts[where] = PlannedGpu(
                node=state.node, index=state.index, mps=tuple(state.planned)
            )
    stats = {**result.stats, "polish_moved": float(moved), "gpus_touched": float(len(layouts))}
    return replace(result, layouts=layouts, assignments=assignments, stats=stats)


def _neighbourhood(
    pod: PendingPod,
    home: str,
    mps_nodes: Sequence[NodeState],
    gpus: Mapping[tuple[str, int], _Gpu],
    order: Mapping[str, int],
    cap_gpus: int,
) -> list[NodeState]:
    """The pod's candidate nodes (module docstring, "Cost"), in the snapshot's order."""
    usable = [n for n in mps_nodes if pod.eligible_nodes is None or n.name in pod.eligible_nodes]

    def spare(n: NodeState) -> float:
        states = [gpus[(n.name, g.index)] for g in n.gpus]
        return sum(max(0, g.free) / g.usable for g in states if g.usable > 0)

    chosen = {home}
    total = sum(len(n.gpus) for n in usable if n.name == home)
    for n in sorted(usable, key=lambda n: (spare(n), order[n.name])):
        if n.name in chosen:
            continue
        if total + len(n.gpus) > max(1, cap_gpus):
            continue
        chosen.add(n.name)
        total += len(n.gpus)
    return [n for n in usable if n.name in chosen]


def _movable(
    result: Plan, pods: Mapping[str, PendingPod], gpus: Mapping[tuple[str, int], _Gpu]
) -> list[str]:
    """Pods on one new MPS slice (module docstring), largest slice first, then by name."""
    out: list[tuple[int, str]] = []
    for name, a in result.assignments.items():
        pod = pods.get(name)
        if pod is None or len(pod.requests) != 1:
            continue
        ((resource, n),) = pod.requests.items()
        gb = mps_gb_of(resource)
        if gb is None or n != 1 or resource not in a.gpus or len(a.gpus[resource]) != 1:
            continue
        g = gpus.get((a.node, a.gpus[resource][0]))
        if g is None:
            continue
        mib = gb * _GIB
        if any(not used and m == mib for m, used, _ in g.current):
            continue  # it may hold a free slice that existed before: moving it adds churn
        out.append((-mib, name))
    return [name for _, name in sorted(out)]


def _take_off(g: _Gpu, mib: int) -> None:
    for k in range(len(g.planned) - 1, -1, -1):
        s = g.planned[k]
        if not s.used and s.memory_mib == mib:
            del g.planned[k]
            return
    raise AssertionError(f"polish: GPU {g.node}/{g.index} holds no free {mib} MiB slice")


def _put_on(g: _Gpu, mib: int, settings: PlannerSettings) -> None:
    pct = thread_percentage(mib, g.usable, settings.mps_thread_policy)
    g.planned.append(PlannedSlice(mib, pct, False))


def _differs(g: _Gpu) -> bool:
    """Whether the GPU's planned slices differ from its current ones (the plan touches it)."""
    now = Counter((m, u) for m, u, _ in g.current)
    planned = Counter((s.memory_mib, s.used) for s in g.planned)
    return now != planned
