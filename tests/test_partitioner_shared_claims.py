"""ResourceClaims the partitioner must not over-count or misread: shared claims (one claim named
by several pods counts once), adminAccess requests (no demand), the allocator's per-claim limit
(32 devices) and CEL selectors that are not plain conjunctions (``||``, ``?:``).

Pure tests on :mod:`partitioner.claims`, the index and :func:`partitioner.decide.decide` (driven
through the promises tests' :class:`Cluster`, which applies patches as the API server would).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from test_partitioner_dra import (
    DRA,
    OURS,
    THREE_G,
    allocated,
    bound_claim_pod,
    claim,
    claim_pod,
    mig_request,
)
from test_partitioner_promises import (
    CONFIG,
    T0,
    Cluster,
    applied_np,
    events,
    reservation,
    status_gpu,
)
from test_partitioner_snapshot import node, np

from partitioner.actions import PatchPod, WriteReservations, WriteSpec
from partitioner.claims import read_claim
from partitioner.gating import GATE
from partitioner.index import ClusterIndex
from partitioner.reservations import State
from planner.catalog import default_catalog

CAT = default_catalog()
A = 'device.attributes["gpu.gpuslice.io"]'
ONE_G = f'{A}.profile == "1g.10gb"'
SEVEN_G = f'{A}.profile == "7g.80gb"'


def _gated(pod: dict[str, Any]) -> bool:
    return GATE in str(pod["spec"].get("schedulingGates") or "")


def _pinned_to(pod: dict[str, Any]) -> list[str]:
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    return [v for t in terms["nodeSelectorTerms"] for f in t["matchFields"] for v in f["values"]]


# ----------------------------------------------------------------------------- adminAccess


def test_an_admin_access_request_asks_for_nothing_and_its_result_pins_no_device() -> None:
    admin = mig_request(adminAccess=True)
    d = read_claim(claim("c", admin))
    assert (dict(d.units), d.error) == ({}, "")
    # with an ordinary request beside it, only the ordinary one counts
    ordinary = {**mig_request(ONE_G), "name": "one"}
    assert dict(read_claim(claim("c", admin, ordinary)).units) == {"nvidia.com/mig-1g.10gb": 1}
    obj = allocated(claim("c", admin), (OURS, "d1", "gpu0-3g-40gb-s4"))
    obj["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    d = read_claim(obj)
    assert (dict(d.units), d.devices) == ({}, ())


# ----------------------------------------------------------------------------- claim limit


@pytest.mark.parametrize(
    ("requests", "total"),
    [
        ((mig_request(count=33),), 33),
        (({**mig_request(count=20), "name": "a"}, {**mig_request(count=20), "name": "b"}), 40),
        (
            (
                mig_request(count=30),
                {"name": "nic", "exactly": {"deviceClassName": "nic.example.com", "count": 3}},
            ),
            33,
        ),
    ],
)
def test_a_claim_needing_more_than_32_devices_is_an_error_naming_it_and_the_limit(
    requests: tuple[dict[str, Any], ...], total: int
) -> None:
    d = read_claim(claim("c", *requests))
    assert dict(d.units) == {}
    assert "ResourceClaim ns/c" in d.error and f"needs {total} devices" in d.error
    assert "32" in d.error and "split it" in d.error
    d = read_claim(claim("c", mig_request(count=32)))  # the limit itself is allocatable
    assert (dict(d.units), d.error) == ({THREE_G: 32}, "")


# ----------------------------------------------------------------------------- CEL


@pytest.mark.parametrize(
    "expr",
    [
        f"{ONE_G} && {A}.start >= 4 || {SEVEN_G}",  # (1g && start) || 7g: any 7g device too
        f"{ONE_G} || {SEVEN_G}",
        f"({ONE_G} && {A}.start >= 4) || {SEVEN_G}",
        f"{ONE_G} && ({A}.start >= 4 || {SEVEN_G})",
        f"{ONE_G} && {A}.start >= 4 ? false : true",  # !(1g && start)
        f"({ONE_G} && {A}.start >= 4",
        f'{A}.profile == "1g.10gb',
    ],
)
def test_a_selector_that_is_no_plain_conjunction_is_an_error_never_a_misread(expr: str) -> None:
    d = read_claim(claim("c", mig_request(expr)))
    assert dict(d.units) == {}
    assert "ResourceClaim ns/c request 'gpu'" in d.error and "cannot be read exactly" in d.error
    assert "profile ==" in d.error  # the fix


def test_a_comparison_of_a_conjunction_is_not_read_as_its_conjuncts() -> None:
    """Parentheses are read as CEL groups them: ``(1g && memory >= 4) == false`` is any device
    that is not a 1g of 4+ GB, not a 1g; conjunctions nested in conjunctions are read."""
    d = read_claim(claim("c", mig_request(f"({ONE_G} && {A}.memory >= 4) == false")))
    assert dict(d.units) == {} and "no single MIG profile" in d.error
    for expr in (
        f"({ONE_G} && {A}.type == 'mig') && {A}.memory > 1",
        f"(({ONE_G}))",
        f'{A}.type != "a||b" && {ONE_G}',  # || inside a string literal
        f"!({A}.memory >= 40) && {ONE_G}",
    ):
        d = read_claim(claim("c", mig_request(expr)))
        assert (dict(d.units), d.error) == ({"nvidia.com/mig-1g.10gb": 1}, ""), expr


@pytest.mark.parametrize(
    ("expr", "attribute"),
    [
        (f"({ONE_G} && {A}.start >= 4) && {A}.memory > 1", "start"),
        (f'{A}.uuid == "GPU-1" && {ONE_G}', "uuid"),
        (f"!({A}.start >= 4) && {ONE_G}", "start"),
        (f'{ONE_G} && {A}["index"] == 1', "index"),
        (f'{ONE_G} && {A}.model == "H100-80GB"', "model"),
    ],
)
def test_a_condition_on_what_the_plan_decides_is_an_error_not_ignored(
    expr: str, attribute: str
) -> None:
    """The planner places a request by profile alone: a condition on the start, the GPU or
    the model would make kube-scheduler refuse the device planned for it, and the pod, released,
    would wait for it for good."""
    d = read_claim(claim("c", mig_request(expr)))
    assert dict(d.units) == {}
    assert f"constrains the device's {attribute}" in d.error and "ResourceClaim ns/c" in d.error


@pytest.mark.parametrize(
    ("constraint", "error"),
    [
        ({"matchAttribute": "gpu.gpuslice.io/uuid"}, True),
        ({"requests": ["gpu"], "distinctAttribute": "gpu.gpuslice.io/index"}, True),
        ({"requests": ["gpu/small"], "matchAttribute": "gpu.gpuslice.io/uuid"}, True),
        ({"requests": ["nic"], "matchAttribute": "example.com/numa"}, False),
    ],
)
def test_a_constraint_over_a_planned_request_is_an_error(
    constraint: dict[str, Any], error: bool
) -> None:
    obj = claim("c", mig_request(count=2), {"name": "nic", "exactly": {"deviceClassName": "n"}})
    obj["spec"]["devices"]["constraints"] = [constraint]
    d = read_claim(obj)
    if error:
        assert dict(d.units) == {} and "spec.devices.constraints" in d.error
        assert "ResourceClaim ns/c" in d.error and "drop the constraint" in d.error
    else:
        assert (dict(d.units), d.error) == ({"nvidia.com/mig-3g.40gb": 2}, "")


# ----------------------------------------------------------------------------- shared claims


def test_a_shared_claims_units_count_once_with_its_carrier() -> None:
    """The oldest pending pod carries a shared claim; once one is bound, the bound one does;
    the claim's units follow the pods as they come and go."""
    idx = ClusterIndex.from_objects(
        CAT,
        pods=[claim_pod("p2", "cl"), claim_pod("p1", "cl")],
        claims=[claim("cl", mig_request())],
    )
    p1, p2 = idx.pods["ns/p1"], idx.pods["ns/p2"]
    assert (dict(p1.slices), dict(p2.slices)) == ({THREE_G: 1}, {})
    assert (p1.waiting, p1.claim_carriers) == (True, ())
    assert (dict(p2.slices), p2.waiting, p2.claim_carriers) == ({}, False, ("ns/p1",))
    assert p2.follower and not p2.stray and p2.dra
    assert [w.key for w in idx.waiting()] == ["ns/p1"] and idx.followers == {"ns/p2"}
    idx.apply("pods", "DELETED", claim_pod("p1", "cl"))
    p2 = idx.pods["ns/p2"]
    assert (dict(p2.slices), p2.waiting, p2.follower) == ({THREE_G: 1}, True, False)
    assert idx.followers == set()


