"""The DRA driver's ResourceSlice publisher and claim reader over real HTTP against kmock
(tests/fake_apiserver.py), with the official asyncio client.

Checked: the first publication creates the node's pool (counter slice + one device slice per
GPU) at generation 1 with the Node as owner; an unchanged node writes nothing; narrowing bumps
the generation, rewrites only through patches carrying the resourceVersion, and deletes the
slices of GPUs that publish nothing; another node's slices are never touched; an API server
that drops the counters (DRAPartitionableDevices off) is reported and nothing stays published;
a device published unusable carries the NoSchedule taint, whose ``timeAdded`` (stamped by the
server) is kept so an unchanged round writes nothing; an API server that drops taints
(DRADeviceTaints off) keeps the slices and is written without them from then on; the claim
reader returns claims and ``None`` for absent ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kmock
import kubernetes_validate
import pytest
from fake_apiserver import SLICE_RESOURCE, ApiServer, declare_dra

from node_agent.dra_publish import PublishError, SlicePublisher
from node_agent.dra_slices import DRIVER, UNUSABLE_TAINT_KEY, DraGpu, device_name, resource_slices
from node_agent.draplugin import KubeClaimReader
from planner.catalog import default_catalog

CAT = default_catalog()
H100 = CAT.model("H100-80GB")
GPUS = [DraGpu(i, f"GPU-{i:08d}-0000-0000-0000-000000000000", H100) for i in range(2)]
PATH = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


def slices(api: ApiServer, node: str | None = None) -> dict[str, dict[str, Any]]:
    out = {}
    for (resource, _ns, name), obj in list(api.objects.items()):
        if resource == kmock.resource(SLICE_RESOURCE) and not obj.deleted:
            raw = dict(obj.raw)
            if node is None or raw["spec"]["nodeName"] == node:
                out[name] = raw
    return out


def writes(api: ApiServer) -> list[tuple[str, str]]:
    return [(w.method, w.path.rsplit("/", 1)[-1]) for w in api.writes if PATH in w.path]


async def test_publish_creates_the_pool_then_narrows_it(
    kmock: ApiServer, connect: Callable[[str], Any]
) -> None:
    declare_dra(kmock)
    other = SlicePublisher(connect(str(kmock.url)), "node-b", GPUS[:1])
    await other.publish()
    pub = SlicePublisher(connect(str(kmock.url)), "node-a", GPUS, node_uid="uid-node-a")
    assert await pub.publish()
    mine = slices(kmock, "node-a")
    assert sorted(mine) == [
        "node-a-gpu.gpuslice.io-counters-0",
        "node-a-gpu.gpuslice.io-devices-gpu0",
        "node-a-gpu.gpuslice.io-devices-gpu1",
    ]
    for s in mine.values():
        assert s["spec"]["pool"] == {"name": "node-a", "generation": 1, "resourceSliceCount": 3}
        assert s["metadata"]["ownerReferences"][0]["uid"] == "uid-node-a"
        body = {k: v for k, v in s.items() if k != "metadata"} | {
            "metadata": {"name": s["metadata"]["name"]}
        }
        kubernetes_validate.validate(body, "1.36", strict=True)
    n = len(kmock.writes)
    assert not await pub.publish()  # unchanged: only a list
    assert len(kmock.writes) == n
    three = H100.profile("3g.40gb")
    want = {device_name(1, three, 0), device_name(1, three, 4)}
    assert await pub.publish(want)
    mine = slices(kmock, "node-a")
    # GPU 0 publishes nothing now: its slice stays, empty, so the pool keeps its slices and
    # names (a GPU withdrawn and back rewrote every slice of the node before)
    assert sorted(mine) == [
        "node-a-gpu.gpuslice.io-counters-0",
        "node-a-gpu.gpuslice.io-devices-gpu0",
        "node-a-gpu.gpuslice.io-devices-gpu1",
    ]
    assert mine["node-a-gpu.gpuslice.io-devices-gpu0"]["spec"].get("devices") in ([], None)
    assert {
        d["name"] for d in mine["node-a-gpu.gpuslice.io-devices-gpu1"]["spec"]["devices"]
    } == want
    generations = {s["spec"]["pool"]["generation"] for s in mine.values()}
    assert len(generations) == 1 and min(generations) > 1  # one complete pool, newer
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in mine.values()} == {3}
    assert "DELETE" not in {verb for verb, _ in writes(kmock)[n:]}
    assert len(slices(kmock, "node-b")) == 2  # never touched


async def test_a_server_that_drops_counters_is_refused(
    kmock: ApiServer, connect: Callable[[str], Any]
) -> None:
    declare_dra(kmock)
    kmock.drop_partitionable = True
    pub = SlicePublisher(connect(str(kmock.url)), "node-a", GPUS)
    with pytest.raises(PublishError, match="DRAPartitionableDevices"):
        await pub.publish()
    assert slices(kmock) == {}


def taints(api: ApiServer) -> dict[str, list[dict[str, Any]]]:
    return {
        d["name"]: d["taints"]
        for s in slices(api, "node-a").values()
        for d in s["spec"].get("devices") or ()
        if d.get("taints")
    }


async def test_an_unusable_device_is_tainted_and_its_stamp_kept(
    kmock: ApiServer, connect: Callable[[str], Any]
) -> None:
    declare_dra(kmock)
    three = H100.profile("3g.40gb")
    hit, beside = device_name(0, three, 4), device_name(0, three, 0)
    pub = SlicePublisher(connect(str(kmock.url)), "node-a", GPUS[:1])
    assert await pub.publish({hit, beside}, {hit: "xid"})
    (taint,) = taints(kmock)[hit]
    assert set(taints(kmock)) == {hit}
    assert taint["key"] == UNUSABLE_TAINT_KEY and taint["value"] == "xid"
    assert taint["effect"] == "NoSchedule" and taint["timeAdded"]  # stamped by the server
    for s in slices(kmock, "node-a").values():
        body = {k: v for k, v in s.items() if k != "metadata"} | {
            "metadata": {"name": s["metadata"]["name"]}
        }
        for version in ("1.34", "1.35", "1.36", "1.37"):
            kubernetes_validate.validate(body, version, strict=True)
    n = len(kmock.writes)
    assert not await pub.publish({hit, beside}, {hit: "xid"})  # the stored stamp carried over
    assert len(kmock.writes) == n
    assert await pub.publish({hit, beside}, {hit: "foreign"})  # another reason: a new taint
    assert taints(kmock)[hit][0]["value"] == "foreign"
    assert await pub.publish({hit, beside})  # usable again
    assert taints(kmock) == {} and pub.taints


async def test_a_server_that_drops_taints_keeps_the_slices_untainted(
    kmock: ApiServer, connect: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    declare_dra(kmock)
    kmock.drop_taints = True
    hit = device_name(0, H100.profile("3g.40gb"), 4)
    pub = SlicePublisher(connect(str(kmock.url)), "node-a", GPUS[:1])
    assert await pub.publish({hit}, {hit: "xid"})
    assert not pub.taints and "DRADeviceTaints" in caplog.text
    assert taints(kmock) == {}
    assert {d["name"] for s in slices(kmock).values() for d in s["spec"].get("devices") or ()} == {
        hit
    }
    n = len(kmock.writes)
    assert not await pub.publish({hit}, {hit: "xid"})  # no rewrite every round
    assert len(kmock.writes) == n


async def test_claim_reader(kmock: ApiServer, connect: Callable[[str], Any]) -> None:
    declare_dra(kmock)
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c1", "namespace": "team"},
        "spec": {"devices": {"requests": []}},
    }
    resp = await kmock.post("/apis/resource.k8s.io/v1/namespaces/team/resourceclaims", json=body)
    assert resp.status in (200, 201), await resp.text()
    reader = KubeClaimReader(connect(str(kmock.url)), request_timeout_s=5)
    got = await reader.read("team", "c1")
    assert got is not None and got["metadata"]["uid"]
    assert await reader.read("team", "absent") is None


async def test_driver_republishes_when_the_kubelet_registers_it_again(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A starting kubelet deletes its node's slices and registers the plugin again: the
    driver republishes at once, not at its next resync; stop removes the sockets."""
    import asyncio
    import os
    import tempfile

    from fake_dra_kubelet import FakeDraKubelet
    from fake_kubelet import eventually

    from node_agent.dra_driver import DraDriver
    from node_agent.dra_prepare import DraPreparer
    from node_agent.draplugin import DraKubeletPlugin
    from node_agent.health import AgentHealth
    from node_agent.nvml_fake import FakeNvml

    declare_dra(kmock)
    with tempfile.TemporaryDirectory(prefix="gsdrv-", dir="/tmp") as tmp:
        registry, plugins = os.path.join(tmp, "r"), os.path.join(tmp, "p")
        os.makedirs(registry)
        nv = FakeNvml([H100, H100])
        prep = DraPreparer(nv, CAT, node="node-a")
        api = connect(str(kmock.url))
        health = AgentHealth(resync_seconds=3600)

        plugin = DraKubeletPlugin(
            prep, KubeClaimReader(api), registry_dir=registry, plugin_dir=plugins
        )
        driver = DraDriver(
            plugin, SlicePublisher(api, "node-a", GPUS), resync_s=3600, health=health
        )
        stop = asyncio.Event()
        task = asyncio.create_task(driver.run(stop))
        kubelet = FakeDraKubelet(registry)
        try:
            # nothing is published before the kubelet registers the plugin (review5: claims
            # allocated here would never be prepared): the first round waits
            await eventually(lambda: driver.rounds == 1, what="the first round", timeout=30)
            assert slices(kmock) == {}
            await kubelet.scan()
            await eventually(
                lambda: driver.rounds == 2 and len(slices(kmock)) == 3,
                what="published on registration",
                timeout=30,
            )
            for name in list(slices(kmock)):  # the kubelet's start wipes the node's slices
                resp = await kmock.delete(f"{PATH}/{name}")
                assert resp.status == 200
            await kubelet.restart()
            await eventually(
                lambda: driver.rounds == 3 and len(slices(kmock)) == 3,
                what="republished",
                timeout=30,
            )
            assert driver.failures == 0 and health.check()[0]
            # a claim kube-scheduler allocated, read from the API by the plugin, prepared on NVML
            placement = device_name(1, H100.profile("3g.40gb"), 4)
            claim = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "train", "namespace": "team"},
                "spec": {"devices": {"requests": []}},
                "status": {"allocation": {"devices": {"results": [
                    {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": placement}
                ]}}},
            }  # fmt: skip
            resp = await kmock.post(
                "/apis/resource.k8s.io/v1/namespaces/team/resourceclaims", json=claim
            )
            assert resp.status in (200, 201), await resp.text()
            uid = (await resp.json())["metadata"]["uid"]
            if "status" not in await resp.json():  # the status subresource dropped it: set it
                resp = await kmock.patch(
                    "/apis/resource.k8s.io/v1/namespaces/team/resourceclaims/train/status",
                    json={"status": claim["status"]},
                )
                assert resp.status == 200, await resp.text()
            reply = await kubelet.prepare(DRIVER, ("team", "train", uid))
            assert reply[uid].error == ""
            assert [d.device_name for d in reply[uid].devices] == [placement]
            assert [(p.name, s) for p, s, _ in nv.layout(1)] == [("3g.40gb", 4)]
        finally:  # a failed check must not leave the servers running into the next tests
            stop.set()
            await asyncio.wait_for(task, 30)
            await kubelet.close()
        assert not os.path.exists(driver.plugin.registration_socket)
        await kubelet.close()


