"""The mutating admission webhook: pods that ask for a slice are created gated.

Model
-----
The API server sends every pod CREATE that passes the chart's MutatingWebhookConfiguration
(namespace and object selectors, :data:`partitioner.gating.MATCH_CONDITIONS`) to
``https://<service>.<namespace>.svc:443`` + :data:`WEBHOOK_PATH`.  kopf serves it: its
``WebhookServer`` routes the path to the handler with id :data:`WEBHOOK_ID`, which answers with
the JSONPatch that sets ``spec.schedulingGates`` to the pod's gates plus
:data:`partitioner.gating.GATE` (:func:`partitioner.gating.admission_patch`), or with no patch.

The handler never raises.  kopf turns any handler exception into ``allowed: false``, and the
API server honours that even under ``failurePolicy: Ignore`` (which only covers a webhook it
cannot call), so an exception would reject the user's pod.  Anything unexpected is logged and
the pod is allowed unchanged: it then takes the ordinary path, like every pod created while the
partitioner is down.

Serving (:class:`GateServer`, a kopf admission server):

* certificates, ``webhook_cert_mode``: ``self-managed`` -- a :class:`~partitioner.webhook_certs.
  CertificateKeeper` gets or creates the Secret, patches the caBundle, writes the files, and
  renews them in the background; ``files`` -- ``tls.crt``/``tls.key``/``ca.crt`` in
  ``webhook_cert_dir`` are kept by someone else (cert-manager; the chart mounts its Secret);
* the listener is kopf's ``WebhookServer`` on all interfaces, port ``webhook_port``; it reloads
  changed certificate files by itself.  Whatever fails while serving (no certificate yet, port
  taken, a half-renewed pair of files) is logged and retried: the webhook never stops the
  partitioner, and while it is not served pods are simply not gated.
* readiness: :meth:`GateServer.problem` says why the webhook is not served ("" while it is);
  :func:`register_webhook` hands it to :meth:`partitioner.health.ControllerHealth.webhook`, so
  the Service sends admission calls only to replicas that listen (leader or not).
* shutdown: kopf closes the listener as soon as it gets SIGTERM, while the endpoints may still
  route calls here for a few seconds; the chart's ``preStop`` sleep (``partitioner.
  shutdownDelaySeconds``) delays the SIGTERM until they have dropped the terminating pod.
* request size: an AdmissionReview carries the whole pod (a pod may be up to etcd's 1.5 MiB,
  the API server takes bodies of 3 MiB), beyond the 1 MiB aiohttp reads by default, which
  answered 413 and let such a pod in ungated without a word; :class:`_Listener` reads up to
  :data:`MAX_REVIEW_BYTES` and logs every review it cannot serve.
* kopf's *managed* webhook configuration stays off: it cannot express the namespace selector or
  the match conditions, so the chart renders the configuration.

Wiring: :func:`register_webhook` (from ``operator.build_registry``) adds the handler and a
startup step that calls :func:`configure_admission` with the server; given the controller's
health and metrics, readiness follows the webhook and restored caBundles are counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp.web
import kopf

from partitioner import gating
from partitioner.certs import service_dns_names
from partitioner.health import ControllerHealth
from partitioner.kubeapi import KubeApi
from partitioner.metrics import Metrics
from partitioner.quantities import QuantityError, pod_requests
from partitioner.settings import PartitionerSettings
from partitioner.webhook_certs import CertificateKeeper

__all__ = [
    "WEBHOOK_ID",
    "WEBHOOK_PATH",
    "GateServer",
    "configure_admission",
    "gate_pod",
    "register_webhook",
]

log = logging.getLogger("gpuslice.partitioner.webhook")

WEBHOOK_ID = "slice-gate"
"""kopf handler id; kopf routes ``POST /<id>`` to it, so it is also the webhook's URL path."""
WEBHOOK_PATH = f"/{WEBHOOK_ID}"
_RETRY_SECONDS = 10.0


