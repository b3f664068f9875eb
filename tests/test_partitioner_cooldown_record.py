"""Node cool-downs are recorded on the NodePartitioning (annotation ``gpuslice.io/cooldown``),
so a restarted controller or a new leader keeps the cool-downs the previous one started.

Before, they lived in the controller's memory only: a restart within a cool-down planned the
refused layout onto the Degraded node once more, and a new leader released pods to a node whose
kubelet had just refused one (once the refused pod was deleted)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from test_partitioner_promises import (
    SEVEN_G,
    T0,
    Cluster,
    applied_np,
    gated,
    reservation,
)
from test_partitioner_review4_promises import ONE_GPU, all_events, apply_specs
from test_partitioner_review4_refused_spec import RefusingApi
from test_partitioner_snapshot import node

from contract.nodepartitioning import NodePartitioning
from partitioner.actions import MarkCooldown
from partitioner.decide import ControllerState, Decision
from partitioner.kubeapi import ApiError, NotFound
from partitioner.operator import cool_refused_specs
from partitioner.reservations import State
from partitioner.snapshot import COOLDOWN_ANNOTATION, cooldown_annotation, cooldown_of
from partitioner.writer import WriteBackoff, execute


def marks(d: Decision) -> list[MarkCooldown]:
    return [a for a in d.actions if isinstance(a, MarkCooldown)]


def recorded(c: Cluster, name: str) -> tuple[float, str] | None:
    return cooldown_of(NodePartitioning.model_validate(c.objs[("NodePartitioning", name)]))


def degraded_cluster() -> Cluster:
    return Cluster(
        node("n1", ONE_GPU),
        applied_np("n1", status_gpu0()),
        node("n2", ONE_GPU),
        applied_np("n2", status_gpu0()),
        gated("p", SEVEN_G),
    )


def status_gpu0() -> dict[str, Any]:
    return {"index": 0, "migEnabled": True, "mig": []}


@pytest.mark.parametrize("restart", [False, True])
def test_a_degraded_nodes_cooldown_survives_a_restart(restart: bool) -> None:
    """n1's agent refuses its spec: n1 cools down and the pod goes to n2, also when the
    controller restarts right after the cool-down began (a fresh state reads the record)."""
    c = degraded_cluster()
    seen: list[tuple[str, str, str]] = []
    written: list[MarkCooldown] = []
    restarted = False
    for t in range(0, 1800, 10):
        if restart and written and not restarted:
            c.state, restarted = ControllerState(), True
        d = c.step(T0 + t)
        seen += all_events(d)
        written += marks(d)
        apply_specs(c, d, refuse="n1")
        r = reservation(c, "p")
        if r is not None and r.state is State.RELEASED:
            break
    assert restarted == restart
    r = reservation(c, "p")
    assert r is not None and r.state is State.RELEASED and r.node == "n2", seen
    reserved_on_n1 = [m for n, why, m in seen if n == "p" and why == "Reserved" and "n1" in m]
    assert len(reserved_on_n1) == 1, reserved_on_n1
    (cool,) = [m for n, why, m in seen if n == "n1" and why == "DegradedCooldown"]
    assert "300 s" in cool
    (mark,) = written  # written once, not again by the restarted controller
    assert mark.node == "n1" and mark.reason == "DegradedCooldown" and mark.until is not None
    got = recorded(c, "n1")
    assert got is not None and got[1] == "DegradedCooldown"
    assert mark.until - 0.001 <= got[0] <= mark.until


def test_the_record_is_removed_when_the_cooldown_ends_and_the_node_is_planned_again() -> None:
    c = degraded_cluster()
    until = None
    for t in range(0, 400, 10):
        d = c.step(T0 + t)
        apply_specs(c, d, refuse="n1")
        for m in marks(d):
            until = m.until
        if until is not None:
            break
    assert until is not None
    c.state = ControllerState()  # a restart: the record alone keeps n1 cooling
    d = c.step(until - 1)
    assert not marks(d) and recorded(c, "n1") is not None
    assert d.state.cooldown["n1"] == pytest.approx(until, abs=0.001)
    assert d.next_wakeup is not None and d.next_wakeup <= until
    d = c.step(until + 1)
    assert marks(d) == [MarkCooldown("n1", None)]
    assert recorded(c, "n1") is None
    assert COOLDOWN_ANNOTATION not in c.objs[("NodePartitioning", "n1")]["metadata"]["annotations"]
    assert "n1" not in d.state.cooldown


def test_a_hand_edited_record_is_read_as_none_and_removed() -> None:
    c = degraded_cluster()
    meta = c.objs[("NodePartitioning", "n1")]["metadata"]
    meta["annotations"] = {COOLDOWN_ANNOTATION: "next tuesday"}
    d = c.step(T0)
    assert marks(d) == [MarkCooldown("n1", None)] and "n1" not in d.state.cooldown


def test_a_record_never_shortens_the_cooldown_in_memory() -> None:
    """A record that ends sooner than the running controller's cool-down (a hand edit) is
    rewritten to the controller's end."""
    c = degraded_cluster()
    c.state = ControllerState(cooldown={"n1": T0 + 500}, cooldown_why={"n1": "ApplyDeadlineMissed"})
    meta = c.objs[("NodePartitioning", "n1")]["metadata"]
    meta["annotations"] = {COOLDOWN_ANNOTATION: cooldown_annotation(T0 + 100, "x")}
    d = c.step(T0 + 10)
    assert d.state.cooldown["n1"] == T0 + 500
    assert marks(d) == [MarkCooldown("n1", T0 + 500, "ApplyDeadlineMissed")]


