"""Static MIG partitioning policies: fixed layouts set once, never changed.

Model
-----
A *static layout* is a MIG layout written by shape (``("2g", 0), ("1g", 2), ("1g", 3),
("3g", 4)``) so one definition applies to every GPU model of the same grid; it resolves to a
model's profiles with :meth:`planner.catalog.GpuModel.profile_by_shape` and is validated with
:func:`planner.geometry.parse_layout`.  A :class:`StaticPolicy` is a *mix*: a list of
``(weight, layout)``; the cluster's GPUs (node-name order, then GPU index) get the layouts in
proportion to the weights by the largest-remainder rule, consecutively, so the result is
deterministic.  A uniform policy is a mix of one layout.

Built-in policies (:data:`BUILTIN_STATIC`)
------------------------------------------
* ``all-1g`` — seven ``1g`` instances (four ``1g`` on 4-slot GPUs such as A30);
* ``balanced`` — NVIDIA mig-parted's ``all-balanced`` config: 8-slot GPUs ``2 x 1g + 1 x 2g +
  1 x 3g`` (A100-80GB: 2 x 1g.10gb, 1 x 2g.20gb, 1 x 3g.40gb), A30 ``2 x 1g + 1 x 2g``;
* ``all-2g`` (3 x 2g), ``all-3g`` (2 x 3g), ``all-7g`` (whole GPUs, A30: 4g).

Best static layout
------------------
:func:`maximal_layouts` lists the distinct *maximal* layouts of a model (no instance of the
allowed profiles can be added), as multisets of profiles with canonical placements.
:func:`demand_matched_mix` picks, with CP-SAT, how many of ``gpus`` GPUs get each maximal layout
so that the capacity of every demanded profile covers the largest common fraction ``z`` of its
demand (maximise ``z``, then the compute slices in use); a profile's capacity counts the
instances of that profile only (a pod asking for ``2g`` cannot use two ``1g``).
:func:`static_candidates` returns the built-ins plus the demand-matched mixes for the average
and the peak demand; :func:`best_static` evaluates each candidate with a caller-supplied
function (the simulator's replay) and returns the one with the smallest key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.catalog import GpuModel, MigProfile, UnknownProfile
from planner.geometry import Layout, enumerate_layouts, parse_layout
from planner.snapshot import PlannedGpu

__all__ = [
    "BUILTIN_STATIC",
    "StaticLayoutError",
    "StaticPolicy",
    "assign_static",
    "best_static",
    "demand_matched_mix",
    "maximal_layouts",
    "static_candidates",
    "static_policy",
]

ShapeLayout = tuple[tuple[str, int], ...]
"""A layout by shape: (shape key, start slot) per instance."""


class StaticLayoutError(ValueError):
    """A static policy is unknown or does not fit a GPU model."""


@dataclass(frozen=True, slots=True)
class StaticPolicy:
    """A named mix of static layouts (see the module docstring)."""

    name: str
    mix: tuple[tuple[float, ShapeLayout], ...]
    """(weight, layout by shape); per model, layouts whose grid does not match are skipped."""
    per_model: Mapping[str, tuple[tuple[int, ShapeLayout], ...]] | None = None
    """Exact GPU counts per model (from :func:`demand_matched_mix`); overrides ``mix``."""

    def describe(self) -> str:
        if self.per_model:
            return "; ".join(
                f"{model}: " + ", ".join(f"{n} x [{_fmt(lay)}]" for n, lay in counts)
                for model, counts in self.per_model.items()
            )
        return " + ".join(f"{w:g} x [{_fmt(lay)}]" for w, lay in self.mix)


def _fmt(layout: ShapeLayout) -> str:
    return " ".join(f"{shape}@{start}" for shape, start in layout) or "empty"


_ONE_G_8 = tuple(("1g", s) for s in range(7))
_ONE_G_4 = tuple(("1g", s) for s in range(4))
BUILTIN_STATIC: Mapping[str, StaticPolicy] = {
    "all-1g": StaticPolicy("all-1g", ((1.0, _ONE_G_8), (1.0, _ONE_G_4))),
    "balanced": StaticPolicy(
        "balanced",
        (
            (1.0, (("2g", 0), ("1g", 2), ("1g", 3), ("3g", 4))),
            (1.0, (("2g", 0), ("1g", 2), ("1g", 3))),
        ),
    ),
    "all-2g": StaticPolicy(
        "all-2g", ((1.0, (("2g", 0), ("2g", 2), ("2g", 4))), (1.0, (("2g", 0), ("2g", 2))))
    ),
    "all-3g": StaticPolicy("all-3g", ((1.0, (("3g", 0), ("3g", 4))),)),
    "all-7g": StaticPolicy("all-7g", ((1.0, (("7g", 0),)), (1.0, (("4g", 0),)))),
}
"""Built-in static policies; each lists an 8-slot and (where one exists) a 4-slot variant."""


def static_policy(name: str) -> StaticPolicy:
    try:
        return BUILTIN_STATIC[name]
    except KeyError:
        raise StaticLayoutError(
            f"unknown static layout {name!r}; built-in: {', '.join(BUILTIN_STATIC)}"
        ) from None


def resolve(model: GpuModel, layout: ShapeLayout) -> Layout | None:
    """The layout on ``model``, or ``None`` if a shape or start does not exist on its grid."""
    try:
        spec = [(model.profile_by_shape(shape).name, start) for shape, start in layout]
        return parse_layout(model, spec)
    except (UnknownProfile, ValueError):
        return None


def _planned(node: str, index: int, layout: Layout) -> PlannedGpu:
    return PlannedGpu(node, index, mig=tuple((p.profile.name, p.start) for p in layout))


def _largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    s = sum(weights)
    raw = [w / s * total for w in weights]
    counts = [int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def assign_static(
    policy: StaticPolicy, gpus: Sequence[tuple[str, int, GpuModel]]
) -> list[PlannedGpu]:
    """Per-GPU layouts for ``gpus`` ((node, index, model), in the order given).

    Raises :class:`StaticLayoutError` when no layout of the policy fits a model.
    """
    by_model: dict[str, list[tuple[str, int, GpuModel]]] = {}
    for g in gpus:
        by_model.setdefault(g[2].name, []).append(g)
    out: list[PlannedGpu] = []
    for name, group in by_model.items():
        model = group[0][2]
        if policy.per_model is not None and name in policy.per_model:
            fitting = [(float(n), lay) for n, lay in policy.per_model[name]]
            counts = [n for n, _ in policy.per_model[name]]
            if sum(counts) != len(group):
                raise StaticLayoutError(
                    f"static policy {policy.name!r} plans {sum(counts)} {name} GPUs, "
                    f"the cluster has {len(group)}"
                )
        else:
            fitting = [(w, lay) for w, lay in policy.mix if resolve(model, lay) is not None]
            if not fitting:
                raise StaticLayoutError(
                    f"static policy {policy.name!r} has no layout that fits {name} "
                    f"({model.memory_slots}-slot MIG grid); choose another policy"
                )
            counts = _largest_remainder([w for w, _ in fitting], len(group))
        it = iter(group)
        for (_, lay), n in zip(fitting, counts, strict=True):
            resolved = resolve(model, lay)
            if resolved is None:
                raise StaticLayoutError(f"static layout [{_fmt(lay)}] does not fit {name}")
            for _ in range(n):
                node, index, _m = next(it)
                out.append(_planned(node, index, resolved))
    return out


def maximal_layouts(
    model: GpuModel, profiles: Iterable[MigProfile] | None = None
) -> list[ShapeLayout]:
    """Distinct maximal layouts of ``model`` over ``profiles`` (default: no ``+me``/``1g.2m``).

    Distinct = different multisets of profiles (the first placement found is kept).
    """
    allowed = (
        list(profiles)
        if profiles is not None
        else [p for p in model.profiles if not p.variant and p.shape != "1g.2m"]
    )
    seen: dict[tuple[str, ...], ShapeLayout] = {}
    for layout in enumerate_layouts(model, profiles=allowed):
        if not layout:
            continue
        key = tuple(sorted(p.profile.shape for p in layout))
        if key in seen:
            continue
        extendable = any(
            len(longer) > len(layout)
            for longer in enumerate_layouts(model, pinned=layout, profiles=allowed)
        )
        if not extendable:
            seen[key] = tuple((p.profile.shape, p.start) for p in layout)
    return list(seen.values())


def demand_matched_mix(
    model: GpuModel,
    demand: Mapping[str, float],
    gpus: int,
    name: str = "matched",
) -> StaticPolicy:
    """CP-SAT: GPUs per maximal layout so every profile covers the same largest share of its demand.

    ``demand`` maps a profile *shape* (``1g``, ``2g`` ...) to a non-negative amount (e.g. the
    average number of concurrently requested instances).  Shapes absent from the model raise
    :class:`StaticLayoutError`.
    """
    if gpus < 1:
        raise StaticLayoutError(f"demand_matched_mix needs at least one GPU, got {gpus}")
    wanted = {s: d for s, d in demand.items() if d > 0}
    for shape in wanted:
        try:
            model.profile_by_shape(shape)
        except UnknownProfile:
            raise StaticLayoutError(
                f"demanded MIG shape {shape!r} does not exist on {model.name}"
            ) from None
    candidates = maximal_layouts(model)
    if not wanted:
        return StaticPolicy(name, (), {model.name: ((gpus, candidates[0]),)})
    m = cp_model.CpModel()
    x = [m.new_int_var(0, gpus, f"x{i}") for i in range(len(candidates))]
    m.add(sum(x) == gpus)
    scale = 1000
    z = m.new_int_var(0, scale * 10, "z")  # coverage above 10x counts the same
    # demands become integers in thousandths so the constraint stays linear
    for shape, d in wanted.items():
        dk = max(1, round(d * 1000))
        cap = sum(
            xi * sum(1 for s, _ in lay if s == shape) for xi, lay in zip(x, candidates, strict=True)
        )
        m.add(cap * scale * 1000 >= z * dk)
    compute = {p.shape: p.compute for p in model.profiles}
    used = sum(
        xi * sum(compute[s] for s, _ in lay if s in wanted)
        for xi, lay in zip(x, candidates, strict=True)
    )
    m.maximize(z * (7 * gpus + 1) + used)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 5.0
    solver.parameters.random_seed = 0
    status = solver.solve(m)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise StaticLayoutError(
            f"demand_matched_mix: CP-SAT found no mix ({solver.status_name(status)})"
        )
    counts = tuple(
        (int(solver.value(xi)), lay)
        for xi, lay in zip(x, candidates, strict=True)
        if solver.value(xi) > 0
    )
    return StaticPolicy(name, (), {model.name: counts})


def static_candidates(
    model: GpuModel,
    gpus: int,
    average_demand: Mapping[str, float],
    peak_demand: Mapping[str, float],
) -> list[StaticPolicy]:
    """The built-in policies plus demand-matched mixes for the average and the peak demand."""
    out = [p for p in BUILTIN_STATIC.values() if any(resolve(model, lay) for _, lay in p.mix)]
    out.append(demand_matched_mix(model, average_demand, gpus, "matched-average"))
    out.append(demand_matched_mix(model, peak_demand, gpus, "matched-peak"))
    return out


Key = tuple[float, ...]
"""A candidate's score; smaller is better."""


def best_static(
    candidates: Sequence[StaticPolicy], evaluate: Callable[[StaticPolicy], Key]
) -> tuple[StaticPolicy, Key, list[tuple[StaticPolicy, Key]]]:
    """Evaluate every candidate; return the best (smallest key), its key, and all results."""
    if not candidates:
        raise StaticLayoutError("best_static: no candidate static policies")
    results = [(c, evaluate(c)) for c in candidates]
    best, key = min(results, key=lambda ck: ck[1])
    return best, key, results
