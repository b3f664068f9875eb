"""A clock the test sets by hand: pass it where the code takes ``clock: Callable[[], float]``."""

from __future__ import annotations


class ManualClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
