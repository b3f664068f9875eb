"""The kopf operator: thin handlers that feed a cache, and a loop that runs the decision step.

Wiring
------
* ``on.event`` handlers for Nodes, Pods and NodePartitionings (cluster-wide) fold every event
  into the :class:`Controller`'s :class:`~partitioner.index.ClusterIndex` (parsed once per
  change, trimmed to what the controller reads).  While a decision step runs in its worker
  thread, events are buffered and folded in right after it, so the step reads a consistent
  index.  The handlers never patch the watched objects, so kopf adds no finalizers or
  annotations to Nodes and Pods.
* Every ``lease_poll_seconds`` the cycle lists the node agents' heartbeat Leases
  (:meth:`Controller._poll_leases`, :mod:`.agent_leases`) and tells the index which agents have
  stopped renewing theirs (a change of that set is a change of the index).
* ``on.login`` keeps kopf's usual login (service account, then kubeconfig) unless a connection
  was given, and shares it with the partitioner's own writer client (:mod:`.kubeapi`).  Every
  login reads the credentials afresh (:attr:`Controller.given_connection` aside): after a 401
  kopf logs in again and refuses the credentials it has just seen rejected, so a rotated
  service-account token (the kubelet rewrites the file), a revoked one or an exec plugin's
  short-lived one is picked up, by kopf's watches and by the partitioner's own client, whose
  next request uses the new login (:meth:`Controller._endpoint`).
* ``on.startup`` starts :meth:`Controller.run`: it lists the three resources once (so the first
  decision never sees pods without their nodes; a listing reconciles the index: objects it
  lacks are dropped, older versions never overwrite newer ones, and what the watches reported
  after the listing's snapshot stays), in pages of
  ``list_page_size`` (:meth:`~partitioner.kubeapi.KubeApi.list_all`); while the API server
  cannot be listed it retries with exponential backoff and jitter (:attr:`Controller.backoff`:
  1 s doubling up to 30 s), logging one WARNING when the outage starts and one INFO when the
  listing succeeds (:func:`~partitioner.kubeapi.retry_with_backoff`).  When kopf lists a kind
  again (its watch lost its place: ``410 Gone``, a dropped connection), objects deleted in that
  gap get no ``DELETED`` event, so the next cycle lists that kind itself first
  (:meth:`Controller._note_listing`); NodePartitionings and ResourceClaims, kinds that can run
  out of objects and then show no gap, are listed again every ``relist_seconds``
  (:meth:`Controller._note_periodic_listings`).  Then every ``cycle_seconds``,
  and ``react_seconds`` after a watch event that changed the index (:meth:`Controller._pause`),
  calls :func:`partitioner.decide.decide` with the index and the wall clock (reservation
  deadlines are stored on pods in that clock), carries the actions out (:mod:`.writer`), folds
  the written objects back into the index and records metrics.  ``on.cleanup`` stops it.
* Health (:mod:`.health`): the loop tells :attr:`Controller.health` when it started, when the
  initial listing completed (readiness) and how each step ended (liveness: stale when no step
  completed for ``liveness_stale_seconds``, failing after ``liveness_failed_steps`` steps that
  raised in a row); :class:`~partitioner.health.HealthServer` serves ``/healthz`` and
  ``/readyz`` from those.  kopf's own liveness endpoint is not used: its probe handlers can only
  report values, never a failure the kubelet would act on.

Logging (:func:`configure_logging`): kopf's records and ours go through one handler in the
format of :mod:`contract.logs` (``GPUSLICE_LOG_FORMAT``: text or json; fields ts, level, logger,
msg, then pod/node/plan where known, kopf's object references included).  Every handler has an
id, so kopf names them (``Handler 'watch-pods' succeeded.``), never by their Python
qualname.  kopf's per-event ``Handler '...' succeeded.`` (one per watch event of every pod) and
aiohttp's access lines (one per admission request) are routine: they are logged at DEBUG.

Leader election (:mod:`partitioner.leader`; ``leader_election_enabled``, on in the chart with 2
replicas): kopf runs ``standalone`` on every replica (no kopf peering: see that module for why),
so every replica watches and keeps its index warm, serves health and the admission webhook.
Once its initial listing completed, a replica becomes a candidate for the Lease.  Only the
leader runs decision steps; its writes go through :class:`~partitioner.leader.FencedApi`, so no
write starts, and none in flight survives, past its lease deadline (``renew_deadline``, before
the lease can expire for the others).  A step cut short that way ends quietly (the next leader
plans from the API state).  A follower's cycle decides nothing.  A replica that (re)gains the
lead starts from a fresh :class:`~partitioner.decide.ControllerState`, as after a restart (the
state it kept may predate the other leader's plans).  On shutdown the leader stops its loop
first, then releases the Lease, so a rolling update hands over within one retry period.  Without
election the controller always leads: run one replica (the chart then uses ``Recreate``).

Restart: nothing lives only in memory except the batch window and the Events already emitted
(node cool-downs are written on the node's NodePartitioning, annotation
``gpuslice.io/cooldown``, where it has one).  The index is rebuilt from the API; every reservation is on its pod (annotation
``gpuslice.io/reservation``), so a gated pod planned before the restart is released when its
node applies, a released pod keeps its slice, and nothing is planned twice; pods still waiting
open a new window; plan ids continue after the largest in the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TextIO

import kopf

from contract import logs
from contract.catalog_files import load_catalog
from contract.nodepartitioning import GROUP, PLURAL, VERSION
from partitioner.actions import WriteSpec
from partitioner.agent_leases import LEASE_SELECTOR, AgentLeases
from partitioner.batching import forget
from partitioner.decide import (
    ControllerState,
    Decision,
    PlanFn,
    decide,
)
from partitioner.health import ControllerHealth
from partitioner.heap import HeapKeeper
from partitioner.index import ClusterIndex
from partitioner.kubeapi import Backoff, Endpoint, KubeApi, retry_with_backoff
from partitioner.leader import ElectionConfig, FencedApi, LeaderElector, Leadership, NotLeader
from partitioner.metrics import Metrics
from partitioner.settings import PartitionerSettings
from partitioner.webhook import register_webhook
from partitioner.writer import NP_PATH, Outcome, WriteBackoff, execute
from planner.catalog import Catalog

__all__ = [
    "Controller",
    "build_registry",
    "configure_logging",
    "cool_refused_specs",
    "endpoint_from",
    "run_operator",
]

log = logging.getLogger("gpuslice.partitioner")

_LISTS = {"nodes": "/api/v1/nodes", "pods": "/api/v1/pods", "partitionings": NP_PATH}
RELIST_QUIET_S = 30.0
"""A listed object this long after the previous one of its kind starts a new kopf listing
(:meth:`Controller._note_listing`); one listing's objects come seconds apart at most."""
RELIST_CHUNK = 100
"""Listed objects folded into the index between two yields to the event loop (:meth:`Controller.sync`):
a relisting of tens of thousands of pods must not hold up the admission webhook (its
``timeoutSeconds`` is 5, failing open) and the Lease renewals that share the loop."""
LEASES_PATH = "/apis/coordination.k8s.io/v1/leases"
"""Listed every ``lease_poll_seconds`` with :data:`~partitioner.agent_leases.LEASE_SELECTOR`:
the node agents' heartbeats (in ``agent_lease_namespace`` when set: the release's)."""
CLAIMS_PATH = "/apis/resource.k8s.io/v1/resourceclaims"
"""Listed and watched with ``dra_enabled`` (DRA nodes' demand, partitioner.claims)."""


