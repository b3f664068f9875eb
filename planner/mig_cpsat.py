"""The CP-SAT batch planner: per-GPU MIG layouts (and MPS slices) plus node-level pod placement.

Formulation
-----------
Sets

* ``N``: nodes that are a candidate of some pod group (others are left out and unchanged).
* ``G``: pod groups (:func:`planner.demand.group_pods`: same requests, priority and waiting
  tier); group ``g`` has ``n_g`` identical pods, weight ``w_g``
  (:func:`planner.demand.pod_weights`: priorities lexicographic, then pods (or compute)
  placed, then their waiting tiers), CPU ``c_g``, memory ``m_g``, and on each candidate node
  ``v`` in ``N_g`` needs ``u_{g,k}`` units of key ``k`` (a MIG profile name, or ``mps:<MiB>``
  for an MPS slice size).
* ``N_g``: the ``settings.max_candidate_nodes`` eligible nodes ranked best for ``g`` (most
  pods servable by free instances now, then most memory not in use, then name), plus every
  node the greedy warm start put a pod of ``g`` on.
* ``H_v``: the MIG GPUs of node ``v``, grouped into classes of identical current layout
  (same instances, same used flags); class ``h`` has ``|h|`` GPUs.
* ``L_h``: candidate layouts of class ``h``: only the current layout if the class is
  *locked* (``GpuState.locked``: instances that existed before gpuslice whose places or users
  are not known exactly); else every valid layout (:mod:`planner.geometry`)
  that keeps each USED instance exactly where it is, built from the profiles candidate pods
  of ``v`` need plus the profiles of the class's free instances, reduced to its Pareto front
  (below), always including the current layout and the greedy plan's layouts.

Per candidate layout ``l`` of class ``h``: ``f_{l,k}`` = free (unused) instances of key ``k``,
``churn_l = w_destroy |C \\ l| + w_create |l \\ C| + w_touched [l != C]`` (``C`` = current
layout; only free instances can be destroyed since used ones are pinned), and
``useful_l = 8 (w_free_gpu [l empty] + w_free_block * (largest memory-slice span of a profile
that could still be placed on the unallocated slots)) + value_l`` (the 8 is
:data:`planner.mps.USEFUL_RESOLUTION`: MPS GPUs score their free memory in eighths of a slot,
FGD's fragmentation measure, :mod:`planner.mps`), where ``value_l = round(8 w_free_block
sum_{i in l \\ used} slots_i t_{r(i)})`` values each instance of ``l`` that is not in use by
its request's share ``t_r`` of the target workload (:mod:`planner.mig_target`: given, or
learned from the instances in use and the pending pods' requests), so a free ``7g`` is kept
when ``7g`` pods are what comes next (MIG nodes only: on a hybrid node a free instance may
become a host for MPS slices, :mod:`planner.hybrid`).  Pareto reduction: ``l`` is dropped if
another candidate has ``f >= f_l`` on every needed key, ``churn <= churn_l`` and
``useful >= useful_l`` (ties keep the first); a dropped layout can be swapped for its
dominator in any solution without breaking a constraint or worsening the objective, so the
reduction is exact.

Variables

* ``y_{h,l}`` in ``[0, |h|]``: GPUs of class ``h`` that get layout ``l``.
* ``x_{g,v}`` in ``[0, ub]``: pods of group ``g`` placed on node ``v`` (``ub`` from ``n_g``,
  the node's CPU/memory and the most units of each key the node could offer).
* MPS GPUs: ``keep``/``new``/``touched``/``empty`` per GPU, see :mod:`planner.mps`.

Constraints

* ``sum_l y_{h,l} = |h|`` for every class ``h``;
* ``sum_v x_{g,v} <= n_g`` for every group ``g``;
* per node ``v`` and key ``k``: ``sum_g u_{g,k} x_{g,v} <= sum_{h,l} f_{l,k} y_{h,l}``
  (+ the MPS free-slice terms): every unit of every placed pod gets its own free instance on
  that node (all of a pod's units on one node; the kube-scheduler picks the devices);
* per node ``v``: ``sum_g c_g x_{g,v} <= cpu_free_v`` and ``sum_g m_g x_{g,v} <= mem_free_v``.

Objective (lexicographic, by big-M scaling)

``maximize  M1 * PLACED - M2 * CHURN + USEFUL`` with ``PLACED = sum w_g x_{g,v}``,
``CHURN = sum churn_l y_{h,l} + MPS churn`` and ``USEFUL = sum_v useful_v`` (below).  All
three are non-negative integers bounded by ``CHURN <= C*`` and ``USEFUL <= U*`` (sums of
per-class and per-node maxima), so ``M2 = U* + 1`` makes one unit of churn
outweigh any usefulness difference and ``M1 = M2 C* + U* + 1`` makes one unit of ``PLACED``
outweigh any churn/usefulness difference: the maximum is exactly the lexicographic optimum.
Usefulness is CPU-aware: free GPU capacity on a node no pod can get CPU or memory beside is
stranded, not useful.  With the target workload's per-pod needs ``(c*, m*)``
(:func:`free_capacity_needs`: ``settings.free_capacity_cpu_milli`` / ``_memory_mib``, by
default the lower quartile of the batch's pods), a node ``v`` with ``G_v`` GPUs in the
model, ``U_v = sum_{h in H_v, l} useful_l y_{h,l} + MPS usefulness of v`` (at most ``U*_v``,
at most ``u*_v`` per GPU), and ``useful_v`` in ``[0, U*_v]``:

* ``useful_v = 0`` if not one such pod fits the node now (``cpu_free_v < c*`` or
  ``mem_free_v < m*``): its free GPUs are stranded whatever the plan does;
* ``useful_v = U_v`` if ``G_v`` such pods fit whatever the plan places there
  (``cpu_free_v - sum_g c_g ub(x_{g,v}) >= G_v c*``, the same for memory);
* else an integer ``hosts_v`` in ``[0, min(G_v, cpu_free_v // c*, mem_free_v // m*)]`` with
  ``c* hosts_v + sum_g c_g x_{g,v} <= cpu_free_v`` (and memory), ``useful_v <= U_v`` and
  ``useful_v <= u*_v hosts_v``: free capacity counts for at most as many GPUs as pods of the
  target could still use.

So among plans placing as much with as little churn, the one that leaves free GPUs where pods
can still use them wins, FGD's idea on the planner's own terms (issue 13: the CPU-blind level
left 94 GPUs empty on CPU-exhausted nodes on the saturation protocol, greedy 55).
``U* = sum_v U*_v`` over the nodes not stranded before the plan.

The integers must stay below 2^53 (CP-SAT bounds objectives in doubles); when
``M1 * max PLACED`` would not, the usefulness level is dropped, then the churn level, and
``stats['objective_levels']`` says how many levels were optimised.  One solve keeps the time
limit a single budget (sequential solves would have to split it).

Search: one CP-SAT solve, ``num_workers``/``random_seed`` from the settings, a wall-clock
limit (``settings.time_limit_s``, or what the caller has left of it) and a deterministic-time
limit of ``DETERMINISTIC_PER_SECOND`` units per second of the caller's deterministic share,
hinted with the greedy plan; the best solution at the first limit reached is decoded, and the
solver's own wall time is charged to the caller's :class:`WallBudget`.  Probing presolve is off (``cp_model_probing_level=0``): on
the benchmark's models one probing pass took 0.1-0.25 s, a large share of a sub-second
budget, and without it the plans on 3 seeds at 100 and 1000 nodes placed as many pods or more.  With ``num_workers=1`` the result is deterministic
whenever the solve ends at the optimum or at the deterministic limit; only when the machine is
so slow or loaded that the wall-clock limit comes first does it depend on timing.

Hybrid nodes (MPS slices inside MIG instances) add host variables to this model; their
formulation is in :mod:`planner.hybrid`.  An instance holding a used slice counts as used here.

Scale: :mod:`planner.api` calls this model on the whole snapshot when it has at most
``settings.max_model_gpus`` GPUs, else on neighbourhoods of the greedy plan
(:mod:`planner.neighbourhood`); candidate layouts are memoised per (model, current layout
with used flags, needed profiles) across those calls (:data:`LayoutCache`), and current
layouts are parsed once per plan (:data:`MigParseCache`).

Decoding: class counts go to the class's GPUs in index order, options in candidate order;
each group's first pods (longest waiting, then name) go to its nodes in name order; on a node, pods in
(priority desc, name) order take free instances of their keys in GPU-index order.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from planner.catalog import CatalogError, GpuModel, MigProfile
from planner.demand import (
    Eligibility,
    NodeDemand,
    PodGroup,
    SnapshotError,
    capacity_reason,
    group_pods,
    mps_usable_mib,
    pod_weights,
)
from planner.geometry import Layout, Placement, canonical, enumerate_layouts, layout_errors
from planner.hybrid import (
    HybridNodeVars,
    add_hybrid_node,
    instance_usable_mib,
    needed_host_profiles,
)
from planner.mig_target import free_instance_value, mig_target
from planner.mps import (
    CLIENT_LIMIT_NOTE,
    USEFUL_RESOLUTION,
    MpsGpuVars,
    add_mps_gpu,
    client_limited,
    mps_key,
    mps_target,
    upper_bound,
)
from planner.settings import PlannerSettings, Policy
from planner.snapshot import (
    Assignment,
    GpuState,
    MigInstance,
    Mode,
    NodeState,
    PendingPod,
    Plan,
    PlannedGpu,
    Snapshot,
    Unplaced,
    mps_gb_of,
)

__all__ = [
    "MIN_SOLVE_WALL_S",
    "S_PER_VARIABLE",
    "CurrentMig",
    "LayoutCache",
    "LayoutOption",
    "MigParseCache",
    "WallBudget",
    "candidate_layouts",
    "current_mig",
    "free_capacity_needs",
    "largest_free_block",
    "layout_option",
    "solve_batch",
    "workload_needs",
]

_EXACT_INT = 1 << 53
_MAX_COEFFICIENT = 1 << 62
"""Below CP-SAT's int64 coefficients, with room for the objective's sums."""
_MAX_UNITS_PER_POD = 64
"""A bound on one pod's units in a weighted term (GPUs of a node, compute per GPU)."""
DETERMINISTIC_PER_SECOND = 0.5
"""CP-SAT deterministic-time units allowed per second of the solver's wall-clock limit."""


