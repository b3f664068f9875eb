"""``plan(snapshot, settings) -> Plan``: the planner's one public entry point.

Stages
------
1. Validate: node and pod names unique, every node's model in the catalog (and MIG-capable
   for ``mig``/``hybrid`` nodes), locked GPUs only on MIG nodes, every current MIG layout possible (each distinct layout is
   parsed once: :data:`planner.mig_cpsat.MigParseCache`).  Bad input raises
   :class:`~planner.demand.SnapshotError` naming the node/pod and the fix.
2. The greedy baseline (:func:`planner.greedy.plan_greedy`).  Policy ``greedy``: done (nos's
   name order).  Policy ``cpsat`` on a snapshot of more than ``settings.max_model_gpus`` GPUs:
   greedy visits nodes best fit first (least spare capacity), the warm start of the rounds.
3. Policy ``cpsat``: the snapshot's neighbourhoods (:func:`planner.neighbourhood.node_chunks`):
   one holding everything if the snapshot has at most ``settings.max_model_gpus`` GPUs (the
   exact model), else the packing neighbourhood (:func:`planner.neighbourhood.packing_chunk`:
   where the warm start placed pods and the tightest nodes with room) and then chunks of the
   other nodes by spare capacity.  Per round: the pods to re-plan
   there (:func:`planner.neighbourhood.restrict`), their eligibility on those nodes
   (:class:`planner.demand.EligibilityIndex`), the CP-SAT model
   (:func:`planner.mig_cpsat.solve_batch`, MIG and MPS nodes in one model) hinted with the
   current plan, and the merge into the current plan if it places at least as much.  A
   neighbourhood plan's ``capacity`` reasons are rewritten against every node of the cluster;
   its status is ``FEASIBLE`` (no whole-cluster optimality proof), and
   ``stats['placed_weight_bound']`` is the trivial bound (every pod that is eligible
   somewhere placed).
   Hybrid nodes (MPS slices inside MIG instances) are part of the same model
   (:mod:`planner.hybrid`).
4. If CP-SAT finds no solution in time (no round kept), or (only possible on a time-out) the
   plan places less priority-weighted pods than the greedy plan, or the plan fails the same
   validity check as the greedy one (:func:`_consistent`: a safety net; a free MPS host on a
   locked hybrid GPU is the one case known to reach it), the greedy plan is returned with
   status ``GREEDY_FALLBACK``.
5. Otherwise the CP-SAT plan's MPS placements of one slice size (one GPU or several) are
   polished with the node-level packing measure (:mod:`planner.mps_polish`; setting
   ``mps_polish``): the same pods placed, no more churn, each such pod where FGD-style
   descent on CPU-aware fragmentation plus expected waste puts it.  Its share of the time
   limit (an estimate, at most 10 %) is set aside before the rounds, like the other work
   outside the solver.

Time budget: ``settings.time_limit_s`` is wall time for the whole call.  The planner reads no
clock; the one clock it obeys is the solver's.  Two budgets are kept:

* **Deterministic shares** (reproducible): the work outside the solver is estimated linearly in
  the snapshot's GPUs and pods and in each round's GPUs (coefficients measured on one core of
  the development machine); the solver gets the rest of ``_PLANNED_FRACTION`` of the limit
  (:func:`solver_budget`, never less than ``_MIN_SOLVE_FRACTION`` of it).  A neighbourhood
  holds at most ``max_model_gpus`` GPUs, fewer when the budget is short (one GPU per
  ``_BUDGET_S_PER_GPU`` seconds of budget, :func:`neighbourhood_gpus`); the budget is split
  evenly over as many rounds as leave each at least ``_MIN_ROUND_S`` of solver time plus its
  build (:func:`round_limits`).  A round's share is its CP-SAT deterministic-time limit.
* **Wall time** (:class:`planner.mig_cpsat.WallBudget` of ``_PLANNED_FRACTION`` of the limit):
  charged the estimate of the work before the rounds and of each round's build (scaled by the
  slowdown the solves show, once one ran until its deterministic limit), and the solver's own
  wall time of every solve (``CpSolver.wall_time``: it counts whatever the machine, however
  loaded, took from the solve).  Each round's CP-SAT wall-clock limit is what is left of it; a
  round with less than ``MIN_SOLVE_WALL_S`` left is not run, nor any after it
  (``stats['rounds_skipped']``).  Once a round's model is built, its size is charged too
  (:data:`planner.mig_cpsat.S_PER_VARIABLE` per variable, beyond the per-GPU estimate): a
  model larger than estimated (MPS GPUs with many distinct slice sizes) solves for that much
  less, deterministic limit included, or not at all.

On a machine as fast as the development machine the deterministic limit ends every solve
first, so the plan is reproducible; on a slower or loaded one the wall-clock limits end the
solves and later rounds get only what earlier ones left, so the wall time stays near the
limit, and the plan depends on timing.  What no solver limit can cut is the work outside it
(validation, the greedy plan, model building): at 1000 nodes that is most of a second of a
1 s limit on a machine four times slower than the estimate assumes.  Several small
neighbourhoods solved to (near) optimality place more pods than one large one cut off early: on
the 1000-node benchmark (6 seeded instances), 3 rounds of 48 GPUs with ~0.12 s of solver each
placed 17 more pods in all than 2 rounds of 80 GPUs with ~0.17 s, and 4 rounds of 48 with
~0.08 s as many; at 100 nodes, rounds of 72-96 GPUs did as well as rounds of 48 or better.
Other caps: at most ``max_candidate_nodes`` nodes per pod group, ``_POD_CAP_PER_GPU`` waiting
pods per GPU of a round.

The result lists only GPUs whose layout changes, each with its full desired layout; an
assignment per placed pod; a reason per unplaced pod.  Pure: no clock, no I/O, no logging;
deterministic for a given input and seed when every CP-SAT solve ends at its optimum or at its
deterministic-time limit and no round is skipped for time (see :mod:`planner.mig_cpsat`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

from planner.catalog import Catalog, GpuModel, default_catalog
from planner.demand import (
    EligibilityIndex,
    SnapshotError,
    capacity_reason,
    node_model,
    pod_weights,
)
from planner.geometry import Placement, canonical, layout_errors
from planner.greedy import plan_greedy
from planner.hybrid import hybrid_plan_errors
from planner.mig_cpsat import (
    MIN_SOLVE_WALL_S,
    LayoutCache,
    MigParseCache,
    WallBudget,
    current_mig,
    solve_batch,
)
from planner.mps_polish import polish_budget, polish_mps
from planner.neighbourhood import (
    merge_plans,
    node_chunks,
    packing_chunk,
    restrict,
    spare_capacity,
)
from planner.settings import PlannerSettings, Policy
from planner.snapshot import Mode, NodeState, Plan, Snapshot, Unplaced

__all__ = [
    "neighbourhood_gpus",
    "plan",
    "round_limits",
    "solver_budget",
    "validate_snapshot",
]

_DEFAULT_SETTINGS = PlannerSettings()
_POD_CAP_PER_GPU = 2
"""Pods left unplaced by greedy that enter a neighbourhood model, per GPU of the model."""
_MIN_SOLVE_FRACTION = 0.2
_PLANNED_FRACTION = 0.85
"""Share of the time limit the estimates may fill (the rest absorbs estimation error)."""
_MIN_ROUND_S = 0.1
"""Least solver time worth a neighbourhood round."""
_ROOMS = (Unplaced.CAPACITY.value, Unplaced.NODE_RESOURCES.value)
# Seconds of work outside the solver (one core of the development machine, fitted on the
# benchmark at 100-1000 nodes with 30 % and 60 % pending pods, rounded up): per snapshot GPU
# and per pending pod (validation, greedy, reasons), and per GPU of a round's model (its
# build, candidate layouts, merge).
_S_PER_GPU = 15e-6
_S_PER_POD = 85e-6
_S_PER_MODEL_GPU = 1.2e-3
_HYBRID_BUILD_FACTOR = 3
"""A hybrid GPU costs this many GPUs' model build (layouts over every host profile, slice
patterns, the host decoding): about 0.35 s outside the solver for 96 hybrid A100s and 150
pods on the development machine, against 0.13 s estimated at one GPU each."""
_BUDGET_S_PER_GPU = 0.01
"""Seconds of solver budget per GPU of a neighbourhood: a budget funds several rounds."""


def validate_snapshot(
    snapshot: Snapshot, catalog: Catalog, cache: MigParseCache | None = None
) -> dict[str, GpuModel]:
    """Check ``snapshot`` (module docstring, stage 1); return node name -> catalog model."""
    for what, names in (
        ("node", [n.name for n in snapshot.nodes]),
        ("pending pod", [p.name for p in snapshot.pods]),
    ):
        dup = sorted(n for n, c in Counter(names).items() if c > 1)
        if dup:
            raise SnapshotError(
                f"snapshot lists {what}(s) {dup} more than once; names must be unique"
            )
    parsed: MigParseCache = cache if cache is not None else {}
    models: dict[str, GpuModel] = {}
    for node in snapshot.nodes:
        model = node_model(node, catalog)
        models[node.name] = model
        indices = [g.index for g in node.gpus]
        if len(set(indices)) != len(indices):
            raise SnapshotError(f"node {node.name}: GPU indices {indices} are not unique")
        if node.mode in (Mode.MIG, Mode.HYBRID):
            for gpu in node.gpus:
                current_mig(node, gpu, model, parsed)
        elif any(g.locked for g in node.gpus):
            raise SnapshotError(
                f"node {node.name}: GPUs {[g.index for g in node.gpus if g.locked]} are locked, "
                f"but only MIG GPUs can be (an MPS GPU's slices are all known)"
            )
    return models


def solver_budget(settings: PlannerSettings, gpus: int, pods: int) -> float:
    """Seconds of ``settings.time_limit_s`` left to CP-SAT rounds (module docstring)."""
    limit = settings.time_limit_s
    planned = _PLANNED_FRACTION * limit - _S_PER_GPU * gpus - _S_PER_POD * pods
    return max(_MIN_SOLVE_FRACTION * limit, planned)


def neighbourhood_gpus(settings: PlannerSettings, budget: float) -> int:
    """GPUs per neighbourhood: ``max_model_gpus``, fewer when the budget is short."""
    return max(1, min(settings.max_model_gpus, int(budget / _BUDGET_S_PER_GPU)))


def round_limits(budget: float, chunk_gpus: Sequence[int]) -> list[float]:
    """CP-SAT's wall-clock limit for each round to run, neighbourhoods in order (docstring)."""
    build = [_S_PER_MODEL_GPU * g for g in chunk_gpus]
    rounds = 1
    while rounds < len(build) and budget / (rounds + 1) >= _MIN_ROUND_S + max(build[: rounds + 1]):
        rounds += 1
    share = budget / rounds
    return [max(share / 2, share - cost) for cost in build[:rounds]]


