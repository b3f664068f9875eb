"""The batch window: idle and timeout closing, departures, retries, restart."""

from __future__ import annotations

import pytest

from partitioner.batching import (
    BatchPolicy,
    BatchWindow,
    due,
    forget,
    next_deadline,
    observe,
    planned,
)

P = BatchPolicy(timeout=60, idle=10, retry=30)


def test_idle_closes_a_quiet_window() -> None:
    w = observe(BatchWindow(), ["a"], 100, P)
    assert w.is_open and w.opened_at == 100
    assert not due(w, 109.9, P)
    assert due(observe(w, ["a"], 110, P), 110, P)


def test_arrivals_extend_idle_but_not_the_timeout() -> None:
    w = BatchWindow()
    for t in range(0, 70, 5):  # a new pod every 5 s keeps the window busy
        w = observe(w, [f"p{i}" for i in range(t // 5 + 1)], t, P)
        if t < 60:
            assert not due(w, t, P), t
    assert due(w, 60, P)
    assert next_deadline(w, P) == 60


def test_departed_members_leave_and_an_empty_window_closes() -> None:
    w = observe(BatchWindow(), ["a", "b"], 0, P)
    w = observe(w, ["b"], 3, P)
    assert w.members == {"b"} and w.last_arrival == 0  # a departure is no arrival
    w = observe(w, [], 4, P)
    assert not w.is_open and not due(w, 100, P)


def test_planned_pods_wait_for_retry_then_arrive_again() -> None:
    w = observe(BatchWindow(), ["a"], 0, P)
    w = planned(w, ["a"], 10)
    assert not w.is_open
    w = observe(w, ["a"], 20, P)
    assert not w.is_open  # still pending, but planned 10 s ago: no new window
    w = observe(w, ["a"], 40, P)
    assert w.is_open and w.opened_at == 40


def test_without_retry_planned_pods_never_arrive_again_but_new_ones_do() -> None:
    w = planned(observe(BatchWindow(), ["a"], 0, P), ["a"], 10)
    w = observe(w, ["a"], 1000, P, retry=False)
    assert not w.is_open  # an unchanged cluster: its plan would only repeat
    w = observe(w, ["a", "b"], 1001, P, retry=False)
    assert w.is_open and w.members == {"b"}  # a new pod arrives
    w = observe(w, ["a", "b"], 1002, P, retry=True)
    assert w.members == {"a", "b"}  # something changed: the old pod is retried


def test_a_new_pod_reopens_and_the_batch_can_include_old_ones() -> None:
    w = planned(observe(BatchWindow(), ["a"], 0, P), ["a"], 10)
    w = observe(w, ["a", "b"], 12, P)
    assert w.is_open and w.members == {"b"}


def test_forget_makes_a_pod_arrive_at_once() -> None:
    w = planned(observe(BatchWindow(), ["a"], 0, P), ["a"], 10)
    w = observe(forget(w, ["a"]), ["a"], 11, P)
    assert w.is_open and w.opened_at == 11


def test_restart_starts_empty_and_sees_every_pending_pod() -> None:
    w = observe(BatchWindow(), ["a", "b"], 500, P)
    assert w.members == {"a", "b"} and due(w, 510, P)


def test_bad_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        BatchPolicy(timeout=0)
