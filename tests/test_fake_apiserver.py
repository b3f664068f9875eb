"""The test API server (tests/fake_apiserver.py) refuses what Kubernetes refuses for pods.

Every operator test runs against this server, so a rule it lacks would let a controller bug
through.  Each rule is exercised over HTTP, with the answer (status, field named) a client would
get from a real API server (facts/k8s-scheduling.md sections 1-3).
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import kmock
import pytest
from fake_apiserver import (
    Admission,
    ApiServer,
    Unschedulable,
    bind_like_scheduler,
    declare,
    stored,
)

from partitioner.gating import GATE, release_patch, ungate_patch
from partitioner.reservations import RESERVATION_ANNOTATION

PODS = "/api/v1/namespaces/default/pods"
KUEUE = "kueue.x-k8s.io/admission"
JSON_PATCH = {"Content-Type": "application/json-patch+json"}
PIN = {"key": "metadata.name", "operator": "In", "values": ["n1"]}
ZONE = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}


@pytest.fixture
def kmock_options() -> dict[str, Any]:
    return {"cls": ApiServer}


@pytest.fixture
def api(kmock: ApiServer) -> ApiServer:
    declare(kmock)
    return kmock


def pod(name: str = "p1", gates: tuple[str, ...] = (GATE,), **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "busybox:1",
                    "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}},
                }
            ],
            **spec,
        },
    }
    if gates:
        body["spec"]["schedulingGates"] = [{"name": g} for g in gates]
    return body


async def create(api: ApiServer, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = await api.post(PODS, json=body)
    answer: dict[str, Any] = await resp.json()
    return resp.status, answer


async def patch(
    api: ApiServer, name: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    resp = await api.patch(f"{PODS}/{name}", data=json.dumps(body), headers=headers or {})
    answer: dict[str, Any] = await resp.json()
    return resp.status, answer


def current(api: ApiServer, name: str = "p1") -> dict[str, Any]:
    obj = stored(api, "v1/pods", name, "default")
    assert obj is not None
    return obj


async def created(api: ApiServer, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = await create(api, body)
    assert status in (200, 201), answer
    return answer


def assert_invalid(status: int, answer: dict[str, Any], field: str) -> None:
    assert status == 422, answer
    assert answer["reason"] == "Invalid"
    assert answer["message"].startswith('Pod "p1" is invalid: ')
    assert field in answer["message"], answer["message"]


# ------------------------------------------------------------------------------------- create


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (pod(gates=(GATE, GATE)), "spec.schedulingGates[1].name: Duplicate value"),
        (pod(nodeName="n1"), "spec.nodeName: Forbidden"),
    ],
    ids=["duplicate-gate", "node-name-with-gate"],
)
async def test_create_refuses_what_kubernetes_refuses(
    api: ApiServer, body: dict[str, Any], field: str
) -> None:
    status, answer = await create(api, body)
    assert_invalid(status, answer, field)
    assert stored(api, "v1/pods", "p1", "default") is None


async def test_a_gated_pod_is_created_scheduling_gated(api: ApiServer) -> None:
    await created(api, pod())
    (cond,) = current(api)["status"]["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == (
        "PodScheduled",
        "False",
        "SchedulingGated",
    )
    await created(api, pod("bound", gates=(), nodeName="n1"))  # no gates: nodeName is fine
    assert "status" not in current(api, "bound")


# ------------------------------------------------------------------------------------- gates


async def test_gates_can_only_be_removed(api: ApiServer) -> None:
    await created(api, pod(gates=(KUEUE,)))
    status, answer = await patch(
        api, "p1", {"spec": {"schedulingGates": [{"name": KUEUE}, {"name": GATE}]}}
    )
    assert_invalid(status, answer, "spec.schedulingGates[1].name: Forbidden: only deletion")
    assert GATE in answer["message"]

    await created(api, pod("p2", gates=(KUEUE, GATE)))
    status, answer = await patch(api, "p2", {"spec": {"schedulingGates": [{"name": KUEUE}]}})
    assert status == 200, answer
    status, answer = await patch(api, "p2", {"spec": {"schedulingGates": None}})
    assert status == 200, answer
    assert "schedulingGates" not in current(api, "p2")["spec"]
    status, answer = await patch(api, "p2", {"spec": {"schedulingGates": [{"name": KUEUE}]}})
    assert status == 422 and "only deletion" in answer["message"]


async def test_json_patches_follow_the_same_rules(api: ApiServer) -> None:
    await created(api, pod(gates=(GATE,)))
    add = [{"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": KUEUE}}]
    status, answer = await patch(api, "p1", add, JSON_PATCH)
    assert_invalid(status, answer, "spec.schedulingGates[1].name: Forbidden")
    rv = current(api)["metadata"]["resourceVersion"]
    stale = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
        {"op": "remove", "path": "/spec/schedulingGates"},
    ]
    status, answer = await patch(api, "p1", stale, JSON_PATCH)
    assert status == 422 and "schedulingGates" in current(api)["spec"]
    fresh = [{"op": "test", "path": "/metadata/resourceVersion", "value": rv}, *stale[1:]]
    status, answer = await patch(api, "p1", fresh, JSON_PATCH)
    assert status == 200, answer
    after = current(api)
    assert "schedulingGates" not in after["spec"]
    assert after["metadata"]["resourceVersion"] != rv
    assert after["metadata"]["generation"] == 2


# ------------------------------------------------------------------------ release and affinity


async def test_release_patch_is_accepted_while_gated_and_refused_after(api: ApiServer) -> None:
    gated = await created(api, pod(gates=(GATE,)))
    status, answer = await patch(
        api, "p1", release_patch(gated, "n1", {RESERVATION_ANNOTATION: "{}"})
    )
    assert status == 200, answer
    released = current(api)
    assert "schedulingGates" not in released["spec"]
    terms = released["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [PIN]}]
    assert released["metadata"]["annotations"] == {RESERVATION_ANNOTATION: "{}"}

    # The same narrowing again (to another node) once the gate is gone: refused.
    status, answer = await patch(api, "p1", release_patch(released, "n2"))
    assert_invalid(status, answer, "spec.affinity: Forbidden")
    assert "while the pod is gated" in answer["message"]
    # The release computed before the first one carries the old resourceVersion: conflict.
    status, answer = await patch(api, "p1", release_patch(gated, "n1"))
    assert status == 409, answer


async def test_narrowing_existing_terms_and_dropping_only_our_gate(api: ApiServer) -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [ZONE]},
                    {"matchExpressions": [ZONE], "matchFields": [PIN | {"values": ["n9"]}]},
                ]
            }
        }
    }
    gated = await created(api, pod(gates=(KUEUE, GATE), affinity=affinity))
    status, answer = await patch(api, "p1", release_patch(gated, "n1"))
    assert status == 200, answer
    after = current(api)["spec"]
    assert after["schedulingGates"] == [{"name": KUEUE}]  # another controller's gate stays
    terms = after["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert [t.get("matchFields") for t in terms] == [[PIN], [PIN | {"values": ["n9"]}, PIN]]


def _required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }


WIDENINGS: dict[str, tuple[dict[str, Any], str]] = {
    "term-added": (
        _required({"matchExpressions": [ZONE]}, {"matchFields": [PIN]}),
        "nodeSelectorTerms: Invalid: no additions/deletions",
    ),
    "requirement-removed": (
        _required({"matchExpressions": []}),
        "nodeSelectorTerms[0].matchExpressions: Invalid",
    ),
    "requirement-changed": (
        _required({"matchExpressions": [ZONE | {"values": ["a", "b"]}]}),
        "nodeSelectorTerms[0].matchExpressions: Invalid",
    ),
    "requirement-prepended": (
        _required({"matchExpressions": [PIN | {"key": "x"}, ZONE]}),
        "nodeSelectorTerms[0].matchExpressions: Invalid",
    ),
    "required-removed": (
        {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": None}},
        "requiredDuringSchedulingIgnoredDuringExecution: Invalid: may not be removed",
    ),
    "pod-affinity-added": (
        _required({"matchExpressions": [ZONE]})
        | {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}},
        "spec.affinity.podAffinity: Forbidden",
    ),
}


@pytest.mark.parametrize("case", sorted(WIDENINGS))
async def test_widening_node_affinity_is_refused_even_while_gated(
    api: ApiServer, case: str
) -> None:
    affinity, field = WIDENINGS[case]
    await created(api, pod(affinity=_required({"matchExpressions": [ZONE]})))
    status, answer = await patch(api, "p1", {"spec": {"affinity": affinity}})
    assert_invalid(status, answer, field)


async def test_preferred_affinity_and_node_selector_additions_only_while_gated(
    api: ApiServer,
) -> None:
    preferred = {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [ZONE]}}
            ]
        }
    }
    await created(api, pod(nodeSelector={"a": "1"}))
    status, answer = await patch(api, "p1", {"spec": {"affinity": preferred}})
    assert status == 200, answer
    status, answer = await patch(api, "p1", {"spec": {"nodeSelector": {"b": "2"}}})
    assert status == 200, answer
    assert current(api)["spec"]["nodeSelector"] == {"a": "1", "b": "2"}
    status, answer = await patch(api, "p1", {"spec": {"nodeSelector": {"a": "9"}}})
    assert_invalid(status, answer, "spec.nodeSelector: Invalid: only additions")

    await created(api, pod("p2", gates=(), nodeSelector={"a": "1"}))
    status, answer = await patch(api, "p2", {"spec": {"nodeSelector": {"b": "2"}}})
    assert status == 422 and "spec.nodeSelector: Forbidden" in answer["message"], answer


# ----------------------------------------------------------------------------- other fields


async def test_tolerations_may_only_be_added(api: ApiServer) -> None:
    t1 = {"key": "a", "operator": "Exists", "effect": "NoSchedule"}
    t2 = {"key": "b", "operator": "Exists", "effect": "NoSchedule"}
    await created(api, pod(gates=(), tolerations=[t1]))
    status, answer = await patch(api, "p1", {"spec": {"tolerations": [t1, t2]}})
    assert status == 200, answer
    status, answer = await patch(api, "p1", {"spec": {"tolerations": [t2]}})
    assert_invalid(status, answer, "spec.tolerations[0]: Forbidden")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (
            {"containers": [{"name": "main", "image": "busybox:1", "resources": {}}]},
            "spec.containers: Forbidden",
        ),
        ({"nodeName": "n1"}, "spec.nodeName: Forbidden"),
        ({"priority": 5}, "spec.priority: Forbidden"),
    ],
    ids=["resources", "node-name", "priority"],
)
async def test_any_other_spec_change_is_refused_naming_the_field(
    api: ApiServer, change: dict[str, Any], field: str
) -> None:
    await created(api, pod())
    status, answer = await patch(api, "p1", {"spec": change})
    assert_invalid(status, answer, field)


async def test_image_and_metadata_changes_are_fine(api: ApiServer) -> None:
    await created(api, pod())
    body = current(api)
    body["spec"]["containers"][0]["image"] = "busybox:2"
    status, answer = await patch(
        api,
        "p1",
        {"metadata": {"labels": {"x": "y"}}, "spec": {"containers": body["spec"]["containers"]}},
    )
    assert status == 200, answer


async def test_strategic_merge_patch_of_a_pod_spec_is_not_emulated(api: ApiServer) -> None:
    gated = await created(api, pod())
    smp = {"Content-Type": "application/strategic-merge-patch+json"}
    status, answer = await patch(api, "p1", ungate_patch(gated), smp)
    assert status == 415, answer
    status, answer = await patch(api, "p1", {"metadata": {"labels": {"x": "y"}}}, smp)
    assert status == 200, answer


# ----------------------------------------------------------------------------------- binding


async def test_binding_like_kube_scheduler(api: ApiServer) -> None:
    for name, labels in (("n1", {"zone": "a"}), ("n2", {"zone": "b"})):
        await api.post("/api/v1/nodes", json={"metadata": {"name": name, "labels": labels}})
    gated = await created(api, pod(nodeSelector={"zone": "a"}))
    with pytest.raises(Unschedulable, match=r"gated by gpuslice\.io/slice"):
        await bind_like_scheduler(api, "default", "p1", "n1")
    # The binding subresource itself refuses a gated pod, as the API server does.
    binding = {"target": {"kind": "Node", "name": "n1"}}
    resp = await api.post(f"{PODS}/p1/binding", json=binding)
    assert (
        resp.status == 409 and "non-empty .spec.schedulingGates" in (await resp.json())["message"]
    )

    status, _ = await patch(api, "p1", release_patch(gated, "n1"))
    assert status == 200
    with pytest.raises(Unschedulable, match=r"does not match the pod.s nodeSelector"):
        await bind_like_scheduler(api, "default", "p1", "n2")
    bound = await bind_like_scheduler(api, "default", "p1", "n1")
    assert bound["spec"]["nodeName"] == "n1"
    scheduled = [c for c in bound["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert scheduled == [{"type": "PodScheduled", "status": "True"}]
    resp = await api.post(f"{PODS}/p1/binding", json=binding)
    assert resp.status == 409 and "already assigned to node 'n1'" in (await resp.json())["message"]


async def test_binding_honours_the_narrowed_affinity(api: ApiServer) -> None:
    for name in ("n1", "n2"):
        await api.post("/api/v1/nodes", json={"metadata": {"name": name, "labels": {"zone": "a"}}})
    affinity = _required({"matchExpressions": [ZONE | {"key": "zone"}]})
    gated = await created(api, pod(affinity=affinity))
    await patch(api, "p1", release_patch(gated, "n2"))
    with pytest.raises(Unschedulable, match="node affinity"):
        await bind_like_scheduler(api, "default", "p1", "n1")
    assert (await bind_like_scheduler(api, "default", "p1", "n2"))["spec"]["nodeName"] == "n2"


# ------------------------------------------------------------------------- admission webhook

Answer = Callable[[dict[str, Any]], aiohttp.web.StreamResponse]


@pytest.fixture
async def webhook() -> AsyncIterator[tuple[str, list[Answer], list[dict[str, Any]]]]:
    """A plain-HTTP webhook whose next answer the test chooses; records the reviews it got."""
    answers: list[Answer] = []
    reviews: list[dict[str, Any]] = []

    async def serve(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        review = await request.json()
        reviews.append(review)
        return answers.pop(0)(review)

    app = aiohttp.web.Application()
    app.router.add_post("/gate", serve)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/gate", answers, reviews
    finally:
        await runner.cleanup()


def respond(allowed: bool = True, ops: list[dict[str, Any]] | None = None, **extra: Any) -> Answer:
    def answer(review: dict[str, Any]) -> aiohttp.web.StreamResponse:
        response: dict[str, Any] = {"uid": review["request"]["uid"], "allowed": allowed, **extra}
        if ops is not None:
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
        return aiohttp.web.json_response({**review, "response": response})

    return answer


async def test_admission_webhook_patch_is_applied_before_validation(
    api: ApiServer, webhook: tuple[str, list[Answer], list[dict[str, Any]]]
) -> None:
    url, answers, reviews = webhook
    api.configure_admission(Admission(url=url))
    add = [{"op": "add", "path": "/spec/schedulingGates", "value": [{"name": GATE}]}]
    answers.append(respond(ops=add))
    await created(api, pod(gates=()))
    assert current(api)["spec"]["schedulingGates"] == [{"name": GATE}]
    (review,) = reviews
    req = review["request"]
    assert (req["operation"], req["namespace"], req["resource"]["resource"]) == (
        "CREATE",
        "default",
        "pods",
    )
    assert "uid" not in req["object"]["metadata"]  # assigned after admission

    # A webhook that re-adds a gate the pod already has makes the creation fail (Duplicate).
    answers.append(
        respond(ops=[{"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": GATE}}])
    )
    status, answer = await create(api, pod("p2"))
    assert status == 422 and "Duplicate value" in answer["message"], answer


async def test_admission_denial_rejects_even_under_ignore(
    api: ApiServer, webhook: tuple[str, list[Answer], list[dict[str, Any]]]
) -> None:
    url, answers, _ = webhook
    api.configure_admission(Admission(url=url, failure_policy="Ignore"))
    answers.append(respond(allowed=False, status={"code": 500, "message": "boom"}))
    status, answer = await create(api, pod(gates=()))
    assert status == 500 and "denied the request: boom" in answer["message"], answer
    assert stored(api, "v1/pods", "p1", "default") is None


@pytest.mark.parametrize("policy", ["Ignore", "Fail"])
async def test_admission_call_failure_follows_the_failure_policy(
    api: ApiServer, webhook: tuple[str, list[Answer], list[dict[str, Any]]], policy: str
) -> None:
    url, answers, _ = webhook
    api.configure_admission(Admission(url=url, failure_policy=policy))  # type: ignore[arg-type]
    answers.append(lambda review: aiohttp.web.json_response({"nope": 1}, status=500))
    status, answer = await create(api, pod(gates=()))
    if policy == "Ignore":
        assert status in (200, 201), answer
        assert "schedulingGates" not in current(api)["spec"]
    else:
        assert status == 500 and "failed calling webhook" in answer["message"]
    (why,) = api.admission_failures
    assert "500" in why
    api.configure_admission(Admission(url="http://127.0.0.1:1/gate", failure_policy=policy))  # type: ignore[arg-type]
    status, _ = await create(api, pod("p2", gates=()))
    assert (status in (200, 201)) == (policy == "Ignore")
    assert len(api.admission_failures) == 2


def test_kmock_option_cls_is_the_fake(kmock: kmock.KubernetesEmulator) -> None:
    assert isinstance(kmock, ApiServer)


# --------------------------------------------------------------------------------- lists


async def list_page(api: ApiServer, **params: str) -> tuple[int, dict[str, Any]]:
    resp = await api.get(PODS, params=params)
    answer: dict[str, Any] = await resp.json()
    return resp.status, answer


async def test_lists_are_paginated_with_continue_tokens(api: ApiServer) -> None:
    for name in ("p3", "p1", "p2"):
        await created(api, pod(name, gates=()))
    status, first = await list_page(api, limit="2")
    assert status == 200
    assert [p["metadata"]["name"] for p in first["items"]] == ["p1", "p2"]  # in name order
    assert first["metadata"]["remainingItemCount"] == 1
    token = first["metadata"]["continue"]
    await created(api, pod("p0", gates=()))  # sorts before the token's position: not listed
    status, rest = await list_page(api, limit="2", **{"continue": token})
    assert status == 200
    assert [p["metadata"]["name"] for p in rest["items"]] == ["p3"]
    assert "continue" not in rest["metadata"]
    assert rest["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    status, everything = await list_page(api)
    assert [p["metadata"]["name"] for p in everything["items"]] == ["p0", "p1", "p2", "p3"]
    assert [(c.limit, c.continued, c.items) for c in api.lists] == [
        (2, False, 2),
        (2, True, 1),
        (None, False, 4),
    ]


async def test_list_faults_on_demand(api: ApiServer) -> None:
    for name in ("p1", "p2", "p3"):
        await created(api, pod(name, gates=()))
    api.fail_lists = 1
    status, answer = await list_page(api, limit="1")
    assert (status, answer["reason"]) == (503, "ServiceUnavailable")
    status, first = await list_page(api, limit="1")
    assert status == 200
    api.expire_continues = 1
    token = first["metadata"]["continue"]
    status, answer = await list_page(api, limit="1", **{"continue": token})
    assert (status, answer["reason"]) == (410, "Expired")
    status, second = await list_page(api, limit="1", **{"continue": token})
    assert status == 200 and [p["metadata"]["name"] for p in second["items"]] == ["p2"]
    status, answer = await list_page(api, **{"continue": "not-a-token"})
    assert (status, answer["reason"]) == (400, "BadRequest")
    assert [c.status for c in api.lists] == [503, 200, 410, 200, 400]