@dataclass(slots=True)
class WallBudget:
    """Wall-clock seconds a plan may still spend, as far as a planner without a clock knows.

    Two kinds of charges: ``estimated_s``, deterministic estimates of the caller's work outside
    the solver (seconds on one core of the development machine), and ``solver_s``, the solver's
    own wall time of every solve (``CpSolver.wall_time``: it counts every moment the machine,
    however loaded, took from the solve).  ``slowdown`` scales the estimates: a solve that ran
    until its deterministic-time limit ``d`` and took wall time ``w`` ran ``w * DPS / d`` times
    slower than the rate its limits assume (``DPS`` = ``DETERMINISTIC_PER_SECOND``); the largest
    such factor seen, clamped to ``[1, _MAX_SLOWDOWN]``, is taken to hold for the work outside
    the solver too.  On a machine at least as fast as assumed it stays 1, so nothing about the
    plan depends on timing there.  ``left()`` is what remains of ``limit_s``.
    """

    limit_s: float
    estimated_s: float = 0.0
    solver_s: float = 0.0
    slowdown: float = 1.0

    def left(self) -> float:
        return self.limit_s - self.estimated_s * self.slowdown - self.solver_s

    def charge(self, estimate_s: float) -> None:
        """Work outside the solver, estimated at the development machine's speed."""
        self.estimated_s += max(0.0, estimate_s)

    def charge_solve(self, wall_s: float, deterministic: float, deterministic_limit: float) -> None:
        """One solve: its wall time, and what it says about the machine's speed."""
        self.solver_s += max(0.0, wall_s)
        if deterministic_limit > 0 and deterministic >= _LIMIT_REACHED * deterministic_limit:
            rate = wall_s * DETERMINISTIC_PER_SECOND / deterministic
            self.slowdown = min(_MAX_SLOWDOWN, max(self.slowdown, rate))


S_PER_VARIABLE = 36e-6
"""Seconds a model's build takes per variable (one core of the development machine: 36 us on
96 MPS GPUs with 400 distinct pods, 20,256 variables; 50-60 us on MIG and hybrid models, whose
per-GPU estimate of the caller, :data:`planner.api._S_PER_MODEL_GPU`, covers them)."""
MIN_SOLVE_WALL_S = 0.02
"""Least wall time left worth starting a solve (below it, the solve would return its hint)."""
_LIMIT_REACHED = 0.99
"""A solve whose deterministic time reached this fraction of its limit ran until that limit."""
_MAX_SLOWDOWN = 8.0
"""Largest factor by which the estimates of work outside the solver are scaled."""


