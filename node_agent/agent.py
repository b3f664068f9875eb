"""The node agent's main loop and its Kubernetes port.

Model
-----
The agent owns one NodePartitioning, named after its node.  A :class:`SpecSource` gives the
current spec (with its ``metadata.generation`` and last status), waits for a change, and writes
the status; :class:`KubeSpecSource` does this through the Kubernetes API, and
:class:`InMemorySpecSource` / :class:`FileSpecSource` serve tests, demos and the simulator.

Loop (:meth:`Agent.run`): read the spec -> :meth:`Reconciler.reconcile` (which pushes devices
to the device plugin) -> write the status if it changed -> wait for a spec change, at most
``retry_seconds`` after a pass that did not settle and ``resync_seconds`` otherwise.  A pass that
raises is logged and retried; the loop itself never dies of a bad pass.  Every pass, ok or not,
is reported to the optional :class:`~node_agent.metrics.AgentMetrics` and
:class:`~node_agent.health.AgentHealth`: for liveness a pass *fails* only when it raises or
cannot read NVML at all (a restart initialises NVML anew).  Errors a pass reports about one GPU
or about the kubelet's PodResources go to the status and the metrics, not to liveness: a
restart fixes neither (a process outside any pod, a kubelet that does not answer) and it ends
the MPS daemons of every GPU of the node, so one GPU's trouble failing the probe turned into an
outage of every MPS pod there, again after each restart.

**Kubernetes API unavailable** (:func:`api_unavailable`: no connection, a timeout, HTTP 5xx or
429 from reading the NodePartitioning or writing its status).  Once the agent has read its
NodePartitioning, such a failure does not fail the pass for liveness: an API server outage
(control-plane upgrade, etcd failover) would otherwise fail the probe on every GPU node at the
same moment and the restarts would end every MPS daemon of the cluster, while a restart cannot
bring the API back.  The pass is logged (one WARNING per outage, then DEBUG, one INFO when the
API answers again), counted (``gpuslice_agent_kube_api_errors_total{call}``, and
``gpuslice_agent_spec_stale`` is 1 while it lasts) and goes on with the spec *last read*: the
object as it was, and as ``previous`` status the one this agent built last.  That is safe: it is
the layout the partitioner last promised this node, which the agent was applying anyway; a pass
never destroys an instance or slice that is in use, whatever the spec; and the passes keep what
only they do -- restart a dead MPS daemon, re-create instances a GPU reset removed, keep the
devices advertised and their health current.  A newer spec written meanwhile (a partition that
cuts only this node off) is applied once the API answers; the partitioner waits for ``Applied``
of its generation anyway.  A status write that fails is tried again by the next pass.  Before
the first successful read there is no spec to go on with and this container has started no MPS
daemon, so such a pass fails as before (a restart also reloads the API credentials).  Any other
error of the API (4xx: RBAC, a refused status) still fails the pass.

Without a NodePartitioning the reconciler *drains* the node (module
:mod:`node_agent.reconciler`, "Drain"): the loop logs, at INFO and once per change, which
devices pods still hold (only those stay advertised; nothing is destroyed) and when none is
left.  When :meth:`Agent.run` is stopped (SIGTERM: the pod is deleted) during a drain, it passes
again for a few seconds until nothing is held, so the last idle MPS daemon is stopped and its GPU
put back in compute mode ``DEFAULT`` even when the pod goes right after its last client
(opt-out) or right after its NodePartitioning (uninstall).

MPS daemon liveness: between passes the loop checks every ``mps_liveness_seconds`` (default 5;
0: off) that the MPS control daemons still run (:meth:`~node_agent.mps.ProcessSupervisor.check`:
``get_server_list`` answering, run in a worker thread so the event loop never waits on it, and
never while a pass runs: a check in flight when the loop wakes for another reason is finished
first).  A daemon found dead -- a crash or an OOM kill, which also ended its clients -- is logged
at WARNING with how often it died, counted (``gpuslice_agent_mps_daemon_deaths_total``) and
wakes a pass at once, instead of at the next resync: that pass starts it again with its limits,
in use or not (:mod:`node_agent.mps`), and advertises its devices Unhealthy while it cannot be
started, so the kubelet stops handing them to new pods.  A death a pass's own probes noticed
first (and already repaired) is reported by the next check the same way.

XID critical errors (:mod:`node_agent.xid`): with an :class:`~node_agent.xid.XidWatcher`,
:meth:`Agent.run` registers the GPUs for NVML's XID events and waits for them in a worker
thread for as long as the loop runs (beside the passes, not between them: NVML is thread-safe
and the wait shares nothing with a pass; stopping the loop ends the thread within the watcher's
``wait_ms``).  Every event is counted (``gpuslice_agent_xid_errors_total{gpu,xid}``); a critical
one is logged at WARNING and wakes a pass at once, which advertises the devices it hit
Unhealthy -- for as long as this agent runs -- and reports ``Degraded`` (``GpuXid``); an
ignored one (an application error) is logged at INFO and changes nothing.  A watcher switched
off (setting ``xid_watch`` false: :func:`node_agent.xid.watching`) starts no thread.

:class:`KubeSpecSource` wakes the loop only for changes the agent must act on: a new
``metadata.generation`` (spec change), or the object created, deleted or re-created (new uid).
Its own status writes, and the API server replaying the current object at the start of a watch,
do not wake it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from contract.input_files import InputError, parse_json, parse_yaml, read_text
from contract.kube_retry import Backoff, OutageLog
from contract.nodepartitioning import (
    CLEARED_WHEN_EMPTY,
    GROUP,
    PARTITIONER_STATUS_FIELDS,
    PLURAL,
    VERSION,
    NodePartitioning,
    NodePartitioningSpec,
    NodePartitioningStatus,
    ObjectMeta,
)
from node_agent.health import AgentHealth
from node_agent.metrics import AgentMetrics
from node_agent.nvml import XidEvent
from node_agent.reconciler import Reconciler, ReconcileResult
from node_agent.tasks import first_of
from node_agent.xid import XidWatcher, report_events, watching

__all__ = [
    "Agent",
    "FileSpecSource",
    "InMemorySpecSource",
    "KubeApiError",
    "KubeSpecSource",
    "SpecSource",
    "api_unavailable",
    "draining_gpus",
    "kube_api_client",
    "now_rfc3339",
]

log = logging.getLogger("gpuslice.agent")

MAX_SPEC_BYTES = 4 * 1024 * 1024
"""A NodePartitioning of a node with a few dozen GPUs is a few KiB."""


MERGE_PATCH = "application/merge-patch+json"
"""The Content-Type of every dict patch the agent sends.  kubernetes_asyncio picks JSON Patch
(a list of operations) for a dict body sent to a custom object's patch unless told otherwise,
and the API server refuses that (400: cannot unmarshal object into []jsonPatchOp)."""


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class SpecSource(Protocol):
    async def get(self) -> NodePartitioning | None:
        """The node's NodePartitioning, or ``None`` if there is none."""
        ...

    async def wait_change(self, timeout: float) -> None:
        """Return when the spec may have changed, or after ``timeout`` seconds."""
        ...

    async def write_status(self, status: NodePartitioningStatus) -> None: ...


