"""Which nodes and pods the CP-SAT model re-plans on a large cluster (LNS rounds).

Model
-----
One CP-SAT model over every node of a large cluster neither builds nor solves within the
time limit (it grows with GPUs x candidate layouts and pod groups x nodes).  When the
snapshot has more than ``gpu_cap`` GPUs, the planner instead runs rounds of
large-neighbourhood search (LNS) starting from a warm-start plan ``W_0`` (the greedy plan):

* **Spare capacity** of a node: per MIG GPU, the memory slices of the largest profile that
  fits beside the instances IN USE in the snapshot (:func:`planner.mig_cpsat.largest_free_block`
  of the used instances), as a fraction of the GPU's slots; per MPS GPU, the fraction of its
  usable memory not held by slices in use; summed over the node's GPUs.  What the current
  plan claimed counts as spare: the model may move those pods, and the pods greedy cannot
  place are mostly large ones that need the big free blocks greedy spent on small pods (in
  a few benchmark runs at 100-1000 nodes this ranking did at least as well as ranking by
  total unused memory; those runs are timing-dependent, so the evidence is weak).
* **Warm start** ``W_0``: the greedy plan with nodes visited by spare capacity ascending
  (best fit first; :func:`planner.greedy.plan_greedy`'s ``node_rank``), not nos's name order:
  a pod lands on the tightest node that can take it, as FGD-like packing wants, not on the
  first empty node by name.
* **Packing neighbourhood** ``N_1`` (:func:`packing_chunk`): the nodes ``W_0`` placed pods on,
  tightest first, then the other nodes with some spare capacity that a pending pod may use,
  least spare first, while the total stays within ``gpu_cap`` GPUs.  Round 1 re-plans where
  the batch packs tightest, with the model's free-capacity level choosing among the nodes a
  best-fit scheduler would consider.  Measured on the FGD saturation protocol (openb
  default, one arrival per plan, the planner given the best-fit hosts of 1536 GPUs, seed 42):
  with name-order greedy and the most spare nodes first, 82.85 % GPU-milli allocated on MIG
  nodes and 93.16 % on MPS nodes; with this warm start and ``N_1``, 90.03 % and 94.98 % (the
  protocol's own 96-GPU best-fit neighbourhood, one exact model: 89.59 % and 94.90 %).
* **Neighbourhoods** ``N_2, N_3, ...``: the other nodes in order of spare capacity (most
  first, then fewer GPUs, then name), cut into consecutive chunks of at most ``gpu_cap`` GPUs
  (:func:`node_chunks`).  Round ``k`` re-plans ``N_k`` around the plan ``W_{k-1}``.
* **Re-planned pods** ``P_k``: every pod ``W_{k-1}`` placed on a node of ``N_k``, plus the pods
  it leaves unplaced for lack of room (reason ``capacity`` or ``node cpu/memory``; other
  reasons mean no node can take the pod at all) that may use a node of ``N_k``, at most
  ``pod_cap`` of those in (priority desc, longest waiting, name) order (:func:`restrict`).
* **Fixed part**: every node outside ``N_k`` keeps ``W_{k-1}``'s decisions: its GPU layouts
  and the pods placed on it.  A node's GPUs, CPU and memory are never shared across the cut,
  so the fixed part and any plan of ``(N_k, P_k)`` merge into a valid plan ``W_k``
  (:func:`merge_plans`).

``W_{k-1}`` restricted to ``(N_k, P_k)`` is a feasible solution of round ``k``'s model and is
its hint; :mod:`planner.api` keeps a round's plan only if it places at least the hint's
priority-weighted pods, so every ``W_k`` places at least what ``W_0`` placed (on a large
snapshot the best-fit greedy plan; against nos's name-order plan, the ``greedy`` policy, the
floor is not built in).  How many rounds
run is set by the time budget (:func:`planner.api.round_limits`).  When the whole snapshot fits
``gpu_cap``, there is one neighbourhood holding every node and every pod: the model is the
exact one of :mod:`planner.mig_cpsat` (the brute-force oracle tests run there).

Pure functions of their arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from planner.catalog import GpuModel
from planner.demand import mps_usable_mib
from planner.mig_cpsat import MigParseCache, current_mig, largest_free_block
from planner.settings import PlannerSettings
from planner.snapshot import (
    MigInstance,
    Mode,
    Plan,
    Snapshot,
    Unplaced,
)

__all__ = [
    "Neighbourhood",
    "merge_plans",
    "node_chunks",
    "packing_chunk",
    "restrict",
    "spare_capacity",
]

_ROOM_REASONS = (Unplaced.CAPACITY.value, Unplaced.NODE_RESOURCES.value)


@dataclass(frozen=True, slots=True)
class Neighbourhood:
    """The part of a snapshot the CP-SAT model plans, and the warm start restricted to it."""

    snapshot: Snapshot
    """Nodes of ``N`` (as in the full snapshot) and the re-planned pods ``P``."""
    warm_start: Plan
    """The warm-start plan's layouts on ``N`` and its assignments of pods in ``P``."""
    whole: bool
    """``N`` is every node and ``P`` every pod: nothing is fixed."""