@dataclass(frozen=True, slots=True)
class CurrentMig:
    """A MIG GPU's layout now, which of its instances are in use, and whether it is locked."""

    layout: Layout
    used: frozenset[Placement]
    locked: bool = False
    """The layout must stay as it is (``GpuState.locked``); free instances may take pods."""

    def key(self) -> tuple[object, ...]:
        return (
            *((p.profile.name, p.start, p in self.used) for p in self.layout),
            ("locked",) if self.locked else (),
        )


MigParseCache = dict[tuple[str, tuple[MigInstance, ...], bool], CurrentMig]
"""Parsed layouts by (model name, instances): identical GPUs are parsed and checked once."""


def current_mig(
    node: NodeState, gpu: GpuState, model: GpuModel, cache: MigParseCache | None = None
) -> CurrentMig:
    """Parse a GPU's current instances; :class:`SnapshotError` naming it if impossible.

    ``cache`` (one dict per plan) memoises the parse per (model, instances) signature.
    """
    key = (model.name, gpu.mig, gpu.locked)
    if cache is not None:
        found = cache.get(key)
        if found is not None:
            return found
    parsed = _parse_mig(node, gpu, model)
    if cache is not None:
        cache[key] = parsed
    return parsed


def _parse_mig(node: NodeState, gpu: GpuState, model: GpuModel) -> CurrentMig:
    where = f"node {node.name} GPU {gpu.index}"
    try:
        placements = [(Placement(i.start, model.profile(i.profile)), i.pinned) for i in gpu.mig]
    except CatalogError as e:
        raise SnapshotError(f"{where}: {e}") from e
    layout = canonical(p for p, _ in placements)
    errors = layout_errors(model, layout)
    if errors:
        raise SnapshotError(
            f"{where}: current MIG layout is impossible ({'; '.join(errors)}); fix the "
            f"snapshot (the node agent reports what the GPU holds)"
        )
    return CurrentMig(layout, frozenset(p for p, used in placements if used), gpu.locked)


@dataclass(frozen=True, slots=True)
class LayoutOption:
    """A candidate layout of a GPU with what it offers and costs (module docstring)."""

    layout: Layout
    free: Mapping[str, int]
    """Needed profile name -> free (unused) instances of it in the layout."""
    destroyed: int
    created: int
    churn: int
    useful: int

    @property
    def changed(self) -> bool:
        return bool(self.destroyed or self.created)


def largest_free_block(
    model: GpuModel, layout: Sequence[Placement], memo: dict[int, int] | None = None
) -> int:
    """Memory slices of the largest profile that could still be placed on unallocated slots.

    ``memo`` (per model) caches the answer per set of allocated slots.
    """
    mask = 0
    for p in layout:
        mask |= ((1 << p.profile.memory_slices) - 1) << p.start
    if memo is not None and mask in memo:
        return memo[mask]
    best = 0
    for prof in model.profiles:
        width = (1 << prof.memory_slices) - 1
        if prof.memory_slices > best and any(not (width << s) & mask for s in prof.starts):
            best = prof.memory_slices
    if memo is not None:
        memo[mask] = best
    return best


def layout_option(
    model: GpuModel,
    current: CurrentMig,
    layout: Layout,
    needed: frozenset[str],
    settings: PlannerSettings,
    memo: dict[int, int] | None = None,
    target: Mapping[str, float] | None = None,
) -> LayoutOption:
    """Score ``layout`` as a replacement of ``current`` (free units, churn, usefulness);
    ``target`` is the MIG target workload (:func:`planner.mig_target.mig_target`; ``None``:
    free instances count nothing)."""
    now = set(layout)
    kept = sum(1 for p in current.layout if p in now)  # placements are unique in a layout
    destroyed, created = len(current.layout) - kept, len(layout) - kept
    free: dict[str, int] = {}
    for p in layout:
        name = p.profile.name
        if name in needed and p not in current.used:
            free[name] = free.get(name, 0) + 1
    churn = (
        settings.weight_destroy * destroyed
        + settings.weight_create * created
        + settings.weight_gpu_touched * (destroyed + created > 0)
    )
    useful = USEFUL_RESOLUTION * (
        settings.weight_free_gpu * (not layout)
        + settings.weight_free_block * largest_free_block(model, layout, memo)
    )
    if target:
        useful += free_instance_value(
            (p for p in layout if p not in current.used), target, settings
        )
    return LayoutOption(layout, free, destroyed, created, churn, useful)


_FIELD = 5
"""Bits per free-instance count in a packed vector: 4 for the count (<= 15), 1 guard bit."""


def _pack(vector: Sequence[int]) -> int:
    packed = 0
    for k, v in enumerate(vector):
        packed |= v << (_FIELD * k)
    return packed


def candidate_layouts(
    model: GpuModel,
    current: CurrentMig,
    needed: frozenset[MigProfile],
    settings: PlannerSettings,
    target: Mapping[str, float] | None = None,
) -> list[LayoutOption]:
    """The Pareto front of layouts for one GPU; the current layout first (module docstring).

    Candidates are visited by (churn, -usefulness, free vector descending); a candidate is
    dropped if one kept before it has at least its usefulness and free units (its churn is
    no larger by the visiting order).  Free vectors are compared all keys at once on packed
    integers: with a guard bit above each count, ``(a | guards) - b`` keeps every guard bit
    iff ``a >= b`` on every key.
    """
    names = frozenset(p.name for p in needed)
    addable = set(needed) | {p.profile for p in current.layout if p not in current.used}
    pinned = sorted(current.used)
    memo: dict[int, int] = {}
    first = layout_option(model, current, current.layout, names, settings, memo, target)
    options = [first]
    if current.locked:
        return options
    for layout in enumerate_layouts(model, pinned, addable):
        if layout != current.layout:
            options.append(layout_option(model, current, layout, names, settings, memo, target))
    keys = sorted(names)
    vectors = [tuple(o.free.get(k, 0) for k in keys) for o in options]
    if any(v >= 1 << (_FIELD - 1) for vec in vectors for v in vec):
        raise ValueError(f"{model.name}: more than 15 instances of one profile on a GPU")
    guards = _pack([1 << (_FIELD - 1)] * len(keys))
    order = sorted(
        range(len(options)),
        key=lambda i: (options[i].churn, -options[i].useful, [-f for f in vectors[i]], i),
    )
    front: list[tuple[int, int]] = []  # (usefulness, packed free vector) of kept options
    seen: set[tuple[int, int, int]] = set()
    kept: set[int] = set()
    for i in order:
        o = options[i]
        packed = _pack(vectors[i])
        sig = (o.churn, o.useful, packed)
        if i != 0 and sig in seen:
            continue  # the same as a candidate visited before: dominated by it or its dominator
        seen.add(sig)
        own = packed
        useful = o.useful
        dominated = False
        for f_useful, f_packed in front:
            if f_useful >= useful and ((f_packed | guards) - own) & guards == guards:
                dominated = True
                break
        if not dominated or i == 0:
            front.append((useful, packed))
            kept.add(i)
    return [o for i, o in enumerate(options) if i in kept]


