"""DRA nodes in the partitioner: ResourceClaims read as demand, planned, gated, released.

Pure tests on :mod:`partitioner.claims`, the index and :func:`partitioner.decide.decide`
(driven through the promises tests' :class:`Cluster`, which applies patches as the API server
would), plus the webhook's CEL for pods that name claims.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_partitioner_promises import (
    T0,
    Cluster,
    applied_np,
    events,
    gated,
    reservation,
    status_gpu,
)
from test_partitioner_snapshot import A100, node, np

from partitioner.actions import CreatePartitioning, PatchPod, WriteSpec
from partitioner.claims import MIG_CLASS, pod_claim_keys, read_claim
from partitioner.gating import GATE, MATCH_CONDITIONS_DRA, admission_patch, wants_gate
from partitioner.index import ClusterIndex
from partitioner.ledger import NodeLedger, build_ledgers
from partitioner.reservations import State
from partitioner.snapshot import GpuNode, NodeProblem, read_node
from planner.catalog import default_catalog

CAT = default_catalog()
DRA = {"gpuslice.io/partitioning": "dra", **A100}
MIG = {"gpuslice.io/partitioning": "mig", **A100}
THREE_G = "nvidia.com/mig-3g.40gb"
PROFILE = 'device.attributes["gpu.gpuslice.io"].profile == "3g.40gb"'


def claim(
    name: str,
    *requests: dict[str, Any],
    allocated: bool = False,
    namespace: str = "ns",
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": "1"},
        "spec": {"devices": {"requests": list(requests)}},
    }
    if allocated:
        obj["status"] = {"allocation": {"devices": {"results": [{"device": "gpu0"}]}}}
    return obj


def mig_request(expr: str = PROFILE, count: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "name": "gpu",
        "exactly": {
            "deviceClassName": MIG_CLASS,
            "count": count,
            "selectors": [{"cel": {"expression": expr}}],
            **extra,
        },
    }


def claim_pod(name: str, *claims: str, gate: bool = True, **spec: Any) -> dict[str, Any]:
    """A pod naming ResourceClaims (no extended resources), gated like the webhook does."""
    obj = gated(name, "cpu", **spec)
    obj["spec"]["containers"] = [{"name": "c", "resources": {"requests": {"cpu": "1"}}}]
    obj["spec"]["resourceClaims"] = [
        {"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)
    ]
    if not gate:
        del obj["spec"]["schedulingGates"]
    return obj


def allocated(obj: dict[str, Any], *results: tuple[str, str, str]) -> dict[str, Any]:
    """``obj`` (a claim) with kube-scheduler's allocation: (driver, pool, device) results."""
    obj["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "gpu", "driver": drv, "pool": pool, "device": dev}
                    for drv, pool, dev in results
                ]
            }
        }
    }
    return obj


def bound_claim_pod(name: str, claim_name: str, node_name: str) -> dict[str, Any]:
    """A pod that names ``claim_name``, bound to ``node_name`` and running."""
    obj = claim_pod(name, claim_name, gate=False)
    obj["spec"]["nodeName"] = node_name
    obj["status"] = {"phase": "Running"}
    return obj


OURS = "gpu.gpuslice.io"


# ----------------------------------------------------------------------------- claims


@pytest.mark.parametrize(
    "expr",
    [
        PROFILE,
        "device.attributes['gpu.gpuslice.io'].profile == '3g.40gb'",
        'device.attributes["gpu.gpuslice.io"]["profile"] == "3g.40gb"',
        'device.attributes["gpu.gpuslice.io"].memory > 10 && ' + PROFILE,
        "(" + PROFILE + ")",
    ],
)
def test_a_profile_selector_becomes_the_units_of_that_profile(expr: str) -> None:
    d = read_claim(claim("c", mig_request(expr, count=2)))
    assert (dict(d.units), d.error, d.allocated) == ({THREE_G: 2}, "", False)


