"""The MIG geometry bound: the fewest GPUs any layouts could use for a trace's peak demand.

Definition
----------
Let ``D(t)`` be the multiset of MIG instances the trace's pods hold at time ``t`` if every pod
ran exactly from its arrival to ``arrival + duration`` (the trace's own times, after the
replay's mapping and compression; a pod asking for ``k`` units of a profile contributes ``k``
instances).  For a multiset ``D`` of profiles on one GPU model, ``GPUS(D)`` is the minimum
number of GPUs whose valid layouts (:mod:`planner.geometry`) together contain at least
``D``'s instances.  The **geometry bound** is ``B = max_t GPUS(D(t))``: no partitioning
policy, static or dynamic, clairvoyant or not, can run the trace without pending time on fewer
than ``B`` GPUs.  It ignores node boundaries (a multi-GPU pod needs its GPUs on one node) and
CPU/memory, which can only raise the true minimum, so ``B`` is a lower bound.

Computation
-----------
``GPUS(D)`` is a pattern integer program solved exactly with CP-SAT: ``x_L`` = GPUs that get
maximal layout ``L`` (:func:`simulations.replay.static_layouts.maximal_layouts` over the standard
profiles, which covers every valid layout because a valid layout minus instances is valid);
minimise ``Σ x_L`` subject to ``Σ_L x_L · count_L(p) >= D(p)`` for every profile ``p``.
``D(t)`` only needs checking at local maxima (after the arrivals of an instant, when the next
event is a departure), deduplicated.  Candidates are visited by decreasing *upper* bound
``U(D) = Σ_p ceil(D(p) / max_count_p)`` (a homogeneous packing); once ``U(D)`` is at most the
best exact value found, no later candidate can beat it.  The cheap lower bound
``max(ceil(Σ compute / compute_slices), ceil(Σ memory slices / memory_slots))`` is reported too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.catalog import GpuModel
from planner.snapshot import mig_profile_of
from simulations.replay.engine import ReplayPod
from simulations.replay.static_layouts import maximal_layouts

__all__ = ["GeometryBound", "geometry_bound", "gpus_needed", "peak_demands"]


@dataclass(frozen=True, slots=True)
class GeometryBound:
    gpus: int
    """``B``: the bound in GPUs."""
    at: float
    """A time at which ``GPUS(D(t)) = B``."""
    demand: dict[str, int]
    """``D`` at that time: profile name -> instances."""
    simple_bound: int
    """``max_t`` of the compute/memory-slice bound (``<= gpus``)."""
    candidates: int
    """Distinct local-maximum demands considered."""
    solved: int
    """How many of them needed an exact CP-SAT solve."""

    def as_dict(self) -> dict[str, object]:
        return {
            "gpus": self.gpus,
            "at": self.at,
            "demand": dict(sorted(self.demand.items())),
            "simple_bound": self.simple_bound,
            "candidates": self.candidates,
            "exact_solves": self.solved,
        }


def peak_demands(pods: Sequence[ReplayPod]) -> list[tuple[float, Counter[str]]]:
    """Distinct local-maximum MIG demands ``(time, profile -> instances)`` of the trace."""
    events: list[tuple[float, int, str, int]] = []
    for p in pods:
        for resource, k in p.requests.items():
            profile = mig_profile_of(resource)
            if profile is None:
                continue
            events.append((p.arrival, 1, profile, k))
            events.append((p.arrival + p.duration, 0, profile, -k))
    events.sort(key=lambda e: (e[0], e[1]))
    current: Counter[str] = Counter()
    out: dict[tuple[tuple[str, int], ...], tuple[float, Counter[str]]] = {}
    for i, (t, kind, profile, k) in enumerate(events):
        current[profile] += k
        nxt = events[i + 1] if i + 1 < len(events) else None
        if kind == 1 and (nxt is None or (nxt[0] > t and nxt[1] == 0)):
            key = tuple(sorted((p, n) for p, n in current.items() if n > 0))
            if key and key not in out:
                out[key] = (t, +current)
    return list(out.values())


def _simple(model: GpuModel, demand: Counter[str]) -> int:
    compute = sum(model.profile(p).compute * n for p, n in demand.items())
    memory = sum(model.profile(p).memory_slices * n for p, n in demand.items())
    return max(math.ceil(compute / model.compute_slices), math.ceil(memory / model.memory_slots))


def _upper(model: GpuModel, demand: Counter[str]) -> int:
    return sum(math.ceil(n / model.profile(p).max_count) for p, n in demand.items())


def gpus_needed(model: GpuModel, demand: Counter[str]) -> int:
    """``GPUS(D)`` (module docstring), exact via CP-SAT."""
    wanted = {model.profile(p).shape: n for p, n in demand.items() if n > 0}
    if not wanted:
        return 0
    layouts = maximal_layouts(model)
    upper = _upper(model, demand)
    m = cp_model.CpModel()
    x = [m.new_int_var(0, upper, f"x{i}") for i in range(len(layouts))]
    for shape, n in wanted.items():
        m.add(
            sum(
                xi * sum(1 for s, _ in lay if s == shape)
                for xi, lay in zip(x, layouts, strict=True)
            )
            >= n
        )
    m.minimize(sum(x))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 30.0
    status = solver.solve(m)
    if status != cp_model.OPTIMAL:
        raise RuntimeError(
            f"geometry bound: CP-SAT did not prove optimality ({solver.status_name(status)})"
        )
    return round(solver.objective_value)


def geometry_bound(model: GpuModel, pods: Sequence[ReplayPod]) -> GeometryBound:
    """``B`` for ``pods`` on ``model`` (module docstring)."""
    peaks = peak_demands(pods)
    if not peaks:
        return GeometryBound(0, 0.0, {}, 0, 0, 0)
    simple = max(_simple(model, d) for _, d in peaks)
    order = sorted(peaks, key=lambda td: (-_upper(model, td[1]), td[0]))
    best, best_at, best_d, solved = -1, 0.0, Counter[str](), 0
    for t, d in order:
        if _upper(model, d) <= best:
            break
        solved += 1
        g = gpus_needed(model, d)
        if g > best:
            best, best_at, best_d = g, t, d
    return GeometryBound(best, best_at, dict(best_d), simple, len(peaks), solved)
