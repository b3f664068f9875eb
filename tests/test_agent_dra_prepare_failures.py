"""The DRA agent reports the claims whose prepare fails (node_agent.dra_failures).

The kubelet retries a failed ``NodePrepareResources`` and the pod waits in
``ContainerCreating``; nothing else in the cluster learned of it, so a pod gpuslice had promised
a slice waited for ever.  Checked:

* :class:`~node_agent.dra_failures.PrepareFailures` keeps the newest failure per claim with the
  time of its first, drops it when a prepare succeeds, when the claim is unprepared, when its
  devices are no longer allocated here and when no prepare repeated it for five minutes; lists
  the oldest first, at most the contract's maximum, with long messages cut;
* the kubelet plugin records every failure (a device an XID hit, a claim not allocated yet)
  and forgets it when a retry succeeds;
* shaped publishing writes them into the NodePartitioning status (``prepareFailures``, against
  kmock) and removes the field once none is left (a merge patch sends ``null``: leaving it out
  would keep the stored list).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fake_apiserver import ApiServer

from contract.nodepartitioning import (
    MAX_FAILURE_MESSAGE,
    MAX_PREPARE_FAILURES,
    NodePartitioningStatus,
    PrepareFailure,
)
from node_agent.dra_claims import ClaimRef
from node_agent.dra_failures import STALE_AFTER_S, PrepareFailures
from node_agent.dra_slices import DRIVER
from node_agent.metrics import AgentMetrics
from node_agent.nvml import XidEvent
from node_agent.nvml_fake import FakeNvml
from node_agent.proto import dra_v1_pb2 as dra
from tests import test_agent_draplugin
from tests.test_agent_dra_shaped import (
    H100,
    drop_claim,
    kmock_options,  # noqa: F401  (the fixture: kmock serves tests/fake_apiserver.ApiServer)
    np_of,
    p,
    put_claim,
    put_np,
    round_ok,
    setup,
    spec,
)
from tests.test_agent_draplugin import Node, placement

dirs = test_agent_draplugin.dirs
node = test_agent_draplugin.node
"""The kubelet-plugin fixtures: a plugin on two H100s behind a fake kubelet (gRPC)."""


def ref(name: str, ns: str = "team") -> ClaimRef:
    return ClaimRef(ns, name, f"uid-{name}")


# -- the record ---------------------------------------------------------------------------------


def test_the_newest_failure_is_kept_with_the_time_of_the_first() -> None:
    f = PrepareFailures()
    f.failed(ref("a"), ["gpu0"], "first", now=10.0, wall="2026-12-06T10:00:00Z")
    f.failed(ref("a"), ["gpu0"], "second", now=20.0, wall="2026-12-06T10:00:10Z")
    assert f.report({"gpu0"}, now=21.0) == [
        PrepareFailure(claim="team/a", uid="uid-a", message="second", since="2026-12-06T10:00:00Z")
    ]
    f.succeeded("uid-a")
    assert f.report({"gpu0"}, now=22.0) == [] and len(f) == 0
    f.failed(ref("a"), ["gpu0"], "third", now=30.0, wall="2026-12-06T10:00:30Z")
    assert f.report({"gpu0"}, now=31.0)[0].since == "2026-12-06T10:00:30Z"  # a new wait
    f.forget("uid-a")
    assert f.report({"gpu0"}, now=32.0) == []


def test_a_claim_no_longer_allocated_here_or_not_asked_for_lately_is_dropped() -> None:
    f = PrepareFailures()
    f.failed(ref("moved"), ["gpu0", "gpu1"], "m", now=0.0, wall="t0")
    f.failed(ref("unread"), [], "cannot read it from the API", now=0.0, wall="t0")
    f.failed(ref("kept"), ["gpu1"], "k", now=0.0, wall="t1")
    # gpu0 is no longer allocated: the claim was deallocated (its pod deleted); a claim whose
    # devices could not be read stays until it goes stale
    assert [x.claim for x in f.report({"gpu1"}, now=1.0)] == ["team/unread", "team/kept"]
    f.failed(ref("kept"), ["gpu1"], "k", now=STALE_AFTER_S, wall="t2")
    assert [x.claim for x in f.report({"gpu1"}, now=STALE_AFTER_S + 1)] == ["team/kept"]
    assert f.report({"gpu1"}, now=2 * STALE_AFTER_S + 1) == []
    # publishing every placement lists no claims: allocation unknown, only staleness drops
    f.failed(ref("any"), ["gpu0"], "a", now=0.0, wall="t0")
    assert [x.claim for x in f.report(None, now=1.0)] == ["team/any"]
    assert f.report(None, now=STALE_AFTER_S + 1) == []


def test_the_report_is_oldest_first_capped_and_cut_to_what_the_contract_allows() -> None:
    f = PrepareFailures()
    for n in range(MAX_PREPARE_FAILURES + 5):
        f.failed(
            ref(f"c{n:04d}"),
            [],
            "x" * 5000,
            now=0.0,
            wall=f"2026-12-06T10:{n // 60:02d}:{n % 60:02d}Z",
        )
    out = f.report(set(), now=1.0)
    assert len(out) == MAX_PREPARE_FAILURES
    assert [x.claim for x in out] == [f"team/c{n:04d}" for n in range(MAX_PREPARE_FAILURES)]
    assert {len(x.message) for x in out} == {MAX_FAILURE_MESSAGE}
    assert out[0].message.endswith("...")
    NodePartitioningStatus(prepareFailures=out)  # valid: the contract's limits hold


def test_an_empty_list_is_left_out_of_the_status_so_older_readers_read_the_same() -> None:
    assert "prepareFailures" not in NodePartitioningStatus().model_dump(mode="json")
    some = NodePartitioningStatus(prepareFailures=[PrepareFailure(claim="a/b")])
    assert some.model_dump(mode="json")["prepareFailures"][0]["claim"] == "a/b"
    assert NodePartitioningStatus.model_validate(some.model_dump(mode="json")) == some


# -- the kubelet plugin -------------------------------------------------------------------------


async def test_the_plugin_records_each_failure_and_forgets_it_once_a_retry_succeeds(
    node: Node,
) -> None:
    prep, failures = node.plugin.preparer, node.plugin.failures
    metrics = node.plugin.metrics = AgentMetrics()

    def sample(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(f"gpuslice_agent_dra_{name}", labels) or 0.0

    held = node.claims.put("held", "uid-h", ("gpu", placement(0, "3g.40gb", 0)))
    assert (await node.kubelet.prepare(DRIVER, held))["uid-h"].error == ""
    prep.mark_xids([XidEvent(0, 48)])  # not scoped to an instance: the whole GPU
    over = node.claims.put("over", "uid-o", ("gpu", placement(0, "1g.10gb", 4)))
    beside = node.claims.put("beside", "uid-b", ("gpu", placement(1, "3g.40gb", 4)))
    reply = await node.kubelet.prepare(DRIVER, over, beside)
    assert reply["uid-o"].error and reply["uid-b"].error == ""
    (f,) = failures.report({placement(0, "1g.10gb", 4)}, now=float("-inf"))
    assert f.uid == "uid-o" and f.claim.endswith("/over") and f.message == reply["uid-o"].error
    assert "XID 48" in f.message and f.since
    assert sample("prepares_total", result="prepared") == 2
    assert sample("prepares_total", result="failed") == 1
    assert sample("prepare_failures") == 1
    # the prepared one stays prepared and is not reported
    assert (await node.kubelet.prepare(DRIVER, held))["uid-h"].error == ""
    assert [x.uid for x in failures.report({placement(0, "1g.10gb", 4)}, now=float("-inf"))] == [
        "uid-o"
    ]
    # the XID is gone (an agent restart): the retry succeeds and the record with it
    prep.xid_marks = ()
    assert (await node.kubelet.prepare(DRIVER, over))["uid-o"].error == ""
    assert len(failures) == 0 and sample("prepare_failures") == 0
    assert (await node.kubelet.unprepare(DRIVER, over))["uid-o"].error == ""
    assert sample("unprepares_total", result="released") == 1


# -- the status, on the wire ----------------------------------------------------------------------


@pytest.mark.parametrize("ends", ["unprepared", "deallocated"])
async def test_shaped_publishing_reports_failures_in_the_status_and_removes_them(
    kmock: ApiServer, connect: Callable[[str], Any], tmp_path: Any, ends: str
) -> None:
    nv = FakeNvml([H100, H100])
    driver = setup(kmock, connect, nv, str(tmp_path))
    await put_np(kmock, spec("plan-1", {0: [("3g.40gb", 0), ("3g.40gb", 4)], 1: []}))
    uid = await put_claim(kmock, "hit", [p(0, "3g.40gb", 0)])
    await round_ok(driver)
    assert "prepareFailures" not in np_of(kmock)["status"]
    driver.preparer.mark_xids([XidEvent(0, 79)])  # the whole GPU: nothing new there
    claim = dra.Claim(namespace="team", name="hit", uid=uid)
    reply = await driver.plugin.prepare(dra.NodePrepareResourcesRequest(claims=[claim]))
    assert "XID 79" in reply.claims[uid].error
    await round_ok(driver)
    (f,) = np_of(kmock)["status"]["prepareFailures"]
    assert f["claim"] == "team/hit" and f["uid"] == uid
    assert f["message"] == reply.claims[uid].error and f["since"].endswith("Z")
    assert np_of(kmock)["status"]["gpus"][0]["unhealthy"] is True
    if ends == "unprepared":
        await driver.plugin.unprepare(dra.NodeUnprepareResourcesRequest(claims=[claim]))
    else:  # its pod was deleted: the claim deallocated without an unprepare
        await drop_claim(kmock, "hit")
    await round_ok(driver)
    status = np_of(kmock)["status"]
    assert "prepareFailures" not in status, status
    assert status["gpus"][0]["unhealthy"] is True  # the GPU's own problem is still told
