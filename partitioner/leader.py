"""Leader election: one ``coordination.k8s.io/v1`` Lease decides which replica plans and writes.

Decision
--------
The partitioner elects its leader with a Lease, by client-go's ``leaderelection`` rules, on its
own :class:`~partitioner.kubeapi.KubeApi` (plain GET, POST and PUT of one object), not with kopf
peering.  kopf peering is a presence protocol, not an election: each operator writes its
priority into a (Cluster)KopfPeering object and one that sees a higher priority *pauses its
handlers*; two operators of the same priority both freeze, and there is no lease, deadline or
fencing rule that tells a deposed operator when it must have stopped.  Peering would also pause
the watch handlers that keep a follower's cache warm, and it does not touch the partitioner's
own decision loop (a background task, not a kopf handler), which is what writes.

Model (client-go's, with its defaults: ``lease_duration_s`` 15, ``renew_deadline_s`` 10,
``retry_period_s`` 2)
---------------------------------------------------------------------------------------------
* The Lease ``<namespace>/<name>`` holds ``holderIdentity`` (the pod's name),
  ``leaseDurationSeconds``, ``acquireTime`` and ``renewTime`` (RFC 3339 micro time, from the
  wall clock: informative only) and ``leaseTransitions`` (changes of holder).
* Every attempt (:meth:`LeaderElector.try_acquire_or_renew`) GETs the Lease (absent: POST it;
  a 409 means another candidate created it first).  A candidate never trusts the timestamps in
  the Lease (clocks differ between nodes): it notes *on its own monotonic clock* when it last saw
  the Lease change (``observed_at``), and takes a Lease held by another as expired only once
  ``observed_at + leaseDurationSeconds`` has passed without a change.  Then (or when it holds
  the Lease, or nobody does) it PUTs the whole Lease back with the ``resourceVersion`` it read:
  the API server refuses a stale one with 409, so of two candidates racing for an expired Lease
  exactly one wins.  A new holder increments ``leaseTransitions`` and sets ``acquireTime``.
* The leader renews every ``retry_period_s``.  It leads until ``renew_deadline_s`` after the
  *start* of its last successful attempt (:meth:`~LeaderElector.remaining`, monotonic): an
  attempt that fails, conflicts, or is still in flight then, ends its leadership, and so does
  seeing another holder.  Since the start of an attempt precedes the API server's commit of it,
  which precedes any follower's ``observed_at`` of it, the old leader stops at least
  ``lease_duration_s - renew_deadline_s`` (5 s) *before* any follower may acquire: the margin
  absorbs clock-rate differences (client-go's argument) and the time a write takes.
* Fencing (:class:`FencedApi`): the controller's writes go through a client that refuses to
  send (:class:`NotLeader`) unless :meth:`~LeaderElector.remaining` is positive, and cancels a
  write still in flight when it reaches zero.  So a leader whose event loop froze, whose renewals
  hang, or that was partitioned from the Lease alone, makes no write past its deadline even if
  its election task never ran again.  (Kubernetes has no fencing tokens: a request already
  delivered before the deadline may still be applied after it; spec writes also carry a
  ``resourceVersion``, so such a late write cannot overwrite a newer one.)
* Followers poll every ``retry_period_s`` plus up to ``jitter`` of it (so candidates do not
  retry in lockstep), and wake exactly when the observed Lease expires: failover takes at most
  ``lease_duration_s + retry_period_s (1 + jitter)`` after the leader's last renewal, plus one
  round trip.  A candidate starts only after its cache has synced, so a new leader plans from a
  warm cache at once.
* :meth:`~LeaderElector.release` (on shutdown, after the controller stopped writing) gives the
  Lease up (no holder, ``leaseDurationSeconds`` 1), so a rolling update hands over within one
  retry period instead of a full lease duration.

Everything else runs on every replica: the watches (a warm cache), the health endpoints and
the admission webhook (stateless; its certificate Secret and caBundle writes are idempotent and
resourceVersion-guarded: :mod:`partitioner.webhook_certs`).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from partitioner.kubeapi import ApiError, Conflict, Endpoint, KubeApi, NotFound

__all__ = [
    "LEASE_API_VERSION",
    "ElectionConfig",
    "FencedApi",
    "LeaderElector",
    "Leadership",
    "NotLeader",
    "micro_time",
]

log = logging.getLogger("gpuslice.partitioner.leader")

LEASE_API_VERSION = "coordination.k8s.io/v1"


def micro_time(epoch_s: float) -> str:
    """``epoch_s`` as a Kubernetes MicroTime: RFC 3339 UTC with microseconds."""
    stamp = datetime.datetime.fromtimestamp(epoch_s, datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True, slots=True)
class ElectionConfig:
    """Which Lease, who we are, and client-go's three durations (module docstring)."""

    namespace: str
    name: str
    identity: str
    lease_duration_s: int = 15
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    jitter: float = 0.2
    """Followers wait ``retry_period_s * (1 + jitter * U[0, 1))`` between attempts."""

    def __post_init__(self) -> None:
        for field, value in (("namespace", self.namespace), ("name", self.name)):
            if not value:
                raise ValueError(f"leader election needs a Lease {field}")
        if not self.identity:
            raise ValueError("leader election needs an identity (the pod's name)")
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                f"leader election needs 0 < retry period ({self.retry_period_s:g}s) < renew "
                f"deadline ({self.renew_deadline_s:g}s) < lease duration "
                f"({self.lease_duration_s}s): a leader must stop before its lease can expire"
            )
        if self.jitter < 0:
            raise ValueError(f"jitter ({self.jitter:g}) must be >= 0")