def spare_capacity(
    snapshot: Snapshot,
    models: Mapping[str, GpuModel],
    settings: PlannerSettings,
    parsed: MigParseCache | None = None,
) -> dict[str, float]:
    """Node -> its GPUs' room for new instances/slices beside those in use (docstring)."""
    cache: MigParseCache = parsed if parsed is not None else {}
    spare: dict[str, float] = {}
    seen: dict[tuple[str, tuple[MigInstance, ...], bool], float] = {}
    for node in snapshot.nodes:
        model = models[node.name]
        free = 0.0
        if node.mode is Mode.MPS:
            usable = mps_usable_mib(node, model, settings)
            for gpu in node.gpus:
                used = sum(s.memory_mib for s in gpu.mps if s.used)
                free += max(0.0, 1.0 - used / usable) if usable > 0 else 0.0
        else:
            for gpu in node.gpus:
                key = (model.name, gpu.mig, gpu.locked)
                share = seen.get(key)
                if share is None:
                    cur = current_mig(node, gpu, model, cache)
                    # a locked GPU gets no new instance: no room beside its layout
                    held = cur.layout if cur.locked else sorted(cur.used)
                    share = largest_free_block(model, held) / (model.memory_slots or 1)
                    seen[key] = share
                free += share
        spare[node.name] = free
    return spare


def packing_chunk(
    snapshot: Snapshot, warm: Plan, spare: Mapping[str, float], gpu_cap: int
) -> frozenset[str]:
    """The packing neighbourhood ``N_1`` (module docstring): nodes ``warm`` placed pods on,
    then nodes with spare capacity a pending pod may use, tightest first, within ``gpu_cap``
    GPUs (the first node always enters)."""
    gpus = {n.name: len(n.gpus) for n in snapshot.nodes}
    placed = {a.node for a in warm.assignments.values()}
    # pods share eligible-set objects (the partitioner's index): union each distinct one once
    sets = {id(p.eligible_nodes): p.eligible_nodes for p in snapshot.pods}
    allowed: frozenset[str] | None = None
    if all(e is not None for e in sets.values()):
        allowed = frozenset().union(*(e for e in sets.values() if e is not None))
    others = [
        n for n in gpus if n not in placed and spare[n] > 0 and (allowed is None or n in allowed)
    ]

    def tightest(n: str) -> tuple[float, int, str]:
        return (spare[n], gpus[n], n)

    chunk: list[str] = []
    total = 0
    for name in [*sorted(placed, key=tightest), *sorted(others, key=tightest)]:
        if chunk and total + gpus[name] > gpu_cap:
            break
        chunk.append(name)
        total += gpus[name]
    return frozenset(chunk)


