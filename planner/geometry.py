"""MIG layouts: validity per NVIDIA's placement rules, and enumeration of valid layouts.

Model
-----
A GPU with a ``S``-slot memory grid holds a *layout*: a set of instances ``(profile, start)``.
Instance ``i`` occupies the memory slots ``[start_i, start_i + memory_slices_i)``.  A layout is
valid iff (shared/facts/mig.md):

1. every ``start_i`` is one of the profile's allowed starts (so ``[start, start+size) ⊆ [0, S)``);
2. no two instances share a memory slot;
3. per profile, the number of instances is at most its ``max_count``;
4. at most one media-extension (``+me``) instance; a ``+me.all`` instance forbids every
   other profile except ``-me`` ones;
5. the compute slices sum to at most the GPU's ``compute_slices``.

On 8-slot GPUs rules 1-2 already imply 5, "slots 0-3 hold at most 4 compute, 4-7 at most 3",
and "no 1g at slot 7"; rule 5 is checked anyway so other grids cannot slip through.

Enumeration walks the slots left to right: at each free slot it either leaves the slot empty
or places one allowed profile starting there, so every valid layout is produced exactly once,
in a canonical order (instances sorted by start).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from planner.catalog import GpuModel, MigProfile

__all__ = [
    "InvalidLayout",
    "Layout",
    "Placement",
    "enumerate_layouts",
    "is_valid_layout",
    "layout_errors",
    "parse_layout",
]


class InvalidLayout(ValueError):
    """A layout breaks a placement rule; the message names the rule and the instance."""


@dataclass(frozen=True, slots=True, order=True)
class Placement:
    """One MIG GPU instance: a profile placed at a memory-slot start."""

    start: int
    profile: MigProfile

    @property
    def end(self) -> int:
        return self.start + self.profile.memory_slices

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.start}"


Layout = tuple[Placement, ...]
"""A layout in canonical form: placements sorted by start."""


def canonical(placements: Iterable[Placement]) -> Layout:
    return tuple(sorted(placements, key=lambda p: (p.start, p.profile.name)))


_MEMO_MAX = 1024
"""Entries each memo below keeps; it is emptied when full (planning touches a few dozen)."""
_errors_memo: dict[tuple[int, tuple[Placement, ...]], tuple[GpuModel, tuple[str, ...]]] = {}
_layouts_memo: dict[
    tuple[int, tuple[Placement, ...], frozenset[MigProfile] | None],
    tuple[GpuModel, tuple[Layout, ...]],
] = {}
# Both memos are keyed by the model's identity (the entry holds the model, so the identity
# cannot be reused while it is there) and by the exact arguments: models, profiles and
# placements are frozen, so a result computed once is the result of every later call with the
# same arguments.  The planner asks the same questions thousands of times in a replay (every
# plan re-validates every GPU's layout and enumerates the same few pinned layouts).


def layout_errors(model: GpuModel, placements: Sequence[Placement]) -> list[str]:
    """Every placement rule ``placements`` breaks on ``model`` (empty if the layout is valid).

    Memoised (see ``_errors_memo``); each call returns a new list."""
    key = (id(model), tuple(placements))
    hit = _errors_memo.get(key)
    if hit is None or hit[0] is not model:
        if len(_errors_memo) >= _MEMO_MAX:
            _errors_memo.clear()
        hit = _errors_memo[key] = (model, tuple(_layout_errors(model, key[1])))
    return list(hit[1])


def _layout_errors(model: GpuModel, placements: Sequence[Placement]) -> list[str]:
    errors: list[str] = []
    if not model.mig_capable:
        return [f"{model.name} does not support MIG"]
    known = set(model.profiles)
    occupied: dict[int, Placement] = {}
    for p in canonical(placements):
        if p.profile not in known:
            errors.append(f"{p}: profile {p.profile.name} is not a profile of {model.name}")
            continue
        if p.start not in p.profile.starts:
            errors.append(f"{p}: {p.profile.name} may start only at slots {list(p.profile.starts)}")
            continue
        for slot in p.profile.span(p.start):
            other = occupied.get(slot)
            if other is not None:
                errors.append(f"{p} overlaps {other} at memory slot {slot}")
                break
        else:
            for slot in p.profile.span(p.start):
                occupied[slot] = p
    counts = Counter(p.profile for p in placements)
    for prof, n in counts.items():
        if n > prof.max_count:
            errors.append(f"{n} x {prof.name} exceeds its maximum of {prof.max_count} per GPU")
    me = [p for p in placements if p.profile.has_media_extensions]
    if len(me) > 1:
        errors.append(f"at most one +me instance per GPU, got {', '.join(map(str, me))}")
    if any(p.profile.variant == "+me.all" for p in placements):
        others = [p for p in placements if p.profile.variant not in ("+me.all", "-me")]
        if others:
            errors.append("a +me.all instance allows only -me profiles beside it")
    compute = sum(p.profile.compute for p in placements)
    if compute > model.compute_slices:
        errors.append(f"{compute} compute slices exceed the GPU's {model.compute_slices}")
    return errors


def is_valid_layout(model: GpuModel, placements: Sequence[Placement]) -> bool:
    return not layout_errors(model, placements)


def parse_layout(model: GpuModel, spec: Iterable[tuple[str, int]]) -> Layout:
    """Build a layout from ``(profile name, start)`` pairs; raise :class:`InvalidLayout`."""
    layout = canonical(Placement(start, model.profile(name)) for name, start in spec)
    errs = layout_errors(model, layout)
    if errs:
        raise InvalidLayout(f"invalid MIG layout on {model.name}: " + "; ".join(errs))
    return layout


def enumerate_layouts(
    model: GpuModel,
    pinned: Sequence[Placement] = (),
    profiles: Iterable[MigProfile] | None = None,
) -> Iterator[Layout]:
    """Yield every valid layout that contains all of ``pinned`` (in canonical form).

    ``profiles`` restricts the profiles that may be *added* (default: all of the model's);
    pinned instances are kept whatever their profile.  Raises :class:`InvalidLayout` if the
    pinned instances are not a valid layout themselves (when the first layout is asked for).
    The layouts of one set of arguments are enumerated once and memoised (see
    ``_errors_memo``), in the same order.
    """
    addable = None if profiles is None else frozenset(profiles)
    key = (id(model), tuple(pinned), addable)
    hit = _layouts_memo.get(key)
    if hit is None or hit[0] is not model:
        layouts = tuple(_enumerate_layouts(model, key[1], addable))
        if len(_layouts_memo) >= _MEMO_MAX:
            _layouts_memo.clear()
        hit = _layouts_memo[key] = (model, layouts)
    yield from hit[1]


def _enumerate_layouts(
    model: GpuModel, pinned: Sequence[Placement], profiles: Iterable[MigProfile] | None
) -> Iterator[Layout]:
    pinned_l = canonical(pinned)
    errs = layout_errors(model, pinned_l)
    if errs:
        raise InvalidLayout(
            f"pinned instances are not a valid layout on {model.name}: " + "; ".join(errs)
        )
    addable = sorted(
        set(model.profiles if profiles is None else profiles),
        key=lambda p: (p.memory_slices, p.name),
    )
    slots = model.memory_slots
    taken = [False] * slots
    for p in pinned_l:
        for s in p.profile.span(p.start):
            taken[s] = True
    counts: Counter[MigProfile] = Counter(p.profile for p in pinned_l)
    me_used = sum(1 for p in pinned_l if p.profile.has_media_extensions)
    compute_used = sum(p.profile.compute for p in pinned_l)
    chosen: list[Placement] = []
    # ``fits`` below enforces every rule of ``layout_errors`` but two: foreign profiles and
    # the ``+me.all`` exclusivity.  Only where those can arise is each leaf re-checked.
    known = set(model.profiles)
    check_leaves = any(p not in known or p.variant == "+me.all" for p in addable) or any(
        p.profile.variant == "+me.all" for p in pinned_l
    )

    def fits(prof: MigProfile, start: int) -> bool:
        if start not in prof.starts or counts[prof] >= prof.max_count:
            return False
        if compute_used + prof.compute > model.compute_slices:
            return False
        if prof.has_media_extensions and me_used >= 1:
            return False
        return all(not taken[s] for s in prof.span(start))

    def walk(slot: int) -> Iterator[Layout]:
        nonlocal me_used, compute_used
        while slot < slots and taken[slot]:
            slot += 1
        if slot >= slots:
            layout = canonical((*pinned_l, *chosen))
            if not check_leaves or not layout_errors(model, layout):
                yield layout
            return
        # leave this slot empty
        yield from walk(slot + 1)
        for prof in addable:
            if not fits(prof, slot):
                continue
            span = prof.span(slot)
            for s in span:
                taken[s] = True
            counts[prof] += 1
            me_used += prof.has_media_extensions
            compute_used += prof.compute
            chosen.append(Placement(slot, prof))
            yield from walk(slot + prof.memory_slices)
            chosen.pop()
            compute_used -= prof.compute
            me_used -= prof.has_media_extensions
            counts[prof] -= 1
            for s in span:
                taken[s] = False

    yield from walk(0)


def free_slots(model: GpuModel, layout: Sequence[Placement]) -> list[int]:
    """Memory slots not covered by any instance of ``layout``."""
    used = {s for p in layout for s in p.profile.span(p.start)}
    return [s for s in range(model.memory_slots) if s not in used]
