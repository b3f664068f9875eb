"""The node agent's heartbeat Lease (node_agent/lease.py) and its wiring into ``gpuslice agent``.

Checked, against a fake ``CustomObjectsApi`` that records calls and fails on demand: the first
renewal creates the Lease on the patch's 404 with the contract's name, labels, holder, duration
and MicroTimes; later renewals merge-patch a later ``renewTime`` and keep ``acquireTime``; a
create that races another answers 409 and is renewed by a second patch; an API error, an
exception or a call that hangs is logged once per distinct error naming the Lease, never
raises, and the next renewal succeeds (and says so); ``run`` renews on schedule, stops promptly
when told to, and -- by design -- renews nothing while its event loop is blocked.  The name of
a node too long for ``gpuslice-agent-<node>`` is cut and hashed, stably.  The settings:
``lease_seconds`` defaults to 40, takes 0 (off) and >= 10, refuses 5.

Against kmock (tests/fake_apiserver.py, real HTTP through kubernetes_asyncio): the Lease is
created and renewed as a ``coordination.k8s.io/v1`` object, and both agent commands (the
device-plugin agent's ``_run_real`` and the DRA agent's ``_run_dra``, on the fake NVML) renew
it while they run, stop renewing on shutdown, and start no Lease task with ``lease_seconds`` 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fake_apiserver import LEASE_RESOURCE, ApiServer, declare, declare_dra, declare_leases, stored
from fake_kubelet import eventually
from kubernetes_asyncio.client.exceptions import ApiException

from node_agent.lease import (
    LEASE_LABELS,
    LEASE_SELECTOR,
    AgentLease,
    from_settings,
    lease_name,
    micro_time,
    parse_micro_time,
)
from node_agent.settings import AgentSettings

NODE, NS = "gpu-node-1", "gpu-system"
NAME = "gpuslice-agent-gpu-node-1"
MICRO_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


def api_error(status: int, message: str) -> ApiException:
    e = ApiException(status=status, reason="Error")
    e.body = json.dumps({"kind": "Status", "message": message}).encode()
    return e


class Clock:
    """Now, as the test sets it."""

    def __init__(self, now: datetime = T0) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class FakeLeaseApi:
    """The two CustomObjectsApi calls the Lease makes, over a dict of Leases.  ``fail``: errors
    the next calls raise, in order (before touching anything); ``hang``: calls never answer;
    ``before_create``: run at a create (to plant a racing Lease)."""

    def __init__(self) -> None:
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.fail: list[Exception] = []
        self.hang = False
        self.before_create: Callable[[], None] | None = None

    async def _enter(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.calls.append((method, args, kwargs))
        if self.hang:
            await asyncio.Event().wait()
        if self.fail:
            raise self.fail.pop(0)

    async def patch_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> Any:
        await self._enter("patch", args, kwargs)
        group, version, namespace, plural, name, body = args
        assert (group, version, plural) == ("coordination.k8s.io", "v1", "leases")
        lease = self.leases.get((namespace, name))
        if lease is None:
            raise api_error(404, f'leases.coordination.k8s.io "{name}" not found')
        lease["metadata"]["labels"] = {
            **lease["metadata"].get("labels", {}),
            **body["metadata"]["labels"],
        }
        lease["spec"].update(body["spec"])
        return lease

    async def create_namespaced_custom_object(self, *args: Any, **kwargs: Any) -> Any:
        await self._enter("create", args, kwargs)
        group, version, namespace, plural, body = args
        assert (group, version, plural) == ("coordination.k8s.io", "v1", "leases")
        if self.before_create is not None:
            self.before_create()
        key = (namespace, body["metadata"]["name"])
        if key in self.leases:
            raise api_error(409, "already exists")
        self.leases[key] = json.loads(json.dumps(body))
        return body

    def methods(self) -> list[str]:
        return [m for m, _, _ in self.calls]


@pytest.fixture
def fake() -> FakeLeaseApi:
    return FakeLeaseApi()


# -- renew: create, then patch -------------------------------------------------------------------


async def test_the_first_renewal_creates_the_lease_as_the_contract_says(fake: FakeLeaseApi) -> None:
    clock = Clock()
    lease = AgentLease(NODE, NS, api=fake, clock=clock)
    assert await lease.renew() is True
    assert fake.methods() == ["patch", "create"]  # 404 on the patch, then the create
    (_, args, _) = fake.calls[1]
    assert args[2] == NS
    body = args[4]
    assert (body["apiVersion"], body["kind"]) == ("coordination.k8s.io/v1", "Lease")
    assert body["metadata"] == {"name": NAME, "namespace": NS, "labels": dict(LEASE_LABELS)}
    assert body["metadata"]["labels"] == {
        "app.kubernetes.io/name": "gpuslice",
        "app.kubernetes.io/component": "agent-lease",
    }
    assert LEASE_SELECTOR == "app.kubernetes.io/component=agent-lease"
    spec = body["spec"]
    assert spec["holderIdentity"] == NODE
    assert spec["leaseDurationSeconds"] == 40 and isinstance(spec["leaseDurationSeconds"], int)
    assert MICRO_TIME.match(spec["renewTime"]), spec["renewTime"]
    assert parse_micro_time(spec["renewTime"]) == T0  # microseconds and UTC survive
    assert spec["acquireTime"] == spec["renewTime"]
    assert (lease.renewals, lease.failures) == (1, 0)


async def test_later_renewals_merge_patch_a_later_renew_time_and_keep_the_acquire_time(
    fake: FakeLeaseApi,
) -> None:
    clock = Clock()
    lease = AgentLease(NODE, NS, api=fake, clock=clock)
    assert await lease.renew()
    first = dict(fake.leases[(NS, NAME)]["spec"])
    clock.now = T0 + timedelta(seconds=10, microseconds=1)
    fake.calls.clear()
    assert await lease.renew()
    assert fake.methods() == ["patch"]
    (_, args, kwargs) = fake.calls[0]
    assert args[2] == NS and args[4] == NAME
    assert kwargs["_content_type"] == "application/merge-patch+json"
    assert "acquireTime" not in args[5]["spec"]
    spec = fake.leases[(NS, NAME)]["spec"]
    assert parse_micro_time(spec["renewTime"]) == T0 + timedelta(seconds=10, microseconds=1)
    assert parse_micro_time(spec["renewTime"]) > parse_micro_time(first["renewTime"])
    assert spec["acquireTime"] == first["acquireTime"]
    assert spec["holderIdentity"] == NODE and spec["leaseDurationSeconds"] == 40


async def test_a_lease_created_in_between_is_renewed_by_a_second_patch(fake: FakeLeaseApi) -> None:
    def plant() -> None:  # another agent process (a rollout) created it first
        fake.leases[(NS, NAME)] = {
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {"holderIdentity": NODE, "renewTime": micro_time(T0 - timedelta(seconds=1))},
        }

    fake.before_create = plant
    assert await AgentLease(NODE, NS, api=fake, clock=Clock()).renew()
    assert fake.methods() == ["patch", "create", "patch"]
    stored_lease = fake.leases[(NS, NAME)]
    assert parse_micro_time(stored_lease["spec"]["renewTime"]) == T0
    assert stored_lease["metadata"]["labels"] == dict(LEASE_LABELS)


async def test_the_duration_is_the_configured_seconds_rounded_up(fake: FakeLeaseApi) -> None:
    lease = AgentLease(NODE, NS, 60.5, api=fake, clock=Clock())
    assert lease.renew_seconds == 60.5 / 4
    assert await lease.renew()
    assert fake.leases[(NS, NAME)]["spec"]["leaseDurationSeconds"] == 61
    with pytest.raises(ValueError, match="renew_seconds"):
        AgentLease(NODE, NS, 40, 40, api=fake)
    with pytest.raises(ValueError, match="GPUSLICE_POD_NAMESPACE"):
        AgentLease(NODE, "", api=fake)


# -- failures ------------------------------------------------------------------------------------


def lease_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "gpuslice.agent.lease" and r.levelno == logging.WARNING
    ]


async def test_an_api_error_is_logged_once_never_raises_and_the_next_renewal_succeeds(
    fake: FakeLeaseApi, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="gpuslice.agent.lease")
    lease = AgentLease(NODE, NS, api=fake, clock=Clock())
    forbidden = 'leases.coordination.k8s.io "x" is forbidden: User cannot patch'
    fake.fail = [api_error(403, forbidden) for _ in range(3)]
    for _ in range(3):
        assert await lease.renew() is False
    (warning,) = lease_warnings(caplog)
    assert f"{NS}/{NAME}" in warning and "HTTP 403" in warning and forbidden in warning
    assert "\n" not in warning  # one line, not the exception's headers and body
    fake.fail = [RuntimeError("connection reset by peer")]  # another error: logged too
    assert await lease.renew() is False
    assert len(lease_warnings(caplog)) == 2
    assert "RuntimeError: connection reset by peer" in lease_warnings(caplog)[1]
    assert (lease.renewals, lease.failures) == (0, 4)

    assert await lease.renew() is True  # the API answers again
    assert (NS, NAME) in fake.leases
    assert any(
        r.levelno == logging.INFO and "renewed again" in r.getMessage() for r in caplog.records
    )
    fake.fail = [api_error(403, forbidden)]  # a new outage is logged again
    assert await lease.renew() is False
    assert len(lease_warnings(caplog)) == 3


async def test_a_call_that_hangs_is_bounded_and_logged(
    fake: FakeLeaseApi, caplog: pytest.LogCaptureFixture
) -> None:
    lease = AgentLease(NODE, NS, api=fake, clock=Clock(), request_timeout_s=0.05)
    fake.hang = True
    started = time.monotonic()
    assert await lease.renew() is False
    assert time.monotonic() - started < 2
    (warning,) = lease_warnings(caplog)
    assert "no answer within 0.05s" in warning and NAME in warning
    fake.hang = False
    assert await lease.renew() is True


async def test_no_cluster_to_connect_to_is_a_failed_renewal_not_an_exception(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import node_agent.agent as agent_module

    async def unusable() -> Any:
        raise RuntimeError("cannot connect to the Kubernetes API: not in a pod")

    monkeypatch.setattr(agent_module, "kube_api_client", unusable)
    assert await AgentLease(NODE, NS).renew() is False
    (warning,) = lease_warnings(caplog)
    assert "not in a pod" in warning


# -- run -----------------------------------------------------------------------------------------


@pytest.fixture
async def running() -> AsyncIterator[
    Callable[[AgentLease], tuple[asyncio.Event, asyncio.Task[None]]]
]:
    tasks: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    def start(lease: AgentLease) -> tuple[asyncio.Event, asyncio.Task[None]]:
        stop = asyncio.Event()
        tasks.append((stop, asyncio.create_task(lease.run(stop))))
        return tasks[-1]

    yield start
    for stop, task in tasks:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_run_renews_now_then_every_renew_seconds(
    fake: FakeLeaseApi, running: Callable[[AgentLease], tuple[asyncio.Event, asyncio.Task[None]]]
) -> None:
    lease = AgentLease(NODE, NS, 1.0, 0.05, api=fake)
    running(lease)
    await eventually(lambda: lease.renewals >= 1, timeout=1, what="the first renewal")
    await asyncio.sleep(0.4)
    assert 5 <= lease.renewals <= 10  # about one per 50 ms, no faster


async def test_run_stops_promptly_when_stop_is_set(
    fake: FakeLeaseApi, running: Callable[[AgentLease], tuple[asyncio.Event, asyncio.Task[None]]]
) -> None:
    lease = AgentLease(NODE, NS, 3600.0, api=fake)  # renewed every 900 s
    stop, task = running(lease)
    await eventually(lambda: lease.renewals == 1, timeout=1, what="the first renewal")
    stop.set()
    await asyncio.wait_for(asyncio.shield(task), 0.5)  # not at the next renewal, 900 s away
    assert lease.renewals == 1


async def test_a_blocked_event_loop_renews_nothing(
    fake: FakeLeaseApi, running: Callable[[AgentLease], tuple[asyncio.Event, asyncio.Task[None]]]
) -> None:
    """By design (module docstring): the renewal shares the agent's loop, so a hung NVML call
    made on it lets the Lease expire."""
    lease = AgentLease(NODE, NS, 1.0, 0.02, api=fake)
    running(lease)
    await eventually(lambda: lease.renewals >= 1, timeout=1, what="the first renewal")
    before = lease.renewals
    time.sleep(0.2)  # the point: a blocking call on the loop
    assert lease.renewals == before
    await eventually(lambda: lease.renewals > before, timeout=1, what="renewals again")


# -- the name ------------------------------------------------------------------------------------


def test_a_node_name_too_long_is_cut_and_hashed_stably() -> None:
    assert lease_name(NODE) == NAME
    fits = "n" * (253 - len("gpuslice-agent-"))
    assert lease_name(fits) == "gpuslice-agent-" + fits
    long = "a" * 226 + ".b" + "c" * 60  # a label boundary right at the cut
    other = "a" * 226 + ".b" + "d" * 60
    name = lease_name(long)
    assert len(name) == 253 - 1  # the trailing "." of the cut is dropped
    assert name.startswith("gpuslice-agent-" + "a" * 226 + "-")
    assert DNS_SUBDOMAIN.match(name), name
    assert name == lease_name(long)  # stable
    assert lease_name(other) != name and len(lease_name(other)) == len(name)
    assert len(lease_name("x" * 253)) == 253 and DNS_SUBDOMAIN.match(lease_name("x" * 253))


# -- settings ------------------------------------------------------------------------------------


def make_settings(**fields: Any) -> AgentSettings:
    """Settings from the environment and ``fields`` (the rest from GPUSLICE_* or defaults)."""
    return AgentSettings(**fields)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [n for n in os.environ if n.startswith("GPUSLICE_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_lease_seconds_defaults_to_40_takes_0_and_at_least_10(
    clean_env: pytest.MonkeyPatch,
) -> None:
    assert make_settings().lease_seconds == 40
    for ok in ("0", "10", "90.5"):
        clean_env.setenv("GPUSLICE_LEASE_SECONDS", ok)
        assert make_settings().lease_seconds == float(ok)
    for bad in ("5", "9.9", "-1"):
        clean_env.setenv("GPUSLICE_LEASE_SECONDS", bad)
        with pytest.raises(ValueError, match="lease_seconds"):
            make_settings()


def test_the_lease_from_settings(
    clean_env: pytest.MonkeyPatch, fake: FakeLeaseApi, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpuslice.agent.lease")
    lease = from_settings(make_settings(node_name=NODE, pod_namespace=NS), fake)
    assert lease is not None
    assert (lease.name, lease.namespace, lease.node) == (NAME, NS, NODE)
    assert (lease.duration_seconds, lease.renew_seconds) == (40, 10)
    off = make_settings(node_name=NODE, pod_namespace=NS, lease_seconds=0)
    assert from_settings(off, fake) is None
    assert lease_warnings(caplog) == []  # 0 is a choice: not a warning
    assert from_settings(make_settings(node_name=NODE), fake) is None
    (warning,) = lease_warnings(caplog)
    assert "GPUSLICE_POD_NAMESPACE" in warning


# -- against kmock: the Lease, and both agent commands -----------------------------------------


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


def kube_client(api: ApiServer) -> Any:
    from kubernetes_asyncio import client

    return client.ApiClient(client.Configuration(host=str(api.url).rstrip("/")))


async def test_the_lease_through_the_real_client(kmock: ApiServer) -> None:
    from kubernetes_asyncio import client

    declare(kmock)
    declare_leases(kmock)
    clock = Clock()
    async with kube_client(kmock) as api_client:
        lease = AgentLease(NODE, NS, api=client.CustomObjectsApi(api_client), clock=clock)
        assert await lease.renew()
        obj = stored(kmock, LEASE_RESOURCE, NAME, NS)
        assert obj is not None
        assert obj["metadata"]["labels"] == dict(LEASE_LABELS)
        assert obj["spec"]["holderIdentity"] == NODE
        clock.now = T0 + timedelta(seconds=10)
        assert await lease.renew()
        obj = stored(kmock, LEASE_RESOURCE, NAME, NS)
        assert obj is not None
        assert parse_micro_time(obj["spec"]["renewTime"]) == T0 + timedelta(seconds=10)
        assert parse_micro_time(obj["spec"]["acquireTime"]) == T0


def lease_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("heartbeat Lease")]


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A short directory: unix socket paths are limited to about 100 bytes."""
    with tempfile.TemporaryDirectory(prefix="gslease-", dir="/tmp") as tmp:
        yield tmp


