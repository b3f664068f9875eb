"""The controller's heap and CPython's cyclic garbage collector: keep full collections small.

Model
-----
The index (:mod:`partitioner.index`) holds about fifteen objects per cached pod that the cyclic
collector tracks (736,000 for 50,000 pods on 1,000 nodes).  They live as long as their pod and
form no reference cycles: reference counting frees them when the index drops them.  CPython
3.12's collector is generational: a *full* collection walks every tracked object of the oldest
generation, and runs once the objects promoted into it since the last one outnumber a quarter
of those that survived it.  A decision step with a batch due makes tens of thousands of objects
that outlive it (the planner's snapshot and the plan key the state keeps), so a full collection
comes every one to three such steps.

``gc.freeze`` moves every object alive into a permanent generation that collections skip.
Freezing once after the initial listing (what the controller did until 2026-12-07) only holds
while the listed objects are the cache: every pod updated or replaced since is a new object in
the oldest generation.  Once every pod had been updated once (``gpuslice bench controller``'s
``turnover`` phase), each full collection walked about 680,000 objects for 540 ms, and a step
with a batch due took 446-532 ms at p50-p99 instead of 171-195 ms with this policy
(``simulations/results/controller-2026-12-07b/``).

Policy (:class:`HeapKeeper`)
----------------------------
1. :meth:`~HeapKeeper.start`, after the initial listing: a full collection, then freeze.
2. :meth:`~HeapKeeper.settle`, after every decision step: if a collection promoted objects
   into the oldest generation since the last call, collect the young generations (garbage
   made since is freed, not frozen) and freeze again; a step that promoted nothing (a quiet
   one) costs a look at the collector's counters.  The oldest generation then holds only what
   was promoted during the current step, so a full collection walks thousands of objects, not
   the cache.
3. Every ``reclaim_s`` seconds, at a :meth:`~HeapKeeper.settle`: unfreeze, one full
   collection, freeze.  A frozen object that later becomes part of a garbage *cycle* is not
   collected while frozen (reference counting cannot free a cycle).  The decision path makes
   none (every collection during the benchmark found 0 unreachable objects), but asyncio, kopf
   and the HTTP client do (a task or an exception that refers to itself through a
   traceback): 14-42 objects a minute with pods coming and going, the operator against kmock
   (``tests/test_partitioner_health.py``).  The reclaim first collects what is outside the
   frozen heap, then unfreezes and collects again, and logs how many objects that second
   collection freed: what the policy kept alive.  It walks the whole heap once: 0.45-0.6 s
   at 50,000 pods on this machine, once per ``reclaim_s`` (``heap_reclaim_seconds``, default
   one hour).

What is frozen is still freed by reference counting when the index drops it: a pod deleted or
replaced gives its memory back as before.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


def _promotions() -> int:
    """Collections of the middle generation (each promotes its survivors into the oldest) this
    process has run, automatic or asked for, full ones included."""
    stats = gc.get_stats()
    return int(stats[1]["collections"]) + int(stats[2]["collections"])


@dataclass(frozen=True, slots=True)
class Reclaim:
    """One reclaim: what the full collection of the unfrozen heap found, and its time."""

    unreachable: int
    """Objects found unreachable once unfrozen: reference cycles that formed among frozen
    objects, which no collection could free while they were frozen (what the policy kept)."""
    frozen: int
    """Objects frozen after it (the live heap the collector skips)."""
    seconds: float


class HeapKeeper:
    """Keeps the controller's long-lived objects frozen (module docstring: the policy).

    ``clock`` is monotonic seconds (``time.monotonic`` by default); tests pass their own.
    """

    def __init__(self, reclaim_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not reclaim_s > 0:
            raise ValueError(f"reclaim_s must be > 0 (seconds between full reclaims): {reclaim_s}")
        self.reclaim_s = reclaim_s
        self._clock = clock
        self._promoted_seen = _promotions()
        self._reclaimed_at: float | None = None
        self.freezes = 0
        """Refreezes after a step that promoted objects (not counting start and reclaims)."""
        self.last_reclaim: Reclaim | None = None

    def start(self) -> None:
        """After the initial listing: everything alive now is the cache; freeze it."""
        gc.collect()
        gc.freeze()
        self._promoted_seen = _promotions()
        self._reclaimed_at = self._clock()

    def settle(self) -> Reclaim | None:
        """After a decision step: reclaim when due, else refreeze if objects were promoted.

        Returns the reclaim when one ran.  Before :meth:`start` it does nothing (the heap is
        the listing's, still being built).
        """
        if self._reclaimed_at is None:
            return None
        now = self._clock()
        if now - self._reclaimed_at >= self.reclaim_s:
            return self.reclaim()
        if _promotions() != self._promoted_seen:
            gc.collect(1)  # young garbage is collected, not frozen
            gc.freeze()
            self.freezes += 1
            self._promoted_seen = _promotions()
        return None

    def reclaim(self) -> Reclaim:
        """Unfreeze, collect everything, freeze again (policy 3); logged, and kept in
        :attr:`last_reclaim`."""
        now = self._clock()
        started = time.perf_counter()
        gc.collect()  # what is garbage outside the frozen heap: not the policy's to count
        gc.unfreeze()
        unreachable = gc.collect()
        gc.freeze()
        took = time.perf_counter() - started
        self._promoted_seen = _promotions()
        self._reclaimed_at = now
        self.last_reclaim = Reclaim(unreachable, gc.get_freeze_count(), took)
        log.info(
            "heap reclaim: %d objects in cycles among frozen objects freed, %d objects frozen, "
            "%.3f s",
            unreachable,
            self.last_reclaim.frozen,
            took,
        )
        return self.last_reclaim
