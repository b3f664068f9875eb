"""Planner-shaped publishing and ``adminAccess``: an admin result holds nothing.

kube-scheduler does not count an ``adminAccess`` result as an allocation (dra.md): an admin
claim may inspect a device another claim holds, and an ordinary claim may be allocated a
device an admin claim inspects.  The agent must read it the same way: the inspected device is
not reported used (the partitioner would never promise it) and does not keep a placement the
plan dropped published (kube-scheduler could allocate that unplanned placement to an ordinary
claim) or standing in the way of the planned one.
"""

from __future__ import annotations

import asyncio
from typing import Any

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.agent import InMemorySpecSource
from node_agent.dra_checkpoint import Checkpoint
from node_agent.dra_claims import AllocatedDevice, ClaimRef
from node_agent.dra_driver import DraDriver
from node_agent.dra_prepare import DraPreparer
from node_agent.dra_shape import claim_devices
from node_agent.dra_slices import DRIVER, DraGpu, device_name
from node_agent.draplugin import DraKubeletPlugin
from node_agent.nvml_fake import FakeNvml
from planner.catalog import default_catalog

CAT = default_catalog()
H100 = CAT.model("H100-80GB")
NODE = "n1"
P3_0 = device_name(0, H100.profile("3g.40gb"), 0)
P4_0 = device_name(0, H100.profile("4g.40gb"), 0)


def _result(device: str, admin: bool) -> dict[str, Any]:
    return {
        "request": "gpu",
        "driver": DRIVER,
        "pool": NODE,
        "device": device,
        "adminAccess": admin,
    }


def _claim(name: str, *results: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ops", "name": name, "uid": f"u-{name}"},
        "status": {"allocation": {"devices": {"results": list(results)}}},
    }


def test_claim_devices_leaves_admin_results_out() -> None:
    claims = [_claim("inspect", _result(P3_0, True)), _claim("job", _result(P4_0, False))]
    assert claim_devices(claims, NODE) == {P4_0}


class _Claims:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    async def allocated(self) -> set[str]:
        return claim_devices(self.items, NODE)


class _Publisher:
    def __init__(self, gpus: list[DraGpu]) -> None:
        self.gpus, self.node, self.last = gpus, NODE, set[str]()

    async def publish(self, want: Any, taints: Any = None) -> bool:
        self.last = set(want)
        return True


def _spec(*layout: tuple[str, int]) -> NodePartitioningSpec:
    return NodePartitioningSpec.model_validate(
        {
            "planId": "p",
            "mode": "mig",
            "gpus": [{"index": 0, "mig": [{"profile": p, "start": s} for p, s in layout]}],
        }
    )


def test_an_inspected_placement_is_not_used_and_gives_way_to_the_plan(tmp_path: Any) -> None:
    async def run() -> None:
        nv = FakeNvml([H100])
        prep = DraPreparer(nv, CAT, node=NODE, checkpoint=Checkpoint(None))
        plugin = DraKubeletPlugin(prep, None, registry_dir=str(tmp_path), plugin_dir=str(tmp_path))
        plugin.registered = True  # as by the kubelet: an unregistered plugin publishes nothing
        src = InMemorySpecSource(NODE, _spec(("3g.40gb", 0), ("3g.40gb", 4)))
        claims, pub = _Claims(), _Publisher([DraGpu(0, nv.gpu_uuid(0), H100)])
        drv = DraDriver(plugin, pub, spec_source=src, claims=claims)  # type: ignore[arg-type]
        assert await drv.publish_once()
        claims.items.append(_claim("inspect", _result(P3_0, True)))
        prep.prepare(
            ClaimRef("ops", "inspect", "u-inspect"),
            [AllocatedDevice("gpu", NODE, P3_0, admin_access=True)],
        )
        assert await drv.publish_once()
        assert src.obj is not None and src.obj.status is not None
        used = {(m.profile, m.start): m.used for m in src.obj.status.gpus[0].mig}
        assert used[("3g.40gb", 0)] is False  # inspected, held by no one
        src.set_spec(_spec(("4g.40gb", 0), ("3g.40gb", 4)))  # the partitioner re-plans GPU 0
        assert await drv.publish_once()
        assert P3_0 not in pub.last and P4_0 in pub.last
        assert [(p.name, s) for p, s, _ in nv.layout(0)] == [("4g.40gb", 0), ("3g.40gb", 4)]

    asyncio.run(run())
