"""The admission webhook when something around it breaks (partitioner/webhook_certs.py,
partitioner/webhook.py, partitioner/health.py), against kmock in looptime's fake time:

* the MutatingWebhookConfiguration replaced or re-created without its caBundle (``helm upgrade
  --force``, ``kubectl replace``, a GitOps re-create), or with a foreign one: restored within
  ``webhook_ca_bundle_check_seconds``, with a WARNING and a count, not an hour later;
* the certificate Secret lost (deleted, garbage-collected with a re-created configuration) or
  unreadable: written back from a replica's material, so the other replicas' certificates stay
  trusted; a new CA, when one must be made, keeps the CAs still served in the bundle;
* readiness: a replica is ready only while its webhook is served (the Service routes admission
  calls to ready pods), follower or leader.

Trust is checked as the API server does it: is the served certificate signed by a CA of the
caBundle (``x509`` directly, not :func:`partitioner.certs.trusts`, which is under test too).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
import kopf
import pytest
from cryptography import x509
from fake_apiserver import MWC_RESOURCE, ApiServer, declare, declare_leases, stored
from test_partitioner_webhook import (
    CONFIGURATION,
    MWC_PATH,
    NAMESPACE,
    SECRET,
    SERVICE,
    ca_bundle,
    configuration,
    eventually,
    free_port,
    keeper,
    served,
    settings,
)

from partitioner.certs import CA_DAYS, SERVING_DAYS, issue, service_dns_names
from partitioner.operator import Controller, run_operator
from partitioner.settings import PartitionerSettings
from partitioner.webhook_certs import CertificateKeeper

SECRET_PATH = f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}"
LOGGER = "gpuslice.partitioner.webhook"


@attrs.define(kw_only=True)
class FlakySecrets(ApiServer):
    """The fake API server, answering 403 to every Secret request while ``refuse`` is set."""

    refuse: bool = attrs.field(default=False, init=False)

    async def _handle(self, request: kmock.Request) -> Any:
        if self.refuse and "/secrets" in request.url.path:
            status = {"kind": "Status", "status": "Failure", "reason": "Forbidden"}
            body = status | {"code": 403, "message": "secrets is forbidden"}
            return aiohttp.web.json_response(body, status=403)
        return await super()._handle(request)


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": FlakySecrets}


def trusted(bundle: bytes | None, server_pem: bytes) -> bool:
    """Would a client trusting ``bundle`` only accept the certificate in ``server_pem``?"""
    if not bundle:
        return False
    cert = x509.load_pem_x509_certificates(server_pem)[0]
    for ca in x509.load_pem_x509_certificates(bundle):
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, Exception):
            continue
        return True
    return False


def mwc_version(api: ApiServer) -> str:
    mwc = stored(api, MWC_RESOURCE, CONFIGURATION)
    assert mwc is not None
    return str(mwc["metadata"]["resourceVersion"])


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING
    ]


# -- the caBundle between syncs ----------------------------------------------------------------
@pytest.mark.looptime
async def test_a_configuration_without_its_cabundle_gets_it_back_within_seconds(
    kmock: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    k = keeper(kmock, tmp_path, "a")
    restored: list[float] = []
    loop = asyncio.get_running_loop()
    k.restored = lambda: restored.append(loop.time())
    assert (k.check_seconds, k.bundle_check_seconds) == (3600, 20)
    task = asyncio.create_task(k.run())
    try:
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            await k.ready.wait()
            assert trusted(ca_bundle(kmock), k.server_file.read_bytes())
            version = mwc_version(kmock)
            await asyncio.sleep(300)  # five quiet minutes: the checks only read
            assert mwc_version(kmock) == version and restored == [] and warnings(caplog) == []

            # 1. replaced with the chart's rendered object: no caBundle
            await kmock.patch(
                f"{MWC_PATH}/{CONFIGURATION}", json={"webhooks": configuration()["webhooks"]}
            )
            assert ca_bundle(kmock) is None
            start = loop.time()
            await eventually(lambda: ca_bundle(kmock), within=120)
            assert loop.time() - start <= 21, f"restored after {loop.time() - start:.0f}s"
            assert trusted(ca_bundle(kmock), k.server_file.read_bytes())
            assert len(restored) == 1
            (warning,) = warnings(caplog)
            assert f"{CONFIGURATION} has no caBundle" in warning and "restored" in warning
            assert "failurePolicy Ignore admitted slice pods ungated" in warning

            # 2. deleted and created again (a new uid): caBundle back, the Secret follows it
            await kmock.delete(f"{MWC_PATH}/{CONFIGURATION}")
            again = await (await kmock.post(MWC_PATH, json=configuration())).json()
            start = loop.time()
            await eventually(lambda: ca_bundle(kmock), within=120)
            assert loop.time() - start <= 21
            secret = stored(kmock, "v1/secrets", SECRET, NAMESPACE)
            assert secret is not None
            owners = [r["uid"] for r in secret["metadata"]["ownerReferences"]]
            assert owners == [again["metadata"]["uid"]]
            assert len(restored) == 2

            # 3. a caBundle that does not trust this replica (e.g. another install's CA)
            foreign = issue(service_dns_names(SERVICE, NAMESPACE), k.clock()).ca_bundle
            webhooks = configuration()["webhooks"]
            webhooks[0]["clientConfig"]["caBundle"] = base64.b64encode(foreign).decode()
            await kmock.patch(f"{MWC_PATH}/{CONFIGURATION}", json={"webhooks": webhooks})
            await eventually(lambda: ca_bundle(kmock) != foreign, within=21)
            assert trusted(ca_bundle(kmock), k.server_file.read_bytes())
            assert "does not trust this replica's certificate" in warnings(caplog)[-1]
            assert len(restored) == 3 and len(warnings(caplog)) == 3

            version = mwc_version(kmock)
            await asyncio.sleep(120)  # sound again: nothing more written or said
            assert mwc_version(kmock) == version and len(restored) == 3
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await k.api.close()


def test_the_cabundle_check_is_never_rarer_than_the_certificate_check(tmp_path: Path) -> None:
    config = settings(tmp_path, 9443, webhook_cert_check_seconds=5)
    assert config.webhook_ca_bundle_check_seconds == 20
    k = CertificateKeeper(None, config)  # type: ignore[arg-type]  # no call is made
    assert (k.check_seconds, k.bundle_check_seconds) == (5, 5)
    with pytest.raises(ValueError, match="webhook_ca_bundle_check_seconds"):
        settings(tmp_path, 9443, webhook_ca_bundle_check_seconds=0)


# -- a lost Secret -----------------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["missing", "unreadable"])
async def test_a_lost_secret_is_written_back_so_every_replica_stays_trusted(
    kmock: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, loss: str
) -> None:
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    a, b = keeper(kmock, tmp_path, "a"), keeper(kmock, tmp_path, "b")
    try:
        old = await a.sync()
        assert await b.sync() == old
        if loss == "missing":
            await kmock.delete(SECRET_PATH)
        else:
            await kmock.patch(SECRET_PATH, json={"data": {"ca.crt": "not base64!"}})
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert await a.sync() == old  # not a new CA
        secret = stored(kmock, "v1/secrets", SECRET, NAMESPACE)
        assert secret is not None and secret["data"] == old.secret_data()
        assert any(f"Secret {SECRET} is {loss}: writing back" in w for w in warnings(caplog))
        bundle = ca_bundle(kmock)
        assert trusted(bundle, a.server_file.read_bytes())
        assert trusted(bundle, b.server_file.read_bytes())
        assert await b.sync() == old
    finally:
        await a.api.close()
        await b.api.close()


async def test_a_new_ca_keeps_the_cas_still_served_in_the_bundle(
    kmock: ApiServer, tmp_path: Path
) -> None:
    """A replica that holds nothing sound (it just started, or its material is due) must make a
    new CA when the Secret is gone; the CAs the others still serve under stay trusted: the
    configuration's caBundle's and its own material's."""
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    a = keeper(kmock, tmp_path, "a")
    c = keeper(kmock, tmp_path, "c")  # restarted: nothing in memory
    d = keeper(kmock, tmp_path, "d")
    try:
        old = await a.sync()
        await kmock.delete(SECRET_PATH)
        new = await c.sync()
        assert new.ca_key != old.ca_key  # a new CA...
        bundle = ca_bundle(kmock)
        assert bundle == new.ca_bundle
        assert trusted(bundle, c.server_file.read_bytes())
        assert trusted(bundle, a.server_file.read_bytes())  # ...and a's CA is still trusted
        assert await a.sync() == new  # the Secret is the source again: a follows

        # d's own material is due (its CA ends within a year) and the Secret is gone: the new
        # CA keeps d's CA, though the configuration's caBundle (stripped) knows nothing of it.
        now = datetime.datetime.now(datetime.UTC)
        names = service_dns_names(SERVICE, NAMESPACE)
        due = issue(names, now - (CA_DAYS - SERVING_DAYS + 30) * datetime.timedelta(days=1))
        d.material = due
        await kmock.delete(SECRET_PATH)
        await kmock.patch(
            f"{MWC_PATH}/{CONFIGURATION}", json={"webhooks": configuration()["webhooks"]}
        )
        fresh = await d.sync()
        assert fresh.ca_key not in (due.ca_key, new.ca_key)
        due_ca = x509.load_pem_x509_certificates(due.ca_bundle)[0]
        assert due_ca in x509.load_pem_x509_certificates(ca_bundle(kmock) or b"")
    finally:
        for k in (a, c, d):
            await k.api.close()