@pytest.mark.parametrize("until", [T0 + 0.0004, T0 + 123.4567, 1.0e9 + 0.9999])
def test_the_annotation_is_floored_to_the_millisecond(until: float) -> None:
    doc = json.loads(cooldown_annotation(until, "AdmissionRejected"))
    assert doc["until"].endswith("Z") and doc["reason"] == "AdmissionRejected"
    np = NodePartitioning.model_validate(
        {
            "metadata": {"name": "n1", "annotations": {COOLDOWN_ANNOTATION: json.dumps(doc)}},
            "spec": {"planId": "", "mode": "mig", "gpus": []},
        }
    )
    got = cooldown_of(np)
    assert got is not None
    assert until - 0.001 <= got[0] <= until + 1e-6 and got[1] == "AdmissionRejected"


def test_a_refused_spec_write_cools_down_with_its_reason() -> None:
    state = cool_refused_specs(ControllerState(), {"n1": ("ns/p",)}, T0, 300.0)
    assert state.cooldown == {"n1": T0 + 300} and state.cooldown_why == {"n1": "WriteRefused"}


class _Api:
    def __init__(self, missing: set[str]) -> None:
        self.missing = missing
        self.calls: list[tuple[str, str, Any]] = []

    async def patch(self, path: str, body: Any, content_type: str = "") -> dict[str, Any]:
        self.calls.append(("PATCH", path, body))
        if path.rsplit("/", 1)[-1] in self.missing:
            raise NotFound(404, "NotFound", "gone", path)
        return {"metadata": {"name": path.rsplit("/", 1)[-1]}}


def test_the_writer_merges_the_annotation_and_passes_a_deleted_object_by() -> None:
    api = _Api(missing={"gone"})
    out = asyncio.run(
        execute(
            api,  # type: ignore[arg-type]
            [
                MarkCooldown("n1", T0 + 300, "DegradedCooldown"),
                MarkCooldown("n2", None),
                MarkCooldown("gone", T0, "ApplyDeadlineMissed"),
            ],
        )
    )
    assert not out.failures and not out.write_failures
    (_, p1, b1), (_, p2, b2), _ = api.calls
    assert p1.endswith("/nodepartitionings/n1") and p2.endswith("/nodepartitionings/n2")
    value = b1["metadata"]["annotations"][COOLDOWN_ANNOTATION]
    assert json.loads(value)["reason"] == "DegradedCooldown"
    assert b2 == {"metadata": {"annotations": {COOLDOWN_ANNOTATION: None}}}


class _Recording(RefusingApi):
    """RefusingApi that also records the Events posted."""

    def __init__(self, c: Cluster) -> None:
        super().__init__(c)
        self.events: list[dict[str, Any]] = []

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path.endswith("/events"):
            self.events.append(body)
        return body


def test_a_refused_spec_is_told_as_a_cooldown_and_the_wait_names_it() -> None:
    """A spec write the API server refuses cools the node down: WriteRefused says so (it said
    the write would be tried again within a minute), and the pod's Waiting Event names the
    refusal (it blamed 'a promise it did not keep', sending the operator to the agent)."""
    c = Cluster(node("n1", ONE_GPU), applied_np("n1", status_gpu0()), gated("p", SEVEN_G))
    api = _Recording(c)
    clock = [0.0]
    backoff = WriteBackoff(base_s=1.0, cap_s=60.0, clock=lambda: clock[0])
    waiting: list[str] = []
    for t in range(0, 200, 10):
        clock[0] = float(t)
        d = c.step(T0 + t)
        waiting += [m for n, why, m in all_events(d) if n == "p" and why == "Waiting"]
        outcome = asyncio.run(execute(api, d.actions, backoff=backoff))  # type: ignore[arg-type]
        if outcome.refused_specs:
            c.state = cool_refused_specs(c.state, outcome.refused_specs, T0 + t, 300.0)
    (refused,) = [e for e in api.events if e["reason"] == "WriteRefused"]
    assert "left out of plans for cooldownSeconds" in refused["message"]
    assert "tries it again" not in refused["message"]
    assert waiting and "the API server refused its spec" in waiting[-1], waiting
    assert api.tries["n1"] == 1


