"""Allocation-aware destroy: the device plugin's ledger of ids handed out by ``Allocate``.

The kubelet records an allocation in PodResources only after ``Allocate`` returns; a device
allocated in that window looked free to the agent's re-read and could be destroyed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from fake_kubelet import FakeKubelet, eventually

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.allocations import MAX_ENTRIES, AllocationLedger, LedgerInUse
from node_agent.deviceplugin import DevicePluginManager
from node_agent.devices import AdvertisedDevice, InUseSource
from node_agent.mps import FakeSupervisor
from node_agent.nvml_fake import FakeNvml
from node_agent.reconciler import Reconciler
from planner.catalog import default_catalog

CAT = default_catalog()
MIG_1G = "nvidia.com/mig-1g.10gb"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class KubeletRecord:
    """PodResources as the kubelet answers it: only what it has recorded so far."""

    def __init__(self) -> None:
        self.recorded: set[str] = set()

    async def in_use_device_ids(self) -> set[str]:
        return set(self.recorded)


# -- the ledger ---------------------------------------------------------------------------


def test_unconfirmed_ids_are_held_until_the_grace_period_ends() -> None:
    clock = Clock()
    ledger = AllocationLedger(30, clock=clock)
    ledger.record(["a", "b"])
    assert ledger.held(set()) == {"a", "b"}
    clock.now += 29.9
    assert ledger.held(set()) == {"a", "b"}
    clock.now += 0.1  # admission failed after Allocate: the kubelet never recorded them
    assert ledger.held(set()) == set()
    assert len(ledger) == 0


def test_confirmed_ids_follow_podresources_and_reallocation_restarts_the_hold() -> None:
    clock = Clock()
    ledger = AllocationLedger(30, clock=clock)
    ledger.record(["a"])
    assert ledger.held({"a"}) == set()  # visible: PodResources answers for it now
    assert "a" in ledger
    clock.now += 1
    assert ledger.held(set()) == set()  # released by the pod: forgotten at once
    assert "a" not in ledger
    ledger.record(["a"])  # handed out again
    clock.now += 100
    ledger.record(["a"])  # and again: a new allocation time
    assert ledger.held(set()) == {"a"}


def test_the_ledger_survives_an_agent_restart(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "state" / "allocations.json"
    AllocationLedger(30, path=path, clock=clock).record(["MIG-1", "MIG-2"])
    AllocationLedger(30, path=path, clock=clock).held({"MIG-2"})  # MIG-2 confirmed
    clock.now += 10
    restarted = AllocationLedger(30, path=path, clock=clock)
    assert restarted.held(set()) == {"MIG-1"}  # MIG-2 was confirmed and is gone now
    assert json.loads(path.read_text()) == {"MIG-1": [1_000_000.0, False]}


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\xff\xfe not json",
        b"[1, 2, 3]",
        b'{"x": "y", "z": [1], "n": [NaN, false], "b": [true, true]}',
        b"[" * 100_000,
    ],
)
def test_a_damaged_ledger_file_is_ignored(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "allocations.json"
    path.write_bytes(content)
    ledger = AllocationLedger(30, path=path)
    assert len(ledger) == 0
    ledger.record(["a"])  # and replaced by a good one
    assert AllocationLedger(30, path=path).held(set()) == {"a"}


def test_the_ledger_is_bounded() -> None:
    ledger = AllocationLedger(30)
    ledger.record(f"id-{i}" for i in range(MAX_ENTRIES + 10))
    assert len(ledger) == MAX_ENTRIES
    assert "id-0" not in ledger and f"id-{MAX_ENTRIES + 9}" in ledger


def test_grace_must_be_positive() -> None:
    with pytest.raises(ValueError, match="grace_seconds must be > 0"):
        AllocationLedger(0)


# -- the device plugin records, the reconciler protects -------------------------------------


@pytest.fixture
def plugin_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="gsal-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(plugin_dir: str) -> AsyncIterator[FakeKubelet]:
    k = FakeKubelet(plugin_dir)
    await k.start()
    yield k
    await k.stop()


def spec(*instances: tuple[str, int]) -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate(
        {
            "planId": "p",
            "mode": "mig",
            "gpus": [{"index": 0, "mig": [{"profile": p, "start": s} for p, s in instances]}],
        }
    )


async def allocate_then_repartition(
    kubelet: FakeKubelet, plugin_dir: str, in_use: InUseSource, ledger: AllocationLedger
) -> tuple[FakeNvml, str, set[str]]:
    """Create 1g@0 + 1g@1, let the kubelet allocate 1g@0 over gRPC (not yet recorded in
    PodResources), then ask for a layout without it; return the hardware, the allocated UUID
    and the MIG UUIDs left."""
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")], mig_enabled=True)
    manager = DevicePluginManager(
        plugin_dir, poll_interval_s=0.05, register_timeout_s=5, on_allocate=ledger.record
    )
    await manager.start()
    try:

        def publish(devices: Mapping[str, Sequence[AdvertisedDevice]]) -> None:
            manager.set_devices(devices)

        agent = Reconciler(nv, in_use, FakeSupervisor(nvml=nv), CAT, publish=publish)
        first = await agent.reconcile(spec(("1g.10gb", 0), ("1g.10gb", 1)), 1, now="t")
        assert first.applied
        uuid = nv.uuid_of(0, next(gi for gi, _, start, _ in nv.instances(0) if start == 0))
        await eventually(lambda: kubelet.registered(MIG_1G) is not None, what="registration")
        conn = kubelet.registered(MIG_1G)
        assert conn is not None
        await eventually(lambda: uuid in conn.devices, what="device advertised")
        await conn.allocate([uuid])  # the kubelet records it only after this returns
        await agent.reconcile(spec(("7g.80gb", 0)), 2, now="t")
    finally:
        await manager.stop()
    return nv, uuid, set(nv.mig_uuids())


async def test_a_device_allocated_before_podresources_shows_it_is_not_destroyed(
    kubelet: FakeKubelet, plugin_dir: str
) -> None:
    ledger = AllocationLedger(60)
    record = KubeletRecord()
    nv, uuid, left = await allocate_then_repartition(
        kubelet, plugin_dir, LedgerInUse(record, ledger), ledger
    )
    assert uuid in ledger  # recorded by the gRPC Allocate
    assert uuid in left  # kept: the 7g spec is not applied over it (Degraded, InstanceInUse)
    assert [(p.name, s) for p, s, _ in nv.layout(0)] == [("1g.10gb", 0), ("1g.10gb", 1)]


async def test_without_the_ledger_the_same_race_destroys_the_device(
    kubelet: FakeKubelet, plugin_dir: str
) -> None:
    """The finding itself: PodResources alone does not protect a fresh allocation."""
    ledger = AllocationLedger(60)
    nv, uuid, left = await allocate_then_repartition(kubelet, plugin_dir, KubeletRecord(), ledger)
    assert uuid in ledger  # the plugin did hand it out ...
    assert uuid not in left  # ... and the agent destroyed it: the 7g instance replaced it
    assert [(p.name, s) for p, s, _ in nv.layout(0)] == [("7g.80gb", 0)]


async def test_failed_allocate_records_nothing(kubelet: FakeKubelet, plugin_dir: str) -> None:
    recorded: list[list[str]] = []
    manager = DevicePluginManager(
        plugin_dir, poll_interval_s=0.05, register_timeout_s=5, on_allocate=recorded.append
    )
    await manager.start()
    try:
        dev = AdvertisedDevice("MIG-x", MIG_1G, "GPU-0", True)
        manager.set_devices({MIG_1G: [dev]})
        await eventually(lambda: kubelet.registered(MIG_1G) is not None, what="registration")
        conn = kubelet.registered(MIG_1G)
        assert conn is not None
        await eventually(lambda: "MIG-x" in conn.devices, what="device advertised")
        with pytest.raises(Exception, match="MIG-nope"):
            await conn.allocate(["MIG-nope"])
        assert recorded == []
        await conn.allocate(["MIG-x"], ["MIG-x"])
        assert recorded == [["MIG-x", "MIG-x"]]
    finally:
        await manager.stop()
    assert not os.listdir(plugin_dir) or os.listdir(plugin_dir) == ["kubelet.sock"]