LayoutCache = dict[tuple[object, ...], list[LayoutOption]]
"""Candidate layouts by (model, current layout with used flags, needed profiles, MIG target)."""

# --------------------------------------------------------------------------- the batch model


@dataclass(slots=True)
class _MigClass:
    node: str
    indices: tuple[int, ...]
    current: CurrentMig
    options: list[LayoutOption]
    counts: list[cp_model.IntVar] = field(default_factory=list)


@dataclass(slots=True)
class _NodeInfo:
    state: NodeState
    model: GpuModel
    is_mig: bool
    free_now: Counter[str]
    """Key -> free instances/slices the node has now."""
    potential: int
    """Memory slots (MIG) or MiB (MPS) not held by anything in use."""
    mig: dict[int, CurrentMig] = field(default_factory=dict)


def _node_info(
    node: NodeState, model: GpuModel, settings: PlannerSettings, cache: MigParseCache
) -> _NodeInfo:
    free_now: Counter[str] = Counter()
    if node.mode in (Mode.MIG, Mode.HYBRID):
        info = _NodeInfo(node, model, True, free_now, 0)
        for gpu in node.gpus:
            cur = current_mig(node, gpu, model, cache)
            info.mig[gpu.index] = cur
            free_now.update(p.profile.name for p in cur.layout if p not in cur.used)
            free_now.update(  # a sealed host (used itself) offers none of its slices
                mps_key(s.memory_mib) for i in gpu.mig if not i.used for s in i.mps if not s.used
            )
            if cur.locked:  # only its free instances can ever be offered
                info.potential += sum(
                    p.profile.memory_slices for p in cur.layout if p not in cur.used
                )
            else:
                info.potential += model.memory_slots - sum(
                    p.profile.memory_slices for p in cur.used
                )
        return info
    usable = mps_usable_mib(node, model, settings)
    potential = 0
    for gpu in node.gpus:
        free_now.update(mps_key(s.memory_mib) for s in gpu.mps if not s.used)
        potential += max(0, usable - sum(s.memory_mib for s in gpu.mps if s.used))
    return _NodeInfo(node, model, False, free_now, potential)


