"""The fourth DRA review's findings (hunt4/dra4), each fixed and checked here.

* 1: an API server that drops counters (DRAPartitionableDevices off) never sees a device slice:
  the counter slice is written and read back first, the publisher then refuses without writing
  until its next check (backing off), which writes the counter slice alone.
* 3: a GPU that publishes nothing keeps its (empty, schema-valid) device slice, so withdrawing
  one idle GPU and bringing it back patch that one slice at the stored generation.
* 4: mode ``all`` never withdraws a device a foreign process blocks on its own (it may be
  allocated to a claim not prepared yet): published tainted, or its whole GPU withdrawn where
  the API server drops taints.
* 5: ``-me`` profiles get device names of their own and are a variant; the catalog refuses two
  profiles that would get one device name; built-in names are unchanged.
* 6: a failed prepare leaves an instance it adopted; the start-up roll-back of a ``started``
  record keeps planned instances.
"""

from __future__ import annotations

import collections
import copy
import json
import types
from pathlib import Path
from typing import Any
from unittest import mock

import kubernetes_validate
import pytest

from contract.dra_devices import dns_label, placement_device_name
from node_agent.dra_checkpoint import Checkpoint
from node_agent.dra_claims import AllocatedDevice, ClaimError, ClaimRef
from node_agent.dra_driver import DraDriver, _all_but_unhealthy
from node_agent.dra_prepare import DraPreparer
from node_agent.dra_publish import PublishError, SlicePublisher
from node_agent.dra_shape import publish_set
from node_agent.dra_slices import (
    UNUSABLE_TAINT_KEY,
    DraGpu,
    device_name,
    gpu_counters,
    placement_counters,
    resource_slices,
)
from node_agent.nvml_fake import FakeNvml
from planner.catalog import CatalogError, default_catalog, parse_catalog

CAT = default_catalog()
H100 = CAT.model("H100-80GB")
THREE = H100.profile("3g.40gb")


