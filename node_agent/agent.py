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
raises is logged and retried; the loop itself never dies of a bad pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import yaml

from contract.nodepartitioning import (
    GROUP,
    PLURAL,
    VERSION,
    NodePartitioning,
    NodePartitioningSpec,
    NodePartitioningStatus,
    ObjectMeta,
)
from node_agent.reconciler import Reconciler, ReconcileResult

__all__ = [
    "Agent",
    "FileSpecSource",
    "InMemorySpecSource",
    "KubeSpecSource",
    "SpecSource",
    "now_rfc3339",
]

log = logging.getLogger("gpuslice.agent")


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
    to ``<file>.status.json``.  Changes are noticed by polling every ``poll_seconds``.
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
            return self.path.read_text()
        except OSError as e:
            raise ValueError(f"cannot read spec file {self.path}: {e}") from e

    async def get(self) -> NodePartitioning | None:
        text = self._read()
        if text != self._text:
            self._text = text
            self._generation += 1
        doc: Any = yaml.safe_load(text) if text.strip() else None
        if doc is None:
            return None
        try:
            if isinstance(doc, dict) and "spec" in doc:
                obj = NodePartitioning.model_validate(
                    {**doc, "metadata": {"name": self.name, **doc.get("metadata", {})}}
                )
                spec = obj.spec
            else:
                spec = NodePartitioningSpec.model_validate(doc)
        except ValueError as e:
            raise ValueError(
                f"spec file {self.path} is not a valid NodePartitioning spec: {e}"
            ) from e
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


class KubeSpecSource:
    """The node's NodePartitioning through the Kubernetes API (in-cluster or kubeconfig).

    ``get``: GET the cluster-scoped object; ``write_status``: PATCH its status subresource;
    ``wait_change``: a watch on that one object (field selector ``metadata.name``) that returns
    at the first event.  The blocking client runs in a worker thread.
    """

    def __init__(self, name: str, api: Any | None = None) -> None:
        if not name:
            raise ValueError(
                "node name is empty: set GPUSLICE_NODE_NAME (downward API spec.nodeName)"
            )
        self.name = name
        if api is None:
            kube: Any = importlib.import_module("kubernetes")
            try:
                kube.config.load_incluster_config()
            except kube.config.ConfigException:
                kube.config.load_kube_config()
            api = kube.client.CustomObjectsApi()
        self._api = api

    async def get(self) -> NodePartitioning | None:
        def call() -> Any:
            from kubernetes.client.exceptions import ApiException

            try:
                return self._api.get_cluster_custom_object(GROUP, VERSION, PLURAL, self.name)
            except ApiException as e:
                if e.status == 404:
                    return None
                raise

        raw = await asyncio.to_thread(call)
        return None if raw is None else NodePartitioning.model_validate(raw)

    async def wait_change(self, timeout: float) -> None:
        def call() -> None:
            w: Any = importlib.import_module("kubernetes.watch").Watch()
            for _event in w.stream(
                self._api.list_cluster_custom_object,
                GROUP,
                VERSION,
                PLURAL,
                field_selector=f"metadata.name={self.name}",
                timeout_seconds=max(1, int(timeout)),
            ):
                w.stop()
                return

        await asyncio.to_thread(call)

    async def write_status(self, status: NodePartitioningStatus) -> None:
        body = {"status": status.model_dump(mode="json")}
        await asyncio.to_thread(
            self._api.patch_cluster_custom_object_status, GROUP, VERSION, PLURAL, self.name, body
        )


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
    ) -> None:
        self.reconciler = reconciler
        self.source = source
        self.resync_seconds = resync_seconds
        self.retry_seconds = retry_seconds
        self._clock = clock
        self._written: dict[str, Any] | None = None
        self.passes = 0
        self.last: ReconcileResult | None = None

    async def run_once(self) -> ReconcileResult:
        obj = await self.source.get()
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
        return result

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
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