async def test_a_slice_deleted_during_a_round_is_created_again() -> None:
    """The kubelet's start may delete the node's slices between the publisher's list and its
    patch: the 404 makes it create the slice instead of failing the round."""
    from kubernetes_asyncio.client.exceptions import ApiException

    first = SlicePublisher(None, "node-a", GPUS[:1])._wanted(1, None)

    class Api:
        def __init__(self) -> None:
            self.objects = {s["metadata"]["name"]: s for s in first}
            self.calls: list[tuple[str, str]] = []

        async def list_cluster_custom_object(self, *a: Any, **k: Any) -> dict[str, Any]:
            return {"items": list(self.objects.values())}

        async def patch_cluster_custom_object(
            self, g: str, v: str, p: str, name: str, body: Any, **k: Any
        ) -> None:
            self.calls.append(("patch", name))
            raise ApiException(status=404, reason="NotFound")

        async def create_cluster_custom_object(
            self, g: str, v: str, p: str, body: Any, **k: Any
        ) -> None:
            self.calls.append(("create", body["metadata"]["name"]))
            self.objects[body["metadata"]["name"]] = body

        async def delete_cluster_custom_object(
            self, g: str, v: str, p: str, name: str, **k: Any
        ) -> None:
            self.calls.append(("delete", name))
            self.objects.pop(name, None)

    api = Api()
    pub = SlicePublisher(api, "node-a", GPUS[:1])
    assert await pub.publish({device_name(0)})  # one GPU narrowed: its slice alone
    devices = "node-a-gpu.gpuslice.io-devices-gpu0"
    assert api.calls == [("patch", devices), ("create", devices)]
    assert {s["spec"]["pool"]["generation"] for s in api.objects.values()} == {1}


