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
  conjunct of an ``&&``, at any depth of parentheses that only group conjunctions) asks for N
  instances of profile P: the units ``nvidia.com/mig-<P>: N``, the same name the device-plugin
  mode advertises, so the planner, its catalog and every rule about MIG requests apply
  unchanged.  A selector is read only where the reading is exact: one with ``||`` or a
  conditional (``?:``) anywhere outside a string literal, unbalanced parentheses or an
  unterminated string is an *error* (below), never read as its first conjunct (CEL binds
  ``&&`` tighter than ``||``: ``P1 && x || P2`` is ``(P1 && x) || P2``, any device of P2);
* a request with ``adminAccess: true`` adds nothing: kube-scheduler does not count
  admin-access results as allocated (such a claim shares a device another claim may hold) and
  allocates it only existing devices, so there is nothing to plan for it, and its results pin
  no device (:attr:`ClaimDemand.devices`);
* a claim needing more than :data:`CLAIM_LIMIT` (32) devices in all (the sum of its
  ``ExactCount`` requests, any DeviceClass) is an *error*: kube-scheduler's allocator refuses
  it (``AllocationResultsMaxSize``, "exceeds the claim limit"), so planning for it would only
  reconfigure GPUs for a pod that can never be scheduled;
* a request of another DeviceClass (another driver, or ``gpu.gpuslice.io``: a whole GPU, which
  the agent publishes on every GPU the plan leaves without instances) is not the partitioner's
  to plan and adds nothing;
* a ``mig.gpuslice.io`` request the partitioner cannot turn into units (no profile comparison,
  ``allocationMode: All``, ``firstAvailable`` alternatives) is an *error* naming the claim and
  the fix: the pod gets an Event and is not planned (it can still take a published placement
  that matches);
* a selector that also constrains an attribute the plan decides (``start``, ``index``,
  ``uuid``, ``model``), and a ``spec.devices.constraints`` entry (``matchAttribute``,
  ``distinctAttribute``) that covers a planned request, are *errors*: the planner places each
  request by profile alone, so kube-scheduler could not allocate the devices planned for the
  claim and the pod, released, would wait for them for good;
* an opaque config addressed to gpuslice's driver in the claim's ``spec.devices.config`` that
  applies to a planned request is an *error*: gpuslice's devices take no parameters and the
  node agent refuses to prepare such a claim, so planning for it would reconfigure GPUs for a
  pod that would then be stranded;
* an *allocated* claim (``status.allocation`` set) keeps its units: its pod, once bound, holds
  them on its node as a device-plugin pod holds its extended resources (the ledger counts them
  until the agent reports the devices used), and the devices its allocation names are pinned
  on their node whatever the agent's ``used`` flags say (:attr:`ClaimDemand.devices`): a DRA
  node need not guess from counts which device a bound pod holds;
* these are the *claim's* units: a claim several pods name is allocated once, and the index
  gives its units to one of them (:mod:`partitioner.index`, "carrier"), never to each.

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
CLAIM_LIMIT = 32
"""Devices one claim can be allocated at most (kube-scheduler's ``AllocationResultsMaxSize``):
a claim needing more is refused by the allocator ("exceeds the claim limit")."""

_PROFILE = re.compile(
    r"""device\s*\.\s*attributes\s*\[\s*(["'])gpu\.gpuslice\.io\1\s*\]\s*"""
    r"""(?:\.\s*profile|\[\s*(["'])profile\2\s*\])\s*==\s*(["'])([^"']+)\3"""
)
_PLACED = re.compile(
    r"""device\s*\.\s*attributes\s*\[\s*(["'])gpu\.gpuslice\.io\1\s*\]\s*"""
    r"""(?:\.\s*(start|index|uuid|model)\b|\[\s*(["'])(start|index|uuid|model)\3\s*\])"""
)
"""A reference to an attribute of gpuslice's devices that the plan decides (which GPU, which
placement, which model): a selector condition on it is not planned."""
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


class _Unreadable(ValueError):
    """A CEL expression the partitioner cannot read exactly (the message says why)."""


def _string_end(text: str, at: int) -> int:
    """Where the string literal opened by the quote at ``at`` closes (the closing quote's
    index; ``len(text)`` when it never does), escapes skipped."""
    end, quote = at + 1, text[at]
    while end < len(text) and text[end] != quote:
        end += 2 if text[end] == "\\" else 1
    return min(end, len(text))


