"""Planner-shaped publishing of the DRA agent (node_agent.dra_shape, node_agent.dra_driver),
against kmock (tests/fake_apiserver.py, real HTTP, the official asyncio client) and the fake NVML.

Checked: with a NodePartitioning spec, exactly the spec's placements plus the allocated
devices of this pool (claims of every namespace, and prepared ones) are published, the whole
GPU where the spec plans nothing, everything whole without a NodePartitioning; an allocated
device the new spec drops stays published and is reported used; the status carries
observedGeneration, planId, Applied and the used flags, a GPU held whole is reported as its
full-size profile, the partitioner's reservations are left alone and an unchanged status is not
rewritten; unprepare keeps an idle instance at a planned placement and the next claim adopts it
without creating one (NVML creates counted), while an unplanned one is destroyed; an idle
instance the spec drops is destroyed by the next round, a used or claimed one never; the
start-up clean-up keeps planned idle instances; a round makes the planned instances that are
missing before it publishes them (never beside an allocated or used one); a spec change wakes
the loop; mode ``all``
publishes every placement and writes no status; an invalid ``--dra-publish`` exits 2.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import kmock
import pytest
from fake_apiserver import NP_PATH, SLICE_RESOURCE, ApiServer, declare, declare_dra

from node_agent.agent import KubeSpecSource
from node_agent.dra_checkpoint import Checkpoint
from node_agent.dra_claims import AllocatedDevice, ClaimError, ClaimRef
from node_agent.dra_driver import DraDriver
from node_agent.dra_prepare import DraPreparer
from node_agent.dra_publish import SlicePublisher
from node_agent.dra_shape import ShapeApi, planned_devices
from node_agent.dra_slices import DRIVER, UNUSABLE_TAINT_KEY, DraGpu, device_name, whole_gpu_profile
from node_agent.draplugin import DraKubeletPlugin, KubeClaimReader
from node_agent.nvml_fake import FakeNvml
from planner.catalog import default_catalog

CAT = default_catalog()
H100 = CAT.model("H100-80GB")
NODE = "node-a"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"


def p(gpu: int, profile: str, start: int, model: Any = H100) -> str:
    return device_name(gpu, model.profile(profile), start)


class CountingNvml(FakeNvml):
    """The fake NVML, counting GPU-instance creations."""

    creates = 0

    def create_gpu_instance(self, gpu: int, profile_id: int, start: int, size: int) -> int:
        self.creates += 1
        return super().create_gpu_instance(gpu, profile_id, start, size)


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


def devices_of(api: ApiServer, node: str = NODE) -> Iterator[dict[str, Any]]:
    """The devices of ``node``'s ResourceSlices as stored."""
    for (resource, _ns, _name), obj in list(api.objects.items()):
        if resource == kmock.resource(SLICE_RESOURCE) and not obj.deleted:
            spec = dict(obj.raw)["spec"]
            if spec["nodeName"] == node:
                yield from spec.get("devices") or ()


def published(api: ApiServer, node: str = NODE) -> set[str]:
    return {d["name"] for d in devices_of(api, node)}


def tainted(api: ApiServer, node: str = NODE) -> dict[str, str]:
    """Published device -> the value of its ``NoSchedule`` unusable taint."""
    out: dict[str, str] = {}
    for d in devices_of(api, node):
        for t in d.get("taints") or ():
            assert t["key"] == UNUSABLE_TAINT_KEY and t["effect"] == "NoSchedule"
            out[d["name"]] = t["value"]
    return out


def np_of(api: ApiServer, name: str = NODE) -> dict[str, Any]:
    obj = api.objects[kmock.resource("gpuslice.io/v1alpha1/nodepartitionings"), None, name]
    return dict(obj.raw)


def spec(plan: str, gpus: dict[int, list[tuple[str, int]]]) -> dict[str, Any]:
    return {
        "planId": plan,
        "mode": "mig",
        "gpus": [
            {"index": i, "mig": [{"profile": pr, "start": s} for pr, s in mig]}
            for i, mig in gpus.items()
        ],
    }


async def put_np(api: ApiServer, body: dict[str, Any], name: str = NODE) -> None:
    obj = {
        "apiVersion": "gpuslice.io/v1alpha1",
        "kind": "NodePartitioning",
        "metadata": {"name": name},
        "spec": body,
    }
    resp = await api.post(NP_PATH, json=obj)
    assert resp.status in (200, 201), await resp.text()