def test_a_refused_cooldown_record_is_told_and_backed_off() -> None:
    """The cool-down annotation is a write like the others: refused, it is told once
    (WriteRefused) and held back, never raised."""
    events: list[dict[str, Any]] = []

    class Refusing:
        async def patch(self, path: str, body: Any, content_type: str = "") -> dict[str, Any]:
            raise ApiError(403, "Forbidden", "nodepartitionings is forbidden", path)

        async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            events.append(body)
            return body

    backoff = WriteBackoff(base_s=1.0, cap_s=60.0, clock=lambda: 0.0)
    mark = MarkCooldown("n1", T0 + 300, "DegradedCooldown")
    out = asyncio.run(execute(Refusing(), [mark], backoff=backoff))  # type: ignore[arg-type]
    assert out.write_failures == [("mark_cooldown", "403")]
    out = asyncio.run(execute(Refusing(), [mark], backoff=backoff))  # type: ignore[arg-type]
    assert out.held_back == ["mark_cooldown n1"]
    (told,) = [e for e in events if e["reason"] == "WriteRefused"]
    assert "cool-down annotation" in told["message"]


def test_gpuslice_status_shows_the_cooldown_and_the_pod_waiting_for_it() -> None:
    """`gpuslice status` reads the record: the node row says why and until when, and a pod
    whose only node cools down is `waiting` with that reason (it said `queued`)."""
    from gpuslice.commands.status import status_document

    c = Cluster(node("n1", ONE_GPU), applied_np("n1", status_gpu0()), gated("p", SEVEN_G))
    meta = c.objs[("NodePartitioning", "n1")]["metadata"]
    meta["annotations"] = {COOLDOWN_ANNOTATION: cooldown_annotation(T0 + 240, "DegradedCooldown")}

    def doc(now: float) -> dict[str, Any]:
        objs = c.objs
        return status_document(
            [o for (k, _), o in objs.items() if k == "Node"],
            [o for (k, _), o in objs.items() if k == "Pod"],
            [o for (k, _), o in objs.items() if k == "NodePartitioning"],
            now,
        )

    d = doc(T0)
    (row,) = d["nodes"]
    assert row["cooldown"] == "DegradedCooldown, ends in 4m"
    (pod,) = d["pods"]
    assert pod["state"] == "waiting" and "n1 (cooling down after DegradedCooldown)" in pod["detail"]
    d = doc(T0 + 241)  # over
    assert d["nodes"][0]["cooldown"] is None and d["pods"][0]["state"] == "queued"


def test_a_record_never_cools_a_node_longer_than_one_cooldown_from_now() -> None:
    """A record written by a replica whose clock ran ahead (or under a longer cooldownSeconds)
    is capped at cooldownSeconds from now, and rewritten so."""
    c = degraded_cluster()
    meta = c.objs[("NodePartitioning", "n1")]["metadata"]
    meta["annotations"] = {COOLDOWN_ANNOTATION: cooldown_annotation(T0 + 30 * 86400, "x")}
    d = c.step(T0)
    assert d.state.cooldown["n1"] == T0 + 300
    assert marks(d) == [MarkCooldown("n1", T0 + 300, "x")]


def test_the_what_if_leaves_a_cooling_node_out_as_the_controller_does() -> None:
    from partitioner.snapshot import read_kubectl_list
    from planner.catalog import default_catalog

    c = Cluster(node("n1", ONE_GPU), applied_np("n1", status_gpu0()), gated("p", SEVEN_G))
    items = [dict(o) for o in c.objs.values()]
    for o in items:
        o.setdefault(
            "apiVersion", "gpuslice.io/v1alpha1" if o["kind"] == "NodePartitioning" else "v1"
        )
    reading = read_kubectl_list({"kind": "List", "items": items}, default_catalog())
    assert "ns/p" in reading.candidates  # no record: planned
    meta = c.objs[("NodePartitioning", "n1")]["metadata"]
    meta["annotations"] = {COOLDOWN_ANNOTATION: cooldown_annotation(T0 + 240, "DegradedCooldown")}
    reading = read_kubectl_list({"kind": "List", "items": items}, default_catalog())
    assert reading.problems["n1"].reason == "CoolingDown"
    assert "DegradedCooldown" in reading.problems["n1"].message
    assert not reading.nodes and "n1 (CoolingDown)" in reading.waiting["ns/p"]
