"""The kopf operator: thin handlers that feed a cache, and a loop that runs the decision step.

Wiring
------
* ``on.event`` handlers for Nodes, Pods and NodePartitionings (cluster-wide) copy every object
  into the :class:`Controller`'s cache and delete it on ``DELETED``.  They never patch the
  watched objects, so kopf adds no finalizers or annotations to Nodes and Pods.
* ``on.login`` keeps kopf's usual login (service account, then kubeconfig) unless a connection
  was given, and shares it with the partitioner's own writer client (:mod:`.kubeapi`).
* ``on.startup`` starts :meth:`Controller.run`: it lists the three resources once (so the first
  decision never sees pods without their nodes), then every ``cycle_seconds`` calls
  :func:`partitioner.decide.decide` with the cache and the loop clock, carries the actions out
  (:mod:`.writer`), folds the written objects back into the cache and records metrics.
  ``on.cleanup`` stops it.
* ``on.probe`` reports the age of the last completed cycle on the liveness endpoint.

Peering: the partitioner runs ``standalone`` (no kopf peering objects).  Run exactly one
replica with the Deployment strategy ``Recreate``, so two partitioners never write specs at
once; a second one would still be safe (every spec write is guarded by resourceVersion), only
wasteful.

Restart: nothing lives only in memory except the batch window.  The cache is rebuilt from the
API, pending pods are still pending (a new window opens for them), pods whose spec was already
written are in flight (annotation on their NodePartitioning) and are not planned twice, and
plan ids continue after the largest in the cluster.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import kopf

from contract.catalog_files import load_catalog
from contract.nodepartitioning import GROUP, PLURAL, VERSION, NodePartitioning
from partitioner.batching import forget
from partitioner.decide import (
    ControllerState,
    DecideConfig,
    Decision,
    PlanFn,
    decide,
    default_planner,
)
from partitioner.kubeapi import Endpoint, KubeApi
from partitioner.metrics import Metrics
from partitioner.settings import PartitionerSettings
from partitioner.snapshot import ClusterView, pod_key
from partitioner.webhook import register_webhook
from partitioner.writer import NP_PATH, Outcome, execute
from planner.catalog import Catalog

__all__ = ["Controller", "build_registry", "endpoint_from", "run_operator"]

log = logging.getLogger("gpuslice.partitioner")

_LISTS = {"nodes": "/api/v1/nodes", "pods": "/api/v1/pods", "partitionings": NP_PATH}


def endpoint_from(info: kopf.ConnectionInfo) -> Endpoint:
    secure = info.server.startswith("https://")
    return Endpoint(
        server=info.server,
        headers=info.as_http_headers(),
        ssl=info.as_ssl_context() if secure else True,
    )


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
    ) -> None:
        self.settings = settings
        self.config = DecideConfig(
            catalog=catalog if catalog is not None else load_catalog(settings.catalog_files),
            policy=settings.batch_policy(),
            planner_settings=settings.planner_settings(),
            planner=planner if planner is not None else default_planner(),
        )
        self.metrics = metrics if metrics is not None else Metrics()
        self.offload = offload
        """Run the decision step in a worker thread (planning must not stall the watchers)."""
        self.cache: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in _LISTS}
        self.state = ControllerState()
        self.connection = connection
        self.instance = socket.gethostname()
        self.api = KubeApi(self._endpoint)
        self.last_decision: Decision | None = None
        self.last_cycle: float | None = None
        self._logged_in = asyncio.Event()
        self._awaiting_applied: dict[str, tuple[int, float]] = {}
        self._task: asyncio.Task[None] | None = None

    # -- cache -----------------------------------------------------------------------------
    def observe(self, kind: str, event: Mapping[str, Any]) -> None:
        """Fold one watch event (``kind`` in nodes, pods, partitionings) into the cache."""
        obj = event.get("object") or {}
        key = pod_key(obj) if kind == "pods" else (obj.get("metadata") or {}).get("name", "")
        if event.get("type") == "DELETED":
            self.cache[kind].pop(key, None)
        else:
            self.cache[kind][key] = copy.deepcopy(dict(obj))

    def view(self) -> ClusterView:
        return ClusterView(
            nodes=dict(self.cache["nodes"]),
            pods=dict(self.cache["pods"]),
            partitionings=dict(self.cache["partitionings"]),
        )

    # -- login -----------------------------------------------------------------------------
    def logged_in(self, info: kopf.ConnectionInfo) -> None:
        self.connection = info
        self._logged_in.set()

    def _endpoint(self) -> Endpoint:
        if self.connection is None:
            raise RuntimeError("the partitioner has not logged in to the API server yet")
        return endpoint_from(self.connection)

    # -- the cycle -------------------------------------------------------------------------
    async def sync(self) -> None:
        """List the three resources once, so the first decision sees a complete cluster."""
        for kind, path in _LISTS.items():
            doc = await self.api.request("GET", path)
            for item in doc.get("items") or ():
                self.observe(kind, {"type": None, "object": item})

    async def step(self, now: float) -> Decision:
        """One cycle: decide at ``now`` (loop clock), act, record."""
        view, state = self.view(), self.state
        started = time.perf_counter()
        if self.offload:
            decision = await asyncio.to_thread(decide, state, view, now, self.config)
        else:
            decision = decide(state, view, now, self.config)
        elapsed = time.perf_counter() - started
        self.state = decision.state
        outcome = await execute(self.api, decision.actions, instance=self.instance)
        if outcome.conflicts:  # not written: plan those pods again in the next window
            retry = [p for pods in outcome.conflicts.values() for p in pods]
            self.state = replace(self.state, window=forget(self.state.window, retry))
        for name, obj in outcome.objects.items():
            self.cache["partitionings"][name] = obj
        for name in outcome.deleted:
            self.cache["partitionings"].pop(name, None)
        self._record(decision, outcome, elapsed, now)
        self.last_decision, self.last_cycle = decision, now
        return decision

    def _record(self, d: Decision, outcome: Outcome, elapsed: float, now: float) -> None:
        m = self.metrics
        m.pending_pods.set(len(d.reading.batchable))
        if d.error:
            log.error("%s", d.error)
        if d.plan is not None:
            m.batch_size.observe(len(d.batch))
            m.plan_duration.observe(elapsed)
            m.pods_planned.inc(len(d.plan.assignments))
            m.pods_unplaceable.inc(len(d.plan.unplaced))
            m.gpus_reconfigured.inc(d.gpus_reconfigured)
            log.info(
                "plan %s: %d pod(s) in batch, %d placed, %d unplaced, %d spec(s) written, %s",
                d.plan_id,
                len(d.batch),
                len(d.plan.assignments),
                len(d.plan.unplaced),
                len(outcome.written),
                d.plan.status or d.plan.policy,
            )
        m.spec_conflicts.inc(len(outcome.conflicts))
        for node in outcome.written:
            generation = (outcome.objects[node].get("metadata") or {}).get("generation") or 0
            self._awaiting_applied[node] = (int(generation), now)
        for node, (generation, since) in list(self._awaiting_applied.items()):
            raw = self.cache["partitionings"].get(node)
            if raw is None:
                del self._awaiting_applied[node]
                continue
            try:
                np = NodePartitioning.model_validate(raw)
            except ValueError:
                continue
            if np.applied and np.status is not None and np.status.observedGeneration >= generation:
                m.spec_to_applied.observe(max(0.0, now - since))
                del self._awaiting_applied[node]

    async def run(self) -> None:
        """Sync, then step every ``cycle_seconds`` until cancelled; a failing step is logged."""
        loop = asyncio.get_running_loop()
        await self._logged_in.wait()
        while True:
            try:
                await self.sync()
                break
            except Exception as e:
                log.warning("initial listing failed (retrying): %s", e)
                await asyncio.sleep(self.settings.cycle_seconds)
        while True:
            try:
                await self.step(loop.time())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("partitioner cycle failed; retrying next cycle")
            await asyncio.sleep(self.settings.cycle_seconds)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="gpuslice-partitioner-cycle")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.api.close()


def build_registry(controller: Controller) -> kopf.OperatorRegistry:
    """A fresh kopf registry whose handlers drive ``controller``."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def _startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.scanning.disabled = True  # the CRD is installed before the partitioner
        settings.posting.enabled = False  # our Events are posted by the writer
        controller.start()

    @kopf.on.cleanup(registry=registry)
    async def _cleanup(**_: Any) -> None:
        await controller.stop()

    @kopf.on.login(registry=registry)
    def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = controller.connection
        if info is None:
            info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            controller.logged_in(info)
        return info

    @kopf.on.probe(id="last_cycle_age_seconds", registry=registry)
    def _probe(**_: Any) -> float | None:
        if controller.last_cycle is None:
            return None
        return asyncio.get_running_loop().time() - controller.last_cycle

    @kopf.on.event("v1", "nodes", registry=registry)
    def _node(event: Mapping[str, Any], **_: Any) -> None:
        controller.observe("nodes", event)

    @kopf.on.event("v1", "pods", registry=registry)
    def _pod(event: Mapping[str, Any], **_: Any) -> None:
        controller.observe("pods", event)

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    def _partitioning(event: Mapping[str, Any], **_: Any) -> None:
        controller.observe("partitionings", event)

    if controller.settings.webhook_enabled:  # gates pods at admission: partitioner/webhook.py
        register_webhook(registry, controller.settings, controller.api)
    return registry


async def run_operator(
    controller: Controller,
    *,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
    liveness_endpoint: str | None = None,
) -> None:
    """Run kopf (standalone, cluster-wide) with the partitioner's handlers until stopped."""
    await kopf.operator(
        registry=build_registry(controller),
        standalone=True,
        clusterwide=True,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        liveness_endpoint=liveness_endpoint,
    )
