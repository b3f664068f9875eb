"""The admission webhook, served by the real kopf operator, against kmock in looptime's fake time.

The operator runs with the webhook on (self-managed certificates unless said otherwise): it
creates the certificate Secret, sets the caBundle of the MutatingWebhookConfiguration the chart
would have rendered, and serves kopf's WebhookServer over TLS.  Reviews are POSTed the way the
API server sends them: to the Service's DNS name (checked against the certificate), trusting only
the caBundle it was given.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import kmock
import kopf
import pytest
from fake_apiserver import MWC_RESOURCE, Admission, ApiServer, admission_review, declare, stored

from partitioner import gating
from partitioner.certs import Material, issue, renewed, service_dns_names
from partitioner.kubeapi import Endpoint, KubeApi
from partitioner.operator import Controller, build_registry, run_operator
from partitioner.settings import PartitionerSettings
from partitioner.webhook import WEBHOOK_PATH
from partitioner.webhook_certs import CertificateKeeper

NAMESPACE, SERVICE = "gpu-system", "gs-gpuslice-webhook"
CONFIGURATION, SECRET = "gs-gpuslice", "gs-gpuslice-webhook-tls"
HOST = service_dns_names(SERVICE, NAMESPACE)[0]
MWC_PATH = f"/apis/{MWC_RESOURCE}"
MIG = "nvidia.com/mig-1g.10gb"


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def configuration() -> dict[str, Any]:
    """The MutatingWebhookConfiguration as the chart renders it (no caBundle yet)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": CONFIGURATION},
        "webhooks": [
            {
                "name": "slice-gate.gpuslice.io",
                "clientConfig": {
                    "service": {
                        "name": SERVICE,
                        "namespace": NAMESPACE,
                        "path": WEBHOOK_PATH,
                        "port": 443,
                    }
                },
                "failurePolicy": "Ignore",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
            }
        ],
    }


def settings(tmp_path: Path, port: int, **overrides: Any) -> PartitionerSettings:
    base: dict[str, Any] = {
        "cycle_seconds": 1,
        "planner_time_limit_seconds": 0.5,
        "metrics_port": 0,
        "health_port": 0,
        "webhook_enabled": True,
        "webhook_port": port,
        "webhook_cert_dir": str(tmp_path / "certs"),
        "webhook_service_name": SERVICE,
        "webhook_namespace": NAMESPACE,
        "webhook_configuration_name": CONFIGURATION,
        "webhook_secret_name": SECRET,
    }
    return PartitionerSettings(**(base | overrides))


async def eventually(check: Callable[[], Any], within: float, step: float = 0.5) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not (result := check()):
        if loop.time() >= deadline:
            raise AssertionError(f"condition not met within {within}s of loop time")
        await asyncio.sleep(step)
    return result


def ca_bundle(api: ApiServer) -> bytes | None:
    mwc = stored(api, MWC_RESOURCE, CONFIGURATION)
    encoded = ((mwc or {}).get("webhooks") or [{}])[0].get("clientConfig", {}).get("caBundle")
    return base64.b64decode(encoded) if encoded else None


async def post_review(port: int, ca: bytes, review: dict[str, Any]) -> dict[str, Any]:
    """POST ``review`` as the API server would: TLS to ``HOST``, trusting ``ca`` only."""
    context = ssl.create_default_context(cadata=ca.decode())
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"https://127.0.0.1:{port}{WEBHOOK_PATH}",
            json=review,
            ssl=context,
            server_hostname=HOST,
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
    response: dict[str, Any] = answer["response"]
    assert response["uid"] == review["request"]["uid"]
    return response


async def served(port: int, ca: bytes) -> bool:
    probe = admission_review({"metadata": {"name": "probe", "namespace": "default"}, "spec": {}})
    try:
        await post_review(port, ca, probe)
    except (aiohttp.ClientError, OSError):
        return False
    return True


async def wait_served(port: int, ca: Callable[[], bytes | None], within: float = 30) -> bytes:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        bundle = ca()
        if bundle and await served(port, bundle):
            return bundle
        if loop.time() >= deadline:
            raise AssertionError(f"the webhook was not served within {within}s of loop time")
        await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def operator(api: ApiServer, config: PartitionerSettings) -> AsyncIterator[Controller]:
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


