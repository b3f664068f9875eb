"""Plans are promises: the decision step gates, reserves, releases and keeps deadlines.

Every test drives :func:`partitioner.decide.decide` on plain API objects, applying the actions
it returns the way the API server would (JSON merge patches through
:mod:`simulations.replay.kube_rules`, which refuses what Kubernetes refuses), so a release that widens
affinity or adds a gate would fail here too.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import math
from typing import Any

import pytest
from test_partitioner_snapshot import A100, node, np

from partitioner.actions import (
    EmitEvent,
    MarkCooldown,
    PatchPod,
    SetNodeCondition,
    WriteReservations,
    WriteSpec,
)
from partitioner.batching import BatchPolicy
from partitioner.decide import ControllerState, DecideConfig, Decision, decide
from partitioner.gating import GATE
from partitioner.index import ClusterIndex
from partitioner.reservations import RESERVATION_ANNOTATION, State, parse_reservation
from partitioner.snapshot import COOLDOWN_ANNOTATION, cooldown_annotation
from planner.catalog import default_catalog
from planner.greedy import plan_greedy
from simulations.replay.kube_rules import merge_patch, validate_pod_update

CAT = default_catalog()
MIG = {"gpuslice.io/partitioning": "mig", **A100}
ONE_G = "nvidia.com/mig-1g.10gb"
SEVEN_G = "nvidia.com/mig-7g.80gb"
T0 = 1_800_000_000.0
CONFIG = DecideConfig(
    catalog=CAT,
    policy=BatchPolicy(timeout=60, idle=10, retry=60),
    planner=plan_greedy,
    apply_deadline_s=300,
    bind_deadline_s=120,
    cooldown_s=300,
    drain_after_s=600,
    drain_fraction=0.5,
)


def gated(name: str, resource: str, created: float = T0, **spec: Any) -> dict[str, Any]:
    stamp = datetime.datetime.fromtimestamp(created, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "creationTimestamp": stamp,
        },
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {resource: "1"}}}],
            "schedulingGates": [{"name": GATE}],
            **spec,
        },
        "status": {"phase": "Pending"},
    }


def status_gpu(index: int, *instances: tuple[str, int, bool]) -> dict[str, Any]:
    return {
        "index": index,
        "migEnabled": True,
        "mig": [{"profile": p, "start": s, "used": u} for p, s, u in instances],
    }


def applied_np(name: str, *gpus: dict[str, Any], generation: int = 2) -> dict[str, Any]:
    obj = np(
        name, plan="1", generation=generation, observed=generation, applied=True, gpus=list(gpus)
    )
    obj["spec"]["gpus"] = [
        {
            "index": g["index"],
            "mig": [{"profile": m["profile"], "start": m["start"]} for m in g["mig"]],
        }
        for g in gpus
    ]
    return obj


def with_alloc(obj: dict[str, Any], **devices: int) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    for short, k in devices.items():
        obj["status"]["allocatable"][f"nvidia.com/mig-{short.replace('_', '.')}"] = str(k)
    return obj


class Cluster:
    """API objects plus the bits of the API server the tests need (rv, patches, rules)."""

    def __init__(self, *objs: dict[str, Any]) -> None:
        self.objs: dict[tuple[str, str], dict[str, Any]] = {}
        for o in objs:
            self.put(o)
        self.state = ControllerState()
        self.kubelet_lists_bound = True
        self.silent_agents: frozenset[str] = frozenset()
        """Nodes whose agent stopped renewing its Lease (what the operator's listing says)."""

    def put(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        namespaced = obj["kind"] in ("Pod", "ResourceClaim")
        key = f"{meta.get('namespace', '')}/{meta['name']}" if namespaced else meta["name"]
        self.objs[(obj["kind"], key)] = obj

    def pod(self, name: str) -> dict[str, Any]:
        return self.objs[("Pod", f"ns/{name}")]

    def index(self) -> ClusterIndex:
        index = ClusterIndex.from_objects(
            CAT,
            [self._listing(o) for (k, _), o in self.objs.items() if k == "Node"],
            [o for (k, _), o in self.objs.items() if k == "Pod"],
            [o for (k, _), o in self.objs.items() if k == "NodePartitioning"],
            [o for (k, _), o in self.objs.items() if k == "ResourceClaim"],
        )
        index.set_silent_agents(self.silent_agents)
        return index

    def _listing(self, node_obj: dict[str, Any]) -> dict[str, Any]:
        """The node as its kubelet shows it: allocatable lists at least the slices the pods
        bound there hold (they were admitted with them), whatever the test wrote."""
        if not self.kubelet_lists_bound:  # the test plays a kubelet that lost the devices
            return node_obj
        name = node_obj["metadata"]["name"]
        held: dict[str, int] = {}
        for (kind, _), o in self.objs.items():
            if kind != "Pod" or o["spec"].get("nodeName") != name:
                continue
            if (o.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            for c in o["spec"].get("containers", ()):
                for r, v in ((c.get("resources") or {}).get("limits") or {}).items():
                    if r.startswith("nvidia.com/mig-") or r.startswith("nvidia.com/gpu-"):
                        held[r] = held.get(r, 0) + int(v)
        alloc = (node_obj.get("status") or {}).get("allocatable") or {}
        short = {r: k for r, k in held.items() if int(alloc.get(r, 0)) < k}
        if not short:
            return node_obj
        out = copy.deepcopy(node_obj)
        out.setdefault("status", {}).setdefault("allocatable", {}).update(
            {r: str(k) for r, k in short.items()}
        )
        return out

    def step(self, now: float, config: DecideConfig = CONFIG) -> Decision:
        d = decide(self.state, self.index(), now, config)
        self.state = d.state
        for a in d.actions:
            if isinstance(a, PatchPod):
                old = self.pod(a.pod.split("/", 1)[1])
                rv = (a.patch.get("metadata") or {}).get("resourceVersion")
                assert rv is None or rv == old["metadata"]["resourceVersion"]
                new = merge_patch(copy.deepcopy(old), a.patch)
                validate_pod_update(old, new)  # raises what the API server would refuse
                new["metadata"]["resourceVersion"] = str(
                    int(old["metadata"]["resourceVersion"]) + 1
                )
                self.put(new)
            elif isinstance(a, WriteReservations):
                obj = self.objs[("NodePartitioning", a.node)]
                obj.setdefault("status", {})["reservations"] = [
                    r.model_dump(mode="json") for r in a.reservations
                ]
            elif isinstance(a, MarkCooldown):  # a merge patch of one annotation
                meta = self.objs[("NodePartitioning", a.node)]["metadata"]
                annotations = dict(meta.get("annotations") or {})
                annotations.pop(COOLDOWN_ANNOTATION, None)
                if a.until is not None:
                    annotations[COOLDOWN_ANNOTATION] = cooldown_annotation(a.until, a.reason)
                meta["annotations"] = annotations
        return d


def running(name: str, node_name: str, *resources: str) -> dict[str, Any]:
    limits: dict[str, str] = {}
    for r in resources:
        limits[r] = str(int(limits.get(r, "0")) + 1)
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "c", "resources": {"limits": limits}}],
        },
        "status": {"phase": "Running"},
    }