@dataclass(frozen=True, slots=True)
class Leadership:
    """What one replica knows about the election."""

    leader: bool
    """This replica leads now (plans and writes)."""
    holder: str
    """The holder of the Lease as last read ("" none or not read yet)."""


class NotLeader(Exception):
    """A write was refused or cancelled because this replica does not lead (any more)."""


_ELECTION = frozenset(
    {"holderIdentity", "leaseDurationSeconds", "acquireTime", "renewTime", "leaseTransitions"}
)
"""The Lease spec fields the election writes; the others are kept as read (:meth:`_lease`)."""
_KEPT_METADATA = ("labels", "annotations", "ownerReferences", "finalizers")


class LeaderElector:
    """Acquires, renews and releases the Lease; :meth:`remaining` is the fence (module docstring).

    ``monotonic``: the clock of every deadline (tests pass the event loop's); ``wall``: epoch
    seconds for the Lease's informative timestamps; ``on_change``: called with the new
    :class:`Leadership` whenever it changes (from the election task).
    """

    def __init__(
        self,
        api: KubeApi,
        config: ElectionConfig,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        rand: Callable[[], float] = random.random,
        on_change: Callable[[Leadership], None] | None = None,
    ) -> None:
        self.api = api
        self.config = config
        self._monotonic = monotonic
        self._wall = wall
        self._rand = rand
        self._on_change = on_change
        self._valid_until: float | None = None
        self._observed: Mapping[str, Any] | None = None
        self._observed_at = 0.0
        self._reported = Leadership(False, "")
        self._failing = False
        self._released = False
        self.term = 0
        """Bumped each time this replica starts leading (not on a renewal): a caller that
        last saw another term knows it lost the lead in between, however briefly."""
        self.collection = f"/apis/{LEASE_API_VERSION}/namespaces/{config.namespace}/leases"
        self.path = f"{self.collection}/{config.name}"

    # -- the fence -------------------------------------------------------------------------
    def remaining(self) -> float:
        """Seconds this replica still leads (0 when it does not): its write deadline."""
        if self._valid_until is None:
            return 0.0
        return max(0.0, self._valid_until - self._monotonic())

    def is_leader(self) -> bool:
        return self.remaining() > 0

    def fence(self) -> float:
        """:meth:`remaining`, or :class:`NotLeader` when it is 0."""
        left = self.remaining()
        if left <= 0:
            raise NotLeader(
                f"{self.config.identity} does not hold Lease "
                f"{self.config.namespace}/{self.config.name}; not writing"
            )
        return left

    @property
    def holder(self) -> str:
        return str((self._observed or {}).get("holderIdentity") or "")

    def leadership(self) -> Leadership:
        return Leadership(self.is_leader(), self.holder)

    # -- one attempt -----------------------------------------------------------------------
    def _spec(self, now: str, acquired: str, transitions: int) -> dict[str, Any]:
        return {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": self.config.lease_duration_s,
            "acquireTime": acquired,
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def _observe(self, lease: Mapping[str, Any]) -> Mapping[str, Any]:
        spec: Mapping[str, Any] = lease.get("spec") or {}
        if spec != self._observed:
            self._observed, self._observed_at = dict(spec), self._monotonic()
        return spec

    def _expires_at(self) -> float:
        """Monotonic time at which the observed Lease expires for this replica."""
        spec = self._observed or {}
        if not spec.get("holderIdentity"):
            return -math.inf
        duration = spec.get("leaseDurationSeconds") or self.config.lease_duration_s
        return self._observed_at + float(duration)

    async def try_acquire_or_renew(self) -> bool:
        """One attempt: ``True`` when this replica holds the Lease (renewed or acquired)."""
        cfg = self.config
        if self._released:
            return False
        started = self._monotonic()
        now = micro_time(self._wall())
        try:
            lease = await self.api.request("GET", self.path)
        except NotFound:
            try:
                created = await self.api.create(
                    self.collection, self._lease(self._spec(now, now, 0))
                )
            except Conflict:  # another candidate created it first
                return False
            self._observe(created)
            return self._lead_from(started)
        spec = self._observe(lease)
        holder = str(spec.get("holderIdentity") or "")
        mine = holder == cfg.identity
        if holder and not mine and self._monotonic() < self._expires_at():
            self._valid_until = None  # another replica holds a live lease
            return False
        renewing = mine and self.is_leader()
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if mine else 1)
        acquired = str(spec.get("acquireTime") or now) if renewing else now
        body = self._lease(self._spec(now, acquired, transitions), lease)
        try:
            updated = await self.api.request("PUT", self.path, body)
        except Conflict:  # the Lease changed since it was read: whoever changed it, we do not
            self._valid_until = None  # know we still hold it
            return False
        self._observe(updated)
        return self._lead_from(started)

    def _lease(self, spec: dict[str, Any], read: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The Lease object to write with ``spec``; an update carries the resourceVersion of
        the Lease ``read`` (optimistic concurrency: 409 if it changed since) and keeps what
        else it holds -- labels, annotations, owner references, spec fields other than the
        election's (``strategy``, ``preferredHolder``) -- as client-go's LeaseLock does: an
        update replaces the whole object, and a body built from scratch wiped them."""
        meta: dict[str, Any] = {"name": self.config.name, "namespace": self.config.namespace}
        if read is not None:
            old = read.get("metadata") or {}
            meta |= {k: old[k] for k in _KEPT_METADATA if k in old}
            meta["resourceVersion"] = old.get("resourceVersion")
            others = {k: v for k, v in (read.get("spec") or {}).items() if k not in _ELECTION}
            spec = others | spec
        return {"apiVersion": LEASE_API_VERSION, "kind": "Lease", "metadata": meta, "spec": spec}

    def _lead_from(self, started: float) -> bool:
        if self._released:  # released while this attempt was in flight
            return False
        if not self.is_leader():  # a new term, not a renewal
            self.term += 1
        self._valid_until = started + self.config.renew_deadline_s
        return True

    async def release(self) -> bool:
        """Give the Lease up if this replica holds it: stop leading first, then clear it.

        The elector never takes the Lease again afterwards (it is shutting down).
        """
        cfg = self.config
        held = self.is_leader()
        self._released = True
        self._valid_until = None
        self._report()
        if not held:
            return False
        try:
            lease = await self.api.request("GET", self.path)
            if (lease.get("spec") or {}).get("holderIdentity") != cfg.identity:
                return False
            now = micro_time(self._wall())
            spec = dict(lease.get("spec") or {})
            spec.pop("holderIdentity", None)
            spec.update(leaseDurationSeconds=1, acquireTime=now, renewTime=now)
            self._observe(await self.api.request("PUT", self.path, self._lease(spec, lease)))
        except (ApiError, TimeoutError) as e:  # refused, or unreachable (Unreachable)
            log.warning("could not release Lease %s/%s: %s", cfg.namespace, cfg.name, e)
            return False
        log.info("released Lease %s/%s", cfg.namespace, cfg.name)
        return True

    # -- the loop --------------------------------------------------------------------------
    def _report(self) -> None:
        now = self.leadership()
        if now == self._reported:
            return
        before, self._reported = self._reported, now
        lease = f"{self.config.namespace}/{self.config.name}"
        if now.leader and not before.leader:
            log.info("%s became the leader (Lease %s)", self.config.identity, lease)
        elif before.leader and not now.leader:
            log.warning(
                "%s stopped leading (Lease %s, holder now %r): no more writes",
                self.config.identity,
                lease,
                now.holder,
            )
        elif not now.leader and now.holder != before.holder:
            log.info("following %r (Lease %s)", now.holder, lease)
        if self._on_change is not None:
            self._on_change(now)

    def _pause(self) -> float:
        cfg = self.config
        if self.is_leader():
            return min(cfg.retry_period_s, self.remaining())
        wait = cfg.retry_period_s * (1 + cfg.jitter * self._rand())
        until_expiry = self._expires_at() - self._monotonic()
        if 0 <= until_expiry < wait:
            wait = until_expiry + 1e-3
        return max(0.0, wait)

    async def run(self) -> None:
        """Attempt every retry period until cancelled; never raises otherwise."""
        cfg = self.config
        while True:
            leading = self.is_leader()
            budget = self.remaining() if leading else cfg.renew_deadline_s
            try:
                async with asyncio.timeout(budget):
                    await self.try_acquire_or_renew()
                if self._failing:
                    log.info("Lease %s/%s reachable again", cfg.namespace, cfg.name)
                self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not self._failing:  # one line per outage, not one per attempt
                    log.warning(
                        "leader election: Lease %s/%s attempt failed (retrying every %gs): %s",
                        cfg.namespace,
                        cfg.name,
                        cfg.retry_period_s,
                        f"{type(e).__name__}: {e}" if str(e) else type(e).__name__,
                    )
                self._failing = True
                if leading and not self.is_leader():
                    self._valid_until = None
            self._report()
            await asyncio.sleep(self._pause())
            self._report()  # a deadline may have passed while sleeping


class FencedApi(KubeApi):
    """A :class:`KubeApi` whose writes are fenced by ``fence`` (e.g. :meth:`LeaderElector.fence`).

    Before a write (any method but GET) ``fence()`` returns the seconds left to write or raises
    :class:`NotLeader`; the write is cancelled when those run out, and then raises
    :class:`NotLeader` too (never an :class:`ApiError`: the writer lets it end the step).
    """

    def __init__(
        self, endpoint: Callable[[], Endpoint], fence: Callable[[], float], timeout_s: float = 30.0
    ) -> None:
        super().__init__(endpoint, timeout_s)
        self._fence = fence

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        *,
        query: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        if method.upper() == "GET":
            return await super().request(method, path, body, content_type, query=query)
        left = self._fence()
        deadline = asyncio.timeout(left)
        try:
            async with deadline:
                return await super().request(method, path, body, content_type, query=query)
        except TimeoutError as e:
            if deadline.expired():
                raise NotLeader(f"{method} {path} cancelled: leadership ended in flight") from e
            raise
