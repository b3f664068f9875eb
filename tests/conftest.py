"""Test-wide isolation of process state that the commands under test change.

``gpuslice agent``/``partitioner`` configure the root logger (:func:`contract.logs.configure`:
its handler and level) like the real processes do; without a reset, a later test in the same
process would see an earlier test's level and handler (aiohttp's access lines in a CLI's
stderr, say).  After each test the handlers ``configure`` added are removed and the root
level is put back; pytest's own capture handlers are left to pytest.  The heap a controller
froze is unfrozen.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator

import pytest

from contract.logs import LogHandler


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for h in [h for h in root.handlers if isinstance(h, LogHandler) and h not in before]:
        root.removeHandler(h)
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _heap_unfrozen() -> Iterator[None]:
    """The controller freezes the heap after its initial listing (partitioner.index.freeze_heap):
    in one test process that would keep every later test's garbage cycles alive."""
    yield
    gc.unfreeze()
