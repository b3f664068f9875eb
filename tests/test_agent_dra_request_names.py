"""NodePrepareResources answers each device with the requests it serves by their base names.

Model: a claim allocated through ``firstAvailable`` has results whose request is
``<request>/<subrequest>`` (``gpu/small``).  The kubelet gives a container the CDI devices of
the devices whose ``request_names`` contain the request the container names in
``resources.claims[].request`` -- which names no subrequest -- compared exactly (kubelet
``cdiDevicesAsList``); the Go kubelet-plugin helper strips subrequest names
(``BaseRequestRef``).  So the driver answers ``gpu``, each name once per device, each device
once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from node_agent.dra_checkpoint import Checkpoint
from node_agent.dra_prepare import DraPreparer
from node_agent.dra_slices import DRIVER, device_name
from node_agent.draplugin import DraKubeletPlugin
from node_agent.nvml_fake import FakeNvml
from node_agent.proto import dra_v1_pb2 as dra
from planner.catalog import default_catalog

CAT = default_catalog()
H100 = CAT.model("H100-80GB")
NODE = "node-a"
SMALL = device_name(0, H100.profile("1g.10gb"), 0)
SMALL2 = device_name(0, H100.profile("1g.10gb"), 1)
BIG = device_name(1, H100.profile("3g.40gb"), 4)


def result(request: str, device: str, **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": NODE, "device": device, **extra}


class Claims:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}

    def put(self, name: str, *results: dict[str, Any]) -> dra.Claim:
        self.objects[name] = {
            "metadata": {"namespace": "team", "name": name, "uid": f"uid-{name}"},
            "status": {"allocation": {"devices": {"results": list(results)}}},
        }
        return dra.Claim(namespace="team", name=name, uid=f"uid-{name}")

    async def read(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return self.objects.get(name)


def plugin(tmp_path: Path, claims: Claims) -> DraKubeletPlugin:
    prep = DraPreparer(
        FakeNvml([H100, H100]),
        CAT,
        node=NODE,
        checkpoint=Checkpoint(tmp_path / "dra.json"),
        cdi_dir=tmp_path / "cdi",
    )
    return DraKubeletPlugin(prep, claims)


def cdi_for(reply: dra.NodePrepareResourceResponse, request: str) -> list[str]:
    """What the kubelet gives a container naming ``request`` (kubelet cdiDevicesAsList)."""
    return [
        c
        for d in reply.devices
        if not d.request_names or request in d.request_names
        for c in d.cdi_device_ids
    ]


async def prepare(p: DraKubeletPlugin, claim: dra.Claim) -> dra.NodePrepareResourceResponse:
    reply = (await p.prepare(dra.NodePrepareResourcesRequest(claims=[claim]))).claims[claim.uid]
    assert reply.error == ""
    return reply


async def test_a_subrequest_result_answers_its_base_request(tmp_path: Path) -> None:
    claims = Claims()
    p = plugin(tmp_path, claims)
    c = claims.put(
        "c1", result("gpu/small", SMALL), result("gpu/small", SMALL2), result("aux", BIG)
    )
    for _ in range(2):  # prepared, then answered again from the record
        reply = await prepare(p, c)
        names = {d.device_name: list(d.request_names) for d in reply.devices}
        assert names == {SMALL: ["gpu"], SMALL2: ["gpu"], BIG: ["aux"]}
        assert len(cdi_for(reply, "gpu")) == 2
        assert len(cdi_for(reply, "aux")) == 1


async def test_a_device_two_results_name_is_answered_once(tmp_path: Path) -> None:
    """Two admin-access requests of one claim may name one device (admin access is no
    allocation): one device answered, each base name once, one CDI device in the spec."""
    claims = Claims()
    p = plugin(tmp_path, claims)
    owner = claims.put("owner", result("gpu", SMALL))
    await prepare(p, owner)
    c = claims.put(
        "watch",
        result("look", SMALL, adminAccess=True),
        result("peek/any", SMALL, adminAccess=True),
    )
    reply = await prepare(p, c)
    assert [(d.device_name, list(d.request_names)) for d in reply.devices] == [
        (SMALL, ["look", "peek"])
    ]
    assert cdi_for(reply, "look") == cdi_for(reply, "peek") == list(reply.devices[0].cdi_device_ids)
    spec = next((tmp_path / "cdi").glob("*uid-watch*"))
    assert spec.read_text().count('"name"') == 1
