"""A pod patch the API server refuses in a way its retry gets again (a validating webhook or
admission policy that forbids changing a gated pod: 400, 403, 422) is told in a Warning Event
on the pod, once per pod and answer, naming the answer and the fix; 404 (gone), 409 (changed
since) and 5xx (passing) are not.  Before, a release refused forever left the pod gated and its
slice held with a log line per cycle only."""

from __future__ import annotations

from typing import Any

from partitioner.actions import ObjectRef, PatchPod
from partitioner.kubeapi import ApiError, Conflict
from partitioner.writer import execute


class Refusing:
    """Answers every pod patch with ``error``; records the Events posted."""

    def __init__(self, error: ApiError) -> None:
        self.error = error
        self.events: list[dict[str, Any]] = []

    async def patch(self, path: str, body: Any, content_type: str = "") -> dict[str, Any]:
        raise self.error

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.events.append(body)
        return body


def release(uid: str = "uid-p") -> PatchPod:
    ref = ObjectRef("Pod", "p", "default", uid)
    return PatchPod("default/p", ref, {"spec": {"schedulingGates": None}}, "release")


async def test_a_refusal_a_retry_gets_again_is_told_once_per_pod_and_answer() -> None:
    denied = ApiError(
        422, "Invalid", 'admission webhook "policy.example" denied the request', "/pods/p"
    )
    api = Refusing(denied)
    told: dict[str, str] = {}
    for _ in range(3):  # three cycles
        out = await execute(api, [release()], told=told)  # type: ignore[arg-type]
        assert out.pod_refusals["default/p"].startswith("422")
    (event,) = api.events
    assert (event["type"], event["reason"]) == ("Warning", "PatchRefused")
    assert event["involvedObject"]["name"] == "p"
    message = event["message"]
    assert "release patch" in message and "422 Invalid" in message
    assert "policy.example" in message and "stays gated" in message
    assert "delete the pod" in message
    api.error = ApiError(403, "Forbidden", 'pods "p" is forbidden', "/pods/p")
    await execute(api, [release()], told=told)  # type: ignore[arg-type]
    assert [e["reason"] for e in api.events] == ["PatchRefused"] * 2  # a new answer: told
    await execute(api, [release("uid-new")], told=told)  # type: ignore[arg-type]
    assert len(api.events) == 3  # a pod of the same name, another uid: told again


async def test_answers_a_retry_can_pass_are_not_told() -> None:
    for error in (
        Conflict(409, "Conflict", "the object has been modified", "/pods/p"),
        ApiError(404, "NotFound", 'pods "p" not found', "/pods/p"),
        ApiError(503, "ServiceUnavailable", "etcd leader changed", "/pods/p"),
        ApiError(429, "TooManyRequests", "slow down", "/pods/p"),
    ):
        api = Refusing(error)
        out = await execute(api, [release()], told={})  # type: ignore[arg-type]
        assert out.pod_refusals and api.events == [], error.status
