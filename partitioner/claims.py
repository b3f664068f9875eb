"""ResourceClaims as demand: what a pending pod on a DRA node asks gpuslice to plan.  Pure.

Model
-----
On nodes labelled ``gpuslice.io/partitioning=dra`` the node agent is a DRA driver
(``gpu.gpuslice.io``, docs/operations.md "DRA mode") and pods ask for MIG instances through
ResourceClaims (``resource.k8s.io/v1``), not extended resources.  The partitioner plans those
nodes like MIG nodes and the agent publishes the planned placements (planner-shaped
publishing), so it must read a claim as the request it stands for:

* a claim request ``exactly: {deviceClassName: mig.gpuslice.io, count: N, selectors: [...]}``
  whose CEL selectors include ``device.attributes["gpu.gpuslice.io"].profile == "<P>"`` (the
  form the docs give; ``["profile"]`` and single quotes are read too; the comparison may be one
  conjunct of an ``&&``) asks for N instances of profile P: the units
  ``nvidia.com/mig-<P>: N``, the same name the device-plugin mode advertises, so the planner,
  its catalog and every rule about MIG requests apply unchanged;
* a request of another DeviceClass (another driver, or ``gpu.gpuslice.io``: a whole GPU, which
  the agent publishes on every GPU the plan leaves without instances) is not the partitioner's
  to plan and adds nothing;
* a ``mig.gpuslice.io`` request the partitioner cannot turn into units (no profile comparison,
  ``allocationMode: All``, ``firstAvailable`` alternatives) is an *error* naming the claim and
  the fix: the pod gets an Event and is not planned (it can still take a published placement
  that matches);
* an *allocated* claim (``status.allocation`` set) keeps its units: its pod, once bound, holds
  them on its node as a device-plugin pod holds its extended resources (the ledger counts them
  until the agent reports the devices used), and the devices its allocation names are pinned
  on their node whatever the agent's ``used`` flags say (:attr:`ClaimDemand.devices`): a DRA
  node need not guess from counts which device a bound pod holds.

A pod's claims are ``spec.resourceClaims``: ``resourceClaimName`` names the claim; a
``resourceClaimTemplateName`` entry's claim is named in ``status.resourceClaimStatuses`` once
the resource-claim controller created it (until then the pod's demand is unknown and it is not
planned; the claim's creation re-reads the pod).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from contract.nodepartitioning import PrepareFailure
from planner.snapshot import mig_resource

__all__ = [
    "DRIVER",
    "MIG_CLASS",
    "ClaimDemand",
    "claim_key",
    "claim_key_of",
    "failed_claims",
    "pod_claim_keys",
    "read_claim",
]

Obj = Mapping[str, Any]
DRIVER = "gpu.gpuslice.io"
"""The DRA driver name (node_agent.dra_slices.DRIVER; the partitioner never imports the agent)."""
MIG_CLASS = "mig.gpuslice.io"
"""The DeviceClass of MIG placements (node_agent.dra_slices.device_classes)."""
_MAX_COUNT = 64

_PROFILE = re.compile(
    r"""device\s*\.\s*attributes\s*\[\s*(["'])gpu\.gpuslice\.io\1\s*\]\s*"""
    r"""(?:\.\s*profile|\[\s*(["'])profile\2\s*\])\s*==\s*(["'])([^"']+)\3"""
)
_FIX = (
    f"select one profile: deviceClassName {MIG_CLASS} with the CEL selector "
    f'device.attributes["{DRIVER}"].profile == "<profile>" and allocationMode ExactCount'
)


@dataclass(frozen=True, slots=True)
class ClaimDemand:
    """What one claim asks the partitioner for."""

    units: Mapping[str, int]
    """``nvidia.com/mig-<profile>`` -> instances (empty: nothing to plan)."""
    error: str = ""
    """Why a ``mig.gpuslice.io`` request cannot be planned (names the claim and the fix)."""
    allocated: bool = False
    uid: str = ""
    """The claim's ``metadata.uid``: a claim deleted and created again under its name is
    another claim (the DRA agent's prepare failures name the uid)."""
    devices: tuple[tuple[str, str], ...] = ()
    """(pool, device) of each device kube-scheduler allocated it from gpuslice's driver: the
    pool is the node (:mod:`contract.dra_devices` names the device)."""


def claim_key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def claim_key_of(claim: Obj) -> str:
    """``namespace/name`` of a ResourceClaim object (the index's key for it)."""
    meta = claim.get("metadata") or {}
    return claim_key(str(meta.get("namespace", "")), str(meta.get("name", "")))


def _profile(selectors: object) -> str | None:
    """The profile the selectors pin, if exactly one comparison names one."""
    found: set[str] = set()
    for s in selectors if isinstance(selectors, list) else ():
        expr = ((s or {}).get("cel") or {}).get("expression") if isinstance(s, Mapping) else None
        if not isinstance(expr, str):
            continue
        for conjunct in expr.split("&&"):
            m = _PROFILE.fullmatch(conjunct.strip().strip("()").strip())
            if m is not None:
                found.add(m.group(4))
    return found.pop() if len(found) == 1 else None


def read_claim(claim: Obj) -> ClaimDemand:
    """The demand of one ResourceClaim (module docstring), with the devices allocated to it."""
    devices = _allocated_devices(claim)
    demand = _read_demand(claim)
    return replace(demand, devices=devices) if devices else demand


def _read_demand(claim: Obj) -> ClaimDemand:
    name = claim_key_of(claim)
    allocated = bool((claim.get("status") or {}).get("allocation"))
    uid = str((claim.get("metadata") or {}).get("uid") or "")
    units: dict[str, int] = {}
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ()
    for req in requests if isinstance(requests, list) else ():
        if not isinstance(req, Mapping):
            continue
        label = f"ResourceClaim {name} request {req.get('name', '')!r}"
        alternatives = req.get("firstAvailable") or ()
        if any(
            isinstance(a, Mapping) and a.get("deviceClassName") == MIG_CLASS for a in alternatives
        ):
            return ClaimDemand(
                {}, f"{label}: firstAvailable alternatives are not planned; {_FIX}", allocated, uid
            )
        exact = req.get("exactly") or {}
        if not isinstance(exact, Mapping) or exact.get("deviceClassName") != MIG_CLASS:
            continue
        mode = exact.get("allocationMode") or "ExactCount"
        if mode != "ExactCount":
            return ClaimDemand(
                {}, f"{label}: allocationMode {mode} is not planned; {_FIX}", allocated, uid
            )
        count = exact.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= _MAX_COUNT:
            return ClaimDemand(
                {}, f"{label}: count {count!r} is not 1..{_MAX_COUNT}; {_FIX}", allocated, uid
            )
        profile = _profile(exact.get("selectors"))
        if profile is None:
            return ClaimDemand(
                {}, f"{label}: its selectors name no single MIG profile; {_FIX}", allocated, uid
            )
        resource = mig_resource(profile)
        units[resource] = units.get(resource, 0) + count
    return ClaimDemand(units, allocated=allocated, uid=uid)


def _allocated_devices(claim: Obj) -> tuple[tuple[str, str], ...]:
    """(pool, device) of the claim's allocation results from gpuslice's driver (sorted)."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (
        (allocation.get("devices") or {}).get("results")
        if isinstance(allocation, Mapping)
        else None
    )
    out: set[tuple[str, str]] = set()
    for r in results if isinstance(results, list) else ():
        if isinstance(r, Mapping) and r.get("driver") == DRIVER:
            pool, device = r.get("pool"), r.get("device")
            if isinstance(pool, str) and isinstance(device, str):
                out.add((pool, device))
    return tuple(sorted(out))


def pod_claim_keys(pod: Obj) -> tuple[tuple[str, ...], bool]:
    """The keys of the pod's claims, and whether every one is known yet (a template's claim is
    named in ``status.resourceClaimStatuses`` once created)."""
    meta = pod.get("metadata") or {}
    namespace = str(meta.get("namespace", ""))
    entries = (pod.get("spec") or {}).get("resourceClaims") or ()
    statuses = {
        str(s.get("name")): s.get("resourceClaimName")
        for s in (pod.get("status") or {}).get("resourceClaimStatuses") or ()
        if isinstance(s, Mapping)
    }
    keys: list[str] = []
    complete = True
    for e in entries if isinstance(entries, list) else ():
        if not isinstance(e, Mapping):
            continue
        claim = e.get("resourceClaimName") or statuses.get(str(e.get("name")))
        if claim:
            keys.append(claim_key(namespace, str(claim)))
        elif e.get("resourceClaimTemplateName"):
            complete = False
    return tuple(keys), complete


def failed_claims(
    failures: Iterable[PrepareFailure], claims: Mapping[str, ClaimDemand]
) -> dict[str, PrepareFailure]:
    """A node agent's prepare failures (``status.prepareFailures``) by claim key, each only if
    it is of the claim now under that name: a failure reported for a claim deleted before one
    of the same name was created (another uid) is left out; a uid unknown on either side (no
    claim read, an agent that sent none) is assumed the same."""
    out: dict[str, PrepareFailure] = {}
    for f in failures:
        demand = claims.get(f.claim)
        if not (f.uid and demand is not None and demand.uid and demand.uid != f.uid):
            out[f.claim] = f
    return out
