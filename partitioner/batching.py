"""The batch window: when enough pending pods have gathered to plan them together. Pure.

Model
-----
A window is *closed* (no pod waiting for a plan) or *open* since ``opened_at``.  Every cycle the
controller reports the set of pods that are candidates now (pending, partitionable, not in
flight) with :func:`observe`:

* a candidate is an *arrival* when it is not a member yet and was never planned, or was last
  planned ``retry_seconds`` ago or more and the caller says a retry could change something
  (``retry=True``: the cluster changed since the last plan, or time alone can change it, such
  as a waiting-time tier crossed).  An unplaceable pod is retried, but does not keep the window
  open forever on its own, and is not re-planned for nothing: a retry of an unchanged input
  would only repeat the last plan;
* an arrival opens a closed window (``opened_at = now``) and sets ``last_arrival = now``;
* members that are no longer candidates (scheduled, deleted) leave; a window left without
  members closes.

The window is *due* (:func:`due`) when it has been open ``timeout`` seconds, or no pod arrived
for ``idle`` seconds.  Then the controller plans every candidate and calls :func:`planned`,
which closes the window and stamps the planned pods with ``now``.  When a plan could not be
written (a conflict), :func:`forget` un-stamps its pods so they open the next window at once.

Restart: the state lives in memory only.  A new controller starts with an empty window and
sees every still-pending pod as an arrival, so a restart delays a batch by at most one window
and loses no pod; pods already planned are kept out by the caller (they are in flight).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

__all__ = ["BatchPolicy", "BatchWindow", "due", "forget", "next_deadline", "observe", "planned"]


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    timeout: float = 60.0
    """Close the window this long after it opened, even if pods keep arriving."""
    idle: float = 10.0
    """Close the window when no pod arrived for this long."""
    retry: float = 60.0
    """A pod planned but still pending counts as a new arrival again after this long."""

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.idle <= 0 or self.retry < 0:
            raise ValueError(
                f"batch window: timeout ({self.timeout}) and idle ({self.idle}) must be > 0 and "
                f"retry ({self.retry}) >= 0 seconds"
            )


@dataclass(frozen=True, slots=True)
class BatchWindow:
    opened_at: float | None = None
    last_arrival: float | None = None
    members: frozenset[str] = frozenset()
    planned_at: Mapping[str, float] = field(default_factory=dict)
    """Pod -> when it was last part of a plan (pruned to pods still pending)."""

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None


def observe(
    window: BatchWindow,
    candidates: Iterable[str],
    now: float,
    policy: BatchPolicy,
    retry: bool = True,
) -> BatchWindow:
    """The window after seeing the current candidate pods at time ``now``; with
    ``retry=False`` pods planned before are not arrivals however long ago (module docstring)."""
    current = frozenset(candidates)
    # Stamps are pruned only when a stamped pod is no longer a candidate (the subset test is
    # far cheaper than rebuilding the mapping every cycle, with thousands of pods waiting);
    # windows may share the mapping: nothing changes one in place (:func:`planned` and
    # :func:`forget` copy it).
    planned_at = window.planned_at
    if not planned_at.keys() <= current:
        planned_at = {p: t for p, t in planned_at.items() if p in current}
    arrivals = {
        p
        for p in current - window.members
        if p not in planned_at or (retry and now - planned_at[p] >= policy.retry)
    }
    members = (window.members & current) | arrivals
    if not members:
        return BatchWindow(planned_at=planned_at)
    opened_at = window.opened_at if window.opened_at is not None else now
    last_arrival = now if arrivals else window.last_arrival
    return BatchWindow(opened_at, last_arrival, frozenset(members), planned_at)


def due(window: BatchWindow, now: float, policy: BatchPolicy) -> bool:
    deadline = next_deadline(window, policy)
    return deadline is not None and now >= deadline


def next_deadline(window: BatchWindow, policy: BatchPolicy) -> float | None:
    """When the open window becomes due (``None`` when closed)."""
    if window.opened_at is None:
        return None
    last = window.last_arrival if window.last_arrival is not None else window.opened_at
    return min(window.opened_at + policy.timeout, last + policy.idle)


def planned(window: BatchWindow, batch: Iterable[str], now: float) -> BatchWindow:
    """Close the window after planning ``batch`` at ``now``."""
    stamped = dict(window.planned_at)
    stamped.update(dict.fromkeys(batch, now))
    return replace(BatchWindow(), planned_at=stamped)


def forget(window: BatchWindow, pods: Iterable[str]) -> BatchWindow:
    """Treat ``pods`` as never planned (their plan was not written): they arrive again at once."""
    drop = set(pods)
    return replace(window, planned_at={p: t for p, t in window.planned_at.items() if p not in drop})