async def run_command(
    kmock: ApiServer,
    monkeypatch: pytest.MonkeyPatch,
    run: Callable[[Callable[[], asyncio.Event]], Any],
    lease_seconds: float,
) -> list[AgentLease]:
    """Run an agent command until its main loop runs (and, with a Lease, until the Lease is in
    kmock), then stop it as SIGTERM would; the Leases whose ``run`` it started."""
    from gpuslice.commands import agent as agent_cmd

    started: list[AgentLease] = []
    original = AgentLease.run

    async def spied(self: AgentLease, stop: asyncio.Event) -> None:
        started.append(self)
        await original(self, stop)

    monkeypatch.setattr(AgentLease, "run", spied)
    stop, looping = asyncio.Event(), asyncio.Event()

    def stop_on_signals() -> asyncio.Event:
        looping.set()
        return stop

    monkeypatch.setattr(agent_cmd, "_stop_on_signals", stop_on_signals)
    task = asyncio.create_task(run(stop_on_signals))
    try:
        await eventually(looping.is_set, timeout=20, what="the agent's main loop")
        if lease_seconds:
            await eventually(
                lambda: stored(kmock, LEASE_RESOURCE, NAME, NS) is not None,
                timeout=10,
                what="the Lease",
            )
            assert len(lease_tasks()) == 1
        else:
            await asyncio.sleep(0.3)  # time a Lease task would have had to renew
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0
    assert lease_tasks() == []  # stopped with the agent
    return started


