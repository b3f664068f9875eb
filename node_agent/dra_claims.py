"""What a ResourceClaim asks this node's DRA driver to prepare: its allocation, read and checked.

Model
-----
The kubelet's ``NodePrepareResources`` names a claim only (namespace, name, UID); the driver
reads the ``resource.k8s.io/v1`` ResourceClaim itself and takes from
``status.allocation.devices.results`` the results whose ``driver`` is its own
(shared/facts/dra.md section 1).  Each result names a ``pool`` and a ``device``; this driver's
pool is the node (:mod:`node_agent.dra_slices`), its devices ``gpu<i>`` (a whole GPU) and
``gpu<i>-<profile>-s<start>`` (a MIG placement).  :func:`device_targets` maps every device name
the GPUs of this node can publish back to ``(GPU index, profile, start)``; a result naming a
device of this pool that no GPU can have (a renamed profile, a GPU gone) is refused, as is a
result of this driver in another pool (the claim was allocated on another node).

The checks, each a :class:`ClaimError` whose message names the claim and what to do:

* the claim was not found, or its UID differs from the kubelet's (deleted and recreated);
* it is not allocated;
* a result of this driver is for another pool, or names an unknown device.

A claim whose results are all of other drivers prepares nothing (``[]``): each driver prepares
its own devices.  A result's ``adminAccess`` flag is kept (:attr:`AllocatedDevice.admin_access`):
such a result is no allocation, and the preparer gives it the device as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from node_agent.dra_slices import DRIVER, device_name
from planner.catalog import GpuModel, MigProfile

__all__ = [
    "AllocatedDevice",
    "ClaimError",
    "ClaimRef",
    "DeviceTarget",
    "allocated_devices",
    "device_targets",
]


class ClaimError(Exception):
    """A claim this driver cannot prepare (the message names the claim and the fix)."""


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim as the kubelet names it."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"ResourceClaim {self.namespace}/{self.name} (uid {self.uid})"


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One allocation result of this driver: the request it serves and the device."""

    request: str
    """The request as the result names it: ``gpu``, or ``gpu/small`` for a ``firstAvailable``
    subrequest."""
    pool: str
    device: str
    share_id: str | None = None
    admin_access: bool = False
    """The result's ``adminAccess``: access to the device as it is, not an allocation
    (kube-scheduler does not count it as allocated: :mod:`node_agent.dra_prepare`,
    "adminAccess")."""


@dataclass(frozen=True, slots=True)
class DeviceTarget:
    """What a device name means on this node: a whole GPU (``profile`` ``None``) or a MIG
    placement ``(profile, start)`` on GPU ``gpu``."""

    gpu: int
    profile: MigProfile | None = None
    start: int = 0


def device_targets(models: Mapping[int, GpuModel]) -> dict[str, DeviceTarget]:
    """Every device name the GPUs ``{index: model}`` publish -> its target."""
    out: dict[str, DeviceTarget] = {}
    for i, model in models.items():
        out[device_name(i)] = DeviceTarget(i)
        for p in model.profiles:
            for s in p.starts:
                out[device_name(i, p, s)] = DeviceTarget(i, p, s)
    return out


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def allocated_devices(
    claim: Mapping[str, Any] | None,
    ref: ClaimRef,
    pool: str,
    known: Sequence[str] | Mapping[str, Any],
    driver: str = DRIVER,
) -> list[AllocatedDevice]:
    """The results of ``driver`` in ``claim`` (the object read from the API), checked against
    what the kubelet asked for (``ref``) and this node's ``pool`` and ``known`` device names."""
    if claim is None:
        raise ClaimError(
            f"{ref} was not found in the API: it was deleted; the kubelet retries with the "
            "pod's current claims"
        )
    uid = _get(claim, "metadata", "uid")
    if uid != ref.uid:
        raise ClaimError(
            f"{ref}: the API holds a claim of that name with uid {uid!r}, so the kubelet's "
            "claim was deleted and recreated; the pod must be recreated to use the new claim"
        )
    allocation = _get(claim, "status", "allocation")
    if not isinstance(allocation, Mapping):
        raise ClaimError(
            f"{ref} is not allocated (no status.allocation); the kubelet prepares only "
            "allocated claims: check the scheduler's events on the pod"
        )
    results = _get(allocation, "devices", "results") or []
    if not isinstance(results, list):
        raise ClaimError(f"{ref}: status.allocation.devices.results is not a list")
    out: list[AllocatedDevice] = []
    for n, r in enumerate(results):
        if not isinstance(r, Mapping) or r.get("driver") != driver:
            continue
        device, where = r.get("device"), r.get("pool")
        request = r.get("request")
        if (
            not isinstance(device, str)
            or not isinstance(where, str)
            or not isinstance(request, str)
        ):
            raise ClaimError(
                f"{ref}: allocation result {n} of {driver} lacks request, pool or device"
            )
        if where != pool:
            raise ClaimError(
                f"{ref}: device {device} was allocated from pool {where!r}, not this node's "
                f"pool {pool!r}; the pod was bound to the wrong node or the claim is stale"
            )
        if device not in known:
            raise ClaimError(
                f"{ref}: device {device} is not a device of this node's GPUs (it has "
                f"{len(known)}); the node's GPUs changed since the allocation: delete the pod "
                "so that its claim is allocated again"
            )
        share = r.get("shareID")
        out.append(
            AllocatedDevice(
                request,
                where,
                device,
                share if isinstance(share, str) else None,
                admin_access=r.get("adminAccess") is True,
            )
        )
    _refuse_config(allocation, ref, driver, {d.request for d in out})
    return out


def _refuse_config(
    allocation: Mapping[str, Any], ref: ClaimRef, driver: str, requests: set[str]
) -> None:
    """gpuslice's devices take no parameters: an opaque config addressed to ``driver`` that
    applies to one of its ``requests`` (none listed: to all; a subrequest ``main/sub`` counts
    as ``main``) is refused, as drivers refuse a config they cannot decode (dra.md section 1),
    rather than prepared as if it were not there."""
    base = {r.split("/", 1)[0] for r in requests} | requests
    for cfg in _get(allocation, "devices", "config") or ():
        if not isinstance(cfg, Mapping):
            continue
        opaque = cfg.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        named = cfg.get("requests") or []
        if not isinstance(named, list):
            named = []
        if named and not ({str(n) for n in named} & base):
            continue
        source = cfg.get("source") or "FromClaim"
        where = "its DeviceClass" if source == "FromClass" else "the claim"
        raise ClaimError(
            f"{ref}: an opaque config for {driver} ({source}) applies to "
            + (f"request(s) {', '.join(sorted(str(n) for n in named))}" if named else "it")
            + f"; gpuslice's devices take no parameters: remove the config from {where}"
        )
