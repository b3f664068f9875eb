"""MIG layout validity and enumeration: NVIDIA's documented cases and the placement rules."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.catalog import GpuModel, default_catalog
from planner.geometry import (
    InvalidLayout,
    Placement,
    enumerate_layouts,
    free_slots,
    layout_errors,
    parse_layout,
)

CAT = default_catalog()
A100 = CAT.model("A100-SXM4-80GB")
A30 = CAT.model("A30")


def lay(*spec: tuple[str, int]) -> list[Placement]:
    return [Placement(start, A100.profile(name)) for name, start in spec]


def test_4g_at_0_plus_3g_at_4_is_valid() -> None:
    assert layout_errors(A100, lay(("4g.40gb", 0), ("3g.40gb", 4))) == []


def test_3g_3g_1g_is_invalid() -> None:
    errors = layout_errors(A100, lay(("3g.40gb", 0), ("3g.40gb", 4), ("1g.10gb", 0)))
    assert any("overlaps" in e for e in errors)
    # no placement of a 1g fits beside two 3g: every layout with 2 x 3g has nothing else
    for layout in enumerate_layouts(A100, lay(("3g.40gb", 0), ("3g.40gb", 4))):
        assert len(layout) == 2


@pytest.mark.parametrize(
    "left",
    [
        [("2g.20gb", 0), ("2g.20gb", 2)],
        [("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3)],
        [("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 2), ("1g.10gb", 3)],
    ],
)
def test_3g_at_4_with_slots_0_to_3_filled_is_valid(left: list[tuple[str, int]]) -> None:
    layout = lay(("3g.40gb", 4), *left)
    assert layout_errors(A100, layout) == []
    assert sum(p.profile.compute for p in layout) == 7
    assert free_slots(A100, layout) == []


def test_no_1g_at_slot_7() -> None:
    assert 7 not in A100.profile("1g.10gb").starts
    with pytest.raises(InvalidLayout, match=r"may start only at slots \[0, 1, 2, 3, 4, 5, 6\]"):
        parse_layout(A100, [("1g.10gb", 7)])


def test_3g_at_0_reaches_only_6_compute() -> None:
    best = max(
        sum(p.profile.compute for p in layout)
        for layout in enumerate_layouts(A100, lay(("3g.40gb", 0)))
    )
    assert best == 6


def test_max_count_and_single_media_extension() -> None:
    me = A100.profile("1g.10gb+me")
    errors = layout_errors(A100, [Placement(0, me), Placement(1, me)])
    assert any("+me" in e for e in errors)
    errors = layout_errors(A30, [Placement(s, A30.profile("1g.6gb")) for s in range(4)] * 2)
    assert any("exceeds its maximum of 4" in e for e in errors)


def test_enumeration_keeps_every_pinned_instance_and_yields_only_valid_layouts() -> None:
    pinned = lay(("2g.20gb", 2), ("1g.10gb", 6))
    seen = set()
    for layout in enumerate_layouts(A100, pinned):
        assert set(pinned) <= set(layout)
        assert layout_errors(A100, layout) == []
        seen.add(layout)
    assert len(seen) > 10
    with pytest.raises(InvalidLayout, match="pinned instances are not a valid layout"):
        next(enumerate_layouts(A100, lay(("4g.40gb", 0), ("3g.40gb", 0))))


@pytest.mark.parametrize("model", [m for m in CAT.models if m.mig_capable], ids=lambda m: m.name)
def test_enumeration_yields_only_valid_layouts_on_every_model(model: GpuModel) -> None:
    layouts = list(enumerate_layouts(model))
    assert len(layouts) == len(set(layouts)) > len(model.profiles)
    assert all(layout_errors(model, layout) == [] for layout in layouts)


def test_enumeration_keeps_a_me_all_instance_alone() -> None:
    # No catalog model has a +me.all profile yet (a user file may add one): the walk's own
    # checks do not cover its exclusivity, the final check must.
    rtx = CAT.model("RTX-PRO-6000-Blackwell")
    me_all = replace(rtx.profile("1g.24gb+me"), name="1g.24gb+me.all", variant="+me.all")
    model = replace(rtx, profiles=(*rtx.profiles, me_all))
    with_me_all = [lay for lay in enumerate_layouts(model) if any(p.profile == me_all for p in lay)]
    assert with_me_all and all(len(lay) == 1 for lay in with_me_all)
    pinned = [Placement(3, me_all)]
    assert list(enumerate_layouts(model, pinned)) == [tuple(pinned)]


def test_a30_has_its_own_4_slot_grid() -> None:
    assert A30.memory_slots == 4
    assert (
        layout_errors(
            A30, [Placement(0, A30.profile("2g.12gb")), Placement(2, A30.profile("2g.12gb"))]
        )
        == []
    )
    assert layout_errors(A30, [Placement(1, A30.profile("2g.12gb"))]) != []


def test_memoised_enumeration_and_errors_answer_as_computed() -> None:
    # enumerate_layouts and layout_errors memoise per (model, arguments): a second call gives
    # the same layouts in the same order, an invalid pinned layout raises on every call (when
    # the first layout is asked for), and each errors list is the caller's own.
    pinned = lay(("3g.40gb", 4))
    first = list(enumerate_layouts(A100, pinned))
    assert first and list(enumerate_layouts(A100, pinned)) == first
    only_1g = [A100.profile("1g.10gb")]
    assert list(enumerate_layouts(A100, tuple(pinned), only_1g)) == [
        layout
        for layout in first
        if all(p in pinned or p.profile.name == "1g.10gb" for p in layout)
    ]
    bad = lay(("3g.40gb", 0), ("4g.40gb", 0))
    for _ in range(2):
        layouts = enumerate_layouts(A100, bad)  # nothing raised before the first layout
        with pytest.raises(InvalidLayout, match="overlaps"):
            next(layouts)
    errors = layout_errors(A100, bad)
    errors.append("changed by the caller")
    assert layout_errors(A100, bad) == errors[:-1] != []
