"""The read-only catalog probe (node_agent.catalog_probe) over a fake ``pynvml`` module.

The fake answers from a catalog model as a driver would (ids, slice counts, names with NVIDIA's
``MIG `` prefix, possible placements through a ctypes array and count), and each test bends one
answer to check that exactly that difference is reported.  The fake also refuses every call that
would change the GPU, so a probe that tried one would fail here.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from node_agent import catalog_probe
from node_agent.catalog_probe import (
    MEMORY_TOLERANCE_MIB,
    ProbedGpu,
    ProbedProfile,
    check,
    compare,
    match_model,
    probe,
    report,
)
from planner.catalog import GpuModel, default_catalog

CAT = default_catalog()


@dataclass
class Gpu:
    model: GpuModel
    pci: str = ""
    mig_capable: bool = True
    starts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """nvml index -> starts the 'driver' reports instead of the catalog's."""
    missing: set[int] = field(default_factory=set)
    extra: dict[int, tuple[int, str]] = field(default_factory=dict)
    """nvml index -> (profile id, name) the driver offers beyond the catalog."""
    refuse_info: int | None = None
    """An NVML error code every profile-info call returns (a driver that wants MIG mode on)."""
    mig_on: bool = False


class FakeDriver:
    """The pynvml calls the probe makes; any other attribute access fails the test."""

    NVMLError = pynvml.NVMLError
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_GPU_INSTANCE_PROFILE_COUNT = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    c_nvmlGpuInstancePlacement_t = pynvml.c_nvmlGpuInstancePlacement_t

    def __init__(self, *gpus: Gpu) -> None:
        self.gpus = gpus
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the probe called {name}, which it must not")

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Gpu:
        return self.gpus[i]

    def nvmlDeviceGetName(self, g: Gpu) -> str:  # str, as nvidia-ml-py's convertStrBytes
        return f"NVIDIA {g.model.name}"

    def nvmlDeviceGetPciInfo(self, g: Gpu) -> Any:
        pci = g.pci or g.model.pci_device_ids[0]
        return SimpleNamespace(pciDeviceId=(int(pci, 16) << 16) | 0x10DE)

    def nvmlDeviceGetMemoryInfo(self, g: Gpu) -> Any:
        return SimpleNamespace(total=g.model.memory_mib * 1024 * 1024)

    def nvmlDeviceGetMigMode(self, g: Gpu) -> list[int]:
        if not g.mig_capable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [int(g.mig_on), int(g.mig_on)]

    def _profile(self, g: Gpu, idx: int) -> tuple[int, str, int, int, int, tuple[int, ...]]:
        if idx in g.extra:
            pid, name = g.extra[idx]
            return pid, name, 1, 1, 1, (0,)
        for p in g.model.profiles:
            if p.nvml_index == idx and idx not in g.missing:
                starts = g.starts.get(idx, p.starts)
                return p.profile_id, p.name, p.compute, p.max_count, p.memory_slices, starts
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, g: Gpu, idx: int, version: int = 2) -> Any:
        assert version == 2, "the v2 struct carries the profile's name"
        if g.refuse_info is not None:
            raise pynvml.NVMLError(g.refuse_info)
        pid, name, compute, count, _, _ = self._profile(g, idx)
        mem = next((p.memory_mib for p in g.model.profiles if p.profile_id == pid), 1024)
        return SimpleNamespace(
            id=pid,
            name=f"MIG {name}".encode(),
            sliceCount=compute,
            instanceCount=count,
            memorySizeMB=mem,
        )

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, g: Gpu, profile_id: int, arr: Any, count_ref: Any
    ) -> int:
        extra = [i for i, (pid, _) in g.extra.items() if pid == profile_id]
        idx = extra[0] if extra else g.model.profile_by_id(profile_id).nvml_index
        *_, size, starts = self._profile(g, idx)
        assert len(starts) <= len(arr), "placement array too small"
        for k, s in enumerate(starts):
            arr[k] = pynvml.c_nvmlGpuInstancePlacement_t(s, size)
        count_ref._obj.value = len(starts)
        return 0