class FakeApi:
    """ResourceSlices in memory, answered as the API server stores them.  ``drop_counters``:
    the DRAPartitionableDevices gate is off; ``drop_taints``: DRADeviceTaints is off.
    ``log``: every write, with the devices published without counters at that moment."""

    def __init__(self) -> None:
        self.objs: dict[str, dict[str, Any]] = {}
        self.rv = 0
        self.drop_counters = False
        self.drop_taints = False
        self.log: list[tuple[str, str]] = []
        self.uncounted: list[str] = []

    def _stored(self, body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        spec = body["spec"]
        if self.drop_counters:
            spec.pop("sharedCounters", None)
        for d in spec.get("devices") or ():
            if self.drop_counters:
                d.pop("consumesCounters", None)
            if self.drop_taints:
                d.pop("taints", None)
            for t in d.get("taints") or ():
                t.setdefault("timeAdded", "2026-12-07T00:00:00Z")
        if not spec.get("devices"):
            spec.pop("devices", None)  # omitempty
        return body

    def _note(self, op: str, name: str) -> None:
        self.log.append((op, name))
        self.uncounted += [
            d["name"]
            for o in self.objs.values()
            for d in o["spec"].get("devices") or ()
            if "consumesCounters" not in d
        ]

    def generations(self) -> set[int]:
        return {o["spec"]["pool"]["generation"] for o in self.objs.values()}

    async def list_cluster_custom_object(self, *a: Any, **kw: Any) -> dict[str, Any]:
        return {"items": copy.deepcopy(list(self.objs.values()))}

    async def create_cluster_custom_object(self, g: str, v: str, p: str, body: Any, **kw: Any):
        self.rv += 1
        body = self._stored(body)
        body["metadata"]["resourceVersion"] = str(self.rv)
        self.objs[body["metadata"]["name"]] = body
        self._note("create", body["metadata"]["name"])

    async def patch_cluster_custom_object(self, g: str, v: str, p: str, name: str, body: Any, **kw):
        self.rv += 1
        self.objs[name]["spec"] = self._stored({"spec": body["spec"]})["spec"]
        self.objs[name]["metadata"]["resourceVersion"] = str(self.rv)
        self._note("patch", name)

    async def delete_cluster_custom_object(self, g: str, v: str, p: str, name: str, **kw: Any):
        self.objs.pop(name, None)
        self.log.append(("delete", name))


def devices_published(api: FakeApi) -> list[str]:
    return [d["name"] for o in api.objs.values() for d in o["spec"].get("devices") or ()]


# -- 1: the counters gate off ---------------------------------------------------------------


async def test_gate_off_never_publishes_a_device_without_counters() -> None:
    api = FakeApi()
    api.drop_counters = True
    pub = SlicePublisher(api, "n1", [DraGpu(i, f"GPU-{i}", H100) for i in range(2)])
    for _ in range(3):  # the driver's retries, 2 s apart
        with pytest.raises(PublishError, match="DRAPartitionableDevices feature gate is off"):
            await pub.publish()
    assert api.uncounted == []  # never a device the scheduler could allocate without counters
    assert api.log == [
        ("create", "n1-gpu.gpuslice.io-counters-0"),
        ("delete", "n1-gpu.gpuslice.io-counters-0"),
    ]  # once: the retries within the back-off write nothing
    assert api.objs == {}


async def test_gate_off_writes_no_device_slice_and_probes_with_backoff() -> None:
    api = FakeApi()
    api.drop_counters = True
    now = [0.0]
    gpus = [DraGpu(i, f"GPU-{i}", H100) for i in range(2)]
    pub = SlicePublisher(
        api, "n1", gpus, gate_probe_s=30.0, gate_probe_max_s=120.0, clock=lambda: now[0]
    )
    with pytest.raises(PublishError, match="DRAPartitionableDevices feature gate is off"):
        await pub.publish()
    created = [name for op, name in api.log if op == "create"]
    assert created == ["n1-gpu.gpuslice.io-counters-0"]  # no device slice, ever
    assert api.uncounted == [] and api.objs == {}
    # until the next check: refused at once, nothing written (the retry loop runs every 2 s)
    api.log.clear()
    for t in (2.0, 10.0, 29.0):
        now[0] = t
        with pytest.raises(PublishError, match=r"removed .*checked again in"):
            await pub.publish()
    assert api.log == []
    # the check: the counter slice alone, again refused, the next check twice as far
    now[0] = 30.0
    with pytest.raises(PublishError, match="DRAPartitionableDevices"):
        await pub.publish()
    assert [op for op, _ in api.log] == ["create", "delete"]
    api.log.clear()
    now[0] = 30.0 + 59.0
    with pytest.raises(PublishError, match="checked again in"):
        await pub.publish()
    assert api.log == []
    # the gate switched on: the next check publishes everything
    api.drop_counters = False
    now[0] = 30.0 + 60.0
    assert await pub.publish()
    assert pub.gate_off is None
    assert sorted(api.objs) == [
        "n1-gpu.gpuslice.io-counters-0",
        "n1-gpu.gpuslice.io-devices-gpu0",
        "n1-gpu.gpuslice.io-devices-gpu1",
    ]
    assert api.log[0] == ("create", "n1-gpu.gpuslice.io-counters-0")


# -- 3: a withdrawn GPU keeps its slice -------------------------------------------------------


def test_a_gpu_publishing_nothing_keeps_an_empty_valid_slice() -> None:
    gpus = [DraGpu(i, f"GPU-{i}", H100) for i in range(3)]
    every = resource_slices("n1", gpus)
    names = [device_name(0, THREE, 0), device_name(2, THREE, 4)]
    narrowed = resource_slices("n1", gpus, 1, names)
    assert [s["metadata"]["name"] for s in narrowed] == [s["metadata"]["name"] for s in every]
    (gpu1,) = [s for s in narrowed if s["metadata"]["name"].endswith("devices-gpu1")]
    assert gpu1["spec"]["devices"] == []
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in narrowed} == {4}
    for version in ("1.34", "1.35", "1.36", "1.37"):
        kubernetes_validate.validate(gpu1, version, strict=True)


async def test_withdrawing_one_idle_gpu_patches_its_slice_alone() -> None:
    api = FakeApi()
    gpus = [DraGpu(i, f"GPU-{i}", H100) for i in range(4)]
    pub = SlicePublisher(api, "n1", gpus)
    planned = {i: [device_name(i, THREE, 0), device_name(i, THREE, 4)] for i in range(4)}
    assert await pub.publish(publish_set(planned, allocated=set()))
    api.log.clear()
    assert await pub.publish(publish_set(planned, allocated=set(), withheld={2}))
    assert api.log == [("patch", "n1-gpu.gpuslice.io-devices-gpu2")]
    assert api.generations() == {1}
    assert not any(d.startswith("gpu2") for d in devices_published(api))
    api.log.clear()
    assert await pub.publish(publish_set(planned, allocated=set()))
    assert api.log == [("patch", "n1-gpu.gpuslice.io-devices-gpu2")]
    assert api.generations() == {1}
    assert not await pub.publish(publish_set(planned, allocated=set()))  # unchanged: no write


# -- 4: mode all and a foreign process ------------------------------------------------------


def _fits(published: set[str], allocated: set[str], new: str, prep: DraPreparer) -> bool:
    """kube-scheduler's counter check: only devices published and allocated are subtracted."""
    have = dict(gpu_counters(H100))
    for n in [*(a for a in allocated if a in published), new]:
        t = prep.targets[n]
        for k, v in placement_counters(H100, t.profile, t.start).items():
            have[k] -= v
    return all(v >= 0 for v in have.values())