def plan(
    snapshot: Snapshot,
    settings: PlannerSettings = _DEFAULT_SETTINGS,
    catalog: Catalog | None = None,
) -> Plan:
    """Decide per-GPU layouts and pod placements for ``snapshot`` (module docstring)."""
    cat = catalog if catalog is not None else default_catalog()
    parsed: MigParseCache = {}
    models = validate_snapshot(snapshot, cat, parsed)
    gpus = sum(len(n.gpus) for n in snapshot.nodes)
    large = settings.policy is Policy.CPSAT and gpus > max(1, settings.max_model_gpus)
    # a large snapshot's warm start visits nodes best fit first (planner.neighbourhood)
    spare = spare_capacity(snapshot, models, settings, parsed) if large else None
    greedy = plan_greedy(snapshot, settings, cat, node_rank=spare)
    if settings.policy is Policy.GREEDY:
        return greedy
    greedy_ok = _consistent(greedy, snapshot, models, parsed, settings)
    warm = greedy if greedy_ok else _nothing_placed(snapshot, greedy)
    # the MPS packing polish runs after the solve: its share of the limit is set aside first
    polish_n, polish_s = polish_budget(snapshot, settings)
    budget = max(
        _MIN_SOLVE_FRACTION * settings.time_limit_s,
        solver_budget(settings, gpus, len(snapshot.pods)) - polish_s,
    )
    if spare is None:  # the exact model: one neighbourhood holding everything
        cap = max(1, settings.max_model_gpus)
        chunks = [frozenset(n.name for n in snapshot.nodes)]
    else:
        cap = neighbourhood_gpus(settings, budget)
        chunks = node_chunks(snapshot, spare, cap, packing_chunk(snapshot, warm, spare, cap))
    by_name = {n.name: n for n in snapshot.nodes}
    chunk_gpus = [sum(_build_gpus(by_name[n]) for n in c) for c in chunks]
    limits = round_limits(budget, chunk_gpus)
    wall = WallBudget(
        _PLANNED_FRACTION * settings.time_limit_s,
        _S_PER_GPU * gpus + _S_PER_POD * len(snapshot.pods) + polish_s,
    )
    current, solved, skipped = warm, 0, 0
    layouts: LayoutCache = {}
    stats: dict[str, float] = {}
    for k, (names, round_limit) in enumerate(zip(chunks, limits, strict=False)):
        nb = restrict(snapshot, current, names, int(_POD_CAP_PER_GPU * cap))
        if not nb.snapshot.pods and not nb.whole:
            continue
        build = _S_PER_MODEL_GPU * chunk_gpus[k]
        wall.charge(build)
        if wall.left() < MIN_SOLVE_WALL_S:
            skipped = len(limits) - k
            break
        index = EligibilityIndex(nb.snapshot.nodes, models, settings)
        part = solve_batch(
            nb.snapshot,
            models,
            {p.name: index.of(p) for p in nb.snapshot.pods},
            settings,
            nb.warm_start,
            time_limit_s=wall.left(),
            deterministic_limit_s=round_limit,
            wall=wall,
            build_charged_s=build,
            parse_cache=parsed,
            layout_cache=layouts,
        )
        if part is None:
            continue
        if nb.whole:
            current, stats, solved = part, dict(part.stats), 1
            break
        if _weight(part, nb.snapshot, settings) < _weight(nb.warm_start, nb.snapshot, settings):
            continue  # a time-out before CP-SAT reached its hint: keep the round's start
        current = merge_plans(current, nb, part)
        solved += 1
        _add_round_stats(stats, part.stats)
    if solved == 0:
        fallback = {**greedy.stats, "rounds_skipped": float(skipped)}
        return replace(greedy, status="GREEDY_FALLBACK", stats=fallback)
    result = current
    if len(chunks) > 1:
        result = _cluster_reasons(result, snapshot, models, settings, greedy.unplaced)
        stats.update(_lns_stats(result, snapshot, len(chunks), solved, settings))
        stats["rounds_skipped"] = float(skipped)
        result = replace(result, policy=Policy.CPSAT.value, status="FEASIBLE", stats=stats)
    else:
        result = replace(result, stats={**result.stats, "rounds": 1.0, "rounds_skipped": 0.0})
    result_ok = _consistent(result, snapshot, models, parsed, settings)
    if result_ok and (
        not greedy_ok or _weight(result, snapshot, settings) >= _weight(greedy, snapshot, settings)
    ):
        if settings.mps_polish:
            return polish_mps(snapshot, result, models, settings, max_evals=polish_n)
        return result
    fallback = dict(greedy.stats)
    fallback["cpsat_placed"] = float(len(result.assignments))
    fallback["solve_s"] = result.stats.get("solve_s", 0.0)
    return replace(greedy, status="GREEDY_FALLBACK", stats=fallback)