def _one(g: Gpu) -> tuple[ProbedGpu, list[str]]:
    drv = FakeDriver(g)
    [probed] = probe(drv)  # type: ignore[arg-type]
    assert drv.calls == ["init", "shutdown"]
    return probed, compare(match_model(CAT, probed), probed)


@pytest.mark.parametrize("name", [m.name for m in CAT.models if m.mig_capable])
def test_a_driver_that_answers_like_the_catalog_agrees_for_every_mig_model(name: str) -> None:
    model = CAT.model(name)
    probed, diffs = _one(Gpu(model))
    assert diffs == []
    assert match_model(CAT, probed) is model
    assert sorted(p.nvml_index for p in probed.profiles) == sorted(
        p.nvml_index for p in model.profiles
    )
    starts = {q.nvml_index: tuple(s for s, _ in q.placements) for q in probed.profiles}
    assert starts == {p.nvml_index: p.starts for p in model.profiles}


def test_different_starts_are_reported_with_both_lists() -> None:
    model = CAT.model("H200-141GB")
    three_g = model.profile_by_shape("3g")
    _, diffs = _one(Gpu(model, starts={three_g.nvml_index: (0, 2, 4)}))
    assert diffs == [
        f"GPU 0 (NVIDIA H200-141GB, PCI {model.pci_device_ids[0]}) profile {three_g.name}: "
        f"starts [0, 2, 4] (catalog {list(three_g.starts)})"
    ]


def test_a_missing_and_an_extra_profile_are_both_reported() -> None:
    model = CAT.model("A100-SXM4-80GB")
    me = model.profile_by_shape("1g+me")
    _, diffs = _one(Gpu(model, missing={me.nvml_index}, extra={15: (99, "1g.10gb+me.all")}))
    assert len(diffs) == 2
    assert f"catalog profile {me.name} (index {me.nvml_index}) is not supported" in diffs[0]
    assert "offers profile 1g.10gb+me.all (index 15, id 99)" in diffs[1]


def test_an_unknown_gpu_and_a_wrong_mig_claim_are_differences() -> None:
    v100 = CAT.model("V100-32GB")
    _, diffs = _one(Gpu(v100, pci="FFFF", mig_capable=False))  # matched by its name
    assert diffs == []
    _, diffs = _one(Gpu(v100, mig_capable=True, extra={0: (19, "1g.4gb")}))
    assert diffs and "lists none" in diffs[0]
    a100 = CAT.model("A100-SXM4-80GB")
    _, diffs = _one(Gpu(a100, mig_capable=False))
    assert diffs and "MIG is not supported" in diffs[0]


def test_refused_profile_queries_are_unverified_not_differences() -> None:
    model = CAT.model("H100-SXM5-80GB")
    drv = FakeDriver(Gpu(model, refuse_info=pynvml.NVML_ERROR_NO_PERMISSION))
    doc = report(CAT, probe(drv))  # type: ignore[arg-type]
    [g] = doc["gpus"]
    assert doc["agree"] is True and g["differences"] == []
    assert len(g["unverified"]) == pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    assert g["catalogModel"] == model.name


def test_mig_mode_off_and_no_profile_answered_is_unverified_not_every_profile_missing() -> None:
    # nvml.h: profile info answers NOT_SUPPORTED "if device doesn't have MIG mode enabled".
    model = CAT.model("A100-SXM4-40GB")
    off = Gpu(model, refuse_info=pynvml.NVML_ERROR_NOT_SUPPORTED)
    doc = report(CAT, probe(FakeDriver(off)))  # type: ignore[arg-type]
    [g] = doc["gpus"]
    assert doc["agree"] is True and g["differences"] == []
    assert len(g["unverified"]) == 1 and "MIG mode is off" in g["unverified"][0]
    # With MIG mode on the same silence means the driver lacks every profile.
    on = Gpu(model, refuse_info=pynvml.NVML_ERROR_NOT_SUPPORTED, mig_on=True)
    doc = report(CAT, probe(FakeDriver(on)))  # type: ignore[arg-type]
    [g] = doc["gpus"]
    assert doc["agree"] is False and g["unverified"] == []
    assert len(g["differences"]) == len(model.profiles)
    # A driver that answers with MIG off is compared as before.
    _, diffs = _one(Gpu(model, missing={model.profile_by_shape("2g").nvml_index}))
    assert len(diffs) == 1 and "2g.10gb" in diffs[0]