def reservation(c: Cluster, name: str) -> Any:
    raw = c.pod(name)["metadata"].get("annotations", {}).get(RESERVATION_ANNOTATION)
    return parse_reservation(raw) if raw else None


def events(d: Decision, reason: str) -> list[str]:
    out = [a.message for a in d.actions if isinstance(a, EmitEvent) and a.reason == reason]
    for a in d.actions:
        if isinstance(a, PatchPod | WriteSpec):
            out += [e.message for e in a.on_success if e.reason == reason]
    return out


def test_a_free_slice_is_reserved_and_released_at_once_with_a_narrowed_affinity() -> None:
    selector = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    }
    n1 = with_alloc(node("n1", {**MIG, "zone": "a"}), **{"1g_10gb": 1})
    c = Cluster(
        n1,
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        gated("p", ONE_G, affinity=selector),
    )
    d = c.step(T0 + 5)
    assert d.plan is None  # no batch, no plan: the slice exists
    p = c.pod("p")
    assert "schedulingGates" not in p["spec"]
    (term,) = p["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "zone", "operator": "In", "values": ["a"]}]
    assert term["matchFields"] == [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]
    r = reservation(c, "p")
    assert (r.node, r.state, dict(r.gpus), r.deadline) == (
        "n1",
        State.RELEASED,
        {ONE_G: (0,)},
        T0 + 125,
    )
    assert events(d, "Reserved") == [
        "reserved nvidia.com/mig-1g.10gb on node n1 GPU 0 (a free slice)"
    ]
    assert events(d, "Released") == [
        "released to node n1 GPU 0: its slice (nvidia.com/mig-1g.10gb) is ready"
    ]
    (view,) = [a for a in d.actions if isinstance(a, WriteReservations)]
    assert [(e.pod, e.state, e.gpus) for e in view.reservations] == [
        ("ns/p", "released", {ONE_G: [0]})
    ]


def test_a_free_slice_the_scheduler_cannot_see_yet_is_held_until_allocatable_shows_it() -> None:
    c = Cluster(
        node("n1", MIG),  # allocatable has no nvidia.com/mig-1g.10gb yet (kubelet lag)
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        gated("p", ONE_G),
    )
    c.step(T0 + 5)
    assert c.pod("p")["spec"]["schedulingGates"] == [{"name": GATE}]
    assert reservation(c, "p").state is State.PLANNED
    c.put(with_alloc(node("n1", MIG), **{"1g_10gb": 1}))
    d = c.step(T0 + 6)
    assert "schedulingGates" not in c.pod("p")["spec"]
    assert reservation(c, "p").state is State.RELEASED and len(events(d, "Released")) == 1


def test_a_second_pod_never_gets_the_slice_promised_to_the_first() -> None:
    one_gpu = {**MIG, "nvidia.com/gpu.count": "1"}
    full = status_gpu(0, ("1g.10gb", 0, False), *(("1g.10gb", s, True) for s in range(1, 7)))
    c = Cluster(
        with_alloc(node("n1", one_gpu), **{"1g_10gb": 7}),
        applied_np("n1", full),
        gated("old", ONE_G, created=T0),
        gated("new", ONE_G, created=T0 + 1),
    )
    for i in range(6):  # six pods bound to the six used instances
        c.put(running(f"run{i}", "n1", ONE_G))
    c.step(T0 + 5)
    assert reservation(c, "old").state is State.RELEASED
    assert reservation(c, "new") is None and c.pod("new")["spec"]["schedulingGates"]
    for t in (T0 + 6, T0 + 30):  # the old pod is not bound yet: its slice stays promised
        d = c.step(t)
        assert reservation(c, "new") is None
    assert d.plan is not None and "ns/new" in d.plan.unplaced  # planned, nothing to give


def test_planned_pods_are_released_when_the_node_applies_and_not_before() -> None:
    n1 = node("n1", MIG)
    c = Cluster(n1, applied_np("n1", status_gpu(0), status_gpu(1)), gated("p", SEVEN_G))
    c.step(T0)  # opens the window
    d = c.step(T0 + 11)
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    (patch,) = [a for a in d.actions if isinstance(a, PatchPod)]
    assert patch.after_spec == "n1" and patch.purpose == "reserve"
    r = reservation(c, "p")
    assert (r.state, r.plan, r.deadline) == (State.PLANNED, w.spec.planId, T0 + 11 + 300)
    busy = c.objs[("NodePartitioning", "n1")]
    busy["metadata"]["generation"] = 3
    busy["spec"] = w.spec.model_dump(mode="json")
    c.put(with_alloc(n1, **{"7g_80gb": 1}))
    c.step(T0 + 12)  # the agent has not applied: still gated
    assert c.pod("p")["spec"]["schedulingGates"] == [{"name": GATE}]
    c.put(applied_np("n1", status_gpu(0, ("7g.80gb", 0, False)), status_gpu(1), generation=3))
    c.step(T0 + 20)
    assert (
        "schedulingGates" not in c.pod("p")["spec"] and reservation(c, "p").state is State.RELEASED
    )


def test_a_node_that_never_applies_gives_its_pods_back_after_the_deadline() -> None:
    c = Cluster(
        node("n1", MIG),
        node("n2", MIG),
        np("n1", plan="9", generation=3, observed=2, applied=True),  # busy: gen 3 not observed
        applied_np("n2", status_gpu(0), status_gpu(1)),
        gated("p", SEVEN_G),
    )
    pod = c.pod("p")
    pod["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {
                "node": "n1",
                "state": "planned",
                "gpus": {SEVEN_G: [0]},
                "plan": "9",
                "since": T0,
                "deadline": T0 + 300,
            }
        )
    }
    d = c.step(T0 + 299)
    assert reservation(c, "p").node == "n1" and not events(d, "ReservationDropped")
    d = c.step(T0 + 301)
    assert reservation(c, "p") is None
    assert events(d, "ReservationDropped") == [
        "node n1 did not apply plan 9 within 300 s (waited 301 s); planning it again"
    ]
    assert "n1" in d.state.cooldown and d.state.cooldown["n1"] == T0 + 301 + 300
    (node_event,) = [
        a for a in d.actions if isinstance(a, EmitEvent) and a.reason == "ApplyDeadlineMissed"
    ]
    assert node_event.ref.kind == "Node" and node_event.ref.name == "n1"
    d = c.step(T0 + 312)  # its new window (opened at 301) is due: planned on n2 only
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    assert w.node == "n2" and reservation(c, "p").node == "n2"


