"""A relisting neither re-reads what the index holds already nor blocks the event loop (review
4, finding 2).

Relisting pods after a kopf watch gap parsed every pod again and ran on the event loop in one
piece: 3-8 s at 20,000-50,000 pods, while the same loop serves the admission webhook (5 s
timeout, failing open) and the Lease renewals.  Now an object listed at the resourceVersion the
index holds is skipped (the same object state), and :meth:`Controller.sync` folds the listing
in chunks, yielding to the loop in between; watch events folded in meanwhile stay guarded as
while the pages are read (tests/test_partitioner_relist_races.py).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kopf
import pytest
from test_partitioner_promises import MIG, applied_np, status_gpu
from test_partitioner_relist_races import _bound, _pod
from test_partitioner_snapshot import node

import partitioner.index as index_module
import partitioner.operator as operator_module
from partitioner.index import ClusterIndex
from partitioner.operator import Controller
from partitioner.settings import PartitionerSettings
from planner.catalog import default_catalog


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Keys of the pods :func:`partitioner.index._read_pod` reads from now on."""
    read: list[str] = []
    real = index_module._read_pod

    def counting(pod: Any, *args: Any, **kwargs: Any) -> Any:
        read.append(pod["metadata"]["name"])
        return real(pod, *args, **kwargs)

    monkeypatch.setattr(index_module, "_read_pod", counting)
    return read


def test_a_relisted_pod_held_at_its_resource_version_is_not_read_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pods = [_pod(f"p{i}", str(10 + i)) for i in range(50)] + [_bound("b", "90")]
    index = ClusterIndex.from_objects(default_catalog(), nodes=[node("n1", MIG)], pods=pods)
    nps = [applied_np("n1", status_gpu(0))]
    index.relist("partitionings", copy.deepcopy(nps), "100")
    version, waiting = index.version, [p.key for p in index.waiting()]
    read = _reads(monkeypatch)
    assert index.relist("pods", copy.deepcopy(pods), "100") == []
    assert index.relist("partitionings", copy.deepcopy(nps), "100") == []
    assert read == []
    assert index.version == version  # nothing changed
    assert [p.key for p in index.waiting()] == waiting
    # a changed pod is read; one gone is dropped; one of the same name and version but
    # another uid (not the pod held) is read too
    changed = _pod("p1", "200", nodeName="n1")
    other = _pod("p2", "12")
    other["metadata"]["uid"] = "uid-p2-again"
    listing = [changed, other, *copy.deepcopy(pods[3:])]
    assert index.relist("pods", listing, "300") == ["ns/p0"]
    assert read == ["p1", "p2"]
    assert index.pods["ns/p1"].node == "n1"
    assert index.pods["ns/p2"].uid == "uid-p2-again"


def _controller(items: list[dict[str, Any]]) -> Controller:
    c = Controller(
        PartitionerSettings(metrics_port=0, health_port=0),
        connection=kopf.ConnectionInfo(server="https://example.invalid"),
    )
    listed = {"pods": items}

    async def list_all(path: str, page_size: int = 500, **_: Any) -> dict[str, Any]:
        # answered at once: the pages were read (the loop was free meanwhile)
        kind = path.rsplit("/", 1)[-1]
        return {"metadata": {"resourceVersion": "5000"}, "items": listed.get(kind, [])}

    c.api.list_all = list_all  # type: ignore[method-assign]
    return c


def test_sync_yields_to_the_event_loop_while_it_folds_a_large_listing() -> None:
    n = 2000
    items = [_pod(f"p{i:05}", str(10 + i)) for i in range(n)]
    c = _controller(items)

    async def main() -> int:
        turns = 0
        done = asyncio.Event()

        async def probe() -> None:  # another task on the loop: the webhook, a Lease renewal
            nonlocal turns
            while not done.is_set():
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(probe())
        await asyncio.sleep(0)
        start = turns
        await c.sync(["pods"])
        ran = turns - start
        done.set()
        await task
        return ran

    ran = asyncio.run(main())
    assert len(c.index.pods) == n
    assert ran >= 5, ran  # the probe ran between the chunks (before: not once)
    assert getattr(operator_module, "RELIST_CHUNK", n) <= n // 5


def test_watch_events_folded_between_chunks_are_kept() -> None:
    """While the listing is folded chunk by chunk, kopf's watch reports a pod created after
    the snapshot, one deleted after it (listed in a later chunk) and one deleted after it
    (listed in an earlier chunk): the first stays, the others do not come back."""
    n = 1000
    items = [_pod(f"p{i:05}", str(10 + i)) for i in range(n)]
    c = _controller(items)
    early, late = items[1], items[-1]

    def deleted(pod: dict[str, Any]) -> dict[str, Any]:
        gone = copy.deepcopy(pod)
        gone["metadata"]["resourceVersion"] = "6000"
        return {"type": "DELETED", "object": gone}

    async def main() -> None:
        async def watch() -> None:
            for _ in range(2):  # after the first chunk
                await asyncio.sleep(0)
            c.observe("pods", {"type": "ADDED", "object": _pod("new", "5500")})
            c.observe("pods", deleted(late))
            c.observe("pods", deleted(early))

        task = asyncio.create_task(watch())
        await c.sync(["pods"])
        await task

    asyncio.run(main())
    assert "ns/new" in c.index.pods
    assert "ns/" + late["metadata"]["name"] not in c.index.pods
    assert "ns/" + early["metadata"]["name"] not in c.index.pods
    assert len(c.index.pods) == n - 2 + 1
