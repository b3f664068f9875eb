"""The partitioner's liveness and readiness rules and the HTTP endpoint serving them.

Model
-----
:class:`ControllerHealth` is told when the controller starts (:meth:`~ControllerHealth.started`),
when its initial listing of Nodes, Pods and NodePartitionings has completed
(:meth:`~ControllerHealth.synced`) and how every decision step ended
(:meth:`~ControllerHealth.step_done`: completed, or raised).  A step that completes with a
planner error in its :class:`~partitioner.decide.Decision` is a completed step: the error is
reported and the batch retried later, and a restart would not fix a bad input.  With ``S`` =
``liveness_stale_seconds`` and ``N`` = ``liveness_failed_steps``, the controller is **not live**
when

* no decision step has completed for longer than ``S`` seconds (since the last one, or since
  start when none has: the initial listing never finished, or the first step hangs), e.g. a
  step stuck in a hung API call or an event loop that no longer runs; or
* the last ``N`` decision steps all raised (one completed step resets the count).

``S = 0`` or ``N = 0`` turns that rule off.  With leader election (:mod:`partitioner.leader`) a
follower's cycle (it checks leadership, keeps its cache, decides nothing) counts as a completed
step, so a healthy follower stays live however long it follows.

It is **ready** once the initial listing has completed (the index holds every object that
existed then; before that a decision would plan pods without their nodes) *and*, where it serves
the admission webhook (:meth:`~ControllerHealth.webhook`, from
:func:`partitioner.webhook.register_webhook`), once that webhook is served: the webhook's Service
sends admission calls only to ready pods, and a call to a replica that does not listen fails, so
``failurePolicy: Ignore`` would admit that slice pod ungated.  The reason then names why it is
not served (no certificate yet and the certificate sync's last error, or the listener's).  This
holds *whether or not it leads*: every replica serves the webhook, and a synced follower is
exactly what a failover needs.  Leadership is reported, not required:
:meth:`~ControllerHealth.leadership` records it (``leader`` true without election) and both
answers carry it.

The clock is injectable (monotonic seconds; tests pass the event loop's fake clock) and the state
is guarded by a lock: the HTTP thread reads what the event loop writes.

:class:`HealthServer` is a stdlib ``ThreadingHTTPServer`` in a daemon thread, so it answers even
while the event loop is blocked (and then reports the loop as stale), like the node agent's:

* ``GET /healthz`` -> ``200`` when live, else ``503`` (the chart's liveness probe);
* ``GET /readyz`` -> ``200`` when ready, else ``503`` (the chart's readiness probe);
* anything else -> ``404``.

Both answer a JSON object: ``ok``, ``reason`` (why not, or ``"ok"``), ``synced``,
``last_step_age_s`` (``null`` before the first completed step), ``failed_steps`` (raised in a
row), ``leader`` (this replica plans and writes) and ``holder`` (the Lease's holder as last read;
``""`` without election or before the first read).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from contract.http_server import ProbeHandler, ThreadedHttpServer

__all__ = ["ControllerHealth", "HealthReport", "HealthServer"]


@dataclass(frozen=True, slots=True)
class HealthReport:
    """One answer of :meth:`ControllerHealth.liveness` or :meth:`ControllerHealth.readiness`."""

    ok: bool
    reason: str
    synced: bool
    last_step_age_s: float | None
    failed_steps: int
    leader: bool = True
    holder: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "reason": self.reason,
            "synced": self.synced,
            "last_step_age_s": self.last_step_age_s,
            "failed_steps": self.failed_steps,
            "leader": self.leader,
            "holder": self.holder,
        }


class ControllerHealth:
    """Liveness and readiness of the partitioner's control loop (module docstring)."""

    def __init__(
        self,
        stale_seconds: float,
        failed_steps: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stale_seconds < 0 or failed_steps < 0:
            raise ValueError(
                f"stale_seconds ({stale_seconds}) and failed_steps ({failed_steps}) must be >= 0"
            )
        self.stale_seconds = stale_seconds
        self.failed_steps = failed_steps
        self._clock = clock
        self._lock = threading.Lock()
        self._since = clock()
        self._last_step: float | None = None
        self._failures = 0
        self._last_error = ""
        self._synced = False
        self._leader = True
        self._holder = ""
        self._webhook: Callable[[], str] | None = None

    def started(self) -> None:
        """The control loop starts now: staleness counts from here until its first step."""
        with self._lock:
            self._since = self._clock()

    def synced(self) -> None:
        """The initial listing of Nodes, Pods and NodePartitionings has completed."""
        with self._lock:
            self._synced = True

    def leadership(self, leader: bool, holder: str) -> None:
        """This replica leads (or not) and the Lease's holder is ``holder``."""
        with self._lock:
            self._leader, self._holder = leader, holder

    def webhook(self, problem: Callable[[], str]) -> None:
        """This replica serves the admission webhook: ready only while ``problem()`` (called from
        the HTTP thread: it must only read) answers ``""``; otherwise it says why not."""
        with self._lock:
            self._webhook = problem

    def step_done(self, error: str | None = None) -> None:
        """A decision step ended: completed (``error`` None) or raised ``error``."""
        now = self._clock()
        with self._lock:
            if error is None:
                self._last_step, self._failures, self._last_error = now, 0, ""
            else:
                self._failures += 1
                self._last_error = error

    def liveness(self) -> HealthReport:
        """Live unless the loop is stale or its last ``failed_steps`` steps raised."""
        now = self._clock()
        with self._lock:
            since = self._since if self._last_step is None else self._last_step
            idle = now - since
            reason = "ok"
            if self.failed_steps and self._failures >= self.failed_steps:
                reason = (
                    f"the last {self._failures} decision steps failed (limit "
                    f"{self.failed_steps}): {self._last_error}"
                )
            elif self.stale_seconds and idle > self.stale_seconds:
                done = self._last_step is not None
                what = "no decision step completed" if done else "no decision step yet"
                reason = f"{what} for {idle:.1f}s (limit {self.stale_seconds:g}s)"
            return self._report(reason == "ok", reason, now)

    def readiness(self) -> HealthReport:
        """Ready once the initial listing has completed and the webhook, if this replica serves
        one, is served; leader or not (module docstring)."""
        now = self._clock()
        with self._lock:
            synced, webhook = self._synced, self._webhook
        problem = webhook() if synced and webhook is not None else ""
        with self._lock:
            if not synced:
                reason = (
                    "the initial listing of nodes, pods and NodePartitionings has not completed"
                )
                return self._report(False, reason, now)
            if problem:
                return self._report(False, problem, now)
            return self._report(True, "ok", now)

    def _report(self, ok: bool, reason: str, now: float) -> HealthReport:
        age = None if self._last_step is None else max(0.0, now - self._last_step)
        return HealthReport(
            ok, reason, self._synced, age, self._failures, self._leader, self._holder
        )


class HealthServer(ThreadedHttpServer):
    """``/healthz`` and ``/readyz`` over HTTP in a daemon thread (module docstring)."""

    def __init__(self, health: ControllerHealth, port: int, host: str = "") -> None:
        self._health = health
        super().__init__(port, host, "gpuslice-partitioner-health")

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        health = self._health

        class Handler(ProbeHandler):
            def do_GET(self) -> None:
                path = self._path()
                if path == "/healthz":
                    report = health.liveness()
                elif path == "/readyz":
                    report = health.readiness()
                else:
                    body = b"not found: /healthz, /readyz\n"
                    self._reply(404, "text/plain; charset=utf-8", body)
                    return
                body = json.dumps(report.as_json()).encode() + b"\n"
                self._reply(200 if report.ok else 503, "application/json", body)

        return Handler