def _slots(prep: DraPreparer, name: str) -> set[str]:
    """The memory-slot counters device ``name`` consumes."""
    t = prep.targets[name]
    return {k for k in placement_counters(H100, t.profile, t.start) if k.startswith("mem")}


def _mode_all_driver(api: FakeApi) -> tuple[DraDriver, DraPreparer, FakeNvml]:
    nv = FakeNvml([H100], mig_enabled=True)
    prep = DraPreparer(nv, CAT, node="n1", checkpoint=Checkpoint(None))
    plugin = types.SimpleNamespace(
        preparer=prep,
        prepare_failures=lambda *a: None,
        registered=True,  # as by the kubelet: an unregistered plugin publishes nothing
        registration_problem=lambda *a: None,
    )
    pub = SlicePublisher(api, "n1", [DraGpu(0, "GPU-0", H100)])
    return DraDriver(plugin, pub), prep, nv  # type: ignore[arg-type]


@pytest.mark.parametrize("taints_kept", [True, False])
async def test_mode_all_never_withdraws_a_blocked_device_alone(taints_kept: bool) -> None:
    api = FakeApi()
    api.drop_taints = not taints_kept
    driver, prep, nv = _mode_all_driver(api)
    gi = nv.create_gpu_instance(0, H100.profile("1g.10gb").profile_id, 0, 1)
    nv.start_process(0, gi, nv.create_compute_instance(0, gi), "stray")
    claim_c = "gpu0-3g-40gb-s0"  # allocated by kube-scheduler, its prepare refused meanwhile
    with pytest.raises(ClaimError):
        prep.prepare(ClaimRef("team", "c", "uid-c"), [AllocatedDevice("gpu", "n1", claim_c)])
    assert await driver.publish_once()
    published = set(devices_published(api))
    # no placement overlapping C's can be allocated beside it
    for other in published - {claim_c}:
        if _slots(prep, other) & _slots(prep, claim_c):
            assert not _fits(published, {claim_c}, other, prep), other
    if taints_kept:
        assert claim_c in published
        (taint,) = next(
            d["taints"]
            for o in api.objs.values()
            for d in o["spec"].get("devices") or ()
            if d["name"] == claim_c
        )
        assert taint["key"] == UNUSABLE_TAINT_KEY and taint["value"] == "foreign"
        assert device_name(0, THREE, 4) in published  # the rest of the GPU serves on
    else:
        assert not driver.publisher.taints
        assert published == set()  # its only GPU withdrawn, nothing prepared on it


def test_all_but_unhealthy_withdraws_a_hidden_devices_gpu() -> None:
    nv = FakeNvml([H100, H100], mig_enabled=True)
    prep = DraPreparer(nv, CAT, node="n1", checkpoint=Checkpoint(None))
    hidden = {device_name(0, THREE, 0)}
    prepared = {device_name(0, THREE, 4)}
    out = _all_but_unhealthy(prep.targets, prepared, {}, hidden)
    assert out == {n for n, t in prep.targets.items() if t.gpu == 1} | prepared
    tainting = _all_but_unhealthy(prep.targets, prepared, {}, hidden, tainting=True)
    assert tainting == set(prep.targets)


# -- 5: -me profiles ------------------------------------------------------------------------


def _rtx(names: dict[str, str]) -> dict[str, Any]:
    shapes = {
        "1g": (14, 4),
        "1g+me": (21, 1),
        "1g-me": (67, 4),
        "1g+me.all": (66, 1),
    }
    geo = {
        "memory_slots": 12,
        "compute_slices": 4,
        "profiles": [
            {
                "shape": s,
                "profile_id": pid,
                "compute": 1,
                "memory_slices": 3,
                "max_count": mx,
                "starts": [0, 3, 6, 9],
            }
            for s, (pid, mx) in shapes.items()
        ]
        + [
            {
                "shape": "4g",
                "profile_id": 0,
                "compute": 4,
                "memory_slices": 12,
                "max_count": 1,
                "starts": [0],
            }
        ],
    }
    profiles = {s: {"name": n, "memory_mib": 24192} for s, n in names.items()}
    profiles["4g"] = {"name": "4g.96gb", "memory_mib": 97408}
    return {
        "geometries": {"rtxpro-12-me": geo},
        "models": [
            {
                "name": "RTX-PRO-6000-R580",
                "memory_mib": 97887,
                "pci_device_ids": ["2BB5"],
                "geometry": "rtxpro-12-me",
                "profiles": profiles,
            }
        ],
    }


RTX_NAMES = {
    "1g": "1g.24gb",
    "1g+me": "1g.24gb+me",
    "1g-me": "1g.24gb-me",
    "1g+me.all": "1g.24gb+me.all",
}


