"""The self-managed webhook certificate: kept in a Secret, written to files, trusted by the API
server through the MutatingWebhookConfiguration's ``caBundle``.

Model
-----
:meth:`CertificateKeeper.sync` makes the three places agree, in this order:

1. **The Secret** ``webhook_secret_name`` (type ``kubernetes.io/tls``; keys ``ca.crt``,
   ``ca.key``, ``tls.crt``, ``tls.key``) in the partitioner's namespace is the one source.
   Absent -> created with fresh material (:func:`partitioner.certs.issue`); a 409 means another
   replica created it first, so it is re-read and used.  Lost (deleted by hand, or
   garbage-collected with a configuration deleted and created again) or unreadable while this
   replica holds sound material (:attr:`CertificateKeeper.material`) -> written back from that
   material, with a WARNING: every replica serves a certificate of that CA, and a new CA in the
   caBundle alone would leave the others untrusted until their next sync.  Not while the
   configuration is missing too, though: that is an uninstall (the pre-delete hook deleted the
   configuration, the garbage collector its Secret, and this replica has not stopped yet), and a
   Secret written back then would have no owner and outlive the release with the CA key in it.
   The replica keeps serving what it holds (the API server calls no webhook without a
   configuration) and writes the Secret, owned, once the configuration exists again.  A Secret is
   created without an owner only by a replica that holds nothing yet (its first sync: the
   partitioner may start before the configuration exists); the uninstall hook deletes the Secret
   by name after the partitioner stopped (``gpuslice ungate --delete-secret``).  Whenever a new CA
   *is* issued (nothing sound anywhere, or a rollover), the CAs of this replica's material and of
   the configuration's current caBundle that are still valid stay in the new bundle
   (:func:`partitioner.certs.with_cas`).  Due for renewal
   (:func:`partitioner.certs.renewal_reason`) -> replaced by a merge patch carrying the
   resourceVersion it was read at; a 409 means another replica renewed it: re-read.  So two
   replicas always end up serving the same material.  The Secret is owned by the
   MutatingWebhookConfiguration (an ownerReference, no blockOwnerDeletion), so uninstalling the
   chart garbage-collects it.  Every sync checks that: a Secret created while the configuration
   did not exist yet (the partitioner started first: helm creates the Deployment before it,
   GitOps waves) or one owned by an earlier configuration of that name (another uid) gets the
   owner reference as soon as the configuration exists (a merge patch of
   ``metadata.ownerReferences`` with the resourceVersion read, other owners kept).
2. **The caBundle** of every webhook in the MutatingWebhookConfiguration
   ``webhook_configuration_name`` is set to the Secret's ``ca.crt`` (a merge patch of the
   ``webhooks`` list as read, with its resourceVersion; a 409 is re-read and retried).  This
   comes before the files: during a CA rollover the bundle already trusts the new CA when the
   server starts presenting a certificate it signed.  A missing configuration (pods are not
   gated meanwhile: failurePolicy Ignore) is logged once and the sync retried soon, with
   backoff (:data:`MISSING_CONFIGURATION_RETRY`: 1 s doubling up to 30 s), not after a whole
   check period: its caBundle and the Secret's owner are set within seconds of its creation.
3. **The files** in ``webhook_cert_dir``: ``tls.pem`` (private key + certificate, one atomic
   write, mode 0600) and ``ca.crt``; kopf's WebhookServer re-reads them every 60 s and restarts
   its listener when they change.

:meth:`CertificateKeeper.run` repeats :meth:`~CertificateKeeper.sync` every
``webhook_cert_check_seconds``, and sooner (with backoff and jitter up to that period, one
WARNING per outage) after a failure or while the configuration is missing.  Between syncs, every
``webhook_ca_bundle_check_seconds`` (20 s), it GETs the configuration alone
(:meth:`~CertificateKeeper.check_configuration`): a configuration replaced or re-created without
the caBundle (``helm upgrade --force``, ``kubectl replace``, a GitOps re-create), or with one
that does not trust this replica's certificate, would make every admission call fail TLS, and
``failurePolicy: Ignore`` would then admit every slice pod ungated, silently.  Such a
configuration gets a sync at once (caBundle, and the Secret's owner for a new uid), a WARNING
that says so, and a count (the ``restored`` callback: ``gpuslice_webhook_ca_bundle_restored_total``).
:attr:`~CertificateKeeper.last_error` holds the error of the last failed attempt (readiness names
it while no certificate was ever written).
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
    trusts,
    with_cas,
)
from partitioner.kubeapi import Backoff, Conflict, KubeApi, NotFound, OutageLog
from partitioner.settings import PartitionerSettings

__all__ = [
    "CA_FILE",
    "MISSING_CONFIGURATION_RETRY",
    "MWC_PATH",
    "SERVER_FILE",
    "CertificateKeeper",
    "write_atomically",
]

log = logging.getLogger("gpuslice.partitioner.webhook")

MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
SERVER_FILE = "tls.pem"
"""Private key and serving certificate, one PEM file (self-managed mode)."""
CA_FILE = "ca.crt"
_ATTEMPTS = 4  # reads after a conflict before giving up until the next check
_MWC_KIND = "MutatingWebhookConfiguration"
MISSING_CONFIGURATION_RETRY = Backoff(initial_s=1.0, cap_s=30.0)
"""Waits between syncs while the MutatingWebhookConfiguration is missing (never longer than
``webhook_cert_check_seconds``): it usually appears moments after the partitioner starts."""


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
        restored: Callable[[], None] = lambda: None,
    ) -> None:
        ns = settings.webhook_namespace
        self.api = api
        self.names = service_dns_names(settings.webhook_service_name, ns)
        self.secret_name = settings.webhook_secret_name
        self.secrets_path = f"/api/v1/namespaces/{ns}/secrets"
        self.configuration_path = f"{MWC_PATH}/{settings.webhook_configuration_name}"
        self.directory = Path(settings.webhook_cert_dir)
        self.check_seconds = settings.webhook_cert_check_seconds
        self.bundle_check_seconds = min(
            settings.webhook_ca_bundle_check_seconds, self.check_seconds
        )
        self.clock = clock
        self.restored = restored
        """Called each time :meth:`check_configuration` found the caBundle wrong and restored it."""
        self.material: Material | None = None
        self.ready = asyncio.Event()
        """Set once the files hold usable material."""
        self.configuration_missing = 0
        """Syncs in a row that found no MutatingWebhookConfiguration (0: the last one did)."""
        self.configuration_uid = ""
        """The configuration's uid at the last sync ("" while it was missing)."""
        self.last_error = ""
        """The last failed attempt's error ("" once one succeeded since)."""
        self.secret_withheld = False
        """The Secret and the configuration were both missing at the last sync, so the Secret
        was not written back (module docstring); logged once per such absence."""

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
            log.warning("Secret %s: %s; writing it again", self.secret_name, e)
            return None

    async def _configuration(self) -> dict[str, Any] | None:
        """The MutatingWebhookConfiguration; ``None`` while it is missing."""
        try:
            return await self.api.request("GET", self.configuration_path)
        except NotFound:
            return None

    @staticmethod
    def _bundles_of(mwc: Mapping[str, Any] | None) -> list[bytes | None]:
        """Each webhook's caBundle, decoded (``None``: it has none, or not base64)."""
        out: list[bytes | None] = []
        for w in (mwc or {}).get("webhooks") or ():
            encoded = ((w or {}).get("clientConfig") or {}).get("caBundle")
            try:
                out.append(base64.b64decode(encoded, validate=True) if encoded else None)
            except (ValueError, TypeError):
                out.append(None)
        return out

    @staticmethod
    def _owner_of(mwc: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The owner reference to the configuration ``mwc`` (``None`` while it is missing)."""
        if mwc is None:
            return None
        meta = mwc.get("metadata") or {}
        return {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": _MWC_KIND,
            "name": meta.get("name", ""),
            "uid": meta.get("uid", ""),
        }

    @staticmethod
    def _owners_to_set(
        secret: Mapping[str, Any] | None, owner: Mapping[str, Any] | None
    ) -> list[dict[str, Any]] | None:
        """The Secret's ``ownerReferences`` with ``owner`` in them, if it lacks it (``None``:
        nothing to change).  A reference to an earlier configuration of that name (another
        uid, deleted since) is replaced; other owners are kept."""
        if secret is None or owner is None:
            return None
        refs = [
            dict(r)
            for r in (secret.get("metadata") or {}).get("ownerReferences") or ()
            if isinstance(r, Mapping)
        ]
        if any(r.get("kind") == _MWC_KIND and r.get("uid") == owner["uid"] for r in refs):
            return None
        kept = [
            r for r in refs if not (r.get("kind") == _MWC_KIND and r.get("name") == owner["name"])
        ]
        return [*kept, dict(owner)]

    def _replacement(
        self, material: Material | None, exists: bool, trusted: bytes, now: datetime.datetime
    ) -> Material:
        """What to write instead of the Secret's ``material`` (due for renewal; ``exists``: the
        Secret is there at all): this replica's own material when the Secret lost it and it is
        sound, else renewed material, a new CA keeping the CAs still served (module docstring).
        """
        held = self.material
        if material is None and held is not None and not renewal_reason(held, self.names, now):
            log.warning(
                "Secret %s is %s: writing back the certificate this replica serves (still "
                "valid), not a new CA, which the other replicas' certificates are not signed by",
                self.secret_name,
                "unreadable" if exists else "missing",
            )
            return held
        fresh = renewed(material, self.names, now)
        if material is None or fresh.ca_key != material.ca_key:  # a new CA
            fresh = with_cas(fresh, (held.ca_bundle if held else b"") + trusted, now)
        return fresh

    async def _secret_material(self) -> Material:
        """The Secret's material, created, restored or renewed first when needed; the Secret
        gets its owner (the configuration, once it exists) in the same write, or alone.  A
        missing Secret is not written back while the configuration is missing too, unless this
        replica holds nothing yet (:meth:`_withhold`)."""
        mwc = await self._configuration()
        owner = self._owner_of(mwc)
        trusted = b"".join(b for b in self._bundles_of(mwc) if b)
        for _ in range(_ATTEMPTS):
            secret = await self._read_secret()
            material = self._material_of(secret)
            now = self.clock()
            reason = renewal_reason(material, self.names, now)
            owners = self._owners_to_set(secret, owner)
            if secret is None and owner is None and self.material is not None:
                return self._withhold(self.material)
            self.secret_withheld = False
            if not reason and owners is None:
                assert material is not None
                self.configuration_uid = owner["uid"] if owner else ""
                return material
            fresh = (
                self._replacement(material, secret is not None, trusted, now)
                if reason
                else material
            )
            assert fresh is not None
            try:
                if secret is None:
                    log.info("creating the webhook certificate Secret %s", self.secret_name)
                    await self.api.create(self.secrets_path, self._secret_body(fresh, owner))
                else:
                    meta: dict[str, Any] = {
                        "resourceVersion": (secret.get("metadata") or {}).get("resourceVersion")
                    }
                    body: dict[str, Any] = {"metadata": meta}
                    if reason:
                        log.info(
                            "renewing the webhook certificate in %s: %s", self.secret_name, reason
                        )
                        body["data"] = fresh.secret_data()
                    if owners is not None:
                        assert owner is not None
                        log.info(
                            "Secret %s is now owned by %s %s: it is deleted with it",
                            self.secret_name,
                            _MWC_KIND,
                            owner["name"],
                        )
                        meta["ownerReferences"] = owners
                    await self.api.patch(f"{self.secrets_path}/{self.secret_name}", body)
            except Conflict:
                log.info("Secret %s was written by another replica; re-reading", self.secret_name)
                continue
            self.configuration_uid = owner["uid"] if owner else ""
            return fresh
        raise RuntimeError(
            f"Secret {self.secret_name} kept changing while being written ({_ATTEMPTS} tries)"
        )

    def _withhold(self, held: Material) -> Material:
        """The Secret and the configuration are both missing (an uninstall, most likely): keep
        serving ``held`` and write nothing, as an unowned Secret would outlive the release."""
        if not self.secret_withheld:
            log.info(
                "Secret %s and MutatingWebhookConfiguration %s are both missing (uninstalled?): "
                "the Secret is not written back while the configuration is missing (it would "
                "have no owner and outlive it); serving the certificate this replica holds",
                self.secret_name,
                self.configuration_path.rsplit("/", 1)[-1],
            )
        self.secret_withheld = True
        self.configuration_uid = ""
        return held

    def _secret_body(self, material: Material, owner: Mapping[str, Any] | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "name": self.secret_name,
            "labels": {
                "app.kubernetes.io/part-of": "gpuslice",
                "app.kubernetes.io/component": "webhook",
            },
        }
        if owner is not None:
            meta["ownerReferences"] = [dict(owner)]
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": meta,
            "data": material.secret_data(),
        }

    # -- the caBundle --------------------------------------------------------------------
    async def _patch_ca_bundle(self, bundle: bytes) -> bool:
        """Set the caBundle; ``False`` when the configuration does not exist (yet)."""
        encoded = base64.b64encode(bundle).decode("ascii")
        for _ in range(_ATTEMPTS):
            try:
                mwc = await self.api.request("GET", self.configuration_path)
            except NotFound:
                # WARNING once per absence; the retries soon after (run) at DEBUG.
                level = logging.WARNING if not self.configuration_missing else logging.DEBUG
                log.log(
                    level,
                    "MutatingWebhookConfiguration %s not found: its caBundle is set once it "
                    "exists (pods are not gated meanwhile); checking again within %.0f s",
                    self.configuration_path.rsplit("/", 1)[-1],
                    min(MISSING_CONFIGURATION_RETRY.cap_s, self.check_seconds),
                )
                return False
            webhooks = [dict(w) for w in mwc.get("webhooks") or ()]
            if all((w.get("clientConfig") or {}).get("caBundle") == encoded for w in webhooks):
                return True
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
            return True
        raise RuntimeError(f"{self.configuration_path} kept changing while its caBundle was set")

    # -- the whole step ------------------------------------------------------------------
    async def sync(self) -> Material:
        """Secret, then caBundle, then files (see the module docstring)."""
        material = await self._secret_material()
        if await self._patch_ca_bundle(material.ca_bundle):
            self.configuration_missing = 0
        else:
            self.configuration_missing += 1
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

    def _ca_bundle_problem(self, mwc: Mapping[str, Any]) -> str:
        """What is wrong with the configuration's caBundle for this replica ("" when nothing
        is, or nothing is known yet)."""
        if self.material is None:
            return ""
        bundles = self._bundles_of(mwc)
        if any(b is None for b in bundles):
            return "has no caBundle"
        if not all(b is not None and trusts(b, self.material.cert) for b in bundles):
            return "has a caBundle that does not trust this replica's certificate"
        return ""

    async def check_configuration(self) -> None:
        """Between syncs: GET the configuration alone; :meth:`sync` at once when it is gone, a
        new object (another uid), or its caBundle does not trust this replica's certificate
        (then also a WARNING and :attr:`restored`)."""
        mwc = await self._configuration()
        problem = "" if mwc is None else self._ca_bundle_problem(mwc)
        uid = "" if mwc is None else str((mwc.get("metadata") or {}).get("uid") or "")
        if not problem and uid == self.configuration_uid:
            return
        await self.sync()
        if problem and not self.configuration_missing:
            log.warning(
                "MutatingWebhookConfiguration %s %s (replaced or re-created without it?): "
                "restored.  Meanwhile the API server could not verify the webhook, and "
                "failurePolicy Ignore admitted slice pods ungated (without a reservation).  "
                "Tools that replace the object (helm --force, kubectl replace, GitOps "
                "Replace=true) should ignore its caBundle",
                self.configuration_path.rsplit("/", 1)[-1],
                problem,
            )
            self.restored()

    async def run(self) -> None:
        """:meth:`sync` now and every ``check_seconds``, :meth:`check_configuration` every
        ``bundle_check_seconds`` in between; after a failure, or while the
        MutatingWebhookConfiguration is missing, a whole sync sooner.

        Retries after a failure back off exponentially with jitter (1 s doubling up to
        ``check_seconds``); an outage is one WARNING when it starts and one INFO when a sync
        succeeds again (:class:`~partitioner.kubeapi.OutageLog`), not a line per attempt.  A
        sync that found no configuration is repeated after
        :data:`MISSING_CONFIGURATION_RETRY` (1 s doubling up to 30 s, at most
        ``check_seconds``), so its caBundle and the Secret's owner follow its creation within
        seconds instead of a check period (an hour by default) of ungated pods.
        """
        loop = asyncio.get_running_loop()
        backoff = Backoff(initial_s=min(1.0, self.check_seconds), cap_s=self.check_seconds)
        outage = OutageLog("webhook certificate sync", log)
        next_sync = loop.time()
        while True:
            try:
                if loop.time() >= next_sync:
                    await self.sync()
                    next_sync = loop.time() + self.check_seconds
                else:
                    await self.check_configuration()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.last_error = f"{type(e).__name__}: {e}"
                delay = backoff.delay(outage.failures + 1, random.random())
                outage.failed(e, delay)
                next_sync = loop.time()  # the retry is a whole sync
                await asyncio.sleep(delay)
                continue
            self.last_error = ""
            outage.succeeded()
            if self.configuration_missing:
                retry = MISSING_CONFIGURATION_RETRY.delay(
                    self.configuration_missing, random.random()
                )
                next_sync = loop.time()  # the retry is a whole sync
                await asyncio.sleep(min(retry, self.check_seconds))
            else:
                wait = min(self.bundle_check_seconds, next_sync - loop.time())
                await asyncio.sleep(max(0.0, wait))