def test_claims_of_other_classes_ask_for_nothing_and_allocated_ones_keep_their_units() -> None:
    other = {"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}}
    assert dict(read_claim(claim("c", other)).units) == {}
    d = read_claim(claim("c", other, mig_request(), allocated=True))
    assert (dict(d.units), d.allocated) == ({THREE_G: 1}, True)


@pytest.mark.parametrize(
    ("request_", "why"),
    [
        (mig_request('device.attributes["gpu.gpuslice.io"].memory > 10'), "no single MIG"),
        (
            mig_request(PROFILE + ' && device.attributes["gpu.gpuslice.io"].profile == "1g.10gb"'),
            "no single MIG",
        ),
        (mig_request(allocationMode="All"), "allocationMode All"),
        (mig_request(count=0), "count 0"),
        ({"name": "gpu", "firstAvailable": [{"deviceClassName": MIG_CLASS}]}, "firstAvailable"),
    ],
)
def test_a_mig_request_that_cannot_be_planned_is_an_error_naming_the_claim_and_the_fix(
    request_: dict[str, Any], why: str
) -> None:
    d = read_claim(claim("c", request_))
    assert dict(d.units) == {}
    assert why in d.error and "ResourceClaim ns/c" in d.error and "profile ==" in d.error


@pytest.mark.parametrize(
    ("names", "told"),
    [(None, "every request"), (["gpu"], "request(s) gpu"), (["gpu/small", "nic"], "gpu/small")],
)
def test_an_opaque_config_for_gpuslice_on_a_planned_request_is_refused_before_planning(
    names: list[str] | None, told: str
) -> None:
    """The agent refuses to prepare a claim with an opaque config for its driver
    (node_agent.dra_claims): the partitioner tells the pod before planning for it."""
    obj = claim("c", mig_request(), {"name": "nic", "exactly": {"deviceClassName": "nic.x"}})
    cfg: dict[str, Any] = {"opaque": {"driver": OURS, "parameters": {"a": 1}}}
    if names is not None:
        cfg["requests"] = names
    obj["spec"]["devices"]["config"] = [cfg]
    d = read_claim(obj)
    assert dict(d.units) == {}
    assert "ResourceClaim ns/c" in d.error and told in d.error
    assert "remove the config" in d.error


@pytest.mark.parametrize(
    "cfg",
    [
        {"opaque": {"driver": "nic.example.com", "parameters": {}}},  # another driver's
        {"opaque": {"driver": OURS, "parameters": {}}, "requests": ["nic"]},  # another request
    ],
)
def test_an_opaque_config_that_is_not_for_a_planned_request_is_no_error(
    cfg: dict[str, Any],
) -> None:
    obj = claim("c", mig_request(), {"name": "nic", "exactly": {"deviceClassName": "nic.x"}})
    obj["spec"]["devices"]["config"] = [cfg]
    d = read_claim(obj)
    assert (dict(d.units), d.error) == ({THREE_G: 1}, "")


def test_a_template_claim_is_known_once_the_pod_status_names_it() -> None:
    pod = claim_pod("p")
    pod["spec"]["resourceClaims"] = [
        {"name": "a", "resourceClaimName": "direct"},
        {"name": "b", "resourceClaimTemplateName": "tmpl"},
    ]
    assert pod_claim_keys(pod) == (("ns/direct",), False)
    pod["status"]["resourceClaimStatuses"] = [{"name": "b", "resourceClaimName": "p-b-x1"}]
    assert pod_claim_keys(pod) == (("ns/direct", "ns/p-b-x1"), True)


# ----------------------------------------------------------------------------- index


def test_a_pod_asks_for_its_claims_units_and_is_read_again_when_a_claim_arrives() -> None:
    index = ClusterIndex(CAT)
    index.upsert_pod(claim_pod("p", "cl"))
    p = index.pods["ns/p"]
    assert (dict(p.slices), p.waiting, p.claims_pending, p.stray) == ({}, False, True, False)
    before = index.version
    index.apply("claims", "ADDED", claim("cl", mig_request()))
    p = index.pods["ns/p"]
    assert index.version > before
    assert (dict(p.slices), p.dra, p.waiting) == ({THREE_G: 1}, True, True)
    assert [w.key for w in index.waiting()] == ["ns/p"]
    index.apply("claims", "DELETED", claim("cl"))
    assert index.pods["ns/p"].claims_pending and not index.pods["ns/p"].waiting
    index.relist("claims", [claim("cl", mig_request(count=3))])
    assert dict(index.pods["ns/p"].slices) == {THREE_G: 3}
    index.relist("claims", [])
    assert index.claims == {} and not index.pods["ns/p"].waiting


def test_a_gated_pod_whose_claims_ask_gpuslice_for_nothing_is_a_stray() -> None:
    index = ClusterIndex.from_objects(
        CAT,
        pods=[claim_pod("p", "nic")],
        claims=[claim("nic", {"name": "n", "exactly": {"deviceClassName": "nic.example.com"}})],
    )
    assert index.strays == {"ns/p"} and not index.pods["ns/p"].waiting
    index.apply("pods", "DELETED", claim_pod("p", "nic"))
    assert index.strays == set()


def test_extended_resources_and_claims_in_one_pod_is_an_error() -> None:
    pod = claim_pod("p", "cl")
    pod["spec"]["containers"][0]["resources"]["limits"] = {THREE_G: "1"}
    index = ClusterIndex.from_objects(CAT, pods=[pod], claims=[claim("cl", mig_request())])
    p = index.pods["ns/p"]
    assert dict(p.slices) == {} and "both as extended resources and through" in p.request_error


def test_dra_pods_are_eligible_only_on_dra_nodes_and_others_only_elsewhere() -> None:
    mig_pod = gated("m", THREE_G)
    index = ClusterIndex.from_objects(
        CAT,
        nodes=[node("d1", DRA), node("m1", MIG)],
        pods=[claim_pod("p", "cl"), mig_pod],
        claims=[claim("cl", mig_request())],
    )
    gpu_nodes = index.gpu_nodes()
    assert index.eligible(index.pods["ns/p"], gpu_nodes) == {"d1"}
    assert index.eligible(index.pods["ns/m"], gpu_nodes) == {"m1"}


def test_a_dra_node_is_read_as_a_mig_node_unless_the_device_plugin_agent_still_holds_it() -> None:
    reading = read_node(node("d1", DRA), CAT)
    assert isinstance(reading, GpuNode) and reading.dra and reading.mode.value == "mig"
    assert read_node(node("d1", {**DRA, "gpuslice.io/managed": "true"}), CAT) is None
    t4 = {"gpuslice.io/partitioning": "dra", "nvidia.com/gpu.product": "Tesla-T4"}
    t4["nvidia.com/gpu.count"] = "1"
    problem = read_node(node("t", t4), CAT)
    assert isinstance(problem, NodeProblem) and problem.reason == "MigNotSupported"


# ----------------------------------------------------------------------------- decisions


def test_a_claim_pod_is_planned_on_the_dra_node_and_released_when_the_agent_publishes() -> None:
    c = Cluster(node("d1", DRA), np("d1"), claim_pod("p", "cl"), claim("cl", mig_request()))
    c.step(T0)  # the batch window opens
    d = c.step(T0 + 61)
    (spec,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    assert spec.node == "d1" and spec.spec.mode == "mig"
    assert [(m.profile) for g in spec.spec.gpus for m in g.mig] == ["3g.40gb"]
    assert reservation(c, "p").state is State.PLANNED and GATE in str(c.pod("p")["spec"])
    placed = [(m.profile, m.start) for g in spec.spec.gpus for m in g.mig]
    gpu = spec.spec.gpus[0].index
    # The DRA agent publishes the spec and reports it as its status: a free 3g placement.
    c.put(applied_np("d1", status_gpu(gpu, *[(p, s, False) for p, s in placed]), generation=2))
    d = c.step(T0 + 62)
    assert [a.purpose for a in d.actions if isinstance(a, PatchPod)] == ["release"]
    pod = c.pod("p")
    assert "schedulingGates" not in pod["spec"] or GATE not in str(pod["spec"]["schedulingGates"])
    assert "d1" in str(pod["spec"]["affinity"]) and reservation(c, "p").state is State.RELEASED


def test_no_room_on_a_dra_node_while_its_published_placement_is_allocated() -> None:
    allocated = claim("held", mig_request(), allocated=True)
    bound = claim_pod("b", "held", gate=False)
    bound["spec"]["nodeName"] = "d1"
    bound["status"] = {"phase": "Running"}
    c = Cluster(
        node("d1", DRA),
        applied_np("d1", status_gpu(0, ("3g.40gb", 0, False))),  # the agent has not caught up
        bound,
        allocated,
        claim_pod("p", "cl"),
        claim("cl", mig_request()),
    )
    d = c.step(T0)
    idx = c.index()
    # The only published 3g placement is the bound pod's: nothing is reserved or released.
    assert not [a for a in d.actions if isinstance(a, PatchPod) and a.purpose == "release"]
    assert idx.pods["ns/p"].waiting


def test_a_gated_pod_whose_claims_are_another_drivers_loses_the_gate() -> None:
    nic = claim("nic", {"name": "n", "exactly": {"deviceClassName": "x"}})
    c = Cluster(node("d1", DRA), np("d1"), claim_pod("p", "nic"), nic)
    d = c.step(T0)
    (patch,) = [a for a in d.actions if isinstance(a, PatchPod)]
    assert patch.purpose == "ungate" and "schedulingGates" not in c.pod("p")["spec"]
    assert "ask gpuslice for no slice" in events(d, "Ungated")[0]


def test_dra_nodes_get_a_node_partitioning() -> None:
    d = Cluster(node("d1", DRA)).step(T0)
    assert [a.node for a in d.actions if isinstance(a, CreatePartitioning)] == ["d1"]


# ----------------------------------------------------------------------------- the webhook


def test_with_dra_served_pods_naming_claims_are_gated_and_the_cel_agrees() -> None:
    pod = claim_pod("p", "cl", gate=False)
    assert not wants_gate(pod) and wants_gate(pod, claims=True)
    assert admission_patch(pod, claims=True) == [{"name": GATE}]
    bound = copy.deepcopy(pod)
    bound["spec"]["nodeName"] = "n"
    assert not wants_gate(bound, claims=True)
    (asks,) = [e for n, e in MATCH_CONDITIONS_DRA if n == "asks-for-a-slice"]
    assert asks.startswith(
        "(has(object.spec.resourceClaims) && size(object.spec.resourceClaims) > 0)"
    )


def test_a_placement_reported_used_without_a_claim_is_neither_promised_nor_planned_over() -> None:
    # The DRA agent reports 3g@0 of GPU 0 used by processes outside any claim (``foreign``,
    # node_agent.dra_foreign): it withdrew it, and a prepare there would fail.
    gpu0 = status_gpu(0, ("3g.40gb", 0, True), ("3g.40gb", 4, False))
    gpu0["mig"][0]["foreign"] = True
    c = Cluster(
        node("d1", DRA),
        applied_np("d1", gpu0, status_gpu(1)),  # the agent lists every GPU, empty ones too
        claim_pod("p", "cl"),
        claim("cl", mig_request()),
        claim_pod("q", "cq"),
        claim("cq", mig_request()),
    )
    d = c.step(T0)
    # the free 3g@4 is promised to one pod at once; the busy 3g@0 to nobody
    (fast,) = [a for a in d.actions if isinstance(a, PatchPod) and a.purpose == "release"]
    waiting = "q" if fast.pod == "ns/p" else "p"
    assert reservation(c, waiting) is None  # it waits for the batch
    d = c.step(T0 + 61)
    (spec,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    placed = {(g.index, m.profile, m.start) for g in spec.spec.gpus for m in g.mig}
    assert (0, "3g.40gb", 0) in placed  # kept as it is
    assert not [s for g, p, s in placed if g == 0 and p != "3g.40gb" and s < 4]
    new = placed - {(0, "3g.40gb", 0), (0, "3g.40gb", 4)}
    assert new and all(g != 0 for g, _, _ in new), placed  # the other pod: another GPU
    assert reservation(c, waiting).state is State.PLANNED


def test_the_device_a_claim_is_allocated_is_kept_while_the_agents_flags_lag() -> None:
    """DRA promise harness seed 40001212.  GPU 0 holds 3g@0 and 3g@4; the agent's last report
    shows 3g@0 used (its pod has left) and 3g@4 free, though bound pod b's claim is allocated
    gpu0-3g-40gb-s4 now.  The counts agree (one bound, one used), so the ledger pinned 3g@0
    and a plan replaced 3g@4 under pod b.  The allocation names the device: it stays."""
    held = allocated(claim("held", mig_request()), (OURS, "d1", "gpu0-3g-40gb-s4"))
    bound = bound_claim_pod("b", "held", "d1")
    two_g = 'device.attributes["gpu.gpuslice.io"].profile == "2g.20gb"'
    c = Cluster(
        node("d1", {**DRA, "nvidia.com/gpu.count": "1"}),
        applied_np("d1", status_gpu(0, ("3g.40gb", 0, True), ("3g.40gb", 4, False))),
        bound,
        held,
        claim_pod("p", "cl"),
        claim("cl", mig_request(two_g)),
    )
    assert c.index().allocated_devices("d1") == {"gpu0-3g-40gb-s4"}
    c.step(T0)  # the batch window opens
    d = c.step(T0 + 61)
    for spec in [a for a in d.actions if isinstance(a, WriteSpec)]:
        placed = {(m.profile, m.start) for g in spec.spec.gpus for m in g.mig}
        assert ("3g.40gb", 4) in placed, placed
    assert reservation(c, "p") is None


def test_the_index_follows_each_claims_allocated_devices_per_node() -> None:
    """Allocated, moved, deallocated, deleted: the node's allocated devices follow; results of
    other drivers are not gpuslice's."""

    def version(name: str, rv: str, *results: tuple[str, str, str]) -> dict[str, Any]:
        obj = claim(name, mig_request())
        obj["metadata"]["resourceVersion"] = rv
        return allocated(obj, *results)

    idx = ClusterIndex.from_objects(CAT, [node("d1", DRA), node("d2", DRA)])
    idx.upsert_claim(version("a", "1", (OURS, "d1", "gpu0-3g-40gb-s0"), ("x.io", "d1", "nic0")))
    idx.upsert_claim(version("b", "1", (OURS, "d1", "gpu1-7g-80gb-s0")))
    assert idx.allocated_devices("d1") == {"gpu0-3g-40gb-s0", "gpu1-7g-80gb-s0"}
    idx.upsert_claim(version("a", "2", (OURS, "d2", "gpu0-3g-40gb-s4")))
    assert idx.allocated_devices("d1") == {"gpu1-7g-80gb-s0"}
    assert idx.allocated_devices("d2") == {"gpu0-3g-40gb-s4"}
    idx.upsert_claim(version("b", "2"))  # deallocated
    assert idx.allocated_devices("d1") == frozenset()
    idx.remove_claim("ns/a")
    assert idx.allocated_devices("d2") == frozenset()


def test_a_frozen_gpus_stale_used_flag_hides_no_claims_device_elsewhere() -> None:
    """DRA promise harness seed 70002048.  GPU 0 is frozen for a drain; its 1g@0 still shows
    used though its pod left, and pod b's claim holds GPU 1's 1g@0, which shows free.  Counted
    from the flags, the frozen GPU held b's unit, so both of GPU 1's 1g instances looked free
    (a drain then broke the hold of a pod released there).  The allocations say where b is."""
    one_g = 'device.attributes["gpu.gpuslice.io"].profile == "1g.10gb"'
    held = allocated(claim("held", mig_request(one_g)), (OURS, "d1", "gpu1-1g-10gb-s0"))
    bound = bound_claim_pod("b", "held", "d1")
    index = ClusterIndex.from_objects(CAT, [node("d1", {**DRA, "nvidia.com/gpu.count": "2"})])
    index.upsert_claim(held)
    index.upsert_pod(bound)
    index.upsert_partitioning(
        np(
            "d1",
            observed=1,
            applied=True,
            gpus=[
                status_gpu(0, ("1g.10gb", 0, True), ("1g.10gb", 1, False)),
                status_gpu(1, ("1g.10gb", 0, False), ("1g.10gb", 1, False)),
            ],
        )
    )
    ledgers, problems = build_ledgers(index, (), (), {"d1": frozenset({0})})
    assert not problems
    assert ledgers["d1"].bound["nvidia.com/mig-1g.10gb"] == 1
    assert ledgers["d1"].free()["nvidia.com/mig-1g.10gb"] == 1


def _sick_gpu_ledger(b_holds: str) -> NodeLedger:
    """GPU 0: 2g@0 used by processes of no claim (``foreign``), 2g@4 free; GPU 1, unhealthy
    as a whole: 2g@0 shows used.  Bound pod b's claim holds ``b_holds``."""
    two_g = 'device.attributes["gpu.gpuslice.io"].profile == "2g.20gb"'
    held = allocated(claim("held", mig_request(two_g)), (OURS, "d1", b_holds))
    gpu0 = status_gpu(0, ("2g.20gb", 0, True), ("2g.20gb", 4, False))
    gpu0["mig"][0]["foreign"] = True
    gpu1 = status_gpu(1, ("2g.20gb", 0, True))
    gpu1["unhealthy"] = True
    index = ClusterIndex.from_objects(CAT, [node("d1", {**DRA, "nvidia.com/gpu.count": "2"})])
    index.upsert_claim(held)
    index.upsert_pod(bound_claim_pod("b", "held", "d1"))
    # the agent's status changed after b bound, so its flags look current (equal counts)
    index.upsert_partitioning(np("d1", observed=1, applied=True, gpus=[gpu0, gpu1]))
    ledgers, problems = build_ledgers(index, (), (), {})
    assert not problems and not ledgers["d1"].stale_used
    return ledgers["d1"]


def test_a_claims_healthy_device_is_not_free_while_a_departed_pods_sick_one_shows_used() -> None:
    """DRA promise harness seed 100001597.  The pod on GPU 1's unhealthy 2g@0 left (its flag
    still shows used) and pod b's claim was allocated GPU 0's 2g@4 (not shown used yet): one
    bound pod, one used flag.  Counted from the flags, b sat on the unhealthy device and 2g@4
    was promised to another pod.  The allocations say where b is: nothing of 2g is free."""
    ledger = _sick_gpu_ledger("gpu0-2g-20gb-s4")
    assert ledger.bound["nvidia.com/mig-2g.20gb"] == 1
    assert ledger.free()["nvidia.com/mig-2g.20gb"] == 0
    # b on the unhealthy device: GPU 0's 2g@4 is free
    assert _sick_gpu_ledger("gpu1-2g-20gb-s0").free()["nvidia.com/mig-2g.20gb"] == 1