def _annotated(pod: dict[str, Any], doc: dict[str, Any]) -> dict[str, Any]:
    pod["metadata"]["annotations"] = {RESERVATION_ANNOTATION: json.dumps(doc)}
    return pod


@pytest.mark.parametrize("deadline", [None, 1e11, T0 + 86400])
def test_a_planned_reservation_without_a_near_deadline_still_has_one(
    deadline: float | None,
) -> None:
    # A hand-edited annotation without a deadline, or with one far off, waited forever on a
    # node that never applies; it is held to apply + bind deadlines past its ``since``.
    doc: dict[str, Any] = {
        "node": "n1", "state": "planned", "gpus": {SEVEN_G: [0]}, "plan": "9", "since": T0,
    }  # fmt: skip
    if deadline is not None:
        doc["deadline"] = deadline
    c = Cluster(
        node("n1", MIG),
        node("n2", MIG),
        np("n1", plan="9", generation=3, observed=2, applied=True),  # busy: gen 3 not observed
        applied_np("n2", status_gpu(0), status_gpu(1)),
        _annotated(gated("p", SEVEN_G), doc),
    )
    d = c.step(T0 + 419)
    assert reservation(c, "p").node == "n1" and not events(d, "ReservationDropped")
    d = c.step(T0 + 421)
    assert reservation(c, "p") is None
    assert events(d, "ReservationDropped") == [
        "node n1 did not apply plan 9 within 300 s (waited 421 s); planning it again"
    ]
    c.step(T0 + 432)
    assert reservation(c, "p").node == "n2"


@pytest.mark.parametrize(
    ("gpus", "held"),
    [
        ({}, "nothing"),
        ({SEVEN_G: [0]}, "nvidia.com/mig-7g.80gb x1"),
        ({ONE_G: [0, 0]}, "nvidia.com/mig-1g.10gb x2"),
    ],
)
def test_a_reservation_that_is_not_the_pods_request_is_ignored(
    gpus: dict[str, list[int]], held: str
) -> None:
    # The reservation holds exactly the pod's request (gpuslice writes no other): one that
    # held nothing let the pod be released for no slice while the free one went to the next;
    # one that held two units starved an older pod's legitimate hold.
    one_gpu = {**MIG, "nvidia.com/gpu.count": "1"}
    c = Cluster(
        with_alloc(node("n1", one_gpu), **{"1g_10gb": 1}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False))),
        _annotated(
            gated("a", ONE_G, created=T0),
            {"node": "n1", "state": "planned", "gpus": gpus, "since": T0, "deadline": T0 + 300},
        ),
        gated("b", ONE_G, created=T0 + 1),
    )
    d = c.step(T0 + 5)
    assert events(d, "InvalidReservation") == [
        f"annotation {RESERVATION_ANNOTATION} holds {held} but the pod asks for "
        f"{ONE_G} x1; ignored, the pod is planned again"
    ]
    released = [n for n in ("a", "b") if "schedulingGates" not in c.pod(n)["spec"]]
    assert released == ["a"]  # the older pod, for the one free slice, and only one pod
    assert reservation(c, "a").gpus == {ONE_G: (0,)}


@pytest.mark.parametrize(
    ("bend", "where"),
    [
        # (an unknown status field is a newer release's and is read past: test_contract_crd)
        (lambda g: g["mig"][0].__setitem__("used", "maybe"), "status.gpus.0.mig.0.used"),
        (lambda g: g["mig"][0].__setitem__("start", -1), "status.gpus.0.mig.0.start"),
    ],
)
def test_an_invalid_node_partitioning_is_told_on_the_node_and_its_pods_go_elsewhere(
    bend: Any, where: str
) -> None:
    # Before, such a node was left out of every plan with no condition, Event or problem.
    bad = applied_np("n1", status_gpu(0, ("7g.80gb", 0, False)), status_gpu(1))
    bend(bad["status"]["gpus"][0])
    c = Cluster(
        with_alloc(node("n1", MIG), **{"7g_80gb": 1}),
        bad,
        node("n2", MIG),
        applied_np("n2", status_gpu(0), status_gpu(1)),
        gated("p", SEVEN_G),
    )
    d = c.step(T0)
    (cond,) = [a for a in d.actions if isinstance(a, SetNodeCondition)]
    assert (cond.node, cond.status, cond.reason) == ("n1", "False", "InvalidPartitioning")
    assert where in cond.message and "kubectl edit nodepartitioning n1" in cond.message
    (warning,) = [
        a for a in d.actions if isinstance(a, EmitEvent) and a.reason == "InvalidPartitioning"
    ]
    assert warning.ref.kind == "Node" and warning.message == cond.message
    assert d.problems["n1"].reason == "InvalidPartitioning"
    c.step(T0 + 11)
    assert reservation(c, "p").node == "n2"  # n1's free 7g is not promised


def test_a_pod_recreated_under_the_same_name_is_told_its_own_story() -> None:
    # Events were remembered by namespace/name: a pod deleted and recreated between two steps
    # (a StatefulSet's, or kubectl replace) got none of its own.
    c = Cluster(node("n1", MIG), applied_np("n1", status_gpu(0), status_gpu(1)))
    c.put(_annotated(gated("p", SEVEN_G), {"node": "n1"}))  # no state: malformed
    d = c.step(T0)
    assert [len(events(d, r)) for r in ("InvalidReservation", "Gated")] == [1, 1]
    d = c.step(T0 + 1)
    assert not [a for a in d.actions if isinstance(a, EmitEvent)]  # told once
    again = _annotated(gated("p", SEVEN_G, created=T0 + 2), {"node": "n1"})
    again["metadata"]["uid"] = "uid-p-2"
    c.put(again)
    d = c.step(T0 + 3)
    assert [len(events(d, r)) for r in ("InvalidReservation", "Gated")] == [1, 1]
    assert {a.ref.uid for a in d.actions if isinstance(a, EmitEvent)} == {"uid-p-2"}