async def patch_spec(api: ApiServer, body: dict[str, Any], name: str = NODE) -> None:
    resp = await api.patch(f"{NP_PATH}/{name}", json={"spec": body})
    assert resp.status == 200, await resp.text()


async def put_claim(
    api: ApiServer, name: str, devices: list[str], *, pool: str = NODE, ns: str = "team",
    driver: str = DRIVER,
) -> str:  # fmt: skip
    results = [
        {"request": f"r{n}", "driver": driver, "pool": pool, "device": d}
        for n, d in enumerate(devices)
    ]
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": results}}},
    }
    resp = await api.post(CLAIMS.format(ns=ns), json=body)
    assert resp.status in (200, 201), await resp.text()
    got = await resp.json()
    assert got["status"]["allocation"]["devices"]["results"] == results
    return str(got["metadata"]["uid"])


async def drop_claim(api: ApiServer, name: str, ns: str = "team") -> None:
    resp = await api.delete(f"{CLAIMS.format(ns=ns)}/{name}")
    assert resp.status == 200, await resp.text()


def setup(
    api: ApiServer, connect: Callable[[str], Any], nv: FakeNvml, tmp: str, *, shaped: bool = True,
    **kw: Any,
) -> DraDriver:  # fmt: skip
    declare(api)
    declare_dra(api)
    client = connect(str(api.url))
    prep = DraPreparer(nv, CAT, node=NODE, checkpoint=Checkpoint(None))
    gpus = [DraGpu(i, nv.gpu_uuid(i), m) for i, m in sorted(prep.models.items())]
    plugin = DraKubeletPlugin(
        prep,
        KubeClaimReader(client),
        registry_dir=os.path.join(tmp, "r"),
        plugin_dir=os.path.join(tmp, "p"),
    )
    plugin.registered = True  # as by the kubelet: an unregistered plugin publishes nothing
    return DraDriver(
        plugin,
        SlicePublisher(client, NODE, gpus),
        resync_s=3600,
        spec_source=KubeSpecSource(NODE, client, request_timeout_s=5) if shaped else None,
        claims=ShapeApi(client, NODE, request_timeout_s=5) if shaped else None,
        **kw,
    )


async def round_ok(driver: DraDriver) -> None:
    assert await driver.publish_once(), "the round failed"


async def assert_mode_all_hides(
    api: ApiServer,
    driver: DraDriver,
    *,
    every: set[str],
    gpu0: set[str],
    held: str,
    hit: set[str],
    reason: str,
    taints_kept: bool,
) -> None:
    """Mode ``all`` after devices of GPU 0 turned unusable (``hit``, for ``reason``) beside a
    prepared device ``held``: never withdrawn; where the server keeps taints everything stays
    published and exactly ``hit`` is tainted, else GPU 0 is withdrawn but ``held``; and a
    second round writes nothing (settled)."""
    assert held in published(api)  # prepared: never withdrawn
    if taints_kept:
        assert driver.publisher.taints
        assert published(api) == every  # nothing withdrawn: the rest of GPU 0 serves on
        assert tainted(api) == dict.fromkeys(hit, reason)
    else:
        assert not driver.publisher.taints
        assert tainted(api) == {}
        assert published(api) == (every - gpu0) | {held}  # GPU 1 untouched
    writes = len(api.writes)
    await round_ok(driver)
    assert len(api.writes) == writes  # settled: no rewrite every round


def mig_status(api: ApiServer) -> dict[int, list[tuple[str, int, bool]]]:
    return {
        g["index"]: [(m["profile"], m["start"], m["used"]) for m in g["mig"]]
        for g in np_of(api)["status"]["gpus"]
    }


def conditions(api: ApiServer) -> dict[str, tuple[str, str, int]]:
    return {
        c["type"]: (c["status"], c["reason"], c["observedGeneration"])
        for c in np_of(api)["status"]["conditions"]
    }


# -- what is published, what is reported ----------------------------------------------------


async def test_spec_placements_plus_allocated_whole_gpu_elsewhere_and_the_status(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Any
) -> None:
    nv = FakeNvml([H100, H100, H100])
    driver = setup(kmock, connect, nv, str(tmp_path))
    await put_np(kmock, spec("plan-1", {0: [("3g.40gb", 0), ("3g.40gb", 4)], 1: []}))
    await put_claim(kmock, "small", [p(2, "1g.10gb", 6)], ns="a")
    await put_claim(kmock, "elsewhere", [p(1, "7g.80gb", 0)], pool="node-b", ns="b")
    await put_claim(kmock, "other-driver", [p(1, "3g.40gb", 0)], driver="x.example.com", ns="b")
    # the status the partitioner keeps on the object: never overwritten by the agent
    resp = await kmock.patch(
        f"{NP_PATH}/{NODE}/status",
        json={"status": {"reservations": [{"pod": "team/w", "state": "planned"}]}},
    )
    assert resp.status == 200, await resp.text()
    await round_ok(driver)
    assert published(kmock) == {
        p(0, "3g.40gb", 0),
        p(0, "3g.40gb", 4),
        "gpu1",  # listed without instances: whole
        "gpu2",  # not listed: whole
        p(2, "1g.10gb", 6),  # allocated on this pool
    }
    np = np_of(kmock)
    status = np["status"]
    assert status["observedGeneration"] == np["metadata"]["generation"] == 1
    assert status["planId"] == "plan-1"
    assert conditions(kmock) == {
        "Applied": ("True", "Applied", 1),
        "Degraded": ("False", "AsExpected", 1),
    }
    assert mig_status(kmock) == {
        0: [("3g.40gb", 0, False), ("3g.40gb", 4, False)],
        1: [],
        2: [("1g.10gb", 6, True)],
    }
    assert [g["uuid"] for g in status["gpus"]] == [nv.gpu_uuid(i) for i in range(3)]
    # as NVML reads it (review5): on where the round made the planned instances, else off
    assert [g["migEnabled"] for g in status["gpus"]] == [True, False, False]
    assert {g["model"] for g in status["gpus"]} == {"H100-80GB"}
    assert status["reservations"] == [{"pod": "team/w", "state": "planned"}]
    writes = driver.status_writes
    await round_ok(driver)  # nothing changed: no status write
    assert driver.status_writes == writes == 1


async def test_an_allocated_device_the_new_spec_drops_stays_published_and_used(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Any
) -> None:
    nv = FakeNvml([H100, H100])
    driver = setup(kmock, connect, nv, str(tmp_path))
    await put_np(kmock, spec("plan-1", {0: [("3g.40gb", 0), ("3g.40gb", 4)]}))
    await round_ok(driver)
    await put_claim(kmock, "train", [p(0, "3g.40gb", 4)])
    await put_claim(kmock, "whole", ["gpu1"])
    await patch_spec(kmock, spec("plan-2", {0: [("7g.80gb", 0)]}))  # overlaps the claim
    await round_ok(driver)
    assert published(kmock) == {p(0, "7g.80gb", 0), p(0, "3g.40gb", 4), "gpu1"}
    status = np_of(kmock)["status"]
    assert status["observedGeneration"] == 2 and status["planId"] == "plan-2"
    assert conditions(kmock)["Applied"] == ("True", "Applied", 2)
    # the planned 7g overlaps the allocated 3g: not free (not reported) until the claim goes,
    # so the status stays a valid layout
    assert mig_status(kmock) == {
        0: [("3g.40gb", 4, True)],
        1: [("7g.80gb", 0, True)],  # held whole: the full-size profile, used
    }
    assert layout(nv, 0) == {("3g.40gb", 4)}  # the 7g is not made beside the claimed 3g
    await drop_claim(kmock, "train")
    await round_ok(driver)
    assert published(kmock) == {p(0, "7g.80gb", 0), "gpu1"}
    assert mig_status(kmock)[0] == [("7g.80gb", 0, False)]
    assert layout(nv, 0) == {("7g.80gb", 0)}  # the idle 3g destroyed, the planned 7g made


async def test_no_nodepartitioning_publishes_whole_gpus_and_writes_no_status(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Any
) -> None:
    driver = setup(kmock, connect, FakeNvml([H100, H100]), str(tmp_path))
    await put_claim(kmock, "c", [p(1, "2g.20gb", 2)])
    await round_ok(driver)
    assert published(kmock) == {"gpu0", "gpu1", p(1, "2g.20gb", 2)}
    assert driver.status_writes == 0
    assert not [w for w in kmock.writes if "nodepartitionings" in w.path]


