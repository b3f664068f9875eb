"""The partitioner's Kubernetes client: kubernetes_asyncio's ApiClient, for plain JSON objects.

Model
-----
kopf owns the watching; this client reads (single objects, and whole collections with
:meth:`KubeApi.list_all`), creates, patches and deletes.  It sends every request through the
official asyncio client's :class:`kubernetes_asyncio.client.ApiClient` (``call_api`` and its
REST client), with plain dicts in and out (no generated models: the partitioner reads the few
fields it needs, and its NodePartitionings have no generated model anyway).

* Connection: the :class:`Endpoint` kopf logged in to (server, ``Authorization`` header, TLS
  context), re-read on every request so a re-login by kopf is picked up.  The headers go with
  each request; one ApiClient (one connection pool) serves each distinct ``(server, ssl)``, whose
  REST client uses the Endpoint's SSL context (kopf's, with the cluster CA and any client
  certificate, which kubernetes_asyncio's ``Configuration`` could only take as files).  A
  caller's ``endpoint`` must therefore return the same SSL context while the login is unchanged
  (``partitioner.operator.Controller`` keeps one per login).
* Errors: every failure is an :class:`ApiError`: the API's status code, reason and message
  (409 is :class:`Conflict`, 404 :class:`NotFound`, 410 :class:`Expired`), or
  :class:`Unreachable` (status 0) when no answer came: connection refused or reset, TLS failure,
  no answer within ``timeout_s``.
* Lists (:meth:`KubeApi.list_all`): pages of ``page_size`` objects (``limit``), following
  ``metadata.continue``; all pages are one consistent snapshot (the first page's
  resourceVersion).  A continue token the server no longer honours (``410 Expired``: it
  compacted that version away) restarts the list from the first page, at most
  ``restarts`` times.
* Retries (:func:`retry_with_backoff`, tenacity): after a failed attempt the next one waits
  :meth:`Backoff.delay`: exponential growth up to a cap, with jitter so replicas do not retry in
  lockstep; an outage is logged as one WARNING when it starts and one INFO when it ends
  (:class:`OutageLog`), every failure in between at DEBUG.  These three live in
  :mod:`contract.kube_retry` (the node agent uses them too) and are re-exported here.
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.client.rest import RESTClientObject

from contract.kube_retry import Backoff, OutageLog, retry_with_backoff

__all__ = [
    "MERGE_PATCH",
    "STRATEGIC_MERGE_PATCH",
    "USER_AGENT",
    "ApiError",
    "Backoff",
    "Conflict",
    "Endpoint",
    "Expired",
    "KubeApi",
    "NotFound",
    "OutageLog",
    "Unreachable",
    "retry_with_backoff",
]

log = logging.getLogger("gpuslice.partitioner.kubeapi")

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
USER_AGENT = "gpuslice-partitioner"
_JSON_ANSWERS = {200: "object", 201: "object", 202: "object"}
"""``call_api``'s response types: ``object`` hands the decoded JSON back unchanged."""


class ApiError(Exception):
    """The API server refused a request (``status``: its HTTP status code)."""

    def __init__(self, status: int, reason: str, message: str, path: str) -> None:
        super().__init__(f"{status} {reason} on {path}: {message}")
        self.status, self.reason, self.message, self.path = status, reason, message, path


class Conflict(ApiError):
    """409: the object changed since it was read (or already exists, on create)."""


class NotFound(ApiError):
    """404: the object or resource does not exist."""


class Expired(ApiError):
    """410: a continue token (or resourceVersion) older than the server still keeps."""


class Unreachable(ApiError):
    """No answer: connection refused or reset, TLS failure, or none within the timeout."""

    def __init__(self, path: str, cause: BaseException) -> None:
        why = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        super().__init__(0, "Unreachable", why, path)
        self.args = (f"{path}: API server unreachable: {why}",)


@dataclass(frozen=True, slots=True)
class Endpoint:
    server: str
    headers: Mapping[str, str] = field(default_factory=dict)
    ssl: ssl.SSLContext | bool = True
    """An SSL context, True for the system defaults, False to skip verification."""


class _RestClient(RESTClientObject):
    """kubernetes_asyncio's REST client with a given TLS context instead of one from files.

    The parent builds its :class:`ssl.SSLContext` from ``Configuration`` file paths; everything
    else (requests, proxies, ``server_hostname``, the read buffer for large objects) is the
    parent's, set up with the same attributes.
    """

    def __init__(self, configuration: Configuration, tls: ssl.SSLContext | bool) -> None:
        # the parent assigns these same optional values (its stub types them without None)
        self.server_hostname = configuration.tls_server_name  # type: ignore[assignment]
        self.proxy = configuration.proxy  # type: ignore[assignment]
        self.proxy_headers = configuration.proxy_headers  # type: ignore[assignment]
        connector = aiohttp.TCPConnector(limit=configuration.connection_pool_maxsize, ssl=tls)
        self.pool_manager = aiohttp.ClientSession(
            connector=connector, trust_env=True, read_bufsize=2**21
        )


async def _api_client(ep: Endpoint) -> ApiClient:
    """An ApiClient for ``ep``'s server whose REST client uses ``ep.ssl``."""
    config = Configuration(host=ep.server.rstrip("/"))
    config.verify_ssl = ep.ssl is not False
    client = ApiClient(config)
    default, client.rest_client = client.rest_client, _RestClient(config, ep.ssl)
    await default.close()  # the one ApiClient built itself: it never opened a connection
    client.user_agent = USER_AGENT
    return client