def pod(name: str, **spec: Any) -> dict[str, Any]:
    labels = spec.pop("labels", None)
    owners = spec.pop("ownerReferences", None)
    resources = spec.pop("resources", {"limits": {MIG: "1"}})
    meta: dict[str, Any] = {"name": name, "namespace": "default"}
    if labels:
        meta["labels"] = labels
    if owners:
        meta["ownerReferences"] = owners
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "main", "resources": resources}], **spec},
    }


def patched(pod_body: dict[str, Any], response: dict[str, Any]) -> dict[str, Any] | None:
    """The pod after the webhook's answer (``None``: no patch)."""
    assert response["allowed"] is True, response
    if "patch" not in response:
        return None
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    result: dict[str, Any] = jsonpatch.apply_patch(pod_body, ops)
    return result


KUEUE = {"name": "kueue.x-k8s.io/admission"}
DS_OWNER = [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "u1"}]
RS_OWNER = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "u2"}]


def _sidecar(name: str, limits: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "restartPolicy": "Always", "resources": {"limits": limits}}


# pod -> the gates it must have after admission (None: left unpatched)
CASES: dict[str, tuple[dict[str, Any], list[dict[str, str]] | None]] = {
    "mig-limit": (pod("a"), [{"name": gating.GATE}]),
    "mps-request-replicaset": (
        pod("b", resources={"requests": {"nvidia.com/gpu-10gb": "1"}}, ownerReferences=RS_OWNER),
        [{"name": gating.GATE}],
    ),
    "init-container": (
        pod("c", resources={}, initContainers=[{"name": "i", "resources": {"limits": {MIG: "1"}}}]),
        [{"name": gating.GATE}],
    ),
    "other-gate-kept": (pod("d", schedulingGates=[KUEUE]), [KUEUE, {"name": gating.GATE}]),
    "no-slice": (pod("e", resources={"limits": {"nvidia.com/gpu": "1", "cpu": "1"}}), None),
    "opted-out": (pod("f", labels={gating.OPT_OUT_LABEL: gating.OPT_OUT_VALUE}), None),
    "daemonset": (pod("g", ownerReferences=DS_OWNER), None),
    "node-name": (pod("h", nodeName="n1"), None),
    "gate-present": (pod("i", schedulingGates=[{"name": gating.GATE}]), None),
    "malformed": ({"metadata": {"name": "j", "namespace": "default"}, "spec": ["x"]}, None),
    # amounts as kube-scheduler counts them: all zero asks for nothing (the CEL goes by names)
    "zero-limit": (pod("z1", resources={"limits": {MIG: "0"}}), None),
    "zero-request-and-limit": (
        pod("z2", resources={"limits": {MIG: "0"}, "requests": {MIG: "0"}}),
        None,
    ),
    "zero-in-container-and-init": (
        pod(
            "z3",
            resources={"limits": {"nvidia.com/gpu-10gb": "0"}},
            initContainers=[{"name": "i", "resources": {"requests": {MIG: "0"}}}],
        ),
        None,
    ),
    "zero-and-one": (
        pod(
            "z4",
            resources={"limits": {MIG: "0"}},
            initContainers=[{"name": "i", "resources": {"limits": {MIG: "1"}}}],
        ),
        [{"name": gating.GATE}],
    ),
    "sidecar-only": (
        pod("s1", resources={}, initContainers=[_sidecar("side", {MIG: "1"})]),
        [{"name": gating.GATE}],
    ),
    "several-containers": (
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "m1", "namespace": "default"},
            "spec": {
                "containers": [
                    {"name": "a", "resources": {"limits": {"cpu": "1"}}},
                    {"name": "b", "resources": {"requests": {"nvidia.com/gpu-10gb": "2"}}},
                ]
            },
        },
        [{"name": gating.GATE}],
    ),
    "fractional": (pod("f1", resources={"limits": {MIG: "500m"}}), [{"name": gating.GATE}]),
    "large": (pod("l1", resources={"limits": {MIG: "2k"}}), [{"name": gating.GATE}]),
    "two-gates-kept": (
        pod("g1", schedulingGates=[{"name": "a.io/x"}, {"name": "b.io/y"}]),
        [{"name": "a.io/x"}, {"name": "b.io/y"}, {"name": gating.GATE}],
    ),
}


