"""The partitioner's client (partitioner/kubeapi.py) against the fake API server.

Lists are paginated and survive an expired continue token; refusals keep their types and a
server that cannot be reached is an :class:`~partitioner.kubeapi.Unreachable`, not a transport
library's exception; the Endpoint's TLS context is the one used; retries back off exponentially
with jitter up to a cap and log one line per outage (sleep and jitter injected: no waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp.web
import hypothesis.strategies as st
import pytest
from fake_apiserver import ApiServer, declare
from hypothesis import given

from partitioner.certs import issue
from partitioner.kubeapi import (
    Backoff,
    Conflict,
    Endpoint,
    Expired,
    KubeApi,
    NotFound,
    OutageLog,
    Unreachable,
    retry_with_backoff,
)

NODES = "/api/v1/nodes"
PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


@pytest.fixture
def api(kmock: ApiServer) -> ApiServer:
    declare(kmock)
    return kmock


@pytest.fixture
async def client(api: ApiServer) -> AsyncIterator[KubeApi]:
    endpoint = Endpoint(str(api.url).rstrip("/"), {"Authorization": "Bearer partitioner"})
    kube = KubeApi(lambda: endpoint)
    yield kube
    await kube.close()


def node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


async def nodes(client: KubeApi, count: int) -> list[str]:
    names = [f"n{i:02d}" for i in range(count)]
    for name in names:
        await client.create(NODES, node(name))
    return names


def names(doc: dict[str, Any]) -> list[str]:
    return [item["metadata"]["name"] for item in doc["items"]]


# ------------------------------------------------------------------------------ lists


async def test_a_list_longer_than_a_page_returns_every_object_once(
    api: ApiServer, client: KubeApi
) -> None:
    created = await nodes(client, 7)
    doc = await client.list_all(NODES, page_size=3)
    assert names(doc) == created
    calls = [c for c in api.lists if c.path == NODES]
    assert [(c.limit, c.continued, c.items) for c in calls] == [
        (3, False, 3),
        (3, True, 3),
        (3, True, 1),
    ]
    assert doc["metadata"]["resourceVersion"]  # the snapshot's version, for a watch to start at
    assert "continue" not in doc["metadata"]


async def test_the_default_page_is_500_objects(api: ApiServer, client: KubeApi) -> None:
    await nodes(client, 2)
    doc = await client.list_all(NODES)
    assert len(doc["items"]) == 2
    assert [c.limit for c in api.lists] == [500]


async def test_an_expired_continue_token_restarts_the_list(api: ApiServer, client: KubeApi) -> None:
    created = await nodes(client, 5)
    api.expire_continues = 1  # the second page's request is refused with 410 Expired
    doc = await client.list_all(NODES, page_size=2)
    assert names(doc) == created  # every object once: the first page is not kept twice
    assert [(c.continued, c.status) for c in api.lists] == [
        (False, 200),
        (True, 410),
        (False, 200),  # restarted from the first page
        (True, 200),
        (True, 200),
    ]


async def test_a_list_whose_tokens_keep_expiring_gives_up(api: ApiServer, client: KubeApi) -> None:
    await nodes(client, 5)
    api.expire_continues = 100
    with pytest.raises(Expired) as e:
        await client.list_all(NODES, page_size=2, restarts=2)
    assert e.value.status == 410 and e.value.reason == "Expired"
    assert sum(1 for c in api.lists if not c.continued) == 3  # the first try and 2 restarts


async def test_a_bad_page_size_is_refused_naming_it(client: KubeApi) -> None:
    with pytest.raises(ValueError, match="page size must be >= 1, got 0"):
        await client.list_all(NODES, page_size=0)


# ------------------------------------------------------------------------------ errors


async def test_refusals_keep_their_status_and_type(api: ApiServer, client: KubeApi) -> None:
    await nodes(client, 1)
    with pytest.raises(NotFound) as missing:
        await client.request("GET", f"{NODES}/absent")
    assert missing.value.status == 404
    with pytest.raises(Conflict) as taken:
        await client.create(NODES, node("n00"))
    assert taken.value.status == 409
    got = await client.patch(f"{NODES}/n00", {"metadata": {"labels": {"a": "b"}}})
    assert got["metadata"]["labels"] == {"a": "b"}
    assert api.writes[-1].author == "partitioner"  # the Endpoint's headers were sent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_a_server_that_cannot_be_reached_is_unreachable() -> None:
    kube = KubeApi(lambda: Endpoint(f"http://127.0.0.1:{_free_port()}"))
    try:
        with pytest.raises(Unreachable) as e:
            await kube.request("GET", NODES)
    finally:
        await kube.close()
    assert e.value.status == 0
    assert f"GET {NODES}" in str(e.value) and "unreachable" in str(e.value)


@contextlib.asynccontextmanager
async def https_server(tmp_path: Path) -> AsyncIterator[tuple[str, bytes]]:
    """An HTTPS server answering ``GET /api/v1/nodes`` with a certificate for ``localhost``
    from a fresh CA; yields its URL and the CA bundle."""
    material = issue(["localhost"], datetime.datetime.now(datetime.UTC))
    pem = tmp_path / "server.pem"
    pem.write_bytes(material.server_pem())
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pem)

    async def answer(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        return aiohttp.web.json_response({"kind": "NodeList", "items": [node("tls")]})

    app = aiohttp.web.Application()
    app.router.add_get(NODES, answer)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"https://localhost:{port}", material.ca_bundle
    finally:
        await runner.cleanup()


async def test_the_endpoints_tls_context_is_the_one_used(tmp_path: Path) -> None:
    async with https_server(tmp_path) as (url, ca):
        trusting = ssl.create_default_context(cadata=ca.decode("ascii"))
        kube = KubeApi(lambda: Endpoint(url, ssl=trusting))
        system = KubeApi(lambda: Endpoint(url))  # the system CAs do not know the test CA
        try:
            doc = await kube.list_all(NODES)
            with pytest.raises(Unreachable, match="certificate"):
                await system.request("GET", NODES)
        finally:
            await kube.close()
            await system.close()
    assert names(doc) == ["tls"]


async def test_a_new_login_gets_a_new_connection_and_the_old_one_is_closed(
    api: ApiServer,
) -> None:
    server = str(api.url).rstrip("/")
    logins = [Endpoint(server, {"Authorization": "Bearer one"}, ssl=ssl.create_default_context())]
    kube = KubeApi(lambda: logins[-1])
    await kube.create(NODES, node("a"))
    first = kube._client
    logins.append(Endpoint(server, {"Authorization": "Bearer two"}, ssl=False))
    await kube.create(NODES, node("b"))
    # nothing was in flight on the first login's client: closed at once, not kept for good
    assert kube._client is not first and kube._retired == []
    assert first is not None and first.rest_client.pool_manager.closed
    assert [w.author for w in api.writes] == ["one", "two"]
    second = kube._client
    await kube.close()
    assert second is not None and second.rest_client.pool_manager.closed
    assert kube._client is None and kube._retired == []


async def test_a_client_retired_mid_request_is_closed_when_its_request_ends(
    api: ApiServer,
) -> None:
    """A re-login while a request is in flight on the old client: that request completes on
    it, then the old client is closed (each re-login after a 401 left one open before)."""
    server = str(api.url).rstrip("/")
    logins = [Endpoint(server, {"Authorization": "Bearer one"}, ssl=ssl.create_default_context())]
    kube = KubeApi(lambda: logins[-1])
    await kube.create(NODES, node("a"))
    first = kube._client
    assert first is not None
    started, go = asyncio.Event(), asyncio.Event()
    real_call = first.call_api

    async def slow_call(*args: Any, **kwargs: Any) -> Any:
        started.set()
        await go.wait()
        return await real_call(*args, **kwargs)

    first.call_api = slow_call  # type: ignore[method-assign]
    slow = asyncio.create_task(kube.create(NODES, node("b")))
    await started.wait()
    logins.append(Endpoint(server, {"Authorization": "Bearer two"}, ssl=False))
    await kube.create(NODES, node("c"))  # the new login: a new client, the old one retired
    assert kube._retired == [first] and not first.rest_client.pool_manager.closed
    go.set()
    await slow
    assert kube._retired == [] and first.rest_client.pool_manager.closed
    assert sorted(w.author for w in api.writes) == ["one", "one", "two"]
    await kube.close()


# ------------------------------------------------------------------------------ retries


class Failing:
    """An attempt that fails ``failures`` times (unreachable), then returns ``"ok"``."""

    def __init__(self, failures: int) -> None:
        self.left, self.calls = failures, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.left:
            self.left -= 1
            raise Unreachable("GET /api/v1/nodes", ConnectionRefusedError("connection refused"))
        return "ok"


class Sleeps:
    """A sleep that records what it was asked to wait, and waits not at all."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