def _candidates(
    group: PodGroup,
    infos: Mapping[str, _NodeInfo],
    limit: int,
    warm_nodes: Sequence[str],
) -> list[str]:
    units = next(iter(group.demands.values())).units()

    def rank(name: str) -> tuple[int, int, str]:
        info = infos[name]
        now = min(info.free_now[k] // u for k, u in units.items())
        return (-min(now, group.size), -info.potential, name)

    ranked = sorted(group.demands, key=rank)[: max(0, limit)]
    extra = [n for n in warm_nodes if n in group.demands and n not in ranked]
    return sorted({*ranked, *extra})


@dataclass(slots=True)
class _Model:
    """The CP-SAT model under construction and its variable maps."""

    cp: cp_model.CpModel = field(default_factory=cp_model.CpModel)
    mig: list[_MigClass] = field(default_factory=list)
    mps: list[MpsGpuVars] = field(default_factory=list)
    hybrid: list[HybridNodeVars] = field(default_factory=list)
    x: dict[tuple[int, str], cp_model.IntVar] = field(default_factory=dict)
    supply: dict[str, dict[str, list[tuple[int, cp_model.IntVar]]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    supply_max: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    churn_terms: list[tuple[int, cp_model.IntVar]] = field(default_factory=list)
    churn_exprs: list[cp_model.LinearExpr] = field(default_factory=list)
    useful_terms: dict[str, list[tuple[int, cp_model.IntVar]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    """Node -> (usefulness, layout count variable) of its MIG classes' options."""
    useful_exprs: dict[str, list[cp_model.LinearExpr]] = field(
        default_factory=lambda: defaultdict(list)
    )
    """Node -> usefulness expressions of its MPS GPUs."""
    useful_node_max: Counter[str] = field(default_factory=Counter)
    """Node -> the most usefulness its GPUs can have."""
    useful_gpu_max: Counter[str] = field(default_factory=Counter)
    """Node -> the most usefulness one of its GPUs can have."""
    churn_max: int = 0
    n_layouts: int = 0


def _add_mig_node(
    m: _Model,
    info: _NodeInfo,
    needed: frozenset[MigProfile],
    warm: Mapping[tuple[str, int], PlannedGpu],
    settings: PlannerSettings,
    cache: LayoutCache,
    target: Mapping[str, float],
) -> None:
    node = info.state.name
    target_key = tuple(sorted(target.items()))
    classes: dict[tuple[object, ...], list[int]] = defaultdict(list)
    for index, cur in sorted(info.mig.items()):
        classes[cur.key()].append(index)
    needed_key = tuple(sorted(p.name for p in needed))
    for key, indices in classes.items():
        current = info.mig[indices[0]]
        ckey = (info.model.name, key, needed_key, target_key)
        if ckey not in cache:
            cache[ckey] = candidate_layouts(info.model, current, needed, settings, target)
        options = list(cache[ckey])
        names = frozenset(p.name for p in needed)
        for index in indices:
            planned = warm.get((node, index))
            if planned is None or not planned.mig:
                continue
            layout = _warm_layout(info.model, current, planned)
            if layout is not None and all(o.layout != layout for o in options):
                options.append(
                    layout_option(info.model, current, layout, names, settings, target=target)
                )
        cls = _MigClass(node, tuple(indices), current, options)
        size = len(indices)
        for j, opt in enumerate(options):
            var = m.cp.new_int_var(0, size, f"y[{node},{indices[0]},{j}]")
            cls.counts.append(var)
            for k, f in opt.free.items():
                if f:
                    m.supply[node][k].append((f, var))
            if opt.churn:
                m.churn_terms.append((opt.churn, var))
            if opt.useful:
                m.useful_terms[node].append((opt.useful, var))
        m.cp.add(sum(cls.counts) == size)
        for k in names:
            m.supply_max[node][k] += size * max(o.free.get(k, 0) for o in options)
        m.churn_max += size * max(o.churn for o in options)
        best = max(o.useful for o in options)
        m.useful_node_max[node] += size * best
        m.useful_gpu_max[node] = max(m.useful_gpu_max[node], best)
        m.n_layouts += len(options)
        m.mig.append(cls)


def _warm_layout(model: GpuModel, current: CurrentMig, planned: PlannedGpu) -> Layout | None:
    """The warm-start layout of a GPU if it is valid and keeps every used instance."""
    try:
        layout = canonical(Placement(start, model.profile(name)) for name, start in planned.mig)
    except CatalogError:
        return None
    if layout_errors(model, layout) or not current.used <= set(layout):
        return None
    return layout


def _add_mps_node(
    m: _Model,
    info: _NodeInfo,
    need: Mapping[str, int],
    settings: PlannerSettings,
    target: Mapping[int, float],
) -> None:
    node = info.state.name
    usable = mps_usable_mib(info.state, info.model, settings)
    max_new = {int(k.split(":")[1]): units for k, units in need.items()}
    for gpu in sorted(info.state.gpus, key=lambda g: g.index):
        g = add_mps_gpu(m.cp, node, gpu, usable, max_new, settings, target)
        m.mps.append(g)
        for mib in max_new:
            m.supply[node][mps_key(mib)].extend(g.free_units(mib))
            m.supply_max[node][mps_key(mib)] += g.free_units_max(mib)
        m.churn_exprs.append(g.churn)
        m.useful_exprs[node].append(g.useful)
        m.churn_max += g.churn_max
        m.useful_node_max[node] += g.useful_max
        m.useful_gpu_max[node] = max(m.useful_gpu_max[node], g.useful_max)


def _pod_upper_bound(
    group: PodGroup, demand: NodeDemand, info: _NodeInfo, supply_max: Mapping[str, int]
) -> int:
    pod = group.first
    ub = group.size
    if pod.cpu_milli > 0:
        ub = min(ub, info.state.cpu_milli_free // pod.cpu_milli)
    if pod.memory_mib > 0:
        ub = min(ub, info.state.memory_mib_free // pod.memory_mib)
    for k, u in demand.units().items():
        ub = min(ub, supply_max.get(k, 0) // u)
    return max(0, ub)


@dataclass(frozen=True, slots=True)
class _Scaling:
    m1: int
    m2: int
    levels: int


def _scaling(placed_max: int, churn_max: int, useful_max: int) -> _Scaling:
    m2 = useful_max + 1
    m1 = churn_max * m2 + useful_max + 1
    if placed_max * m1 < _EXACT_INT:
        return _Scaling(m1, m2, 3)
    if placed_max * (churn_max + 1) < _EXACT_INT:
        return _Scaling(churn_max + 1, 1, 2)
    return _Scaling(1, 0, 1)


def _note_client_limit(
    snapshot: Snapshot,
    models: Mapping[str, GpuModel],
    layouts: Mapping[tuple[str, int], PlannedGpu],
    eligibilities: Mapping[str, Eligibility],
    unplaced: dict[str, str],
    settings: PlannerSettings,
) -> None:
    """Append :data:`planner.mps.CLIENT_LIMIT_NOTE` to the ``capacity`` reason of an unplaced
    MPS pod when an eligible node ends the plan with memory for one of its slices only on GPUs
    (hosts) at the client limit or thread budget (:func:`planner.mps.client_limited`)."""
    todo: list[tuple[PendingPod, set[int]]] = []
    for pod in snapshot.pods:
        if unplaced.get(pod.name, "").startswith(Unplaced.CAPACITY.value):
            sizes = {gb * 1024 for r in pod.requests if (gb := mps_gb_of(r))}
            if sizes:
                todo.append((pod, sizes))
    if not todo:
        return
    policy = settings.mps_thread_policy
    wanted = set().union(*(sizes for _, sizes in todo))
    limited: dict[int, set[str]] = {mib: set() for mib in wanted}
    for node in snapshot.nodes:
        model = models.get(node.name)
        if model is None or node.mode is Mode.MIG:
            continue
        for usable, slices in _slice_sets(node, model, layouts, settings):
            for mib in wanted:
                if client_limited(slices, usable, mib, policy):
                    limited[mib].add(node.name)
    if not any(limited.values()):
        return
    for pod, sizes in todo:
        eligible = eligibilities[pod.name].demands
        if any(name in eligible for mib in sizes for name in limited[mib]):
            unplaced[pod.name] += CLIENT_LIMIT_NOTE


def _slice_sets(
    node: NodeState,
    model: GpuModel,
    layouts: Mapping[tuple[str, int], PlannedGpu],
    settings: PlannerSettings,
) -> Iterator[tuple[int, list[int]]]:
    """(usable MiB, [slice MiB]) of every MPS GPU, or every host instance that may take
    new slices (not sealed, not on a locked GPU), of ``node`` as the plan leaves it."""
    if node.mode is Mode.MPS:
        usable = mps_usable_mib(node, model, settings)
        for gpu in node.gpus:
            planned = layouts.get((node.name, gpu.index))
            yield usable, [s.memory_mib for s in (planned.mps if planned else gpu.mps)]
        return
    for gpu in node.gpus:
        if gpu.locked:
            continue
        planned = layouts.get((node.name, gpu.index))
        if planned is not None:
            names = {start: name for name, start in planned.mig}
            for start, sl in planned.mig_mps:
                usable = instance_usable_mib(model.profile(names[start]), settings)
                yield usable, [s.memory_mib for s in sl]
            continue
        for inst in gpu.mig:
            if inst.mps and not inst.used:
                usable = instance_usable_mib(model.profile(inst.profile), settings)
                yield usable, [s.memory_mib for s in inst.mps]


def solve_batch(
    snapshot: Snapshot,
    models: Mapping[str, GpuModel],
    eligibilities: Mapping[str, Eligibility],
    settings: PlannerSettings,
    warm_start: Plan | None = None,
    *,
    time_limit_s: float | None = None,
    deterministic_limit_s: float | None = None,
    wall: WallBudget | None = None,
    build_charged_s: float = 0.0,
    parse_cache: MigParseCache | None = None,
    layout_cache: LayoutCache | None = None,
) -> Plan | None:
    """Plan ``snapshot`` with CP-SAT (module docstring); ``None`` if no solution was found.

    ``models`` maps node name -> catalog model and ``eligibilities`` pod name -> its
    :func:`planner.demand.eligibility`.  ``warm_start`` (the greedy plan) seeds the search.
    ``time_limit_s`` overrides ``settings.time_limit_s`` as the solver's wall-clock limit (the
    caller's share of the budget); the deterministic-time limit is ``DETERMINISTIC_PER_SECOND``
    units per second of ``deterministic_limit_s`` (default: of the wall-clock limit).  ``wall``,
    if given, is charged the solve (also when it finds no solution): :meth:`WallBudget.charge_solve`,
    and, once the model is built, what its size says the build cost beyond ``build_charged_s``
    (the caller's estimate, already charged): ``S_PER_VARIABLE`` per variable.  That excess
    comes off both of the solve's limits; with less than ``MIN_SOLVE_WALL_S`` left the model is
    not solved (``None``).
    ``parse_cache`` and ``layout_cache`` reuse the caller's parsed layouts and candidate layouts
    (one dict each per plan, shared by its neighbourhood rounds).
    """
    cache: MigParseCache = parse_cache if parse_cache is not None else {}
    groups = group_pods(snapshot.pods, eligibilities, settings.wait_tiers_s)
    weights = pod_weights(
        (p for g in groups for p in g.pods), settings.wait_tiers_s, settings.placement_weight
    )
    if sum(weights.values()) * _MAX_UNITS_PER_POD >= _MAX_COEFFICIENT:
        # Each priority outweighs every pod below it, so a deep queue over many priorities
        # (6 PriorityClasses x 1000 pods that waited past the last tier) needs coefficients
        # beyond CP-SAT's int64: building the objective raised, and the batch failed every
        # step.  None: the caller keeps the greedy plan, which orders by priority the same.
        return None
    nodes = {n.name: n for n in snapshot.nodes}
    warm_layouts = dict(warm_start.layouts) if warm_start is not None else {}
    warm_node = {pod: a.node for pod, a in (warm_start.assignments.items() if warm_start else ())}

    infos: dict[str, _NodeInfo] = {}
    for g in groups:
        for name in g.demands:
            if name not in infos:
                infos[name] = _node_info(nodes[name], models[name], settings, cache)
    cands: list[list[str]] = []
    need: dict[str, Counter[str]] = defaultdict(Counter)
    for g in groups:
        warm_nodes = sorted({warm_node[p.name] for p in g.pods if p.name in warm_node})
        cs = _candidates(g, infos, settings.max_candidate_nodes, warm_nodes)
        cands.append(cs)
        for name in cs:
            for k, u in g.demands[name].units().items():
                need[name][k] += u * g.size

    # Candidate layouts are built per model from every profile any node of that model needs,
    # so GPU classes with the same current layout share one enumeration across nodes.
    model_keys: dict[str, set[str]] = defaultdict(set)
    for name, keys in need.items():
        info = infos[name]
        if info.state.mode is Mode.HYBRID:
            model_keys[info.model.name].update(
                needed_host_profiles(info.state, info.model, keys, settings)
            )
        elif info.is_mig:
            model_keys[info.model.name].update(keys)
    m = _Model()
    options_cache: LayoutCache = layout_cache if layout_cache is not None else {}
    target = mps_target(snapshot, settings)
    instances_target = mig_target(snapshot, settings)
    for name in sorted(need):
        info = infos[name]
        if info.is_mig:
            needed = frozenset(info.model.profile(k) for k in model_keys[info.model.name])
            # on a hybrid node a free instance may become a host for MPS slices, whose worth is
            # the hybrid model's (planner.hybrid); only MIG nodes value free instances by requests
            mig_only = instances_target if info.state.mode is Mode.MIG else {}
            _add_mig_node(m, info, needed, warm_layouts, settings, options_cache, mig_only)
            if info.state.mode is Mode.HYBRID:
                h = add_hybrid_node(
                    m.cp,
                    info.state,
                    info.model,
                    need[name],
                    m.supply[name],
                    m.supply_max[name],
                    settings,
                )
                m.hybrid.append(h)
                m.churn_exprs.append(h.churn)
                m.churn_max += h.churn_max
        else:
            _add_mps_node(m, info, need[name], settings, target)

    placed_terms: list[tuple[int, cp_model.IntVar]] = []
    per_node: dict[str, list[tuple[int, cp_model.IntVar]]] = defaultdict(list)
    for gi, (g, cs) in enumerate(zip(groups, cands, strict=True)):
        xs: list[cp_model.IntVar] = []
        for name in cs:
            ub = _pod_upper_bound(g, g.demands[name], infos[name], m.supply_max[name])
            if ub == 0:
                continue
            x = m.cp.new_int_var(0, ub, f"x[{gi},{name}]")
            m.x[(gi, name)] = x
            xs.append(x)
            per_node[name].append((gi, x))
            placed_terms.append((weights[g.first.name], x))
        if len(xs) > 1:
            m.cp.add(sum(xs) <= g.size)

    loads: dict[str, _NodeLoad] = {}
    for name, entries in per_node.items():
        state = nodes[name]
        demand_terms: dict[str, list[tuple[int, cp_model.IntVar]]] = defaultdict(list)
        cpu: list[tuple[int, cp_model.IntVar]] = []
        mem: list[tuple[int, cp_model.IntVar]] = []
        for gi, x in entries:
            g = groups[gi]
            for k, u in g.demands[name].units().items():
                demand_terms[k].append((u, x))
            cpu.append((g.first.cpu_milli, x))
            mem.append((g.first.memory_mib, x))
        for k, terms in demand_terms.items():
            m.cp.add(_wsum(terms) <= _wsum(m.supply[name][k]))
        load = loads[name] = _NodeLoad(
            cpu,
            mem,
            sum(c * upper_bound(x) for c, x in cpu),
            sum(c * upper_bound(x) for c, x in mem),
        )
        if load.cpu_most > state.cpu_milli_free:
            m.cp.add(_wsum(cpu) <= state.cpu_milli_free)
        if load.mem_most > state.memory_mib_free:
            m.cp.add(_wsum(mem) <= state.memory_mib_free)

    needs = free_capacity_needs(snapshot, settings)
    useful, useful_max = _usefulness(m, nodes, loads, needs)
    placed_max = sum(c * upper_bound(x) for c, x in placed_terms)
    scale = _scaling(placed_max, m.churn_max, useful_max)
    placed = _wsum(placed_terms)
    churn = _wsum(m.churn_terms) + sum(m.churn_exprs)
    objective = scale.m1 * placed
    if scale.levels >= 2:
        objective -= scale.m2 * churn
    if scale.levels >= 3:
        objective += useful
    m.cp.maximize(objective)
    _hint(m, groups, warm_layouts, warm_node)

    limit = max(0.01, settings.time_limit_s if time_limit_s is None else time_limit_s)
    work = limit if deterministic_limit_s is None else max(0.01, deterministic_limit_s)
    if wall is not None:
        excess = S_PER_VARIABLE * len(m.cp.proto.variables) - max(0.0, build_charged_s)
        if excess > 0:
            # a model larger than the caller's estimate (MPS GPUs with a hundred distinct slice
            # sizes: 211 variables a GPU, 0.7 s to build 96 GPUs against 0.12 s estimated)
            wall.charge(excess)
            limit = min(limit, wall.left())
            work = min(work - excess, limit)
            if limit < MIN_SOLVE_WALL_S or work < MIN_SOLVE_WALL_S:
                return None  # a negative deterministic limit was MODEL_INVALID
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = limit
    solver.parameters.max_deterministic_time = work * DETERMINISTIC_PER_SECOND
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.num_workers = max(1, settings.num_workers)
    solver.parameters.random_seed = settings.seed
    status = solver.solve(m.cp)
    if wall is not None:
        reached = solver.response_proto.deterministic_time
        wall.charge_solve(solver.wall_time, reached, solver.parameters.max_deterministic_time)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None

    layouts, free, hosted = _decode_gpus(m, solver, settings)
    assignments = _decode_pods(m, solver, groups, cands, free, hosted)
    unplaced: dict[str, str] = {}
    for pod in snapshot.pods:
        if pod.name in assignments:
            continue
        el = eligibilities[pod.name]
        unplaced[pod.name] = capacity_reason(pod, el.demands) if el.demands else str(el.reason)
    _note_client_limit(snapshot, models, layouts, eligibilities, unplaced, settings)
    obj, bound = solver.objective_value, solver.best_objective_bound
    stats: dict[str, float] = {
        "solve_s": solver.wall_time,
        "objective": obj,
        "bound": bound,
        "gap": (bound - obj) / max(1.0, abs(obj)),
        "placed": float(len(assignments)),
        "unplaced": float(len(unplaced)),
        "placed_weight": float(solver.value(placed)),
        "placed_weight_bound": float((int(bound) + scale.m2 * m.churn_max) // scale.m1),
        "churn": float(solver.value(churn)),
        "objective_levels": float(scale.levels),
        "pod_groups": float(len(groups)),
        "nodes_in_model": float(len(need)),
        "gpu_classes": float(len(m.mig)),
        "layouts": float(m.n_layouts),
        "variables": float(len(m.cp.proto.variables)),
        "gpus_touched": float(len(layouts)),
    }
    return Plan(
        layouts=layouts,
        assignments=assignments,
        unplaced=unplaced,
        policy=Policy.CPSAT.value,
        status=solver.status_name(status),
        stats=stats,
    )


def free_capacity_needs(snapshot: Snapshot, settings: PlannerSettings) -> tuple[int, int]:
    """CPU (milli) and memory (MiB) a pod of the target workload needs beside its GPU slice
    (module docstring, "Usefulness"): ``settings.free_capacity_cpu_milli`` /
    ``free_capacity_memory_mib`` when given, else the lower quartile of the batch's pods
    (:func:`workload_needs`)."""
    cpu, mem = settings.free_capacity_cpu_milli, settings.free_capacity_memory_mib
    if cpu is None or mem is None:
        learned = workload_needs((p.cpu_milli, p.memory_mib) for p in snapshot.pods)
        cpu = learned[0] if cpu is None else cpu
        mem = learned[1] if mem is None else mem
    return max(0, cpu), max(0, mem)


def workload_needs(pods: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """The target workload's per-pod (CPU milli, memory MiB) from its pods' requests: the lower
    quartile of each (a node that can still host a quarter of the pods counts as useful;
    the median was worse on the openb saturation runs, README design notes); (0, 0) for
    none."""
    cpus, mems = [], []
    for cpu, mem in pods:
        cpus.append(cpu)
        mems.append(mem)
    if not cpus:
        return (0, 0)
    cpus.sort()
    mems.sort()
    quarter = (len(cpus) - 1) // 4
    return (cpus[quarter], mems[quarter])


@dataclass(frozen=True, slots=True)
class _NodeLoad:
    """The CPU and memory the plan's placements take on a node: (request, count variable)
    terms and their largest possible sums."""

    cpu: list[tuple[int, cp_model.IntVar]]
    mem: list[tuple[int, cp_model.IntVar]]
    cpu_most: int
    mem_most: int


_NO_LOAD = _NodeLoad([], [], 0, 0)


def _usefulness(
    m: _Model,
    nodes: Mapping[str, NodeState],
    loads: Mapping[str, _NodeLoad],
    needs: tuple[int, int],
) -> tuple[cp_model.LinearExpr, int]:
    """The objective's usefulness level and its maximum, node by node (module docstring): a
    node's free GPU capacity counts for at most as many GPUs as pods of the target workload
    (``needs``: CPU, memory) could still get CPU and memory there after the plan."""
    need_cpu, need_mem = needs
    parts: list[cp_model.LinearExpr] = []
    total_max = 0
    for name in sorted(m.useful_node_max):
        most = m.useful_node_max[name]
        if most <= 0:
            continue
        state = nodes[name]
        room = gpus = len(state.gpus)  # every GPU of a node in the model is in it
        if need_cpu > 0:
            room = min(room, state.cpu_milli_free // need_cpu)
        if need_mem > 0:
            room = min(room, state.memory_mib_free // need_mem)
        if room <= 0:
            continue  # no pod like the target's fits the node: its free GPUs are stranded
        raw = _wsum(m.useful_terms.get(name, ())) + sum(m.useful_exprs.get(name, ()))
        total_max += most
        load = loads.get(name, _NO_LOAD)
        cpu_low = state.cpu_milli_free - load.cpu_most
        mem_low = state.memory_mib_free - load.mem_most
        if (need_cpu <= 0 or cpu_low >= gpus * need_cpu) and (
            need_mem <= 0 or mem_low >= gpus * need_mem
        ):
            parts.append(raw)  # whatever the plan places there, every GPU keeps room
            continue
        hosts = m.cp.new_int_var(0, room, f"hosts[{name}]")
        if need_cpu > 0:
            m.cp.add(need_cpu * hosts + _wsum(load.cpu) <= state.cpu_milli_free)
        if need_mem > 0:
            m.cp.add(need_mem * hosts + _wsum(load.mem) <= state.memory_mib_free)
        value = m.cp.new_int_var(0, most, f"useful[{name}]")
        m.cp.add(value <= raw)
        m.cp.add(value <= m.useful_gpu_max[name] * hosts)
        parts.append(value)
    return cp_model.LinearExpr.sum(parts), total_max


def _wsum(terms: Sequence[tuple[int, cp_model.IntVar]]) -> cp_model.LinearExpr:
    return cp_model.LinearExpr.weighted_sum([v for _, v in terms], [c for c, _ in terms])


def _hint(
    m: _Model,
    groups: Sequence[PodGroup],
    warm_layouts: Mapping[tuple[str, int], PlannedGpu],
    warm_node: Mapping[str, str],
) -> None:
    if not warm_node and not warm_layouts:
        return
    for cls in m.mig:
        counts = [0] * len(cls.options)
        for index in cls.indices:
            planned = warm_layouts.get((cls.node, index))
            j = 0
            if planned is not None:
                want = sorted(planned.mig)
                j = next(
                    (
                        i
                        for i, o in enumerate(cls.options)
                        if sorted((p.profile.name, p.start) for p in o.layout) == want
                    ),
                    0,
                )
            counts[j] += 1
        for var, c in zip(cls.counts, counts, strict=True):
            m.cp.add_hint(var, c)
    for g in m.mps:
        g.hint(m.cp, warm_layouts.get((g.node, g.gpu.index)))
    for h in m.hybrid:
        h.hint(m.cp, warm_layouts)
    for (gi, name), x in m.x.items():
        n = sum(1 for p in groups[gi].pods if warm_node.get(p.name) == name)
        m.cp.add_hint(x, min(n, upper_bound(x)))


def _decode_gpus(
    m: _Model,
    solver: cp_model.CpSolver,
    settings: PlannerSettings,
) -> tuple[
    dict[tuple[str, int], PlannedGpu],
    dict[str, dict[str, list[int]]],
    dict[str, dict[str, list[tuple[int, int]]]],
]:
    """Changed GPUs' full layouts, per node and key the GPU index of each free unit, and per
    hybrid node and MPS key the (GPU index, host start) of each free slice."""
    layouts: dict[tuple[str, int], PlannedGpu] = {}
    free: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    final: dict[str, dict[int, Layout]] = defaultdict(dict)
    for cls in m.mig:
        indices = iter(cls.indices)
        for opt, var in zip(cls.options, cls.counts, strict=True):
            for _ in range(solver.value(var)):
                index = next(indices)
                final[cls.node][index] = opt.layout
                for p in opt.layout:
                    if p not in cls.current.used:
                        free[cls.node][p.profile.name].append(index)
                if opt.changed:
                    layouts[(cls.node, index)] = PlannedGpu(
                        cls.node, index, mig=tuple((p.profile.name, p.start) for p in opt.layout)
                    )
    for g in m.mps:
        slices, changed, sizes = g.decode(solver, settings.mps_thread_policy)
        for mib in sizes:
            free[g.node][mps_key(mib)].append(g.gpu.index)
        if changed:
            layouts[(g.node, g.gpu.index)] = PlannedGpu(g.node, g.gpu.index, mps=slices)
    for per_key in free.values():
        for lst in per_key.values():
            lst.sort()
    hosted: dict[str, dict[str, list[tuple[int, int]]]] = {}
    for h in m.hybrid:
        name = h.node.name
        for index in final[name]:
            layouts.pop((name, index), None)  # the hybrid decode lists what changed
        changed_gpus, hosted[name] = h.decode(solver, final[name], free[name], settings)
        for index, planned in changed_gpus.items():
            layouts[(name, index)] = planned
    return layouts, free, hosted


def _decode_pods(
    m: _Model,
    solver: cp_model.CpSolver,
    groups: Sequence[PodGroup],
    cands: Sequence[Sequence[str]],
    free: Mapping[str, Mapping[str, list[int]]],
    hosted: Mapping[str, Mapping[str, list[tuple[int, int]]]],
) -> dict[str, Assignment]:
    on_node: dict[str, list[tuple[PendingPod, NodeDemand]]] = defaultdict(list)
    for gi, (g, cs) in enumerate(zip(groups, cands, strict=True)):
        pods = iter(g.pods)
        for name in cs:
            x = m.x.get((gi, name))
            for _ in range(solver.value(x) if x is not None else 0):
                on_node[name].append((next(pods), g.demands[name]))
    assignments: dict[str, Assignment] = {}
    for name, entries in sorted(on_node.items()):
        pool = {k: list(v) for k, v in free.get(name, {}).items()}
        in_hosts = {k: list(v) for k, v in hosted.get(name, {}).items()}
        for pod, demand in sorted(entries, key=lambda e: (-e[0].priority, e[0].name)):
            gpus: dict[str, tuple[int, ...]] = {}
            hosts: dict[str, tuple[int, ...]] = {}
            for r in demand.requests:
                if r.profile is None and name in hosted:  # an MPS slice inside an instance
                    got = in_hosts.get(r.key, [])[: r.count]
                    del in_hosts.setdefault(r.key, [])[: r.count]
                    if len(got) < r.count:  # the model guarantees this never happens
                        raise AssertionError(f"plan decoding: {pod.name} lacks {r.key} on {name}")
                    gpus[r.resource] = tuple(g for g, _ in got)
                    hosts[r.resource] = tuple(st for _, st in got)
                    continue
                take = pool[r.key][: r.count]
                del pool[r.key][: r.count]
                if len(take) < r.count:  # the model guarantees this never happens
                    raise AssertionError(f"plan decoding: {pod.name} lacks {r.key} on {name}")
                gpus[r.resource] = tuple(take)
            assignments[pod.name] = (
                Assignment(name, gpus, hosts) if hosts else Assignment(name, gpus)
            )
    return assignments