def test_a_released_pod_whose_slice_was_taken_is_replanned_on_its_node() -> None:
    n1 = with_alloc(node("n1", MIG), **{"1g_10gb": 1})
    thief = {
        "kind": "Pod",
        "metadata": {
            "name": "thief",
            "namespace": "ns",
            "uid": "uid-thief",
            "resourceVersion": "1",
        },
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "c", "resources": {"limits": {ONE_G: "1"}}}],
        },
        "status": {"phase": "Running"},
    }
    c = Cluster(
        n1,
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        gated("p", ONE_G),
    )
    c.step(T0)
    assert reservation(c, "p").state is State.RELEASED
    c.put(thief)  # a pod created while the webhook was down took the slice first
    d = c.step(T0 + 2)
    assert events(d, "SliceTaken") == [
        "its slice on node n1 is gone: another pod took it; the pod is pinned to node n1, so a "
        "new slice is planned there"
    ]
    c.step(T0 + 3)
    d = c.step(T0 + 14)
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    assert w.node == "n1"
    r = reservation(c, "p")
    assert (r.node, r.state, r.plan) == ("n1", State.RELEASED, w.spec.planId)


def test_a_released_pod_whose_node_is_gone_is_reported_stranded_with_the_recovery() -> None:
    c = Cluster(node("n2", MIG), applied_np("n2", status_gpu(0), status_gpu(1)), gated("p", ONE_G))
    pod = c.pod("p")
    pod["spec"].pop("schedulingGates")
    pod["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {
                "node": "n1",
                "state": "released",
                "gpus": {ONE_G: [0]},
                "since": T0,
                "deadline": T0 + 120,
            }
        )
    }
    d = c.step(T0 + 5)
    (msg,) = events(d, "Stranded")
    assert "node n1 is gone" in msg and "delete the pod so its controller recreates it" in msg
    assert not [a for a in d.actions if isinstance(a, WriteSpec)]
    assert not events(c.step(T0 + 6), "Stranded")  # once per change, not every cycle


def test_pods_gated_by_another_controller_wait_for_it() -> None:
    p = gated("p", ONE_G)
    p["spec"]["schedulingGates"].append({"name": "kueue.x-k8s.io/admission"})
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        p,
    )
    d = c.step(T0)
    assert reservation(c, "p") is None and d.counts.get("candidates", 0) == 0


BUSY0 = status_gpu(0, ("3g.40gb", 4, True))
BUSY1 = status_gpu(1, ("1g.10gb", 0, True), ("1g.10gb", 1, True), ("3g.40gb", 4, True))


def no_gpu_can_host_big(*waiting: dict[str, Any]) -> Cluster:
    """Two busy GPUs (a used 3g on each, two used 1g beside one of them) and a gated 7g pod
    ``big`` that no plan can place without moving them, plus ``waiting``."""
    three = "nvidia.com/mig-3g.40gb"
    return Cluster(
        node("n1", MIG),
        applied_np("n1", BUSY0, BUSY1),
        gated("big", SEVEN_G, created=T0),
        *waiting,
        running("a", "n1", three),
        running("b", "n1", ONE_G, ONE_G, three),
    )


def test_a_long_waiting_pod_no_gpu_can_host_gets_a_drain_then_the_emptied_gpu() -> None:
    c = no_gpu_can_host_big()
    c.step(T0 + 600)
    d = c.step(T0 + 611)
    assert d.plan is not None and "ns/big" in d.plan.unplaced
    (msg,) = events(d, "Draining")
    assert msg.startswith(
        "waited 611 s and no GPU can host it without moving pods: draining node n1 GPU 0"
    )
    r = reservation(c, "big")
    assert (r.state, dict(r.gpus)) == (State.DRAINING, {SEVEN_G: (0,)})
    (view,) = [a for a in d.actions if isinstance(a, WriteReservations)]
    assert [(e.state, e.gpus) for e in view.reservations] == [("draining", {SEVEN_G: [0]})]
    # GPU 0 empties (its pod ended): the waiting pod is planned there, nowhere else
    del c.objs[("Pod", "ns/a")]
    c.put(applied_np("n1", status_gpu(0, ("3g.40gb", 4, False)), BUSY1))
    d = c.step(T0 + 620)
    (w,) = [a for a in d.actions if isinstance(a, WriteSpec)]
    by_index = {g.index: [(m.profile, m.start) for m in g.mig] for g in w.spec.gpus}
    assert by_index[0] == [("7g.80gb", 0)]
    assert by_index[1] == [("1g.10gb", 0), ("1g.10gb", 1), ("3g.40gb", 4)]
    r = reservation(c, "big")
    assert (r.state, r.node, dict(r.gpus)) == (State.PLANNED, "n1", {SEVEN_G: (0,)})


@pytest.mark.parametrize("limit", [1.0, math.inf])
def test_no_drain_starts_while_the_queue_is_deeper_than_the_limit(limit: float) -> None:
    """The drain case above with two younger whole-GPU pods waiting too: 3 slice units wait on
    a 2-GPU cluster.  With a limit of 1 unit per GPU that is overload: no GPU is frozen, the
    pods wait their turn; without a limit the oldest gets its drain."""
    config = dataclasses.replace(CONFIG, drain_queue_limit=limit)
    c = no_gpu_can_host_big(
        gated("next1", SEVEN_G, created=T0 + 1), gated("next2", SEVEN_G, created=T0 + 2)
    )
    c.step(T0 + 600, config)
    d = c.step(T0 + 611, config)
    assert d.plan is not None and "ns/big" in d.plan.unplaced
    if limit == math.inf:
        assert events(d, "Draining") and reservation(c, "big").state is State.DRAINING
        return
    assert not events(d, "Draining") and d.counts["drains_deep_queue"] == 1
    assert all(reservation(c, n) is None for n in ("big", "next1", "next2"))
    # the queue shrinks to one unit per GPU (a pod was deleted): the oldest is drained
    del c.objs[("Pod", "ns/next2")]
    for t in (T0 + 700, T0 + 711, T0 + 722, T0 + 800):
        c.step(t, config)
    assert reservation(c, "big").state is State.DRAINING