async def test_an_invalid_placement_is_skipped_and_reported(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Any
) -> None:
    driver = setup(kmock, connect, FakeNvml([H100]), str(tmp_path))
    await put_np(kmock, spec("p", {0: [("3g.40gb", 0), ("3g.40gb", 2), ("5g.50gb", 0)]}))
    await round_ok(driver)
    assert published(kmock) == {p(0, "3g.40gb", 0)}
    got = conditions(kmock)
    assert got["Degraded"] == ("True", "InvalidPlacement", 1)
    assert got["Applied"] == ("False", "Degraded", 1)
    planned, skipped = planned_devices([DraGpu(0, "u", H100)], None)
    assert planned == {0: []} and skipped == []


def test_the_whole_gpu_profile_covers_every_memory_slot() -> None:
    names = {
        m: getattr(whole_gpu_profile(CAT.model(m)), "name", None)
        for m in ("H100-80GB", "A30-24GB", "A100-SXM4-80GB")
    }
    assert names == {"H100-80GB": "7g.80gb", "A30-24GB": "4g.24gb", "A100-SXM4-80GB": "7g.80gb"}
    assert whole_gpu_profile(CAT.model("T4")) is None  # no MIG


# -- instances kept, adopted, destroyed -----------------------------------------------------


def ref(n: int) -> ClaimRef:
    return ClaimRef("team", f"c{n}", f"uid-{n}")


def alloc(device: str) -> list[AllocatedDevice]:
    return [AllocatedDevice("gpu", NODE, device)]


def layout(nv: FakeNvml, gpu: int = 0) -> set[tuple[str, int]]:
    return {(pr.name, s) for pr, s, _ in nv.layout(gpu)}


def test_unprepare_keeps_a_planned_instance_and_the_next_claim_adopts_it() -> None:
    nv = CountingNvml([H100])
    prep = DraPreparer(nv, CAT, node=NODE)
    planned, other = p(0, "3g.40gb", 4), p(0, "2g.20gb", 0)
    prep.planned = frozenset({planned})
    (first,) = prep.prepare(ref(1), alloc(planned))
    prep.prepare(ref(2), alloc(other))
    assert nv.creates == 2
    prep.unprepare("uid-1")
    prep.unprepare("uid-2")
    assert layout(nv) == {("3g.40gb", 4)}  # planned: kept, idle, owned by no claim
    assert len(prep.checkpoint) == 0
    (again,) = prep.prepare(ref(3), alloc(planned))
    assert nv.creates == 2  # adopted, not created
    assert again.uuid == first.uuid and set(nv.mig_uuids()) == {first.uuid}
    # a planned instance that runs processes is not released (the kubelet retries)
    g, gi, ci = nv.mig_uuids()[again.uuid]
    pid = nv.start_process(g, gi, ci)
    with pytest.raises(ClaimError, match="still runs processes"):
        prep.unprepare("uid-3")
    nv.stop_process(pid)
    # publishing every placement (planned None): destroyed at unprepare, as before
    prep.planned = None
    prep.unprepare("uid-3")
    assert layout(nv) == set()


def test_the_start_up_clean_up_keeps_planned_idle_instances() -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    made = {}
    for name, start in (("3g.40gb", 0), ("1g.10gb", 4), ("1g.10gb", 5)):
        prof = H100.profile(name)
        gi = nv.create_gpu_instance(0, prof.profile_id, start, prof.memory_slices)
        made[(name, start)] = (gi, nv.create_compute_instance(0, gi))
    gi, ci = made[("1g.10gb", 5)]
    nv.start_process(0, gi, ci)  # an unplanned instance in use
    prep = DraPreparer(nv, CAT, node=NODE)
    prep.planned = frozenset({p(0, "3g.40gb", 0)})
    assert len(prep.clean_unknown()) == 1  # the used one, reported
    assert layout(nv) == {("3g.40gb", 0), ("1g.10gb", 5)}
    prep.planned = None  # without shaping (or an unreadable spec): every idle one goes
    prep.clean_unknown()
    assert layout(nv) == {("1g.10gb", 5)}