def agent_settings(tmp: str, lease_seconds: float, **kw: Any) -> AgentSettings:
    return make_settings(
        node_name=NODE,
        pod_namespace=NS,
        lease_seconds=lease_seconds,
        metrics_port=0,
        state_dir="",
        xid_watch=False,
        **kw,
    )


@pytest.mark.parametrize("lease_seconds", [40.0, 0.0], ids=["lease", "no lease"])
async def test_the_device_plugin_agent_renews_its_lease_while_it_runs(
    kmock: ApiServer,
    monkeypatch: pytest.MonkeyPatch,
    clean_env: pytest.MonkeyPatch,
    short_tmp: str,
    lease_seconds: float,
) -> None:
    import node_agent.agent
    import node_agent.mps
    import node_agent.nvml_pynvml
    import node_agent.podresources
    from gpuslice.commands import agent as agent_cmd
    from node_agent.mps import FakeSupervisor
    from node_agent.nvml_fake import FakeNvml
    from planner.catalog import default_catalog

    declare(kmock)
    declare_leases(kmock)
    catalog = default_catalog()

    async def kmock_client() -> Any:
        return kube_client(kmock)

    monkeypatch.setattr(node_agent.agent, "kube_api_client", kmock_client)
    monkeypatch.setattr(
        node_agent.nvml_pynvml,
        "PynvmlAdapter",
        lambda smi=None, **_: FakeNvml([catalog.model("A100-SXM4-80GB")]),
    )
    monkeypatch.setattr(node_agent.mps, "MpsControlSupervisor", FakeSupervisor)
    monkeypatch.setattr(
        node_agent.podresources, "PodResourcesClient", lambda *a, **k: agent_cmd._NoPods()
    )
    settings = agent_settings(short_tmp, lease_seconds, device_plugin_dir=short_tmp)
    args = argparse.Namespace(once=False, output="table")
    started = await run_command(
        kmock, monkeypatch, lambda _: agent_cmd._run_real(args, settings, catalog), lease_seconds
    )
    if lease_seconds:
        (lease,) = started
        assert (lease.name, lease.namespace, lease.renewals) == (NAME, NS, 1)
        obj = stored(kmock, LEASE_RESOURCE, NAME, NS)
        assert obj is not None and obj["spec"]["holderIdentity"] == NODE
        assert obj["spec"]["leaseDurationSeconds"] == 40
    else:
        assert started == []
        assert stored(kmock, LEASE_RESOURCE, NAME, NS) is None


@pytest.mark.parametrize("lease_seconds", [40.0, 0.0], ids=["lease", "no lease"])
async def test_the_dra_agent_renews_its_lease_while_it_runs(
    kmock: ApiServer,
    monkeypatch: pytest.MonkeyPatch,
    clean_env: pytest.MonkeyPatch,
    short_tmp: str,
    lease_seconds: float,
) -> None:
    import kubernetes_asyncio.config

    import node_agent.nvml_pynvml
    from gpuslice.commands import agent as agent_cmd
    from node_agent.nvml_fake import FakeNvml
    from planner.catalog import default_catalog

    declare(kmock)
    declare_dra(kmock)
    declare_leases(kmock)
    resp = await kmock.post(
        "/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}
    )
    assert resp.status in (200, 201), await resp.text()
    catalog = default_catalog()

    def in_cluster(client_configuration: Any) -> None:
        client_configuration.host = str(kmock.url).rstrip("/")

    monkeypatch.setattr(kubernetes_asyncio.config, "load_incluster_config", in_cluster)
    monkeypatch.setattr(
        node_agent.nvml_pynvml,
        "PynvmlAdapter",
        lambda smi=None, **_: FakeNvml([catalog.model("H100-80GB")]),
    )
    settings = agent_settings(
        short_tmp,
        lease_seconds,
        dra=True,
        dra_registry_dir=os.path.join(short_tmp, "r"),
        dra_plugin_dir=os.path.join(short_tmp, "p"),
        cdi_dir=os.path.join(short_tmp, "cdi"),
    )
    started = await run_command(
        kmock, monkeypatch, lambda _: agent_cmd._run_dra(settings, catalog, "all"), lease_seconds
    )
    if lease_seconds:
        (lease,) = started
        assert (lease.name, lease.namespace) == (NAME, NS)
        obj = stored(kmock, LEASE_RESOURCE, NAME, NS)
        assert obj is not None and obj["spec"]["holderIdentity"] == NODE
    else:
        assert started == []
        assert stored(kmock, LEASE_RESOURCE, NAME, NS) is None