def test_a_deep_queue_ends_a_drain_and_a_short_one_starts_it_again() -> None:
    """A drain started in a short queue ends when the queue has been deep for a batch window (a
    frozen GPU that has emptied would idle while the queue's pods could use it): the pod is a plain candidate
    again, with an Event; no drain starts while the queue stays deep, and once it is short
    the pod is drained again."""
    c = no_gpu_can_host_big()
    c.step(T0 + 600)
    c.step(T0 + 611)
    assert reservation(c, "big").state is State.DRAINING
    c.put(gated("next1", SEVEN_G, created=T0 + 612))
    c.put(gated("next2", SEVEN_G, created=T0 + 613))  # 3 units on 2 GPUs: deep
    d = c.step(T0 + 620)  # deep for less than a batch window: a burst, not yet overload
    assert "drains_ended_deep_queue" not in d.counts and not events(d, "ReservationDropped")
    assert d.next_wakeup is not None and d.next_wakeup <= T0 + 620 + CONFIG.policy.timeout
    d = c.step(T0 + 620 + CONFIG.policy.timeout)
    assert d.counts["drains_ended_deep_queue"] == 1
    (msg,) = events(d, "ReservationDropped")
    assert msg.startswith("drain of node n1 ended: 3 slice unit(s) wait for 2 GPU(s)")
    assert reservation(c, "big") is None and GATE in str(c.pod("big")["spec"])
    (view,) = [a for a in d.actions if isinstance(a, WriteReservations)]
    assert view.reservations == ()
    d = c.step(T0 + 740)
    assert not events(d, "Draining") and reservation(c, "big") is None
    del c.objs[("Pod", "ns/next1")]
    del c.objs[("Pod", "ns/next2")]
    for t in (T0 + 800, T0 + 811, T0 + 822, T0 + 900):
        c.step(t)
    assert reservation(c, "big").state is State.DRAINING


def test_pods_no_node_can_hold_now_do_not_crowd_out_the_ones_behind_them() -> None:
    """Two nodes, each with one GPU busy and one empty: two 7g units fit the cluster, but not on
    one node.  The older pod wants 2 x 7g (all on one node) and cannot be placed now; before,
    it took the whole 7g bound of the batch (2 units) and the younger one-GPU pod was capped out
    of every plan, waiting while a GPU sat empty.  Now the older pod enters the batch taking
    none of the bound (the plan tells it why it waits) and the younger one is planned onto an
    empty GPU.  A second pod of the same request waits outside the batch."""
    busy = status_gpu(0, ("7g.80gb", 0, True))
    whole = gated("whole", SEVEN_G, created=T0)
    whole["spec"]["containers"][0]["resources"]["limits"][SEVEN_G] = "2"
    whole2 = gated("whole2", SEVEN_G, created=T0 + 1)
    whole2["spec"]["containers"][0]["resources"]["limits"][SEVEN_G] = "2"
    c = Cluster(
        node("n1", MIG),
        applied_np("n1", busy, status_gpu(1)),
        node("n2", MIG),
        applied_np("n2", busy, status_gpu(1)),
        whole,
        whole2,
        gated("one", SEVEN_G, created=T0 + 5),
        running("a", "n1", SEVEN_G),
        running("b", "n2", SEVEN_G),
    )
    c.step(T0 + 100)
    d = c.step(T0 + 111)  # the window idles out: plan
    assert d.counts["too_big_now"] == 2 and "capped" not in d.counts
    assert d.plan is not None and d.plan.unplaced["ns/whole"].startswith("capacity")
    # the younger pod of the same request waits outside the batch: it stays small
    assert d.snapshot is not None
    assert {p.name for p in d.snapshot.pods} == {"ns/whole", "ns/one"}
    r = reservation(c, "one")
    assert r is not None and r.state is State.PLANNED and dict(r.gpus) == {SEVEN_G: (1,)}
    assert reservation(c, "whole") is None


def test_a_drain_prefers_a_gpu_whose_layout_already_has_the_pods_instance() -> None:
    """GPU 0 holds a used 4g + a used 3g (load 7), GPU 1 a used 1g + a used 3g (load 4): no
    plan can place a 4g without moving a pod.  A waiting 4g pod is drained onto GPU 0, the more
    loaded one: once it empties, its 4g instance serves the
    pod as it is, with no new layout now and none to undo later (the least loaded GPU would
    need 4g + 3g made for it and, after it, the layout back for the next whole-GPU pod)."""
    four, three = "nvidia.com/mig-4g.40gb", "nvidia.com/mig-3g.40gb"
    gpu0 = status_gpu(0, ("4g.40gb", 0, True), ("3g.40gb", 4, True))
    gpu1 = status_gpu(1, ("1g.10gb", 0, True), ("3g.40gb", 4, True))
    c = Cluster(
        with_alloc(node("n1", MIG), **{"4g_40gb": 1, "3g_40gb": 2, "1g_10gb": 1}),
        applied_np("n1", gpu0, gpu1),
        gated("waits", four, created=T0),
        running("a", "n1", four),
        running("b", "n1", three),
        running("c", "n1", three, ONE_G),
    )
    c.step(T0 + 600)
    d = c.step(T0 + 611)
    (msg,) = events(d, "Draining")
    assert "draining node n1 GPU 0" in msg
    assert dict(reservation(c, "waits").gpus) == {four: (0,)}
    # GPU 0 empties: the pod gets its 4g instance, and no spec is written (no new layout)
    for gone in ("a", "b"):
        del c.objs[("Pod", f"ns/{gone}")]
    c.put(applied_np("n1", status_gpu(0, ("4g.40gb", 0, False), ("3g.40gb", 4, False)), gpu1))
    d = c.step(T0 + 620)
    assert not [a for a in d.actions if isinstance(a, WriteSpec)]
    r = reservation(c, "waits")
    assert (r.node, dict(r.gpus)) == ("n1", {four: (0,)})
    assert r.state in (State.PLANNED, State.RELEASED)


BUDGET_OF_ONE = dataclasses.replace(CONFIG, drain_fraction=0.25, drain_queue_limit=math.inf)
"""Drain budget 1 GPU (a quarter of 2, at least 1); no queue limit (3 units waiting on 2 GPUs
would count as overload with the default one)."""


