"""The ``gpuslice`` commands' Kubernetes client: the few API calls they make, as raw JSON.

:class:`Cluster` wraps kubernetes_asyncio without its model objects and runs each call to
completion (the commands are sequences of calls, one after another); every failure is an
:class:`ApiFailure` naming the object.  Connection: ``--kubeconfig``/``--context`` (or
``$KUBECONFIG``), else the in-cluster service account.  Used by ``gpuslice ungate`` (which
writes) and ``gpuslice status`` (which only reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gpuslice.cli import BadInput

__all__ = ["MERGE_PATCH", "NP", "REQUEST_TIMEOUT_S", "ApiFailure", "Cluster"]

MERGE_PATCH = "application/merge-patch+json"
_PAGE = 500
REQUEST_TIMEOUT_S = 30.0
"""Longest wait for one API request."""
NP = ("gpuslice.io", "v1alpha1", "nodepartitionings")
CLAIMS = ("resource.k8s.io", "v1", "resourceclaims")


@dataclass(frozen=True)
class ApiFailure(Exception):
    """An API call failed; ``what`` names the object."""

    what: str
    status: int
    detail: str

    def __str__(self) -> str:
        return (
            f"{self.what}: {self.status} {self.detail}"
            if self.status
            else f"{self.what}: {self.detail}"
        )


class Cluster:
    """The few calls the commands make, as raw JSON (kubernetes_asyncio, no model objects).

    A command is a sequence of calls, one after another, so this class keeps it synchronous:
    each call runs to completion on the class's own event loop (an :class:`asyncio.Runner`),
    and :meth:`close` closes the client and that loop.  Each request is bounded by
    :data:`REQUEST_TIMEOUT_S`; no answer in time, or none at all, is an :class:`ApiFailure`
    with status 0.
    """

    def __init__(self, kubeconfig: str | None, context: str | None) -> None:
        self._runner = asyncio.Runner()
        try:
            self._api_client = self._runner.run(self._connect(kubeconfig, context))
        except BaseException:
            self._runner.close()
            raise
        from kubernetes_asyncio import client

        self.core = client.CoreV1Api(self._api_client)
        self.admission = client.AdmissionregistrationV1Api(self._api_client)
        self.apps = client.AppsV1Api(self._api_client)
        self.custom = client.CustomObjectsApi(self._api_client)
        self.coordination = client.CoordinationV1Api(self._api_client)

    @staticmethod
    async def _connect(kubeconfig: str | None, context: str | None) -> Any:
        """An ApiClient: the in-cluster service account when no kubeconfig or context is
        given and the process runs in a pod, else the kubeconfig (``$KUBECONFIG``,
        ``~/.kube/config``)."""
        import yaml
        from kubernetes_asyncio import client, config

        try:
            if kubeconfig is None and context is None and "KUBERNETES_SERVICE_HOST" in os.environ:
                configuration = client.Configuration()
                config.load_incluster_config(client_configuration=configuration)
                return client.ApiClient(configuration)
            return await config.new_client_from_config(config_file=kubeconfig, context=context)
        except (
            config.ConfigException,
            OSError,
            ValueError,
            TypeError,
            KeyError,
            AttributeError,
            AssertionError,  # the client library asserts the shape of some entries
            yaml.YAMLError,
        ) as e:
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            why = " ".join((f"{type(e).__name__}: {e}" if str(e) else type(e).__name__).split())
            raise BadInput(
                f"cannot connect: kubeconfig {where} is not usable ({why}); check it with "
                "`kubectl config view`"
            ) from None

    def close(self) -> None:
        try:
            self._runner.run(self._api_client.close())
        finally:
            self._runner.close()

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        import aiohttp

        async def call() -> tuple[int, str, bytes]:
            resp = await fn(
                *args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S, **kwargs
            )
            try:
                return resp.status, str(resp.reason or ""), await resp.read()
            finally:
                resp.release()

        try:
            status, reason, data = self._runner.run(call())
        except aiohttp.InvalidURL as e:  # the kubeconfig's server or proxy URL
            raise BadInput(
                f"{what}: the kubeconfig's API server or proxy URL is not a URL ({e}); check it "
                "with `kubectl config view`"
            ) from None
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise ApiFailure(what, 0, f"cannot reach the API server: {why}") from None
        if not 200 <= status < 300:
            detail = reason
            with contextlib.suppress(ValueError, AttributeError):
                detail = json.loads(data or b"{}").get("message") or detail
            raise ApiFailure(what, status, str(detail))
        result: dict[str, Any] = json.loads(data or b"{}")
        return result

    def _pages(
        self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Iterator[dict[str, Any]]:
        """Every item of a paged list call, each once.  A continue token the API server no
        longer keeps (410 Expired, after an etcd compaction: routine on big clusters) starts
        the list over once, as kubectl's pager does, skipping the items already yielded (by
        uid); the uninstall hook stopped on it with every gated pod left gated."""
        token: str | None = None
        seen: set[str] = set()
        restarted = False
        while True:
            page: dict[str, Any] = {"limit": _PAGE, **kwargs}
            if token:
                page["_continue"] = token
            try:
                doc = self._call(what, fn, *args, **page)
            except ApiFailure as e:
                if e.status != 410 or not token or restarted:
                    raise
                restarted, token = True, None
                continue
            for item in doc.get("items") or ():
                uid = str((item.get("metadata") or {}).get("uid") or "")
                if uid and uid in seen:
                    continue
                if uid:
                    seen.add(uid)
                yield item
            token = (doc.get("metadata") or {}).get("continue")
            if not token:
                return

    def pods(self, namespace: str | None, selector: str | None = None) -> Iterator[dict[str, Any]]:
        extra = {"label_selector": selector} if selector else {}
        if namespace:
            return self._pages(
                f"pods in {namespace}", self.core.list_namespaced_pod, namespace, **extra
            )
        return self._pages("pods", self.core.list_pod_for_all_namespaces, **extra)

    def gated(self, namespace: str | None) -> Iterator[dict[str, Any]]:
        from partitioner.gating import has_gate

        return (p for p in self.pods(namespace) if has_gate(p))

    def deployment(self, namespace: str, name: str) -> dict[str, Any]:
        return self._call(
            f"Deployment {namespace}/{name}", self.apps.read_namespaced_deployment, name, namespace
        )

    def scale_to_zero(self, namespace: str, name: str) -> None:
        self._call(
            f"Deployment {namespace}/{name}",
            self.apps.patch_namespaced_deployment_scale,
            name,
            namespace,
            {"spec": {"replicas": 0}},
            _content_type=MERGE_PATCH,
        )

    def _delete(self, what: str, fn: Any, *args: Any) -> bool:
        """Delete ``what``; ``False`` if it was already gone (404)."""
        try:
            self._call(what, fn, *args)
        except ApiFailure as e:
            if e.status == 404:
                return False
            raise
        return True

    def delete_lease(self, namespace: str, name: str) -> bool:
        """``False`` if it was already gone."""
        return self._delete(
            f"Lease {namespace}/{name}", self.coordination.delete_namespaced_lease, name, namespace
        )

    def claims(self, namespace: str | None) -> list[dict[str, Any]]:
        """The ResourceClaims (``resource.k8s.io/v1``), of one namespace or all; none where the
        API server serves no such kind (404: no DRA)."""
        try:
            if namespace:
                return list(
                    self._pages(
                        f"ResourceClaims in {namespace}",
                        self.custom.list_namespaced_custom_object,
                        *CLAIMS[:2],
                        namespace,
                        CLAIMS[2],
                    )
                )
            return list(
                self._pages("ResourceClaims", self.custom.list_cluster_custom_object, *CLAIMS)
            )
        except ApiFailure as e:
            if e.status == 404:
                return []
            raise

    def partitioning_objects(self) -> list[dict[str, Any]]:
        return list(self._pages("NodePartitionings", self.custom.list_cluster_custom_object, *NP))

    def partitionings(self) -> list[str]:
        return sorted(str(o["metadata"]["name"]) for o in self.partitioning_objects())

    def events(self, namespace: str, kind: str, name: str) -> list[dict[str, Any]]:
        """The Events about one object (core/v1, by ``involvedObject``), oldest first."""
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        items = self._pages(
            f"events of {kind} {namespace}/{name}",
            self.core.list_namespaced_event,
            namespace,
            field_selector=selector,
        )
        mine = [  # the selector again: a server that ignores it must not mix other objects in
            e
            for e in items
            if (e.get("involvedObject") or {}).get("kind") == kind
            and (e.get("involvedObject") or {}).get("name") == name
        ]
        return sorted(mine, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))

    def delete_partitioning(self, name: str) -> bool:
        """``False`` if it was already gone."""
        return self._delete(
            f"NodePartitioning {name}", self.custom.delete_cluster_custom_object, *NP, name
        )

    def nodes(self) -> list[dict[str, Any]]:
        return list(self._pages("nodes", self.core.list_node))

    def read_node(self, name: str) -> dict[str, Any]:
        return self._call(f"node {name}", self.core.read_node, name)

    def patch_node(self, name: str, body: dict[str, Any], status: bool = False) -> None:
        fn = self.core.patch_node_status if status else self.core.patch_node
        self._call(f"node {name}", fn, name, body, _content_type=MERGE_PATCH)

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self._call(f"pod {namespace}/{name}", self.core.read_namespaced_pod, name, namespace)

    def patch(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        self._call(
            f"pod {namespace}/{name}",
            self.core.patch_namespaced_pod,
            name,
            namespace,
            body,
            _content_type=MERGE_PATCH,
        )

    def delete_webhook(self, name: str) -> bool:
        """Delete the MutatingWebhookConfiguration; ``False`` if it was already gone."""
        try:
            self._call(
                f"MutatingWebhookConfiguration {name}",
                self.admission.delete_mutating_webhook_configuration,
                name,
            )
        except ApiFailure as e:
            if e.status == 404:
                return False
            raise
        return True
