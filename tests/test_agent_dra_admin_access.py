"""adminAccess results: the device as it is, never owned, created, destroyed or conflicting.

Model (node_agent.dra_prepare, "adminAccess"): kube-scheduler does not count an ``adminAccess``
result as allocated, so it gives an admin claim a device another claim holds and an ordinary
claim a device an admin claim has.  The driver gives an admin result the existing MIG device
(or the whole GPU) as it is: the owner keeps it, an ordinary claim prepared after the admin one
creates or adopts the instance as usual, nothing is made for the admin claim (no instance:
that claim's error), and its unprepare drops its record and CDI spec only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from node_agent.dra_checkpoint import Checkpoint
from node_agent.dra_claims import ClaimRef, allocated_devices
from node_agent.dra_prepare import DraPreparer
from node_agent.dra_slices import DRIVER, device_name
from node_agent.draplugin import DraKubeletPlugin
from node_agent.nvml import XidEvent
from node_agent.nvml_fake import FakeNvml
from node_agent.proto import dra_v1_pb2 as dra
from planner.catalog import default_catalog

CAT = default_catalog()
H100 = CAT.model("H100-80GB")
NODE = "node-a"
THREE = H100.profile("3g.40gb")
DEV = device_name(0, THREE, 4)
OVERLAP = device_name(0, H100.profile("4g.40gb"), 0)


class Claims:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}

    def put(self, name: str, device: str = DEV, *, admin: bool = False) -> dra.Claim:
        r: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
        if admin:
            r["adminAccess"] = True
        ns = "ops" if admin else "team"
        self.objects[name] = {
            "metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}"},
            "status": {"allocation": {"devices": {"results": [r]}}},
        }
        return dra.Claim(namespace=ns, name=name, uid=f"uid-{name}")

    async def read(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return self.objects.get(name)


class Node:
    def __init__(self, tmp_path: Path, nv: FakeNvml | None = None) -> None:
        self.nv = nv or FakeNvml([H100])
        self.claims = Claims()
        self.dir = tmp_path
        self.plugin = self._plugin()

    def _plugin(self) -> DraKubeletPlugin:
        prep = DraPreparer(
            self.nv,
            CAT,
            node=NODE,
            checkpoint=Checkpoint(self.dir / "dra.json"),
            cdi_dir=self.dir / "cdi",
        )
        prep.clean_unknown()
        return DraKubeletPlugin(prep, self.claims)

    async def prepare(self, claim: dra.Claim) -> str | list[str]:
        """The claim's error, else the device UUIDs its CDI spec gives."""
        reply = await self.plugin.prepare(dra.NodePrepareResourcesRequest(claims=[claim]))
        r = reply.claims[claim.uid]
        if r.error:
            return r.error
        return [self.visible(claim.uid)]

    async def ok(self, claim: dra.Claim) -> str:
        """Prepare ``claim``, which must succeed; the device UUID its CDI spec gives."""
        got = await self.prepare(claim)
        assert isinstance(got, list), got
        return got[0]

    async def unprepare(self, claim: dra.Claim) -> str:
        reply = await self.plugin.unprepare(dra.NodeUnprepareResourcesRequest(claims=[claim]))
        return reply.claims[claim.uid].error

    def visible(self, uid: str) -> str:
        spec = json.loads(next((self.dir / "cdi").glob(f"*{uid}*")).read_text())
        env = spec["devices"][0]["containerEdits"]["env"]
        return str(env[0].split("=", 1)[1])

    def has_spec(self, uid: str) -> bool:
        return any((self.dir / "cdi").glob(f"*{uid}*"))

    def layout(self) -> list[tuple[str, int]]:
        return [(p.name, s) for p, s, _ in self.nv.layout(0)]


def test_the_claim_reader_keeps_the_flag() -> None:
    claims = Claims()
    claims.put("c", admin=True)
    ref = ClaimRef("ops", "c", "uid-c")
    (a,) = allocated_devices(claims.objects["c"], ref, NODE, [DEV])
    assert a.admin_access
    claims.put("d")
    (b,) = allocated_devices(claims.objects["d"], ClaimRef("team", "d", "uid-d"), NODE, [DEV])
    assert not b.admin_access


async def test_admin_access_to_a_prepared_device_shares_it(tmp_path: Path) -> None:
    node = Node(tmp_path)
    owner, admin = node.claims.put("c1"), node.claims.put("c2", admin=True)
    uuid = await node.ok(owner)
    gi = next(gi for gi, _, _, _ in node.nv.instances(0))
    pid = node.nv.start_process(0, gi, 0)  # the owner's pod runs
    assert await node.prepare(admin) == [uuid]  # the owner's MIG device, as it is
    assert await node.prepare(admin) == [uuid]  # idempotent
    recs = node.plugin.preparer.prepared()
    assert [d.admin_access for d in recs["uid-c2"].devices] == [True]
    assert await node.unprepare(admin) == ""  # waits for no process, destroys nothing
    assert not node.has_spec("uid-c2") and "uid-c2" not in node.plugin.preparer.prepared()
    assert node.layout() == [("3g.40gb", 4)]
    assert node.visible("uid-c1") == uuid
    node.nv.stop_process(pid)
    assert await node.unprepare(owner) == ""
    assert node.layout() == []


async def test_admin_access_first_creates_nothing_and_blocks_nobody(tmp_path: Path) -> None:
    node = Node(tmp_path)
    admin, ordinary = node.claims.put("c2", admin=True), node.claims.put("c3")
    error = await node.prepare(admin)
    assert isinstance(error, str) and "adminAccess" in error and "3g.40gb at 4" in error
    assert not node.nv.mig_enabled(0) and node.layout() == []  # nothing switched or made
    assert "uid-c2" not in node.plugin.preparer.prepared() and not node.has_spec("uid-c2")
    uuid = await node.ok(ordinary)  # the device the scheduler sees free
    assert await node.prepare(admin) == [uuid]  # the kubelet's retry finds it now
    # prepared the other way round: the admin claim first, on an instance nobody owns
    assert await node.unprepare(ordinary) == ""
    assert await node.unprepare(admin) == ""
    node.nv.set_mig_mode(0, True)
    gi = node.nv.create_gpu_instance(0, THREE.profile_id, 4, THREE.memory_slices)
    node.nv.create_compute_instance(0, gi)
    idle = node.nv.uuid_of(0, gi)
    assert await node.prepare(admin) == [idle]
    assert await node.prepare(ordinary) == [idle]  # adopted: the admin claim owns nothing
    assert node.layout() == [("3g.40gb", 4)]
    # a placement overlapping an instance only an admin claim has is made as usual
    other = node.claims.put("c4", OVERLAP)
    assert await node.unprepare(ordinary) == ""
    assert isinstance(await node.prepare(other), list)
    assert node.layout() == [("4g.40gb", 0)]


async def test_admin_access_to_a_whole_gpu_switches_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path)
    owner = node.claims.put("c1")
    await node.prepare(owner)
    whole = node.claims.put("c2", device_name(0), admin=True)
    assert await node.prepare(whole) == [node.nv.gpu_uuid(0)]
    assert node.nv.mig_enabled(0) and node.layout() == [("3g.40gb", 4)]
    assert await node.unprepare(whole) == ""
    assert node.layout() == [("3g.40gb", 4)]


async def test_an_admin_claim_survives_restarts_and_an_xid(tmp_path: Path) -> None:
    node = Node(tmp_path)
    owner, admin = node.claims.put("c1"), node.claims.put("c2", admin=True)
    uuid = await node.ok(owner)
    assert await node.prepare(admin) == [uuid]
    raw = json.loads((tmp_path / "dra.json").read_text())
    flags = {c["uid"]: [d.get("admin_access") for d in c["devices"]] for c in raw["claims"]}
    assert flags == {"uid-c1": [None], "uid-c2": [True]}  # written only when true
    node.plugin = node._plugin()  # agent restart: the record is read back, nothing destroyed
    assert node.layout() == [("3g.40gb", 4)]
    gi = next(gi for gi, _, _, _ in node.nv.instances(0))
    node.plugin.preparer.mark_xids([XidEvent(0, 48, gi_id=gi, ci_id=0)])
    node.plugin.preparer.checkpoint.drop("uid-c2")
    assert await node.prepare(admin) == [uuid]  # an XID does not refuse admin access
    node.nv.reboot()  # the instance is gone: admin access does not make it again
    error = await node.prepare(admin)
    assert isinstance(error, str) and "adminAccess" in error
    assert node.layout() == []
