"""The writer's eviction of a stranded pod (:class:`~partitioner.actions.EvictPod`) on the wire.

Against the fake API server, which serves ``pods/<name>/eviction`` as the API server does for a
pod that has not started: a pod read at the resourceVersion the eviction names is deleted and
its Event posted; one changed since (it bound after all) or replaced by a pod of the same name
answers 409 and stays, with no Event; one already gone answers 404 and is listed as gone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from fake_apiserver import ApiServer, declare, stored

from partitioner.actions import EmitEvent, EvictPod, ObjectRef
from partitioner.kubeapi import Endpoint, KubeApi
from partitioner.writer import execute

PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


@pytest.fixture
async def client(kmock: ApiServer) -> AsyncIterator[KubeApi]:
    declare(kmock)
    endpoint = Endpoint(str(kmock.url).rstrip("/"), {"Authorization": "Bearer partitioner"})
    kube = KubeApi(lambda: endpoint)
    yield kube
    await kube.close()


async def created(api: ApiServer, name: str) -> dict[str, Any]:
    resp = await api.post(PODS, json={"metadata": {"name": name}, "spec": {"containers": []}})
    assert resp.status in (200, 201), await resp.text()
    obj = stored(api, "v1/pods", name, "default")
    assert obj is not None
    return {"uid": obj["metadata"]["uid"], "rv": obj["metadata"]["resourceVersion"]}


def evict(name: str, uid: str, rv: str | None) -> EvictPod:
    ref = ObjectRef("Pod", name, "default", uid)
    told = EmitEvent(ref, "Warning", "StrandedEvicted", "evicted")
    return EvictPod(f"default/{name}", ref, rv, (told,))


def reasons(api: ApiServer) -> list[str]:
    return [
        obj["reason"]
        for (res, _ns, _n), obj in api.objects.items()
        if res == api.resource("v1/events") and not obj.deleted
    ]


async def test_a_pod_as_read_is_evicted_and_its_event_posted(
    kmock: ApiServer, client: KubeApi
) -> None:
    p = await created(kmock, "p")
    out = await execute(client, [evict("p", p["uid"], p["rv"])])
    assert out.evicted == ["default/p"] and out.gone_pods == [("default/p", p["uid"])]
    assert stored(kmock, "v1/pods", "p", "default") is None
    assert reasons(kmock) == ["StrandedEvicted"]
    (write,) = [w for w in kmock.writes if w.path.endswith("/eviction")]
    assert (write.author, write.method) == ("partitioner", "POST")


async def test_a_pod_changed_since_or_replaced_is_kept(kmock: ApiServer, client: KubeApi) -> None:
    p = await created(kmock, "p")
    resp = await kmock.patch(f"{PODS}/p", json={"metadata": {"labels": {"bound": "soon"}}})
    assert resp.status == 200
    out = await execute(client, [evict("p", p["uid"], p["rv"])])  # the rv it was read at
    assert not out.evicted and out.pod_refusals["default/p"].startswith("409")
    assert stored(kmock, "v1/pods", "p", "default") is not None
    out = await execute(client, [evict("p", "another-pods-uid", None)])  # same name, new pod
    assert not out.evicted and out.pod_refusals["default/p"].startswith("409")
    assert stored(kmock, "v1/pods", "p", "default") is not None
    assert reasons(kmock) == []


async def test_a_pod_already_gone_is_listed_as_gone(kmock: ApiServer, client: KubeApi) -> None:
    out = await execute(client, [evict("p", "uid-p", "7")])
    assert not out.evicted and out.gone_pods == [("default/p", "uid-p")]
    assert out.pod_refusals["default/p"].startswith("404") and reasons(kmock) == []