@pytest.mark.looptime
async def test_webhook_answers_gate_exactly_the_pods_that_ask_for_a_slice(
    kmock: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    port = free_port()
    async with operator(kmock, settings(tmp_path, port)):
        ca = await wait_served(port, lambda: ca_bundle(kmock))
        for case, (body, gates) in CASES.items():
            response = await post_review(port, ca, admission_review(body))
            after = patched(body, response)
            if gates is None:
                assert after is None, f"{case}: {response}"
            else:
                assert after is not None, f"{case}: not patched"
                assert after["spec"]["schedulingGates"] == gates, case
                assert {k: v for k, v in after.items() if k != "spec"} == {
                    k: v for k, v in body.items() if k != "spec"
                }, case

        # A failing decision still admits the pod, unchanged (kopf would otherwise answer
        # allowed: false, which the API server honours even under failurePolicy Ignore).
        def broken(_: Any) -> None:
            raise RuntimeError("decision failed")

        monkeypatch.setattr(gating, "admission_patch", broken)
        response = await post_review(port, ca, admission_review(pod("k")))
        assert patched(pod("k"), response) is None
        assert "status" not in response


@pytest.mark.looptime
async def test_pods_created_through_the_api_are_gated_and_not_when_the_partitioner_is_down(
    kmock: ApiServer, tmp_path: Path
) -> None:
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    port = free_port()
    cafile = tmp_path / "apiserver-ca.crt"
    async with operator(kmock, settings(tmp_path, port)):
        ca = await wait_served(port, lambda: ca_bundle(kmock))
        cafile.write_bytes(ca)
        kmock.configure_admission(
            Admission(
                url=f"https://127.0.0.1:{port}{WEBHOOK_PATH}", cafile=cafile, server_hostname=HOST
            )
        )
        resp = await kmock.post("/api/v1/namespaces/default/pods", json=pod("gated"))
        assert resp.status in (200, 201), await resp.text()
        resp = await kmock.post("/api/v1/namespaces/default/pods", json=pod("cpu", resources={}))
        assert resp.status in (200, 201), await resp.text()
        stored_pod = stored(kmock, "v1/pods", "gated", "default")
        assert stored_pod is not None
        assert stored_pod["spec"]["schedulingGates"] == [{"name": gating.GATE}]
        assert stored_pod["status"]["conditions"][0]["reason"] == "SchedulingGated"
        cpu = stored(kmock, "v1/pods", "cpu", "default")
        assert cpu is not None and "schedulingGates" not in cpu["spec"]
        assert kmock.admission_failures == []

        # An API server holding another CA (a stale caBundle) cannot call it: created ungated.
        stranger = tmp_path / "stranger-ca.crt"
        now = datetime.datetime.now(datetime.UTC)
        stranger.write_bytes(issue(service_dns_names(SERVICE, NAMESPACE), now).ca_bundle)
        url = f"https://127.0.0.1:{port}{WEBHOOK_PATH}"
        kmock.configure_admission(Admission(url=url, cafile=stranger, server_hostname=HOST))
        resp = await kmock.post("/api/v1/namespaces/default/pods", json=pod("stale-ca"))
        assert resp.status in (200, 201), await resp.text()
        stale = stored(kmock, "v1/pods", "stale-ca", "default")
        assert stale is not None and "schedulingGates" not in stale["spec"]
        (why,) = kmock.admission_failures
        assert "certificate verify failed" in why
        kmock.admission_failures.clear()
        kmock.configure_admission(Admission(url=url, insecure=True))
        resp = await kmock.post("/api/v1/namespaces/default/pods", json=pod("insecure"))
        assert resp.status in (200, 201), await resp.text()
        assert (stored(kmock, "v1/pods", "insecure", "default") or {})["spec"]["schedulingGates"]

    # The partitioner is gone: failurePolicy Ignore creates the pod as it is (ungated).
    resp = await kmock.post("/api/v1/namespaces/default/pods", json=pod("while-down"))
    assert resp.status in (200, 201), await resp.text()
    down = stored(kmock, "v1/pods", "while-down", "default")
    assert down is not None and "schedulingGates" not in down["spec"]
    assert len(kmock.admission_failures) == 1


@pytest.mark.looptime
async def test_self_managed_certificate_survives_a_restart_and_is_renewed(
    kmock: ApiServer, tmp_path: Path
) -> None:
    declare(kmock)
    mwc = await (await kmock.post(MWC_PATH, json=configuration())).json()
    port = free_port()
    async with operator(kmock, settings(tmp_path, port)):
        ca = await wait_served(port, lambda: ca_bundle(kmock))
    secret = stored(kmock, "v1/secrets", SECRET, NAMESPACE)
    assert secret is not None and secret["type"] == "kubernetes.io/tls"
    assert base64.b64decode(secret["data"]["ca.crt"]) == ca
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "MutatingWebhookConfiguration",
        CONFIGURATION,
        mwc["metadata"]["uid"],
    )
    assert "blockOwnerDeletion" not in owner
    key_file = tmp_path / "certs" / "tls.pem"
    assert key_file.stat().st_mode & 0o077 == 0  # the private key is private

    # Restart: the same material is served, nothing rewritten.
    version = secret["metadata"]["resourceVersion"]
    async with operator(kmock, settings(tmp_path, port)):
        assert await wait_served(port, lambda: ca_bundle(kmock)) == ca
    again = stored(kmock, "v1/secrets", SECRET, NAMESPACE)
    assert again is not None and again["metadata"]["resourceVersion"] == version

    # A certificate near its end (issued 300 days ago) is renewed at start, from the same CA.
    current = Material.from_secret_data(secret["data"])
    old = renewed(
        current,
        service_dns_names(SERVICE, NAMESPACE),
        datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=300),
    )
    assert old.ca_bundle == current.ca_bundle and old.cert != current.cert
    resp = await kmock.patch(
        f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}", json={"data": old.secret_data()}
    )
    assert resp.status == 200
    async with operator(kmock, settings(tmp_path, port)):
        assert await wait_served(port, lambda: ca_bundle(kmock)) == ca
        fresh = Material.from_secret_data(
            (stored(kmock, "v1/secrets", SECRET, NAMESPACE) or {})["data"]
        )
        assert fresh.cert not in (old.cert, current.cert)
        assert fresh.not_after() > old.not_after()
        assert key_file.read_bytes() == fresh.server_pem()


