"""CDI specs for prepared DRA claims: one transient spec file per claim.

Model
-----
The kubelet hands a container the CDI device IDs that ``NodePrepareResources`` returned for
the requests the container names; the container runtime finds each ID in a spec file under
its CDI spec directories (default ``/etc/cdi`` and ``/var/run/cdi``) and applies the device's
``containerEdits`` (shared/facts/dra.md section 3).

One spec per claim, written before prepare answers and removed at unprepare, as the
container-device-interface spec describes transient specs:

* kind ``gpu.gpuslice.io/claim`` (vendor = the driver name, class ``claim``), so an ID reads
  ``gpu.gpuslice.io/claim=<claim UID>-<device name>``: a name is never reused for another
  claim (runtimes cache specs by name);
* file ``<dir>/gpu.gpuslice.io-claim_<claim UID>.json``, written to a temporary name and
  renamed, so a runtime never reads half a file;
* each device's edit sets ``NVIDIA_VISIBLE_DEVICES`` to the UUIDs of every device of the same
  request (MIG UUIDs, or the GPU UUID for a whole GPU), comma-separated, in device-name order.
  The NVIDIA container runtime reads that variable exactly as in device-plugin mode
  (:func:`node_agent.devices.container_env`), and a variable has one value per container, so
  devices given together (one request) must carry the same value.  A container that names
  several requests of one claim gets one request's devices only: give such a container one
  request with ``count`` instead (documented in docs/operations.md).

``cdiVersion`` is ``0.6.0``: environment edits exist since 0.3.0 and dotted vendor names are
accepted by every runtime that ships CDI support with DRA (containerd 1.7+, CRI-O 1.28+).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from node_agent.dra_slices import DRIVER

__all__ = [
    "CDI_CLASS",
    "CDI_VERSION",
    "DEFAULT_CDI_DIR",
    "cdi_device_id",
    "cdi_spec",
    "remove_spec",
    "spec_path",
    "write_spec",
]

CDI_VERSION = "0.6.0"
CDI_CLASS = "claim"
DEFAULT_CDI_DIR = "/var/run/cdi"
_NAME = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9_.:-]*[a-zA-Z0-9])?$")


def _device(claim_uid: str, device: str) -> str:
    name = f"{claim_uid}-{device}"
    if not _NAME.match(name):
        raise ValueError(f"CDI device name {name!r} is not valid (letters, digits, _ . : -)")
    return name


def cdi_device_id(claim_uid: str, device: str, driver: str = DRIVER) -> str:
    """The fully qualified CDI ID of ``device`` prepared for claim ``claim_uid``."""
    return f"{driver}/{CDI_CLASS}={_device(claim_uid, device)}"


def cdi_spec(
    claim_uid: str, devices: Sequence[tuple[str, str, str]], driver: str = DRIVER
) -> dict[str, Any]:
    """The spec of one claim; ``devices`` are ``(request, device name, UUID)``."""
    by_request: dict[str, list[tuple[str, str]]] = {}
    for request, name, uuid in devices:
        by_request.setdefault(request, []).append((name, uuid))
    visible = {r: ",".join(u for _, u in sorted(ds)) for r, ds in by_request.items()}
    return {
        "cdiVersion": CDI_VERSION,
        "kind": f"{driver}/{CDI_CLASS}",
        "devices": [
            {
                "name": _device(claim_uid, name),
                "containerEdits": {"env": [f"NVIDIA_VISIBLE_DEVICES={visible[request]}"]},
            }
            for request, name, _ in sorted(devices, key=lambda d: d[1])
        ],
    }


def spec_path(cdi_dir: str | Path, claim_uid: str, driver: str = DRIVER) -> Path:
    return Path(cdi_dir) / f"{driver}-{CDI_CLASS}_{claim_uid}.json"


def write_spec(
    cdi_dir: str | Path, claim_uid: str, spec: Mapping[str, Any], driver: str = DRIVER
) -> Path:
    """Write the spec atomically (temporary file, then rename); return its path."""
    path = spec_path(cdi_dir, claim_uid, driver)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def remove_spec(cdi_dir: str | Path, claim_uid: str, driver: str = DRIVER) -> None:
    with contextlib.suppress(FileNotFoundError):
        spec_path(cdi_dir, claim_uid, driver).unlink()
