"""The pynvml adapter, driven through a fake ``pynvml`` module backed by the fake NVML.

The fake module keeps pynvml's real constants, structs and exception classes, returns what the
real binding returns (its ctypes structs, ``str`` for text: pynvml's ``convertStrBytes`` and
``_PrintableStructure`` decode bytes), takes arrays and counts by ``ctypes.byref`` like the C
library, and checks the call contract of facts/mig.md: GI creation only with an explicit
``c_nvmlGpuInstancePlacement_t`` passed by reference, the full-size compute-instance profile
with the SHARED engine, CI destroyed before its GI.  ``tests/test_pynvml_binding.py`` keeps its
names and signatures in line with the real ``pynvml``.
"""

from __future__ import annotations

import asyncio
import ctypes
from typing import Any

import pynvml
import pytest

from contract.nodepartitioning import NodePartitioningSpec
from node_agent.gpu_reset import NvidiaSmi
from node_agent.mps import FakeSupervisor
from node_agent.nvml import ComputeMode, NvmlError, NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from node_agent.nvml_pynvml import PynvmlAdapter
from node_agent.reconciler import Reconciler
from planner.catalog import default_catalog

CAT = default_catalog()


def _raise(e: NvmlError) -> None:
    raise pynvml.NVMLError(int(e.code)) from e


