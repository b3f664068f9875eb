"""gpuslice's DRA devices take no parameters: an opaque config addressed to its driver that
applies to one of the claim's requests fails the claim's prepare with the fix (remove it from
the claim or its DeviceClass), as drivers refuse a config they cannot decode
(shared/facts/dra.md section 1); it was ignored, the claim prepared as if it had none.  A config
for another driver, or for another request of the claim, changes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from node_agent.dra_claims import ClaimError, ClaimRef, allocated_devices
from node_agent.dra_slices import DRIVER

NODE = "n1"
DEV = "gpu0-3g-40gb-s4"
REF = ClaimRef("ns", "c", "u1")


def claim(*configs: dict[str, Any]) -> dict[str, Any]:
    results = [
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": DEV},
        {"request": "nic", "driver": "net.example.com", "pool": NODE, "device": "eth1"},
    ]
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": "u1"},
        "status": {"allocation": {"devices": {"results": results, "config": list(configs)}}},
    }


def opaque(driver: str, requests: list[str] | None = None, source: str = "FromClaim") -> Any:
    cfg: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": {}}}
    if requests is not None:
        cfg["requests"] = requests
    return cfg


def test_a_config_for_gpuslice_is_refused_with_the_fix() -> None:
    for cfg, where in (
        (opaque(DRIVER), "the claim"),
        (opaque(DRIVER, ["gpu"]), "the claim"),
        (opaque(DRIVER, source="FromClass"), "its DeviceClass"),
    ):
        with pytest.raises(ClaimError, match=f"take no parameters: remove the config from {where}"):
            allocated_devices(claim(cfg), REF, NODE, [DEV])


def test_other_drivers_and_other_requests_change_nothing() -> None:
    for cfg in (opaque("net.example.com"), opaque(DRIVER, ["nic"])):
        (d,) = allocated_devices(claim(cfg), REF, NODE, [DEV])
        assert d.device == DEV
