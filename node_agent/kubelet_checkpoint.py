"""Device ids the kubelet's device manager holds for pods, read from its own checkpoint.

Why
---
PodResources ``List`` leaves out ordinary (non-restartable) init containers, yet the kubelet
keeps an init container's devices allocated to its pod (they may even be handed on to the
pod's app containers).  A slice requested by such an init container was therefore covered only
by the :class:`~node_agent.allocations.AllocationLedger`'s grace period (60 s); after that the
agent reported it ``used: false`` and the next layout change could destroy it while the init
container still ran.  The kubelet records every allocation, init containers included, in
``<device plugin dir>/kubelet_internal_checkpoint``, a directory the agent already mounts.  This
module reads the device ids from there so that
:class:`~node_agent.allocations.LedgerInUse` counts them as in use.

Format (kubelet ``pkg/kubelet/cm/devicemanager/checkpoint``)::

    {"Data": {"PodDeviceEntries": [{"PodUID": "...", "ContainerName": "...",
                                    "ResourceName": "...",
                                    "DeviceIDs": {"<numa node>": ["id", ...]},
                                    "AllocResp": "<base64>"}],
              "RegisteredDevices": {"<resource>": ["id", ...]}},
     "Checksum": 123, "BootID": "..."}

``DeviceIDs`` is a plain list in checkpoints of kubelets before 1.20; both are read.  The
checksum is not verified (it hashes Go's in-memory layout); the kubelet writes the file
atomically (temp file, rename), so a torn read is not expected.  ``BootID`` (recent kubelets)
is the kernel boot id when the file was written: a different boot id means the node has
rebooted since, and no container of that boot runs any more.

Lingering entries, and the bound
--------------------------------
The kubelet removes the entries of pods that are no longer active from its memory on every
PodResources ``List`` (the agent calls one each pass) and on every ``Allocate``, but writes the
file only on an ``Allocate`` or on a device-list update (``ListAndWatch``) from any device
plugin.  An entry of a finished pod can therefore linger in the file.  Holding such a device
longer only delays a reconfiguration (safe), but it must not block it forever.

The agent cannot tell which checkpoint entries belong to live pods: the checkpoint names pods
by UID only, PodResources names them by namespace/name only, and the agent has no RBAC to read
Pods from the API server.  An age bound per *entry* would release the device of an init
container that simply runs long.  The bound used here is on the age of the *evidence*
instead: every write of the file happens after the kubelet's latest prune, so an entry in a
file written at time W belongs to a pod that was active shortly before W.  Entries count as in
use while the file lists them and the file is younger than ``max_quiet_seconds``
(:data:`DEFAULT_MAX_QUIET_SECONDS`, 6 h, judged from its mtime).  On a node where pods come and
go the file is rewritten often, so a long init container stays protected for as long as it
runs, and a finished pod's entry goes with the next rewrite.  The costs:

* on a node where for 6 h no pod with a device-plugin resource is admitted and no plugin's
  device list changes, a finished pod's device stays in use (and its GPU's layout change
  blocked) for up to those 6 h;
* an ordinary init container that runs longer than 6 h on such a quiet node loses this cover;
  its device is then destroyed only if it has no CUDA process at the moment of a layout change
  (the reconciler re-checks processes just before destroying).

Failure modes: a missing file (no device plugin has registered since the kubelet's state was
created) holds nothing, as before this module.  A file that cannot be read or parsed (or is
over :data:`MAX_FILE_BYTES`) is logged once per distinct problem and changes nothing: the last
good reading stays in force (its age still counts from that reading's mtime), and before any
good reading there is nothing to add, which is the agent's behaviour without this module.  A
pass never fails because of the checkpoint.  The file is parsed only when its mtime, size or
inode changes (one ``stat`` per call otherwise).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CHECKPOINT_NAME",
    "DEFAULT_MAX_QUIET_SECONDS",
    "MAX_FILE_BYTES",
    "CheckpointEntry",
    "CheckpointError",
    "KubeletCheckpoint",
    "parse_checkpoint",
]

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "kubelet_internal_checkpoint"
"""The device manager's checkpoint file, inside the device-plugin directory."""

DEFAULT_MAX_QUIET_SECONDS = 6 * 3600.0
"""Entries of a checkpoint file older than this (mtime) no longer count (module docstring)."""

MAX_FILE_BYTES = 64 * 1024 * 1024
"""A larger checkpoint is treated as unreadable (a busy node's file is well under 1 MiB)."""

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
"""The host's boot id (not namespaced: a container reads the host's)."""


class CheckpointError(ValueError):
    """The checkpoint file does not have the kubelet's format."""


@dataclass(frozen=True, slots=True)
class CheckpointEntry:
    """One ``PodDeviceEntries`` row: the devices of one resource given to one container."""

    pod_uid: str
    container: str
    resource: str
    device_ids: frozenset[str]


def _ids(value: object, where: str) -> set[str]:
    """``DeviceIDs``: ``{"<numa>": [ids]}`` (kubelet >= 1.20) or ``[ids]`` (older)."""
    lists: list[object]
    if isinstance(value, dict):
        lists = list(value.values())
    elif isinstance(value, list):
        lists = [value]
    elif value is None:  # Go marshals a nil map as null
        return set()
    else:
        raise CheckpointError(f"{where}: DeviceIDs is a {type(value).__name__}")
    out: set[str] = set()
    for ids in lists:
        if ids is None:
            continue
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise CheckpointError(f"{where}: DeviceIDs holds something other than id lists")
        out.update(ids)
    return out


