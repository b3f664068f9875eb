"""``plan(snapshot, settings) -> Plan``: the planner's one public entry point.

Stages
------
1. Validate: node and pod names unique, every node's model in the catalog (and MIG-capable
   for ``mig``/``hybrid`` nodes), every current MIG layout possible.  Bad input raises
   :class:`~planner.demand.SnapshotError` naming the node/pod and the fix.
2. Policy ``greedy``: the nos-like baseline (:func:`planner.greedy.plan_greedy`), done.
3. Policy ``cpsat``: resolve every pod's eligibility (:func:`planner.demand.eligibility`),
   run the greedy baseline as warm start, then the CP-SAT batch model
   (:func:`planner.mig_cpsat.solve_batch`, MIG and MPS nodes in one model, one time limit).
   If CP-SAT finds no solution in time, or (only possible on a time-out) its solution places
   less priority-weighted pods than the greedy plan, the greedy plan is returned with status
   ``GREEDY_FALLBACK`` (``stats['cpsat_placed']`` says what CP-SAT had, if anything).

The result lists only GPUs whose layout changes, each with its full desired layout; an
assignment per placed pod; a reason per unplaced pod.  Pure: no clock, no I/O, no logging;
deterministic for a given input and seed when CP-SAT ends before its time limit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from planner.catalog import Catalog, GpuModel, default_catalog
from planner.demand import SnapshotError, eligibility, node_model, priority_weights
from planner.geometry import Placement, canonical, layout_errors
from planner.greedy import plan_greedy
from planner.mig_cpsat import current_mig, solve_batch
from planner.settings import PlannerSettings, Policy
from planner.snapshot import Mode, Plan, Snapshot

__all__ = ["plan", "validate_snapshot"]

_DEFAULT_SETTINGS = PlannerSettings()


def validate_snapshot(snapshot: Snapshot, catalog: Catalog) -> dict[str, GpuModel]:
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
    models: dict[str, GpuModel] = {}
    for node in snapshot.nodes:
        model = node_model(node, catalog)
        models[node.name] = model
        indices = [g.index for g in node.gpus]
        if len(set(indices)) != len(indices):
            raise SnapshotError(f"node {node.name}: GPU indices {indices} are not unique")
        if node.mode in (Mode.MIG, Mode.HYBRID):
            for gpu in node.gpus:
                current_mig(node, gpu, model)
    return models


def plan(
    snapshot: Snapshot,
    settings: PlannerSettings = _DEFAULT_SETTINGS,
    catalog: Catalog | None = None,
) -> Plan:
    """Decide per-GPU layouts and pod placements for ``snapshot`` (module docstring)."""
    cat = catalog if catalog is not None else default_catalog()
    models = validate_snapshot(snapshot, cat)
    greedy = plan_greedy(snapshot, settings, cat)
    if settings.policy is Policy.GREEDY:
        return greedy
    nodes = sorted(snapshot.nodes, key=lambda n: n.name)
    eligibilities = {p.name: eligibility(p, nodes, models, settings) for p in snapshot.pods}
    greedy_ok = _consistent(greedy, snapshot, cat)
    result = solve_batch(snapshot, models, eligibilities, settings, greedy if greedy_ok else None)
    if result is not None and (
        not greedy_ok or _weight(result, snapshot) >= _weight(greedy, snapshot)
    ):
        return result
    stats = dict(greedy.stats)
    if result is not None:
        stats["cpsat_placed"] = float(len(result.assignments))
        stats["solve_s"] = result.stats.get("solve_s", 0.0)
    return replace(greedy, status="GREEDY_FALLBACK", stats=stats)


def _weight(p: Plan, snapshot: Snapshot) -> int:
    weights = priority_weights(snapshot.pods)
    prio = {pod.name: pod.priority for pod in snapshot.pods}
    return sum(weights[prio[name]] for name in p.assignments)


def _consistent(p: Plan, snapshot: Snapshot, catalog: Catalog) -> bool:
    """Cheap check that another planner's plan is valid: layouts and used instances kept."""
    nodes = {n.name: n for n in snapshot.nodes}
    for (name, index), planned in p.layouts.items():
        node = nodes.get(name)
        if node is None:
            return False
        gpu = next((g for g in node.gpus if g.index == index), None)
        if gpu is None:
            return False
        if node.mode is Mode.MPS:
            continue
        model = catalog.model(node.model)
        layout = canonical(Placement(start, model.profile(n)) for n, start in planned.mig)
        used = current_mig(node, gpu, model).used
        if layout_errors(model, layout) or not used <= set(layout):
            return False
    return True