class FakePynvml:
    """Just enough of the pynvml module, over a FakeNvml."""

    NVMLError = pynvml.NVMLError
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError
    c_nvmlGpuInstance_t = ctypes.py_object
    c_nvmlComputeInstance_t = ctypes.py_object
    c_nvmlGpuInstancePlacement_t = pynvml.c_nvmlGpuInstancePlacement_t

    def __init__(self, nv: FakeNvml) -> None:
        self.nv = nv
        self.log: list[str] = []
        for name in dir(pynvml):
            if name.startswith(
                (
                    "NVML_DEVICE_MIG",
                    "NVML_GPU_INSTANCE_PROFILE",
                    "NVML_COMPUTE_INSTANCE",
                    "NVML_COMPUTEMODE",
                    "NVML_FEATURE_",
                )
            ):
                setattr(self, name, getattr(pynvml, name))

    def _do(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except NvmlError as e:
            _raise(e)

    def nvmlInit(self) -> None:
        self.log.append("init")

    def nvmlShutdown(self) -> None:
        self.log.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.nv.gpus())

    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any:
        return ("gpu", i)

    def nvmlDeviceGetIndex(self, h: Any) -> int:
        return int(h[1])

    def _info(self, h: Any) -> Any:
        return self.nv.gpus()[h[1]]

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        info = self._info(h)
        pci = pynvml.nvmlPciInfo_t()  # what nvmlDeviceGetPciInfo_v3 returns
        pci.pciDeviceId = (int(info.pci_device_id, 16) << 16) | 0x10DE
        pci.busId = info.pci_bus_id  # a char array, read back as str (_PrintableStructure)
        return pci

    def nvmlDeviceGetPersistenceMode(self, h: Any) -> int:
        on = self.nv.persistence_mode(h[1])
        return int(pynvml.NVML_FEATURE_ENABLED if on else pynvml.NVML_FEATURE_DISABLED)

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        name = self.nv.process_name(pid)
        if not name:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return name  # str: the binding's convertStrBytes decodes the C string

    def nvmlDeviceGetMemoryInfo(self, h: Any, version: Any = None) -> Any:
        return pynvml.c_nvmlMemory_t(total=self._info(h).memory_mib * 1024 * 1024)

    def nvmlDeviceGetMigMode(self, h: Any) -> list[int]:
        info = self._info(h)
        if not info.mig_capable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [int(info.mig_enabled), int(info.mig_target)]

    def nvmlDeviceSetMigMode(self, h: Any, mode: int) -> int:
        assert mode in (pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE)
        status = self._do(self.nv.set_mig_mode, h[1], mode == pynvml.NVML_DEVICE_MIG_ENABLE)
        return pynvml.NVML_SUCCESS if status is None else int(status)  # an nvmlReturn_t

    def nvmlDeviceGetComputeMode(self, h: Any) -> int:
        return int(self._info(h).compute_mode)

    def nvmlDeviceSetComputeMode(self, h: Any, mode: int) -> None:
        assert isinstance(mode, int) and 0 <= mode < pynvml.NVML_COMPUTEMODE_COUNT
        self.log.append(f"compute mode {mode}")
        self._do(self.nv.set_compute_mode, h[1], ComputeMode(mode))

    def nvmlDeviceGetName(self, h: Any) -> str:
        return str(self._info(h).name)  # str: convertStrBytes

    def nvmlDeviceGetUUID(self, h: Any) -> str:
        if h[0] == "gpu":
            return str(self._info(h).uuid)
        return str(h[4])

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: Any, idx: int, version: int = 2) -> Any:
        model = self.nv.model_of(h[1])
        assert version == 2, "the adapter reads the v2 struct"
        if not self.nv.mig_enabled(h[1]):  # nvml.h: NOT_SUPPORTED while MIG mode is off
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        for p in model.profiles:
            if p.nvml_index == idx:
                info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
                info.id, info.instanceCount, info.sliceCount = p.profile_id, p.max_count, p.compute
                return info
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetGpuInstances(self, h: Any, profile_id: int, arr: Any, count_ref: Any) -> int:
        gis = [g for g in self._do(self.nv.gpu_instances, h[1]) if g.profile_id == profile_id]
        assert len(gis) <= len(arr), "array too small for the profile's instance count"
        for k, g in enumerate(gis):
            arr[k] = ("gi", h[1], g.gi_id)
        count_ref._obj.value = len(gis)
        return 0

    def nvmlGpuInstanceGetInfo(self, gi: Any) -> Any:
        g = next(x for x in self.nv.gpu_instances(gi[1]) if x.gi_id == gi[2])
        return pynvml.c_nvmlGpuInstanceInfo_t(
            id=g.gi_id,
            profileId=g.profile_id,
            placement=pynvml.c_nvmlGpuInstancePlacement_t(g.start, g.size),
        )

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, h: Any, profile_id: int, ref: Any) -> Any:
        placement = ref._obj  # passed with ctypes.byref, as the C API expects
        assert isinstance(placement, pynvml.c_nvmlGpuInstancePlacement_t)
        self.log.append(f"create GI {profile_id} @({placement.start},{placement.size})")
        gi_id = self._do(
            self.nv.create_gpu_instance, h[1], profile_id, placement.start, placement.size
        )
        return ("gi", h[1], gi_id)

    def _gi_compute(self, gi: Any) -> int:
        g = next(x for x in self.nv.gpu_instances(gi[1]) if x.gi_id == gi[2])
        return self.nv.model_of(gi[1]).profile_by_id(g.profile_id).compute

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gi: Any, idx: int, eng: int, version: int = 2
    ) -> Any:
        assert eng == pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        slices = {v: int(k.split("_")[-2]) for k, v in vars(pynvml).items()
                  if k.startswith("NVML_COMPUTE_INSTANCE_PROFILE_") and k.endswith("_SLICE")}  # fmt: skip
        if idx not in slices or slices[idx] > self._gi_compute(gi):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id, info.sliceCount, info.instanceCount = 100 + idx, slices[idx], 1
        return info

    def nvmlGpuInstanceCreateComputeInstance(self, gi: Any, ci_profile_id: int) -> Any:
        full = {
            v: k for k, v in vars(pynvml).items() if k.startswith("NVML_COMPUTE_INSTANCE_PROFILE_")
        }
        name = full[ci_profile_id - 100]
        assert name.endswith(f"_{self._gi_compute(gi)}_SLICE"), f"not full-size: {name}"
        self.log.append(f"create CI on GI {gi[2]}")
        return ("ci", gi[1], gi[2], self._do(self.nv.create_compute_instance, gi[1], gi[2]))

    def nvmlGpuInstanceGetComputeInstances(
        self, gi: Any, ci_profile_id: int, arr: Any, count_ref: Any
    ) -> int:
        g = next(x for x in self.nv.gpu_instances(gi[1]) if x.gi_id == gi[2])
        full = {
            v: k for k, v in vars(pynvml).items() if k.startswith("NVML_COMPUTE_INSTANCE_PROFILE_")
        }
        is_full = full[ci_profile_id - 100].endswith(f"_{self._gi_compute(gi)}_SLICE")
        cis = list(g.compute_instances) if is_full else []
        for k, c in enumerate(cis):
            arr[k] = ("ci", gi[1], gi[2], c)
        count_ref._obj.value = len(cis)
        return 0

    def nvmlComputeInstanceGetInfo(self, ci: Any) -> Any:
        return pynvml.c_nvmlComputeInstanceInfo_t(id=ci[3])

    def nvmlComputeInstanceDestroy(self, ci: Any) -> int:
        self.log.append(f"destroy CI on GI {ci[2]}")
        self._do(self.nv.destroy_compute_instance, ci[1], ci[2], ci[3])
        return 0

    def nvmlGpuInstanceDestroy(self, gi: Any) -> int:
        self.log.append(f"destroy GI {gi[2]}")
        self._do(self.nv.destroy_gpu_instance, gi[1], gi[2])
        return 0

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, k: int) -> Any:
        devs = self.nv.mig_devices(h[1])
        if k >= len(devs):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        d = devs[k]
        return ("mig", h[1], d.gi_id, d.ci_id, d.uuid)

    def nvmlDeviceGetGpuInstanceId(self, mh: Any) -> int:
        return int(mh[2])

    def nvmlDeviceGetComputeInstanceId(self, mh: Any) -> int:
        return int(mh[3])

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        pids = self.nv.running_processes(h[1], h[2] if h[0] == "mig" else None)
        # as nvmlDeviceGetComputeRunningProcesses_v3: friendly objects of c_nvmlProcessInfo_t
        return [pynvml.nvmlStructToFriendlyObject(pynvml.c_nvmlProcessInfo_t(pid=p)) for p in pids]


