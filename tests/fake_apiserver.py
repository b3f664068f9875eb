"""A Kubernetes API server for tests: kmock's emulator plus the bookkeeping clients rely on.

Model
-----
kmock (by kopf's author) stores objects and serves get/list/watch/create/patch/delete over real
HTTP, but assigns neither ``uid`` nor ``resourceVersion`` nor ``generation``, checks no
preconditions and knows no status subresource.  :class:`ApiServer` adds what the API server does
for those, so the node agent's and the partitioner's clients see realistic objects:

* create: ``uid``, ``generation: 1`` (unless given) and a fresh ``resourceVersion``;
* every update: a fresh ``resourceVersion``; a ``metadata.resourceVersion`` in the body that is
  not the current one -> ``409 Conflict``;
* resources declared with the ``status`` subresource (:func:`declare`): a write to the object
  drops ``status`` from the body and bumps ``generation`` when ``spec`` changes; a write to
  ``<object>/status`` keeps only ``status`` (and the precondition) and never bumps it.

kmock ignores field and label selectors and ``timeoutSeconds`` on watches: a client must filter
the events it gets and end its watch itself.

:func:`declare` registers the resources gpuslice uses (namespaces, nodes, pods, events,
NodePartitionings) and the ``default`` namespace.  Use it with the ``kmock`` pytest fixture by
overriding ``kmock_options`` to ``{"cls": ApiServer}``.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import kmock

NP_RESOURCE = "gpuslice.io/v1alpha1/nodepartitionings"
NP_PATH = "/apis/gpuslice.io/v1alpha1/nodepartitionings"
_VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """kmock plus uid, resourceVersion, generation, 409 and the status subresource."""

    _versions: Iterator[int] = attrs.field(factory=lambda: itertools.count(1000), init=False)

    def _has_status_subresource(self, resource: kmock.resource) -> bool:
        try:
            info = self.resources[resource]
        except KeyError:
            return False
        return "status" in set(info.subresources)

    async def _handle(self, request: kmock.Request) -> Any:
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if request.action == kmock.action.CREATE:
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("generation", 1)
                meta["resourceVersion"] = str(next(self._versions))
            elif request.action == kmock.action.UPDATE and request.name is not None:
                self._update(request, request.resource, request.name, data, meta)
        return await super()._handle(request)

    def _update(
        self,
        request: kmock.Request,
        resource: kmock.resource,
        name: str,
        data: dict[str, Any],
        meta: dict[str, Any],
    ) -> None:
        key = (resource, request.namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return  # kmock answers 404
        current = self.objects[key]
        cur_meta = current.get("metadata") or {}
        wanted = meta.get("resourceVersion")
        if wanted is not None and wanted != cur_meta.get("resourceVersion"):
            raise kmock.KubernetesError(
                status=409,
                reason="Conflict",
                message=(
                    f"the object has been modified (resourceVersion is "
                    f"{cur_meta.get('resourceVersion')}, the update named {wanted})"
                ),
            )
        if self._has_status_subresource(resource):
            if request.subresource == "status":
                for field in [k for k in data if k not in ("status", "metadata")]:
                    del data[field]
                for field in [k for k in meta if k != "resourceVersion"]:
                    del meta[field]
            else:
                data.pop("status", None)
        if request.subresource is None and "spec" in data and data["spec"] != current.get("spec"):
            meta["generation"] = int(cur_meta.get("generation") or 1) + 1
        meta["resourceVersion"] = str(next(self._versions))


def declare(api: kmock.KubernetesEmulator) -> None:
    """Declare the resources gpuslice uses and the ``default`` namespace."""
    api.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", singular="namespace", namespaced=False, verbs=_VERBS
    )
    api.resources["v1/nodes"] = kmock.ResourceInfo(
        kind="Node", singular="node", namespaced=False, verbs=_VERBS, subresources={"status"}
    )
    api.resources["v1/pods"] = kmock.ResourceInfo(
        kind="Pod", singular="pod", namespaced=True, verbs=_VERBS, subresources={"status"}
    )
    api.resources["v1/events"] = kmock.ResourceInfo(
        kind="Event", singular="event", namespaced=True, verbs=_VERBS
    )
    api.resources[NP_RESOURCE] = kmock.ResourceInfo(
        kind="NodePartitioning",
        singular="nodepartitioning",
        namespaced=False,
        verbs=_VERBS,
        subresources={"status"},
    )
    api.objects["v1/namespaces", None, "default"] = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "default", "uid": "ns-default", "resourceVersion": "1"},
    }


def stored(api: kmock.KubernetesEmulator, resource: str, name: str) -> dict[str, Any] | None:
    """The stored object (cluster-scoped), or ``None`` if absent or deleted."""
    key = (kmock.resource(resource), None, name)
    if key not in api.objects or api.objects[key].deleted:
        return None
    return dict(api.objects[key])