async def test_idle_instances_the_spec_drops_are_destroyed_used_and_claimed_ones_never(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Any
) -> None:
    nv = CountingNvml([H100, H100])
    driver = setup(kmock, connect, nv, str(tmp_path))
    prep = driver.preparer
    keep, drop = p(0, "3g.40gb", 0), p(0, "3g.40gb", 4)
    await put_np(kmock, spec("p1", {0: [("3g.40gb", 0), ("3g.40gb", 4)], 1: [("4g.40gb", 0)]}))
    await round_ok(driver)
    # claims on both planned placements of GPU 0, then released: their instances stay
    for n, d in enumerate((keep, drop)):
        prep.prepare(ref(n), alloc(d))
        prep.unprepare(f"uid-{n}")
    assert layout(nv, 0) == {("3g.40gb", 0), ("3g.40gb", 4)}
    # GPU 1: a claimed instance and an instance running processes outside any claim
    claimed = p(1, "4g.40gb", 0)
    prep.prepare(ref(7), alloc(claimed))
    prof = H100.profile("1g.10gb")
    gi = nv.create_gpu_instance(1, prof.profile_id, 6, 1)
    ci = nv.create_compute_instance(1, gi)
    nv.start_process(1, gi, ci)
    await round_ok(driver)
    assert driver.idle_destroyed == 0
    # the new spec drops one placement of GPU 0 and every one of GPU 1
    await patch_spec(kmock, spec("p2", {0: [("3g.40gb", 0)]}))
    await round_ok(driver)
    assert layout(nv, 0) == {("3g.40gb", 0)} and driver.idle_destroyed == 1
    assert layout(nv, 1) == {("4g.40gb", 0), ("1g.10gb", 6)}  # claimed, used: never
    # the prepared claim is published (from the checkpoint) though the API lists no claim;
    # the whole GPU 1 is not: it shares a memory slot with the busy 1g@6, reported used
    # (tests/test_agent_dra_foreign.py)
    assert published(kmock) == {keep, claimed}
    assert mig_status(kmock)[1] == [("4g.40gb", 0, True), ("1g.10gb", 6, True)]
    before = nv.creates
    prep.prepare(ref(8), alloc(keep))
    assert nv.creates == before  # the kept instance is adopted


# -- the loop ---------------------------------------------------------------------------------


async def test_the_loop_keeps_planned_instances_at_start_and_follows_spec_changes(
    kmock: ApiServer, connect: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    from fake_kubelet import eventually

    nv = FakeNvml([H100], mig_enabled=True)
    for name, start in (("3g.40gb", 0), ("3g.40gb", 4)):
        prof = H100.profile(name)
        nv.create_compute_instance(
            0, nv.create_gpu_instance(0, prof.profile_id, start, prof.memory_slices)
        )
    with tempfile.TemporaryDirectory(prefix="gsshp-", dir="/tmp") as tmp:
        driver = setup(kmock, connect, nv, tmp, spec_poll_s=0.05)
        await put_np(kmock, spec("p1", {0: [("3g.40gb", 0)]}))
        stop = asyncio.Event()
        task = asyncio.create_task(driver.run(stop))
        try:
            await eventually(lambda: driver.rounds >= 1, what="first round", timeout=20)
            assert driver.failures == 0, caplog.text[-3000:]
            assert layout(nv) == {("3g.40gb", 0)}  # the start-up clean-up kept the planned one
            assert published(kmock) == {p(0, "3g.40gb", 0)}
            rounds = driver.rounds
            await patch_spec(kmock, spec("p2", {0: [("3g.40gb", 4), ("2g.20gb", 0)]}))
            # the status write is the round's last await: the round counts as finished only
            # when publish_once returns, so wait for both rather than read rounds in between
            await eventually(
                lambda: (
                    np_of(kmock).get("status", {}).get("observedGeneration") == 2
                    and driver.rounds > rounds
                ),
                what="the new spec published and its round finished",
                timeout=20,
            )
            assert published(kmock) == {p(0, "3g.40gb", 4), p(0, "2g.20gb", 0)}
            assert driver.failures == 0, caplog.text[-3000:]
            # the dropped 3g@0 destroyed, the new placements made before they were published
            assert layout(nv) == {("3g.40gb", 4), ("2g.20gb", 0)}
            assert driver.idle_destroyed == 1 and driver.planned_created == 2
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)


async def test_mode_all_publishes_every_placement_and_writes_no_status(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Any
) -> None:
    nv = CountingNvml([H100])
    driver = setup(kmock, connect, nv, str(tmp_path), shaped=False)
    await put_np(kmock, spec("p1", {0: [("3g.40gb", 0)]}))
    await round_ok(driver)
    assert published(kmock) == set(driver.preparer.targets)
    assert len(published(kmock)) > 10
    assert "status" not in np_of(kmock)
    assert driver.preparer.planned is None
    driver.preparer.prepare(ref(1), alloc(p(0, "3g.40gb", 0)))
    driver.preparer.unprepare("uid-1")
    assert layout(nv) == set()  # destroyed at unprepare, as before