class NoPods:
    """In-use source of a node without pods."""

    async def in_use_device_ids(self) -> set[str]:
        return set()


SPEC_7G = NodePartitioningSpec.model_validate(
    {"mode": "mig", "gpus": [{"index": 0, "mig": [{"profile": "7g.80gb", "start": 0}]}]}
)


def make(
    *models: str, mig: bool = False, passthrough: bool = False
) -> tuple[FakeNvml, FakePynvml, PynvmlAdapter]:
    """The adapter over the fake pynvml; its nvidia-smi is the fake NVML's emulated tool
    (``passthrough``: a pass-through VM, where an Ampere MIG-mode change is RESET_REQUIRED)."""
    nv = FakeNvml([CAT.model(m) for m in models], mig_enabled=mig, passthrough=passthrough)
    mod = FakePynvml(nv)
    return nv, mod, PynvmlAdapter(mod, NvidiaSmi(nv.nvidia_smi))  # type: ignore[arg-type]


def test_gpu_listing_reads_pci_id_memory_and_mig_mode() -> None:
    nv, mod, ad = make("A100-SXM4-80GB", "V100-32GB")
    gpus = ad.gpus()
    assert [(g.pci_device_id, g.memory_mib, g.mig_capable) for g in gpus] == [
        ("20B2", 81920, True),
        ("1DB5", 32768, False),
    ]
    assert gpus[0].uuid == nv.gpus()[0].uuid and gpus[0].name == "NVIDIA A100-SXM4-80GB"
    assert mod.log == ["init"]
    ad.close()
    assert mod.log[-1] == "shutdown"


def test_create_with_explicit_placement_and_full_size_shared_ci() -> None:
    nv, mod, ad = make("A100-SXM4-80GB", mig=True)
    p3 = CAT.model("A100-SXM4-80GB").profile("3g.40gb")
    gi = ad.create_gpu_instance(0, p3.profile_id, 4, 4)
    ci = ad.create_compute_instance(0, gi)
    assert mod.log[1:] == [f"create GI {p3.profile_id} @(4,4)", f"create CI on GI {gi}"]
    [info] = ad.gpu_instances(0)
    assert (info.gi_id, info.profile_id, info.start, info.size) == (gi, p3.profile_id, 4, 4)
    assert info.compute_instances == (ci,)
    [dev] = ad.mig_devices(0)
    assert (dev.gi_id, dev.ci_id) == (gi, ci) and dev.uuid == nv.uuid_of(0, gi, ci)


def test_driver_errors_map_to_the_same_codes() -> None:
    nv, _, ad = make("A100-SXM4-80GB", mig=True)
    p3 = CAT.model("A100-SXM4-80GB").profile("3g.40gb")
    gi = ad.create_gpu_instance(0, p3.profile_id, 0, 4)
    with pytest.raises(NvmlError) as e:
        ad.create_gpu_instance(0, p3.profile_id, 0, 4)
    assert e.value.code == NvmlErrorCode.INSUFFICIENT_RESOURCES
    ci = ad.create_compute_instance(0, gi)
    pid = nv.start_process(0, gi, ci)
    assert ad.running_processes(0, gi) == [pid] and ad.running_processes(0, 99) == []
    with pytest.raises(NvmlError) as e:
        ad.destroy_compute_instance(0, gi, ci)
    assert e.value.code == NvmlErrorCode.IN_USE
    with pytest.raises(NvmlError) as e:
        ad.destroy_gpu_instance(0, gi)
    assert e.value.code == NvmlErrorCode.IN_USE
    with pytest.raises(NvmlError) as e:
        ad.set_mig_mode(0, False)
    assert e.value.code == NvmlErrorCode.IN_USE
    assert NvmlErrorCode.of(12345) == NvmlErrorCode.UNKNOWN


def test_a_failed_compute_instance_query_is_an_error_not_an_idle_instance() -> None:
    """nvmlGpuInstanceGetComputeInstanceProfileInfo answers NOT_SUPPORTED / INVALID_ARGUMENT
    for a profile the GI cannot hold (skipped); any other error (GPU lost, no permission) was
    swallowed too, the GI listed with no compute instance -- idle to the reconciler, which then
    tried to destroy it under its processes.  It is an error of the GPU now."""
    _, mod, ad = make("A100-SXM4-80GB", mig=True)
    p3 = CAT.model("A100-SXM4-80GB").profile("3g.40gb")
    gi = ad.create_gpu_instance(0, p3.profile_id, 0, 4)
    ci = ad.create_compute_instance(0, gi)
    assert [g.compute_instances for g in ad.gpu_instances(0)] == [(ci,)]
    for code in (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_NO_PERMISSION):

        def broken(*_: Any, c: int = code) -> Any:
            raise pynvml.NVMLError(c)

        mod.nvmlGpuInstanceGetComputeInstanceProfileInfo = broken
        with pytest.raises(NvmlError) as e:
            ad.gpu_instances(0)
        assert e.value.code == NvmlErrorCode.of(code)


def test_mig_mode_reads_current_and_pending_and_maps_the_activation_status() -> None:
    _, mod, ad = make("A100-SXM4-80GB", "H100-80GB", passthrough=True)
    assert [(g.mig_enabled, g.pending_mig_enabled) for g in ad.gpus()] == [(False, False)] * 2
    assert ad.set_mig_mode(0, True) == NvmlErrorCode.RESET_REQUIRED  # Ampere in a VM: pending
    assert ad.set_mig_mode(1, True) is None  # Hopper: NVML_SUCCESS, active now
    a100, h100 = ad.gpus()
    assert (a100.mig_enabled, a100.pending_mig_enabled, a100.mig_pending) == (False, True, True)
    assert (h100.mig_enabled, h100.mig_pending) == (True, False)
    # nvidia-ml-py has no GPU reset call: the adapter runs the host driver's nvidia-smi -r
    assert not [n for n in dir(pynvml) if n in ("nvmlDeviceReset", "nvmlDeviceResetGpu")]
    assert a100.pci_bus_id == "00000000:07:00.0"
    ad.reset_gpu(0)
    assert mod.log == ["init", "shutdown", "init"]  # NVML let go of the GPU for the reset
    assert ad.gpus()[0].mig_enabled and not ad.gpus()[0].mig_pending


def test_reset_without_nvidia_smi_is_not_supported_and_nvml_is_back() -> None:
    nv, mod, ad = make("A100-SXM4-80GB", passthrough=True)
    ad.set_mig_mode(0, True)
    nv.tool_present = False
    with pytest.raises(NvmlError) as e:
        ad.reset_gpu(0)
    assert e.value.code == NvmlErrorCode.NOT_SUPPORTED and e.value.op == "reset_gpu"
    assert "NVIDIA_DRIVER_CAPABILITIES=utility" in str(e.value)
    assert mod.log[-1] == "init" and ad.gpus()[0].mig_pending


def test_nvml_that_does_not_come_back_after_a_reset_keeps_the_reset_error_and_retries() -> None:
    """nvmlInit failing after the reset replaced the reset's error (NOT_SUPPORTED, whose remedy
    names nvidia-smi, became DRIVER_NOT_LOADED) and NVML stayed down: every later call answered
    UNINITIALIZED until the agent restarted.  The reset's error is raised, and the next call
    initialises NVML again."""
    nv, mod, ad = make("A100-SXM4-80GB", passthrough=True)
    ad.set_mig_mode(0, True)
    nv.tool_present = False
    fails = [True]
    init = mod.nvmlInit

    def flaky_init() -> None:
        if fails[0]:
            fails[0] = False
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        init()

    mod.nvmlInit = flaky_init
    with pytest.raises(NvmlError) as e:
        ad.reset_gpu(0)
    assert e.value.code == NvmlErrorCode.NOT_SUPPORTED and "nvidia-smi" in str(e.value)
    assert mod.log[-1] == "shutdown"  # NVML is down now
    assert ad.gpus()[0].mig_pending  # the next call brought it back
    assert mod.log[-1] == "init"


