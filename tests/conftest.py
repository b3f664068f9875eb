"""Test-wide isolation of process state that the commands under test change.

``gpuslice agent``/``partitioner`` configure the root logger (:func:`contract.logs.configure`:
its handler and level) like the real processes do; without a reset, a later test in the same
process would see an earlier test's level and handler (aiohttp's access lines in a CLI's
stderr, say).  After each test the handlers ``configure`` added are removed and the root
level is put back; pytest's own capture handlers are left to pytest.  The heap a controller
froze is unfrozen.  ``connect`` gives tests a Kubernetes client for a fake API server.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

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
    """The controller freezes the heap after its initial listing and after its steps
    (partitioner.heap.HeapKeeper): in one test process that would keep every later test's
    garbage cycles alive."""
    yield
    gc.unfreeze()


@pytest.fixture
async def connect() -> AsyncIterator[Callable[[str], Any]]:
    """``connect(url)``: a kubernetes_asyncio CustomObjectsApi for a fake API server at
    ``url``; its ApiClient is closed after the test."""
    from kubernetes_asyncio import client as kclient

    clients: list[Any] = []

    def custom_objects(url: str) -> Any:
        api_client = kclient.ApiClient(kclient.Configuration(host=url.rstrip("/")))
        clients.append(api_client)
        return kclient.CustomObjectsApi(api_client)

    yield custom_objects
    for api_client in clients:
        await api_client.close()