def node_chunks(
    snapshot: Snapshot,
    spare: Mapping[str, float],
    gpu_cap: int,
    first: frozenset[str] = frozenset(),
) -> list[frozenset[str]]:
    """The neighbourhoods (module docstring): ``first`` (the packing neighbourhood, when
    given), then the other nodes by ``spare`` capacity (:func:`spare_capacity`), most first,
    in chunks of at most ``gpu_cap`` GPUs; one holding every node if the snapshot has at most
    ``gpu_cap`` GPUs."""
    if sum(len(n.gpus) for n in snapshot.nodes) <= gpu_cap:
        return [frozenset(n.name for n in snapshot.nodes)]
    ranked = sorted(
        (n for n in snapshot.nodes if n.name not in first),
        key=lambda n: (-spare[n.name], len(n.gpus), n.name),
    )
    chunks: list[frozenset[str]] = [first] if first else []
    chunk: list[str] = []
    gpus = 0
    for node in ranked:
        if chunk and gpus + len(node.gpus) > gpu_cap:
            chunks.append(frozenset(chunk))
            chunk, gpus = [], 0
        chunk.append(node.name)
        gpus += len(node.gpus)
    if chunk:
        chunks.append(frozenset(chunk))
    return chunks


def restrict(
    snapshot: Snapshot, current: Plan, names: frozenset[str], pod_cap: int
) -> Neighbourhood:
    """The neighbourhood on nodes ``names`` around the plan ``current`` (module docstring)."""
    if len(names) == len(snapshot.nodes):
        return Neighbourhood(snapshot, current, whole=True)
    on_n = [p for p in snapshot.pods if (a := current.assignments.get(p.name)) and a.node in names]
    waiting = [
        p
        for p in snapshot.pods
        if p.name not in current.assignments
        and current.unplaced.get(p.name, Unplaced.CAPACITY.value).startswith(_ROOM_REASONS)
        and (p.eligible_nodes is None or not names.isdisjoint(p.eligible_nodes))
    ]
    waiting.sort(key=lambda p: (-p.priority, -p.waited_s, p.name))
    pods = tuple(sorted([*on_n, *waiting[: max(0, pod_cap)]], key=lambda p: p.name))
    pod_names = {p.name for p in pods}
    restricted = Plan(
        layouts={k: v for k, v in current.layouts.items() if k[0] in names},
        assignments={k: v for k, v in current.assignments.items() if k in pod_names},
        unplaced={k: v for k, v in current.unplaced.items() if k in pod_names},
        policy=current.policy,
        status=current.status,
    )
    nodes = tuple(n for n in snapshot.nodes if n.name in names)
    return Neighbourhood(Snapshot(nodes, pods), restricted, whole=False)


def merge_plans(warm: Plan, nb: Neighbourhood, part: Plan) -> Plan:
    """``warm``'s fixed part (outside ``nb``) plus ``part``, the plan of ``nb.snapshot``.

    Unplaced reasons are ``part``'s for re-planned pods and ``warm``'s for the others; the
    caller rewrites them against the whole cluster where needed.
    """
    if nb.whole:
        return part
    names = {n.name for n in nb.snapshot.nodes}
    pods = {p.name for p in nb.snapshot.pods}
    layouts = {k: v for k, v in warm.layouts.items() if k[0] not in names}
    layouts.update(part.layouts)
    assignments = {k: v for k, v in warm.assignments.items() if k not in pods}
    assignments.update(part.assignments)
    unplaced = {k: v for k, v in warm.unplaced.items() if k not in pods}
    unplaced.update(part.unplaced)
    return Plan(
        layouts=dict(sorted(layouts.items())),
        assignments=dict(sorted(assignments.items())),
        unplaced=dict(sorted(unplaced.items())),
        policy=part.policy,
        status=part.status,
        stats=part.stats,
    )