def test_profiles_read_with_mig_off_are_read_again_once_mig_mode_is_on() -> None:
    nv, _, ad = make("H100-80GB")
    assert ad.gpu_instances(0) == []  # MIG off: no profile answers
    assert ad.set_mig_mode(0, True) is None and nv.mig_enabled(0)  # Hopper: current at once
    p3 = CAT.model("H100-80GB").profile("3g.40gb")
    gi = ad.create_gpu_instance(0, p3.profile_id, 0, p3.memory_slices)
    assert [g.gi_id for g in ad.gpu_instances(0)] == [gi]
    ci = ad.create_compute_instance(0, gi)
    assert [g.compute_instances for g in ad.gpu_instances(0)] == [(ci,)]


def test_process_names_come_from_nvml() -> None:
    nv, _, ad = make("V100-32GB")
    pid = nv.start_process(0, name="python3")
    assert ad.running_processes(0) == [pid]
    assert ad.process_name(pid) == "python3" and ad.process_name(99999) == ""


def test_reconciler_over_the_adapter_resets_the_ampere_gpu_itself() -> None:
    """The finding: in production the pending mode never completed (reset NOT_SUPPORTED)."""
    nv, _, ad = make("A100-SXM4-80GB")
    nv.set_persistence_mode(0, True)

    rec = Reconciler(ad, NoPods(), FakeSupervisor(), CAT)
    spec = SPEC_7G
    res = asyncio.run(rec.reconcile(spec, 1))
    assert res.applied and [(p.name, s) for p, s, _ in nv.layout(0)] == [("7g.80gb", 0)]
    assert nv.mig_enabled(0) and not nv.mig_pending(0) and nv.persistence_mode(0)


def test_reconciler_over_the_adapter_reports_a_pending_mig_mode_until_the_gpu_is_reset() -> None:
    nv, _, ad = make("A100-SXM4-80GB", passthrough=True)
    nv.tool_present = False  # no nvidia-smi in the agent's container

    rec = Reconciler(ad, NoPods(), FakeSupervisor(), CAT)
    spec = SPEC_7G
    for _ in range(2):  # every pass retries; the request itself is made once
        res = asyncio.run(rec.reconcile(spec, 1))
        applied, degraded = res.status.conditions
        assert (applied.status, applied.reason) == ("False", "Degraded")
        assert (degraded.status, degraded.reason) == ("True", "MIGModePending")
        assert "(nvidia-smi -r -i 00000000:07:00.0) or reboot the node" in degraded.message
        assert res.settled and not res.status.gpus[0].migEnabled and nv.layout(0) == []
    assert res.operations == 0 and nv.mig_pending(0)
    nv.tool_present = True  # the operator fixes the DaemonSet
    res = asyncio.run(rec.reconcile(spec, 1))
    assert res.applied and [(p.name, s) for p, s, _ in nv.layout(0)] == [("7g.80gb", 0)]


def test_reconciler_over_the_adapter_destroys_ci_before_gi_and_applies() -> None:
    nv, mod, ad = make("A100-SXM4-80GB", mig=True)

    rec = Reconciler(ad, NoPods(), FakeSupervisor(), CAT)
    spec = NodePartitioningSpec.model_validate(
        {"mode": "mig", "gpus": [{"index": 0, "mig": [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]}]}
    )  # fmt: skip
    assert asyncio.run(rec.reconcile(spec, 1)).applied
    assert sorted((p.name, s) for p, s, _ in nv.layout(0)) == [("3g.40gb", 0), ("3g.40gb", 4)]
    mod.log.clear()
    assert asyncio.run(rec.reconcile(SPEC_7G, 2)).applied
    destroys = [x for x in mod.log if x.startswith("destroy")]
    assert len(destroys) == 4
    for k in (0, 2):  # each instance: its CI, then its GI
        assert destroys[k].startswith("destroy CI") and destroys[k + 1].startswith("destroy GI")
        assert destroys[k].split()[-1] == destroys[k + 1].split()[-1]