# -- readiness follows serving -----------------------------------------------------------------
@contextlib.asynccontextmanager
async def wired(
    api: ApiServer, config: PartitionerSettings, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Controller]:
    """The operator as it runs: ``operator.build_registry`` wires its webhook to its health
    and metrics."""
    info = kopf.ConnectionInfo(server=str(api.url).rstrip("/"))
    controller = Controller(config, connection=info)
    stop = asyncio.Event()
    task = asyncio.create_task(run_operator(controller, stop_flag=stop))
    try:
        yield controller
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
    assert task.exception() is None


async def listening(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


@pytest.mark.looptime
async def test_not_ready_while_the_webhook_is_not_served_and_ready_once_it_is(
    kmock: FlakySecrets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    kmock.refuse = True  # e.g. RBAC missing for the Secret: no certificate, no listener
    port = free_port()
    async with wired(kmock, settings(tmp_path, port), monkeypatch) as controller:
        await eventually(lambda: controller.health.readiness().synced, within=60)
        await asyncio.sleep(30)
        report = controller.health.readiness()
        assert not await listening(port)
        assert not report.ok and report.synced
        assert report.reason.startswith("the admission webhook is not served: no certificate yet")
        assert "403 Forbidden" in report.reason and SECRET in report.reason
        assert controller.health.liveness().ok

        kmock.refuse = False
        # the sync retries with backoff (1 s doubling, jittered): within a minute here
        await eventually(lambda: controller.health.readiness().ok, within=90)
        assert await served(port, ca_bundle(kmock) or b"")
        sample = controller.metrics.registry.get_sample_value
        assert sample("gpuslice_webhook_ca_bundle_restored_total") == 0

        # the configuration replaced: restored and counted in the replica's metrics
        await kmock.patch(
            f"{MWC_PATH}/{CONFIGURATION}", json={"webhooks": configuration()["webhooks"]}
        )
        await eventually(lambda: ca_bundle(kmock), within=21)
        assert sample("gpuslice_webhook_ca_bundle_restored_total") == 1
        assert controller.health.readiness().ok


@pytest.mark.looptime
async def test_files_mode_is_not_ready_until_its_files_serve(
    kmock: FlakySecrets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    declare(kmock)
    certs = tmp_path / "mounted"
    certs.mkdir()
    port = free_port()
    config = settings(
        tmp_path,
        port,
        webhook_cert_mode="files",
        webhook_cert_dir=str(certs),
        webhook_secret_name="",
        webhook_configuration_name="",
    )
    async with wired(kmock, config, monkeypatch) as controller:
        await eventually(lambda: "FileNotFoundError" in controller.health.readiness().reason, 60)
        assert controller.health.readiness().synced and not await listening(port)
        material = issue(service_dns_names(SERVICE, NAMESPACE), datetime.datetime.now(datetime.UTC))
        for name, data in (
            ("tls.crt", material.cert),
            ("tls.key", material.key),
            ("ca.crt", material.ca_bundle),
        ):
            (certs / name).write_bytes(data)
        await eventually(lambda: controller.health.readiness().ok, within=30)
        assert await served(port, material.ca_bundle)


@pytest.mark.looptime
async def test_a_follower_serves_the_webhook_and_is_ready(
    kmock: FlakySecrets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leader election: another replica holds the Lease for the whole test; this one follows,
    serves the webhook, and is ready exactly when it does."""
    declare(kmock)
    declare_leases(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    lease = "gs-gpuslice-partitioner"
    await kmock.post(
        f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases",
        json={
            "metadata": {"name": lease, "namespace": NAMESPACE},
            "spec": {"holderIdentity": "other", "leaseDurationSeconds": 86400},
        },
    )
    port = free_port()
    config = settings(
        tmp_path,
        port,
        leader_election_enabled=True,
        leader_election_namespace=NAMESPACE,
        leader_election_lease_name=lease,
        leader_election_identity="me",
    )
    async with wired(kmock, config, monkeypatch) as controller:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not (report := controller.health.readiness()).ok:
            assert loop.time() < deadline, report.reason
            await asyncio.sleep(0.1)
        assert await served(port, ca_bundle(kmock) or b"")  # ready means served
        assert (report.leader, report.holder) == (False, "other")
        assert not controller.leading()