@pytest.mark.looptime
async def test_files_mode_serves_the_mounted_certificate(kmock: ApiServer, tmp_path: Path) -> None:
    """cert-manager's mode: the operator only reads tls.crt/tls.key/ca.crt, touches no Secret."""
    declare(kmock)
    material = issue(service_dns_names(SERVICE, NAMESPACE), datetime.datetime.now(datetime.UTC))
    certs = tmp_path / "mounted"
    certs.mkdir()
    for name, data in (
        ("tls.crt", material.cert),
        ("tls.key", material.key),
        ("ca.crt", material.ca_bundle),
    ):
        (certs / name).write_bytes(data)
    port = free_port()
    config = settings(
        tmp_path,
        port,
        webhook_cert_mode="files",
        webhook_cert_dir=str(certs),
        webhook_secret_name="",
        webhook_configuration_name="",
    )
    async with operator(kmock, config):
        await wait_served(port, lambda: material.ca_bundle)
        response = await post_review(port, material.ca_bundle, admission_review(pod("a")))
        after = patched(pod("a"), response)
        assert after is not None and after["spec"]["schedulingGates"] == [{"name": gating.GATE}]
    assert stored(kmock, "v1/secrets", SECRET, NAMESPACE) is None


def test_kmock_is_the_fake(kmock: kmock.KubernetesEmulator) -> None:
    assert isinstance(kmock, ApiServer)


# --------------------------------------------------------------- the certificate keeper alone


def keeper(api: ApiServer, tmp_path: Path, name: str) -> CertificateKeeper:
    """One replica's keeper (its own certificate directory) talking to ``api``."""
    server = str(api.url).rstrip("/")
    client = KubeApi(lambda: Endpoint(server=server))
    return CertificateKeeper(client, settings(tmp_path / name, 9443))


def race_reads(*keepers: CertificateKeeper) -> None:
    """Make every keeper's first Secret read return only when all have read: each then acts on
    what it read, as two replicas starting together would."""
    barrier = asyncio.Barrier(len(keepers))
    for k in keepers:
        read = k._read_secret
        first = [True]

        async def synced(read: Any = read, first: list[bool] = first) -> Any:
            secret = await read()
            if first[0]:
                first[0] = False
                await barrier.wait()
            return secret

        k._read_secret = synced  # type: ignore[method-assign]


