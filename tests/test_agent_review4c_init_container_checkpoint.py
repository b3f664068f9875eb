"""Review 4c: an ordinary init container's device, which PodResources ``List`` leaves out.

The kubelet keeps an init container's devices allocated to its pod but ``List`` skips
non-restartable init containers, so the allocation ledger covered such a slice for its 60 s
grace only; after that it read ``used: false`` and the next layout change destroyed it while
the init container could still run.  The agent now also counts the ids of the kubelet's
device-manager checkpoint (node_agent.kubelet_checkpoint).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from manual_clock import ManualClock

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.allocations import AllocationLedger, LedgerInUse
from node_agent.kubelet_checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    KubeletCheckpoint,
    parse_checkpoint,
)
from node_agent.mps import FakeSupervisor
from node_agent.nvml_fake import FakeNvml
from node_agent.reconciler import Reconciler
from planner.catalog import default_catalog

CAT = default_catalog()
T0 = 1_700_000_000.0


class KubeletList:
    """PodResources ``List``: the init container 'prep' holding the MIG device is left out."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    async def in_use_device_ids(self) -> set[str]:
        return set(self.ids)


class BrokenList:
    async def in_use_device_ids(self) -> set[str]:
        raise RuntimeError("PodResources unreadable")


def entry(pod: str, container: str, ids: object, resource: str = "nvidia.com/mig-1g.10gb"):
    return {
        "PodUID": pod,
        "ContainerName": container,
        "ResourceName": resource,
        "DeviceIDs": ids,
        "AllocResp": "",
    }


def write_checkpoint(path: Path, entries: list[dict], when: float, **extra: object) -> None:
    """Write the file as the kubelet does (``extra``: top-level fields such as BootID)."""
    doc = {
        "Data": {"PodDeviceEntries": entries, "RegisteredDevices": {}},
        "Checksum": 1234,
        **extra,
    }
    path.write_text(json.dumps(doc))
    os.utime(path, (when, when))


def spec(*inst: tuple[str, int]) -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate(
        {
            "planId": "p",
            "mode": "mig",
            "gpus": [{"index": 0, "mig": [{"profile": p, "start": s} for p, s in inst]}],
        }
    )


def used_of(result, uuid: str) -> list[bool]:
    return [m.used for g in result.status.gpus for m in g.mig if m.deviceId == uuid]


# -- the repro: the init container's slice past the ledger's grace ------------------------


@pytest.mark.parametrize(
    "device_ids",
    [lambda u: {"0": [u]}, lambda u: [u]],
    ids=["per-numa-map", "legacy-plain-list"],
)
async def test_init_container_device_survives_grace_and_is_freed_when_the_entry_goes(
    tmp_path: Path, device_ids
) -> None:
    clock = ManualClock(T0)
    ledger = AllocationLedger(60, clock=clock)
    path = tmp_path / CHECKPOINT_NAME
    write_checkpoint(path, [], clock.now)
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")], mig_enabled=True)
    in_use = LedgerInUse(KubeletList(), ledger, KubeletCheckpoint(path, clock=clock))
    rec = Reconciler(nv, in_use, FakeSupervisor(nvml=nv), CAT)
    two = spec(("1g.10gb", 0), ("1g.10gb", 1))
    await rec.reconcile(two, 1, now="t")
    uuid = nv.uuid_of(0, next(gi for gi, _, start, _ in nv.instances(0) if start == 0))

    ledger.record([uuid])  # Allocate for init container 'prep'; then the kubelet's checkpoint
    write_checkpoint(path, [entry("pod-a", "prep", device_ids(uuid))], clock.now)
    r = await rec.reconcile(two, 1, now="t")
    assert used_of(r, uuid) == [True]

    clock.now += 61  # past the ledger's grace; 'prep' still runs
    r = await rec.reconcile(two, 1, now="t")
    assert used_of(r, uuid) == [True]
    r = await rec.reconcile(spec(("7g.80gb", 0)), 2, now="t")
    assert not r.applied
    assert uuid in nv.mig_uuids()

    clock.now += 30  # the pod ended; the kubelet pruned it and rewrote its checkpoint
    write_checkpoint(path, [], clock.now)
    r = await rec.reconcile(spec(("7g.80gb", 0)), 2, now="t")
    assert r.applied
    assert uuid not in nv.mig_uuids()
    assert [(p.name, s) for p, s, _ in nv.layout(0)] == [("7g.80gb", 0)]


