"""Warm slices through the real operator (kopf against kmock, looptime's fake time).

A whole-GPU pod is gated, planned, released and bound on one GPU of a two-GPU node; once it
is bound and nothing waits, the operator with ``warmSliceShare`` writes a spec
that keeps a free ``7g`` ready on the same node's other GPU, never on the idle node, and counts
it in ``gpuslice_warm_slices_total``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import NP_RESOURCE, ApiServer, bind_like_scheduler, stored
from test_operator_gates import (
    A100,
    PODS,
    SEVEN_G,
    agent_applies,
    eventually,
    gating_operator,
    get_pod,
    kmock_options,  # noqa: F401  (the fixture)
    kubelet_advertises,
    pod,
    reservation,
    setup,
)


def two_gpu_node(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {**A100, "nvidia.com/gpu.count": "2"}},
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}},
    }


def profiles(api: ApiServer, name: str) -> list[list[str]]:
    np = stored(api, NP_RESOURCE, name) or {}
    return [[m["profile"] for m in g["mig"]] for g in (np.get("spec") or {}).get("gpus") or []]


@pytest.mark.looptime
async def test_a_warm_7g_is_kept_ready_beside_the_running_pod(
    kmock: ApiServer, tmp_path: Path
) -> None:
    await setup(kmock)
    for n in ("n1", "n2"):
        resp = await kmock.post("/api/v1/nodes", json=two_gpu_node(n))
        assert resp.status in (200, 201), await resp.text()
    async with gating_operator(kmock, tmp_path, warm_slice_share=0.05) as controller:
        await eventually(lambda: stored(kmock, NP_RESOURCE, "n2"), within=10)
        resp = await kmock.post(PODS, json=pod("p1"))
        assert resp.status in (200, 201), await resp.text()
        r = await eventually(lambda: reservation(kmock, "p1"), within=40)
        await agent_applies(kmock, r.node)
        await kubelet_advertises(kmock, r.node, {SEVEN_G: 1})
        await eventually(lambda: not get_pod(kmock, "p1")["spec"].get("schedulingGates"), 10)
        warm = "gpuslice_warm_slices_total"
        assert sorted(profiles(kmock, r.node)) == [[], ["7g.80gb"]]
        assert controller.metrics.registry.get_sample_value(warm) == 0  # p1 still waits
        await bind_like_scheduler(kmock, "default", "p1", r.node)

        await eventually(lambda: profiles(kmock, r.node) == [["7g.80gb"], ["7g.80gb"]], 20)
        other = "n2" if r.node == "n1" else "n1"
        assert all(not gpu for gpu in profiles(kmock, other))  # the idle node stays whole
        # the step counts its warm slice after all its writes: wait for the count as well
        await eventually(lambda: controller.metrics.registry.get_sample_value(warm) == 1, 5)
        await asyncio.sleep(30)  # the node applies nothing: no second warm spec meanwhile
        assert controller.metrics.registry.get_sample_value(warm) == 1
