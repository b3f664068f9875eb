"""The DRA kubelet plugin over real gRPC on unix sockets, against a fake kubelet that uses the
stubs generated from the kubelet's own pluginregistration v1 and DRA v1 .proto files
(tests/fake_dra_kubelet.py), with MIG claims prepared on the fake NVML.

Checked: registration (GetInfo, NotifyRegistrationStatus, a refusal recorded, a vanished
socket served again and registered again); prepare of MIG claims (instances at their
placements, CDI IDs of the claim, one answer per claim even when others fail); idempotent
prepare; unknown, recreated and unallocated claims; a claim of this driver allocated on
another node; unprepare (in use, then released; unknown claims succeed); a kubelet restart and
an agent restart in between.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from fake_dra_kubelet import FakeDraKubelet
from fake_kubelet import eventually

from node_agent.cdi import spec_path
from node_agent.dra_checkpoint import Checkpoint
from node_agent.dra_prepare import DraPreparer
from node_agent.dra_slices import DRIVER, device_name
from node_agent.draplugin import DRA_SERVICE, DraKubeletPlugin
from node_agent.nvml_fake import FakeNvml
from planner.catalog import default_catalog

CAT = default_catalog()
H100 = CAT.model("H100-80GB")
NODE = "gpu-node-1"


def placement(gpu: int, profile: str, start: int) -> str:
    return device_name(gpu, H100.profile(profile), start)


class Claims:
    """The API's ResourceClaims, as a dict (namespace, name) -> object."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.reads = 0

    def put(
        self,
        name: str,
        uid: str,
        *devices: tuple[str, str],
        namespace: str = "team",
        pool: str = NODE,
        allocated: bool = True,
    ) -> tuple[str, str, str]:
        results = [
            {"request": req, "driver": DRIVER, "pool": pool, "device": d} for req, d in devices
        ]
        results.append({"request": "nic", "driver": "net.example.com", "pool": NODE, "device": "x"})
        obj: dict[str, Any] = {"metadata": {"namespace": namespace, "name": name, "uid": uid}}
        if allocated:
            obj["status"] = {"allocation": {"devices": {"results": results}}}
        self.objects[(namespace, name)] = obj
        return namespace, name, uid

    async def read(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        self.reads += 1
        return self.objects.get((namespace, name))


@pytest.fixture
def dirs() -> Iterator[tuple[str, str, str]]:
    # unix socket paths are limited to 107 bytes: keep the temp dir short
    with tempfile.TemporaryDirectory(prefix="gsdra-", dir="/tmp") as tmp:
        dirs = tuple(os.path.join(tmp, d) for d in ("registry", "plugins", "state"))
        for d in dirs:
            os.makedirs(d)
        yield dirs  # type: ignore[misc]


class Node:
    def __init__(self, dirs: tuple[str, str, str], nv: FakeNvml, claims: Claims) -> None:
        self.registry, self.plugins, self.state = dirs
        self.nv = nv
        self.claims = claims
        self.registered = 0
        self.plugin = self._plugin()
        self.kubelet = FakeDraKubelet(self.registry)

    def _plugin(self) -> DraKubeletPlugin:
        prep = DraPreparer(
            self.nv,
            CAT,
            node=NODE,
            checkpoint=Checkpoint(os.path.join(self.state, "dra.json")),
            cdi_dir=os.path.join(self.state, "cdi"),
        )
        prep.clean_unknown()

        def on_registered() -> None:
            self.registered += 1

        return DraKubeletPlugin(
            prep,
            self.claims,
            registry_dir=self.registry,
            plugin_dir=self.plugins,
            on_registered=on_registered,
            poll_interval_s=0.05,
        )

    async def restart_agent(self) -> None:
        await self.plugin.stop()
        self.plugin = self._plugin()
        await self.plugin.start()


@pytest.fixture
async def node(dirs: tuple[str, str, str]) -> AsyncIterator[Node]:
    n = Node(dirs, FakeNvml([H100, H100]), Claims())
    await n.plugin.start()
    await n.kubelet.scan()
    yield n
    await n.kubelet.close()
    await n.plugin.stop()


async def test_registration(node: Node) -> None:
    (info,) = node.kubelet.infos
    assert info.type == "DRAPlugin" and info.name == DRIVER
    assert info.endpoint == os.path.join(node.plugins, DRIVER, "dra.sock")
    assert list(info.supported_versions) == [DRA_SERVICE, "v1beta1.DRAPlugin"]
    assert os.path.basename(node.plugin.registration_socket) == f"{DRIVER}-reg.sock"
    assert node.kubelet.plugins[DRIVER].service == "v1.DRAPlugin"
    assert node.plugin.registered and node.registered == 1 and node.plugin.error == ""


async def test_a_refused_registration_is_recorded(dirs: tuple[str, str, str]) -> None:
    n = Node(dirs, FakeNvml([H100]), Claims())
    await n.plugin.start()
    try:
        # a kubelet that knows neither v1 nor v1beta1 (v1beta1 is served too: review5)
        old = FakeDraKubelet(n.registry, known_services=("v1alpha4.DRAPlugin",))
        await old.scan()
        assert not n.plugin.registered and "supported versions" in n.plugin.error
        assert n.registered == 0 and DRIVER not in old.plugins
    finally:
        await n.plugin.stop()


async def test_prepare_mig_claims_and_answer_every_claim(node: Node) -> None:
    a = node.claims.put("train", "uid-a", ("gpu", placement(1, "3g.40gb", 4)))
    b = node.claims.put("infer", "uid-b", ("small", placement(1, "1g.10gb", 0)), ("gpu", "gpu0"))
    gone = ("team", "deleted", "uid-gone")
    reply = await node.kubelet.prepare(DRIVER, a, b, gone)
    assert reply["uid-a"].error == "" and reply["uid-b"].error == ""
    assert "was not found" in reply["uid-gone"].error
    (d,) = reply["uid-a"].devices
    assert (list(d.request_names), d.pool_name, d.device_name) == (["gpu"], NODE, "gpu1-3g-40gb-s4")
    assert list(d.cdi_device_ids) == [f"{DRIVER}/claim=uid-a-gpu1-3g-40gb-s4"]
    assert not d.HasField("share_id")
    assert {x.device_name for x in reply["uid-b"].devices} == {"gpu0", "gpu1-1g-10gb-s0"}
    assert not node.nv.mig_enabled(0)
    assert {(p.name, s) for p, s, _ in node.nv.layout(1)} == {("3g.40gb", 4), ("1g.10gb", 0)}
    spec = json.loads(spec_path(os.path.join(node.state, "cdi"), "uid-a").read_text())
    (uuid,) = [u for u, (g, _, _) in node.nv.mig_uuids().items() if g == 1 and u in str(spec)]
    assert spec["devices"][0]["containerEdits"]["env"] == [f"NVIDIA_VISIBLE_DEVICES={uuid}"]


async def test_prepare_is_idempotent(node: Node) -> None:
    a = node.claims.put("train", "uid-a", ("gpu", placement(0, "7g.80gb", 0)))
    first = await node.kubelet.prepare(DRIVER, a)
    uuids = set(node.nv.mig_uuids())
    again = await node.kubelet.prepare(DRIVER, a)
    assert again["uid-a"] == first["uid-a"]
    assert set(node.nv.mig_uuids()) == uuids


async def test_claims_that_cannot_be_prepared(node: Node) -> None:
    recreated = node.claims.put("train", "uid-new", ("gpu", "gpu0"))
    unallocated = node.claims.put("wait", "uid-w", allocated=False)
    elsewhere = node.claims.put("far", "uid-f", ("gpu", "gpu0"), pool="gpu-node-2")
    unknown = node.claims.put("odd", "uid-o", ("gpu", "gpu7-1g-10gb-s0"))
    reply = await node.kubelet.prepare(
        DRIVER, ("team", "train", "uid-old"), unallocated, elsewhere, unknown
    )
    assert "deleted and recreated" in reply["uid-old"].error
    assert "is not allocated" in reply["uid-w"].error
    assert "not this node's pool" in reply["uid-f"].error
    assert "not a device of this node" in reply["uid-o"].error
    assert node.nv.mig_uuids() == {} and not node.nv.mig_enabled(0)
    assert recreated  # the claim under that name exists, with another uid


async def test_unprepare_waits_for_the_pod_and_unknown_claims_succeed(node: Node) -> None:
    a = node.claims.put("train", "uid-a", ("gpu", placement(0, "2g.20gb", 4)))
    assert len((await node.kubelet.prepare(DRIVER, a))["uid-a"].devices) == 1
    (uuid,) = node.nv.mig_uuids()
    pid = node.nv.start_process(*node.nv.mig_uuids()[uuid])
    reply = await node.kubelet.unprepare(DRIVER, a, ("team", "never", "uid-never"))
    assert "still runs processes" in reply["uid-a"].error and reply["uid-never"].error == ""
    assert set(node.nv.mig_uuids()) == {uuid}
    node.nv.stop_process(pid)
    del node.claims.objects[("team", "train")]  # the claim may be gone by now
    reply = await node.kubelet.unprepare(DRIVER, a)
    assert reply["uid-a"].error == "" and node.nv.mig_uuids() == {}
    assert not spec_path(os.path.join(node.state, "cdi"), "uid-a").exists()


async def test_kubelet_restart_then_agent_restart(node: Node) -> None:
    a = node.claims.put("train", "uid-a", ("gpu", placement(1, "4g.40gb", 0)))
    first = (await node.kubelet.prepare(DRIVER, a))["uid-a"]
    await node.kubelet.restart()
    assert DRIVER in node.kubelet.plugins and node.registered == 2
    assert (await node.kubelet.prepare(DRIVER, a))["uid-a"] == first
    await node.restart_agent()
    await node.kubelet.restart()
    assert node.registered == 3 and node.plugin.registered
    assert (await node.kubelet.prepare(DRIVER, a))["uid-a"] == first
    assert len(node.nv.mig_uuids()) == 1
    assert (await node.kubelet.unprepare(DRIVER, a))["uid-a"].error == ""
    assert node.nv.mig_uuids() == {}


async def test_a_vanished_socket_is_served_again(node: Node) -> None:
    os.unlink(node.plugin.registration_socket)
    os.unlink(node.plugin.dra_socket)
    await eventually(
        lambda: (
            os.path.exists(node.plugin.registration_socket)
            and os.path.exists(node.plugin.dra_socket)
        ),
        timeout=30,
        what="sockets served again",
    )
    assert not node.plugin.registered
    await node.kubelet.restart()
    assert node.plugin.registered and node.registered == 2
    a = node.claims.put("train", "uid-a", ("gpu", "gpu1"))
    assert (await node.kubelet.prepare(DRIVER, a))["uid-a"].error == ""


def test_checkpoint_path_is_the_state_dir(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path / "x" / "dra.json")
    from node_agent.dra_checkpoint import ClaimRecord

    cp.put(ClaimRecord("n", "c", "u", "started"))
    assert json.loads((tmp_path / "x" / "dra.json").read_text())["claims"][0]["uid"] == "u"


def test_dra_mode_refuses_the_fake_and_one_shot_flags(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuslice.cli import main

    monkeypatch.setenv("GPUSLICE_METRICS_PORT", "0")
    for argv in (["agent", "--dra", "--fake"], ["agent", "--dra", "--once"]):
        assert main(argv) == 2
        assert "DRA mode serves the kubelet" in capsys.readouterr().err
    monkeypatch.setenv("GPUSLICE_DRA", "true")
    assert main(["agent", "--fake"]) == 2


def test_dra_mode_without_nvml_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pynvml

    from gpuslice.cli import main

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:  # a GPU machine: the agent would start for real
        pynvml.nvmlShutdown()
        pytest.skip("NVML works here")
    monkeypatch.setenv("GPUSLICE_METRICS_PORT", "0")
    monkeypatch.setenv("GPUSLICE_NODE_NAME", "n1")
    assert main(["agent", "--dra"]) == 2
    assert "NVML is not usable" in capsys.readouterr().err


async def test_a_file_that_cannot_be_written_fails_that_claim_only(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CDI spec of one claim cannot be written (a full or read-only disk): the whole
    NodePrepareResources call failed at gRPC level (the other claim voided, no failure
    recorded, the instance made for the claim left on the GPU).  Now that claim's error says
    so, what its prepare made is rolled back, and the other claim is prepared."""
    import errno

    import node_agent.dra_prepare as dp

    real = dp.write_spec

    def full(cdi_dir: Any, uid: str, spec: Any, driver: str = DRIVER) -> Any:
        if uid == "uid-a":
            raise OSError(errno.ENOSPC, "No space left on device", str(cdi_dir))
        return real(cdi_dir, uid, spec, driver)

    monkeypatch.setattr(dp, "write_spec", full)
    a = node.claims.put("a", "uid-a", ("gpu", placement(0, "3g.40gb", 4)))
    b = node.claims.put("b", "uid-b", ("gpu", placement(0, "3g.40gb", 0)))
    reply = await node.kubelet.prepare(DRIVER, a, b)
    assert "No space left on device" in reply["uid-a"].error and not reply["uid-b"].error
    assert len(node.plugin.failures) == 1
    assert [(p.name, s) for p, s, _ in node.nv.layout(0)] == [("3g.40gb", 0)]  # a's rolled back
