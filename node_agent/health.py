"""The agent's liveness and readiness rules and the HTTP endpoint serving ``/healthz``,
``/readyz`` and ``/metrics``.

Model
-----
:class:`AgentHealth` is told the outcome of every reconcile pass (:meth:`AgentHealth.record`:
ok, or failed with a reason; the device-plugin agent fails a pass when it raises or cannot read
NVML at all, not for errors about one GPU or PodResources, which a restart does not fix:
:mod:`node_agent.agent`; the DRA driver when a publish round fails).  With ``R`` =
``resync_seconds`` and ``N`` = ``failure_resyncs``, the agent is **unhealthy** when

* passes have been failing without interruption for longer than ``N * R`` seconds (one ok pass
  resets this), or
* no pass at all has finished for longer than ``N * R`` seconds (since the last one, or since
  start): the loop is stuck, e.g. in a hung driver call.

Otherwise it is healthy; a restart cannot fix a Degraded spec, so Degraded is not unhealthy.
The clock is injectable (monotonic seconds) and the state is guarded by a lock: the HTTP thread
reads what the event loop writes.

Readiness is liveness plus the problems a restart cannot fix but that keep the agent from
serving (:meth:`AgentHealth.not_ready`: the DRA driver's kubelet that has not registered the
plugin yet, or never will -- a wrong registry directory): the agent is *ready* when it is
healthy and no such problem is set.  Such a problem never fails liveness: a restart would only
start the wait again, a crash loop for a configuration error.

:class:`MonitoringServer` is a stdlib ``ThreadingHTTPServer`` in a daemon thread, so it answers
even while the event loop is blocked (and then reports the loop as stuck):

* ``GET /healthz`` -> ``200 ok`` or ``503 unhealthy: <reason>`` (liveness);
* ``GET /readyz`` -> ``200 ok``, or ``503 unhealthy: <reason>`` while ``/healthz`` fails, else
  ``503 not ready: <reason>`` while a problem is set (readiness);
* ``GET /metrics`` -> the Prometheus text format of the given registry;
* anything else -> ``404``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from contract.http_server import ProbeHandler, ThreadedHttpServer

__all__ = ["AgentHealth", "MonitoringServer"]


class AgentHealth:
    """Liveness of the reconcile loop (see the module docstring)."""

    def __init__(
        self,
        resync_seconds: float,
        failure_resyncs: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if resync_seconds <= 0 or failure_resyncs < 1:
            raise ValueError(
                f"resync_seconds ({resync_seconds}) must be > 0 and failure_resyncs "
                f"({failure_resyncs}) >= 1"
            )
        self.limit_s = resync_seconds * failure_resyncs
        self._clock = clock
        self._lock = threading.Lock()
        self._last_pass = clock()
        self._failing_since: float | None = None
        self._last_error = ""
        self._not_ready: str | None = None

    def record(self, ok: bool, error: str = "") -> None:
        """One pass finished: ``ok``, or failed with ``error``."""
        now = self._clock()
        with self._lock:
            self._last_pass = now
            if ok:
                self._failing_since = None
                self._last_error = ""
            else:
                if self._failing_since is None:
                    self._failing_since = now
                self._last_error = error

    def not_ready(self, reason: str | None) -> None:
        """Set (``reason``) or clear (``None``) the problem that keeps the agent from being
        ready without failing liveness (module docstring)."""
        with self._lock:
            self._not_ready = reason

    def ready(self) -> tuple[bool, str]:
        """``(ready, reason)``: :meth:`check`'s answer while unhealthy (``"unhealthy: ..."``),
        else ``"not ready: <problem>"`` while one is set, else ``(True, "ok")``."""
        ok, reason = self.check()
        if not ok:
            return False, f"unhealthy: {reason}"
        with self._lock:
            problem = self._not_ready
        if problem is not None:
            return False, f"not ready: {problem}"
        return True, "ok"

    def check(self) -> tuple[bool, str]:
        """``(healthy, reason)``; the reason is ``"ok"`` when healthy."""
        now = self._clock()
        with self._lock:
            if self._failing_since is not None and now - self._failing_since > self.limit_s:
                return False, (
                    f"reconcile failing for {now - self._failing_since:.0f}s "
                    f"(limit {self.limit_s:.0f}s): {self._last_error}"
                )
            idle = now - self._last_pass
            if idle > self.limit_s:
                return False, (
                    f"no reconcile pass finished for {idle:.0f}s (limit {self.limit_s:.0f}s)"
                )
        return True, "ok"


class MonitoringServer(ThreadedHttpServer):
    """``/healthz``, ``/readyz`` and ``/metrics`` over HTTP in a daemon thread (see the module
    docstring)."""

    def __init__(
        self,
        health: AgentHealth,
        registry: CollectorRegistry,
        port: int,
        host: str = "",
    ) -> None:
        self._health = health
        self._registry = registry
        super().__init__(port, host, "gpuslice-agent-http")

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        health, registry = self._health, self._registry

        class Handler(ProbeHandler):
            def do_GET(self) -> None:
                path = self._path()
                if path == "/healthz":
                    ok, reason = health.check()
                    body = (reason if ok else f"unhealthy: {reason}").encode() + b"\n"
                    self._reply(200 if ok else 503, "text/plain; charset=utf-8", body)
                elif path == "/readyz":
                    ok, reason = health.ready()
                    body = reason.encode() + b"\n"
                    self._reply(200 if ok else 503, "text/plain; charset=utf-8", body)
                elif path == "/metrics":
                    self._reply(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                else:
                    self._reply(
                        404,
                        "text/plain; charset=utf-8",
                        b"not found: /healthz, /readyz, /metrics\n",
                    )

        return Handler
