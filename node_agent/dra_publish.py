"""Publishing this node's ResourceSlices through the Kubernetes API (kubernetes_asyncio).

Model
-----
The pool is the node's: every slice of this driver whose ``spec.nodeName`` is this node
(:mod:`node_agent.dra_slices` builds them).  :meth:`SlicePublisher.publish` converges the API to
the wanted slices:

1. List the driver's slices of this node (field selectors ``spec.nodeName``, ``spec.driver``,
   checked again on the answers).
2. If the stored slices are the wanted ones at the stored generation, nothing is written (a
   resync of an unchanged node costs one list).  "The same" is as the API server stores a
   spec, not string for string: quantities (capacities, counters) are compared by value --
   the server answers them in canonical form (``40960Mi`` as ``40Gi``,
   :mod:`contract.quantity`; the slices are written in that form too) -- and fields it
   omits when empty (``null``, ``[]``, ``{}``) count as absent on both sides.  Comparing the
   strings rewrote every slice at a new generation each round on GPUs whose memory is a whole
   number of GiB (A100, A30, H200, B200, GB200, GH200), the pool incomplete meanwhile.
3. If exactly one slice differs (one GPU narrowed or withdrawn) and every stored slice is at
   the stored generation, that slice alone is patched at that generation: the pool stays
   complete for the scheduler (shared/facts/dra.md, consequence 2).  Else the pool's
   generation is bumped (one above the highest stored) and every wanted slice is written at it: created, or updated by a JSON merge patch that carries the stored
   ``resourceVersion`` (a concurrent writer gets ``409`` and the next round starts over); then
   slices no longer wanted are deleted.  Consumers use only the highest generation and skip a
   pool until all ``resourceSliceCount`` slices of it are there, so the pool is never read
   half-written (shared/facts/dra.md section 2).
4. Counter slices are written first and read back before any device slice is written: an API
   server whose DRAPartitionableDevices gate is off drops ``sharedCounters`` and
   ``consumesCounters`` silently, which would let the scheduler allocate overlapping
   placements.  If the counters did not survive, no device slice is written at all (writing
   them first and deleting them after the read-back left every placement allocatable without
   counters for a moment each round); every slice of the node is deleted and
   :class:`PublishError` says so and names the fix.  The publisher remembers it: until the
   next check (after ``gate_probe_s``, doubling up to ``gate_probe_max_s``) a round raises the
   same error without writing, and the check writes the counter slices alone again.  The
   device slices are read back too (their ``consumesCounters``), deleted and refused likewise.

Device taints (:data:`~node_agent.dra_slices.UNUSABLE_TAINT_KEY`, on devices no new claim can
use): the API server stamps a taint's ``timeAdded`` when it is not sent, so each wanted taint
takes the stamp of the same taint (key, value, effect) on the same device as stored, and an
unchanged round still writes nothing.  An API server whose DRADeviceTaints gate is off (before
Kubernetes 1.36, or switched off) drops ``taints`` silently: the read-back notices it, logs one
warning and publishes no taints from then on (comparing slices that carry them with stored ones
that never will would rewrite the pool every round).  Nothing else changes there: an untainted
device is what every release before this one published, and the driver's lingering poll still
withdraws it within ``spec_poll_s`` of its claim's deallocation.

Slices carry an owner reference to the Node when its UID is given, so they are
garbage-collected with the Node.  With ``node_uid_reader`` the UID is read again before every
round that writes: a Node deleted and registered again under its name (``kubectl delete node``,
a replaced VM) has a new UID, and slices owned by the old one are deleted by the garbage
collector as soon as they are written -- with the UID read once at start the pool was
published, collected and published again forever.  Errors are one-line :class:`PublishError` naming the slice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any

from contract.quantity import quantity_value
from node_agent.agent import MERGE_PATCH
from node_agent.dra_slices import DRIVER, DraGpu, resource_slices

__all__ = ["GROUP", "PLURAL", "VERSION", "PublishError", "SlicePublisher"]

log = logging.getLogger(__name__)

GROUP = "resource.k8s.io"
VERSION = "v1"
PLURAL = "resourceslices"


class PublishError(Exception):
    """Publishing failed (the message names the slice and the cause)."""


def _dropped(sent: Mapping[str, Any], got: Mapping[str, Any]) -> bool:
    """Did the server drop counters from the slice we sent?"""
    s, g = sent.get("spec") or {}, got.get("spec") or {}
    if s.get("sharedCounters") and not g.get("sharedCounters"):
        return True
    got_devices = {d.get("name"): d for d in g.get("devices") or ()}
    for d in s.get("devices") or ():
        if d.get("consumesCounters") and not (got_devices.get(d["name"]) or {}).get(
            "consumesCounters"
        ):
            return True
    return False


def _taints_dropped(sent: Mapping[str, Any], got: Mapping[str, Any]) -> bool:
    """Did the server drop the taints of some device we sent?"""
    got_devices = {d.get("name"): d for d in (got.get("spec") or {}).get("devices") or ()}
    return any(
        d.get("taints") and not (got_devices.get(d["name"]) or {}).get("taints")
        for d in (sent.get("spec") or {}).get("devices") or ()
    )


def _stamped(wanted: Sequence[dict[str, Any]], stored: Mapping[str, Mapping[str, Any]]) -> None:
    """Give each wanted taint the ``timeAdded`` of the same taint of the same device as stored
    (the server stamps one it is not sent: module docstring)."""
    stamps: dict[tuple[str, str, str, str], str] = {}
    for s in stored.values():
        for d in (s.get("spec") or {}).get("devices") or ():
            for t in d.get("taints") or ():
                if t.get("timeAdded"):
                    key = (d.get("name"), t.get("key"), t.get("value", ""), t.get("effect"))
                    stamps[key] = t["timeAdded"]
    for s in wanted:
        for d in s["spec"].get("devices") or ():
            for t in d.get("taints") or ():
                stamp = stamps.get((d["name"], t["key"], t.get("value", ""), t["effect"]))
                if stamp is not None:
                    t["timeAdded"] = stamp


def _generation(obj: Mapping[str, Any]) -> int:
    """The pool generation of a stored slice (0 when it has none)."""
    return int(((obj.get("spec") or {}).get("pool") or {}).get("generation") or 0)


def _at(spec: Mapping[str, Any], generation: int) -> dict[str, Any]:
    """``spec`` with its pool at ``generation``."""
    return {**spec, "pool": {**spec["pool"], "generation": generation}}


_QUANTITY_MAPS = frozenset({"capacity", "counters"})
"""The spec keys whose entries hold quantities (``capacity.<name>.value``, its request policy,
``counters.<name>.value`` of shared and consumed counters)."""


def _comparable(obj: Any, quantities: bool = False) -> Any:
    """``obj`` (part of a slice spec) as compared for "unchanged" (module docstring): a
    quantity under :data:`_QUANTITY_MAPS` by its value
    (:func:`~contract.quantity.quantity_value`, so ``40Gi`` equals ``40960Mi``), and fields
    the server omits when empty (``null``, ``[]``, ``{}``: ``omitempty``) left out on both
    sides."""
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            c = _comparable(v, quantities or k in _QUANTITY_MAPS)
            if c is not None and c != [] and c != {}:
                out[k] = c
        return out
    if isinstance(obj, list):
        return [_comparable(v, quantities) for v in obj]
    if quantities and isinstance(obj, str):
        value = quantity_value(obj)
        return obj if value is None else ("quantity", value)
    return obj


def _same(stored: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> bool:
    """Is ``stored`` (a spec as the server answers it) the ``wanted`` spec (:func:`_comparable`)?"""
    return _comparable(stored or {}) == _comparable(wanted)


class SlicePublisher:
    """Keeps this node's ResourceSlices equal to the wanted ones (module docstring)."""

    def __init__(
        self,
        api: Any,
        node: str,
        gpus: Sequence[DraGpu],
        *,
        node_uid: str | None = None,
        node_uid_reader: Callable[[], Awaitable[str | None]] | None = None,
        driver: str = DRIVER,
        request_timeout_s: float = 10.0,
        gate_probe_s: float = 30.0,
        gate_probe_max_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.node = node
        self.gpus = list(gpus)
        self.node_uid = node_uid
        self.node_uid_reader = node_uid_reader
        """Reads the Node's current UID before a round that writes (module docstring)."""
        self.driver = driver
        self.request_timeout_s = request_timeout_s
        self.writes = 0
        """Slices created, patched or deleted so far (for tests and metrics)."""
        self.taints = True
        """Whether devices are published with their taints: ``False`` once the API server
        dropped them (module docstring)."""
        self.gate_probe_s = gate_probe_s
        self.gate_probe_max_s = gate_probe_max_s
        self.clock = clock
        self.gate_off: str | None = None
        """The refusal while the API server is known to drop counters (module docstring, 4);
        ``None`` when it kept them at the last check."""
        self._probe_wait = 0.0
        self._probe_at = 0.0

    async def stored(self) -> dict[str, dict[str, Any]]:
        """This node's slices of this driver, by name."""
        answer = await self.api.list_cluster_custom_object(
            GROUP,
            VERSION,
            PLURAL,
            field_selector=f"spec.nodeName={self.node},spec.driver={self.driver}",
            _request_timeout=self.request_timeout_s,
        )
        out: dict[str, dict[str, Any]] = {}
        for item in answer.get("items") or ():
            spec = item.get("spec") or {}
            if spec.get("nodeName") == self.node and spec.get("driver") == self.driver:
                out[item["metadata"]["name"]] = item
        return out

    def _wanted(
        self,
        generation: int,
        publish: Collection[str] | None,
        tainted: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        return self._owned(
            resource_slices(
                self.node, self.gpus, generation, publish, tainted if self.taints else None
            )
        )

    def _owned(self, out: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``out`` with the Node as every slice's owner (when its UID is known)."""
        for s in out:
            s["metadata"].pop("ownerReferences", None)
            if self.node_uid:
                s["metadata"]["ownerReferences"] = [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": self.node,
                        "uid": self.node_uid,
                        "controller": True,
                    }
                ]
        return out

    async def _patched(self, name: str, stored: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
        """Merge-patch a stored slice to ``want`` (guarded by its resourceVersion); ``False``
        if it is gone (404)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        meta: dict[str, Any] = {"resourceVersion": stored["metadata"].get("resourceVersion")}
        if self.node_uid:
            meta["ownerReferences"] = want["metadata"]["ownerReferences"]
        try:
            await self.api.patch_cluster_custom_object(
                GROUP,
                VERSION,
                PLURAL,
                name,
                {"metadata": meta, "spec": want["spec"]},
                _content_type=MERGE_PATCH,
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    async def publish(
        self, publish: Collection[str] | None = None, tainted: Mapping[str, str] | None = None
    ) -> bool:
        """Converge; return whether anything was written.  ``publish`` narrows the devices
        (planner-shaped publishing; ``None``: every placement); ``tainted``: the published
        devices no new claim can use, with why (:func:`~node_agent.dra_slices.resource_slices`)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        if self.gate_off is not None and self.clock() < self._probe_at:
            raise PublishError(
                f"{self.gate_off} (checked again in {self._probe_at - self.clock():.0f} s)"
            )
        try:
            stored = await self.stored()
        except ApiException as e:
            raise PublishError(f"listing ResourceSlices of node {self.node}: {_why(e)}") from None
        generation = max((_generation(s) for s in stored.values()), default=0)
        wanted = self._wanted(generation + 1, publish, tainted)
        _stamped(wanted, stored)
        writes = wanted
        if generation and {s["metadata"]["name"] for s in wanted} == set(stored):
            differ = [
                s
                for s in wanted
                if not _same(stored[s["metadata"]["name"]].get("spec"), _at(s["spec"], generation))
            ]
            if not differ:
                return False  # the stored slices are these, at the stored generation
            if len(differ) == 1 and all(_generation(s) == generation for s in stored.values()):
                # one slice changed (one GPU narrowed or withdrawn): it alone is written, at the
                # stored generation, so the pool stays complete for the scheduler meanwhile
                # (shared/facts/dra.md, consequence 2) instead of every slice at a new one
                for s in wanted:
                    s["spec"] = _at(s["spec"], generation)
                writes = differ
        if self.node_uid_reader is not None:
            try:
                self.node_uid = await self.node_uid_reader()
            except ApiException as e:
                raise PublishError(f"reading Node {self.node}: {_why(e)}") from None
            self._owned(wanted)
        counted = [s for s in writes if "sharedCounters" in s["spec"]]
        await self._write(counted, stored)
        if counted:
            # the counters must survive before any device is published (module docstring, 4)
            now = await self._now()
            lost = [
                s["metadata"]["name"]
                for s in counted
                if s["metadata"]["name"] in now and _dropped(s, now[s["metadata"]["name"]])
            ]
            if lost:
                await self._delete(sorted(now))
                self._refuse(lost)
            if self.gate_off is not None:
                log.info(
                    "the API server keeps the counters of node %s's ResourceSlices now: "
                    "publishing its devices",
                    self.node,
                )
                self.gate_off = None
                self._probe_wait = 0.0
        await self._write([s for s in writes if "sharedCounters" not in s["spec"]], stored)
        now = await self._now()  # what the server kept (its answers may be empty)
        names = {s["metadata"]["name"] for s in wanted}
        dropped = [
            s["metadata"]["name"]
            for s in wanted
            if s["metadata"]["name"] in now and _dropped(s, now[s["metadata"]["name"]])
        ]
        if self.taints and any(
            _taints_dropped(s, now[s["metadata"]["name"]])
            for s in wanted
            if s["metadata"]["name"] in now
        ):
            self.taints = False
            log.warning(
                "the API server dropped the device taints of node %s's ResourceSlices: its "
                "DRADeviceTaints feature gate is off (beta, on by default from Kubernetes "
                "1.36). Publishing without them: a freed device an XID hit or a foreign "
                "process uses can be allocated until the agent's next round withdraws it",
                self.node,
            )
        await self._delete(sorted((set(now) - names) | set(dropped)))
        if dropped:
            self._refuse(dropped)
        log.info(
            "published %d ResourceSlice(s) of node %s at generation %d",
            len(wanted),
            self.node,
            generation + 1,
        )
        return True

    async def _write(self, slices: Sequence[dict[str, Any]], stored: dict[str, Any]) -> None:
        """Create or patch each of ``slices`` (``stored``: the node's slices as listed)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        for s in slices:
            name = s["metadata"]["name"]
            try:
                if name in stored and not await self._patched(name, stored[name], s):
                    stored.pop(name)  # deleted meanwhile (a starting kubelet): create it
                if name not in stored:
                    await self.api.create_cluster_custom_object(
                        GROUP, VERSION, PLURAL, s, _request_timeout=self.request_timeout_s
                    )
            except ApiException as e:
                raise PublishError(f"writing ResourceSlice {name}: {_why(e)}") from None
            self.writes += 1

    async def _now(self) -> dict[str, dict[str, Any]]:
        """:meth:`stored`, its failure a :class:`PublishError`."""
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            return await self.stored()
        except ApiException as e:
            raise PublishError(f"listing ResourceSlices of node {self.node}: {_why(e)}") from None

    async def _delete(self, names: Sequence[str]) -> None:
        """Delete these slices (one already gone is fine)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        for name in names:
            try:
                await self.api.delete_cluster_custom_object(
                    GROUP, VERSION, PLURAL, name, _request_timeout=self.request_timeout_s
                )
            except ApiException as e:
                if e.status != 404:
                    raise PublishError(f"deleting ResourceSlice {name}: {_why(e)}") from None
            self.writes += 1

    def _refuse(self, dropped: Sequence[str]) -> None:
        """The API server dropped the counters of ``dropped``: remember it, schedule the next
        check (backing off) and raise (module docstring, 4)."""
        self.gate_off = (
            f"the API server dropped the counters of ResourceSlice {dropped[0]} (and "
            f"{len(dropped) - 1} more): its DRAPartitionableDevices feature gate is off. "
            "Enable it on kube-apiserver and kube-scheduler (beta, on by default from "
            "Kubernetes 1.36), or run gpuslice in device-plugin mode; the slices were removed"
        )
        self._probe_wait = min(
            self.gate_probe_max_s, self._probe_wait * 2 if self._probe_wait else self.gate_probe_s
        )
        self._probe_at = self.clock() + self._probe_wait
        raise PublishError(self.gate_off)


def _why(e: Any) -> str:
    import json

    try:
        message = json.loads(e.body).get("message")
    except (TypeError, ValueError, AttributeError):
        message = None
    return f"HTTP {e.status} {message or e.reason}"