def test_main_prints_json_and_exits_by_agreement(capsys: pytest.CaptureFixture[str]) -> None:
    model = CAT.model("A100-SXM4-40GB")
    assert catalog_probe.main([], nvml=FakeDriver(Gpu(model))) == 0  # type: ignore[arg-type]
    doc = json.loads(capsys.readouterr().out)
    assert doc["agree"] is True and doc["gpus"][0]["catalogModel"] == model.name
    bent = Gpu(model, starts={model.profile_by_shape("2g").nvml_index: (0, 2)})
    assert catalog_probe.main([], nvml=FakeDriver(bent)) == 1  # type: ignore[arg-type]
    assert json.loads(capsys.readouterr().out)["agree"] is False


def test_no_driver_is_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    class Broken:
        NVMLError = pynvml.NVMLError

        def nvmlInit(self) -> None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    assert catalog_probe.main([], nvml=Broken()) == 2  # type: ignore[arg-type]
    assert "NVML unavailable" in capsys.readouterr().err


def test_the_placement_array_is_large_enough_for_every_catalog_profile() -> None:
    for model in CAT.models:
        for p in model.profiles:
            n = max(p.max_count, 1) * 8
            assert len(p.starts) <= n, (model.name, p.name)
    assert ctypes.sizeof(pynvml.c_nvmlGpuInstancePlacement_t) == 8


HARDWARE = Path(__file__).parent / "fixtures" / "hardware"


@pytest.mark.parametrize("capture", sorted(HARDWARE.glob("*.probe.json")), ids=lambda p: p.name)
def test_the_catalog_agrees_with_every_real_capture(capture: Path) -> None:
    """Probes of real GPUs (the device check in docs/operations.md) stay true of the catalog."""
    doc = json.loads(capture.read_text())
    for entry in doc["gpus"]:
        raw = dict(entry["gpu"])
        profiles = [
            ProbedProfile(**(p | {"placements": [tuple(x) for x in p["placements"]]}))
            for p in raw.pop("profiles")
        ]
        gpu = ProbedGpu(**raw, profiles=profiles)
        model = match_model(CAT, gpu)
        assert model is not None and model.name == entry["catalogModel"]
        assert profiles and all(p.placements for p in profiles), "a capture with placements"
        assert compare(model, gpu) == []
        assert model.placements_captured
        # drivers move a profile's memory by a few MiB between releases (the H100's 1g.20gb:
        # 20,091 MiB in the catalog, 20,096 on 580.159.04); compare() allows MEMORY_TOLERANCE_MIB
        off = {
            p.name: p.memory_mib - model.profile(p.name).memory_mib
            for p in profiles
            if p.memory_mib is not None
        }
        assert all(abs(d) <= MEMORY_TOLERANCE_MIB for d in off.values()), off


def test_an_older_binding_still_probes_the_profiles_the_catalog_knows() -> None:
    """nvidia-ml-py 12.535 (pyproject's lower bound) counts 0xA GPU-instance profiles: the
    RTX PRO ``+gfx`` ones at 0xA and 0xB were never asked, and the check reported them
    missing on a GPU that has them."""
    model = CAT.model("RTX-PRO-6000-Blackwell")
    assert max(p.nvml_index for p in model.profiles) >= 0xA
    drv = FakeDriver(Gpu(model))
    drv.NVML_GPU_INSTANCE_PROFILE_COUNT = 0xA  # type: ignore[misc]
    with_catalog = 1 + max(p.nvml_index for m in CAT.models for p in m.profiles)
    [probed] = probe(drv, with_catalog)  # type: ignore[arg-type]
    assert compare(model, probed) == []
    [old] = probe(drv)  # type: ignore[arg-type]  # the binding's count alone: what it was
    assert any("+gfx" in d for d in compare(model, old))
    assert check(CAT, drv) == 0  # type: ignore[arg-type]  # the command asks the catalog's