def _build_gpus(node: NodeState) -> int:
    """GPUs of ``node`` as the model build's estimate counts them (hybrid ones weigh more)."""
    return len(node.gpus) * (_HYBRID_BUILD_FACTOR if node.mode is Mode.HYBRID else 1)


def _nothing_placed(snapshot: Snapshot, greedy: Plan) -> Plan:
    """The start when greedy's plan is unusable: nothing changed, every pod waiting."""
    waiting = f"{Unplaced.CAPACITY.value}: not planned yet"
    return Plan(
        layouts={},
        assignments={},
        unplaced={p.name: greedy.unplaced.get(p.name, waiting) for p in snapshot.pods},
    )


def _add_round_stats(total: dict[str, float], part: Mapping[str, float]) -> None:
    for key in ("solve_s", "variables", "layouts", "pod_groups", "gpu_classes"):
        total[key] = total.get(key, 0.0) + part.get(key, 0.0)
    total["rounds_optimal"] = total.get("rounds_optimal", 0.0) + float(part.get("gap", 1.0) == 0)


def _lns_stats(
    result: Plan, snapshot: Snapshot, chunks: int, solved: int, settings: PlannerSettings
) -> dict[str, float]:
    """Whole-plan figures for a neighbourhood (LNS) plan; the bound is the trivial one."""
    weights = pod_weights(snapshot.pods, settings.wait_tiers_s, settings.placement_weight)
    eligible_weight = sum(
        weights[p.name]
        for p in snapshot.pods
        if p.name in result.assignments or result.unplaced[p.name].startswith(_ROOMS)
    )
    return {
        "placed": float(len(result.assignments)),
        "unplaced": float(len(result.unplaced)),
        "placed_weight": float(_weight(result, snapshot, settings)),
        "placed_weight_bound": float(eligible_weight),
        "gpus_touched": float(len(result.layouts)),
        "neighbourhoods": float(chunks),
        "rounds": float(solved),
    }


def _cluster_reasons(
    result: Plan,
    snapshot: Snapshot,
    models: dict[str, GpuModel],
    settings: PlannerSettings,
    greedy_reasons: Mapping[str, str],
) -> Plan:
    """Rewrite room-related unplaced reasons against every node of the cluster.

    The greedy plan's ``capacity`` reason of a pod already is that text (the same
    :func:`planner.demand.capacity_reason` over the same eligible nodes), so it is reused.
    """
    todo = [p for p in snapshot.pods if result.unplaced.get(p.name, "").startswith(_ROOMS)]
    if not todo:
        return result
    index: EligibilityIndex | None = None
    unplaced = dict(result.unplaced)
    for pod in todo:
        known = greedy_reasons.get(pod.name, "")
        if known.startswith(Unplaced.CAPACITY.value):
            unplaced[pod.name] = known
            continue
        if index is None:
            index = EligibilityIndex(snapshot.nodes, models, settings)
        names = index.eligible_names(pod)
        unplaced[pod.name] = capacity_reason(pod, names) if names else str(index.of(pod).reason)
    return replace(result, unplaced=unplaced)


def _weight(p: Plan, snapshot: Snapshot, settings: PlannerSettings) -> int:
    weights = pod_weights(snapshot.pods, settings.wait_tiers_s, settings.placement_weight)
    return sum(weights[name] for name in p.assignments)


