"""A spec write the API server refuses for good cools its node down (a review's finding: the
same node was planned every batch, the write refused or held back each time, and the pod waited
for good with nothing but ``Gated`` while an identical node stood empty)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from test_partitioner_promises import (
    CONFIG,
    MIG,
    SEVEN_G,
    T0,
    Cluster,
    applied_np,
    gated,
    merge_patch,
    reservation,
    status_gpu,
)
from test_partitioner_snapshot import node

from partitioner.decide import decide
from partitioner.kubeapi import ApiError
from partitioner.operator import cool_refused_specs
from partitioner.writer import WriteBackoff, execute

ONE_GPU = {**MIG, "nvidia.com/gpu.count": "1"}


class RefusingApi:
    """Refuses every spec write to ``n1`` with 422; applies the others to the cluster."""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.tries = {"n1": 0, "n2": 0}

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return body

    async def patch(self, path: str, body: dict[str, Any], *a: Any, **k: Any) -> dict[str, Any]:
        name = path.rsplit("/", 1)[1]
        if "/nodepartitionings/" in path and "spec" in body:
            self.tries[name] += 1
            if name == "n1":
                raise ApiError(422, "Invalid", "spec: denied by admission policy", path)
            old = self.c.objs[("NodePartitioning", name)]
            merged = merge_patch(copy.deepcopy(old), body)
            merged["metadata"]["generation"] += 1
            merged["metadata"]["resourceVersion"] = str(int(old["metadata"]["resourceVersion"]) + 1)
            self.c.put(merged)
            return merged
        if "/pods/" in path:
            old = self.c.pod(name)
            new = merge_patch(copy.deepcopy(old), body)
            new["metadata"]["resourceVersion"] = str(int(old["metadata"]["resourceVersion"]) + 1)
            self.c.put(new)
            return new
        return {}

    async def request(self, *a: Any, **k: Any) -> dict[str, Any]:
        return {}


def test_a_node_whose_spec_is_refused_cools_down_and_the_pod_goes_elsewhere() -> None:
    c = Cluster(
        node("n1", ONE_GPU),
        applied_np("n1", status_gpu(0)),
        node("n2", ONE_GPU),
        applied_np("n2", status_gpu(0)),
        gated("p", SEVEN_G),
    )
    api = RefusingApi(c)
    clock = [0.0]
    backoff = WriteBackoff(base_s=1.0, cap_s=60.0, clock=lambda: clock[0])
    served = None
    for t in range(0, 1800, 10):
        clock[0] = float(t)
        now = T0 + t
        d = decide(c.state, c.index(), now, CONFIG)
        c.state = d.state
        outcome = asyncio.run(execute(api, d.actions, backoff=backoff))  # type: ignore[arg-type]
        if outcome.refused_specs:  # what Controller.step does with the outcome
            c.state = cool_refused_specs(c.state, outcome.refused_specs, now, CONFIG.cooldown_s)
        r = reservation(c, "p")
        if r is not None:
            served = (t, r.node)
            break
    assert served is not None and served[1] == "n2", (served, api.tries)
    assert api.tries["n1"] == 1  # refused once, then left out of plans