async def test_one_gpu_narrowed_rewrites_its_slice_alone_at_the_same_generation(
    kmock: ApiServer, connect: Callable[[str], Any]
) -> None:
    """dra.md, consequence 2: narrowing one GPU rewrites one slice and leaves the counters
    alone.  Every slice was rewritten at a new generation, one write after another, and the
    scheduler skipped the node's pool until the last landed (fewer slices than
    resourceSliceCount at the newest generation).  A change of several slices still moves the
    whole pool to a new generation."""
    declare_dra(kmock)
    four = [DraGpu(i, f"GPU-{i:08d}-0000-0000-0000-000000000000", H100) for i in range(4)]
    pub = SlicePublisher(connect(str(kmock.url)), "node-a", four)
    every = {d["name"] for s in resource_slices("node-a", four, 1, None) for d in
             (s["spec"].get("devices") or ())}  # fmt: skip
    assert await pub.publish(every)
    three = H100.profile("3g.40gb")
    n = len(writes(kmock))
    assert await pub.publish(every - {device_name(2, three, 4)})
    assert writes(kmock)[n:] == [("PATCH", "node-a-gpu.gpuslice.io-devices-gpu2")]
    assert {s["spec"]["pool"]["generation"] for s in slices(kmock, "node-a").values()} == {1}
    n = len(writes(kmock))
    assert await pub.publish(every - {device_name(1, three, 4), device_name(3, three, 4)})
    assert len(writes(kmock)[n:]) == 5  # two GPUs changed: the pool moves to generation 2
    assert {s["spec"]["pool"]["generation"] for s in slices(kmock, "node-a").values()} == {2}