def test_minus_me_profiles_are_a_variant_with_names_of_their_own() -> None:
    model = parse_catalog(json.dumps(_rtx(RTX_NAMES)), "override.json").model("RTX-PRO-6000-R580")
    minus, plus, me_all = (model.profile(n) for n in ("1g.24gb-me", "1g.24gb+me", "1g.24gb+me.all"))
    assert minus.variant == "-me" and not minus.has_media_extensions
    assert dns_label(minus.name) != dns_label(plus.name)
    devices = [
        d["name"]
        for s in resource_slices("n1", [DraGpu(0, "GPU-0", model)])
        for d in s["spec"].get("devices") or ()
    ]
    assert [n for n, k in collections.Counter(devices).items() if k > 1] == []
    need: collections.Counter[str] = collections.Counter(placement_counters(model, me_all, 0))
    need.update(placement_counters(model, minus, 3))
    have = gpu_counters(model)
    assert all(v <= have[k] for k, v in need.items())  # mig.md: +me.all allows -me beside it
    need.update(placement_counters(model, model.profile("1g.24gb"), 6))
    assert not all(v <= have[k] for k, v in need.items())  # but nothing else


def test_the_catalog_refuses_two_profiles_with_one_device_name() -> None:
    clash = {**RTX_NAMES, "1g+me": "1g.24gb.+me"}  # spelled 1g-24gb--me, as 1g.24gb-me is
    with pytest.raises(CatalogError, match="same DRA device name"):
        parse_catalog(json.dumps(_rtx(clash)), "override.json")


def test_builtin_device_names_are_unchanged() -> None:
    for model in CAT.models:
        for p in model.profiles:
            old = p.name.lower().replace(".", "-").replace("+", "-")
            assert placement_device_name(0, p.name, 0) == f"gpu0-{old}-s0"


# -- 6: a failed prepare and an adopted instance -------------------------------------------


def _planned_prep(nv: FakeNvml, cp: Checkpoint, tmp: Path) -> DraPreparer:
    prep = DraPreparer(nv, CAT, node="n1", checkpoint=cp, cdi_dir=tmp)
    prep.planned = frozenset({device_name(0, THREE, 0), device_name(0, THREE, 4)})
    return prep


def _layout(nv: FakeNvml) -> list[tuple[str, int]]:
    return sorted((p.name, s) for p, s, *_ in nv.layout(0))


def test_a_failed_prepare_leaves_the_instance_it_adopted(tmp_path: Path) -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    prep = _planned_prep(nv, Checkpoint(None), tmp_path)
    assert prep.create_planned(prep.planned or ()) == 2
    before = _layout(nv)
    with (
        mock.patch("node_agent.dra_prepare.write_spec", side_effect=OSError(28, "No space")),
        pytest.raises(ClaimError, match="No space"),
    ):
        prep.prepare(
            ClaimRef("team", "a", "uid-a"), [AllocatedDevice("gpu", "n1", device_name(0, THREE, 0))]
        )
    assert _layout(nv) == before
    assert prep.checkpoint.get("uid-a") is None
    # the kubelet's retry adopts it again
    prep.prepare(
        ClaimRef("team", "a", "uid-a"), [AllocatedDevice("gpu", "n1", device_name(0, THREE, 0))]
    )
    assert _layout(nv) == before


def test_a_failed_prepare_still_destroys_what_it_created(tmp_path: Path) -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    prep = _planned_prep(nv, Checkpoint(None), tmp_path)
    with (
        mock.patch("node_agent.dra_prepare.write_spec", side_effect=OSError(28, "No space")),
        pytest.raises(ClaimError),
    ):
        prep.prepare(
            ClaimRef("team", "a", "uid-a"), [AllocatedDevice("gpu", "n1", device_name(0, THREE, 0))]
        )
    assert _layout(nv) == []


class _Crash(BaseException):
    """The agent dying mid-prepare (no rollback runs)."""


def test_the_start_up_rollback_keeps_a_planned_instance(tmp_path: Path) -> None:
    nv = FakeNvml([H100], mig_enabled=True)
    cp = Checkpoint(None)
    prep = _planned_prep(nv, cp, tmp_path)
    prep.create_planned(prep.planned or ())
    before = _layout(nv)
    with mock.patch("node_agent.dra_prepare.write_spec", side_effect=_Crash), pytest.raises(_Crash):
        prep.prepare(
            ClaimRef("team", "a", "uid-a"), [AllocatedDevice("gpu", "n1", device_name(0, THREE, 0))]
        )
    rec = cp.get("uid-a")
    assert rec is not None and rec.state == "started"
    again = _planned_prep(nv, cp, tmp_path)  # the next agent, the spec read first
    assert again.clean_unknown() == []
    assert _layout(nv) == before
    assert cp.get("uid-a") is None
