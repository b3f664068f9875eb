"""The batch bound (``_UnitBounds``) never caps below what a plan could place.

Oracle: for a GPU with some instances pinned (used or held), every valid layout that keeps
them (``planner.geometry.enumerate_layouts``) is a layout a plan may choose; the most instances
of a profile beyond the pinned ones over all those layouts is what the planner could give out.
The bound must be at least that, or the batch would leave out pods a plan could place; on
the built-in models it is exactly that (so a full cluster's batch holds one pod per resource).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.decide import _mig_gpu_bounds, _UnitBounds
from partitioner.ledger import Device, GpuSlots
from planner.catalog import GpuModel, default_catalog
from planner.geometry import Placement, enumerate_layouts

MODELS = ("A100-SXM4-80GB", "A100-SXM4-40GB", "H100-80GB", "A30")


def _layouts(model: GpuModel) -> list[tuple[Placement, ...]]:
    return list(enumerate_layouts(model))


def _bounds(model: GpuModel, layout: tuple[Placement, ...], pinned: set[int]) -> _UnitBounds:
    devices = [
        Device(
            p.profile.resource,
            p.start,
            p.profile.compute,
            used=i in pinned,
            pinned=i in pinned,
            mig_profile=p.profile.name,
        )
        for i, p in enumerate(layout)
    ]
    b = _UnitBounds([], 0)
    for resource, k in _mig_gpu_bounds(model, GpuSlots(0, devices)):
        b.mig[resource] += k
    return b


def _oracle(model: GpuModel, kept: list[Placement]) -> dict[str, int]:
    best: dict[str, int] = {p.resource: 0 for p in model.profiles}
    for layout in enumerate_layouts(model, kept):
        counts: dict[str, int] = {}
        for p in layout:
            counts[p.profile.resource] = counts.get(p.profile.resource, 0) + 1
        for p in kept:
            counts[p.profile.resource] -= 1
        for r, n in counts.items():
            best[r] = max(best[r], n)
    return best


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(MODELS), st.integers(0, 10**9))
def test_bound_is_what_the_best_layout_keeping_the_pinned_instances_offers(
    name: str, seed: int
) -> None:
    model = default_catalog().model(name)
    rng = random.Random(seed)
    layout = rng.choice(_layouts(model))
    pinned = {i for i in range(len(layout)) if rng.random() < 0.5}
    bounds = _bounds(model, layout, pinned)
    best = _oracle(model, [layout[i] for i in sorted(pinned)])
    for resource, n in best.items():
        assert bounds(resource) == n, (name, layout, pinned, resource)


@pytest.mark.parametrize("name", MODELS)
def test_bound_is_exact_on_empty_and_full_gpus(name: str) -> None:
    model = default_catalog().model(name)
    empty = _bounds(model, (), set())
    for profile in model.profiles:
        assert empty(profile.resource) == _oracle(model, [])[profile.resource]
    full = max(_layouts(model), key=lambda lay: sum(p.profile.compute for p in lay))
    used = _bounds(model, full, set(range(len(full))))
    leftover = _oracle(model, list(full))
    for profile in model.profiles:
        assert used(profile.resource) == leftover[profile.resource]