async def sync_together(a: CertificateKeeper, b: CertificateKeeper) -> tuple[Material, Material]:
    """Both replicas' first sync at once, each acting on what it read first."""
    race_reads(a, b)
    try:
        got_a, got_b = await asyncio.gather(a.sync(), b.sync())
    finally:
        await a.api.close()
        await b.api.close()
    return got_a, got_b


def secret_writes(api: ApiServer) -> list[str]:
    """The HTTP method of every write request to a Secret, in order."""
    methods = [
        str(r.method).upper().rsplit(".", 1)[-1] for r in list(api) if "/secrets" in r.url.path
    ]
    return [m for m in methods if m != "GET"]


async def test_two_replicas_starting_together_share_one_certificate(
    kmock: ApiServer, tmp_path: Path
) -> None:
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    a, b = keeper(kmock, tmp_path, "a"), keeper(kmock, tmp_path, "b")
    got_a, got_b = await sync_together(a, b)
    assert got_a == got_b
    assert a.server_file.read_bytes() == b.server_file.read_bytes() == got_a.server_pem()
    assert secret_writes(kmock) == ["POST", "POST"]  # one lost with 409
    assert ca_bundle(kmock) == got_a.ca_bundle


async def test_two_replicas_renewing_together_keep_one_certificate(
    kmock: ApiServer, tmp_path: Path
) -> None:
    declare(kmock)
    await kmock.post(MWC_PATH, json=configuration())
    names = service_dns_names(SERVICE, NAMESPACE)
    due = issue(names, datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=300))
    await kmock.post(
        f"/api/v1/namespaces/{NAMESPACE}/secrets",
        json={"metadata": {"name": SECRET}, "type": "kubernetes.io/tls", "data": due.secret_data()},
    )
    a, b = keeper(kmock, tmp_path, "a"), keeper(kmock, tmp_path, "b")
    got_a, got_b = await sync_together(a, b)
    assert got_a == got_b and got_a.cert != due.cert
    assert got_a.ca_bundle == due.ca_bundle  # renewed from the same CA
    patches = [m for m in secret_writes(kmock) if m != "POST"]
    assert patches == ["PATCH", "PATCH"]  # one refused with 409, then re-read
    final = stored(kmock, "v1/secrets", SECRET, NAMESPACE)
    assert final is not None and final["data"] == got_a.secret_data()


