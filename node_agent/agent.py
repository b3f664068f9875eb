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
:class:`~node_agent.health.AgentHealth` (a pass *fails* when it raises or reports errors).

Without a NodePartitioning the reconciler *drains* the node (module
:mod:`node_agent.reconciler`, "Drain"): the loop logs, at INFO and once per change, which
devices pods still hold (only those stay advertised; nothing is destroyed) and when none is
left.  When :meth:`Agent.run` is stopped (SIGTERM: the pod is deleted) during a drain, it passes
again for a few seconds until nothing is held, so the last idle MPS daemon is stopped and its GPU
put back in compute mode ``DEFAULT`` even when the pod goes right after its last client
(opt-out) or right after its NodePartitioning (uninstall).

:class:`KubeSpecSource` wakes the loop only for changes the agent must act on: a new
``metadata.generation`` (spec change), or the object created, deleted or re-created (new uid).
Its own status writes, and the API server replaying the current object at the start of a watch,
do not wake it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from pydantic import ValidationError

from contract.input_files import InputError, parse_json, parse_yaml, read_text
from contract.nodepartitioning import (
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
from node_agent.reconciler import Reconciler, ReconcileResult

__all__ = [
    "Agent",
    "FileSpecSource",
    "InMemorySpecSource",
    "KubeSpecSource",
    "SpecSource",
    "draining_gpus",
    "now_rfc3339",
]

log = logging.getLogger("gpuslice.agent")

MAX_SPEC_BYTES = 4 * 1024 * 1024
"""A NodePartitioning of a node with a few dozen GPUs is a few KiB."""


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


class KubeSpecSource:
    """The node's NodePartitioning through the Kubernetes API (in-cluster or kubeconfig).

    * ``get``: GET the cluster-scoped object (``None`` on 404) and remember its uid, generation
      and resourceVersion.
    * ``write_status``: a merge PATCH of its ``status`` subresource.
    * ``wait_change``: a watch on that one object (field selector ``metadata.name``, from the
      resourceVersion last read, server timeout ``timeout``) that returns at the first event that
      is a change for the agent (module docstring).  A watch that fails returns at ``timeout``
      (so a broken API server does not spin the loop); ``410 Gone`` returns at once (re-read).

    The blocking client runs in worker threads, each call bounded by ``request_timeout_s``.  A
    watch that outlives ``timeout`` (kmock ignores ``timeoutSeconds``) or whose waiter is
    cancelled has its socket shut down, so no thread is left reading.  ``api`` is a
    ``kubernetes.client.CustomObjectsApi``.
    """

    def __init__(self, name: str, api: Any | None = None, *, request_timeout_s: float = 10.0):
        if not name:
            raise ValueError(
                "node name is empty: set GPUSLICE_NODE_NAME (downward API spec.nodeName)"
            )
        self.name = name
        self.request_timeout_s = request_timeout_s
        if api is None:
            kube: Any = importlib.import_module("kubernetes")
            try:
                kube.config.load_incluster_config()
            except kube.config.ConfigException:
                kube.config.load_kube_config()
            api = kube.client.CustomObjectsApi()
        self._api = api
        self._read = False
        self._seen: _Seen | None = None
        self._response: Any = None
        self._interrupted = False
        self.watch_events = 0
        """Watch events received (for tests and debugging)."""

    async def get(self) -> NodePartitioning | None:
        def call() -> Any:
            from kubernetes.client.exceptions import ApiException

            try:
                return self._api.get_cluster_custom_object(
                    GROUP, VERSION, PLURAL, self.name, _request_timeout=self.request_timeout_s
                )
            except ApiException as e:
                if e.status == 404:
                    return None
                raise

        raw = await asyncio.to_thread(call)
        self._read = True
        if raw is None:
            self._seen = None
            return None
        obj = NodePartitioning.model_validate(raw)
        meta = raw.get("metadata") or {}
        self._seen = _Seen(
            str(meta.get("uid", "")),
            int(meta.get("generation") or 0),
            str(meta.get("resourceVersion", "")),
            draining_gpus(raw.get("status")),
        )
        return obj

    def _is_change(self, event: Any) -> bool:
        """Whether a watch event is news for the agent (see the module docstring)."""
        self.watch_events += 1
        obj = event.get("object") if isinstance(event, dict) else None
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

    def _watch(self, timeout: float) -> None:
        """Block until a change or ``timeout`` (raises on API errors other than 410 Gone)."""
        from kubernetes.client.exceptions import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        kwargs: dict[str, Any] = {
            "field_selector": f"metadata.name={self.name}",
            "timeout_seconds": max(1, math.ceil(timeout)),
            # a server that ignores timeoutSeconds still ends the watch: by read timeout
            "_request_timeout": (self.request_timeout_s, timeout + 1.0),
        }
        if self._seen is not None and self._seen.resource_version:
            kwargs["resource_version"] = self._seen.resource_version
        resp = self._api.list_cluster_custom_object(
            GROUP, VERSION, PLURAL, watch=True, _preload_content=False, **kwargs
        )
        self._response = resp
        try:
            status = int(getattr(resp, "status", 200))
            if status == 410 or self._interrupted:  # 410: our resourceVersion is too old
                return
            if not 200 <= status < 300:
                raise ApiException(status=status, reason=f"watch answered HTTP {status}")
            for line in iter_resp_lines(resp):
                if not line:
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    err = event.get("object") or {}
                    if err.get("code") == 410:
                        return
                    raise ApiException(status=err.get("code") or 500, reason=err.get("message"))
                if self._is_change(event):
                    return
        finally:
            self._response = None
            resp.close()

    def _interrupt(self) -> None:
        """End a watch blocked in its worker thread (its socket is shut down)."""
        self._interrupted = True
        resp = self._response
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()

    async def wait_change(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._interrupted = False
        watch = asyncio.ensure_future(asyncio.to_thread(self._watch, timeout))
        watch.add_done_callback(_retrieve)  # an interrupted watch's error is expected
        try:
            await asyncio.wait_for(asyncio.shield(watch), timeout + 0.25)
        except TimeoutError:
            self._interrupt()
        except asyncio.CancelledError:
            self._interrupt()  # the agent stops: do not leave a thread reading for `timeout`
            raise
        except Exception as e:  # API server unreachable or refusing: wait out the timeout
            remaining = deadline - loop.time()
            log.debug("watch on NodePartitioning %s failed: %s", self.name, e)
            if remaining > 0:
                await asyncio.sleep(remaining)

    async def write_status(self, status: NodePartitioningStatus) -> None:
        # a merge patch of the agent's own fields: the partitioner's (reservations) stay
        body = {"status": status.model_dump(mode="json", exclude=set(PARTITIONER_STATUS_FIELDS))}
        await asyncio.to_thread(
            self._api.patch_cluster_custom_object_status,
            GROUP,
            VERSION,
            PLURAL,
            self.name,
            body,
            _request_timeout=self.request_timeout_s,
        )


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


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
    ) -> None:
        self.reconciler = reconciler
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
            self.health.record(not result.errors, "; ".join(result.errors))
        return result

    async def _pass(self) -> tuple[int, ReconcileResult]:
        obj = await self.source.get()
        if self.on_draining is not None and obj is not None and obj.status is not None:
            drained = draining_gpus(obj.status.model_dump(mode="json"))
            self.on_draining(
                frozenset(g.uuid for g in obj.status.gpus if g.index in drained and g.uuid)
            )
        spec = obj.spec if obj is not None else None
        generation = (obj.metadata.generation or 0) if obj is not None else 0
        previous = obj.status if obj is not None else None
        result = await self.reconciler.reconcile(
            spec, generation, previous=previous, now=self._clock()
        )
        self.passes += 1
        self.last = result
        dumped = result.status.model_dump(mode="json")
        if obj is not None and dumped != self._written:
            await self.source.write_status(result.status)
            self._written = dumped
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

    async def run(
        self, stop: asyncio.Event | None = None, *, finish_drain_s: float = 15.0
    ) -> None:
        """Reconcile until ``stop`` is set; if it was set mid-drain, finish the drain first (at
        most ``finish_drain_s`` seconds, :meth:`_finish_drain`)."""
        stop = stop or asyncio.Event()
        await self._loop(stop)
        if self.last is not None and self.last.draining:  # stopped (not cancelled) mid-drain
            await self._finish_drain(finish_drain_s)

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
        while not stop.is_set():
            settled = False
            try:
                settled = (await self.run_once()).settled
            except Exception:
                log.exception("reconcile pass failed; retrying in %ss", self.retry_seconds)
            timeout = self.resync_seconds if settled else self.retry_seconds
            waiter = asyncio.ensure_future(self.source.wait_change(timeout))
            stopper = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (waiter, stopper):
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await t
