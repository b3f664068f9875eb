"""Failed writes are counted, told and paced; plans are counted once written (review 4,
findings 3 and 4).

* ``gpuslice_write_failures_total{action,code}`` counts every failed write.
* A write to a node or its NodePartitioning refused with 400/403/422 (an admission policy,
  RBAC) is told once per object and answer (one WARNING, a ``WriteRefused`` Event) and held back
  (a cycle, doubling up to 60 cycles; at once when the write changes; forgotten on success).
  Before, every opted-in node's refused create was re-sent every cycle, forever, with a WARNING
  each, and nothing else said so.
* ``gpuslice_gpus_reconfigured_total``, ``gpuslice_pods_planned_total`` and
  ``gpuslice_batch_size`` count a plan once its spec is written, not also each refused try.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
from collections.abc import Callable
from typing import Any

import kopf
import pytest
from test_partitioner_promises import (
    MIG,
    ONE_G,
    SEVEN_G,
    T0,
    applied_np,
    gated,
    running,
    status_gpu,
    with_alloc,
)
from test_partitioner_snapshot import node

from contract.nodepartitioning import NodePartitioningSpec
from partitioner import writer
from partitioner.actions import CreatePartitioning, SetNodeCondition, WriteSpec
from partitioner.kubeapi import ApiError, Conflict, NotFound, Unreachable
from partitioner.operator import Controller
from partitioner.settings import PartitionerSettings
from partitioner.writer import execute

Fault = Callable[[str, str, Any], None]


def _key(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta["name"]


def _merge(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


class Api:
    """A small API server: objects by kind and key, resourceVersions, 409 on a stale one;
    ``fault(method, path, body)`` may raise first.  Records requests and Events."""

    def __init__(self, objs: dict[str, list[dict[str, Any]]]) -> None:
        self.rv = itertools.count(1000)
        self.store: dict[tuple[str, str], dict[str, Any]] = {}
        for kind, items in objs.items():
            for o in items:
                o = copy.deepcopy(o)
                o["metadata"].setdefault("resourceVersion", str(next(self.rv)))
                self.store[(kind, _key(o))] = o
        self.fault: Fault = lambda method, path, body: None
        self.requests: list[str] = []
        self.events: list[dict[str, Any]] = []

    @staticmethod
    def where(path: str) -> tuple[str, str]:
        parts = path.strip("/").removesuffix("/status").split("/")
        for kind in ("pods", "nodepartitionings", "nodes"):
            if kind in parts:
                i = parts.index(kind)
                if kind == "pods":
                    return kind, f"{parts[i - 1]}/{parts[i + 1]}"
                return kind, parts[i + 1] if i + 1 < len(parts) else ""
        return "", ""

    async def list_all(self, path: str, page_size: int = 500, **_: Any) -> dict[str, Any]:
        kind = path.rsplit("/", 1)[-1]
        items = [copy.deepcopy(o) for (k, _), o in sorted(self.store.items()) if k == kind]
        return {"metadata": {"resourceVersion": str(next(self.rv))}, "items": items}

    async def request(self, method: str, path: str, body: Any = None, *_: Any, **__: Any) -> Any:
        self.fault(method, path, body)
        obj = self.store.get(self.where(path))
        if obj is None:
            raise NotFound(404, "NotFound", "not found", path)
        return copy.deepcopy(obj)

    async def patch(self, path: str, body: Any, content_type: str = "") -> dict[str, Any]:
        self.requests.append(f"PATCH {path}")
        self.fault("PATCH", path, body)
        kind, key = self.where(path)
        cur = self.store.get((kind, key))
        if cur is None:
            raise NotFound(404, "NotFound", "not found", path)
        want = (body.get("metadata") or {}).get("resourceVersion")
        if want is not None and want != cur["metadata"]["resourceVersion"]:
            raise Conflict(409, "Conflict", "the object has been modified", path)
        new = _merge(cur, body)
        if kind == "nodepartitionings" and new.get("spec") != cur.get("spec"):
            new["metadata"]["generation"] = int(cur["metadata"].get("generation") or 1) + 1
        new["metadata"]["resourceVersion"] = str(next(self.rv))
        self.store[(kind, key)] = new
        return copy.deepcopy(new)

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path.endswith("/events"):
            self.events.append(body)
            return body
        self.requests.append(f"POST {path}")
        self.fault("POST", path, body)
        obj = copy.deepcopy(body)
        obj["metadata"]["resourceVersion"] = str(next(self.rv))
        obj["metadata"].setdefault("generation", 1)
        if ("nodepartitionings", _key(obj)) in self.store:
            raise Conflict(409, "AlreadyExists", "exists", path)
        self.store[("nodepartitionings", _key(obj))] = obj
        return copy.deepcopy(obj)

    async def delete(self, path: str) -> dict[str, Any]:
        self.requests.append(f"DELETE {path}")
        self.fault("DELETE", path, None)
        if self.store.pop(self.where(path), None) is None:
            raise NotFound(404, "NotFound", "gone", path)
        return {}

    async def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def controller(api: Api, clock: Clock) -> Controller:
    c = Controller(
        PartitionerSettings(metrics_port=0, health_port=0),
        connection=kopf.ConnectionInfo(server="https://example.invalid"),
        offload=False,
        monotonic=clock,
    )
    c.api.list_all = api.list_all  # type: ignore[method-assign]
    c.api.request = api.request  # type: ignore[method-assign]
    c.writer_api = api  # type: ignore[assignment]
    return c


def sample(c: Controller, name: str, **labels: str) -> float:
    return c.metrics.registry.get_sample_value(name, labels or None) or 0.0


# -- finding 3: failed writes ---------------------------------------------------------------


def test_a_refused_create_is_told_once_counted_and_backed_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = Api({"nodes": [node(f"n{i}", MIG) for i in range(3)]})
    denied = 'admission webhook "validate.kyverno.svc" denied the request: label "team" is required'

    def fault(method: str, path: str, body: Any) -> None:
        if method == "POST" and path.endswith("nodepartitionings"):
            raise ApiError(403, "Forbidden", denied, path)

    api.fault = fault
    clock = Clock()
    c = controller(api, clock)
    asyncio.run(c.sync())
    sent: list[int] = []
    with caplog.at_level(logging.WARNING, logger="gpuslice.partitioner"):
        for i in range(120):  # two minutes, a cycle a second
            clock.now = float(i)
            asyncio.run(c.step(T0 + i))
            sent.append(sum(1 for r in api.requests if r.startswith("POST")))
    posts = sent[-1]
    # 1 s, 2, 4, 8, 16, 32, then every 60 s: 8 tries per node in two minutes, not 120
    assert 3 * 6 <= posts <= 3 * 9, posts
    assert sent[5] - sent[4] < 3  # paced from the start
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 3, [r.getMessage() for r in warnings]  # once per node and answer
    events = [e for e in api.events if e["reason"] == "WriteRefused"]
    assert sorted(e["involvedObject"]["name"] for e in events) == ["n0", "n1", "n2"]
    assert {e["involvedObject"]["kind"] for e in events} == {"Node"}
    assert all("403 Forbidden" in e["message"] and "team" in e["message"] for e in events)
    assert sample(c, "gpuslice_write_failures_total", action="create_partitioning", code="403")
    assert sample(
        c, "gpuslice_write_failures_total", action="create_partitioning", code="403"
    ) == float(posts)
    # the policy is fixed: the next try (within the cap) creates them, and the refusals go
    api.fault = lambda method, path, body: None
    for i in range(120, 200):
        clock.now = float(i)
        asyncio.run(c.step(T0 + i))
    assert sorted(k for kind, k in api.store if kind == "nodepartitionings") == ["n0", "n1", "n2"]
    assert c.write_backoff.refusals == {}


async def test_the_backoff_doubles_is_capped_and_a_changed_write_goes_at_once() -> None:
    clock = Clock()
    backoff = writer.WriteBackoff(base_s=1.0, cap_s=8.0, clock=clock)
    api = Api({"nodes": [node("n1", MIG)]})
    refusal = ApiError(422, "Invalid", "spec.gpus: forbidden by policy", "/np")

    def fault(method: str, path: str, body: Any) -> None:
        raise refusal

    api.fault = fault
    cond = SetNodeCondition("n1", "False", "NoGpuLabels", "the node has no GPU labels")
    tries: list[float] = []
    for t in range(40):
        clock.now = float(t)
        before = len(api.requests)
        out = await execute(api, [cond], backoff=backoff)  # type: ignore[arg-type]
        if len(api.requests) > before:
            tries.append(clock.now)
            assert out.write_failures == [("set_node_condition", "422")]
        else:
            assert out.held_back == ["set_node_condition n1"] and out.write_failures == []
    assert tries == [0, 1, 3, 7, 15, 23, 31, 39]  # waits 1, 2, 4, 8, 8, ...
    told = [e for e in api.events if e["reason"] == "WriteRefused"]
    assert len(told) == 1 and told[0]["involvedObject"]["kind"] == "Node"
    # another condition for that node is another write: sent at once
    other = SetNodeCondition("n1", "True", "Ready", "")
    before = len(api.requests)
    await execute(api, [other], backoff=backoff)  # type: ignore[arg-type]
    assert len(api.requests) == before + 1
    assert len([e for e in api.events if e["reason"] == "WriteRefused"]) == 1  # same answer
    # another answer is told again
    refusal = ApiError(403, "Forbidden", "nodes/status is forbidden", "/np")
    clock.now += 100
    await execute(api, [other], backoff=backoff)  # type: ignore[arg-type]
    assert len([e for e in api.events if e["reason"] == "WriteRefused"]) == 2


async def test_passing_failures_are_counted_but_not_held_back() -> None:
    clock = Clock()
    backoff = writer.WriteBackoff(clock=clock)
    api = Api({})
    spec = NodePartitioningSpec(planId="1", mode="mig", gpus=[])

    def fault(method: str, path: str, body: Any) -> None:
        raise ApiError(503, "ServiceUnavailable", "etcd leader changed", path)

    api.fault = fault
    create = CreatePartitioning("n1", "uid-n1", spec)
    for _ in range(3):
        out = await execute(api, [create], backoff=backoff)  # type: ignore[arg-type]
        assert out.write_failures == [("create_partitioning", "503")]
    assert len(api.requests) == 3 and api.events == []
    assert backoff.refusals == {}


def test_labels() -> None:
    spec = WriteSpec("n", NodePartitioningSpec(mode="mig"), None)
    assert writer.action_label(spec) == "write_spec"
    assert writer.answer_label(ApiError(422, "Invalid", "", "/")) == "422"
    assert writer.answer_label(TimeoutError()) == "timeout"
    assert writer.answer_label(Unreachable("/", ConnectionResetError())) == "unreachable"


# -- finding 4: metrics of unwritten plans ------------------------------------------------------


@pytest.mark.parametrize("answer", [409, 500])
def test_a_plan_whose_spec_write_failed_is_counted_once_written(answer: int) -> None:
    api = Api(
        {
            "nodes": [node("n1", MIG)],
            "nodepartitionings": [applied_np("n1", status_gpu(0), status_gpu(1))],
            "pods": [gated("p", SEVEN_G)],
        }
    )
    left = [1]

    def fault(method: str, path: str, body: Any) -> None:
        spec_write = method == "PATCH" and "spec" in (body or {})
        if spec_write and path.endswith("nodepartitionings/n1") and left[0]:
            left[0] -= 1
            if answer == 409:
                raise Conflict(409, "Conflict", "the object has been modified", path)
            raise ApiError(500, "InternalError", "etcdserver: request timed out", path)

    api.fault = fault
    clock = Clock()
    c = controller(api, clock)
    asyncio.run(c.sync())
    for i in range(30):
        clock.now = 10.0 * i
        asyncio.run(c.step(T0 + 10 * i))
        asyncio.run(c.sync())  # the watch's view of the writes
    writes = [
        r for r in api.requests if r == "PATCH /apis/gpuslice.io/v1alpha1/nodepartitionings/n1"
    ]
    assert len(writes) == 2  # refused once, then written
    assert sample(c, "gpuslice_gpus_reconfigured_total") == 1.0
    assert sample(c, "gpuslice_pods_planned_total") == 1.0
    assert sample(c, "gpuslice_batch_size_count") == 1.0
    assert sample(c, "gpuslice_write_failures_total", action="write_spec", code=str(answer)) == 1


def test_a_warm_slice_is_counted_once_its_spec_is_written() -> None:
    """``gpuslice_warm_slices_total`` counted each warm-slice spec the step asked for, also the
    ones the API server did not take (each retry counted again)."""
    api = Api(
        {
            "nodes": [with_alloc(node("n1", MIG), **{"1g_10gb": 1})],
            "nodepartitionings": [
                applied_np("n1", status_gpu(0, ("1g.10gb", 0, True)), status_gpu(1))
            ],
            "pods": [running("r1", "n1", ONE_G)],
        }
    )
    left = [2]

    def fault(method: str, path: str, body: Any) -> None:
        if method == "PATCH" and "spec" in (body or {}) and left[0]:
            left[0] -= 1
            raise ApiError(500, "InternalError", "etcdserver: request timed out", path)

    api.fault = fault
    clock = Clock()
    c = Controller(
        PartitionerSettings(metrics_port=0, health_port=0, warm_slice_share=0.05),
        connection=kopf.ConnectionInfo(server="https://example.invalid"),
        offload=False,
        monotonic=clock,
    )
    c.api.list_all = api.list_all  # type: ignore[method-assign]
    c.api.request = api.request  # type: ignore[method-assign]
    c.writer_api = api  # type: ignore[assignment]
    asyncio.run(c.sync())
    for i in range(30):
        clock.now = 10.0 * i
        asyncio.run(c.step(T0 + 10 * i))
        asyncio.run(c.sync())
    writes = [
        r for r in api.requests if r == "PATCH /apis/gpuslice.io/v1alpha1/nodepartitionings/n1"
    ]
    assert len(writes) == 3  # refused twice, then written
    assert sample(c, "gpuslice_warm_slices_total") == 1.0