def test_bound_pods_sharing_an_allocated_claim_hold_its_units_once() -> None:
    held = allocated(claim("cl", mig_request()), (OURS, "d1", "gpu0-3g-40gb-s0"))
    idx = ClusterIndex.from_objects(
        CAT,
        [node("d1", DRA)],
        pods=[bound_claim_pod("a", "cl", "d1"), bound_claim_pod("b", "cl", "d1")],
        claims=[held],
    )
    assert idx.usage("d1").slices[THREE_G] == 1
    # a pending pod joining the allocated claim asks for nothing and is not kept waiting
    idx.upsert_pod(claim_pod("c", "cl"))
    c = idx.pods["ns/c"]
    assert (dict(c.slices), c.waiting, c.stray, c.follower) == ({}, False, True, False)
    assert idx.usage("d1").slices[THREE_G] == 1


def test_two_pending_pods_sharing_a_claim_get_one_instance_and_are_released_together() -> None:
    c = Cluster(
        node("d1", DRA),
        np("d1"),
        claim_pod("p1", "cl"),
        claim_pod("p2", "cl"),
        claim("cl", mig_request()),
    )
    d = c.step(T0)  # the batch window opens
    assert "ns/p1" in " ".join(events(d, "Gated"))  # p2 is told whom it waits for
    d = c.step(T0 + 61)
    (spec,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    placed = [(m.profile, m.start) for g in spec.spec.gpus for m in g.mig]
    assert placed == [("3g.40gb", placed[0][1])], placed  # one instance, not one per pod
    reserved = [a.pod for a in d.actions if isinstance(a, PatchPod) and a.purpose == "reserve"]
    assert reserved == ["ns/p1"] and reservation(c, "p2") is None
    assert _gated(c.pod("p2")) and not events(d, "Gated")  # told once, not every step
    gpu = spec.spec.gpus[0].index
    c.put(applied_np("d1", status_gpu(gpu, *[(p, s, False) for p, s in placed]), generation=2))
    d = c.step(T0 + 62)
    released = sorted(
        a.pod for a in d.actions if isinstance(a, PatchPod) and a.purpose == "release"
    )
    assert released == ["ns/p1", "ns/p2"]
    for name in ("p1", "p2"):
        assert not _gated(c.pod(name)) and _pinned_to(c.pod(name)) == ["d1"]
    assert reservation(c, "p1").state is State.RELEASED and reservation(c, "p2") is None
    assert any("with pod(s) ns/p1" in m for m in events(d, "Released"))
    # only the carrier holds the slice on the node's status view
    (view,) = [a for a in d.actions if isinstance(a, WriteReservations)]
    assert [r.pod for r in view.reservations] == ["ns/p1"]
    # Without reservations nothing releases a gated pod: the follower is ungated at once.
    c = Cluster(node("d1", DRA), np("d1"), claim_pod("p1", "cl"), claim_pod("p2", "cl"))
    c.put(claim("cl", mig_request()))
    c.step(T0, replace(CONFIG, reservation=False))
    assert not _gated(c.pod("p2"))


def test_a_pod_joining_an_allocated_claim_is_ungated_at_once_and_nothing_is_planned() -> None:
    """A full single-GPU node: p1 runs on the 7g instance its claim is allocated; p2 names the
    same claim.  It needs no new slice: ungated at once (kube-scheduler sends it where the
    claim is), never planned, reserved or drained for."""
    held = allocated(claim("cl", mig_request(SEVEN_G)), (OURS, "d1", "gpu0-7g-80gb-s0"))
    c = Cluster(
        node("d1", {**DRA, "nvidia.com/gpu.count": "1"}),
        applied_np("d1", status_gpu(0, ("7g.80gb", 0, True))),
        bound_claim_pod("p1", "cl", "d1"),
        claim_pod("p2", "cl"),
        held,
    )
    d = c.step(T0)
    (patch,) = [a for a in d.actions if isinstance(a, PatchPod)]
    assert (patch.pod, patch.purpose) == ("ns/p2", "ungate")
    assert not _gated(c.pod("p2"))
    (message,) = events(d, "Ungated")
    assert "ns/cl" in message and "allocated already on node d1" in message
    for t in (61, 600, 1800, 4000):
        d = c.step(T0 + t)
        assert not [a for a in d.actions if isinstance(a, PatchPod | WriteSpec)], d.actions
        assert not events(d, "Unplaceable")
    assert reservation(c, "p2") is None