def _routine(record: logging.LogRecord) -> bool:
    """kopf's success line of a watch-event handler, or an aiohttp access line."""
    if record.name == "aiohttp.access":
        return record.levelno == logging.INFO
    return (
        record.name == "kopf.objects"
        and record.levelno == logging.INFO
        and getattr(record, "k8s_skip", False) is True  # kopf's per-event (local) logger
        and record.getMessage().endswith(" succeeded.")
    )


class _RoutineAsDebug(logging.Filter):
    """Logs :func:`_routine` records at DEBUG: dropped unless the level is DEBUG."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool | logging.LogRecord:
        if not _routine(record):
            return True
        if self.level > logging.DEBUG:
            return False
        copy = logging.makeLogRecord(record.__dict__)
        copy.levelno, copy.levelname = logging.DEBUG, "DEBUG"
        return copy


def configure_logging(
    settings: PartitionerSettings, stream: TextIO | None = None
) -> logging.Handler:
    """Log kopf's records and the partitioner's in ``settings.log_format`` at ``log_level``.

    Replaces ``kopf.configure`` (whose plain format has no time or level): one root handler
    (:func:`contract.logs.configure`) with the routine-to-DEBUG filter (module docstring).
    ``stream``: where lines go (default stderr).  Returns the handler.
    """
    handler = logs.configure(settings.log_format, settings.log_level, stream=stream)
    handler.addFilter(_RoutineAsDebug(logging.getLevelNamesMapping()[settings.log_level]))
    return handler


def endpoint_from(info: kopf.ConnectionInfo) -> Endpoint:
    secure = info.server.startswith("https://")
    return Endpoint(
        server=info.server,
        headers=info.as_http_headers(),
        ssl=info.as_ssl_context() if secure else True,
    )


def cool_refused_specs(
    state: ControllerState,
    refused: Mapping[str, Sequence[str]],
    now: float,
    cooldown_s: float,
) -> ControllerState:
    """The state after spec writes the API server refused for good (an older CRD schema, an
    admission policy; ``refused``: node -> the pods of that plan): each node cools down, so
    the next plan puts its pods elsewhere, and the pods go back to the next window.  The same
    write would be refused again: before, the same node was planned every batch and its pods
    waited for good, told nothing but ``Gated``."""
    until = now + cooldown_s
    cooldown, why = dict(state.cooldown), dict(state.cooldown_why)
    for node in refused:
        if until > cooldown.get(node, 0.0):
            cooldown[node], why[node] = until, "WriteRefused"
    retry = [p for pods in refused.values() for p in pods]
    return replace(state, cooldown=cooldown, cooldown_why=why, window=forget(state.window, retry))


class Controller:
    """The cache of watched objects, the controller state, and the cycle that acts on them."""

    def __init__(
        self,
        settings: PartitionerSettings,
        *,
        catalog: Catalog | None = None,
        planner: PlanFn | None = None,
        connection: kopf.ConnectionInfo | None = None,
        metrics: Metrics | None = None,
        offload: bool = True,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        list_page_size: int = 500,
        backoff: Backoff | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self.list_page_size = list_page_size
        """Objects per page of the initial listing (``limit``)."""
        self.backoff = backoff if backoff is not None else Backoff(initial_s=1.0, cap_s=30.0)
        """Waits between failed attempts of the initial listing (``rand``: its jitter)."""
        self._rand = rand
        cat = catalog if catalog is not None else load_catalog(settings.catalog_files)
        self.config = settings.decide_config(cat, planner)
        self.metrics = metrics if metrics is not None else Metrics()
        self.offload = offload
        """Run the decision step in a worker thread (planning must not stall the watchers)."""
        self.clock = clock
        """Seconds since the epoch (tests pass the event loop's fake clock)."""
        self.health = ControllerHealth(
            settings.liveness_stale_seconds, settings.liveness_failed_steps, monotonic
        )
        """Liveness and readiness of :meth:`run` (``monotonic``: its clock, in seconds)."""
        self.heap = HeapKeeper(settings.heap_reclaim_seconds, monotonic)
        """Keeps the cache out of the cyclic collector's walks (started after the listing)."""
        self.index = ClusterIndex(cat)
        self._buffered: list[tuple[str, str | None, Mapping[str, Any]]] | None = None
        self.state = ControllerState()
        self.given_connection = connection
        """The connection passed in (tests, tools): every kopf login returns it.  Without one,
        each login (the first, and kopf's re-login after a 401) reads the credentials afresh:
        the service account's token file (rotated by the kubelet), else the kubeconfig."""
        self.connection = connection
        """The latest login's connection: the partitioner's own clients use it (:meth:`_endpoint`)."""
        self._login: tuple[kopf.ConnectionInfo, Endpoint] | None = None
        self.instance = socket.gethostname()
        self.api = KubeApi(self._endpoint)
        """Reads, the Lease and the webhook's certificate: every replica uses it."""
        self.elector: LeaderElector | None = None
        self.writer_api = self.api
        """The decision step's writes: fenced by the Lease with leader election."""
        if settings.leader_election_enabled:
            config = ElectionConfig(
                namespace=settings.leader_election_namespace,
                name=settings.leader_election_lease_name,
                identity=settings.leader_election_identity or self.instance,
                lease_duration_s=settings.leader_election_lease_duration_seconds,
                renew_deadline_s=settings.leader_election_renew_deadline_seconds,
                retry_period_s=settings.leader_election_retry_period_seconds,
            )
            self.elector = LeaderElector(
                self.api, config, monotonic=monotonic, wall=clock, on_change=self._leadership
            )
            self.writer_api = FencedApi(self._endpoint, self._fence)
        self._leadership(Leadership(self.elector is None, ""))
        self._was_leading = False
        self._term = 0
        """The elector's term at the last cycle (:attr:`LeaderElector.term`)."""
        self._step_term = 0
        """The elector's term when the running step began: its writes are fenced by it."""
        self._election: asyncio.Task[None] | None = None
        self.last_decision: Decision | None = None
        self.last_cycle: float | None = None
        self._logged_in = asyncio.Event()
        self._awaiting_applied: dict[str, tuple[int, float]] = {}
        self._refusals_told: dict[str, str] = {}
        """Pod uid -> the refused patch last told in an Event (:func:`partitioner.writer.execute`)."""
        self.write_backoff = WriteBackoff(
            base_s=settings.cycle_seconds, cap_s=60 * settings.cycle_seconds, clock=monotonic
        )
        """Refused writes to nodes and NodePartitionings, held back per object: a cycle at
        first, doubling up to 60 cycles (:class:`~partitioner.writer.WriteBackoff`)."""
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()
        """Set when a watch event changed the index since the last step began reading it."""
        self._monotonic = monotonic
        self._listings: dict[str, tuple[bool, float]] = {}
        """kind -> (a watch event came since kopf's last listed object, when that object came)."""
        self.relist_due: set[str] = set()
        """Kinds kopf listed again after a gap in its watch (:meth:`_note_listing`): the next
        cycle lists them itself, reconciling the index (objects deleted in the gap go)."""
        self._listed_at: dict[str, float] = {}
        """kind -> when the controller's own listing of it last began (monotonic)."""
        self.agent_leases = AgentLeases()
        """The agents' heartbeat Leases as last listed (:meth:`_poll_leases`)."""
        self._leases_polled: float | None = None
        self._lease_error = ""

    # -- index -----------------------------------------------------------------------------
    def observe(self, kind: str, event: Mapping[str, Any]) -> None:
        """Fold one watch event (``kind`` in nodes, pods, partitionings) into the index."""
        obj = event.get("object") or {}
        event_type = event.get("type")
        self._note_listing(kind, event_type)
        if self._buffered is not None:  # a step is reading the index in its thread
            self._buffered.append((kind, event_type, obj))
            return
        self._fold(kind, event_type, obj)

    def _note_listing(self, kind: str, event_type: str | None) -> None:
        """Notice kopf listing ``kind`` again, after a gap its watch could not bridge.

        kopf lists a resource (events of type ``None``), then watches it from the listing's
        resourceVersion; when the watch fails (``410 Gone``, a lost connection) it lists again.
        A listing only upserts: an object deleted during the gap gets no ``DELETED`` event and
        would stay in the index for good (a bound pod holding its slice, a node with its
        GPUs).  A listed object that follows a watch event of its kind, or comes
        ``RELIST_QUIET_S`` after the previous listed one, starts such a new listing (kopf's
        own first listing is one burst before any watch event, so it triggers nothing); the
        next cycle then lists the kind itself (:meth:`sync`), which drops what is gone.  A
        listing of a kind with no object left shows nothing to notice (pods and nodes never run
        out: the partitioner is a pod on a node; NodePartitionings and claims can, and a ghost
        of those stays until the next restart).
        """
        now = self._monotonic()
        watched, last = self._listings.get(kind, (False, now))
        if event_type is not None:
            self._listings[kind] = (True, last)
            return
        if kind in self._listings and (watched or now - last > RELIST_QUIET_S):
            if kind not in self.relist_due:
                log.info(
                    "kopf is listing %s again after a gap in its watch; the partitioner "
                    "lists them too, to drop what was deleted meanwhile",
                    kind,
                )
            self.relist_due.add(kind)
            self.changed.set()
        self._listings[kind] = (False, now)

    def _fold(self, kind: str, event_type: str | None, obj: Mapping[str, Any]) -> None:
        before = self.index.version
        self.index.apply(kind, event_type, obj)
        if self.index.version != before:  # a change the step reads: react (:meth:`_pause`)
            self.changed.set()

    def _drain_buffer(self) -> None:
        buffered, self._buffered = self._buffered or [], None
        for kind, event_type, obj in buffered:
            self._fold(kind, event_type, obj)

    # -- login -----------------------------------------------------------------------------
    def logged_in(self, info: kopf.ConnectionInfo) -> None:
        self.connection = info
        self._logged_in.set()

    def _endpoint(self) -> Endpoint:
        """The Endpoint of the current login, built once per login (one SSL context each)."""
        info = self.connection
        if info is None:
            raise RuntimeError("the partitioner has not logged in to the API server yet")
        if self._login is None or self._login[0] is not info:
            self._login = (info, endpoint_from(info))
        return self._login[1]

    # -- the cycle -------------------------------------------------------------------------
    async def sync(self, kinds: Iterable[str] | None = None) -> None:
        """List the watched resources (``kinds``: those only; paginated), reconciling the index
        with what exists now.

        The listed objects are folded in :data:`RELIST_CHUNK` at a time, yielding to the event
        loop in between (:meth:`ClusterIndex.relisting`); watch events folded in meanwhile are
        guarded like those that come while the pages are read (:attr:`ClusterIndex.deletions`),
        and objects held at their listed resourceVersion are not read again."""
        lists = dict(_LISTS)
        if self.settings.dra_enabled:
            lists["claims"] = CLAIMS_PATH
        if kinds is not None:
            wanted = set(kinds)
            lists = {kind: path for kind, path in lists.items() if kind in wanted}
        self.relist_due -= lists.keys()  # a listing begun now covers every gap noticed so far
        began = self._monotonic()
        for kind in lists:
            self._listed_at[kind] = began
        # kopf's watches deliver events while the pages are read: the listing's snapshot must
        # not undo what they report after it (ClusterIndex.relist)
        self.index.deletions = {}
        try:
            for kind, path in lists.items():
                doc = await self.api.list_all(path, page_size=self.list_page_size)
                version = (doc.get("metadata") or {}).get("resourceVersion")
                listing = self.index.relisting(kind, str(version) if version is not None else None)
                items = doc.get("items") or []
                for start in range(0, len(items), RELIST_CHUNK):
                    if start:  # the loop also serves the admission webhook and the Lease
                        await asyncio.sleep(0)
                    listing.fold(items[start : start + RELIST_CHUNK])
                listing.finish()
        finally:
            self.index.deletions = None

    def _fence(self) -> float:
        """Seconds the step may still write: the elector's fence, and none once the term the
        step began in has ended (a lead lost and regained while it ran: what it decided is
        another term's, and Events and node conditions carry no resourceVersion to refuse it)."""
        assert self.elector is not None
        if self.elector.term != self._step_term:
            raise NotLeader(
                f"the lead changed hands since this step began (term {self._step_term})"
            )
        return self.elector.fence()

    async def step(self, now: float | None = None) -> Decision:
        """One cycle: decide at ``now`` (default: the controller's clock), act, record."""
        if self.elector is not None:
            self._step_term = self.elector.term
        now = self.clock() if now is None else now
        state = self.state
        self.changed.clear()  # what happened so far, this step reads
        started = time.perf_counter()
        if self.offload:
            self._buffered = []
            try:
                decision = await asyncio.to_thread(decide, state, self.index, now, self.config)
            finally:
                self._drain_buffer()
        else:
            decision = decide(state, self.index, now, self.config)
        elapsed = time.perf_counter() - started
        self.state = decision.state
        # kopf's handlers fold watch events in while the writes are in flight: a DELETED event
        # then comes before the write's answer, which must not bring the object back
        self.index.write_deletions = {}
        before = _spec_layouts(self.index, decision.actions)
        try:
            outcome = await execute(
                self.writer_api,
                decision.actions,
                instance=self.instance,
                told=self._refusals_told,
                backoff=self.write_backoff,
            )
        finally:
            written_deletions = self.index.write_deletions
            self.index.write_deletions = None
        if outcome.conflicts:  # not written: plan those pods again in the next window
            retry = [p for pods in outcome.conflicts.values() for p in pods]
            self.state = replace(self.state, window=forget(self.state.window, retry))
        if outcome.refused_specs:
            self.state = cool_refused_specs(
                self.state, outcome.refused_specs, now, self.config.cooldown_s
            )
        stale = self.index.stale_response
        for obj in outcome.objects.values():
            if not stale("partitionings", obj, written_deletions):
                self.index.upsert_partitioning(obj)
        for name in outcome.deleted:
            self.index.remove_partitioning(name)
        for obj in outcome.pods.values():
            if not stale("pods", obj, written_deletions):
                self.index.upsert_pod(obj)
        for key, uid in outcome.gone_pods:  # its DELETED event may never come (index.relist)
            held = self.index.pods.get(key)
            if held is not None and held.uid == uid:  # not a pod of that name created since
                namespace, _, name = key.partition("/")
                meta = {"namespace": namespace, "name": name}
                self.index.apply("pods", "DELETED", {"metadata": meta})
        self._record(decision, outcome, elapsed, now, before)
        self.last_decision, self.last_cycle = decision, now
        return decision

    def _record(
        self,
        d: Decision,
        outcome: Outcome,
        elapsed: float,
        now: float,
        before: Mapping[str, Mapping[int, str]] | None = None,
    ) -> None:
        """Metrics and the plan's log line of one step.  ``before``: the layout of each node's
        spec before the step's spec writes (:func:`_spec_layouts`): a plan whose spec writes
        failed (409, 5xx, refused, held back) counts only the pods and GPUs of the nodes
        written, so a plan retried after a failed write is not counted twice."""
        m = self.metrics
        m.observe_waiting(
            d.counts,
            (pod.created for pod in self.index.waiting()),
            (problem.reason for problem in d.problems.values()),
            now,
        )
        if d.error:
            m.planner_errors.inc()
            log.error("%s", d.error, extra={"plan": d.plan_id})
        if d.plan is not None:
            specs = {a.node: a for a in d.actions if isinstance(a, WriteSpec)}
            unwritten = specs.keys() - set(outcome.written)
            placed = sum(1 for a in d.plan.assignments.values() if a.node not in unwritten)
            if not unwritten:
                reconfigured = d.gpus_reconfigured
            else:  # the written nodes' part of it
                old = before or {}
                changed = sum(
                    _changed_gpus(old.get(node, {}), _layout(specs[node].spec.gpus))
                    for node in specs.keys() - unwritten
                )
                reconfigured = min(d.gpus_reconfigured, changed)
            if placed or not d.plan.assignments:  # else every placement is planned again
                m.batch_size.observe(len(d.batch))
            m.plan_duration.observe(elapsed)
            m.pods_planned.inc(placed)
            m.pods_unplaceable.inc(len(d.plan.unplaced))
            m.gpus_reconfigured.inc(reconfigured)
            log.info(
                "plan %s: %d pod(s) in batch, %d placed, %d unplaced, %d spec(s) written, %s",
                d.plan_id,
                len(d.batch),
                len(d.plan.assignments),
                len(d.plan.unplaced),
                len(outcome.written),
                d.plan.status or d.plan.policy,
                extra={"plan": d.plan_id},
            )
        if d.counts.get("warm", 0):  # counted once its spec (one without pods) was written
            written = set(outcome.written)
            warm = sum(
                1
                for a in d.actions
                if isinstance(a, WriteSpec) and not a.planned_pods and a.node in written
            )
            m.warm_slices.inc(min(d.counts["warm"], warm))
        if d.counts.get("warm_errors", 0):
            m.planner_errors.inc()
            log.error(
                "%s; no warm slice made this step (tried again once the cluster changes)",
                d.warm_error or "planner raised while planning a warm slice",
            )
        m.spec_conflicts.inc(len(outcome.conflicts))
        for action, code in outcome.write_failures:
            m.write_failures.labels(action, code).inc()
        m.pods_evicted.inc(len(outcome.evicted))
        for node in outcome.written:
            generation = (outcome.objects[node].get("metadata") or {}).get("generation") or 0
            self._awaiting_applied[node] = (int(generation), now)
        for node, (generation, since) in list(self._awaiting_applied.items()):
            info = self.index.partitionings.get(node)
            if info is None:
                del self._awaiting_applied[node]
                continue
            np = info.np
            if np is None:
                continue
            if np.applied and np.status is not None and np.status.observedGeneration >= generation:
                m.spec_to_applied.observe(max(0.0, now - since))
                del self._awaiting_applied[node]

    # -- leadership ------------------------------------------------------------------------
    def _leadership(self, now: Leadership) -> None:
        """The elector's report (or the fixed one without election): health and metric."""
        self.health.leadership(now.leader, now.holder)
        self.metrics.leader.set(1 if now.leader else 0)

    def leading(self) -> bool:
        """This replica may plan and write now (always, without leader election)."""
        return self.elector is None or self.elector.is_leader()

    def _note_periodic_listings(self) -> None:
        """Mark due the kinds that can run out of objects, ``relist_seconds`` after the
        controller last listed them.

        :meth:`_note_listing` notices kopf's listing after a watch gap by the listed objects it
        sees; a kind with no object left shows none, so a NodePartitioning (or, in DRA mode, a
        ResourceClaim) deleted during such a gap would stay in the index until a restart: a
        ghost claim is demand nobody has, a ghost NodePartitioning a spec nobody reads.  These
        kinds are few objects (one per GPU node, one per claim), so they are simply listed
        again on a period; pods and nodes never run out (the partitioner is a pod on a node)
        and are many, so they are listed only after a gap.
        """
        period = self.settings.relist_seconds
        if period <= 0:
            return
        now = self._monotonic()
        kinds = ["partitionings", "claims"] if self.settings.dra_enabled else ["partitionings"]
        for kind in kinds:
            last = self._listed_at.get(kind)
            if last is not None and now - last >= period:
                self.relist_due.add(kind)

    async def _poll_leases(self) -> None:
        """List the agents' heartbeat Leases every ``lease_poll_seconds`` and tell the index
        which agents are silent (:mod:`partitioner.agent_leases`; this controller's monotonic
        clock).  A listing that fails (no RBAC for Leases, an API outage) is logged once per
        distinct error and changes nothing: the last silent set stands until one succeeds."""
        period = self.settings.lease_poll_seconds
        if period <= 0:
            return
        now = self._monotonic()
        if self._leases_polled is not None and now - self._leases_polled < period:
            return
        self._leases_polled = now
        namespace = self.settings.agent_lease_namespace
        path = (
            f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
            if namespace
            else LEASES_PATH
        )
        try:
            doc = await self.api.list_all(
                path, page_size=self.list_page_size, selector=LEASE_SELECTOR
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            if error != self._lease_error:
                log.warning("listing the node agents' Leases failed: %s", error)
                self._lease_error = error
            return
        if self._lease_error:
            log.info("listing the node agents' Leases works again")
            self._lease_error = ""
        silent = self.agent_leases.observe(doc.get("items") or (), now)
        if silent != self.index.silent_agents:
            log.warning(
                "node agents not renewing their Lease: %s", ", ".join(sorted(silent)) or "none"
            )
        self.index.set_silent_agents(silent)

    async def _cycle(self) -> None:
        """One cycle: the relistings kopf's watch gaps call for (:meth:`_note_listing`) and the
        periodic ones (:meth:`_note_periodic_listings`), the agents' Leases when due
        (:meth:`_poll_leases`), then a decision step when leading (module docstring)."""
        self._note_periodic_listings()
        await self._poll_leases()
        if self.relist_due:
            due = sorted(self.relist_due)
            self.relist_due.clear()  # a kind noticed again while this listing runs stays due
            try:
                await self.sync(due)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the step still runs; the next cycle lists again
                self.relist_due.update(due)
                log.warning("listing %s again failed: %s", ", ".join(due), e)
        leading = self.leading()
        term = self.elector.term if self.elector is not None else 0
        if leading and self.elector is not None and (not self._was_leading or term != self._term):
            # a new term, also one that began and the previous one ended within a cycle that
            # blocked longer than the Lease (an API outage, a long plan): as after a restart,
            # plans may have moved on under another leader
            self.state = ControllerState()
            self._awaiting_applied.clear()
            log.info("leading: decision steps start from the API state")
        self._was_leading, self._term = leading, term
        if not leading:
            self.metrics.not_leading()  # the leader's figures are the ones exported
            self.health.step_done()  # a follower's cycle: nothing to decide
            return
        try:
            await self.step()
        except NotLeader as e:  # the lease deadline passed during the step
            log.warning("decision step cut short, leadership ended: %s", e)
            self._was_leading = False
            self.health.step_done()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("partitioner cycle failed; retrying next cycle")
            self.metrics.step_failures.inc()
            self.health.step_done(f"{type(e).__name__}: {e}")
        else:
            self.health.step_done()

    async def run(self) -> None:
        """Sync, then a cycle every ``cycle_seconds`` until cancelled; a failing step is logged.

        Each outcome is told to :attr:`health`: the start, the completed initial listing, and
        every cycle (completed or raised).  With leader election the replica becomes a candidate
        once synced.
        """
        self.health.started()
        await self._logged_in.wait()
        await retry_with_backoff(
            self.sync,
            "initial listing of nodes, pods and NodePartitionings",
            backoff=self.backoff,
            rand=self._rand,
            logger=log,
        )
        self.health.synced()
        self.heap.start()
        if self.elector is not None and self._election is None:
            self._election = asyncio.create_task(
                self.elector.run(), name="gpuslice-partitioner-election"
            )
        while True:
            await self._cycle()
            reclaim = self.heap.settle()
            if reclaim is not None:
                self.metrics.heap_frozen_cycles.inc(reclaim.unreachable)
                self.metrics.heap_reclaim_seconds.set(reclaim.seconds)
            await self._pause()

    async def _pause(self) -> None:
        """Between two cycles: ``react_seconds`` at least; then the next cycle starts at once if
        a watch event changed the index (a node reported a new slice, a pod arrived), else at
        the first such event, and ``cycle_seconds`` after this one ended at the latest (the
        time-based decisions: batch window, deadlines, drains).  The step's own writes, folded
        back into the index, are not such a change: it acts on them at the next regular cycle.
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + self.settings.cycle_seconds
        await asyncio.sleep(self.settings.react_seconds)
        left = end - loop.time()
        if self.changed.is_set() or left <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout=left)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="gpuslice-partitioner-cycle")

    async def stop(self) -> None:
        """Stop the loop (no more writes), then the election, then release the Lease."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._election is not None:
            self._election.cancel()
            await asyncio.gather(self._election, return_exceptions=True)
            self._election = None
        if self.elector is not None:
            try:
                async with asyncio.timeout(self.elector.config.renew_deadline_s):
                    await self.elector.release()
            except TimeoutError:
                log.warning("could not release the Lease in time; it expires by itself")
        if self.writer_api is not self.api:
            await self.writer_api.close()
        await self.api.close()


def _layout(gpus: Iterable[Any]) -> dict[int, str]:
    """GPU index -> its desired layout (a spec's ``gpus``), comparable across specs."""
    out: dict[int, str] = {}
    for g in gpus:
        mig = sorted(json.dumps(m.model_dump(mode="json"), sort_keys=True) for m in g.mig)
        mps = sorted(json.dumps(s.model_dump(mode="json"), sort_keys=True) for s in g.mps)
        if mig or mps:
            out[g.index] = json.dumps([mig, mps])
    return out


def _changed_gpus(old: Mapping[int, str], new: Mapping[int, str]) -> int:
    return sum(1 for i in old.keys() | new.keys() if old.get(i) != new.get(i))


def _spec_layouts(index: ClusterIndex, actions: Iterable[Any]) -> dict[str, dict[int, str]]:
    """Node -> the layout of its spec now, for each node a step writes a spec of."""
    out: dict[str, dict[int, str]] = {}
    for a in actions:
        if isinstance(a, WriteSpec):
            np = index.partitioning(a.node)
            out[a.node] = _layout(np.spec.gpus) if np is not None else {}
    return out


def build_registry(controller: Controller) -> kopf.OperatorRegistry:
    """A fresh kopf registry whose handlers drive ``controller``."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(id="start-controller", registry=registry)
    async def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.scanning.disabled = True  # the CRD is installed before the partitioner
        settings.posting.enabled = False  # our Events are posted by the writer
        controller.start()

    @kopf.on.cleanup(id="stop-controller", registry=registry)
    async def _cleanup(**_: Any) -> None:
        await controller.stop()

    @kopf.on.login(id="login", registry=registry)
    def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # never the previous login's credentials: kopf re-logins after a 401 and refuses the
        # ones it has just invalidated (a rotated or revoked token: LoginError, the operator
        # exits); kopf's own login functions read the token file and the kubeconfig anew
        info = controller.given_connection
        if info is None:
            info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            controller.logged_in(info)
        return info

    @kopf.on.event("v1", "nodes", id="watch-nodes", registry=registry)
    async def _node(event: Mapping[str, Any], **_: Any) -> None:
        controller.observe("nodes", event)

    @kopf.on.event("v1", "pods", id="watch-pods", registry=registry)
    async def _pod(event: Mapping[str, Any], **_: Any) -> None:
        controller.observe("pods", event)

    @kopf.on.event(GROUP, VERSION, PLURAL, id="watch-partitionings", registry=registry)
    async def _partitioning(event: Mapping[str, Any], **_: Any) -> None:
        controller.observe("partitionings", event)

    if controller.settings.dra_enabled:  # DRA nodes' demand: partitioner/claims.py

        @kopf.on.event(
            "resource.k8s.io", "v1", "resourceclaims", id="watch-claims", registry=registry
        )
        async def _claim(event: Mapping[str, Any], **_: Any) -> None:
            controller.observe("claims", event)

    if controller.settings.webhook_enabled and not controller.settings.reservation:
        # Without reservations nothing releases a gated pod (decide ungates it again): gating
        # at admission would only cost every slice pod a cycle.  The chart renders no webhook
        # then; a hand-set GPUSLICE_WEBHOOK_ENABLED is ignored, and a configuration left
        # pointing here fails open (failurePolicy Ignore).
        log.warning(
            "GPUSLICE_WEBHOOK_ENABLED is ignored: reservations are off (GPUSLICE_RESERVATION="
            "false), so the admission webhook is not served and no pod is gated; turn "
            "reservations on to gate pods"
        )
    elif controller.settings.webhook_enabled:  # gates pods at admission: partitioner/webhook.py
        register_webhook(
            registry, controller.settings, controller.api, controller.health, controller.metrics
        )
    return registry


async def run_operator(
    controller: Controller,
    *,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
) -> None:
    """Run kopf (standalone, cluster-wide) with the partitioner's handlers until stopped.

    Health is served by :class:`~partitioner.health.HealthServer` (the caller starts it), not
    by kopf's liveness endpoint.
    """
    await kopf.operator(
        registry=build_registry(controller),
        standalone=True,
        clusterwide=True,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