def _scan(expr: str) -> list[tuple[int, int]]:
    """(position, parenthesis depth) of every top-level-of-its-group ``&&`` in ``expr``,
    outside string literals.  Raises :class:`_Unreadable` for ``||``, ``?:``, unbalanced
    parentheses or an unterminated string: an expression with those is not a conjunction."""
    out: list[tuple[int, int]] = []
    depth, i, n = 0, 0, len(expr)
    while i < n:
        ch = expr[i]
        if ch in "\"'":
            end = _string_end(expr, i)
            if end >= n:
                raise _Unreadable("it has an unterminated string literal")
            i = end + 1
            continue
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth < 0:
                raise _Unreadable("its parentheses are unbalanced")
        elif expr.startswith("||", i):
            raise _Unreadable("it has '||', and CEL binds && tighter than ||")
        elif ch == "?":
            raise _Unreadable("it has a conditional '?:'")
        elif expr.startswith("&&", i):
            out.append((i, depth))
            i += 2
            continue
        i += 1
    if depth != 0:
        raise _Unreadable("its parentheses are unbalanced")
    return out


def _conjuncts(expr: str) -> list[str]:
    """The conjuncts of ``expr`` read as ``c1 && c2 && ...``, parentheses that enclose a whole
    conjunction opened (``(a && b) && c`` is three); :class:`_Unreadable` as :func:`_scan`."""
    text = expr.strip()
    while text.startswith("(") and text.endswith(")") and _encloses(text):
        text = text[1:-1].strip()
    cuts = [at for at, depth in _scan(text) if depth == 0]
    if not cuts:
        return [text]
    parts, start = [], 0
    for at in cuts:
        parts.append(text[start:at])
        start = at + 2
    parts.append(text[start:])
    return [c for part in parts for c in _conjuncts(part)]


def _encloses(text: str) -> bool:
    """Whether the ``(`` opening ``text`` is closed by its last character."""
    depth, at, n = 0, 0, len(text)
    while at < n:
        ch = text[at]
        if ch in "\"'":  # a string literal: skipped whole (terminated: _scan read it)
            at = _string_end(text, at)
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth == 0:
                return at == n - 1
        at += 1
    return False


def _profile(selectors: object) -> str | None:
    """The profile the selectors pin, if exactly one comparison names one (:class:`_Unreadable`
    for a selector that is not a conjunction the reader can read exactly, or one that also
    constrains an attribute the plan decides: ``start``, ``index``, ``uuid``, ``model``)."""
    found: set[str] = set()
    for s in selectors if isinstance(selectors, list) else ():
        expr = ((s or {}).get("cel") or {}).get("expression") if isinstance(s, Mapping) else None
        if not isinstance(expr, str):
            continue
        _scan(expr)  # anything unreadable anywhere in it, before its parts are read
        for conjunct in _conjuncts(expr):
            m = _PROFILE.fullmatch(conjunct)
            if m is not None:
                found.add(m.group(4))
                continue
            placed = _PLACED.search(conjunct)
            if placed is not None:
                raise _Unreadable(
                    f"it also constrains the device's {placed.group(2) or placed.group(4)}, "
                    f"which the plan decides (the partitioner plans by profile alone, and "
                    f"kube-scheduler could not allocate the device planned for it); drop that "
                    f"condition"
                )
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
    planned: set[str] = set()  # names of the requests that ask for MIG placements
    devices = 0  # the claim needs in all, every DeviceClass (the allocator's claim limit)
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ()
    for req in requests if isinstance(requests, list) else ():
        if not isinstance(req, Mapping):
            continue
        label = f"ResourceClaim {name} request {req.get('name', '')!r}"
        devices += _exact_count(req.get("exactly"))
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
        if exact.get("adminAccess") is True:
            continue  # not an allocation: it shares an existing device, nothing to plan
        mode = exact.get("allocationMode") or "ExactCount"
        if mode != "ExactCount":
            return ClaimDemand(
                {}, f"{label}: allocationMode {mode} is not planned; {_FIX}", allocated, uid
            )
        count = exact.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            return ClaimDemand(
                {}, f"{label}: count {count!r} is not 1..{CLAIM_LIMIT}; {_FIX}", allocated, uid
            )
        try:
            profile = _profile(exact.get("selectors"))
        except _Unreadable as e:
            return ClaimDemand(
                {},
                f"{label}: its selectors cannot be read exactly ({e}); only a conjunction "
                f"(&&) that includes one profile comparison is read; {_FIX}",
                allocated,
                uid,
            )
        if profile is None:
            return ClaimDemand(
                {}, f"{label}: its selectors name no single MIG profile; {_FIX}", allocated, uid
            )
        resource = mig_resource(profile)
        units[resource] = units.get(resource, 0) + count
        planned.add(str(req.get("name", "")))
    refused = _whole_claim_error(claim, name, units, devices, planned)
    if refused:
        return ClaimDemand({}, refused, allocated, uid)
    return ClaimDemand(units, allocated=allocated, uid=uid)