# -- the command line -------------------------------------------------------------------------


def test_an_invalid_dra_publish_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuslice.cli import main
    from node_agent.settings import AgentSettings

    monkeypatch.setenv("GPUSLICE_METRICS_PORT", "0")
    monkeypatch.setenv("GPUSLICE_NODE_NAME", "n1")
    assert main(["agent", "--dra", "--dra-publish", "most"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "--dra-publish 'most': expected shaped or all" in err
    assert main(["agent", "--fake", "--dra-publish", "all"]) == 2
    assert "--dra-publish is for DRA mode" in capsys.readouterr().err
    monkeypatch.setenv("GPUSLICE_DRA_PUBLISH", "most")
    assert main(["agent", "--dra"]) == 2
    assert "dra_publish" in capsys.readouterr().err
    monkeypatch.setenv("GPUSLICE_DRA_PUBLISH", "all")
    assert AgentSettings().dra_publish == "all"  # type: ignore[call-arg]
    monkeypatch.delenv("GPUSLICE_DRA_PUBLISH")
    assert AgentSettings().dra_publish == "shaped"  # type: ignore[call-arg]


async def test_a_round_makes_the_planned_instances_before_publishing_and_prepare_adopts_them(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Any
) -> None:
    nv = CountingNvml([H100, H100])  # MIG off: the round switches the idle GPU on
    driver = setup(kmock, connect, nv, str(tmp_path))
    await put_np(kmock, spec("p1", {0: [("3g.40gb", 0), ("3g.40gb", 4)], 1: [("4g.40gb", 0)]}))
    await put_claim(kmock, "old", [p(1, "2g.20gb", 2)])  # allocated from an older generation
    await round_ok(driver)
    assert layout(nv, 0) == {("3g.40gb", 0), ("3g.40gb", 4)}
    assert layout(nv, 1) == set()  # the 4g would overlap the allocated 2g: left to prepare
    assert nv.creates == 2 and driver.planned_created == 2
    # published all the same (the counters keep the 4g from being allocated beside the 2g)
    assert published(kmock) == {
        p(0, "3g.40gb", 0),
        p(0, "3g.40gb", 4),
        p(1, "4g.40gb", 0),
        p(1, "2g.20gb", 2),
    }
    assert mig_status(kmock)[1] == [("2g.20gb", 2, True)]
    before = nv.creates
    (dev,) = driver.preparer.prepare(ref(1), alloc(p(0, "3g.40gb", 4)))
    assert nv.creates == before  # adopted, nothing made at prepare
    assert dev.device == p(0, "3g.40gb", 4)
    await round_ok(driver)  # nothing missing: nothing made again
    assert nv.creates == before and driver.planned_created == 2


async def test_a_drained_gpu_publishes_nothing_free_and_a_drain_wakes_the_loop(
    kmock: ApiServer, connect: Callable[[str], Any]
) -> None:
    from fake_kubelet import eventually

    nv = FakeNvml([H100, H100])
    with tempfile.TemporaryDirectory(prefix="gsshp-", dir="/tmp") as tmp:
        driver = setup(kmock, connect, nv, tmp, spec_poll_s=0.05)
        await put_np(kmock, spec("p1", {0: [("3g.40gb", 0), ("3g.40gb", 4)], 1: [("7g.80gb", 0)]}))
        await put_claim(kmock, "busy", [p(0, "3g.40gb", 0)])
        stop = asyncio.Event()
        task = asyncio.create_task(driver.run(stop))
        try:
            await eventually(lambda: driver.rounds >= 1, what="first round", timeout=20)
            assert published(kmock) == {p(0, "3g.40gb", 0), p(0, "3g.40gb", 4), p(1, "7g.80gb", 0)}
            # the partitioner drains GPU 0 (a status write: no new generation)
            drain = {
                "pod": "team/big",
                "state": "draining",
                "gpus": {"nvidia.com/mig-7g.80gb": [0]},
            }
            resp = await kmock.patch(
                f"{NP_PATH}/{NODE}/status", json={"status": {"reservations": [drain]}}
            )
            assert resp.status == 200, await resp.text()
            await eventually(
                lambda: published(kmock) == {p(0, "3g.40gb", 0), p(1, "7g.80gb", 0)},
                what="the drained GPU's free placement withdrawn",
                timeout=20,
            )
            assert np_of(kmock)["status"]["reservations"] == [drain]  # the partitioner's, kept
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