async def test_backoff_delays_grow_and_are_capped() -> None:
    sleeps, attempt = Sleeps(), Failing(9)
    got = await retry_with_backoff(
        attempt, "listing", backoff=Backoff(1.0, 30.0), sleep=sleeps, rand=lambda: 0.0
    )
    assert got == "ok" and attempt.calls == 10
    assert sleeps.delays == [1, 2, 4, 8, 16, 30, 30, 30, 30]


async def test_backoff_jitter_spreads_each_delay_below_its_step() -> None:
    sleeps = Sleeps()
    draws = iter([0.5, 0.99, 0.0, 0.5, 0.99, 0.25, 0.75])
    await retry_with_backoff(
        Failing(7), "listing", backoff=Backoff(1.0, 30.0), sleep=sleeps, rand=lambda: next(draws)
    )
    assert sleeps.delays == pytest.approx([0.75, 1.01, 4.0, 6.0, 8.08, 26.25, 18.75])


@given(st.lists(st.floats(0, 1, exclude_max=True), min_size=12, max_size=12))
def test_jittered_delays_never_shrink_before_the_cap_and_never_pass_it(draws: list[float]) -> None:
    policy = Backoff(initial_s=0.5, cap_s=30.0)
    delays = [policy.delay(n, u) for n, u in enumerate(draws, start=1)]
    assert all(0 < d <= 30.0 for d in delays)
    below_cap = [d for n, d in enumerate(delays, start=1) if 0.5 * 2 ** (n - 1) < 30.0]
    assert below_cap == sorted(below_cap)
    assert all(d >= 15.0 for d in delays[len(below_cap) :])


