"""Two asyncio idioms the agent's loops share: wait for the first of several waits, and
cancel a background task, each leaving no task behind."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

__all__ = ["cancel", "first_of"]


async def first_of(*waits: Awaitable[Any], timeout: float | None = None) -> None:
    """Return when the first of ``waits`` completes, or after ``timeout`` seconds; the others
    are cancelled and awaited, so no task outlives the call.  A wait's exception is not
    raised here (the caller's next round looks again)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


async def cancel(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