async def test_malformed_checkpoint_falls_back_to_the_ledger_without_failing_the_pass(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(T0)
    ledger = AllocationLedger(60, clock=clock)
    path = tmp_path / CHECKPOINT_NAME
    path.write_text('{"Data": {"PodDeviceEntries": [{"PodUID": ')  # torn / not JSON
    nv = FakeNvml([CAT.model("A100-SXM4-80GB")], mig_enabled=True)
    in_use = LedgerInUse(KubeletList(), ledger, KubeletCheckpoint(path, clock=clock))
    rec = Reconciler(nv, in_use, FakeSupervisor(nvml=nv), CAT)
    two = spec(("1g.10gb", 0), ("1g.10gb", 1))
    with caplog.at_level(logging.WARNING, logger="node_agent.kubelet_checkpoint"):
        r = await rec.reconcile(two, 1, now="t")
        assert r.applied and not r.errors
        uuid = nv.uuid_of(0, next(gi for gi, _, start, _ in nv.instances(0) if start == 0))
        ledger.record([uuid])
        r = await rec.reconcile(two, 1, now="t")
        assert used_of(r, uuid) == [True]  # the ledger, as before
        clock.now += 61
        r = await rec.reconcile(two, 1, now="t")
        assert used_of(r, uuid) == [False] and r.applied and not r.errors
    warnings = [rec for rec in caplog.records if "kubelet checkpoint" in rec.getMessage()]
    assert len(warnings) == 1  # logged once, not every pass


# -- KubeletCheckpoint ------------------------------------------------------------------


def test_both_device_id_formats_and_go_nulls_are_read(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT_NAME
    entries = [
        entry("p1", "init", {"0": ["a", "b"], "1": ["c"]}),
        entry("p1", "app", ["d"]),  # kubelet < 1.20
        entry("p2", "app", None),  # Go's nil map
        entry("p3", "app", {"0": None}),
    ]
    write_checkpoint(path, entries, T0)
    assert KubeletCheckpoint(path, clock=ManualClock(T0)).device_ids() == {"a", "b", "c", "d"}
    doc = {"Data": {"PodDeviceEntries": None, "RegisteredDevices": None}, "Checksum": 0}
    assert parse_checkpoint(doc) == ([], "")


@pytest.mark.parametrize(
    "content",
    [
        "",
        "not json",
        "[]",
        '{"Checksum": 1}',
        '{"Data": {"PodDeviceEntries": {}}}',
        '{"Data": {"PodDeviceEntries": ["x"]}}',
        '{"Data": {"PodDeviceEntries": [{"PodUID": "p", "DeviceIDs": ["a"]}]}}',
        json.dumps({"Data": {"PodDeviceEntries": [entry("p", "c", 7)]}}),
        json.dumps({"Data": {"PodDeviceEntries": [entry("p", "c", {"0": [1, 2]})]}}),
        json.dumps({"Data": {"PodDeviceEntries": [entry("p", "c", ["a"])]}, "BootID": 3}),
        "[" * 100_000,
        b"\xff\xfe garbage",
    ],
)
def test_a_malformed_file_never_raises_and_never_releases_a_good_reading(
    tmp_path: Path, content: str | bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / CHECKPOINT_NAME
    clock = ManualClock(T0)

    def put(data: str | bytes, when: float) -> None:
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)
        os.utime(path, (when, when))

    fresh = KubeletCheckpoint(path, clock=clock)
    put(content, T0)
    with caplog.at_level(logging.WARNING, logger="node_agent.kubelet_checkpoint"):
        assert fresh.device_ids() == set()  # never readable: today's behaviour
        assert fresh.device_ids() == set()
    assert len(caplog.records) == 1

    held = KubeletCheckpoint(path, clock=clock)
    write_checkpoint(path, [entry("p", "prep", {"0": ["mig-a"]})], T0)
    assert held.device_ids() == {"mig-a"}
    clock.now += 10
    put(content, clock.now)
    assert held.device_ids() == {"mig-a"}  # a bad rewrite unblocks nothing
    write_checkpoint(path, [], clock.now + 1)
    assert held.device_ids() == set()  # a good rewrite is followed again


def test_missing_file_holds_nothing_and_a_vanished_one_keeps_its_last_reading(
    tmp_path: Path,
) -> None:
    path = tmp_path / CHECKPOINT_NAME
    cp = KubeletCheckpoint(path, clock=ManualClock(T0))
    assert cp.device_ids() == set()
    write_checkpoint(path, [entry("p", "prep", ["x"])], T0)
    assert cp.device_ids() == {"x"}
    path.unlink()
    assert cp.device_ids() == {"x"}
    unreadable = KubeletCheckpoint(tmp_path, clock=ManualClock(T0))  # a directory
    assert unreadable.device_ids() == set()


def test_the_file_is_parsed_only_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import node_agent.kubelet_checkpoint as kc

    path = tmp_path / CHECKPOINT_NAME
    write_checkpoint(path, [entry("p", "c", ["aaaa"])], T0)
    cp = KubeletCheckpoint(path, clock=ManualClock(T0))
    parses: list[int] = []
    real = kc.parse_checkpoint

    def counting(doc: object):
        parses.append(1)
        return real(doc)

    monkeypatch.setattr(kc, "parse_checkpoint", counting)
    for _ in range(5):
        assert cp.device_ids() == {"aaaa"}
    assert len(parses) == 1
    write_checkpoint(path, [entry("p", "c", ["bbbb"])], T0 + 1)  # same size, new mtime
    assert cp.device_ids() == {"bbbb"}
    assert len(parses) == 2


def test_entries_of_a_file_quiet_past_the_bound_no_longer_count(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    path = tmp_path / CHECKPOINT_NAME
    write_checkpoint(path, [entry("gone", "prep", ["x"])], T0)
    cp = KubeletCheckpoint(path, clock=clock, max_quiet_seconds=3600)
    assert cp.device_ids() == {"x"}
    clock.now += 3600
    assert cp.device_ids() == {"x"}
    clock.now += 1  # nothing on the node rewrote it for an hour: cannot block forever
    assert cp.device_ids() == set()
    write_checkpoint(path, [entry("live", "prep", ["x"])], clock.now)  # rewritten: live again
    assert cp.device_ids() == {"x"}
    with pytest.raises(ValueError):
        KubeletCheckpoint(path, max_quiet_seconds=0)


def test_a_checkpoint_from_before_the_last_reboot_holds_nothing(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("b-now\n")
    path = tmp_path / CHECKPOINT_NAME
    clock = ManualClock(T0)
    write_checkpoint(path, [entry("p", "prep", ["x"])], T0, BootID="b-before")
    assert KubeletCheckpoint(path, clock=clock, boot_id_path=str(boot)).device_ids() == set()
    write_checkpoint(path, [entry("p", "prep", ["x"])], T0, BootID="b-now")
    assert KubeletCheckpoint(path, clock=clock, boot_id_path=str(boot)).device_ids() == {"x"}
    unknown = str(tmp_path / "no-boot-id")  # host boot id unreadable: the check is skipped
    write_checkpoint(path, [entry("p", "prep", ["x"])], T0, BootID="b-before")
    assert KubeletCheckpoint(path, clock=clock, boot_id_path=unknown).device_ids() == {"x"}


def test_in_dir_names_the_kubelets_file(tmp_path: Path) -> None:
    cp = KubeletCheckpoint.in_dir(str(tmp_path))
    assert cp.path == tmp_path / "kubelet_internal_checkpoint"
    with pytest.raises(CheckpointError):
        parse_checkpoint({"Data": {"PodDeviceEntries": [entry("p", "c", "a")]}})


# -- LedgerInUse with the checkpoint -----------------------------------------------------


async def test_ledger_in_use_adds_checkpoint_ids_without_confirming_ledger_entries(
    tmp_path: Path,
) -> None:
    clock = ManualClock(T0)
    path = tmp_path / CHECKPOINT_NAME
    write_checkpoint(path, [entry("p", "prep", ["x"])], T0)
    ledger = AllocationLedger(60, clock=clock)
    ledger.record(["x", "y"])
    source = KubeletList()
    in_use = LedgerInUse(source, ledger, KubeletCheckpoint(path, clock=clock))
    assert await in_use.in_use_device_ids() == {"x", "y"}
    clock.now += 61
    assert await in_use.in_use_device_ids() == {"x"}  # y expired; x is the checkpoint's
    source.ids = {"z"}
    assert await in_use.in_use_device_ids() == {"x", "z"}
    with pytest.raises(RuntimeError):  # PodResources unreadable: unknown, never a subset
        await LedgerInUse(BrokenList(), ledger, KubeletCheckpoint(path)).in_use_device_ids()


# -- the wiring: the real agent's in-use source reads the kubelet's checkpoint -----------


class _Stop(Exception):
    pass


async def test_the_device_plugin_agent_counts_the_kubelet_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse
    import tempfile

    import node_agent.agent
    import node_agent.mps
    import node_agent.nvml_pynvml
    import node_agent.podresources
    import node_agent.reconciler
    from gpuslice.commands import agent as agent_cmd
    from node_agent.settings import AgentSettings

    for name in [n for n in os.environ if n.startswith("GPUSLICE_")]:
        monkeypatch.delenv(name)

    class Source:
        def __init__(self, node: str) -> None:
            pass

        async def connect(self) -> object:
            return object()

        async def close(self) -> None:
            pass

    seen: list[object] = []

    def capture(nvml: object, in_use: object, *a: object, **k: object) -> None:
        seen.append(in_use)
        raise _Stop

    monkeypatch.setattr(node_agent.agent, "KubeSpecSource", Source)
    monkeypatch.setattr(
        node_agent.nvml_pynvml,
        "PynvmlAdapter",
        lambda smi=None, **_: FakeNvml([CAT.model("A100-SXM4-80GB")]),
    )
    monkeypatch.setattr(node_agent.mps, "MpsControlSupervisor", FakeSupervisor)
    monkeypatch.setattr(
        node_agent.podresources, "PodResourcesClient", lambda *a, **k: KubeletList()
    )
    monkeypatch.setattr(node_agent.reconciler, "Reconciler", capture)
    with tempfile.TemporaryDirectory(prefix="gs4c-", dir="/tmp") as tmp:
        write_checkpoint(Path(tmp) / CHECKPOINT_NAME, [entry("p", "prep", ["mig-x"])], 0)
        os.utime(Path(tmp) / CHECKPOINT_NAME)  # written now
        settings = AgentSettings(
            node_name="n1", metrics_port=0, state_dir="", xid_watch=False, device_plugin_dir=tmp
        )
        with pytest.raises(_Stop):
            await agent_cmd._run_real(argparse.Namespace(once=True, output="table"), settings, CAT)
        (in_use,) = seen
        assert isinstance(in_use, LedgerInUse)
        assert await in_use.in_use_device_ids() == {"mig-x"}