def whole_node_waits(*others: dict[str, Any]) -> Cluster:
    """Node n1 (2 GPUs, each with a 1g and a 3g instance in use) and a gated pod ``whole``
    asking for both GPUs, beside ``others``."""
    busy = [status_gpu(i, ("1g.10gb", 0, True), ("3g.40gb", 4, True)) for i in (0, 1)]
    three = "nvidia.com/mig-3g.40gb"
    whole_node = gated("whole", SEVEN_G, created=T0)
    whole_node["spec"]["containers"][0]["resources"]["limits"][SEVEN_G] = "2"
    return Cluster(
        node("n1", MIG),
        applied_np("n1", *busy),
        whole_node,
        *others,
        running("a", "n1", ONE_G, three),
        running("b", "n1", ONE_G, three),
    )


def test_a_pod_larger_than_the_drain_budget_is_not_drained_and_holds_no_one_back() -> None:
    """The older pod needs both GPUs of the node and is never drained; the younger one-GPU pod
    behind it gets its drain."""
    config = BUDGET_OF_ONE
    c = whole_node_waits(gated("one", "nvidia.com/mig-4g.40gb", created=T0 + 5))
    c.step(T0 + 600, config)
    d = c.step(T0 + 611, config)
    # no node can hold both units now: in the batch (told why), taking none of its bound
    assert d.plan is not None and "ns/whole" in d.plan.unplaced
    assert d.counts["too_big_now"] == 1
    (msg,) = events(d, "Draining")
    assert msg.startswith("waited 606 s") and "draining node n1 GPU 0" in msg
    assert reservation(c, "whole") is None
    assert reservation(c, "one").state is State.DRAINING
    # the whole-node pod's owner is told why no GPU is emptied for it, and what changes that
    (told,) = [a for a in d.actions if isinstance(a, EmitEvent) and a.reason == "NotDrained"]
    assert told.ref.name == "whole" and told.type == "Normal"
    assert told.message.startswith(
        "waits for 2 GPU(s) on one node, more than the drain budget of 1 GPU(s) "
        "(drainFraction 0.25 of the cluster's GPUs)"
    )
    assert "drainFraction" in told.message and "node pool of their own" in told.message


def test_a_pod_larger_than_the_drain_budget_is_told_once() -> None:
    c = whole_node_waits()
    steps = [c.step(T0 + t, BUDGET_OF_ONE) for t in range(600, 900, 10)]
    # the batch was planned again and again, each time looking for drains; none started
    planned = [d for d in steps if d.plan is not None]
    assert len(planned) >= 3 and all("ns/whole" in d.plan.unplaced for d in planned)
    assert not any(d.counts.get("drains_started") for d in steps)
    assert [len(events(d, "NotDrained")) for d in planned] == [1] + [0] * (len(planned) - 1)
    assert sum(len(events(d, "NotDrained")) for d in steps) == 1


@pytest.mark.parametrize("waited", [200, 500, 30_000])
@pytest.mark.parametrize("queue_limit", [1.0, 0.1])
def test_free_slices_wait_for_an_older_starving_pod_to_be_planned(
    waited: float, queue_limit: float
) -> None:
    """A free 7g instance and two gated pods: an older 4g pod no free slice serves and a younger
    7g pod the free instance fits. Past the first waiting tier (300 s) the older pod keeps the
    node's free slices from the younger one, and the next plan repartitions the 7g for it;
    before that, the younger pod takes the free slice at once.  That is a shallow queue; two
    units waiting on two GPUs is a deep one for a ``drain_queue_limit`` of 0.1 per GPU
    (threshold: 1 unit), where throughput comes first and only a pod past ``aged_after_s`` (8 h)
    keeps slices."""
    four = "nvidia.com/mig-4g.40gb"
    config = dataclasses.replace(CONFIG, drain_queue_limit=queue_limit)
    c = Cluster(
        with_alloc(node("n1", MIG), **{"7g_80gb": 2}),
        applied_np("n1", status_gpu(0, ("7g.80gb", 0, False)), status_gpu(1, ("7g.80gb", 0, True))),
        gated("old", four, created=T0),
        gated("young", SEVEN_G, created=T0 + waited - 60),
        running("busy", "n1", SEVEN_G),
    )
    c.step(T0 + waited, config)
    if waited < 300 or (queue_limit < 1 and waited < 28_800):
        assert reservation(c, "young").state is State.RELEASED
        assert reservation(c, "old") is None
        return
    assert reservation(c, "young") is None
    c.step(T0 + waited + 11, config)  # the window idles out: plan
    r = reservation(c, "old")
    assert (r.state, r.node, dict(r.gpus)) == (State.PLANNED, "n1", {four: (0,)})
    assert reservation(c, "young") is None


@pytest.mark.parametrize(
    ("queue_limit", "whole_waited"), [(math.inf, 30), (0.1, 30), (0.1, 30_000)]
)
def test_in_a_deep_queue_free_slices_go_to_the_smallest_pods_first(
    queue_limit: float, whole_waited: float
) -> None:
    """Two free 7g instances on one node; an older pod wants both (2 x 7g), two younger ones one
    each.  In a shallow queue free slices go oldest first: the older pod takes both.  When more
    units wait than ``drain_queue_limit`` per GPU (4 units on 2 GPUs, threshold 1) throughput
    rules, as in the plan's objective (pods placed): the two one-GPU pods get them and the
    older pod waits, unless it has waited past ``aged_after_s`` (8 h)."""
    now = T0 + 30
    whole = gated("whole", SEVEN_G, created=now - whole_waited)
    whole["spec"]["containers"][0]["resources"]["limits"][SEVEN_G] = "2"
    config = dataclasses.replace(CONFIG, drain_queue_limit=queue_limit)
    c = Cluster(
        with_alloc(node("n1", MIG), **{"7g_80gb": 2}),
        applied_np(
            "n1", status_gpu(0, ("7g.80gb", 0, False)), status_gpu(1, ("7g.80gb", 0, False))
        ),
        whole,
        gated("one", SEVEN_G, created=T0 + 10),
        gated("two", SEVEN_G, created=T0 + 20),
    )
    d = c.step(now, config)
    assert d.plan is None  # free slices, no plan
    if queue_limit == math.inf or whole_waited > 28_800:
        r = reservation(c, "whole")
        assert (r.state, r.node, dict(r.gpus)) == (State.RELEASED, "n1", {SEVEN_G: (0, 1)})
        assert reservation(c, "one") is None and reservation(c, "two") is None
        return
    assert reservation(c, "whole") is None
    got = {n: dict(reservation(c, n).gpus)[SEVEN_G] for n in ("one", "two")}
    assert reservation(c, "one").state is State.RELEASED
    assert sorted(got.values()) == [(0,), (1,)]


