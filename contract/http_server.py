"""A small HTTP server in a daemon thread, for the probe and metrics endpoints of both
components (the partitioner's ``/healthz``/``/readyz``, the agent's ``/healthz``/``/metrics``).

Subclasses give :meth:`_handler_class` (a :class:`ProbeHandler`, which adds the reply helper
and keeps probes out of the log); the server binds in the constructor (port 0: any free port,
read back from :attr:`port`), serves from :meth:`start` until :meth:`stop`.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["ProbeHandler", "ThreadedHttpServer"]


class ProbeHandler(BaseHTTPRequestHandler):
    """A request handler for probe and metrics endpoints: :meth:`_reply` sends one whole
    response; no access log (the kubelet and Prometheus call every few seconds)."""

    def _path(self) -> str:
        """The request path without its query string."""
        return self.path.split("?", 1)[0]

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class ThreadedHttpServer:
    def __init__(self, port: int, host: str, thread_name: str) -> None:
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None
        self._thread_name = thread_name

    @property
    def port(self) -> int:
        """The bound port (useful when constructed with port 0)."""
        return int(self._server.server_address[1])

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__}.start() called twice")
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=self._thread_name, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError
