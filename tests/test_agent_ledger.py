"""The allocation ledger: ids handed out by ``Allocate``, held until PodResources shows them.

The kubelet records an allocation in PodResources only after ``Allocate`` returns; a device
allocated in that window looked free to the agent's re-read and could be destroyed.  The race
itself, over real gRPC, is tested in test_agent_deviceplugin.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from manual_clock import ManualClock

from node_agent.allocations import MAX_ENTRIES, AllocationLedger

# -- the ledger ---------------------------------------------------------------------------


def test_unconfirmed_ids_are_held_until_the_grace_period_ends() -> None:
    clock = ManualClock(1_000_000.0)
    ledger = AllocationLedger(30, clock=clock)
    ledger.record(["a", "b"])
    assert ledger.held(set()) == {"a", "b"}
    clock.now += 29.9
    assert ledger.held(set()) == {"a", "b"}
    clock.now += 0.1  # admission failed after Allocate: the kubelet never recorded them
    assert ledger.held(set()) == set()
    assert len(ledger) == 0


def test_confirmed_ids_follow_podresources_and_reallocation_restarts_the_hold() -> None:
    clock = ManualClock(1_000_000.0)
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
    clock = ManualClock(1_000_000.0)
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