def _consistent(
    p: Plan,
    snapshot: Snapshot,
    models: dict[str, GpuModel],
    parsed: MigParseCache,
    settings: PlannerSettings = _DEFAULT_SETTINGS,
) -> bool:
    """Cheap check that another planner's plan is valid: layouts and used instances kept."""
    nodes = {n.name: n for n in snapshot.nodes}
    checked: dict[tuple[object, ...], bool] = {}
    for (name, index), planned in p.layouts.items():
        node = nodes.get(name)
        if node is None:
            return False
        gpu = next((g for g in node.gpus if g.index == index), None)
        if gpu is None:
            return False
        if node.mode is Mode.MPS:
            continue
        model = models[name]
        if node.mode is Mode.HYBRID and hybrid_plan_errors(node, model, planned, settings):
            return False
        key = (model.name, gpu.mig, gpu.locked, planned.mig)
        ok = checked.get(key)
        if ok is None:
            try:
                layout = canonical(Placement(start, model.profile(n)) for n, start in planned.mig)
            except ValueError:
                return False
            current = current_mig(node, gpu, model, parsed)
            ok = checked[key] = (
                not layout_errors(model, layout)
                and current.used <= set(layout)
                and (not current.locked or layout == current.layout)
            )
        if not ok:
            return False
    return True