def test_backoff_refuses_settings_that_cannot_work() -> None:
    with pytest.raises(ValueError, match=r"0 < initial \(0s\) <= cap \(30s\)"):
        Backoff(initial_s=0)
    with pytest.raises(ValueError, match=r"jitter must be in \[0, 1\), got 1"):
        Backoff(jitter=1.0)
    with pytest.raises(ValueError, match="follows a failure; got failures=0"):
        Backoff().delay(0, 0.0)


async def test_an_outage_logs_one_warning_and_one_recovery_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("gpuslice.test.outage")
    caplog.set_level(logging.DEBUG, logger=logger.name)
    await retry_with_backoff(Failing(6), "the listing", sleep=Sleeps(), logger=logger)
    by_level = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == logger.name]
    warnings = [m for lvl, m in by_level if lvl == logging.WARNING]
    infos = [m for lvl, m in by_level if lvl == logging.INFO]
    debugs = [m for lvl, m in by_level if lvl == logging.DEBUG]
    assert len(warnings) == 1 and "the listing failed" in warnings[0]
    assert "connection refused" in warnings[0]
    assert infos == ["the listing succeeded after 6 failed attempt(s)"]
    assert len(debugs) == 5  # the other failures
    assert not any(r.exc_info for r in caplog.records)  # no traceback per attempt


def test_a_second_outage_is_reported_again() -> None:
    lines: list[tuple[int, str]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("gpuslice.test.outage2")
    logger.addHandler(Collect())
    logger.setLevel(logging.INFO)
    logger.propagate = False
    outage = OutageLog("renewal", logger)
    for _ in range(2):
        outage.failed(TimeoutError(), 1.0)
        outage.failed(TimeoutError(), 2.0)
        outage.succeeded()
    outage.succeeded()  # nothing was failing: no line
    assert [lvl for lvl, _ in lines] == [logging.WARNING, logging.INFO] * 2
    assert "TimeoutError" in lines[0][1]


async def test_cancellation_is_not_retried() -> None:
    sleeps = Sleeps()

    async def cancelled() -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await retry_with_backoff(cancelled, "x", sleep=sleeps)
    assert sleeps.delays == []