class KubeApi:
    """JSON requests to the API server over kubernetes_asyncio (module docstring)."""

    def __init__(self, endpoint: Callable[[], Endpoint], timeout_s: float = 30.0) -> None:
        self._endpoint = endpoint
        self.timeout_s = timeout_s
        self._client: ApiClient | None = None
        self._client_for: tuple[str, ssl.SSLContext | bool] | None = None
        self._retired: list[ApiClient] = []
        """Clients of an earlier login with requests still in flight on them: each is closed
        when its last one ends (before, every re-login after a 401 left one open for good)."""
        self._in_flight: dict[int, int] = {}
        """``id(client)`` -> requests in flight on it."""

    async def close(self) -> None:
        clients = [*self._retired, *([self._client] if self._client is not None else [])]
        self._client, self._client_for, self._retired = None, None, []
        for client in clients:
            await client.close()

    async def _client_of(self, ep: Endpoint) -> ApiClient:
        key = (ep.server, ep.ssl)
        if self._client is None or self._client_for != key:
            client = await _api_client(ep)
            old, self._client, self._client_for = self._client, client, key
            if old is not None:
                if self._in_flight.get(id(old)):
                    self._retired.append(old)
                else:
                    await old.close()
        return self._client

    async def _done(self, client: ApiClient) -> None:
        """A request on ``client`` ended: a retired client with none left is closed."""
        left = self._in_flight.get(id(client), 1) - 1
        if left > 0:
            self._in_flight[id(client)] = left
            return
        self._in_flight.pop(id(client), None)
        if any(c is client for c in self._retired):
            self._retired = [c for c in self._retired if c is not client]
            await client.close()

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        *,
        query: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """``method path`` with a JSON ``body`` (sent as ``content_type``); the decoded answer."""
        ep = self._endpoint()
        client = await self._client_of(ep)
        self._in_flight[id(client)] = self._in_flight.get(id(client), 0) + 1
        try:
            return await self._call(client, ep, method, path, body, content_type, query)
        finally:
            await self._done(client)

    async def _call(
        self,
        client: ApiClient,
        ep: Endpoint,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        content_type: str,
        query: Mapping[str, str] | None,
    ) -> dict[str, Any]:
        headers = {**ep.headers, "Accept": "application/json", "Content-Type": content_type}
        where = f"{method} {path}"
        try:
            result = await client.call_api(
                path,
                method.upper(),
                query_params=list(query.items()) if query else None,
                header_params=headers,
                body=dict(body) if body is not None else None,
                response_types_map=_JSON_ANSWERS,
                _return_http_data_only=True,
                _request_timeout=self.timeout_s,
            )
        except ApiException as e:
            raise _error(int(e.status or 0), _text(e.body), where) from None
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise Unreachable(where, e) from e
        return result if isinstance(result, dict) else {}

    async def create(self, path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, obj)

    async def patch(
        self, path: str, patch: Mapping[str, Any], content_type: str = MERGE_PATCH
    ) -> dict[str, Any]:
        return await self.request("PATCH", path, patch, content_type)

    async def delete(self, path: str) -> dict[str, Any]:
        return await self.request("DELETE", path)

    async def list_all(
        self, path: str, page_size: int = 500, restarts: int = 3, selector: str = ""
    ) -> dict[str, Any]:
        """Every object of the collection at ``path`` (``selector``: those its label selector
        matches), read in pages of ``page_size``.

        Returns the list as one document: ``items`` (all pages, in order), and ``metadata`` with
        the ``resourceVersion`` of the snapshot.  A ``410 Expired`` on a continue token restarts
        the list from its first page (at most ``restarts`` times; then the :class:`Expired`
        propagates).
        """
        if page_size < 1:
            raise ValueError(f"list page size must be >= 1, got {page_size}")
        for attempt in range(restarts + 1):
            items: list[Any] = []
            token = ""
            while True:
                query = {"limit": str(page_size)}
                if selector:
                    query["labelSelector"] = selector
                if token:
                    query["continue"] = token
                try:
                    page = await self.request("GET", path, query=query)
                except Expired:
                    if not token or attempt == restarts:
                        raise
                    log.info(
                        "listing %s: continue token expired after %d object(s); restarting "
                        "the list",
                        path,
                        len(items),
                    )
                    break
                items.extend(page.get("items") or ())
                meta = page.get("metadata") or {}
                token = str(meta.get("continue") or "")
                if not token:
                    version = meta.get("resourceVersion")
                    return {**page, "metadata": {"resourceVersion": version}, "items": items}
        raise AssertionError("unreachable: the last restart raises or returns")


def _text(body: Any) -> str:
    if isinstance(body, bytes):
        return body.decode("utf-8", "replace")
    return "" if body is None else str(body)


def _error(status: int, text: str, where: str) -> ApiError:
    reason, message = "", text[:500]
    try:
        doc = json.loads(text)
        reason, message = str(doc.get("reason", "")), str(doc.get("message", message))
    except (json.JSONDecodeError, AttributeError):
        pass
    cls = {409: Conflict, 404: NotFound, 410: Expired}.get(status, ApiError)
    return cls(status, reason, message, where)