async def test_a_missing_configuration_or_unreadable_secret_is_not_fatal(
    kmock: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    declare(kmock)
    await kmock.post(
        f"/api/v1/namespaces/{NAMESPACE}/secrets",
        json={"metadata": {"name": SECRET}, "data": {"tls.crt": "bm90IGEgY2VydA=="}},
    )
    k = keeper(kmock, tmp_path, "a")
    try:
        with caplog.at_level("WARNING", logger="gpuslice.partitioner.webhook"):
            material = await k.sync()
    finally:
        await k.api.close()
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert f"Secret {SECRET}: the Secret has no 'ca.crt'" in messages
    assert f"MutatingWebhookConfiguration {CONFIGURATION} not found" in messages
    secret = stored(kmock, "v1/secrets", SECRET, NAMESPACE)
    assert secret is not None and secret["data"] == material.secret_data()
    assert k.ready.is_set() and k.ca_file.read_bytes() == material.ca_bundle


async def test_without_reservations_no_webhook_is_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """reservation=False: nothing would release a gated pod, so a hand-set webhook_enabled is
    ignored (the chart sets neither then): no gating handler, no admission server, a WARNING
    that says why; with reservations on the same settings serve it."""
    served_by = {}
    for reservation in (True, False):
        config = settings(tmp_path, 9443, reservation=reservation)
        controller = Controller(config, connection=kopf.ConnectionInfo(server="http://127.0.0.1:1"))
        try:
            with caplog.at_level("WARNING", logger="gpuslice.partitioner"):
                registry = build_registry(controller)
        finally:
            await controller.api.close()
        served_by[reservation] = (
            [h.id for h in registry._webhooks.get_all_handlers()],
            "admission-server" in {h.id for h in registry._activities.get_all_handlers()},
        )
    assert served_by == {True: (["slice-gate"], True), False: ([], False)}
    (warning,) = [r.getMessage() for r in caplog.records if "WEBHOOK_ENABLED" in r.getMessage()]
    assert "reservations are off" in warning


MWC_KIND = "MutatingWebhookConfiguration"


def owners(api: ApiServer) -> list[dict[str, Any]]:
    secret = stored(api, "v1/secrets", SECRET, NAMESPACE)
    assert secret is not None, f"Secret {SECRET} was not created"
    refs: list[dict[str, Any]] = secret["metadata"].get("ownerReferences") or []
    return refs


async def test_a_secret_created_before_its_configuration_is_owned_once_it_exists(
    kmock: ApiServer, tmp_path: Path
) -> None:
    """The partitioner may start before the MutatingWebhookConfiguration exists (helm creates
    the Deployment first; GitOps waves): the Secret, created without an owner, gets the
    configuration as owner at the next sync, so it is garbage-collected with it; an owner
    reference to an earlier configuration of that name is replaced, other owners are kept."""
    declare(kmock)
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "name": "keep", "uid": "cm-uid"}
    k = keeper(kmock, tmp_path, "a")
    try:
        material = await k.sync()  # no configuration yet
        assert owners(kmock) == []
        await kmock.patch(
            f"/api/v1/namespaces/{NAMESPACE}/secrets/{SECRET}",
            json={"metadata": {"ownerReferences": [foreign]}},
        )
        mwc = await (await kmock.post(MWC_PATH, json=configuration())).json()
        assert await k.sync() == material  # the same certificate, now owned
        want = (MWC_KIND, CONFIGURATION, mwc["metadata"]["uid"])
        refs = owners(kmock)
        assert [(r["kind"], r["name"], r["uid"]) for r in refs[1:]] == [want], (
            f"Secret {SECRET} is not owned by its {MWC_KIND} {CONFIGURATION}: {refs}"
        )
        assert refs[0] == foreign
        version = stored(kmock, "v1/secrets", SECRET, NAMESPACE)["metadata"]["resourceVersion"]
        await k.sync()  # owned already: nothing written
        assert stored(kmock, "v1/secrets", SECRET, NAMESPACE)["metadata"]["resourceVersion"] == (
            version
        )
        # The configuration deleted and created again (a new uid): the reference follows it.
        await kmock.delete(f"{MWC_PATH}/{CONFIGURATION}")
        again = await (await kmock.post(MWC_PATH, json=configuration())).json()
        assert again["metadata"]["uid"] != mwc["metadata"]["uid"]
        await k.sync()
        assert [(r["kind"], r["uid"]) for r in owners(kmock)] == [
            ("ConfigMap", "cm-uid"),
            (MWC_KIND, again["metadata"]["uid"]),
        ]
    finally:
        await k.api.close()


@pytest.mark.looptime
async def test_a_missing_configuration_is_checked_again_within_seconds(
    kmock: ApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While the configuration is missing, pods are created ungated (failurePolicy Ignore):
    the keeper looks again within seconds (backoff up to 30 s), not a check period (an hour)
    later, and sets the caBundle and the Secret's owner soon after the configuration appears.
    The absence is one WARNING, not one per retry."""
    declare(kmock)
    k = keeper(kmock, tmp_path, "a")
    assert k.check_seconds == 3600
    task = asyncio.create_task(k.run())
    try:
        with caplog.at_level("DEBUG", logger="gpuslice.partitioner.webhook"):
            await k.ready.wait()
            await asyncio.sleep(120)  # two minutes without a configuration
            mwc = await (await kmock.post(MWC_PATH, json=configuration())).json()
            started = asyncio.get_running_loop().time()
            await eventually(lambda: ca_bundle(kmock), within=60)
            took = asyncio.get_running_loop().time() - started
        assert took <= 31, f"caBundle of {CONFIGURATION} set {took:.0f}s after it was created"
        assert [r["uid"] for r in owners(kmock)] == [mwc["metadata"]["uid"]]
        missing = [r for r in caplog.records if "not found" in r.getMessage()]
        assert len(missing) > 2  # checked again and again...
        assert [r.levelname for r in missing].count("WARNING") == 1  # ...warned once
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await k.api.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"webhook_secret_name": "", "webhook_namespace": ""},
            "needs webhook_namespace, webhook_secret_name",
        ),
        ({"webhook_port": 8081, "health_port": 8081}, "webhook_port and health_port are both 8081"),
    ],
)
def test_webhook_settings_are_checked(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        settings(tmp_path, 9443, **overrides)
    assert not PartitionerSettings(webhook_secret_name="").webhook_enabled  # off: not checked
