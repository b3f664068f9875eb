"""Device ids the device plugin handed out that the kubelet may not report yet.

Model
-----
The kubelet records a device in its PodResources API only *after* the plugin's ``Allocate``
returns (facts/k8s-scheduling.md section 6).  A device allocated just before the agent
withdraws it can therefore be missing from the agent's re-read of ``List`` and look free.  The
:class:`AllocationLedger` closes that window: the device plugin records every id a successful
``Allocate`` returns (:meth:`AllocationLedger.record`, before the reply leaves), and the
reconciler's in-use source (:class:`LedgerInUse`) adds the ledger's *held* ids to what
PodResources shows.  Per id:

* **unconfirmed** (allocated, not yet seen in a ``List``): held until ``grace_seconds`` after
  the allocation, then forgotten -- the pod's admission failed after ``Allocate`` (another
  device or resource could not be allocated) and the kubelet never recorded it;
* **confirmed** (seen in a ``List`` since its allocation): PodResources is authoritative from
  then on; the first ``List`` that no longer shows it means the pod released it, and the id is
  forgotten;
* a new ``Allocate`` of an id makes it unconfirmed again, with a new allocation time.

PodResources does not list ordinary init containers at all: their devices are covered by the
kubelet's own checkpoint instead (:mod:`node_agent.kubelet_checkpoint`, the optional
``checkpoint`` of :class:`LedgerInUse`), not by the grace period.

``held`` answers are only as good as the ``List`` they are given: the reconciler asks with every
answer it reads and asks nothing when PodResources is unreadable (then nothing is destroyed
anyway).

Crash safety: with a ``path`` the ledger is written to a small JSON file (atomically: a temp
file renamed over it) on every change and read back on start, so an agent that restarts between
an ``Allocate`` and the kubelet's record still holds the id.  The chart keeps the file on the
host's ``/run`` (tmpfs): a node reboot clears it together with every allocation.  Times are
wall-clock seconds (they must survive the restart); a file that cannot be read is logged and
ignored (an empty ledger), and at most :data:`MAX_ENTRIES` ids are kept (oldest dropped), so a
damaged or hostile file cannot grow the agent's memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from node_agent.devices import InUseSource

__all__ = ["MAX_ENTRIES", "AllocationLedger", "CheckpointIds", "LedgerInUse"]

log = logging.getLogger(__name__)

MAX_ENTRIES = 65536
"""Ids kept at most (a node advertises a few hundred devices at the very most)."""

MAX_FILE_BYTES = 8 * 1024 * 1024
"""The ledger file is ignored beyond this size (it holds at most MAX_ENTRIES short ids)."""


@dataclass(slots=True)
class _Entry:
    allocated_at: float
    confirmed: bool = False


class AllocationLedger:
    """Ids from successful ``Allocate`` calls, held until the kubelet shows them or grace ends.

    ``clock`` returns wall-clock seconds (default :func:`time.time`); ``path`` (optional)
    persists the ledger across agent restarts (module docstring).
    """

    def __init__(
        self,
        grace_seconds: float = 60.0,
        *,
        path: str | Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not grace_seconds > 0:
            raise ValueError(f"allocation grace_seconds must be > 0, got {grace_seconds}")
        self.grace_seconds = grace_seconds
        self.path = Path(path) if path else None
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        if self.path is not None:
            self._entries = _load(self.path)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, device_id: object) -> bool:
        return device_id in self._entries

    def record(self, device_ids: Iterable[str]) -> None:
        """``Allocate`` handed out ``device_ids`` now: hold them (module docstring)."""
        now = self._clock()
        for dev in device_ids:
            self._entries.pop(dev, None)  # re-insert: dict order stays oldest first
            self._entries[dev] = _Entry(now)
        while len(self._entries) > MAX_ENTRIES:
            del self._entries[next(iter(self._entries))]
        self._save()

    def held(self, visible: Iterable[str]) -> set[str]:
        """Ids to count as in use besides ``visible`` (the ids of one PodResources ``List``).

        Updates the ledger: visible ids are confirmed, confirmed ids no longer visible are
        released, unconfirmed ids past the grace period expire."""
        seen = set(visible)
        now = self._clock()
        out: set[str] = set()
        changed = False
        for dev in list(self._entries):
            entry = self._entries[dev]
            if dev in seen:
                if not entry.confirmed:
                    entry.confirmed = changed = True
            elif entry.confirmed or now - entry.allocated_at >= self.grace_seconds:
                del self._entries[dev]
                changed = True
            else:
                out.add(dev)
        if changed:
            self._save()
        return out

    def _save(self) -> None:
        if self.path is None:
            return
        doc = {d: [e.allocated_at, e.confirmed] for d, e in self._entries.items()}
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
        except OSError as e:  # the in-memory ledger still protects this agent's lifetime
            log.warning("cannot write the allocation ledger %s: %s", self.path, e)
            with contextlib.suppress(OSError):
                tmp.unlink()


def _load(path: Path) -> dict[str, _Entry]:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:
        log.warning("ignoring the allocation ledger %s: %s", path, e)
        return {}
    out: dict[str, _Entry] = {}
    if not isinstance(doc, dict):
        log.warning("ignoring the allocation ledger %s: not a JSON object", path)
        return out
    for dev, value in doc.items():
        if (
            isinstance(value, list)
            and len(value) == 2
            and isinstance(value[0], int | float)
            and not isinstance(value[0], bool)
            and value[0] == value[0]  # not NaN
            and isinstance(value[1], bool)
        ):
            out[dev] = _Entry(float(value[0]), value[1])
    if len(out) > MAX_ENTRIES:
        out = dict(list(out.items())[-MAX_ENTRIES:])
    return out


class CheckpointIds(Protocol):
    """Device ids the kubelet's device manager holds (:class:`~node_agent.kubelet_checkpoint.
    KubeletCheckpoint`); never raises."""

    def device_ids(self) -> set[str]: ...


class LedgerInUse:
    """An :class:`~node_agent.devices.InUseSource`: PodResources' ids plus the ledger's held ids,
    plus the ids of the kubelet's device-manager checkpoint (``checkpoint``, optional).

    PodResources ``List`` leaves out ordinary init containers, whose devices the kubelet keeps
    allocated to the pod: the checkpoint lists them (:mod:`node_agent.kubelet_checkpoint`).
    Checkpoint ids do not confirm ledger entries: the ledger follows ``List`` alone.

    A failure of ``source`` propagates (in use unknown); the ledger and the checkpoint are only
    consulted with a real answer."""

    def __init__(
        self,
        source: InUseSource,
        ledger: AllocationLedger,
        checkpoint: CheckpointIds | None = None,
    ) -> None:
        self.source = source
        self.ledger = ledger
        self.checkpoint = checkpoint

    async def in_use_device_ids(self) -> set[str]:
        visible = set(await self.source.in_use_device_ids())
        held = visible | self.ledger.held(visible)
        if self.checkpoint is not None:
            held |= self.checkpoint.device_ids()
        return held
