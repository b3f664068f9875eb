"""Test oracle: NVIDIA's MIG rules and profile names, written from ``shared/facts/mig.md`` only.

Nothing here is read from the planner or the catalog: tables and rules are copied by hand from
the facts sheet ("8 memory slices, 7 compute slices", "A30", "RTX PRO 6000 Blackwell" and the
profile-name table), so tests can judge the catalog, the planner and the adoption code against
an independent reading of the hardware.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GEOMETRIES", "MODELS", "Shape", "layout_ok", "names_of", "resource_name"]


@dataclass(frozen=True)
class Shape:
    key: str
    compute: int
    memory_slices: int
    max_count: int
    starts: tuple[int, ...]
    media: bool = False


@dataclass(frozen=True)
class Geometry:
    slots: int
    compute: int
    shapes: tuple[Shape, ...]


# facts/mig.md, "8 memory slices, 7 compute slices": same ids and placements on all of them.
EIGHT = Geometry(
    8,
    7,
    (
        Shape("1g", 1, 1, 7, (0, 1, 2, 3, 4, 5, 6)),
        Shape("1g+me", 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), media=True),
        Shape("1g2m", 1, 2, 4, (0, 2, 4, 6)),
        Shape("2g", 2, 2, 3, (0, 2, 4)),
        Shape("3g", 3, 4, 2, (0, 4)),
        Shape("4g", 4, 4, 1, (0,)),
        Shape("7g", 7, 8, 1, (0,)),
    ),
)
# facts/mig.md, "A30 24GB": 4 memory slices, 4 compute slices.
A30 = Geometry(
    4,
    4,
    (
        Shape("1g", 1, 1, 4, (0, 1, 2, 3)),
        Shape("1g+me", 1, 1, 1, (0, 1, 2, 3), media=True),
        Shape("2g", 2, 2, 2, (0, 2)),
        Shape("2g+me", 2, 2, 1, (0, 2), media=True),
        Shape("4g", 4, 4, 1, (0,)),
    ),
)
# facts/mig.md, "RTX PRO 6000 Blackwell": a 12-unit grid, 4 compute slices.
RTX = Geometry(
    12,
    4,
    (
        Shape("1g", 1, 3, 4, (0, 3, 6, 9)),
        Shape("1g+me", 1, 3, 1, (0, 3, 6, 9), media=True),
        Shape("1g+gfx", 1, 3, 4, (0, 3, 6, 9)),
        Shape("2g", 2, 6, 2, (0, 6)),
        Shape("2g+gfx", 2, 6, 2, (0, 6)),
        Shape("4g", 4, 12, 1, (0,)),
    ),
)


def _eight(one: str, double: str, two: str, three: str, four: str, seven: str) -> dict[str, str]:
    return {
        "1g": one,
        "1g+me": f"{one}+me",
        "1g2m": double,
        "2g": two,
        "3g": three,
        "4g": four,
        "7g": seven,
    }


# facts/mig.md, the profile-name table; keyed by the catalog's model names (the only link to
# the code under test: a catalog model missing here fails the exact-name test).
MODELS: dict[str, tuple[Geometry, dict[str, str]]] = {
    "A100-SXM4-40GB": (
        EIGHT,
        _eight("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    ),
    "A100-SXM4-80GB": (
        EIGHT,
        _eight("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
    ),
    "H100-80GB": (EIGHT, _eight("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")),
    "H100-NVL": (EIGHT, _eight("1g.12gb", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb")),
    "GH200-96GB": (
        EIGHT,
        _eight("1g.12gb", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"),
    ),
    "GH200-144GB": (
        EIGHT,
        _eight("1g.18gb", "1g.36gb", "2g.36gb", "3g.72gb", "4g.72gb", "7g.144gb"),
    ),
    "H200-141GB": (
        EIGHT,
        _eight("1g.18gb", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"),
    ),
    "B200": (EIGHT, _eight("1g.23gb", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb")),
    "GB200": (EIGHT, _eight("1g.23gb", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb")),
    "A30": (
        A30,
        {
            "1g": "1g.6gb",
            "1g+me": "1g.6gb+me",
            "2g": "2g.12gb",
            "2g+me": "2g.12gb+me",
            "4g": "4g.24gb",
        },
    ),
    "RTX-PRO-6000-Blackwell": (
        RTX,
        {
            "1g": "1g.24gb",
            "1g+me": "1g.24gb+me",
            "1g+gfx": "1g.24gb+gfx",
            "2g": "2g.48gb",
            "2g+gfx": "2g.48gb+gfx",
            "4g": "4g.96gb",
        },
    ),
}
GEOMETRIES = {name: geo for name, (geo, _) in MODELS.items()}


def resource_name(profile: str) -> str:
    """The Kubernetes resource of a profile: ``+`` is not allowed in resource names, NVIDIA's
    device plugin spells it ``.`` (facts/gpu-operator.md, section 2)."""
    return "nvidia.com/mig-" + profile.replace("+", ".")


def names_of(model: str) -> dict[str, Shape]:
    """Profile name -> shape on ``model`` (empty for a GPU without MIG)."""
    if model not in MODELS:
        return {}
    geo, names = MODELS[model]
    return {names[s.key]: s for s in geo.shapes}


def layout_ok(model: str, instances: Sequence[tuple[str, int]]) -> bool:
    """facts/mig.md's placement model: allowed starts, no shared memory slice, per-profile
    maximum counts, at most one media-extension instance, compute within the GPU's."""
    shapes = names_of(model)
    geo = GEOMETRIES[model]
    taken: set[int] = set()
    for name, start in instances:
        shape = shapes.get(name)
        if shape is None or start not in shape.starts:
            return False
        span = set(range(start, start + shape.memory_slices))
        if span & taken or max(span) >= geo.slots:
            return False
        taken |= span
    counts = Counter(name for name, _ in instances)
    if any(n > shapes[name].max_count for name, n in counts.items()):
        return False
    if sum(n for name, n in counts.items() if shapes[name].media) > 1:
        return False
    return sum(shapes[name].compute for name, _ in instances) <= geo.compute