def test_compute_mode_is_read_and_set_with_nvml_constants() -> None:
    nv, mod, ad = make("A100-SXM4-80GB", "V100-32GB")
    assert [g.compute_mode for g in ad.gpus()] == [ComputeMode.DEFAULT, ComputeMode.DEFAULT]
    ad.set_compute_mode(1, ComputeMode.EXCLUSIVE_PROCESS)
    assert mod.log[-1] == f"compute mode {pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS}"
    assert nv.compute_mode(1) == ComputeMode.EXCLUSIVE_PROCESS
    assert [g.compute_mode for g in ad.gpus()] == [
        ComputeMode.DEFAULT,
        ComputeMode.EXCLUSIVE_PROCESS,
    ]
    assert {m.name: int(m) for m in ComputeMode} == {
        n.removeprefix("NVML_COMPUTEMODE_"): v
        for n, v in vars(pynvml).items()
        if n.startswith("NVML_COMPUTEMODE_") and n != "NVML_COMPUTEMODE_COUNT"
    }
    nv.inject("set_compute_mode", NvmlErrorCode.NO_PERMISSION)
    with pytest.raises(NvmlError) as e:
        ad.set_compute_mode(0, ComputeMode.EXCLUSIVE_PROCESS)
    assert e.value.code == NvmlErrorCode.NO_PERMISSION and e.value.op == "set_compute_mode"


def test_mps_over_the_adapter_sets_exclusive_process_before_the_daemon() -> None:
    nv, mod, ad = make("A30")

    sup = FakeSupervisor(nvml=nv)
    rec = Reconciler(ad, NoPods(), sup, CAT)
    spec = NodePartitioningSpec.model_validate(
        {"mode": "mps", "gpus": [{"index": 0, "mps": [{"memoryMiB": 4096, "activeThreadPercentage": 25}]}]}
    )  # fmt: skip
    assert asyncio.run(rec.reconcile(spec, 1)).applied
    assert f"compute mode {pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS}" in mod.log
    assert sup.running() == {"gpu0"}


def test_running_processes_on_a_driver_without_the_v3_symbol_is_an_nvml_error() -> None:
    """pynvml's ``@throwOnVersionMismatch`` raises ``NVMLLibraryMismatchError`` (no NVMLError)."""

    class OldDriver(FakePynvml):
        @pynvml.throwOnVersionMismatch
        def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # no _v3 in the lib

    nv = FakeNvml([CAT.model("V100-32GB")])
    ad = PynvmlAdapter(OldDriver(nv))  # type: ignore[arg-type]
    with pytest.raises(NvmlError) as e:
        ad.running_processes(0)
    assert e.value.code == NvmlErrorCode.FUNCTION_NOT_FOUND and e.value.op == "running_processes"


def test_mig_device_indices_answering_invalid_argument_are_empty() -> None:
    """NVIDIA's go-nvlib skips both NOT_FOUND and INVALID_ARGUMENT from
    ``nvmlDeviceGetMigDeviceHandleByIndex``; so does the adapter (any other error raises)."""
    codes = {0: pynvml.NVML_ERROR_INVALID_ARGUMENT}

    class Sparse(FakePynvml):
        def nvmlDeviceGetMaxMigDeviceCount(self, h: Any) -> int:
            return 1 + super().nvmlDeviceGetMaxMigDeviceCount(h)

        def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, k: int) -> Any:
            if k in codes:
                raise pynvml.NVMLError(codes[k])
            return super().nvmlDeviceGetMigDeviceHandleByIndex(h, k - 1)

    nv = FakeNvml([CAT.model("A100-SXM4-80GB")], mig_enabled=True)
    ad = PynvmlAdapter(Sparse(nv), NvidiaSmi(nv.nvidia_smi))  # type: ignore[arg-type]
    gi = ad.create_gpu_instance(0, CAT.model("A100-SXM4-80GB").profile("7g.80gb").profile_id, 0, 8)
    ci = ad.create_compute_instance(0, gi)
    assert [(d.gi_id, d.ci_id) for d in ad.mig_devices(0)] == [(gi, ci)]
    codes[0] = pynvml.NVML_ERROR_NO_PERMISSION
    with pytest.raises(NvmlError) as e:
        ad.mig_devices(0)
    assert e.value.code == NvmlErrorCode.NO_PERMISSION