class InMemorySpecSource:
    """A NodePartitioning held in memory (tests, the simulator)."""

    def __init__(self, name: str, spec: NodePartitioningSpec | None = None) -> None:
        self.name = name
        self.obj: NodePartitioning | None = None
        self.status_writes = 0
        self._changed = asyncio.Event()
        if spec is not None:
            self.set_spec(spec)

    def set_spec(self, spec: NodePartitioningSpec) -> None:
        gen = (self.obj.metadata.generation or 0) + 1 if self.obj else 1
        status = self.obj.status if self.obj else None
        self.obj = NodePartitioning(
            metadata=ObjectMeta(name=self.name, generation=gen), spec=spec, status=status
        )
        self._changed.set()

    async def get(self) -> NodePartitioning | None:
        return self.obj

    async def wait_change(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)
        self._changed.clear()

    async def write_status(self, status: NodePartitioningStatus) -> None:
        if self.obj is not None:
            self.obj = self.obj.model_copy(update={"status": status})
        self.status_writes += 1


class FileSpecSource:
    """A spec in a local JSON/YAML file (a NodePartitioning or a bare spec), for demos.

    The generation goes up whenever the file's content changes; the status is written as JSON
    to ``<file>.status.json``.  Changes are noticed by polling every ``poll_seconds``.  The file
    is read through :mod:`contract.input_files` (at most :data:`MAX_SPEC_BYTES`, UTF-8/16/32,
    no alias bombs, duplicate keys or deep nesting); every problem is a :class:`ValueError`
    naming the file.
    """

    def __init__(self, path: str | Path, name: str = "local", poll_seconds: float = 0.5) -> None:
        self.path = Path(path)
        self.status_path = self.path.with_name(self.path.name + ".status.json")
        self.name = name
        self.poll_seconds = poll_seconds
        self._text: str | None = None
        self._generation = 0
        self._status: NodePartitioningStatus | None = None

    def _read(self) -> str:
        try:
            return read_text(self.path, "spec", MAX_SPEC_BYTES)
        except InputError as e:
            raise ValueError(str(e)) from None

    def _parse(self, text: str) -> Any:
        where = str(self.path)
        try:
            if self.path.suffix.lower() == ".json":
                return parse_json(text, where)
            return parse_yaml(text, where)
        except InputError as e:
            raise ValueError(str(e)) from None

    async def get(self) -> NodePartitioning | None:
        text = self._read()
        if text != self._text:
            self._text = text
            self._generation += 1
        doc: Any = self._parse(text) if text.strip() else None
        if doc is None:
            return None
        if not isinstance(doc, dict):
            raise ValueError(
                f"spec file {self.path}: expected a mapping (a NodePartitioning, or a spec with "
                f"'mode' and 'gpus'), got {type(doc).__name__}"
            )
        try:
            if "spec" in doc:
                meta = doc.get("metadata", {})
                if not isinstance(meta, dict):
                    raise ValueError(
                        f"spec file {self.path}: 'metadata' must be a mapping, got "
                        f"{type(meta).__name__}; remove it or write metadata: {{name: ...}}"
                    )
                obj = NodePartitioning.model_validate(
                    {**doc, "metadata": {**meta, "name": self.name}}
                )
                spec = obj.spec
            else:
                spec = NodePartitioningSpec.model_validate(doc)
        except ValidationError as e:
            first = e.errors()[0]
            at = ".".join(str(p) for p in first["loc"]) or "the document"
            raise ValueError(
                f"spec file {self.path} is not a valid NodePartitioning spec: {e.error_count()} "
                f"error(s), the first at {at}: {first['msg']}"
            ) from None
        return NodePartitioning(
            metadata=ObjectMeta(name=self.name, generation=self._generation),
            spec=spec,
            status=self._status,
        )

    async def wait_change(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            await asyncio.sleep(min(self.poll_seconds, max(0.0, deadline - loop.time())))
            with contextlib.suppress(ValueError):
                if self._read() != self._text:
                    return

    async def write_status(self, status: NodePartitioningStatus) -> None:
        self._status = status
        self.status_path.write_text(json.dumps(status.model_dump(mode="json"), indent=2) + "\n")


def draining_gpus(status: Any) -> frozenset[int]:
    """GPU indices the partitioner drains (``status.reservations`` in state ``draining``)."""
    if not isinstance(status, dict):
        return frozenset()
    out: set[int] = set()
    for entry in status.get("reservations") or ():
        if isinstance(entry, dict) and entry.get("state") == "draining":
            for indices in (entry.get("gpus") or {}).values():
                out.update(i for i in indices if isinstance(i, int))
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class _Seen:
    """Identity of the object as last read: a new uid or generation is a new spec."""

    uid: str
    generation: int
    resource_version: str
    draining: frozenset[int] = frozenset()


async def kube_api_client() -> Any:
    """A new ``kubernetes_asyncio`` ``ApiClient`` (the caller closes it): the in-cluster service
    account, else the kubeconfig (``$KUBECONFIG``, ``~/.kube/config``); a ``ConfigException``
    in one line when neither is usable."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException as not_in_pod:
        kubeconfig = os.environ.get("KUBECONFIG") or None  # read now, not at import
        try:
            await config.load_kube_config(
                config_file=kubeconfig, client_configuration=configuration
            )
        except (config.ConfigException, OSError) as e:
            raise config.ConfigException(
                f"cannot connect to the Kubernetes API: not in a pod ({not_in_pod}) "
                f"and kubeconfig {kubeconfig or '~/.kube/config'} unusable ({e}); run "
                "the agent in its DaemonSet, or set KUBECONFIG"
            ) from None
    return client.ApiClient(configuration)


class CustomApiUser:
    """Holds a ``CustomObjectsApi``: an injected one (tests; the caller's to close), else one
    built on first use from the in-cluster service account or the kubeconfig
    (:func:`kube_api_client`) and closed by :meth:`close`."""

    _api: Any
    _owned: Any

    async def connect(self) -> Any:
        """The ``CustomObjectsApi``: the injected one, or one from the in-cluster service
        account, else the kubeconfig (``$KUBECONFIG``, ``~/.kube/config``)."""
        if self._api is None:
            from kubernetes_asyncio import client

            self._owned = await kube_api_client()
            self._api = client.CustomObjectsApi(self._owned)
        return self._api

    async def close(self) -> None:
        """Close the ApiClient :meth:`connect` built (an injected ``api`` is the caller's)."""
        owned, self._owned = self._owned, None
        if owned is not None:
            self._api = None
            await owned.close()


class KubeSpecSource(CustomApiUser):
    """The node's NodePartitioning through the Kubernetes API (kubernetes_asyncio).

    * ``get``: GET the cluster-scoped object (``None`` on 404) and remember its uid, generation,
      drained GPUs and resourceVersion.
    * ``write_status``: a merge PATCH of its ``status`` subresource (the agent's fields only).
    * ``wait_change``: a watch (``kubernetes_asyncio.watch.Watch``) on that one object (field
      selector ``metadata.name``, from the resourceVersion remembered, with bookmarks and server
      timeout ``timeout``) that returns at the first event that is a change for the agent
      (module docstring).  Every other event -- a BOOKMARK, the replay of the object as read,
      the agent's own status write -- only advances the remembered resourceVersion, so the next
      watch starts after it.  ``410 Gone`` (that resourceVersion is compacted away) forgets it
      and returns at once (the caller re-reads); a server that ends the watch returns too.
      The watch ends at ``timeout`` whatever the server does (kmock ignores ``timeoutSeconds``)
      and when its waiter is cancelled, closing its connection; it starts no task.
    * Failures: a watch that fails is retried after :class:`~contract.kube_retry.Backoff`
      delays (exponential, with jitter) until ``timeout``, so a broken API server neither spins
      the loop nor raises; ``get`` and ``write_status`` raise (a refusal as a one-line
      :class:`KubeApiError`).  One
      :class:`~contract.kube_retry.OutageLog` covers all three: one WARNING when the API starts
      failing, one INFO when a call succeeds again, DEBUG in between.

    ``api`` is a ``kubernetes_asyncio.client.CustomObjectsApi`` (the caller closes its
    ApiClient).  Without one, the source connects on first use with the in-cluster service
    account, else the kubeconfig (:meth:`connect`), and :meth:`close` closes that client.  Each
    request other than the watch is bounded by ``request_timeout_s``, and so is the watch's
    connection.
    """

    def __init__(
        self,
        name: str,
        api: Any | None = None,
        *,
        request_timeout_s: float = 10.0,
        backoff: Backoff | None = None,
    ):
        if not name:
            raise ValueError(
                "node name is empty: set GPUSLICE_NODE_NAME (downward API spec.nodeName)"
            )
        self.name = name
        self.request_timeout_s = request_timeout_s
        self.backoff = backoff if backoff is not None else Backoff(initial_s=1.0, cap_s=30.0)
        self._api = api
        self._owned: Any = None
        """The ApiClient :meth:`connect` built (closed by :meth:`close`)."""
        self._read = False
        self._seen: _Seen | None = None
        self._resource_version = ""
        """Where the next watch starts: the last read, advanced by events that changed nothing."""
        self.outage = OutageLog(f"Kubernetes API for NodePartitioning {name}", log)
        self.watch_events = 0
        """Watch events received, bookmarks included (for tests and debugging)."""
        self.crd_stale = False
        """The API server dropped a status field this agent wrote (told once in a warning)."""

    @property
    def resource_version(self) -> str:
        """The resourceVersion the next watch starts from (empty: from now)."""
        return self._resource_version

    async def get(self) -> NodePartitioning | None:
        from kubernetes_asyncio.client.exceptions import ApiException

        api = await self.connect()
        try:
            raw = await api.get_cluster_custom_object(
                GROUP, VERSION, PLURAL, self.name, _request_timeout=self.request_timeout_s
            )
        except ApiException as e:
            if e.status != 404:
                error = _api_error(e, f"reading NodePartitioning {self.name}")
                self.outage.failed(error)
                raise error from None
            raw = None
        except Exception as e:
            self.outage.failed(e)
            raise
        self.outage.succeeded()
        self._read = True
        if raw is None:
            self._seen, self._resource_version = None, ""
            return None
        obj = NodePartitioning.model_validate(raw)
        meta = raw.get("metadata") or {}
        self._seen = _Seen(
            str(meta.get("uid", "")),
            int(meta.get("generation") or 0),
            str(meta.get("resourceVersion", "")),
            draining_gpus(raw.get("status")),
        )
        self._resource_version = self._seen.resource_version
        return obj

    def _is_change(self, event: dict[str, Any]) -> bool:
        """Whether a watch event is news for the agent (see the module docstring)."""
        obj = event.get("object")
        if not isinstance(obj, dict) or event.get("type") not in ("ADDED", "MODIFIED", "DELETED"):
            return False
        meta = obj.get("metadata") or {}
        if meta.get("name") != self.name:
            return False
        if not self._read:
            return True
        seen = self._seen
        if event["type"] == "DELETED":
            return seen is not None and str(meta.get("uid", "")) == seen.uid
        return seen is None or (
            str(meta.get("uid", "")) != seen.uid
            or int(meta.get("generation") or 0) != seen.generation
            or draining_gpus(obj.get("status")) != seen.draining
        )

    async def _watch(self, api: Any, timeout: float) -> None:
        """One watch: returns at a change, at 410 Gone or when the server ends it; raises on
        any other failure.  The caller bounds it by ``timeout``."""
        from kubernetes_asyncio.client.exceptions import ApiException
        from kubernetes_asyncio.watch import Watch

        async def list_watch(*args: Any, **kwargs: Any) -> Any:
            """The watch request, refusing an answer that is not 2xx (``Watch`` reads any
            body as events, and an empty one as the end of the watch)."""
            # booleans as the API server's documentation spells them (Python would send
            # "True", which kmock does not take for a watch)
            kwargs.update(watch="true", allow_watch_bookmarks="true")
            resp = await api.list_cluster_custom_object(*args, **kwargs)
            if not 200 <= resp.status < 300:
                body = ""
                with contextlib.suppress(Exception):
                    body = (await resp.content.read(4096)).decode("utf-8", "replace")
                resp.close()
                raise ApiException(status=resp.status, reason=_status_message(body, resp.reason))
            self.outage.succeeded()  # the watch is open: the API answers again
            return resp

        kwargs: dict[str, Any] = {
            "field_selector": f"metadata.name={self.name}",
            "timeout_seconds": max(1, math.ceil(timeout)),
            "allow_watch_bookmarks": True,
            # bounds the connection; the caller bounds the whole watch by `timeout`
            "_request_timeout": (self.request_timeout_s, timeout + self.request_timeout_s),
        }
        if self._resource_version:
            kwargs["resource_version"] = self._resource_version
        watch = Watch(return_type="object")  # events carry plain dicts (no generated model)
        try:
            async for event in watch.stream(list_watch, GROUP, VERSION, PLURAL, **kwargs):
                self.watch_events += 1
                if not isinstance(event, dict):
                    raise ApiException(status=0, reason=f"not a watch event: {str(event)[:200]}")
                if event.get("type") != "BOOKMARK" and self._is_change(event):
                    return
                obj = event.get("raw_object")
                version = ((obj.get("metadata") if isinstance(obj, dict) else None) or {}).get(
                    "resourceVersion"
                )
                if self._read and version:  # nothing to act on up to this version
                    self._resource_version = str(version)
        except ApiException as e:
            if e.status != 410:
                raise
            log.debug(
                "watch on NodePartitioning %s from resourceVersion %s: 410 Gone; re-reading",
                self.name,
                self._resource_version,
            )
            self._resource_version = ""
        finally:
            resp, watch.resp = watch.resp, None
            if resp is not None:
                resp.close()  # a watch left mid-stream: drop its connection, not reuse it
            await watch.close()

    async def wait_change(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                api = await self.connect()
                async with asyncio.timeout_at(deadline):
                    await self._watch(api, timeout)
                return
            except TimeoutError:
                if loop.time() >= deadline:
                    return  # no change within `timeout`
                error: Exception = TimeoutError("no answer to the watch request")
            except Exception as e:  # API server unreachable or refusing: retry with backoff
                error = _api_error(e, f"watching NodePartitioning {self.name}")
            delay = self.backoff.delay(self.outage.failures + 1, random.random())
            remaining = deadline - loop.time()
            self.outage.failed(error, delay if delay < remaining else None)
            if delay >= remaining:
                await asyncio.sleep(max(0.0, remaining))
                return
            await asyncio.sleep(delay)

    async def write_status(self, status: NodePartitioningStatus) -> None:
        # a merge patch of the agent's own fields: the partitioner's (reservations) stay
        body = {"status": status.model_dump(mode="json", exclude=set(PARTITIONER_STATUS_FIELDS))}
        for name in CLEARED_WHEN_EMPTY:  # left out when empty: a merge patch must remove it
            body["status"].setdefault(name, None)
        from kubernetes_asyncio.client.exceptions import ApiException

        api = await self.connect()
        try:
            answer = await api.patch_cluster_custom_object_status(
                GROUP,
                VERSION,
                PLURAL,
                self.name,
                body,
                _content_type=MERGE_PATCH,
                _request_timeout=self.request_timeout_s,
            )
        except ApiException as e:
            error = _api_error(e, f"writing the status of NodePartitioning {self.name}")
            self.outage.failed(error)
            raise error from None
        except Exception as e:
            self.outage.failed(e)
            raise
        self.outage.succeeded()
        stored = answer.get("status") if isinstance(answer, dict) else None
        dropped = _dropped_field(body["status"], stored) if isinstance(stored, dict) else None
        if dropped is not None and not self.crd_stale:
            self.crd_stale = True
            log.warning(
                "the API server dropped status.%s of NodePartitioning %s: the cluster's "
                "NodePartitioning CRD is older than this agent (Helm does not upgrade CRDs), so "
                "the partitioner never reads it; apply the release's CRD: kubectl apply -f "
                "charts/gpuslice/crds/nodepartitioning.yaml (docs/operations.md, 'Install')",
                dropped,
                self.name,
            )


def _dropped_field(sent: Any, stored: Any, path: str = "") -> str | None:
    """The first field of ``sent`` (a status as written) that ``stored`` (as the API server
    answered it) lacks: pruned by a CRD schema that does not know it, or ``None``."""
    if isinstance(sent, dict) and isinstance(stored, dict):
        for key, value in sent.items():
            if value is None:  # a removal
                continue
            where = f"{path}.{key}" if path else key
            if key not in stored:
                return where
            found = _dropped_field(value, stored[key], where)
            if found is not None:
                return found
    elif isinstance(sent, list) and isinstance(stored, list):
        for i, (a, b) in enumerate(zip(sent, stored, strict=False)):
            found = _dropped_field(a, b, f"{path}[{i}]")
            if found is not None:
                return found
    return None


class KubeApiError(Exception):
    """The API server refused a call (``status``: its HTTP status code), in one line."""

    def __init__(self, what: str, status: int, message: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {message}" if status else f"{what}: {message}")
        self.status = status


def api_unavailable(e: BaseException) -> bool:
    """Whether an API call failed because the API server is unreachable or overloaded: no
    connection, a timeout, or HTTP 5xx / 429 (a :class:`KubeApiError` or ``ApiException``
    status).  A restart of the agent fixes none of these (module docstring).  A TLS failure is
    not one: the client reads the cluster's CA once, when it is built, so after a CA rotation
    every call fails verification until a restart reloads it -- going on with the spec last
    read would have kept the agent alive, and stale, for good."""
    if isinstance(e, ssl.SSLError):
        return False
    status = getattr(e, "status", None)
    if isinstance(status, int) and (status == 429 or 500 <= status <= 599):
        return True
    if isinstance(e, TimeoutError | ConnectionError):
        return True
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - kubernetes_asyncio depends on it
        return False
    if isinstance(e, aiohttp.ClientSSLError | aiohttp.ServerFingerprintMismatch):
        return False
    return isinstance(e, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError)


def _api_error(e: Exception, what: str) -> Exception:
    """A kubernetes_asyncio ``ApiException`` (whose text spans the HTTP headers and body) as a
    one-line :class:`KubeApiError`; any other error as it is."""
    from kubernetes_asyncio.client.exceptions import ApiException

    if not isinstance(e, ApiException):
        return e
    body = e.body.decode("utf-8", "replace") if isinstance(e.body, bytes) else str(e.body or "")
    return KubeApiError(what, int(e.status or 0), _status_message(body, e.reason))


def _status_message(body: str, reason: str | None) -> str:
    """The ``message`` of a Kubernetes ``Status`` answer, else the HTTP reason and body."""
    with contextlib.suppress(ValueError, AttributeError):
        message = json.loads(body).get("message")
        if message:
            return str(message)
    return body.strip()[:200] or reason or "no message"


class Agent:
    """The reconcile loop of one node (see the module docstring)."""

    def __init__(
        self,
        reconciler: Reconciler,
        source: SpecSource,
        *,
        resync_seconds: float = 30.0,
        retry_seconds: float = 2.0,
        clock: Callable[[], str] = now_rfc3339,
        metrics: AgentMetrics | None = None,
        health: AgentHealth | None = None,
        on_draining: Callable[[frozenset[str]], None] | None = None,
        mps_liveness_seconds: float = 5.0,
        xids: XidWatcher | None = None,
    ) -> None:
        self.reconciler = reconciler
        self.xids = xids
        """Watches NVML's XID events while :meth:`run` runs (module docstring); ``None``: off."""
        self._xid_wake = asyncio.Event()
        """Set (from the watcher's thread, through the loop) by a critical XID event."""
        self.mps_liveness_seconds = mps_liveness_seconds
        """Check the MPS daemons this often between passes (module docstring); 0: never."""
        self.daemon_deaths: dict[str, int] = {}
        """MPS daemon key -> deaths seen by this agent (crash loops)."""
        self.on_draining = on_draining
        """Receives the UUIDs of the GPUs the partitioner drains (the device plugin's preferred
        allocation puts their devices last: ``DevicePluginManager.set_avoided``)."""
        self.source = source
        self.resync_seconds = resync_seconds
        self.retry_seconds = retry_seconds
        self._clock = clock
        self.metrics = metrics
        self.health = health
        self._written: dict[str, Any] | None = None
        self.passes = 0
        self.last: ReconcileResult | None = None
        self._drain_logged: tuple[str, ...] | None = None
        """The held devices last logged while draining (``None``: not draining)."""
        self._read_once = False
        """The NodePartitioning was read at least once (a stale spec exists to go on with)."""
        self._spec_obj: NodePartitioning | None = None
        """The NodePartitioning as last read (``None``: there was none)."""
        self.api_failures = 0
        """API calls (read, status write) failed in a row (module docstring)."""
        self.spec_stale = False
        """The last pass went on with the spec last read: the API did not answer."""

    async def run_once(self) -> ReconcileResult:
        """One pass; its outcome goes to the metrics and health (if any), errors included."""
        t0 = time.monotonic()
        try:
            generation, result = await self._pass()
        except Exception as e:
            if self.metrics is not None:
                self.metrics.observe_failure(time.monotonic() - t0)
            if self.health is not None:
                self.health.record(False, f"{type(e).__name__}: {e}")
            raise
        t1 = time.monotonic()
        if self.metrics is not None:
            self.metrics.observe_pass(generation, result, t1 - t0, t1)
        if self.health is not None:
            self.health.record(not result.nvml_failed, "; ".join(result.errors))
        return result

    async def _read_spec(self) -> tuple[NodePartitioning | None, bool]:
        """The NodePartitioning, and whether it is the one last read because the API did not
        answer (module docstring, "Kubernetes API unavailable")."""
        try:
            obj = await self.source.get()
        except Exception as e:
            if not (self._read_once and api_unavailable(e)):
                raise
            self._api_failed("read", e)
            return self._spec_obj, True
        self._read_once = True
        self._spec_obj = obj
        return obj, False

    def _api_failed(self, call: str, e: Exception) -> None:
        """Log and count an API call that failed for lack of an API server."""
        self.api_failures += 1
        if self.metrics is not None:
            self.metrics.observe_api_error(call)
        obj = self._spec_obj
        what = f"generation {obj.metadata.generation or 0}" if obj is not None else "none: draining"
        if self.api_failures == 1:
            log.warning(
                "Kubernetes API unavailable (%s: %s: %s); reconciling with the NodePartitioning "
                "last read (%s) and writing its status again once it answers. Liveness does not "
                "fail for this: a restart cannot bring the API back and would end the MPS "
                "daemons (further failures at DEBUG)",
                call,
                type(e).__name__,
                e,
                what,
            )
        else:
            log.debug("Kubernetes API still unavailable (%s): %s: %s", call, type(e).__name__, e)

    async def _pass(self) -> tuple[int, ReconcileResult]:
        failures_before = self.api_failures
        obj, stale = await self._read_spec()
        if (
            not stale
            and self.on_draining is not None
            and obj is not None
            and obj.status is not None
        ):
            drained = draining_gpus(obj.status.model_dump(mode="json"))
            self.on_draining(
                frozenset(g.uuid for g in obj.status.gpus if g.index in drained and g.uuid)
            )
        spec = obj.spec if obj is not None else None
        generation = (obj.metadata.generation or 0) if obj is not None else 0
        previous = obj.status if obj is not None else None
        if stale and self.last is not None:
            previous = self.last.status  # newer than the one read, which may not be written
        result = await self.reconciler.reconcile(
            spec, generation, previous=previous, now=self._clock()
        )
        self.passes += 1
        self.last = result
        self.spec_stale = stale
        if self.metrics is not None:
            self.metrics.observe_spec_stale(stale)
        dumped = result.status.model_dump(mode="json")
        if obj is not None and dumped != self._written and not stale:
            try:
                await self.source.write_status(result.status)
            except Exception as e:
                if not api_unavailable(e):
                    raise
                self._api_failed("write_status", e)
            else:
                self._written = dumped
        if self.api_failures and self.api_failures == failures_before:
            log.info(
                "Kubernetes API answers again after %d failed call(s); the NodePartitioning "
                "is read and its status written again",
                self.api_failures,
            )
            self.api_failures = 0
        self._log_drain(result)
        level = logging.INFO if result.operations or result.errors else logging.DEBUG
        log.log(
            level,
            "reconciled generation %s: applied=%s ops=%d blocks=%s errors=%s",
            generation,
            result.applied,
            result.operations,
            {i: b.reason for i, b in result.blocks.items()},
            result.errors,
        )
        return generation, result

    def _log_drain(self, result: ReconcileResult) -> None:
        """Say, once per change, what a drain waits for (module docstring)."""
        if not result.draining:
            if self._drain_logged is not None:
                log.info("NodePartitioning is back: the node is managed again")
            self._drain_logged = None
            return
        if not result.fresh or result.held == self._drain_logged:
            return  # in-use ids unknown this pass, or nothing new to say
        self._drain_logged = result.held
        if result.held:
            shown = ", ".join(result.held[:8]) + (
                f" and {len(result.held) - 8} more" if len(result.held) > 8 else ""
            )
            log.info(
                "no NodePartitioning for this node (opted out, gpuslice being uninstalled, or "
                "not created yet): draining; %d device(s) still held by pods stay advertised "
                "and untouched: %s; free slices are no longer advertised and MPS daemons "
                "without clients are stopped",
                len(result.held),
                shown,
            )
        else:
            log.info(
                "no NodePartitioning for this node and no device held by a pod: drained "
                "(nothing advertised, no MPS daemon, GPUs in compute mode DEFAULT; MIG mode "
                "and MIG instances left as they are)"
            )

    async def run(self, stop: asyncio.Event | None = None, *, finish_drain_s: float = 15.0) -> None:
        """Reconcile until ``stop`` is set; if it was set mid-drain, finish the drain first (at
        most ``finish_drain_s`` seconds, :meth:`_finish_drain`)."""
        stop = stop or asyncio.Event()
        async with self._watching_xids():
            await self._loop(stop)
            if self.last is not None and self.last.draining:  # stopped (not cancelled) mid-drain
                await self._finish_drain(finish_drain_s)

    def _watching_xids(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Run the XID watcher in a worker thread while the body runs (module docstring;
        none when the setting ``xid_watch`` is off)."""
        return watching(self.xids, self._report_xids)

    async def _finish_drain(self, within_s: float) -> None:
        """Stopped while draining (SIGTERM: the partitioner removed the node's label once no
        pod used a slice, or an uninstall deleted the NodePartitioning): pass again, a second
        apart, until no device is held -- the kubelet may list a finished pod's devices a little
        longer -- so the last idle MPS daemon stops and its GPU is back in ``DEFAULT``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while loop.time() < deadline:
            try:
                result = await asyncio.wait_for(self.run_once(), deadline - loop.time())
            except Exception:  # the API or NVML is gone: nothing more to do on the way out
                return
            if not result.draining or (result.fresh and not result.held):
                return
            await asyncio.sleep(min(1.0, max(0.0, deadline - loop.time())))

    async def _loop(self, stop: asyncio.Event) -> None:
        failing = 0  # passes that raised in a row: the first is logged with its traceback
        while not stop.is_set():
            settled = False
            self._xid_wake.clear()  # an XID from now on wakes the next wait
            try:
                settled = (await self.run_once()).settled
            except Exception as e:
                failing += 1
                if failing == 1:
                    log.exception(
                        "reconcile pass failed; retrying every %ss (further failures at DEBUG "
                        "until a pass succeeds)",
                        self.retry_seconds,
                    )
                else:
                    log.debug("reconcile pass failed again (%d in a row): %s", failing, e)
            else:
                if failing:
                    log.info("reconcile passes succeed again after %d failure(s)", failing)
                failing = 0
            timeout = self.resync_seconds if settled else self.retry_seconds
            await first_of(
                self.source.wait_change(timeout),
                stop.wait(),
                self._watch_daemons(),
                self._xid_wake.wait(),
            )

    async def _watch_daemons(self) -> None:
        """Return once an MPS daemon is found dead, checking every ``mps_liveness_seconds``;
        never when that is 0 (module docstring).  A check that raises is logged at DEBUG and
        tried again at the next interval."""
        interval = self.mps_liveness_seconds
        if interval <= 0:
            await asyncio.Event().wait()  # off: never set; the loop's other waits end it
            return
        supervisor = self.reconciler.supervisor
        while True:
            await asyncio.sleep(interval)
            try:
                died = await _run_to_end(asyncio.to_thread(supervisor.check))
            except Exception as e:
                log.debug("MPS daemon liveness check failed: %s", e)
                continue
            if died:
                self._report_deaths(died)
                return

    def _report_deaths(self, died: list[str]) -> None:
        """Log and count MPS daemon deaths (module docstring)."""
        if self.metrics is not None:
            self.metrics.observe_daemon_deaths(died)
        for key in died:
            n = self.daemon_deaths[key] = self.daemon_deaths.get(key, 0) + 1
            log.warning(
                "MPS control daemon %s died (%d time(s) since this agent started); its MPS "
                "clients died with it. Reconciling now: its devices are advertised Unhealthy "
                "until it runs again, and it is started again with its limits even where pods "
                "hold its slices; a rising count is a crash loop (see its MPS log directory)",
                key,
                n,
            )

    def _report_xids(self, events: list[XidEvent]) -> None:
        """Count and log the XID events of one wait; a critical one wakes a pass (module
        docstring).  Runs on the event loop."""
        watcher = self.xids
        if watcher is not None and report_events(events, watcher, self.metrics, _XID_DOES):
            self._xid_wake.set()


_XID_DOES = (
    "reconciling now; the devices it hit (that instance's, else the whole GPU's) are advertised "
    "Unhealthy until the agent restarts: drain the node, reset the GPU or reboot, then restart "
    "the agent pod"
)
"""What the device-plugin agent does about a critical XID, as its WARNING says."""


async def _run_to_end[T](work: Awaitable[T]) -> T:
    """Await ``work``; if the waiter is cancelled meanwhile, let ``work`` finish first (a
    thread cannot be interrupted: the next pass must not use the supervisor alongside it), then
    re-raise the cancellation."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise
