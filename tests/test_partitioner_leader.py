"""Leader election (partitioner/leader.py) against the fake API server, in looptime's fake time.

Each candidate talks to the fake API server (``tests/fake_apiserver.py``: Leases with
resourceVersion conflicts, every accepted write recorded with its author and loop time) with
its own bearer token, so every write is attributed.  Durations are client-go's defaults (lease
15 s, renew deadline 10 s, retry 2 s, jitter 0.2); failover times are measured in loop time and
printed (``-s`` shows them).  The last tests run two real kopf operators (partitioner/operator.py)
side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from fake_apiserver import (
    LEASE_RESOURCE,
    NP_PATH,
    NP_RESOURCE,
    ApiServer,
    Write,
    declare,
    declare_leases,
    stored,
)
from test_partitioner_operator import A100, create, eventually, node, pod, settings

from partitioner.kubeapi import Endpoint, KubeApi
from partitioner.leader import ElectionConfig, FencedApi, LeaderElector, NotLeader, micro_time
from partitioner.operator import Controller, run_operator
from partitioner.settings import PartitionerSettings

NAMESPACE, LEASE = "default", "gpuslice-partitioner"
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{LEASE}"
DURATION, RENEW, RETRY, JITTER = 15, 10.0, 2.0, 0.2
FAILOVER_BOUND = DURATION + RETRY * (1 + JITTER) + 0.5  # lease + one jittered retry + slack
PODS = "/api/v1/namespaces/default/pods"
ONE_G = "nvidia.com/mig-1g.10gb"


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


def client(api: ApiServer, who: str) -> KubeApi:
    endpoint = Endpoint(str(api.url).rstrip("/"), {"Authorization": f"Bearer {who}"})
    return KubeApi(lambda: endpoint)


def candidate(api: ApiServer, who: str, **config: Any) -> LeaderElector:
    loop = asyncio.get_running_loop()
    cfg = ElectionConfig(NAMESPACE, LEASE, who, **config)
    return LeaderElector(client(api, who), cfg, monotonic=loop.time, wall=loop.time)


def lease(api: ApiServer) -> dict[str, Any]:
    obj = stored(api, LEASE_RESOURCE, LEASE, NAMESPACE)
    assert obj is not None
    return obj


def lease_writes(api: ApiServer, who: str) -> list[Write]:
    return [w for w in api.writes if w.author == who and "/leases" in w.path]


def other_writes(api: ApiServer, who: str) -> list[Write]:
    return [w for w in api.writes if w.author == who and "/leases" not in w.path]


def epoch(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


@contextlib.asynccontextmanager
async def running(*electors: LeaderElector) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(e.run()) for e in electors]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for e in electors:
            await e.api.close()


def test_config_refuses_a_deadline_the_lease_could_outlive() -> None:
    with pytest.raises(ValueError, match=r"renew deadline \(15s\) < lease duration \(15s\)"):
        ElectionConfig(NAMESPACE, LEASE, "a", lease_duration_s=15, renew_deadline_s=15)
    with pytest.raises(ValueError, match="needs an identity"):
        ElectionConfig(NAMESPACE, LEASE, "")
    with pytest.raises(ValueError, match="leader_election_namespace"):
        PartitionerSettings(leader_election_enabled=True)
    with pytest.raises(ValueError, match=r"retry_period_seconds \(12\) < .*renew_deadline"):
        PartitionerSettings(
            leader_election_enabled=True,
            leader_election_namespace=NAMESPACE,
            leader_election_retry_period_seconds=12,
        )
    assert micro_time(0.5) == "1970-01-01T00:00:00.500000Z"


@pytest.mark.looptime
async def test_two_candidates_never_lead_at_once_and_the_lease_says_who(kmock: ApiServer) -> None:
    declare(kmock)
    declare_leases(kmock)
    a, b = candidate(kmock, "a"), candidate(kmock, "b")
    loop = asyncio.get_running_loop()
    async with running(a, b):
        leaders = await eventually(lambda: [e for e in (a, b) if e.is_leader()], within=5, step=0.1)
        start = loop.time()
        while loop.time() - start < 120:
            assert not (a.is_leader() and b.is_leader())
            assert a.is_leader() or b.is_leader()  # the leader renews: no gap while it is well
            await asyncio.sleep(0.1)
        (leader,) = leaders
        follower = b if leader is a else a
        spec = lease(kmock)["spec"]
        assert spec["holderIdentity"] == leader.config.identity
        assert spec["leaseDurationSeconds"] == DURATION
        assert spec["leaseTransitions"] == 0
        renewed, acquired = epoch(spec["renewTime"]), epoch(spec["acquireTime"])
        assert acquired <= start and loop.time() - RETRY * 1.5 <= renewed <= loop.time()
        assert follower.holder == leader.config.identity
        assert lease_writes(kmock, follower.config.identity) == []  # it only reads
        assert len(lease_writes(kmock, leader.config.identity)) >= 120 / RETRY - 1


@pytest.mark.looptime
async def test_two_candidates_racing_for_an_expired_lease_one_wins(kmock: ApiServer) -> None:
    declare(kmock)
    declare_leases(kmock)
    old = candidate(kmock, "old")
    assert await old.try_acquire_or_renew()
    a, b = candidate(kmock, "a"), candidate(kmock, "b")
    assert not await a.try_acquire_or_renew()  # held and live
    assert not await b.try_acquire_or_renew()
    await asyncio.sleep(DURATION + 0.1)  # "old" never renewed: expired for both
    results = await asyncio.gather(a.try_acquire_or_renew(), b.try_acquire_or_renew())
    assert sorted(results) == [False, True]
    winner = a if results[0] else b
    assert lease(kmock)["spec"]["holderIdentity"] == winner.config.identity
    assert lease(kmock)["spec"]["leaseTransitions"] == 1
    # both read the same resourceVersion and both sent a PUT: the server took exactly one
    assert len(lease_writes(kmock, "a")) + len(lease_writes(kmock, "b")) == 1
    assert not (a.is_leader() and b.is_leader())
    for e in (old, a, b):
        await e.api.close()


@pytest.mark.looptime
async def test_cut_off_leader_is_replaced_and_writes_nothing_after(kmock: ApiServer) -> None:
    """The leader loses the Lease alone (its renewals hang) but could still write: the fence
    stops it at its renew deadline, before the follower may acquire."""
    declare(kmock)
    declare_leases(kmock)
    loop = asyncio.get_running_loop()
    a = candidate(kmock, "a")
    async with running(a):
        await eventually(a.is_leader, within=5, step=0.1)
    b = candidate(kmock, "b")
    a_writes = FencedApi(a.api._endpoint, a.fence)
    refused: list[float] = []

    async def keep_writing() -> None:  # what a leader's decision loop would do
        n = 0
        while True:
            n += 1
            event = {"metadata": {"name": f"w{n}", "namespace": NAMESPACE}, "reason": "Test"}
            try:
                await a_writes.create(f"/api/v1/namespaces/{NAMESPACE}/events", event)
            except NotLeader:
                refused.append(loop.time())
            await asyncio.sleep(0.2)

    async with running(a, b):
        await asyncio.sleep(7)  # b follows
        assert a.is_leader() and not b.is_leader()
        writer = asyncio.create_task(keep_writing())
        await asyncio.sleep(3)
        cut = loop.time()
        kmock.lease_outage.add("a")
        await eventually(b.is_leader, within=40, step=0.05)
        acquired = next(w.at for w in lease_writes(kmock, "b"))
        failover = acquired - cut
        renewed = max(w.at for w in lease_writes(kmock, "a"))  # its last renewal, before the cut
        print(
            f"\nfailover after the leader was cut off from its Lease: {failover:.2f}s "
            f"({acquired - renewed:.2f}s after its last renewal)"
        )
        assert failover <= FAILOVER_BOUND
        assert DURATION <= acquired - renewed <= FAILOVER_BOUND  # never before the lease expired
        last_a = max(w.at for w in other_writes(kmock, "a"))
        assert last_a < cut + RENEW  # stopped by its deadline (last renewal <= cut)
        assert last_a < acquired - (DURATION - RENEW) + RETRY  # well before b took over
        assert refused and min(refused) <= cut + RENEW + 0.3
        assert not a.is_leader()
        kmock.lease_outage.discard("a")
        await asyncio.sleep(10)  # a reconnects: it sees b's live lease and follows
        assert b.is_leader() and not a.is_leader() and a.holder == "b"
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
    await a_writes.close()
    assert not [w for w in other_writes(kmock, "a") if w.at >= acquired]
    spec = lease(kmock)["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)


@pytest.mark.looptime
async def test_released_lease_is_taken_within_a_retry_period(kmock: ApiServer) -> None:
    declare(kmock)
    declare_leases(kmock)
    loop = asyncio.get_running_loop()
    a, b = candidate(kmock, "a"), candidate(kmock, "b")
    async with running(a):
        await eventually(a.is_leader, within=5, step=0.1)
    a_task = asyncio.create_task(a.run())  # still leading: the loop renews
    async with running(b):
        await asyncio.sleep(5)
        assert b.holder == "a" and a.is_leader()
        a_task.cancel()  # shutting down: the loop stops first, then the Lease is given up
        await asyncio.gather(a_task, return_exceptions=True)
        released = loop.time()
        assert await a.release()
        assert not a.is_leader()
        assert "holderIdentity" not in lease(kmock)["spec"]
        await eventually(b.is_leader, within=RETRY * (1 + JITTER) + 0.5, step=0.05)
        print(f"\nhandover after a release: {loop.time() - released:.2f}s")
        spec = lease(kmock)["spec"]
        assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
        assert not await a.try_acquire_or_renew()  # a released elector never takes it again
    await a.api.close()


# -- two real operators ------------------------------------------------------------------------
def replica_settings(who: str) -> PartitionerSettings:
    base = settings(batch_idle_seconds=2, batch_timeout_seconds=5).model_dump()
    return PartitionerSettings(
        **base
        | {
            "leader_election_enabled": True,
            "leader_election_namespace": NAMESPACE,
            "leader_election_identity": who,
        }
    )


@contextlib.asynccontextmanager
async def replica(api: ApiServer, who: str) -> AsyncIterator[Controller]:
    info = kopf.ConnectionInfo(server=str(api.url).rstrip("/"), token=who)
    loop = asyncio.get_running_loop()
    controller = Controller(
        replica_settings(who), connection=info, clock=loop.time, monotonic=loop.time
    )
    stop = asyncio.Event()
    task = asyncio.create_task(run_operator(controller, stop_flag=stop))
    try:
        await eventually(lambda: controller.health.readiness().ok, within=30, step=0.1)
        yield controller
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)
    assert task.exception() is None


def gauge(c: Controller) -> float | None:
    return c.metrics.registry.get_sample_value("gpuslice_leader")


def partitionings(api: ApiServer) -> dict[str, dict[str, Any]]:
    out = {}
    for name in ("n1", "n2"):
        obj = stored(api, NP_RESOURCE, name)
        if obj is not None:
            out[name] = obj
    return out


def plan_ids(api: ApiServer) -> set[str]:
    return {np["spec"]["planId"] for np in partitionings(api).values()} - {""}


@pytest.mark.looptime
async def test_only_the_leader_plans_and_a_cut_off_one_is_replaced(kmock: ApiServer) -> None:
    declare(kmock)
    declare_leases(kmock)
    for name in ("n1", "n2"):
        await create(
            kmock, "/api/v1/nodes", node(name, {"gpuslice.io/partitioning": "mig", **A100})
        )
    loop = asyncio.get_running_loop()
    async with replica(kmock, "a") as a:
        await eventually(a.leading, within=10, step=0.1)
        async with replica(kmock, "b") as b:
            await asyncio.sleep(5)
            assert a.leading() and not b.leading()
            for c, leads in ((a, True), (b, False)):  # both ready; the body says who leads
                ready = c.health.readiness()
                assert ready.ok and (ready.leader, ready.holder) == (leads, "a")
                assert ready.as_json()["leader"] is leads
                assert c.health.liveness().ok
                assert gauge(c) == (1.0 if leads else 0.0)
            await create(kmock, PODS, pod("p1", ONE_G))
            await eventually(lambda: plan_ids(kmock) == {"1"}, within=15)
            assert other_writes(kmock, "a")  # the leader planned and wrote
            assert "default/p1" in b.index.pods  # the follower's cache is warm...
            assert not [w for w in kmock.writes if w.author == "b"]  # ...and it wrote nothing

            cut = loop.time()
            kmock.lease_outage.add("a")  # the leader is cut off from its Lease
            await asyncio.sleep(RENEW - RETRY)
            # a new pod arrives while "a" is about to lose the lead: only "b" may plan it
            await create(kmock, PODS, pod("p2", ONE_G))
            await eventually(b.leading, within=30, step=0.05)
            acquired = next(w.at for w in lease_writes(kmock, "b"))
            failover = acquired - cut
            print(f"\noperator failover (leader cut off from its Lease): {failover:.2f}s")
            assert failover <= FAILOVER_BOUND
            assert not a.leading()
            assert (a.health.readiness().leader, b.health.readiness().leader) == (False, True)
            assert (gauge(a), gauge(b)) == (0.0, 1.0)
            await eventually(lambda: plan_ids(kmock) == {"1", "2"}, within=20)
            kmock.lease_outage.discard("a")
            await asyncio.sleep(10)
            assert b.leading() and not a.leading()
            # the waiting gauges are the leader's: a deposed one exported its last step's
            # (sums over the replicas doubled, alerts kept firing after the cause was gone)
            pending = "gpuslice_pending_pods"
            assert (b.metrics.registry.get_sample_value(pending) or 0) >= 1
            assert a.metrics.registry.get_sample_value(pending) == 0.0
            assert a.health.liveness().ok and a.health.readiness().ok  # a healthy follower
            assert a.health.readiness().holder == "b"
            # the deposed leader made no write after the new one acquired the Lease
            assert not [w for w in other_writes(kmock, "a") if w.at >= acquired]
            assert max(w.at for w in other_writes(kmock, "a")) < cut + RENEW
            plan2 = [n for n, np in partitionings(kmock).items() if np["spec"]["planId"] == "2"]
            (node2,) = plan2
            spec_writers = {
                w.author
                for w in kmock.writes
                if w.path == f"{NP_PATH}/{node2}" and w.method == "PATCH" and w.at > cut
            }
            assert spec_writers == {"b"}
            stopping = loop.time()
        # "b" shut down: it stopped its loop, then released the Lease; "a" takes over at once
        await eventually(a.leading, within=RETRY * (1 + JITTER) + 0.5, step=0.05)
        released = [w for w in lease_writes(kmock, "b") if w.at >= stopping]
        assert len(released) == 1  # the release, then nothing more from "b"
        retaken = next(w.at for w in lease_writes(kmock, "a") if w.at >= released[0].at)
        handover = retaken - released[0].at
        print(f"operator handover after the leader shut down and released: {handover:.2f}s")
        assert handover <= RETRY * (1 + JITTER) + 0.5
        spec = lease(kmock)["spec"]
        assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("a", 2)
        assert not [w for w in kmock.writes if w.author == "b" and w.at > released[0].at]


@pytest.mark.looptime
async def test_a_write_in_flight_at_the_deadline_is_cancelled(kmock: ApiServer) -> None:
    declare(kmock)
    declare_leases(kmock)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3

    def fence() -> float:
        left = deadline - loop.time()
        if left <= 0:
            raise NotLeader("past the deadline")
        return left

    slow = FencedApi(client(kmock, "slow")._endpoint, fence)
    kmock.lease_outage.add("slow")  # its requests to the Lease hang
    body = {"metadata": {"name": LEASE, "namespace": NAMESPACE}, "spec": {}}
    collection = LEASE_PATH.rsplit("/", 1)[0]
    started = loop.time()
    with pytest.raises(NotLeader, match="leadership ended in flight"):
        await slow.create(collection, body)
    assert loop.time() - started == pytest.approx(3, abs=0.01)  # cancelled at the deadline
    kmock.lease_outage.discard("slow")
    with pytest.raises(NotLeader, match="past the deadline"):
        await slow.create(f"/api/v1/namespaces/{NAMESPACE}/events", {"metadata": {"name": "e"}})
    sent = [r for r in list(kmock) if r.headers.get("Authorization") == "Bearer slow"]
    assert len(sent) == 1  # the refused write never reached the API server
    assert await slow.request("GET", collection)  # reads are not fenced
    await slow.close()
    await asyncio.sleep(0.5)  # the server answers the abandoned request
    assert kmock.writes == []


@pytest.mark.looptime
async def test_a_lease_outage_logs_one_warning_and_one_recovery_line(
    kmock: ApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Attempts during an outage of the Lease (refused, unreachable or hanging) are not one
    WARNING each: one when it starts, one INFO when the Lease answers again."""
    declare(kmock)
    declare_leases(kmock)
    caplog.set_level(logging.INFO, logger="gpuslice.partitioner.leader")
    a = candidate(kmock, "a")
    async with running(a):
        await eventually(a.is_leader, within=5, step=0.1)
        kmock.lease_outage.add("a")  # its Lease requests hang, then answer 503
        await asyncio.sleep(60)  # many retry periods
        kmock.lease_outage.discard("a")
        await eventually(a.is_leader, within=30, step=0.1)
    lines = [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "gpuslice.partitioner.leader"
    ]
    failed = [m for lvl, m in lines if lvl == logging.WARNING and "attempt failed" in m]
    back = [m for lvl, m in lines if lvl == logging.INFO and "reachable again" in m]
    assert len(failed) == 1, lines
    assert back == [f"Lease {NAMESPACE}/{LEASE} reachable again"]


@pytest.mark.looptime
async def test_renewals_and_the_release_keep_the_leases_labels_annotations_and_other_fields(
    kmock: ApiServer,
) -> None:
    """A Lease update replaces the whole object: a body built from scratch wiped the labels,
    annotations and owner references an admin or a GitOps tool put there, and the spec fields
    the election does not own (strategy, preferredHolder), at every renewal.  Kept now, as
    client-go's LeaseLock keeps them, through a renewal and the release."""
    declare(kmock)
    declare_leases(kmock)
    collection = LEASE_PATH.rsplit("/", 1)[0]
    labels = {"app.kubernetes.io/part-of": "gpuslice", "team": "infra"}
    annotations = {"argocd.argoproj.io/tracking-id": "x"}
    await create(kmock, collection, {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": LEASE, "namespace": NAMESPACE, "labels": labels,
                     "annotations": annotations},
        "spec": {"strategy": "OldestEmulationVersion"},
    })  # fmt: skip
    a = candidate(kmock, "a")
    try:
        assert await a.try_acquire_or_renew()
        assert await a.try_acquire_or_renew()  # a renewal
        puts = [r.data for r in list(kmock) if r.method == "PUT" and "/leases/" in str(r.url)]
        assert len(puts) == 2
        for body in puts:
            assert body["metadata"]["labels"] == labels
            assert body["metadata"]["annotations"] == annotations
            assert body["spec"]["strategy"] == "OldestEmulationVersion"
            assert body["spec"]["holderIdentity"] == "a"
        assert await a.release()
        (last,) = [r.data for r in list(kmock) if r.method == "PUT" and "/leases/" in str(r.url)][
            2:
        ]
        assert last["metadata"]["labels"] == labels and "holderIdentity" not in last["spec"]
        assert last["spec"]["strategy"] == "OldestEmulationVersion"
    finally:
        await a.api.close()


async def test_a_lead_lost_and_regained_between_two_cycles_starts_from_a_fresh_state() -> None:
    """A cycle can block longer than the Lease (an API outage, a long plan); meanwhile another
    replica may lead, plan and hand the Lease back.  The replica then leads at both of its
    cycles, but in a new term: its decision state (plans, windows, Events told) is another
    term's and is dropped, as after a restart.  A renewal within one term keeps it."""
    from partitioner.decide import ControllerState

    class Elector:
        def __init__(self) -> None:
            self.term = 1

        def is_leader(self) -> bool:
            return True

    c = Controller(settings(), connection=kopf.ConnectionInfo(server="http://127.0.0.1:9"))
    c.elector = Elector()  # type: ignore[assignment]
    steps: list[ControllerState] = []

    async def step(now: float | None = None) -> Any:
        steps.append(c.state)

    async def no_leases() -> None:
        return None

    c.step = step  # type: ignore[method-assign]
    c._poll_leases = no_leases  # type: ignore[method-assign]
    await c._cycle()
    c.state = first = ControllerState(last_plan_id=7)  # what term 1's steps decided
    await c._cycle()  # a renewal: same term, the state stays
    assert steps[-1] is first
    c.elector.term = 2  # lost and regained while a cycle blocked
    await c._cycle()
    assert steps[-1] is not first and steps[-1].last_plan_id == 0


def test_a_steps_writes_are_fenced_by_the_term_it_began_in() -> None:
    """A step computed in one term must not write in the next (a lead lost and regained while
    it ran): Events and node conditions carry no resourceVersion for the API server to refuse
    them with.  The fence allows the elector's time left only within the step's term."""

    class Elector:
        term = 3

        def fence(self) -> float:
            return 4.5

    c = Controller(settings(), connection=kopf.ConnectionInfo(server="http://127.0.0.1:9"))
    c.elector = Elector()  # type: ignore[assignment]
    c._step_term = 3
    assert c._fence() == 4.5
    c.elector.term = 4
    with pytest.raises(NotLeader, match="term 3"):
        c._fence()
