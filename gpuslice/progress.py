"""Progress of a long command on stderr, drawn only where someone watches it.

Model: :class:`Progress` counts ``done`` out of ``total`` steps with a label for the current
step.  Where it draws depends on its stream (stderr):

* a terminal: a rich progress bar (bar, percentage, elapsed time, label), redrawn in place at
  most every 0.1 s and left on screen, complete, when the command ends;
* anything else -- a file, a pipe, a CI log: no control characters at all, only a plain line
  ``<what>: 40% (<label>), 12 s`` every ``interval_s`` (default 30 s), so a long run in a
  log still shows it is alive and a short one adds nothing;
* ``enabled=False`` (the commands' ``--quiet``): nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """See the module docstring.  Use as a context manager, or call :meth:`close`."""

    def __init__(
        self,
        what: str,
        total: int = 1,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.total = max(1, total)
        self.done = 0
        self.label = ""
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.interval_s = interval_s
        self._clock = clock
        self._started = clock()
        self._last_line = self._started
        self._last_draw = float("-inf")
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(enabled and isatty is not None and isatty())
        self._bar: Any = None
        self._task: Any = None
        if self.tty:
            self._start_bar()

    def _start_bar(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import (
            Progress as RichProgress,
        )

        console = Console(file=self.stream, force_terminal=True, highlight=False, emoji=False)
        self._bar = RichProgress(
            TextColumn("{task.fields[what]}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}", markup=False),
            console=console,
            auto_refresh=False,
        )
        self._bar.start()
        self._task = self._bar.add_task("", total=self.total, what=self.what)

    def set_total(self, total: int) -> None:
        """A new total (the steps became known); ``done`` is kept."""
        self.total = max(1, total)
        if self._bar is not None:
            self._bar.update(self._task, total=self.total)

    def update(self, done: int, label: str | None = None) -> None:
        """``done`` steps of :attr:`total` are finished; ``label`` names the current one."""
        self.done = min(max(0, done), self.total)
        if label is not None:
            self.label = label
        if not self.enabled:
            return
        now = self._clock()
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=self.label)
            if now - self._last_draw >= 0.1 or self.done == self.total:
                self._last_draw = now
                self._bar.refresh()
        elif now - self._last_line >= self.interval_s:
            self._last_line = now
            pct = 100 * self.done // self.total
            label = f" ({self.label})" if self.label else ""
            print(f"{self.what}: {pct}%{label}, {now - self._started:.0f} s", file=self.stream,
                  flush=True)  # fmt: skip

    def close(self, complete: bool = True) -> None:
        """Finish: a terminal's bar is left on screen (drawn complete unless ``complete`` is
        false: the command failed); elsewhere nothing more is written."""
        if self._bar is not None:
            if complete:
                self._bar.update(self._task, completed=self.total)
            self._bar.refresh()
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.close(complete=exc_type is None)
