"""The controller's heap policy (partitioner/heap.py) against CPython's real collector.

Each test builds the situation the policy is for: objects that outlive a step (promoted into
the oldest generation) must leave the collector's walks, garbage must not be frozen with
them, and a cycle that forms among frozen objects must be freed by the periodic reclaim.
The autouse fixture in conftest.py unfreezes the heap after each test.
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import pytest

from partitioner.heap import HeapKeeper


class Node:
    """A tracked object that can refer to itself (a reference cycle)."""

    def __init__(self) -> None:
        self.other: Any = None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _held(objs: list[Any], generation: int | None = None) -> int:
    """How many of ``objs`` the collector's ``generation`` holds (``None``: any generation;
    a tracked object in none is frozen)."""
    ids = {id(o) for o in objs}
    return sum(1 for o in gc.get_objects(generation) if id(o) in ids)


def test_objects_promoted_by_a_step_are_frozen_at_its_end() -> None:
    keeper = HeapKeeper(3600, Clock())
    keeper.start()
    kept = [Node() for _ in range(5000)]  # made after the listing, alive: a cache's new pods
    gc.collect(1)  # a collection during the step promotes them into the oldest generation
    assert _held(kept, 2) == len(kept)  # a full collection would walk them
    assert keeper.settle() is None
    assert _held(kept, 2) == 0 and keeper.freezes == 1
    assert all(gc.is_tracked(o) for o in kept) and _held(kept) == 0  # tracked, in none: frozen


def test_a_step_that_promoted_nothing_freezes_nothing() -> None:
    keeper = HeapKeeper(3600, Clock())
    keeper.start()
    young = Node()  # in the youngest generation: no collection ran since the listing
    keeper.settle()
    assert keeper.freezes == 0 and gc.is_tracked(young)
    assert any(o is young for o in gc.get_objects(0))


def test_garbage_made_after_the_promotion_is_collected_not_frozen() -> None:
    keeper = HeapKeeper(3600, Clock())
    keeper.start()
    gc.collect(1)  # the step promoted something
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle, then dropped: only the cyclic collector can free it
    gone = weakref.ref(a)
    del a, b
    keeper.settle()
    assert keeper.freezes == 1
    assert gone() is None


def test_a_cycle_among_frozen_objects_waits_for_the_reclaim(caplog: Any) -> None:
    clock = Clock()
    keeper = HeapKeeper(600, clock)
    keeper.start()
    a, b = Node(), Node()
    gc.collect(1)
    keeper.settle()  # a and b are alive, so frozen
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b  # now a garbage cycle of frozen objects
    gc.collect()
    assert gone() is not None  # frozen: no collection sees it
    clock.now = 599.0
    assert keeper.settle() is None and gone() is not None
    clock.now = 600.0
    with caplog.at_level(logging.INFO, logger="partitioner.heap"):
        reclaim = keeper.settle()
    assert reclaim is not None and reclaim.unreachable >= 2 and gone() is None
    assert reclaim.frozen > 0 and reclaim.seconds >= 0
    assert keeper.last_reclaim is reclaim
    assert any("heap reclaim" in r.getMessage() for r in caplog.records)
    clock.now = 1199.0
    assert keeper.settle() is None  # the next one is reclaim_s after this one
    clock.now = 1200.0
    assert keeper.settle() is not None


def test_nothing_happens_before_the_listing() -> None:
    keeper = HeapKeeper(1, Clock())
    frozen = gc.get_freeze_count()
    gc.collect(1)
    assert keeper.settle() is None
    assert keeper.freezes == 0 and gc.get_freeze_count() == frozen


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_the_reclaim_interval_must_be_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="reclaim_s must be > 0"):
        HeapKeeper(bad)