async def test_a_node_registered_again_owns_the_slices_written_after(
    kmock: ApiServer, connect: Callable[[str], Any]
) -> None:
    """``kubectl delete node`` and the kubelet registering it again give the Node a new UID:
    the garbage collector deletes slices owned by the old one, and the pool written again must
    name the new owner (read before each writing round, never on a round that writes nothing),
    or it is collected again, round after round."""
    declare_dra(kmock)
    uid = ["uid-first"]
    reads: list[str] = []

    async def reader() -> str | None:
        reads.append(uid[0])
        return uid[0]

    pub = SlicePublisher(
        connect(str(kmock.url)), "node-a", GPUS, node_uid="uid-first", node_uid_reader=reader
    )
    assert await pub.publish()
    assert not await pub.publish()
    assert reads == ["uid-first"]  # the unchanged round read nothing
    uid[0] = "uid-second"
    for name in slices(kmock, "node-a"):  # what the garbage collector does
        kmock.objects[(kmock.resource(SLICE_RESOURCE), None, name)].delete()
    assert await pub.publish()
    owners = {s["metadata"]["ownerReferences"][0]["uid"] for s in slices(kmock, "node-a").values()}
    assert owners == {"uid-second"}
    # a GPU narrowed later is patched with the owner of that moment too
    uid[0] = "uid-third"
    three = H100.profile("3g.40gb")
    assert await pub.publish({device_name(1, three, 0)})
    owners = {s["metadata"]["ownerReferences"][0]["uid"] for s in slices(kmock, "node-a").values()}
    assert owners == {"uid-third"}
    assert reads == ["uid-first", "uid-second", "uid-third"]


def test_slice_names_of_a_long_node_name_stay_valid_and_unique() -> None:
    """Node names may have 253 characters; ``<node>-gpu.gpuslice.io-devices-gpu<i>`` went over
    the 253 an object name may have, and the API server refused every slice of the node."""
    from node_agent.dra_slices import MAX_OBJECT_NAME, resource_slices

    long_a = "n" * 200 + "." + "a" * 41  # 242 characters
    long_b = "n" * 200 + "." + "b" * 41
    names = {
        node: [s["metadata"]["name"] for s in resource_slices(node, GPUS, 1, None)]
        for node in (long_a, long_b, "node-a")
    }
    for node, ns in names.items():
        assert all(len(n) <= MAX_OBJECT_NAME for n in ns), node
        assert len(set(ns)) == len(ns)
    assert not set(names[long_a]) & set(names[long_b])  # the hash tells them apart
    assert names["node-a"][0] == "node-a-gpu.gpuslice.io-counters-0"  # short names unchanged
