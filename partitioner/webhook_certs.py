"""The self-managed webhook certificate: kept in a Secret, written to files, trusted by the API
server through the MutatingWebhookConfiguration's ``caBundle``.

Model
-----
:meth:`CertificateKeeper.sync` makes the three places agree, in this order:

1. **The Secret** ``webhook_secret_name`` (type ``kubernetes.io/tls``; keys ``ca.crt``,
   ``ca.key``, ``tls.crt``, ``tls.key``) in the partitioner's namespace is the one source.
   Absent -> created with fresh material (:func:`partitioner.certs.issue`); a 409 means another
   replica created it first, so it is re-read and used.  Due for renewal
   (:func:`partitioner.certs.renewal_reason`) -> replaced by a merge patch carrying the
   resourceVersion it was read at; a 409 means another replica renewed it: re-read.  So two
   replicas always end up serving the same material.  The Secret is owned by the
   MutatingWebhookConfiguration (an ownerReference, no blockOwnerDeletion), so uninstalling the
   chart garbage-collects it.
2. **The caBundle** of every webhook in the MutatingWebhookConfiguration
   ``webhook_configuration_name`` is set to the Secret's ``ca.crt`` (a merge patch of the
   ``webhooks`` list as read, with its resourceVersion; a 409 is re-read and retried).  This
   comes before the files: during a CA rollover the bundle already trusts the new CA when the
   server starts presenting a certificate it signed.  A missing configuration is logged and
   retried at the next check (pods are not gated meanwhile: failurePolicy Ignore).
3. **The files** in ``webhook_cert_dir``: ``tls.pem`` (private key + certificate, one atomic
   write, mode 0600) and ``ca.crt``; kopf's WebhookServer re-reads them every 60 s and restarts
   its listener when they change.

:meth:`CertificateKeeper.run` repeats :meth:`~CertificateKeeper.sync` every
``webhook_cert_check_seconds``, and sooner (with backoff and jitter up to that period, one
WARNING per outage) after a failure.
Times for renewal come from the wall clock (certificates are about real time, not loop time).
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import logging
import os
import random
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from partitioner.certs import (
    CertificateError,
    Material,
    renewal_reason,
    renewed,
    service_dns_names,
)
from partitioner.kubeapi import Backoff, Conflict, KubeApi, NotFound, OutageLog
from partitioner.settings import PartitionerSettings

__all__ = ["CA_FILE", "MWC_PATH", "SERVER_FILE", "CertificateKeeper", "write_atomically"]

log = logging.getLogger("gpuslice.partitioner.webhook")

MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
SERVER_FILE = "tls.pem"
"""Private key and serving certificate, one PEM file (self-managed mode)."""
CA_FILE = "ca.crt"
_ATTEMPTS = 4  # reads after a conflict before giving up until the next check


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> bool:
    """Write ``data`` to ``path`` through a rename (readers see the old or the new file, never
    half of one); ``False`` when the file already holds exactly that."""
    try:
        if path.read_bytes() == data:
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


class CertificateKeeper:
    """Keeps the Secret, the caBundle and the certificate files in step (module docstring)."""

    def __init__(
        self,
        api: KubeApi,
        settings: PartitionerSettings,
        *,
        clock: Callable[[], datetime.datetime] = _utcnow,
    ) -> None:
        ns = settings.webhook_namespace
        self.api = api
        self.names = service_dns_names(settings.webhook_service_name, ns)
        self.secret_name = settings.webhook_secret_name
        self.secrets_path = f"/api/v1/namespaces/{ns}/secrets"
        self.configuration_path = f"{MWC_PATH}/{settings.webhook_configuration_name}"
        self.directory = Path(settings.webhook_cert_dir)
        self.check_seconds = settings.webhook_cert_check_seconds
        self.clock = clock
        self.material: Material | None = None
        self.ready = asyncio.Event()
        """Set once the files hold usable material."""

    @property
    def server_file(self) -> Path:
        return self.directory / SERVER_FILE

    @property
    def ca_file(self) -> Path:
        return self.directory / CA_FILE

    # -- the Secret ----------------------------------------------------------------------
    async def _read_secret(self) -> dict[str, Any] | None:
        try:
            return await self.api.request("GET", f"{self.secrets_path}/{self.secret_name}")
        except NotFound:
            return None

    def _material_of(self, secret: Mapping[str, Any] | None) -> Material | None:
        if secret is None:
            return None
        try:
            return Material.from_secret_data(secret.get("data") or {})
        except CertificateError as e:
            log.warning("Secret %s: %s; issuing a new certificate", self.secret_name, e)
            return None

    async def _owner(self) -> list[dict[str, Any]]:
        try:
            mwc = await self.api.request("GET", self.configuration_path)
        except NotFound:
            return []
        meta = mwc.get("metadata") or {}
        return [
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration",
                "name": meta.get("name", ""),
                "uid": meta.get("uid", ""),
            }
        ]

    async def _secret_material(self) -> Material:
        """The Secret's material, created or renewed first when needed."""
        for _ in range(_ATTEMPTS):
            secret = await self._read_secret()
            material = self._material_of(secret)
            reason = renewal_reason(material, self.names, self.clock())
            if not reason:
                assert material is not None
                return material
            fresh = renewed(material, self.names, self.clock())
            try:
                if secret is None:
                    log.info("creating the webhook certificate Secret %s", self.secret_name)
                    await self.api.create(self.secrets_path, await self._secret_body(fresh))
                else:
                    log.info("renewing the webhook certificate in %s: %s", self.secret_name, reason)
                    rv = (secret.get("metadata") or {}).get("resourceVersion")
                    await self.api.patch(
                        f"{self.secrets_path}/{self.secret_name}",
                        {"metadata": {"resourceVersion": rv}, "data": fresh.secret_data()},
                    )
            except Conflict:
                log.info("Secret %s was written by another replica; re-reading", self.secret_name)
                continue
            return fresh
        raise RuntimeError(
            f"Secret {self.secret_name} kept changing while being written ({_ATTEMPTS} tries)"
        )

    async def _secret_body(self, material: Material) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": self.secret_name,
            "labels": {
                "app.kubernetes.io/part-of": "gpuslice",
                "app.kubernetes.io/component": "webhook",
            },
        }
        owners = await self._owner()
        if owners:
            meta["ownerReferences"] = owners
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": meta,
            "data": material.secret_data(),
        }

    # -- the caBundle --------------------------------------------------------------------
    async def _patch_ca_bundle(self, bundle: bytes) -> None:
        encoded = base64.b64encode(bundle).decode("ascii")
        for _ in range(_ATTEMPTS):
            try:
                mwc = await self.api.request("GET", self.configuration_path)
            except NotFound:
                log.warning(
                    "MutatingWebhookConfiguration %s not found: its caBundle is set once it "
                    "exists (pods are not gated meanwhile)",
                    self.configuration_path.rsplit("/", 1)[-1],
                )
                return
            webhooks = [dict(w) for w in mwc.get("webhooks") or ()]
            if all((w.get("clientConfig") or {}).get("caBundle") == encoded for w in webhooks):
                return
            for w in webhooks:
                w["clientConfig"] = {**(w.get("clientConfig") or {}), "caBundle": encoded}
            rv = (mwc.get("metadata") or {}).get("resourceVersion")
            try:
                await self.api.patch(
                    self.configuration_path,
                    {"metadata": {"resourceVersion": rv}, "webhooks": webhooks},
                )
            except Conflict:
                continue
            log.info("caBundle of %s set", self.configuration_path.rsplit("/", 1)[-1])
            return
        raise RuntimeError(f"{self.configuration_path} kept changing while its caBundle was set")

    # -- the whole step ------------------------------------------------------------------
    async def sync(self) -> Material:
        """Secret, then caBundle, then files (see the module docstring)."""
        material = await self._secret_material()
        await self._patch_ca_bundle(material.ca_bundle)
        write_atomically(self.ca_file, material.ca_bundle)
        if write_atomically(self.server_file, material.server_pem(), mode=0o600):
            log.info(
                "webhook serving certificate for %s written (until %s)",
                ", ".join(self.names),
                f"{material.not_after():%Y-%m-%d}",
            )
        self.material = material
        self.ready.set()
        return material

    async def run(self) -> None:
        """:meth:`sync` now and every ``check_seconds``; after a failure retry sooner.

        Retries back off exponentially with jitter (1 s doubling up to ``check_seconds``); an
        outage is one WARNING when it starts and one INFO when a sync succeeds again
        (:class:`~partitioner.kubeapi.OutageLog`), not a line per attempt.
        """
        backoff = Backoff(initial_s=min(1.0, self.check_seconds), cap_s=self.check_seconds)
        outage = OutageLog("webhook certificate sync", log)
        while True:
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                delay = backoff.delay(outage.failures + 1, random.random())
                outage.failed(e, delay)
                await asyncio.sleep(delay)
                continue
            outage.succeeded()
            await asyncio.sleep(self.check_seconds)
