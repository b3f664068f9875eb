"""The DRA driver's node-local record of what it prepared, per claim, kept across restarts.

Model
-----
The kubelet may call ``NodeUnprepareResources`` after the claim was deleted from the API, after
an agent restart, or twice; so the driver remembers what it created for each claim
(shared/facts/dra.md section 3).  A :class:`ClaimRecord` is

* ``started``: written *before* anything is created for the claim, then rewritten after every
  instance created, so an agent that dies mid-prepare leaves a record of exactly what to roll
  back; or
* ``completed``: every device exists and the CDI spec is written; prepare answers from it.

:class:`Checkpoint` is a JSON file (``{"version": 1, "claims": [...]}``) replaced atomically
(temporary file, fsync, rename) on every change; ``path=None`` keeps it in memory only (tests).
A file that cannot be read as a checkpoint is not silently dropped: it is renamed to
``<name>.corrupt`` (kept for inspection) and the agent starts with no record, logging an error
that names both files -- the instances it described are then unknown, and the driver removes
them only when idle (:meth:`node_agent.dra_prepare.DraPreparer.clean_unknown`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["Checkpoint", "ClaimRecord", "PreparedDevice"]

log = logging.getLogger(__name__)

VERSION = 1


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device prepared for a claim."""

    request: str
    device: str
    """The DRA device name (``gpu0``, ``gpu0-3g-40gb-s4``)."""
    gpu: int
    gpu_uuid: str
    profile: str | None
    """The MIG profile name; ``None``: the whole GPU."""
    start: int
    uuid: str
    """The MIG device UUID (``MIG-...``) or, for a whole GPU, the GPU UUID."""
    cdi_id: str
    share_id: str | None = None
    admin_access: bool = False
    """Prepared for an ``adminAccess`` result: the device as it was found, owned by no one
    (:mod:`node_agent.dra_prepare`, "adminAccess"); written to the file only when true, so a
    checkpoint without admin devices stays readable by earlier agents."""


@dataclass(slots=True)
class ClaimRecord:
    namespace: str
    name: str
    uid: str
    state: Literal["started", "completed"]
    devices: list[PreparedDevice] = field(default_factory=list)

    def label(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


def _record(raw: Any) -> ClaimRecord:
    if not isinstance(raw, dict) or raw.get("state") not in ("started", "completed"):
        raise ValueError(f"not a claim record: {raw!r}")
    devices = [PreparedDevice(**d) for d in raw.get("devices", [])]
    return ClaimRecord(raw["namespace"], raw["name"], raw["uid"], raw["state"], devices)


class Checkpoint:
    """Claim UID -> :class:`ClaimRecord`, persisted on every change (module docstring)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._claims: dict[str, ClaimRecord] = {}
        if self.path is not None and self.path.exists():
            self._load(self.path)

    def _load(self, path: Path) -> None:
        try:
            doc = json.loads(path.read_text())
            if not isinstance(doc, dict) or doc.get("version") != VERSION:
                raise ValueError(
                    f"version {doc.get('version') if isinstance(doc, dict) else doc!r}"
                )
            claims = [_record(c) for c in doc.get("claims", [])]
        except (OSError, ValueError, TypeError, KeyError) as e:
            aside = path.with_name(path.name + ".corrupt")
            os.replace(path, aside)
            log.error(
                "DRA checkpoint %s is unreadable (%s); kept it as %s and started with no "
                "prepared claims: idle MIG instances it described are removed, used ones kept",
                path,
                e,
                aside,
            )
            return
        self._claims = {c.uid: c for c in claims}

    def __iter__(self) -> Iterator[ClaimRecord]:
        return iter(list(self._claims.values()))

    def __len__(self) -> int:
        return len(self._claims)

    def get(self, uid: str) -> ClaimRecord | None:
        return self._claims.get(uid)

    def put(self, record: ClaimRecord) -> None:
        self._claims[record.uid] = record
        self._save()

    def drop(self, uid: str) -> None:
        if self._claims.pop(uid, None) is not None:
            self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        claims = [asdict(c) for c in self._claims.values()]
        for c in claims:
            for d in c["devices"]:
                if not d["admin_access"]:
                    del d["admin_access"]  # the field earlier agents know nothing of
        doc = {"version": VERSION, "claims": claims}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