def _pod_name(body: Mapping[str, Any]) -> str:
    meta = body.get("metadata") if isinstance(body, Mapping) else None
    if not isinstance(meta, Mapping):
        return "?"
    name = meta.get("name") or f"{meta.get('generateName') or ''}*"
    return f"{meta.get('namespace') or '?'}/{name}"


def _asks_for_nothing(body: Mapping[str, Any], claims: bool) -> bool:
    """Every slice the pod names is requested as zero (:func:`partitioner.quantities.
    pod_requests`, the scheduler's rule) and it names no ResourceClaim gpuslice would plan.

    The ``matchConditions`` (CEL) select pods by resource *names*, so such a pod reaches the
    webhook; gated, it would wait for a partitioner that has nothing to plan for it.  A request
    that cannot be read is not "nothing": the pod is gated and the partitioner reports it.
    """
    spec = body.get("spec") or {}
    if claims and spec.get("resourceClaims"):
        return False
    try:
        requests = pod_requests(body)
    except QuantityError:
        return False
    return not any(requests.get(r, 0) > 0 for r in gating.slice_resources(body))


def gate_pod(body: Mapping[str, Any], patch: kopf.Patch, claims: bool = False) -> None:
    """Add the gate to ``patch`` when ``body`` (the pod being created) should be gated
    (``claims``: DRA nodes are served, pods naming ResourceClaims are gated too).

    Never raises (module docstring): a failure is logged and the pod goes ungated.
    """
    try:
        gates = gating.admission_patch(body, claims)
        if gates is not None and not _asks_for_nothing(body, claims):
            patch.spec["schedulingGates"] = gates
            log.debug("gating pod %s", _pod_name(body))
    except Exception:
        log.exception("cannot decide whether to gate pod %s; admitted ungated", _pod_name(body))


MAX_REVIEW_BYTES = 16 * 1024 * 1024
"""Largest AdmissionReview read: the API server refuses request bodies over 3 MiB, and a
review carries the object (and, on UPDATE, the old one) with its own envelope."""


class _Listener(kopf.WebhookServer):
    """kopf's listener, reading reviews of up to :data:`MAX_REVIEW_BYTES` (aiohttp's default
    cap is 1 MiB) and logging each review it cannot answer (the API server then applies the
    ``failurePolicy``: the pod is created ungated)."""

    @staticmethod
    async def _serve(fn: kopf.WebhookFn, request: aiohttp.web.Request) -> aiohttp.web.Response:
        chunks: list[bytes] = []
        size = 0
        while chunk := await request.content.read(1 << 16):
            size += len(chunk)
            if size > MAX_REVIEW_BYTES:
                log.warning(
                    "admission review of more than %d bytes not read: the pod is created ungated",
                    MAX_REVIEW_BYTES,
                )
                raise aiohttp.web.HTTPRequestEntityTooLarge(
                    max_size=MAX_REVIEW_BYTES, actual_size=size
                )
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            review = json.loads(raw)
        except ValueError as e:
            log.warning("admission review is not JSON (%s): not answered", e)
            raise aiohttp.web.HTTPBadRequest(reason="the AdmissionReview is not JSON") from None
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        try:
            answer = await fn(
                review,
                webhook=request.match_info.get("id"),
                sslpeer=peer,
                headers=dict(request.headers),
            )
        except Exception as e:  # a malformed review kopf refuses: the API server's policy applies
            log.warning("admission review not answered: %s: %s", type(e).__name__, e)
            raise aiohttp.web.HTTPBadRequest(reason=f"{type(e).__name__}: {e}"[:200]) from None
        return aiohttp.web.json_response(answer)