def parse_checkpoint(doc: object) -> tuple[list[CheckpointEntry], str]:
    """The entries and the ``BootID`` ("" when absent) of a decoded checkpoint document.

    Raises :class:`CheckpointError` if it is not in the kubelet's format."""
    if not isinstance(doc, dict):
        raise CheckpointError("not a JSON object")
    data = doc.get("Data")
    if not isinstance(data, dict):
        raise CheckpointError("no Data object")
    rows = data.get("PodDeviceEntries")
    if rows is None:  # no allocation yet (Go's nil slice)
        rows = []
    if not isinstance(rows, list):
        raise CheckpointError("Data.PodDeviceEntries is not a list")
    boot_id = doc.get("BootID", "")
    if not isinstance(boot_id, str):
        raise CheckpointError("BootID is not a string")
    entries: list[CheckpointEntry] = []
    for n, row in enumerate(rows):
        where = f"PodDeviceEntries[{n}]"
        if not isinstance(row, dict):
            raise CheckpointError(f"{where} is not an object")
        fields = (row.get("PodUID"), row.get("ContainerName"), row.get("ResourceName"))
        if not all(isinstance(f, str) for f in fields):
            raise CheckpointError(f"{where}: PodUID, ContainerName or ResourceName is missing")
        pod_uid, container, resource = (str(f) for f in fields)
        entries.append(
            CheckpointEntry(
                pod_uid, container, resource, frozenset(_ids(row.get("DeviceIDs"), where))
            )
        )
    return entries, boot_id


def _host_boot_id(path: str) -> str:
    try:
        return Path(path).read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return ""  # unknown: the boot-id check is skipped


@dataclass(frozen=True, slots=True)
class _Reading:
    key: tuple[int, int, int]  # (mtime_ns, size, inode) of the file read
    mtime: float
    ids: frozenset[str]


class KubeletCheckpoint:
    """The device ids the kubelet's device-manager checkpoint holds (module docstring).

    ``path`` is the checkpoint file (see :meth:`in_dir`); ``clock`` returns wall-clock
    seconds, compared with the file's mtime."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_quiet_seconds: float = DEFAULT_MAX_QUIET_SECONDS,
        clock: Callable[[], float] = time.time,
        boot_id_path: str = BOOT_ID_PATH,
    ) -> None:
        if not max_quiet_seconds > 0:
            raise ValueError(f"max_quiet_seconds must be > 0, got {max_quiet_seconds}")
        self.path = Path(path)
        self.max_quiet_seconds = max_quiet_seconds
        self._clock = clock
        self._boot_id = _host_boot_id(boot_id_path)
        self._reading: _Reading | None = None
        self._bad_key: tuple[int, int, int] | None = None
        self._logged: str | None = None

    @classmethod
    def in_dir(
        cls,
        device_plugin_dir: str,
        *,
        max_quiet_seconds: float = DEFAULT_MAX_QUIET_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> KubeletCheckpoint:
        """The checkpoint inside the kubelet's device-plugin directory."""
        return cls(
            Path(device_plugin_dir) / CHECKPOINT_NAME,
            max_quiet_seconds=max_quiet_seconds,
            clock=clock,
        )

    def device_ids(self) -> set[str]:
        """Ids to count as in use; never raises (module docstring)."""
        try:
            self._refresh()
        except Exception as e:  # a pass must never fail because of the checkpoint
            self._note(
                f"cannot read the kubelet checkpoint {self.path}: {e}; keeping the last "
                "good reading, if any"
            )
        reading = self._reading
        if reading is None or self._clock() - reading.mtime > self.max_quiet_seconds:
            return set()
        return set(reading.ids)

    def _note(self, message: str, level: int = logging.WARNING) -> None:
        if message != self._logged:  # once per distinct problem, not every pass
            self._logged = message
            log.log(level, "%s", message)

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self._reading is None:
                self._note(
                    f"no kubelet device-manager checkpoint at {self.path}: init containers' "
                    "devices are covered by the allocation ledger only",
                    logging.INFO,
                )
            else:  # the kubelet never deletes it: keep what it last said
                self._note(f"the kubelet checkpoint {self.path} vanished; keeping its last reading")
            return
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        if (self._reading is not None and key == self._reading.key) or key == self._bad_key:
            return
        try:
            if st.st_size > MAX_FILE_BYTES:
                raise CheckpointError(f"larger than {MAX_FILE_BYTES} bytes")
            with open(self.path, "rb") as f:
                raw = f.read(MAX_FILE_BYTES + 1)
            entries, boot_id = parse_checkpoint(json.loads(raw))
        except (OSError, ValueError, RecursionError) as e:
            self._bad_key = key
            self._note(
                f"ignoring the kubelet checkpoint {self.path}: {e}; keeping the last good "
                "reading, if any"
            )
            return
        self._bad_key = None
        if boot_id and self._boot_id and boot_id != self._boot_id:
            ids: frozenset[str] = frozenset()  # written before the last reboot: nothing runs
        else:
            ids = frozenset(d for e in entries for d in e.device_ids)
        self._reading = _Reading(key, st.st_mtime, ids)
        if self._logged is not None:
            log.info("the kubelet checkpoint %s reads again (%d device ids)", self.path, len(ids))
            self._logged = None