def test_in_a_deep_queue_a_pod_past_aged_after_keeps_one_node_only() -> None:
    """Deep queue (5 units on 4 GPUs, threshold 1): two 4g pods past ``aged_after_s`` (8 h) that
    no free slice serves, and three young 7g pods.  Free 7g instances: one on n1, two on n2.
    The oldest 4g pod keeps n2 (the most idle compute) for the next plan; the second 4g pod
    keeps nothing more (one node per request), so a young 7g pod takes n1's free instance.
    In a shallow queue the first 4g pod would keep every node's free slices."""
    four = "nvidia.com/mig-4g.40gb"
    now = T0 + 40_000
    c = Cluster(
        with_alloc(node("n1", MIG), **{"7g_80gb": 2}),
        applied_np("n1", status_gpu(0, ("7g.80gb", 0, False)), status_gpu(1, ("7g.80gb", 0, True))),
        with_alloc(node("n2", MIG), **{"7g_80gb": 2}),
        applied_np(
            "n2", status_gpu(0, ("7g.80gb", 0, False)), status_gpu(1, ("7g.80gb", 0, False))
        ),
        gated("old4a", four, created=T0),
        gated("old4b", four, created=T0 + 1),
        gated("y1", SEVEN_G, created=now - 30),
        gated("y2", SEVEN_G, created=now - 20),
        gated("y3", SEVEN_G, created=now - 10),
        running("busy", "n1", SEVEN_G),
    )
    c.step(now)
    r = reservation(c, "y1")
    assert (r.state, r.node) == (State.RELEASED, "n1")
    assert reservation(c, "y2") is None and reservation(c, "y3") is None  # n2 is kept
    assert reservation(c, "old4a") is None and reservation(c, "old4b") is None


def test_a_drained_gpu_takes_no_other_pod() -> None:
    free_1g = status_gpu(0, ("1g.10gb", 0, False), ("3g.40gb", 4, True))
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", free_1g, status_gpu(1, ("7g.80gb", 0, True))),
        gated("big", SEVEN_G, created=T0),
        gated("small", ONE_G, created=T0 + 700),
        running("a", "n1", "nvidia.com/mig-3g.40gb"),
        running("b", "n1", SEVEN_G),
    )
    c.pod("big")["metadata"]["annotations"] = {
        RESERVATION_ANNOTATION: json.dumps(
            {"node": "n1", "state": "draining", "gpus": {SEVEN_G: [0]}, "since": T0 + 650}
        )
    }
    d = c.step(T0 + 701)
    assert reservation(c, "small") is None  # the free 1g sits on the drained GPU
    assert d.counts.get("fast", 0) == 0


def test_without_reservations_nothing_is_gated_reserved_or_released() -> None:
    config = DecideConfig(
        catalog=CAT, policy=BatchPolicy(60, 10, 60), planner=plan_greedy, reservation=False
    )
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        gated("p", ONE_G),
    )
    d = c.step(T0, config)
    assert "schedulingGates" not in c.pod("p")["spec"]  # a leftover gate is removed
    assert reservation(c, "p") is None and events(d, "Ungated")
    assert not [a for a in d.actions if isinstance(a, WriteReservations)]


@pytest.mark.parametrize(
    ("limits", "why"),
    [
        ({ONE_G: "1", "nvidia.com/gpu": "1"}, "asks for whole GPUs (nvidia.com/gpu: 1)"),
        ({ONE_G: "1.5"}, "invalid resource request"),
    ],
)
def test_without_reservations_a_gated_pod_gpuslice_cannot_read_loses_the_gate(
    limits: dict[str, str], why: str
) -> None:
    """Reservations off: nothing will ever release a gated pod, so one whose request the
    partitioner cannot read as a slice request (rejected before the legacy path) loses the
    gate at once too, not after a batch window and never kept forever."""
    config = DecideConfig(
        catalog=CAT, policy=BatchPolicy(60, 10, 60), planner=plan_greedy, reservation=False
    )
    bad = gated("bad", ONE_G)
    bad["spec"]["containers"][0]["resources"]["limits"] = limits
    c = Cluster(
        with_alloc(node("n1", MIG), **{"1g_10gb": 1}),
        applied_np("n1", status_gpu(0, ("1g.10gb", 0, False)), status_gpu(1)),
        bad,
    )
    d = c.step(T0, config)
    assert "schedulingGates" not in c.pod("bad")["spec"], (
        "pod ns/bad kept gpuslice's gate with reservations off: nothing would ever remove it"
    )
    (msg,) = events(d, "Ungated")
    assert "reservations are off" in msg and why in msg
    d = c.step(T0 + 5, config)  # ungated now: still reported, never gated again
    assert events(d, "Ungated") == [] and "schedulingGates" not in c.pod("bad")["spec"]


@pytest.mark.parametrize("deadline", [math.inf, T0 + 1])
def test_reservation_annotations_round_trip(deadline: float) -> None:
    from partitioner.reservations import Reservation

    r = Reservation("n1", State.PLANNED, {ONE_G: (0, 3)}, "7", T0, deadline)
    assert parse_reservation(r.to_json()) == r


