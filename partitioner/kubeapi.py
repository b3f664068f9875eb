"""A minimal asynchronous Kubernetes API client for the writes the partitioner makes.

kopf owns the watching; this client only creates, patches and deletes NodePartitionings,
patches node conditions and posts Events.  It talks plain JSON over aiohttp (kopf's own HTTP
library) to the endpoint kopf logged in to (:class:`Endpoint`, re-read on every request so a
re-login by kopf is picked up).  Errors become :class:`ApiError` with the API's status code,
reason and message; 409 is :class:`Conflict`, 404 :class:`NotFound`.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = [
    "MERGE_PATCH",
    "STRATEGIC_MERGE_PATCH",
    "ApiError",
    "Conflict",
    "Endpoint",
    "KubeApi",
    "NotFound",
]

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, path: str) -> None:
        super().__init__(f"{status} {reason} on {path}: {message}")
        self.status, self.reason, self.message, self.path = status, reason, message, path


class Conflict(ApiError):
    """409: the object changed since it was read (or already exists, on create)."""


class NotFound(ApiError):
    """404: the object or resource does not exist."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    server: str
    headers: Mapping[str, str] = field(default_factory=dict)
    ssl: ssl.SSLContext | bool = True
    """An SSL context, True for the system defaults, False to skip verification."""


class KubeApi:
    """JSON requests to the API server; one aiohttp session for the client's lifetime."""

    def __init__(self, endpoint: Callable[[], Endpoint], timeout_s: float = 30.0) -> None:
        self._endpoint = endpoint
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        ep = self._endpoint()
        headers = {**ep.headers, "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        url = ep.server.rstrip("/") + path
        async with self._session.request(
            method, url, data=data, headers=headers, ssl=ep.ssl
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise _error(resp.status, text, f"{method} {path}")
            result: dict[str, Any] = json.loads(text) if text else {}
            return result

    async def create(self, path: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, obj)

    async def patch(
        self, path: str, patch: Mapping[str, Any], content_type: str = MERGE_PATCH
    ) -> dict[str, Any]:
        return await self.request("PATCH", path, patch, content_type)

    async def delete(self, path: str) -> dict[str, Any]:
        return await self.request("DELETE", path)


def _error(status: int, text: str, where: str) -> ApiError:
    reason, message = "", text[:500]
    try:
        doc = json.loads(text)
        reason, message = str(doc.get("reason", "")), str(doc.get("message", message))
    except (json.JSONDecodeError, AttributeError):
        pass
    cls = Conflict if status == 409 else NotFound if status == 404 else ApiError
    return cls(status, reason, message, where)
