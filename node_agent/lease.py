"""The node agent's heartbeat Lease: how the partitioner knows that a node still has a live agent.

Why
---
The partitioner plans slices on a node and promises them to pods; only that node's agent makes
them (device-plugin mode) or prepares them (DRA mode).  When the agent is gone -- its pod
deleted and not back, crash-looping, or alive but stuck -- nothing it was promised happens.  So
the agent renews a Lease, and the partitioner treats a node whose Lease has not been renewed for
``leaseDurationSeconds`` as having no agent: nothing is promised there, and the pods planned
there are planned elsewhere.  With ``lease_seconds`` 0 the agent keeps no Lease and the
partitioner relies on its apply deadline instead.

Contract (the partitioner relies on exactly this)
-------------------------------------------------
* Object: a ``coordination.k8s.io/v1`` ``Lease`` in the agent pod's namespace
  (``GPUSLICE_POD_NAMESPACE``, the downward API's ``metadata.namespace``: the release
  namespace), named ``gpuslice-agent-<node name>`` (:func:`lease_name`).  Node names are DNS
  subdomains, so that is a valid Lease name; one that would exceed 253 characters keeps the
  first 227 characters of the node name (less any trailing ``.`` or ``-``), then ``-`` and the
  first 10 hex digits of the SHA-256 of the whole node name: stable, and still a DNS subdomain.
* ``metadata.labels``: ``app.kubernetes.io/name: gpuslice`` and
  ``app.kubernetes.io/component: agent-lease`` (:data:`LEASE_LABELS`; the partitioner lists
  with the selector :data:`LEASE_SELECTOR`).
* ``spec.holderIdentity``: the node name, exactly (the partitioner maps a Lease to its node by
  it, never by the Lease's name); ``spec.leaseDurationSeconds``: ``lease_seconds`` (whole
  seconds, rounded up); ``spec.renewTime``: now, as a Kubernetes MicroTime
  (``YYYY-MM-DDTHH:MM:SS.ffffffZ``, UTC: :func:`micro_time`); ``spec.acquireTime``: set when
  the Lease is created (an agent that restarts renews the Lease it finds and keeps it).
* Renewed every ``renew_seconds`` (default a quarter of ``lease_seconds``: 10 s of 40 s), so
  three renewals in a row may fail before the partitioner gives up on the node.

Renewal on the event loop
-------------------------
:meth:`AgentLease.run` is an asyncio task on the agent's own event loop, beside the reconcile
loop (device-plugin mode) or the DRA driver (``gpuslice/commands/agent.py``), not a thread.  That
is intended: the Lease says that the *loop* is alive, not only the process.  An agent whose loop
is blocked -- an NVML call that hangs, made on the loop instead of in a worker thread -- stops
renewing, and the partitioner stops counting on the node; a thread would go on renewing for an
agent that does nothing.

Failures
--------
:meth:`AgentLease.renew` never raises: it merge-patches the Lease's ``spec`` (and its labels),
creates the Lease when the patch answers ``404``, patches again when the create answers ``409``
(created in between), and bounds each call by ``request_timeout_s``.  Any other refusal or error
is logged at WARNING once per distinct error while renewals fail (naming the Lease and the
error; repeats at DEBUG), and once at INFO when a renewal succeeds again.  When the agent stops
(SIGTERM) the Lease is left as it is: it expires ``leaseDurationSeconds`` later, unless the next
agent (a rollout) renews it first.  The agent never deletes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from contract.agent_lease import LEASE_LABELS, LEASE_PREFIX, LEASE_SELECTOR
from node_agent.agent import MERGE_PATCH, CustomApiUser, KubeApiError, _api_error

__all__ = [
    "LEASE_GROUP",
    "LEASE_LABELS",
    "LEASE_PLURAL",
    "LEASE_PREFIX",
    "LEASE_SELECTOR",
    "LEASE_VERSION",
    "AgentLease",
    "from_settings",
    "lease_name",
    "micro_time",
    "parse_micro_time",
]

log = logging.getLogger("gpuslice.agent.lease")

LEASE_GROUP, LEASE_VERSION, LEASE_PLURAL = "coordination.k8s.io", "v1", "leases"

MAX_NAME = 253
"""Longest object name (a DNS subdomain)."""
HASH_DIGITS = 10
MICRO_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


def lease_name(node: str) -> str:
    """``gpuslice-agent-<node>``; over 253 characters, the node part is cut and a short stable
    hash of the whole node name appended (module docstring)."""
    name = LEASE_PREFIX + node
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:HASH_DIGITS]
    keep = MAX_NAME - len(LEASE_PREFIX) - 1 - HASH_DIGITS
    return f"{LEASE_PREFIX}{node[:keep].rstrip('.-')}-{digest}"


def micro_time(when: datetime) -> str:
    """``when`` as a Kubernetes MicroTime: RFC 3339 in UTC with microseconds."""
    return when.astimezone(UTC).strftime(MICRO_TIME_FORMAT)


def parse_micro_time(text: str) -> datetime:
    """A MicroTime (:func:`micro_time`'s form) as an aware UTC datetime; ``ValueError`` else."""
    return datetime.strptime(text, MICRO_TIME_FORMAT).replace(tzinfo=UTC)


def _now() -> datetime:
    return datetime.now(UTC)


class AgentLease(CustomApiUser):
    """Keeps the heartbeat Lease of node ``node`` in ``namespace`` renewed (module docstring).

    ``api``: a ``kubernetes_asyncio.client.CustomObjectsApi`` (it serves built-in resources too:
    group ``coordination.k8s.io``, version ``v1``, plural ``leases``); its ApiClient is the
    caller's.  Without one, the Lease connects on first use as the agent does
    (:func:`node_agent.agent.kube_api_client`: the in-cluster service account, else the
    kubeconfig) and :meth:`close` (run at the end of :meth:`run`) closes that client.
    ``clock``: now, as an aware datetime (tests pass their own).
    """

    def __init__(
        self,
        node: str,
        namespace: str,
        lease_seconds: float = 40.0,
        renew_seconds: float | None = None,
        *,
        api: Any | None = None,
        request_timeout_s: float | None = None,
        clock: Callable[[], datetime] = _now,
    ) -> None:
        if not node:
            raise ValueError("the heartbeat Lease needs the node name (GPUSLICE_NODE_NAME)")
        if not namespace:
            raise ValueError("the heartbeat Lease needs a namespace (GPUSLICE_POD_NAMESPACE)")
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds:g}")
        renew = lease_seconds / 4 if renew_seconds is None else renew_seconds
        if not 0 < renew < lease_seconds:
            raise ValueError(
                f"renew_seconds ({renew:g}) must be > 0 and shorter than lease_seconds "
                f"({lease_seconds:g})"
            )
        self.node, self.namespace = node, namespace
        self.name = lease_name(node)
        self.lease_seconds, self.renew_seconds = lease_seconds, renew
        self.duration_seconds = math.ceil(lease_seconds)
        """``spec.leaseDurationSeconds`` (an integer in the API)."""
        self.request_timeout_s = (
            min(10.0, renew) if request_timeout_s is None else request_timeout_s
        )
        self._clock = clock
        self._api = api
        self._owned: Any = None
        """The ApiClient :meth:`connect` built (closed by :meth:`close`)."""
        self._logged: set[str] = set()
        """The errors logged at WARNING since the last successful renewal."""
        self.renewals = 0
        """Successful renewals (creates included)."""
        self.failures = 0
        """Failed renewals."""

    @property
    def where(self) -> str:
        return f"{self.namespace}/{self.name}"

    def _spec(self, now: str) -> dict[str, Any]:
        return {
            "holderIdentity": self.node,
            "leaseDurationSeconds": self.duration_seconds,
            "renewTime": now,
        }

    def _patch(self, now: str) -> dict[str, Any]:
        return {"metadata": {"labels": dict(LEASE_LABELS)}, "spec": self._spec(now)}

    def _lease(self, now: str) -> dict[str, Any]:
        return {
            "apiVersion": f"{LEASE_GROUP}/{LEASE_VERSION}",
            "kind": "Lease",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": dict(LEASE_LABELS),
            },
            "spec": {**self._spec(now), "acquireTime": now},
        }

    async def _bounded(self, call: Any) -> Any:
        async with asyncio.timeout(self.request_timeout_s):
            return await call

    async def _patch_lease(self, api: Any) -> None:
        await self._bounded(
            api.patch_namespaced_custom_object(
                LEASE_GROUP,
                LEASE_VERSION,
                self.namespace,
                LEASE_PLURAL,
                self.name,
                self._patch(micro_time(self._clock())),
                _content_type=MERGE_PATCH,
                _request_timeout=self.request_timeout_s,
            )
        )

    async def renew(self) -> bool:
        """Renew the Lease now (create it when absent); whether that worked.  Never raises
        (cancellation aside): a failure is logged (module docstring, "Failures")."""
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            api = await self.connect()
            try:
                await self._patch_lease(api)
            except ApiException as e:
                if e.status != 404:
                    raise
                try:
                    await self._bounded(
                        api.create_namespaced_custom_object(
                            LEASE_GROUP,
                            LEASE_VERSION,
                            self.namespace,
                            LEASE_PLURAL,
                            self._lease(micro_time(self._clock())),
                            _request_timeout=self.request_timeout_s,
                        )
                    )
                except ApiException as conflict:
                    if conflict.status != 409:
                        raise
                    await self._patch_lease(api)  # created in between: renew that one
                else:
                    log.info(
                        "created heartbeat Lease %s (holder %s, %ds, renewed every %gs)",
                        self.where,
                        self.node,
                        self.duration_seconds,
                        self.renew_seconds,
                    )
        except Exception as e:  # never raise: the agent's work goes on
            self._failed(e)
            return False
        self.renewals += 1
        if self._logged:
            log.info("heartbeat Lease %s renewed again", self.where)
            self._logged.clear()
        return True

    def _failed(self, error: Exception) -> None:
        self.failures += 1
        one_line = _api_error(error, "the API server answered")
        if isinstance(one_line, KubeApiError):
            why = str(one_line)
        elif isinstance(error, TimeoutError):
            why = f"no answer within {self.request_timeout_s:g}s"
        else:
            why = f"{type(error).__name__}: {error}"
        if why in self._logged:
            log.debug("heartbeat Lease %s not renewed (again): %s", self.where, why)
            return
        self._logged.add(why)
        log.warning(
            "heartbeat Lease %s not renewed: %s; retrying every %gs (the partitioner takes "
            "node %s as having no agent once the Lease is %ds old)",
            self.where,
            why,
            self.renew_seconds,
            self.node,
            self.duration_seconds,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Renew now, then every ``renew_seconds`` (on a fixed schedule, not drifting by the
        time a renewal takes) until ``stop`` is set; returns as soon as it is, or after the
        renewal in flight (bounded by ``request_timeout_s``).  Closes a client it built."""
        loop = asyncio.get_running_loop()
        log.info(
            "renewing heartbeat Lease %s every %gs (leaseDurationSeconds %d)",
            self.where,
            self.renew_seconds,
            self.duration_seconds,
        )
        try:
            next_at = loop.time()
            while not stop.is_set():
                await self.renew()
                next_at = max(next_at + self.renew_seconds, loop.time())
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(next_at):
                        await stop.wait()
        finally:
            await self.close()


def from_settings(settings: Any, api: Any | None = None) -> AgentLease | None:
    """The agent's Lease as its settings (:class:`node_agent.settings.AgentSettings`) ask, or
    ``None``: ``lease_seconds`` 0 (logged at INFO), or no ``pod_namespace`` known (a WARNING:
    outside a pod, say)."""
    if not settings.lease_seconds:
        log.info(
            "no heartbeat Lease (GPUSLICE_LEASE_SECONDS=0): the partitioner relies on its "
            "apply deadline for node %s",
            settings.node_name,
        )
        return None
    if not settings.pod_namespace:
        log.warning(
            "running without a heartbeat Lease: GPUSLICE_POD_NAMESPACE is not set (the chart's "
            "DaemonSets set it from the downward API); set it, or GPUSLICE_LEASE_SECONDS=0 to "
            "say no Lease is wanted"
        )
        return None
    return AgentLease(settings.node_name, settings.pod_namespace, settings.lease_seconds, api=api)