def test_with_drain_overtaken_only_an_overtaken_pod_is_drained() -> None:
    """``drain_overtaken`` = 2: the long-waiting 7g pod gets no drain while only one younger
    slice pod is bound (everyone waits in turn), and a drain once a second one is."""
    config = dataclasses.replace(CONFIG, drain_overtaken=2)
    three = "nvidia.com/mig-3g.40gb"

    def younger(name: str, *resources: str) -> dict[str, Any]:
        pod = running(name, "n1", *resources)
        pod["metadata"]["creationTimestamp"] = "2027-01-15T08:05:00Z"  # after T0
        return pod

    c = Cluster(
        node("n1", MIG),
        applied_np("n1", BUSY0, BUSY1),
        gated("big", SEVEN_G, created=T0),
        running("a", "n1", three),  # older than "big" (no creation time: not counted)
        younger("b", ONE_G, ONE_G, three),
    )
    c.step(T0 + 600, config)
    d = c.step(T0 + 611, config)
    assert d.plan is not None and "ns/big" in d.plan.unplaced
    assert events(d, "Draining") == [] and reservation(c, "big") is None
    c.put(younger("c", ONE_G))
    c.put(applied_np("n1", BUSY0, status_gpu(1, ("1g.10gb", 0, True), ("1g.10gb", 1, True),
                                               ("1g.10gb", 2, True), ("3g.40gb", 4, True))))  # fmt: skip
    c.step(T0 + 700, config)  # the change opens a window; planned after its idle time
    d = c.step(T0 + 711, config)
    (msg,) = events(d, "Draining")
    assert "draining node n1 GPU 0" in msg
    assert reservation(c, "big").state is State.DRAINING
    with pytest.raises(ValueError, match="drain_overtaken"):
        dataclasses.replace(CONFIG, drain_overtaken=-1)


@pytest.mark.parametrize(("aged_after", "whole_first"), [(28_800.0, False), (20_000.0, True)])
def test_in_a_deep_queue_aged_after_decides_who_goes_first(
    aged_after: float, whole_first: bool
) -> None:
    """The deep-queue rule of the smallest-first test with the older pod at 25,000 s: under the
    default ``aged_after_s`` (8 h, below the planner's last waiting tier since 2026-12-02) the
    two one-GPU pods take the free instances; with ``aged_after_s`` at 20,000 s the older
    two-GPU pod has aged and takes both."""
    now = T0 + 25_000
    whole = gated("whole", SEVEN_G, created=now - 25_000)
    whole["spec"]["containers"][0]["resources"]["limits"][SEVEN_G] = "2"
    config = dataclasses.replace(CONFIG, drain_queue_limit=0.1, aged_after_s=aged_after)
    c = Cluster(
        with_alloc(node("n1", MIG), **{"7g_80gb": 2}),
        applied_np(
            "n1", status_gpu(0, ("7g.80gb", 0, False)), status_gpu(1, ("7g.80gb", 0, False))
        ),
        whole,
        gated("one", SEVEN_G, created=now - 20),
        gated("two", SEVEN_G, created=now - 10),
    )
    c.step(now, config)
    if whole_first:
        assert reservation(c, "whole").state is State.RELEASED
        assert reservation(c, "one") is None and reservation(c, "two") is None
    else:
        assert reservation(c, "whole") is None
        assert reservation(c, "one").state is State.RELEASED
        assert reservation(c, "two").state is State.RELEASED


def test_a_negative_aged_after_is_refused() -> None:
    with pytest.raises(ValueError, match="aged_after_s"):
        DecideConfig(catalog=CONFIG.catalog, aged_after_s=-1.0)


def test_a_pinned_pod_keeps_what_is_left_of_its_slices_from_newer_pods() -> None:
    """``p`` (two 1g) was released to n1's two free 1g and an ungated pod took one: its promise
    broke, and it stays pinned to n1.  The 1g left is kept for it, not given to ``q``, a gated
    1g pod that arrived meanwhile (before: ``q`` got it by the fast path, and ``p`` needed two
    new slices); once the thief's slice frees too, ``p``'s promise holds again."""
    n1 = with_alloc(node("n1", MIG), **{"1g_10gb": 2})
    p = gated("p", ONE_G)
    p["spec"]["containers"][0]["resources"]["limits"][ONE_G] = "2"
    c = Cluster(
        n1, applied_np("n1", status_gpu(0, ("1g.10gb", 0, False), ("1g.10gb", 1, False))), p
    )
    c.step(T0)
    assert reservation(c, "p").state is State.RELEASED
    c.put(running("thief", "n1", ONE_G))  # created while the webhook was down
    c.put(gated("q", ONE_G, created=T0 + 1))
    d = c.step(T0 + 2)
    assert len(events(d, "SliceTaken")) == 1
    assert reservation(c, "q") is None and events(d, "Reserved") == []
    del c.objs[("Pod", "ns/thief")]  # the thief ended
    c.step(T0 + 4)
    r = reservation(c, "p")
    assert r is not None and (r.node, r.state) == ("n1", State.RELEASED)
    assert dict(r.gpus) == {ONE_G: (0, 0)} and reservation(c, "q") is None


def test_a_pod_asking_for_two_mps_slices_stays_gated_and_is_told_why() -> None:
    """Pods gpuslice can never place lose their gate after a batch window, so kube-scheduler
    places them elsewhere; not a pod asking for two MPS slices: gpuslice's own MPS nodes
    advertise them, kube-scheduler would bind it there beside promises it does not know, and
    its container would be refused slices of two MPS daemons.  It keeps the gate, with one
    ``Unplaceable`` Event naming what to ask for, and the one-slice pod beside it is served."""
    mps = {"gpuslice.io/partitioning": "mps", **A100}
    free = {"memoryMiB": 8192, "activeThreadPercentage": 10}
    pair = gated("pair", "nvidia.com/gpu-8gb")
    pair["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu-8gb"] = "2"
    c = Cluster(
        with_alloc(node("m", mps)),
        np("m", observed=1, applied=True, mode="mps", gpus=[{"index": 0, "mps": [free, free]}]),
        pair,
        gated("one", "nvidia.com/gpu-8gb", created=T0 + 1),
    )
    c.objs[("Node", "m")]["status"]["allocatable"]["nvidia.com/gpu-8gb"] = "2"
    told: list[str] = []
    for t in (T0 + 2, T0 + 70, T0 + 200, T0 + 400):
        told += events(c.step(t), "Unplaceable")
    assert told == [
        "cannot place: more than one MPS slice: the pod asks for 2 MPS slices; a container "
        "reaches one MPS daemon (one GPU, or one MIG instance on a hybrid node), so gpuslice "
        "gives an MPS pod one slice: ask for one slice of the memory it needs "
        "(nvidia.com/gpu-16gb, if one GPU holds it), or for MIG instances "
        "(nvidia.com/mig-<profile>) to use several GPUs"
    ]
    assert c.pod("pair")["spec"]["schedulingGates"] == [{"name": GATE}]
    assert reservation(c, "pair") is None
    r = reservation(c, "one")
    assert r is not None and r.state is State.RELEASED