class GateServer:
    """A kopf admission server: certificates first, then kopf's WebhookServer (module docstring).

    ``url`` is set (and ``serving`` set) once the listener runs; tests read them.
    ``last_error`` is why the listener last failed ("" before any failure).
    """

    def __init__(
        self,
        settings: PartitionerSettings,
        keeper: CertificateKeeper | None,
        *,
        retry_seconds: float = _RETRY_SECONDS,
    ) -> None:
        self.settings = settings
        self.keeper = keeper
        self.retry_seconds = retry_seconds
        self.url: str | None = None
        self.serving = asyncio.Event()
        self.last_error = ""

    def problem(self) -> str:
        """Why the webhook is not served now, ``""`` while it is (readiness; read from the
        health thread, so it only reads)."""
        if self.serving.is_set():
            return ""
        keeper = self.keeper
        if keeper is not None and not keeper.ready.is_set():
            why = keeper.last_error or "its first certificate sync has not completed"
            return f"the admission webhook is not served: no certificate yet ({why})"
        why = self.last_error or "its listener is starting"
        return f"the admission webhook is not served: {why}"

    def _server(self) -> kopf.WebhookServer:
        s = self.settings
        directory = Path(s.webhook_cert_dir)
        host = service_dns_names(s.webhook_service_name, s.webhook_namespace)[0]
        if self.keeper is not None:
            certfile = pkeyfile = self.keeper.server_file
            cafile = self.keeper.ca_file
        else:
            certfile, pkeyfile, cafile = (directory / n for n in ("tls.crt", "tls.key", "ca.crt"))
        return _Listener(
            port=s.webhook_port or None,
            host=host if s.webhook_service_name else None,
            certfile=certfile,
            pkeyfile=pkeyfile,
            cafile=cafile if cafile.exists() else None,
        )

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        renewing: asyncio.Task[None] | None = None
        try:
            if self.keeper is not None:
                renewing = asyncio.create_task(self.keeper.run(), name="gpuslice-webhook-certs")
                await self.keeper.ready.wait()
            while True:
                try:
                    async with self._server() as server:
                        async for config in server(fn):
                            self.url = config.get("url")
                            self.serving.set()
                            log.info("admission webhook listening (%s)", self.url)
                            yield config
                except (OSError, ssl.SSLError, ValueError) as e:
                    self.last_error = f"{type(e).__name__}: {e}"
                    log.error("admission webhook not served: %s (retrying)", e)
                self.serving.clear()
                await asyncio.sleep(self.retry_seconds)
        finally:
            if renewing is not None:
                renewing.cancel()
                await asyncio.gather(renewing, return_exceptions=True)


def configure_admission(kopf_settings: kopf.OperatorSettings, server: GateServer) -> None:
    """Serve admission with ``server``; kopf's managed webhook configuration stays off."""
    kopf_settings.admission.server = server
    kopf_settings.admission.managed = None


def register_webhook(
    registry: kopf.OperatorRegistry,
    settings: PartitionerSettings,
    api: KubeApi,
    health: ControllerHealth | None = None,
    metrics: Metrics | None = None,
) -> GateServer:
    """Add the gating handler and the admission server's configuration to ``registry``;
    ``health`` is then ready only while the webhook is served, ``metrics`` counts caBundles
    restored."""
    keeper = None
    if settings.webhook_cert_mode == "self-managed":
        keeper = CertificateKeeper(api, settings)
        if metrics is not None:
            keeper.restored = metrics.webhook_ca_bundle_restored.inc
    server = GateServer(settings, keeper)
    if health is not None:
        health.webhook(server.problem)

    @kopf.on.mutate(
        "v1",
        "pods",
        id=WEBHOOK_ID,
        operations=["CREATE"],
        ignore_failures=True,
        registry=registry,
    )
    def _gate(body: kopf.Body, patch: kopf.Patch, **kwargs: Any) -> None:
        # kopf's ``operations`` above only shapes a managed configuration (off here); it does
        # not filter what is served.  Gates can only be added at creation.
        if kwargs.get("operation") == "CREATE":
            gate_pod(body, patch, settings.dra_enabled)

    @kopf.on.startup(id="admission-server", registry=registry)
    def _configure_admission(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_admission(settings, server)

    return server