def _whole_claim_error(
    claim: Obj, name: str, units: Mapping[str, int], devices: int, planned: set[str]
) -> str:
    """Why a claim whose requests read as ``units`` cannot be planned as a whole ("" if it can):
    more devices than one claim is allocated, constraints over its planned requests, or an
    opaque config for gpuslice's driver (module docstring)."""
    if not units:
        return ""
    if devices > CLAIM_LIMIT:
        return (
            f"ResourceClaim {name} needs {devices} devices in all, more than the {CLAIM_LIMIT} "
            f"kube-scheduler allocates to one claim (AllocationResultsMaxSize): it can never "
            f"be allocated; split it into claims of at most {CLAIM_LIMIT} devices each"
        )
    constrained = _constrained(claim, planned)
    if constrained is not None:
        return (
            f"ResourceClaim {name}: spec.devices.constraints ({constrained}) are not planned: "
            f"the partitioner plans each request by profile alone and kube-scheduler could not "
            f"allocate the devices planned for it together; drop the constraint, or ask for "
            f"one larger profile"
        )
    configured = _configured(claim, planned)
    if configured is not None:
        return (
            f"ResourceClaim {name}: an opaque config for {DRIVER} applies to {configured}; "
            f"gpuslice's devices take no parameters (the node agent refuses to prepare such a "
            f"claim): remove the config from the claim's spec.devices.config"
        )
    return ""


def _covered(entry: Mapping[str, Any], planned: set[str]) -> list[str] | None:
    """The planned requests a ``spec.devices`` config or constraint entry names (its
    ``requests``; a subrequest ``main/sub`` counts as ``main``), ``[]`` when it names none (it
    applies to every request), ``None`` when it names only other requests."""
    named = entry.get("requests") or []
    names = {str(n) for n in named} if isinstance(named, list) else set()
    if not names:
        return []
    hit = sorted(n for n in names if n in planned or n.split("/", 1)[0] in planned)
    return hit or None


def _entries(claim: Obj, field_name: str) -> list[Mapping[str, Any]]:
    """The mappings of the claim's ``spec.devices.<field_name>`` list."""
    items = ((claim.get("spec") or {}).get("devices") or {}).get(field_name) or ()
    return [e for e in items if isinstance(e, Mapping)] if isinstance(items, list) else []


def _constrained(claim: Obj, planned: set[str]) -> str | None:
    """The first entry of the claim's ``spec.devices.constraints`` (``matchAttribute``,
    ``distinctAttribute``: all of its requests' devices share, or all differ in, an attribute)
    that covers a planned request (:func:`_covered`), as text, or ``None``."""
    for c in _entries(claim, "constraints"):
        if _covered(c, planned) is None:
            continue
        what = ", ".join(f"{k} {c[k]}" for k in ("matchAttribute", "distinctAttribute") if c.get(k))
        return what or "a constraint"
    return None


def _configured(claim: Obj, planned: set[str]) -> str | None:
    """Which of the ``planned`` requests an opaque config addressed to gpuslice's driver in the
    claim's ``spec.devices.config`` applies to ("request(s) a, b", or "every request" for a
    config that names none: :func:`_covered`), or ``None``.  The node agent refuses to prepare
    such a claim (``node_agent.dra_claims``), as a DRA driver refuses a config it cannot
    decode (dra.md section 1): read here, the pod is told before a slice is planned for it.  A
    config of the claim's DeviceClass (``FromClass``) is not in the claim's spec; the agent
    still refuses it."""
    for cfg in _entries(claim, "config"):
        opaque = cfg.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != DRIVER:
            continue
        hit = _covered(cfg, planned)
        if hit is not None:
            return f"request(s) {', '.join(hit)}" if hit else "every request"
    return None


def _exact_count(exact: object) -> int:
    """Devices an ``exactly`` request needs (``ExactCount``; 0 for anything else)."""
    if not isinstance(exact, Mapping) or (exact.get("allocationMode") or "ExactCount") != (
        "ExactCount"
    ):
        return 0
    count = exact.get("count", 1)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0


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
        # an admin-access result is no allocation (kube-scheduler does not count it): the
        # device is another claim's, or free, and this claim pins nothing
        if (
            isinstance(r, Mapping)
            and r.get("driver") == DRIVER
            and r.get("adminAccess") is not True
        ):
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
